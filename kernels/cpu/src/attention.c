/* Causal attention of query rows over a paged K/V pool, in float32.

   Every query vector (a row's head) gets its scores, its softmax and its weighted sum of values in one fixed
   order of its own (per score: eight FMA lanes over the head dimension, then one fixed sum of the lanes; the
   softmax and the values in key order), so a row's result does not depend on what else is in the batch or on
   how its prompt was chunked: batch invariance without float64.

   With AVX2 and a head size that is a multiple of 8, one task takes a block of consecutive rows of one sequence
   (a prompt chunk's rows, or a decode row alone) times the query heads of one kv head (GQA), and converts each
   key and value once for all of them; only the loop nest differs from doing the vectors one by one, never the
   arithmetic of one vector. A block of one row (a decode row) takes the row path instead: the same arithmetic per
   vector, bit for bit, in a loop nest for one row (no padding vector, several keys per vector at once), with its K
   and V rows fetched ahead, and one task per key segment over all the row's kv heads (the pool rows read whole
   and in order) when there are at least as many such row segments as threads. Elsewhere each (row, kv head) is a
   task of its own.

   A row's keys are split at fixed positions, every KEY_SEGMENT keys: each segment gets its own softmax and
   weighed values (its max, its sum, its values), and the segments are combined in order (combine_segments), so a
   deep row is several tasks the pool runs in parallel (a lone decode row at depth 4,000 is 8 tasks, one per
   segment over its kv heads) and its bits still depend only on its own keys. A row of at most KEY_SEGMENT keys is one segment
   and gets exactly the bits it got before the split. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "half.h"
#include "kv_q8.h" /* the pool formats: KV_F32, KV_BF16, KV_F16 (the q8_0 pools are attention_q8.c's) */
#include "pool.h"
#if defined(QMM_AVX2)
#include <immintrin.h>
#endif

/* a row of D values as float32: from float32, bfloat16 (bf16 1) or float16 (bf16 KV_F16) */
static inline void load_row(const void *base, int bf16, int64_t index, int D, float *out) {
    if (bf16 == KV_F16) {
        const uint16_t *p = (const uint16_t *)base + index * D;
        for (int d = 0; d < D; d++) out[d] = f16_to_f32(p[d]);
    } else if (bf16) {
        const uint16_t *p = (const uint16_t *)base + index * D;
        for (int d = 0; d < D; d++) out[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(out, (const float *)base + index * D, sizeof(float) * D);
    }
}

/* eight partial sums in a fixed order: vectorizes without reassociating anything */
static inline float dot(const float *a, const float *b, int D) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[d + l] * b[d + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

#if defined(QMM_AVX2)
/* dot() of a float32 row with a bfloat16 row, converting as it goes: the same eight lanes, products and final sum
   order as dot() over the converted row */
static inline float dot_bf16(const float *a, const uint16_t *b, int D) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + d))), 16);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_castsi256_ps(w), acc);
    }
    float l[8];
    _mm256_storeu_ps(l, acc);
    float s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
    for (; d < D; d++) s += a[d] * bf16_to_f32(b[d]);
    return s;
}
#endif

typedef struct {
    const void *q, *k, *v;
    void *out;
    int q_bf16, kv_bf16, H, Hkv, D, block_size;
    const int32_t *tables, *row_seq, *row_len;
    int64_t table_stride;
    float scale;
    const int32_t *row_lo; /* row t's keys start at position row_lo[t] (a sliding window), or NULL: at 0 */
    const float *sinks;    /* per query head, a logit added to the softmax's denominator with no value, or NULL */
} attn_t;

/* the first key position of row t */
static inline int row_start(const attn_t *a, int t) { return a->row_lo ? a->row_lo[t] : 0; }

/* a K or V row as float32: the pool's own memory when it is float32, else converted into buf */
static inline const float *kv_row(const void *base, int bf16, int64_t index, int D, float *buf) {
    if (!bf16) return (const float *)base + index * D;
    load_row(base, bf16, index, D, buf);
    return buf;
}

/* s[j] = exp(s[j] - max) / sum over j < L, summed in key order (the order every caller has always had); the max and
   the sum go to *mx_out and *sum_out (-inf and 0 when L is 0) */
static void softmax(float *s, int L, float *mx_out, float *sum_out) {
    float mx = -INFINITY, sum = 0.0f;
    for (int j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
    for (int j = 0; j < L; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    float inv = 1.0f / sum;
    for (int j = 0; j < L; j++) s[j] *= inv;
    *mx_out = mx;
    *sum_out = sum;
}

/* keys per segment: a row's keys are split at multiples of this, whatever the batch or chunking */
enum { KEY_SEGMENT = 512 };
/* a segment's partial (max, sum, values) that saw no keys */
#define EMPTY_SEGMENT(p) ((p)[0] == -INFINITY && (p)[1] == 0.0f)

static inline float seg_exp(float x);

/* One vector's attention from its key segments k < nseg, each given as (max score m, sum of exp(score - m), the
   values weighed by that segment's own softmax, D floats) at part + k * stride: exp(m_k - M) * sum_k over the
   segments in order gives each segment's weight (M the largest m of a segment with keys), and the output is the
   segments' values times weight / total, summed in segment order. A segment without keys (m -inf, sum 0) adds
   nothing; a single segment gives its values unchanged (its weight / total is exactly 1). One compiled copy, so
   the per-row and blocked paths round alike. */
static __attribute__((noinline)) void combine_segments(const float *part, int64_t stride, int nseg, int D,
                                                       float *out, float *max_out, float *total_out) {
    float M = -INFINITY, total = 0.0f;
    for (int k = 0; k < nseg; k++) M = part[k * stride] > M ? part[k * stride] : M;
    for (int k = 0; k < nseg; k++)
        if (!EMPTY_SEGMENT(part + k * stride)) total += seg_exp(part[k * stride] - M) * part[k * stride + 1];
    int first = 1;
    memset(out, 0, sizeof(float) * D);
    for (int k = 0; k < nseg; k++) {
        const float *p = part + k * stride;
        if (EMPTY_SEGMENT(p)) continue;
        const float c = seg_exp(p[0] - M) * p[1] / total;
        if (first)
            for (int d = 0; d < D; d++) out[d] = c * p[2 + d];
        else
            for (int d = 0; d < D; d++) out[d] += c * p[2 + d];
        first = 0;
    }
    *max_out = M;
    *total_out = total;
}

/* combine_segments() for the other attention kernels (attention_q8.c) */
void qmm_attn_combine(const float *part, int64_t stride, int nseg, int D, float *out, float *max_out,
                      float *total_out) {
    combine_segments(part, stride, nseg, D, out, max_out, total_out);
}

/* a float32 vector of D into the output (bf16 when out_bf16) at element index */
static inline void store_out(void *out, int out_bf16, int64_t index, const float *x, int D) {
    if (out_bf16) {
        uint16_t *o = (uint16_t *)out + index;
        for (int d = 0; d < D; d++) o[d] = f32_to_bf16(x[d]);
    } else {
        memcpy((float *)out + index, x, sizeof(float) * D);
    }
}

/* store_out() of head `head`'s vector x (D floats, overwritten) whose softmax had max score M and sum of
   exp(score - M) total: with sinks, first scaled by total / (total + exp(sink - M)), which is what adding the
   sink's logit to the softmax's denominator does to every weight (the sink has no value). */
static inline void store_head(const attn_t *a, int64_t index, int head, float *x, float M, float total) {
    if (a->sinks) {
        const float w = total / (total + seg_exp(a->sinks[head] - M));
        for (int d = 0; d < a->D; d++) x[d] *= w;
    }
    store_out(a->out, a->q_bf16, index, x, a->D);
}

/* The per-row path: row t times kv head kvh, its keys segment by segment (KEY_SEGMENT keys, fixed boundaries),
   each segment's softmax and weighed values in key order, then combine_segments(). */
static void attend_task(void *ctx, int task) {
    const attn_t *a = (const attn_t *)ctx;
    const int group = a->H / a->Hkv, t = task / a->Hkv, kvh = task % a->Hkv, D = a->D, bs = a->block_size;
    const int L = a->row_len[t], nseg = L > 0 ? (L + KEY_SEGMENT - 1) / KEY_SEGMENT : 1;
    const int64_t stride = D + 2; /* one segment's partial: max, sum, D values */
    const int32_t *table = a->tables + (int64_t)a->row_seq[t] * a->table_stride;
    const int lo = row_start(a, t);
    const int SL = L < KEY_SEGMENT ? L : KEY_SEGMENT;
    float *buf = malloc(sizeof(float) * ((size_t)group * (SL + D + (size_t)nseg * stride) + 2 * (size_t)D + 1));
    float *scores = buf, *qf = scores + (size_t)group * SL, *part = qf + (size_t)group * D;
    float *row = part + (size_t)group * nseg * stride, *res = row + D;
    for (int g = 0; g < group; g++) load_row(a->q, a->q_bf16, (int64_t)t * a->H + kvh * group + g, D, qf + (size_t)g * D);
    for (int k = 0; k < nseg; k++) {
        const int jlo = k * KEY_SEGMENT, n_seg = L - jlo < KEY_SEGMENT ? L - jlo : KEY_SEGMENT;
        for (int jj = 0; jj < n_seg; jj++) {
            const int j = lo + jlo + jj;
            const int64_t at = (int64_t)table[j / bs] * bs + j % bs;
#if defined(QMM_AVX2)
            if (a->kv_bf16 == KV_BF16) {
                const uint16_t *kr = (const uint16_t *)a->k + (at * a->Hkv + kvh) * D;
                for (int g = 0; g < group; g++)
                    scores[(size_t)g * SL + jj] = dot_bf16(qf + (size_t)g * D, kr, D) * a->scale;
                continue;
            }
#endif
            const float *kr = kv_row(a->k, a->kv_bf16, at * a->Hkv + kvh, D, row);
            for (int g = 0; g < group; g++) scores[(size_t)g * SL + jj] = dot(qf + (size_t)g * D, kr, D) * a->scale;
        }
        for (int g = 0; g < group; g++) {
            float *p = part + ((size_t)g * nseg + k) * stride;
            softmax(scores + (size_t)g * SL, n_seg, p, p + 1);
            memset(p + 2, 0, sizeof(float) * D);
        }
        for (int jj = 0; jj < n_seg; jj++) {
            const int j = lo + jlo + jj;
            const int64_t at = (int64_t)table[j / bs] * bs + j % bs;
#if defined(QMM_AVX2)
            if (a->kv_bf16 == KV_BF16 && D % 8 == 0) { /* out[d] += p * v[d] as one FMA per value, as the loop below compiles */
                const uint16_t *vr = (const uint16_t *)a->v + (at * a->Hkv + kvh) * D;
                for (int g = 0; g < group; g++) {
                    __m256 p = _mm256_set1_ps(scores[(size_t)g * SL + jj]);
                    float *out = part + ((size_t)g * nseg + k) * stride + 2;
                    for (int d = 0; d < D; d += 8) {
                        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(vr + d))), 16);
                        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(p, _mm256_castsi256_ps(w), _mm256_loadu_ps(out + d)));
                    }
                }
                continue;
            }
#endif
            const float *vr = kv_row(a->v, a->kv_bf16, at * a->Hkv + kvh, D, row);
            for (int g = 0; g < group; g++) {
                float p = scores[(size_t)g * SL + jj], *out = part + ((size_t)g * nseg + k) * stride + 2;
                for (int d = 0; d < D; d++) out[d] += p * vr[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float M, total;
        combine_segments(part + (size_t)g * nseg * stride, stride, nseg, D, res, &M, &total);
        store_head(a, ((int64_t)t * a->H + kvh * group + g) * D, kvh * group + g, res, M, total);
    }
    free(buf);
}

#if defined(QMM_AVX2)
/* ---- expf, four at a time: glibc's expf (the ARM optimized-routines algorithm, as glibc's FMA build computes
   it: the same table, polynomial, FMAs and special cases), so the softmax gives the bits a libm expf call gave on
   such a build, and the same bits everywhere else. ---- */

static const uint64_t EXP2F_TAB[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

static inline double f64_bits(uint64_t u) {
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* glibc's special cases of expf (|x| >= 88 or NaN): 1 with *out set, or 0 where x takes the normal path */
static int expf_special(float x, float *out) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (bits == 0xff800000u) *out = 0.0f;
    else if ((bits & 0x7fffffffu) >= 0x7f800000u) *out = x + x;
    else if (x > f32_from_bits(0x42b17217u)) *out = INFINITY;
    else if (x < f32_from_bits(0xc2cff1b4u)) *out = 0.0f;
    else if (x < f32_from_bits(0xc2ce8ecfu)) { /* "may underflow": 0x1.4p-75f squared, rounded at run time as glibc does */
        volatile float tiny = 0x1.4p-75f;
        *out = tiny * tiny;
    } else return 0;
    return 1;
}

static inline __m128 exp4(__m128 x) {
    const __m256d invln2n = _mm256_set1_pd(f64_bits(0x40471547652b82feull));
    const __m256d shift = _mm256_set1_pd(f64_bits(0x4338000000000000ull));
    const __m256d c0 = _mm256_set1_pd(f64_bits(0x3ebc6af84b912394ull));
    const __m256d c1 = _mm256_set1_pd(f64_bits(0x3f2ebfce50fac4f3ull));
    const __m256d c2 = _mm256_set1_pd(f64_bits(0x3f962e42ff0c52d6ull));
    __m256d xd = _mm256_cvtps_pd(x);
    __m256d kd = _mm256_fmadd_pd(invln2n, xd, shift); /* glibc's FMA build fuses z = InvLn2N * x into both uses */
    __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, shift);
    __m256d r = _mm256_fmsub_pd(invln2n, xd, kd);
    __m256i t = _mm256_i64gather_epi64((const long long *)EXP2F_TAB, _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
    __m256d z = _mm256_fmadd_pd(c0, r, c1);
    __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(c2, r, _mm256_set1_pd(1.0));
    y = _mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), s);
    __m128 out = _mm256_cvtpd_ps(y);
    __m128i abs = _mm_and_si128(_mm_castps_si128(x), _mm_set1_epi32(0x7fffffff));
    if (__builtin_expect(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(abs, _mm_set1_epi32(0x42afffff)))), 0)) {
        float xs[4], os[4];
        _mm_storeu_ps(xs, x);
        _mm_storeu_ps(os, out);
        for (int l = 0; l < 4; l++) expf_special(xs[l], &os[l]);
        out = _mm_loadu_ps(os);
    }
    return out;
}

/* expf as the softmax computes it (the combine of key segments uses it too) */
static inline float seg_exp(float x) { return _mm_cvtss_f32(exp4(_mm_set1_ps(x))); }

/* ---- the blocked path: a block of rows of one sequence times the query heads of one kv head ---- */

enum { KEY_TILE = 128, PV_MAX = 6 };

/* eight float32 values of a K or V row from element d, converted from float16 when bf16 is KV_F16 (F16C), from
   bfloat16 when it is KV_BF16 (exact either way): for bfloat16 the
   eight halves loaded into both 128-bit lanes, each moved into the high half of its float by one byte shuffle
   (one shuffle per eight values, where widening and shifting took two) */
static inline __attribute__((always_inline)) __m256 load8(const void *row, int bf16, int d) {
    if (bf16 == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
    if (bf16) {
        const __m256i to_high = _mm256_setr_epi8(-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6,
                                                 7, -128, -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128,
                                                 -128, 14, 15);
        const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
        return _mm256_castsi256_ps(_mm256_shuffle_epi8(h, to_high));
    }
    return _mm256_loadu_ps((const float *)row + d);
}

/* the eight sums ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) of acc[0..7]'s lanes l, in one register: the
   final sum of dot_bf16() and dot(), pair for pair */
static inline __m256 lane_sums8(const __m256 *acc) {
    __m256 p[4];
    for (int i = 0; i < 4; i++)
        p[i] = _mm256_add_ps(_mm256_permute2f128_ps(acc[i], acc[i + 4], 0x20),
                             _mm256_permute2f128_ps(acc[i], acc[i + 4], 0x31));
    return _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
}

/* the four sums ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) of acc[0..3]'s lanes, likewise */
static inline __m128 lane_sums4(const __m256 *acc) {
    __m128 x[4];
    for (int i = 0; i < 4; i++) x[i] = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    return _mm_hadd_ps(_mm_hadd_ps(x[0], x[1]), _mm_hadd_ps(x[2], x[3]));
}

/* twelve scores at once, 4 query vectors (q, D floats apart) times 3 keys (kp): s[k * ps + v] = q[v] . key k *
   scale, each an FMA chain over the head dimension in eight lanes as dot_bf16() computes it (twelve independent
   chains keep both FMA pipes busy) */
static inline __attribute__((always_inline)) void scores12(const float *q, const void *const *kp, int D, int bf16,
                                                          __m256 scale, float *s, int ps) {
    __m256 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8)
        for (int k = 0; k < 3; k++) {
            __m256 kv = load8(kp[k], bf16, d);
            for (int v = 0; v < 4; v++)
                acc[k * 4 + v] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)v * D + d), kv, acc[k * 4 + v]);
        }
    const __m256 s01 = _mm256_mul_ps(lane_sums8(acc), scale);
    _mm_storeu_ps(s, _mm256_castps256_ps128(s01));
    _mm_storeu_ps(s + ps, _mm256_extractf128_ps(s01, 1));
    _mm_storeu_ps(s + 2 * (size_t)ps, _mm_mul_ps(lane_sums4(acc + 8), _mm256_castps256_ps128(scale)));
}

/* acc[v][d .. d + 8c) += p[i * ps + v] * value i [d .. d + 8c) for values i < n in order, for nv vectors: one FMA
   per element and value, as the per-vector loop does it. The accumulators are named registers (an array of them
   would live on the stack). */
static inline __attribute__((always_inline)) void weigh_values(float *acc, int D, int d, int nv, int c,
                                                               const float *p, int ps, const void *const *vp, int n,
                                                               int bf16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
#define PV_LOAD(v)                                                                                                     \
    if (nv > v) {                                                                                                      \
        a##v = _mm256_loadu_ps(acc + (size_t)v * D + d);                                                               \
        if (c > 1) b##v = _mm256_loadu_ps(acc + (size_t)v * D + d + 8);                                                \
    }
#define PV_FMA(v)                                                                                                      \
    if (nv > v) {                                                                                                      \
        const __m256 pv = _mm256_broadcast_ss(pi + v);                                                                 \
        a##v = _mm256_fmadd_ps(pv, w0, a##v);                                                                          \
        if (c > 1) b##v = _mm256_fmadd_ps(pv, w1, b##v);                                                               \
    }
#define PV_STORE(v)                                                                                                    \
    if (nv > v) {                                                                                                      \
        _mm256_storeu_ps(acc + (size_t)v * D + d, a##v);                                                               \
        if (c > 1) _mm256_storeu_ps(acc + (size_t)v * D + d + 8, b##v);                                                \
    }
    PV_LOAD(0) PV_LOAD(1) PV_LOAD(2) PV_LOAD(3) PV_LOAD(4) PV_LOAD(5)
    for (int i = 0; i < n; i++) {
        const float *pi = p + (size_t)i * ps;
        const __m256 w0 = load8(vp[i], bf16, d), w1 = c > 1 ? load8(vp[i], bf16, d + 8) : w0;
        PV_FMA(0) PV_FMA(1) PV_FMA(2) PV_FMA(3) PV_FMA(4) PV_FMA(5)
    }
    PV_STORE(0) PV_STORE(1) PV_STORE(2) PV_STORE(3) PV_STORE(4) PV_STORE(5)
#undef PV_LOAD
#undef PV_FMA
#undef PV_STORE
}

#define WEIGH_CASE(NV, C, BF)                                                                                          \
    case (NV) * 8 + ((C) - 1) * 4 + (BF): weigh_values(acc, D, d, NV, C, p, ps, vp, n, BF); break;
#define WEIGH_CASES(NV, C) WEIGH_CASE(NV, C, KV_F32) WEIGH_CASE(NV, C, KV_BF16) WEIGH_CASE(NV, C, KV_F16)

/* weigh_values for a run-time nv (1 .. PV_MAX), c (1, 2) and pool format bf16 (KV_F32, KV_BF16, KV_F16), each its
   own unrolled copy */
static void weigh(float *acc, int D, int d, int nv, int c, const float *p, int ps, const void *const *vp, int n,
                  int bf16) {
    switch (nv * 8 + (c - 1) * 4 + bf16) {
        WEIGH_CASES(1, 1) WEIGH_CASES(1, 2) WEIGH_CASES(2, 1) WEIGH_CASES(2, 2) WEIGH_CASES(3, 1) WEIGH_CASES(3, 2)
        WEIGH_CASES(4, 1) WEIGH_CASES(4, 2) WEIGH_CASES(5, 1) WEIGH_CASES(5, 2) WEIGH_CASES(6, 1) WEIGH_CASES(6, 2)
    }
}
#undef WEIGH_CASES

typedef struct {
    const attn_t *a;
    const int *starts; /* block b is rows starts[b] .. starts[b + 1] - 1, all of one sequence */
    const int *nseg;   /* block b's key segments (1 + (its longest row's keys - 1) / KEY_SEGMENT) */
    const int *unit;   /* unit u is block unit[2u], key segment unit[2u + 1] */
    const int *work;   /* task i is unit work[2i] times kv head work[2i + 1] (-1: all of them, a one-row block) */
    const int64_t *part_at; /* block b's segment partials at part + part_at[b] (several segments only) */
    float *part;
} blocks_t;

/* Pointers to the K (or V) rows of keys j0 .. j0 + n - 1 of kv head kvh, padded with the last one to n + 8
   entries. */
static void key_rows(const attn_t *a, const void *pool, const int32_t *table, int kvh, int j0, int n,
                     const void **rows) {
    const size_t el = a->kv_bf16 ? 2 : 4;
    const int bs = a->block_size;
    int i = 0;
    while (i < n) {
        const int j = j0 + i, o = j % bs, take = bs - o < n - i ? bs - o : n - i;
        const char *first = (const char *)pool + (((int64_t)table[j / bs] * bs + o) * a->Hkv + kvh) * a->D * el;
        for (int x = 0; x < take; x++) rows[i + x] = first + (size_t)x * a->Hkv * a->D * el;
        i += take;
    }
    for (; i < n + 8; i++) rows[i] = rows[i - 1];
}

/* ---- the row path: the query heads of one kv head of a block of one row (a decode row), the same arithmetic per
   vector as the blocked path, bit for bit, in a loop nest for one row: no padding vector, the scores of several
   keys per vector at once, the softmax over a vector's keys in one run, and each key and value converted once for
   all the row's query heads ---- */

/* scores s[v * ls + k] = q[v] . key k * scale of NV query vectors (D floats apart) and NK keys (kp): each an FMA
   chain over the head dimension in eight lanes and the lanes' fixed sum, as scores12() and dot_bf16() compute it */
static inline __attribute__((always_inline)) void row_scores(const float *q, const void *const *kp, size_t off, int D,
                                                            int bf16, __m256 scale, float *s, int ls, const int NV,
                                                            const int NK) {
    __m256 acc[12];
    for (int i = 0; i < NV * NK; i++) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8)
        for (int k = 0; k < NK; k++) {
            const __m256 kv = load8((const char *)kp[k] + off, bf16, d);
            for (int v = 0; v < NV; v++)
                acc[v * NK + k] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)v * D + d), kv, acc[v * NK + k]);
        }
    if (NK == 8) { /* one vector */
        _mm256_storeu_ps(s, _mm256_mul_ps(lane_sums8(acc), scale));
    } else if (NK == 4) { /* two vectors per lane_sums8, an odd last one through lane_sums4 */
        for (int v = 0; v + 1 < NV; v += 2) {
            const __m256 r = _mm256_mul_ps(lane_sums8(acc + v * 4), scale);
            _mm_storeu_ps(s + (size_t)v * ls, _mm256_castps256_ps128(r));
            _mm_storeu_ps(s + (size_t)(v + 1) * ls, _mm256_extractf128_ps(r, 1));
        }
        if (NV % 2)
            _mm_storeu_ps(s + (size_t)(NV - 1) * ls,
                          _mm_mul_ps(lane_sums4(acc + (NV - 1) * 4), _mm256_castps256_ps128(scale)));
    } else { /* NK == 2, four vectors */
        const __m256 r = _mm256_mul_ps(lane_sums8(acc), scale);
        const __m128 lo = _mm256_castps256_ps128(r), hi = _mm256_extractf128_ps(r, 1);
        _mm_storel_pi((__m64 *)s, lo);
        _mm_storeh_pi((__m64 *)(s + ls), lo);
        _mm_storel_pi((__m64 *)(s + 2 * (size_t)ls), hi);
        _mm_storeh_pi((__m64 *)(s + 3 * (size_t)ls), hi);
    }
}

/* The row path reads its K and V rows from memory (a step's layers together are larger than the cache), so it
   fetches them ahead: the K rows ROW_PREFETCH keys ahead of the scores, the V rows a chunk of ROW_CHUNK keys ahead
   of the values (measured best at 8 and 8 on a 2-core EPYC; more in flight at once was slower). */
enum { ROW_PREFETCH = 8, ROW_CHUNK = 8 };

/* every cache line of bytes from each of rows[from .. to) */
static inline void prefetch_rows(const void *const *rows, int from, int to, size_t bytes) {
    for (int i = from; i < to; i++)
        for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)rows[i] + o, _MM_HINT_T0);
    if (bytes % 64)
        for (int i = from; i < to; i++) _mm_prefetch((const char *)rows[i] + bytes - 1, _MM_HINT_T0);
}

/* the scores of nv (1 .. 4) vectors over keys kp[0 .. 8) (at byte offset off of each) */
static void row_scores8(const float *q, const void *const *kp, size_t off, int D, int bf16, __m256 scale, float *s,
                        int ls, int nv) {
#define ROW_SCORES(NV, NK, BF)                                                                                         \
    for (int j = 0; j < 8; j += NK) row_scores(q, kp + j, off, D, BF, scale, s + j, ls, NV, NK);                       \
    break;
/* nv vectors, NK keys a call, for each KV element type: KV_F32 (0), KV_BF16 (1) or KV_F16 (3) */
#define EACH_KV(NV, NK)                                                                                                \
    case 4 * NV: ROW_SCORES(NV, NK, 0)                                                                                 \
    case 4 * NV + 1: ROW_SCORES(NV, NK, 1)                                                                             \
    case 4 * NV + 3: ROW_SCORES(NV, NK, 3)
    switch (nv * 4 + bf16) {
    EACH_KV(1, 8)
    EACH_KV(2, 4)
    EACH_KV(3, 4)
    EACH_KV(4, 2)
    }
#undef EACH_KV
#undef ROW_SCORES
}

/* acc[v][d .. d + 8C) += p[v * ls + j] * value j [d .. d + 8C) for keys j < n in order, one FMA per element and
   key, as weigh_values() accumulates it, for NV vectors at once (NV * C accumulators, NV broadcast weights and one
   value register: at most 15 of the 16) */
static inline __attribute__((always_inline)) void row_values(float *acc, int D, int d, const float *p, int ls,
                                                            const void *const *vp, size_t off, int n, int bf16,
                                                            const int NV, const int C) {
    __m256 a[12];
    for (int v = 0; v < NV; v++)
        for (int c = 0; c < C; c++) a[v * C + c] = _mm256_loadu_ps(acc + (size_t)v * D + d + 8 * c);
    for (int j = 0; j < n; j++) {
        __m256 pv[4];
        for (int v = 0; v < NV; v++) pv[v] = _mm256_broadcast_ss(p + (size_t)v * ls + j);
        for (int c = 0; c < C; c++) {
            const __m256 w = load8((const char *)vp[j] + off, bf16, d + 8 * c);
            for (int v = 0; v < NV; v++) a[v * C + c] = _mm256_fmadd_ps(pv[v], w, a[v * C + c]);
        }
    }
    for (int v = 0; v < NV; v++)
        for (int c = 0; c < C; c++) _mm256_storeu_ps(acc + (size_t)v * D + d + 8 * c, a[v * C + c]);
}

/* row_values() over the whole head dimension for nv (1 .. 4) vectors, as many registers per vector as fit (8, 4,
   3, 2), the last pass narrower where D asks */
static void row_values_all(float *acc, int D, const float *p, int ls, const void *const *vp, size_t off, int n,
                           int bf16, int nv) {
#define ROW_VALUES(NV, C, BF)                                                                                          \
    case (NV) * 64 + (C) * 4 + (BF): row_values(acc, D, d, p, ls, vp, off, n, BF, NV, C); break;
#define ROW_VALUES_C(NV, C) ROW_VALUES(NV, C, KV_F32) ROW_VALUES(NV, C, KV_BF16) ROW_VALUES(NV, C, KV_F16)
    const int most = nv == 1 ? 8 : (nv == 2 ? 4 : (nv == 3 ? 3 : 2));
    for (int d = 0; d < D;) {
        const int c = (D - d) / 8 < most ? (D - d) / 8 : most;
        switch (nv * 64 + c * 4 + bf16) {
            ROW_VALUES_C(1, 1) ROW_VALUES_C(1, 2) ROW_VALUES_C(1, 3) ROW_VALUES_C(1, 4)
            ROW_VALUES_C(1, 5) ROW_VALUES_C(1, 6) ROW_VALUES_C(1, 7) ROW_VALUES_C(1, 8)
            ROW_VALUES_C(2, 1) ROW_VALUES_C(2, 2) ROW_VALUES_C(2, 3) ROW_VALUES_C(2, 4)
            ROW_VALUES_C(3, 1) ROW_VALUES_C(3, 2) ROW_VALUES_C(3, 3)
            ROW_VALUES_C(4, 1) ROW_VALUES_C(4, 2)
        }
        d += 8 * c;
    }
#undef ROW_VALUES_C
#undef ROW_VALUES
}

/* The softmax of nv (1 .. 4) vectors' scores s[v * ls + j], j < n, in place, as the blocked path computes each
   vector's: its max (exact in any order), exp(s - max) four at a time, their sum in key order (one lane per
   vector, so the vectors' sums run side by side), then each times 1 / sum; the max and the sum go to vmax[v],
   vsum[v]. s has room up to n rounded up to 4. */
static void row_softmax(float *s, int ls, int nv, int n, float *vmax, float *vsum) {
    float mx[4] = {0, 0, 0, 0};
    for (int v = 0; v < nv; v++) {
        const float *sv = s + (size_t)v * ls;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        int j = 0;
        for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(sv + j), m8); /* a NaN score is passed over */
        float lanes[8], m = -INFINITY;
        _mm256_storeu_ps(lanes, m8);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        for (; j < n; j++) m = sv[j] > m ? sv[j] : m;
        mx[v] = vmax[v] = m;
    }
    __m128 sum = _mm_setzero_ps();
    for (int j = 0; j < n; j += 4) {
        __m128 e[4];
        for (int v = 0; v < 4; v++) {
            if (v < nv) {
                float *sv = s + (size_t)v * ls + j;
                e[v] = exp4(_mm_sub_ps(_mm_loadu_ps(sv), _mm_set1_ps(mx[v])));
                _mm_storeu_ps(sv, e[v]);
            } else {
                e[v] = _mm_setzero_ps();
            }
        }
        _MM_TRANSPOSE4_PS(e[0], e[1], e[2], e[3]); /* e[k]: key j + k of every vector */
        sum = _mm_add_ps(sum, e[0]);
        if (j + 1 < n) sum = _mm_add_ps(sum, e[1]);
        if (j + 2 < n) sum = _mm_add_ps(sum, e[2]);
        if (j + 3 < n) sum = _mm_add_ps(sum, e[3]);
    }
    float total[4];
    _mm_storeu_ps(total, sum);
    for (int v = 0; v < nv; v++) {
        float *sv = s + (size_t)v * ls;
        const __m128 inv = _mm_set1_ps(1.0f / total[v]);
        for (int j = 0; j < n; j += 4) _mm_storeu_ps(sv + j, _mm_mul_ps(_mm_loadu_ps(sv + j), inv));
        vsum[v] = total[v];
    }
}

/* per-thread scratch for the row path, kept between calls (a decode step calls it thousands of times) */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_key_make(void) { pthread_key_create(&scratch_key, free); }

static void *row_scratch(size_t bytes) {
    pthread_once(&scratch_once, scratch_key_make);
    size_t *buf = pthread_getspecific(scratch_key);
    if (buf && buf[0] >= bytes) return buf + 8;
    free(buf);
    bytes = bytes * 3 / 2 + 4096;
    buf = aligned_alloc(64, (bytes + 64 + 63) / 64 * 64);
    if (!buf) return 0;
    buf[0] = bytes;
    pthread_setspecific(scratch_key, buf);
    return buf + 8;
}

/* One key segment of one row (t) times kv heads h0 .. h0 + nh - 1: the G vectors of each such kv head get their
   softmax over the segment's keys and their values weighed by it, written as the output when the row has one
   segment (nseg), else as the segment's partials (max, sum, values: D + 2 floats per vector and segment, vector v
   of kv head h at part + ((h * G + v) * nseg + kseg) * (D + 2)) -- the bits the blocked path gives a block of this
   one row. The scores go key by key over all nh heads (the pool rows read in order, fetched ahead), then each
   head's softmax and values. */
static void attend_row(const attn_t *a, int t, int h0, int nh, int kseg, int nseg, float *part) {
    const int D = a->D, G = a->H / a->Hkv, V = nh * G, bf16 = a->kv_bf16, bs = a->block_size;
    const int jlo = kseg * KEY_SEGMENT;
    int n = a->row_len[t] - jlo;
    n = n < 0 ? 0 : (n > KEY_SEGMENT ? KEY_SEGMENT : n);
    const int ls = (n + 7) / 8 * 8 + 8; /* scores per vector: room for whole registers of keys */
    const size_t el = bf16 ? 2 : 4, rowb = (size_t)a->Hkv * D * el, headb = (size_t)D * el;
    float *qf = row_scratch(sizeof(float) * ((size_t)V * (2 * (size_t)D + ls) + 2 * (size_t)V) +
                            2 * sizeof(void *) * (size_t)ls);
    float *s = qf + (size_t)V * D, *acc = s + (size_t)V * ls, *vmax = acc + (size_t)V * D, *vsum = vmax + V;
    const void **kp = (const void **)(vsum + V), **vp = kp + ls;
    for (int v = 0; v < V; v++) load_row(a->q, a->q_bf16, (int64_t)t * a->H + h0 * G + v, D, qf + (size_t)v * D);
    memset(acc, 0, sizeof(float) * (size_t)V * D);
    /* each head's vectors in groups of at most 4, as even as they come (G = 3: one group; 8: two of 4) */
    const int groups = (G + 3) / 4, per = (G + groups - 1) / groups;
    if (n > 0) {
        const int32_t *table = a->tables + (int64_t)a->row_seq[t] * a->table_stride;
        const char *kb = (const char *)a->k + h0 * headb, *vb = (const char *)a->v + h0 * headb;
        const int lo = row_start(a, t);
        for (int i = 0; i < n;) { /* the keys' rows (head h0 on) a pool block at a time; padded with the last one */
            const int j = lo + jlo + i, o = j % bs, take = bs - o < n - i ? bs - o : n - i;
            const size_t at = ((size_t)table[j / bs] * bs + o) * rowb;
            for (int x = 0; x < take; x++) {
                kp[i + x] = kb + at + (size_t)x * rowb;
                vp[i + x] = vb + at + (size_t)x * rowb;
            }
            i += take;
        }
        for (int i = n; i < ls; i++) kp[i] = kp[n - 1], vp[i] = vp[n - 1];
        const __m256 scale = _mm256_set1_ps(a->scale);
        const size_t span = nh * headb;
        prefetch_rows((const void *const *)kp, 0, n < ROW_PREFETCH ? n : ROW_PREFETCH, span);
        for (int j = 0; j < n; j += 8) {
            const int f = j + ROW_PREFETCH, f1 = f + 8 < n ? f + 8 : n;
            if (f < n) prefetch_rows((const void *const *)kp, f, f1, span);
            for (int h = 0; h < nh; h++)
                for (int g0 = 0; g0 < G; g0 += per) {
                    const int v0 = h * G + g0, nv = G - g0 < per ? G - g0 : per;
                    row_scores8(qf + (size_t)v0 * D, (const void *const *)kp + j, h * headb, D, bf16, scale,
                                s + (size_t)v0 * ls + j, ls, nv);
                }
        }
        prefetch_rows((const void *const *)vp, 0, n < ROW_CHUNK ? n : ROW_CHUNK, span);
        for (int h = 0; h < nh; h++)
            for (int g0 = 0; g0 < G; g0 += per) {
                const int v0 = h * G + g0, nv = G - g0 < per ? G - g0 : per;
                row_softmax(s + (size_t)v0 * ls, ls, nv, n, vmax + v0, vsum + v0);
            }
        /* the values a chunk of keys at a time over all heads (each head's sums carried in acc from chunk to
           chunk: the same FMAs in the same order), the next chunk's rows fetched meanwhile */
        for (int j0 = 0; j0 < n; j0 += ROW_CHUNK) {
            const int m = n - j0 < ROW_CHUNK ? n - j0 : ROW_CHUNK, f = j0 + ROW_CHUNK;
            if (f < n) prefetch_rows((const void *const *)vp, f, f + ROW_CHUNK < n ? f + ROW_CHUNK : n, span);
            for (int h = 0; h < nh; h++)
                for (int g0 = 0; g0 < G; g0 += per) {
                    const int v0 = h * G + g0, nv = G - g0 < per ? G - g0 : per;
                    row_values_all(acc + (size_t)v0 * D, D, s + (size_t)v0 * ls + j0, ls,
                                   (const void *const *)vp + j0, h * headb, m, bf16, nv);
                }
        }
    } else {
        for (int v = 0; v < V; v++) vmax[v] = -INFINITY, vsum[v] = 0.0f;
    }
    if (nseg == 1) {
        for (int v = 0; v < V; v++)
            store_head(a, ((int64_t)t * a->H + h0 * G + v) * D, h0 * G + v, acc + (size_t)v * D, vmax[v], vsum[v]);
    } else {
        for (int v = 0; v < V; v++) {
            float *p = part + ((int64_t)(h0 * G + v) * nseg + kseg) * (D + 2);
            p[0] = vmax[v];
            p[1] = vsum[v];
            memcpy(p + 2, acc + (size_t)v * D, sizeof(float) * D);
        }
    }
}

/* One key segment (keys kseg * KEY_SEGMENT onwards, at most KEY_SEGMENT) of a block of rows times one kv head:
   each vector's softmax over its keys of the segment and its values weighed by it, written as the output when the
   block has one segment, else as the segment's partials (max, sum, values) for combine_segments(). */
static void attend_block_task(void *ctx, int task) {
    const blocks_t *blocks = (const blocks_t *)ctx;
    const attn_t *a = blocks->a;
    const int Hkv = a->Hkv, D = a->D, G = a->H / Hkv, kvh = blocks->work[2 * task + 1], bf16 = a->kv_bf16;
    const int b = blocks->unit[2 * blocks->work[2 * task]], kseg = blocks->unit[2 * blocks->work[2 * task] + 1];
    const int t0 = blocks->starts[b], rows = blocks->starts[b + 1] - t0, V = rows * G;
    const int jlo = kseg * KEY_SEGMENT, nseg = blocks->nseg[b];
    if (rows == 1) { /* a decode row (or a one-row chunk): the same bits in a loop nest for one row */
        attend_row(a, t0, kvh < 0 ? 0 : kvh, kvh < 0 ? Hkv : 1, kseg, nseg,
                   nseg > 1 ? blocks->part + blocks->part_at[b] : 0);
        return;
    }
    /* vectors v = r * G + g; scores [key][vp] with vp a multiple of 4 (whole registers in the softmax) and 2 rows
       to spare (the scores of 3 keys at a time); keys counted from jlo */
    const int vp = (V + 3) / 4 * 4;
    int lmax = 0;
    for (int r = 0; r < rows; r++) {
        int l = a->row_len[t0 + r] - jlo;
        l = l < 0 ? 0 : (l > KEY_SEGMENT ? KEY_SEGMENT : l);
        lmax = l > lmax ? l : lmax;
    }
    const int lp = lmax + 2;
    const int32_t *table = a->tables + (int64_t)a->row_seq[t0] * a->table_stride;
    float *qf = malloc(sizeof(float) * ((size_t)vp * D + (size_t)lp * vp + (size_t)V * D + 2 * (size_t)vp) +
                       sizeof(int) * vp + sizeof(void *) * (KEY_TILE + 8));
    float *scores = qf + (size_t)vp * D, *acc = scores + (size_t)lp * vp;
    float *vmax = acc + (size_t)V * D, *vsum = vmax + vp;
    int *len = (int *)(vsum + vp);
    const void **rowp = (const void **)(len + vp);
    for (int v = 0; v < vp; v++) {
        if (v < V) {
            load_row(a->q, a->q_bf16, (int64_t)(t0 + v / G) * a->H + kvh * G + v % G, D, qf + (size_t)v * D);
            const int l = a->row_len[t0 + v / G] - jlo;
            len[v] = l < 0 ? 0 : (l > KEY_SEGMENT ? KEY_SEGMENT : l);
        } else {
            memset(qf + (size_t)v * D, 0, sizeof(float) * D);
            len[v] = 0;
        }
    }
    /* scores, key tile by key tile (lanes past a vector's length are computed and never read) */
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int j0 = 0; j0 < lmax; j0 += KEY_TILE) {
        const int n = lmax - j0 < KEY_TILE ? lmax - j0 : KEY_TILE;
        key_rows(a, a->k, table, kvh, jlo + j0, n, rowp);
        for (int v0 = 0; v0 < vp; v0 += 4)
            for (int i = 0; i < n; i += 3) {
                float *out = scores + (size_t)(j0 + i) * vp + v0;
                if (bf16 == KV_BF16) scores12(qf + (size_t)v0 * D, rowp + i, D, KV_BF16, scale, out, vp);
                else if (bf16 == KV_F16) scores12(qf + (size_t)v0 * D, rowp + i, D, KV_F16, scale, out, vp);
                else scores12(qf + (size_t)v0 * D, rowp + i, D, KV_F32, scale, out, vp);
            }
    }
    /* softmax of each vector over its own keys, four vectors per register, in key order */
    for (int v0 = 0; v0 < vp; v0 += 4) {
        const __m128i lens = _mm_loadu_si128((const __m128i *)(len + v0));
        int lo = len[v0], hi = len[v0];
        for (int v = v0 + 1; v < v0 + 4; v++) {
            lo = len[v] < lo ? len[v] : lo;
            hi = len[v] > hi ? len[v] : hi;
        }
        float *s = scores + v0;
        __m128 mx = _mm_set1_ps(-INFINITY), sum = _mm_setzero_ps();
        int j = 0;
        for (; j < lo; j++) mx = _mm_max_ps(_mm_loadu_ps(s + (size_t)j * vp), mx); /* s > mx ? s : mx */
        for (; j < hi; j++) {
            __m128 m = _mm_castsi128_ps(_mm_cmpgt_epi32(lens, _mm_set1_epi32(j)));
            mx = _mm_blendv_ps(mx, _mm_max_ps(_mm_loadu_ps(s + (size_t)j * vp), mx), m);
        }
        for (j = 0; j < lo; j++) {
            __m128 e = exp4(_mm_sub_ps(_mm_loadu_ps(s + (size_t)j * vp), mx));
            _mm_storeu_ps(s + (size_t)j * vp, e);
            sum = _mm_add_ps(sum, e);
        }
        for (; j < hi; j++) { /* a lane past its length adds +0: its sum stays as it was */
            __m128 m = _mm_castsi128_ps(_mm_cmpgt_epi32(lens, _mm_set1_epi32(j)));
            __m128 e = _mm_and_ps(exp4(_mm_sub_ps(_mm_loadu_ps(s + (size_t)j * vp), mx)), m);
            _mm_storeu_ps(s + (size_t)j * vp, e);
            sum = _mm_add_ps(sum, e);
        }
        _mm_storeu_ps(vmax + v0, mx);
        _mm_storeu_ps(vsum + v0, sum);
        const __m128 inv = _mm_div_ps(_mm_set1_ps(1.0f), sum);
        for (j = 0; j < hi; j++) _mm_storeu_ps(s + (size_t)j * vp, _mm_mul_ps(_mm_loadu_ps(s + (size_t)j * vp), inv));
    }
    /* the weighted values: groups of up to PV_MAX vectors (whole rows where G allows) share each value row over
       the keys all of them see; each vector then takes the keys only it sees */
    memset(acc, 0, sizeof(float) * (size_t)V * D);
    const int parts = (G + PV_MAX - 1) / PV_MAX, part = (G + parts - 1) / parts;
    const int group_rows = G <= PV_MAX ? PV_MAX / G : 1;
    for (int j0 = 0; j0 < lmax; j0 += KEY_TILE) {
        const int n = lmax - j0 < KEY_TILE ? lmax - j0 : KEY_TILE;
        key_rows(a, a->v, table, kvh, jlo + j0, n, rowp);
        for (int r0 = 0; r0 < rows; r0 += group_rows)
            for (int g0 = 0; g0 < G; g0 += part) {
                const int r1 = r0 + group_rows < rows ? r0 + group_rows : rows;
                const int v0 = r0 * G + g0, gn = G <= PV_MAX ? G : (G - g0 < part ? G - g0 : part);
                const int nvec = G <= PV_MAX ? (r1 - r0) * G : gn;
                int lo = len[v0];
                for (int v = v0; v < v0 + nvec; v++) lo = len[v] < lo ? len[v] : lo;
                const int shared = lo - j0 < n ? (lo - j0 > 0 ? lo - j0 : 0) : n;
                for (int d = 0; d < D; d += 16) {
                    const int c = D - d >= 16 ? 2 : 1;
                    if (shared)
                        weigh(acc + (size_t)v0 * D, D, d, nvec, c, scores + (size_t)j0 * vp + v0, vp, rowp, shared,
                              bf16);
                    for (int v = v0; v < v0 + nvec; v++) {
                        const int own = len[v] - j0 < n ? len[v] - j0 : n;
                        if (own > shared)
                            weigh(acc + (size_t)v * D, D, d, 1, c, scores + (size_t)(j0 + shared) * vp + v, vp,
                                  rowp + shared, own - shared, bf16);
                    }
                }
            }
    }
    if (nseg == 1) {
        for (int v = 0; v < V; v++)
            store_head(a, ((int64_t)(t0 + v / G) * a->H + kvh * G + v % G) * D, kvh * G + v % G, acc + (size_t)v * D,
                       vmax[v], vsum[v]);
    } else { /* partials [kv head][vector][segment][max, sum, D values] */
        for (int v = 0; v < V; v++) {
            float *p = blocks->part + blocks->part_at[b] + (((int64_t)kvh * V + v) * nseg + kseg) * (D + 2);
            p[0] = vmax[v];
            p[1] = vsum[v];
            memcpy(p + 2, acc + (size_t)v * D, sizeof(float) * D);
        }
    }
    free(qf);
}

/* Task (block, kv head) of the blocks with several key segments (`unit` lists them here): each vector's segments
   combined into its output. */
static void combine_block_task(void *ctx, int task) {
    const blocks_t *blocks = (const blocks_t *)ctx;
    const attn_t *a = blocks->a;
    const int Hkv = a->Hkv, D = a->D, G = a->H / Hkv, kvh = task % Hkv, b = blocks->unit[task / Hkv];
    const int t0 = blocks->starts[b], V = (blocks->starts[b + 1] - t0) * G, nseg = blocks->nseg[b];
    float res[D];
    for (int v = 0; v < V; v++) {
        float M, total;
        combine_segments(blocks->part + blocks->part_at[b] + ((int64_t)kvh * V + v) * nseg * (D + 2), D + 2, nseg,
                         D, res, &M, &total);
        store_head(a, ((int64_t)(t0 + v / G) * a->H + kvh * G + v % G) * D, kvh * G + v % G, res, M, total);
    }
}

/* rows per block: about 32 query vectors (24 for the default model's 3 per kv head) */
static int rows_per_block(int G) {
    int r = 32 / G;
    if (r >= 8) r -= r % 8;
    return r < 1 ? 1 : r;
}
#endif

#if !defined(QMM_AVX2)
static inline float seg_exp(float x) { return expf(x); }
#endif

/* expf of n values as the attention's softmax computes it (a test's window onto the kernel's exp) */
void qmm_exp(const float *x, int n, float *out) {
#if defined(QMM_AVX2)
    int i = 0;
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(out + i, exp4(_mm_loadu_ps(x + i)));
    if (i < n) {
        float in[4] = {0, 0, 0, 0}, res[4];
        memcpy(in, x + i, sizeof(float) * (n - i));
        _mm_storeu_ps(res, exp4(_mm_loadu_ps(in)));
        memcpy(out + i, res, sizeof(float) * (n - i));
    }
#else
    for (int i = 0; i < n; i++) out[i] = expf(x[i]);
#endif
}

/* out[t, h, :] = softmax(scale * q[t, h] . K[keys of row t]) V for T query rows of H heads of size D (q and out
   in bf16 when q_bf16, else float32; out may be q); row t attends to the row_len[t] positions of sequence
   row_seq[t] from position row_lo[t] on (0 when row_lo is NULL; a sliding-window layer's rows start later), whose
   blocks are tables[row_seq[t] * table_stride + ...]; the pools are [blocks, block_size, Hkv, D] in format kv_bf16
   (KV_F32, KV_BF16 or KV_F16, kv_q8.h). A row's keys are counted from its first one, so its bits depend only on which keys it sees. With
   sinks (float32 [H], or NULL), head h's softmax denominator also has exp(sinks[h]) (attention sinks: gpt-oss). */
void qmm_paged_attention_sinks(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v,
                               int kv_bf16, int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                               const int32_t *row_seq, const int32_t *row_lo, const int32_t *row_len,
                               const float *sinks, float scale, void *out) {
    attn_t a = {q, k, v, out, q_bf16, kv_bf16, H, Hkv, D, block_size, tables, row_seq, row_len, table_stride, scale,
                row_lo, sinks};
#if defined(QMM_AVX2)
    if (D % 8 == 0 && T > 0) {
        const int per = rows_per_block(H / Hkv), G = H / Hkv;
        int *starts = malloc(sizeof(int) * ((size_t)T + 1) * 2), n = 0;
        for (int t = 0; t < T; t++)
            /* a row whose keys do not start at 0 is a block of its own (the row path), as is the row after it */
            if (t == 0 || row_seq[t] != row_seq[t - 1] || t - starts[n - 1] == per ||
                (row_lo && (row_lo[t] || row_lo[t - 1])))
                starts[n++] = t;
        starts[n] = T;
        /* every block's key segments as tasks of their own; partials for the blocks with several */
        int *nseg = starts + n + 1, units = 0, multi = 0;
        int64_t *part_at = malloc(sizeof(int64_t) * (size_t)n), floats = 0;
        for (int b = 0; b < n; b++) {
            int lmax = 0;
            for (int t = starts[b]; t < starts[b + 1]; t++) lmax = row_len[t] > lmax ? row_len[t] : lmax;
            nseg[b] = lmax > 0 ? (lmax + KEY_SEGMENT - 1) / KEY_SEGMENT : 1;
            units += nseg[b];
            part_at[b] = floats;
            if (nseg[b] > 1) {
                floats += (int64_t)Hkv * (starts[b + 1] - starts[b]) * G * nseg[b] * (D + 2);
                multi++;
            }
        }
        int *unit = malloc(sizeof(int) * (2 * (size_t)units + (size_t)multi)), u = 0;
        for (int b = 0; b < n; b++)
            for (int k = 0; k < nseg[b]; k++, u++) {
                unit[2 * u] = b;
                unit[2 * u + 1] = k;
            }
        /* a one-row block's segment is one task over all kv heads (its pool rows read whole and in order, which
           the memory serves about twice as fast as one head's slices) when there are at least as many of them as
           threads, else a task per kv head, as a block of rows always is */
        int single = 0, tasks = 0;
        for (int i = 0; i < units; i++) single += starts[unit[2 * i] + 1] - starts[unit[2 * i]] == 1;
        const int whole = single >= pool_threads();
        int *work = malloc(sizeof(int) * 2 * (size_t)units * Hkv);
        for (int i = 0; i < units; i++) {
            const int b = unit[2 * i];
            if (whole && starts[b + 1] - starts[b] == 1) {
                work[2 * tasks] = i;
                work[2 * tasks++ + 1] = -1;
            } else {
                for (int h = 0; h < Hkv; h++) {
                    work[2 * tasks] = i;
                    work[2 * tasks++ + 1] = h;
                }
            }
        }
        float *part = floats ? malloc(sizeof(float) * (size_t)floats) : 0;
        blocks_t bl = {&a, starts, nseg, unit, work, part_at, part};
        pool_run(attend_block_task, &bl, tasks, 1);
        if (multi) {
            int *mb = unit + 2 * (size_t)units, m = 0;
            for (int b = 0; b < n; b++)
                if (nseg[b] > 1) mb[m++] = b;
            blocks_t cb = {&a, starts, nseg, mb, 0, part_at, part};
            pool_run(combine_block_task, &cb, multi * Hkv, 1);
        }
        free(part);
        free(work);
        free(unit);
        free(part_at);
        free(starts);
        return;
    }
#endif
    pool_run(attend_task, &a, T * Hkv, 1);
}

/* qmm_paged_attention_sinks() without sinks */
void qmm_paged_attention_from(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v,
                              int kv_bf16, int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                              const int32_t *row_seq, const int32_t *row_lo, const int32_t *row_len, float scale,
                              void *out) {
    qmm_paged_attention_sinks(q, q_bf16, T, H, D, k, v, kv_bf16, block_size, Hkv, tables, table_stride, row_seq,
                              row_lo, row_len, 0, scale, out);
}

/* qmm_paged_attention_from() with every row's keys from position 0 */
void qmm_paged_attention(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v, int kv_bf16,
                         int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                         const int32_t *row_seq, const int32_t *row_len, float scale, void *out) {
    qmm_paged_attention_from(q, q_bf16, T, H, D, k, v, kv_bf16, block_size, Hkv, tables, table_stride, row_seq, 0,
                             row_len, scale, out);
}
