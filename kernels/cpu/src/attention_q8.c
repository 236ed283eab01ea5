/* Causal attention of query rows over a paged K/V pool in q8_0 (kv_q8.h), in float32 with int8 dot products.

   Each query vector is quantized to q8_0 blocks (qmm_quantize, as the weight path quantizes activations); a score
   is the sum over the head's blocks of d_q * d_k * (the integer dot of the block's 32 values), times the
   attention scale. Each value row is dequantized a block at a time inside the weighed sum: out += (p * d_v) * v.

   Batch invariance as attention.c: a vector's keys are split at fixed positions (every KEY_SEGMENT keys from its
   first), each segment gets its own softmax (max, sum, weighed values in key order) and the segments are
   combined in order (qmm_attn_combine), so a vector's bits depend only on its own keys, never on the batch, the
   chunking or the thread count. A task is (a block of up to ROWS rows of one sequence, one kv head, one key
   segment); the rows of a block are only walked together so their keys stay in cache, each row computed alone. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "attention_q8.h"
#include "kv_q8.h"
#include "qmatmul.h"
#include "pool.h"
#if defined(QMM_AVX2)
#include <immintrin.h>
#endif


enum { SEG = 512, ROWS = 8 }; /* SEG: attention.c's KEY_SEGMENT */

typedef struct {
    const uint8_t *k, *v;
    void *out;
    int q_bf16, T, H, Hkv, D, block_size;
    const int32_t *tables, *row_seq, *row_lo, *row_len;
    int64_t table_stride;
    const float *sinks;
    float scale;
    const int8_t *qa; /* the query vectors in q8: [T * H, D] values, [T * H, D / 32] scales */
    const float *qd;
    const int *starts;    /* row blocks: rows starts[b] .. starts[b + 1] - 1 */
    const int *units;     /* task u: (block, kv head, segment) at units[3u] */
    const int64_t *part_at; /* row t's segment partials (rows of several segments): [H][nseg][D + 2] floats */
    float *part;
} q8attn_t;

static inline int nseg_of(int L) { return L > 0 ? (L + SEG - 1) / SEG : 1; }

/* head `head`'s output of row t: x (D floats, overwritten) scaled for a sink (see attention.c's store_head) and
   stored in q's dtype */
static void store(const q8attn_t *a, int t, int head, float *x, float M, float total) {
    const int D = a->D;
    if (a->sinks) {
        float e, arg = a->sinks[head] - M;
        qmm_exp(&arg, 1, &e);
        const float w = total / (total + e);
        for (int d = 0; d < D; d++) x[d] *= w;
    }
    const int64_t at = ((int64_t)t * a->H + head) * D;
    if (!a->q_bf16) {
        memcpy((float *)a->out + at, x, sizeof(float) * D);
        return;
    }
    uint16_t *o = (uint16_t *)a->out + at;
    for (int d = 0; d < D; d++) {
        uint32_t bits;
        memcpy(&bits, &x[d], 4);
        o[d] = (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((bits >> 16) | 0x40)
                                                   : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
    }
}

#if defined(QMM_AVX2)
enum { PREFETCH = 24 }; /* keys ahead whose rows are fetched while the current ones are worked on */
#ifndef PREFETCH_FAR_KEYS
#define PREFETCH_FAR_KEYS 64
#endif
/* the same in the VNNI paths, which spend less time per key (and fetch K and V rows together): further ahead to
   cover a memory latency */
enum { PREFETCH_FAR = PREFETCH_FAR_KEYS };

/* ask for the cache lines of a q8_0 row of D values */
static inline void prefetch_row(const uint8_t *row, int D) {
    for (int64_t o = 0; o < q8_row_bytes(D); o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
    _mm_prefetch((const char *)row + q8_row_bytes(D) - 1, _MM_HINT_T0);
}

/* lane i of the result: the sum of v[i]'s eight lanes (integers: exact in any order) */
static inline __m256i reduce8_epi32(const __m256i *v) {
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}
#endif

/* s[jj] = scale * (q . key jj) for the n keys at k + at[jj] * stride, for one query vector (q8 values q, scales
   qd): per key, the sum over its blocks in order of (the integer dot of the block's 32 values) * (d_q * d_k), one
   FMA per block, then times scale. Eight keys at a time: their integer dots of one block in one register. */
static void scores_q8(const int8_t *q, const float *qd, int D, const uint8_t *k, const int64_t *at, int64_t stride,
                      int n, float scale, float *s) {
    const int nb = D / Q8_BLOCK;
#if defined(QMM_AVX2)
    const __m256 sc = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < n; j0 += 8) {
        const int m = n - j0 < 8 ? n - j0 : 8;
        const uint8_t *rows[8];
        for (int i = 0; i < 8; i++) rows[i] = k + at[j0 + (i < m ? i : 0)] * stride; /* past n: any row, unread */
        for (int i = j0 + PREFETCH; i < j0 + PREFETCH + 8 && i < n; i++) prefetch_row(k + at[i] * stride, D);
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const int64_t off = (int64_t)b * Q8_BYTES;
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + b * Q8_BLOCK));
            __m256i p[8];
            for (int i = 0; i < 8; i++) {
                const __m256i kv = _mm256_loadu_si256((const __m256i *)(rows[i] + off + 2));
                const __m256i ax = _mm256_sign_epi8(kv, kv), sy = _mm256_sign_epi8(qv, kv);
#if defined(QMM_VNNI)
                p[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy);
#else
                p[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
#endif
            }
            uint16_t h[8];
            for (int i = 0; i < 8; i++) memcpy(&h[i], rows[i] + off, 2);
            const __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8_epi32(p)), _mm256_mul_ps(dk, _mm256_set1_ps(qd[b])),
                                  acc);
        }
        const __m256 r = _mm256_mul_ps(acc, sc);
        if (m == 8) {
            _mm256_storeu_ps(s + j0, r);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, r);
            memcpy(s + j0, tmp, sizeof(float) * (size_t)m);
        }
    }
#else
    for (int jj = 0; jj < n; jj++) {
        const uint8_t *key = k + at[jj] * stride;
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = key + (int64_t)b * Q8_BYTES;
            const int8_t *kq = (const int8_t *)(blk + 2), *qb = q + b * Q8_BLOCK;
            int32_t isum = 0;
            for (int i = 0; i < Q8_BLOCK; i++) isum += (int32_t)qb[i] * kq[i];
            acc += (float)isum * (qd[b] * q8_scale(blk));
        }
        s[jj] = acc * scale;
    }
#endif
}

#if defined(QMM_VNNI)
/* scores_q8_group for up to 4 vectors (G <= 4) with VNNI: each key block's bytes are loaded, its scale converted
   and its value sum taken once for the G vectors. The integer dot q . k is (q + 128) . k - 128 * sum(k), u8 times
   s8 in one vpdpbusd per vector and block, instead of the sign trick's three instructions; the integers are the
   same, so the scores are scores_q8's bits. */
static void scores_q8_vnni(const int8_t *q, const float *qd, int G, int D, const uint8_t *k, const uint8_t *v,
                           const int64_t *at, int64_t stride, int n, float scale, float *s, int ss) {
    const int nb = D / Q8_BLOCK;
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi8(1);
    __m256i qu[4][8]; /* [g][b]: q + 128 as u8 (D <= 256 here) */
    for (int g = 0; g < G; g++)
        for (int b = 0; b < nb; b++)
            qu[g][b] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + (int64_t)g * D + b * Q8_BLOCK)), flip);
    for (int j0 = 0; j0 < n; j0 += 8) {
        const int m = n - j0 < 8 ? n - j0 : 8;
        const uint8_t *rows[8];
        for (int i = 0; i < 8; i++) rows[i] = k + at[j0 + (i < m ? i : 0)] * stride; /* past n: any row, unread */
        for (int i = j0 + PREFETCH_FAR; i < j0 + PREFETCH_FAR + 8 && i < n; i++) {
            prefetch_row(k + at[i] * stride, D);
            prefetch_row(v + at[i] * stride, D); /* the value rows too: the weighed sum then finds them in L2 */
        }
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int b = 0; b < nb; b++) {
            const int64_t off = (int64_t)b * Q8_BYTES;
            __m256i kv[8], p[8];
            for (int i = 0; i < 8; i++) {
                kv[i] = _mm256_loadu_si256((const __m256i *)(rows[i] + off + 2));
                p[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, kv[i]);
            }
            const __m256i ksum128 = _mm256_slli_epi32(reduce8_epi32(p), 7);
            uint16_t h[8];
            for (int i = 0; i < 8; i++) memcpy(&h[i], rows[i] + off, 2);
            const __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
            for (int g = 0; g < G; g++) {
                for (int i = 0; i < 8; i++) p[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qu[g][b], kv[i]);
                const __m256i dot = _mm256_sub_epi32(reduce8_epi32(p), ksum128);
                acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dk, _mm256_set1_ps(qd[g * nb + b])),
                                         acc[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 r = _mm256_mul_ps(acc[g], sc);
            if (m == 8) {
                _mm256_storeu_ps(s + (int64_t)g * ss + j0, r);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, r);
                memcpy(s + (int64_t)g * ss + j0, tmp, sizeof(float) * (size_t)m);
            }
        }
    }
}
#endif

/* scores_q8 for G vectors (q: G * D values, qd: G * D / 32 scales) over the same n keys, vector g's scores at
   s + g * ss */
static void scores_q8_group(const int8_t *q, const float *qd, int G, int D, const uint8_t *k, const uint8_t *v,
                            const int64_t *at, int64_t stride, int n, float scale, float *s, int ss) {
    const int nb = D / Q8_BLOCK;
#if defined(QMM_VNNI)
    if (nb <= 8) {
        for (int g0 = 0; g0 < G; g0 += 4) /* each vector's scores are its own: any grouping gives the same bits */
            scores_q8_vnni(q + (int64_t)g0 * D, qd + (int64_t)g0 * nb, G - g0 < 4 ? G - g0 : 4, D, k, v, at, stride,
                           n, scale, s + (int64_t)g0 * ss, ss);
        return;
    }
#endif
    (void)v;
    for (int g = 0; g < G; g++)
        scores_q8(q + (int64_t)g * D, qd + (int64_t)g * nb, D, k, at, stride, n, scale, s + (int64_t)g * ss);
}

#if defined(QMM_AVX2)
/* weigh_q8 for a compile-time G: block b's 32 outputs of the G vectors in registers over all n keys, each key's
   weight p * d_v made first for the whole block (w: G * n floats of scratch) */
static inline __attribute__((always_inline)) void weigh_q8_g(float *acc, const int G, int D, const float *p, int ps,
                                                             const uint8_t *v, const int64_t *at, int64_t stride,
                                                             int n, float *w) {
    for (int b = 0; b < D / Q8_BLOCK; b++) {
        const int64_t off = (int64_t)b * Q8_BYTES;
        int jj = 0;
        for (; jj + 8 <= n; jj += 8) {
            if (b == 0) /* the first pass over the value rows: they come from memory */
                for (int i = jj + PREFETCH; i < jj + PREFETCH + 8 && i < n; i++) prefetch_row(v + at[i] * stride, D);
            uint16_t h[8];
            for (int i = 0; i < 8; i++) memcpy(&h[i], v + at[jj + i] * stride + off, 2);
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
            for (int g = 0; g < G; g++)
                _mm256_storeu_ps(w + (int64_t)g * n + jj, _mm256_mul_ps(_mm256_loadu_ps(p + (int64_t)g * ps + jj), dv));
        }
        for (; jj < n; jj++) {
            const float dv = _cvtsh_ss(*(const uint16_t *)(v + at[jj] * stride + off));
            for (int g = 0; g < G; g++) w[(int64_t)g * n + jj] = p[(int64_t)g * ps + jj] * dv;
        }
        __m256 o[4][4]; /* G <= 4: a fixed array the compiler keeps in registers (a VLA lives on the stack) */
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) o[g][c] = _mm256_setzero_ps();
        for (jj = 0; jj < n; jj++) {
            const uint8_t *vq = v + at[jj] * stride + off + 2;
            __m256 x[4];
            for (int c = 0; c < 4; c++)
                x[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(vq + 8 * c))));
            for (int g = 0; g < G; g++) {
                const __m256 wg = _mm256_broadcast_ss(w + (int64_t)g * n + jj);
                for (int c = 0; c < 4; c++) o[g][c] = _mm256_fmadd_ps(wg, x[c], o[g][c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + (int64_t)g * D + b * Q8_BLOCK + 8 * c, o[g][c]);
    }
}
#endif

#if defined(QMM_VNNI)
/* weigh_q8 with AVX-512VL's 32 registers, for compile-time G and NB: blocks b0 .. b0 + NB - 1 of the G vectors'
   outputs in registers (G * NB <= 6: 24 accumulators) over all n keys in one walk, each key's blocks read once
   while its row is in L1 and its weights p * d_v made on the way (the same products and sums, in the same order,
   as weigh_q8_g: the same bits) */
static inline __attribute__((always_inline)) void weigh_q8_rows(float *acc, const int G, const int NB, int b0, int D,
                                                                const float *p, int ps, const uint8_t *v,
                                                                const int64_t *at, int64_t stride, int n) {
    __m256 o[6][4];
    for (int r = 0; r < G * NB; r++)
        for (int c = 0; c < 4; c++) o[r][c] = _mm256_setzero_ps();
    for (int jj = 0; jj < n; jj++) {
        if (b0 == 0 && jj + PREFETCH_FAR < n) prefetch_row(v + at[jj + PREFETCH_FAR] * stride, D); /* once */
        const uint8_t *row = v + at[jj] * stride + (int64_t)b0 * Q8_BYTES;
        for (int bb = 0; bb < NB; bb++) {
            const uint8_t *blk = row + (int64_t)bb * Q8_BYTES;
            const float dv = _cvtsh_ss(*(const uint16_t *)blk);
            __m256 x[4];
            for (int c = 0; c < 4; c++)
                x[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * c))));
            for (int g = 0; g < G; g++) {
                const __m256 wg = _mm256_set1_ps(p[(int64_t)g * ps + jj] * dv);
                for (int c = 0; c < 4; c++) o[g * NB + bb][c] = _mm256_fmadd_ps(wg, x[c], o[g * NB + bb][c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int bb = 0; bb < NB; bb++)
            for (int c = 0; c < 4; c++)
                _mm256_storeu_ps(acc + (int64_t)g * D + (b0 + bb) * Q8_BLOCK + 8 * c, o[g * NB + bb][c]);
}

/* weigh_q8 in passes of weigh_q8_rows over as many blocks as G's accumulators leave room for; 0 where G > 6 */
static int weigh_q8_fused(float *acc, int G, int D, const float *p, int ps, const uint8_t *v, const int64_t *at,
                          int64_t stride, int n) {
    const int nb = D / Q8_BLOCK;
    int b0 = 0;
#define WEIGH_PASS(g, k)                                                                                               \
    for (; b0 + (k) <= nb; b0 += (k)) weigh_q8_rows(acc, g, k, b0, D, p, ps, v, at, stride, n)
    switch (G) {
    case 1: WEIGH_PASS(1, 6); WEIGH_PASS(1, 1); return 1;
    case 2: WEIGH_PASS(2, 3); WEIGH_PASS(2, 1); return 1;
    case 3: WEIGH_PASS(3, 2); WEIGH_PASS(3, 1); return 1;
    case 4: WEIGH_PASS(4, 1); return 1;
    case 5: WEIGH_PASS(5, 1); return 1;
    case 6: WEIGH_PASS(6, 1); return 1;
    default: return 0;
    }
#undef WEIGH_PASS
}
#endif

/* acc[g] (D floats each, G vectors D apart) = sum over keys jj in order of p[g * ps + jj] * value row jj (at
   v + at[jj] * stride), each value block dequantized once for the G vectors (w: scratch of G * n floats) */
static void weigh_q8(float *acc, int G, int D, const float *p, int ps, const uint8_t *v, const int64_t *at,
                     int64_t stride, int n, float *w) {
#if defined(QMM_VNNI)
    if (weigh_q8_fused(acc, G, D, p, ps, v, at, stride, n)) return;
#endif
#if defined(QMM_AVX2)
    switch (G) { /* the accumulators of up to 4 vectors stay in registers */
    case 1: weigh_q8_g(acc, 1, D, p, ps, v, at, stride, n, w); return;
    case 2: weigh_q8_g(acc, 2, D, p, ps, v, at, stride, n, w); return;
    case 3: weigh_q8_g(acc, 3, D, p, ps, v, at, stride, n, w); return;
    case 4: weigh_q8_g(acc, 4, D, p, ps, v, at, stride, n, w); return;
    default:
        for (int g0 = 0; g0 < G; g0 += 4) /* each vector's sums are its own: any grouping gives the same bits */
            weigh_q8(acc + (int64_t)g0 * D, G - g0 < 4 ? G - g0 : 4, D, p + (int64_t)g0 * ps, ps, v, at, stride, n, w);
        return;
    }
#else
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int jj = 0; jj < n; jj++) {
        const uint8_t *row = v + at[jj] * stride;
        for (int b = 0; b < D / Q8_BLOCK; b++) {
            const uint8_t *blk = row + (int64_t)b * Q8_BYTES;
            const int8_t *vq = (const int8_t *)(blk + 2);
            const float dv = q8_scale(blk);
            for (int g = 0; g < G; g++) {
                const float w = p[(int64_t)g * ps + jj] * dv;
                float *o = acc + (int64_t)g * D + b * Q8_BLOCK;
                for (int i = 0; i < Q8_BLOCK; i++) o[i] += w * (float)vq[i];
            }
        }
    }
#endif
}

/* the largest of x[0 .. n - 1] and m (max is exact in any order: the same bits however it is grouped) */
static inline float max_of(const float *x, int n, float m) {
    int i = 0;
#if defined(QMM_AVX2)
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    }
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* the sum of x[0 .. n - 1] in a fixed order for a given n: eight running lane sums (lane l: x[l], x[l + 8], ...)
   added pairwise, then the tail in order (a dependency chain of n / 8 adds instead of n) */
static inline float sum_of(const float *x, int n) {
    float total = 0.0f;
    int i = 0;
#if defined(QMM_AVX2)
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_add_ps(v, _mm256_loadu_ps(x + i));
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        total = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
    }
#endif
    for (; i < n; i++) total += x[i];
    return total;
}

/* Row t, kv head kvh, key segment k: the segment's softmax and weighed values for the kv head's G query heads,
   stored as the output (a row of one segment) or as the segment's partials. scores: G * SEG floats of scratch,
   acc: G * D, at: n key rows, w: G * SEG. */
static void row_segment(const q8attn_t *a, int t, int kvh, int k, float *scores, float *acc, int64_t *at,
                        float *w) {
    const int G = a->H / a->Hkv, D = a->D, bs = a->block_size, L = a->row_len[t], nseg = nseg_of(L);
    const int jlo = k * SEG, n = L - jlo < SEG ? L - jlo : SEG, lo = a->row_lo ? a->row_lo[t] : 0;
    const int64_t rb = q8_row_bytes(D), v0 = (int64_t)t * a->H + (int64_t)kvh * G, stride = a->Hkv * rb;
    const int32_t *table = a->tables + (int64_t)a->row_seq[t] * a->table_stride;
    { /* each key's pool row, counted in rows of all kv heads; one division per segment, not per key */
        const int j0 = lo + jlo;
        int blk = j0 / bs, off = j0 % bs;
        int64_t base = (int64_t)table[blk] * bs;
        for (int jj = 0; jj < n; jj++) {
            at[jj] = base + off;
            if (++off == bs && jj + 1 < n) {
                off = 0;
                base = (int64_t)table[++blk] * bs;
            }
        }
    }
    const uint8_t *k0 = a->k + kvh * rb, *vh = a->v + kvh * rb;
    float mx[G], sum[G];
    scores_q8_group(a->qa + v0 * D, a->qd + v0 * (D / Q8_BLOCK), G, D, k0, vh, at, stride, n, a->scale, scores, SEG);
    for (int g = 0; g < G; g++) { /* the softmax in key order */
        float *sg = scores + (int64_t)g * SEG, m = -INFINITY, total = 0.0f;
        m = max_of(sg, n, m);
        for (int jj = 0; jj < n; jj++) sg[jj] -= m;
        qmm_exp(sg, n, sg);
        total = sum_of(sg, n);
        const float inv = 1.0f / total;
        for (int jj = 0; jj < n; jj++) sg[jj] *= inv;
        mx[g] = m;
        sum[g] = n > 0 ? total : 0.0f;
    }
    weigh_q8(acc, G, D, scores, SEG, vh, at, stride, n, w);
    for (int g = 0; g < G; g++) {
        const int head = kvh * G + g;
        if (nseg == 1) {
            store(a, t, head, acc + (int64_t)g * D, mx[g], sum[g]);
        } else {
            float *p = a->part + a->part_at[t] + ((int64_t)head * nseg + k) * (D + 2);
            p[0] = mx[g];
            p[1] = sum[g];
            memcpy(p + 2, acc + (int64_t)g * D, sizeof(float) * D);
        }
    }
}

static void segment_task(void *ctx, int u) {
    const q8attn_t *a = (const q8attn_t *)ctx;
    const int b = a->units[3 * u], kvh = a->units[3 * u + 1], k = a->units[3 * u + 2], G = a->H / a->Hkv;
    float *buf = malloc(sizeof(float) * (size_t)G * (2 * SEG + a->D) + sizeof(int64_t) * SEG);
    float *acc = buf + (size_t)G * SEG, *w = acc + (size_t)G * a->D;
    int64_t *at = (int64_t *)(w + (size_t)G * SEG);
    for (int t = a->starts[b]; t < a->starts[b + 1]; t++)
        if (k < nseg_of(a->row_len[t])) row_segment(a, t, kvh, k, buf, acc, at, w);
    free(buf);
}

/* task (row, head) of the rows with several segments, listed in units */
static void combine_task(void *ctx, int u) {
    const q8attn_t *a = (const q8attn_t *)ctx;
    const int t = a->units[u / a->H], head = u % a->H, D = a->D, nseg = nseg_of(a->row_len[t]);
    float res[D], M, total;
    qmm_attn_combine(a->part + a->part_at[t] + (int64_t)head * nseg * (D + 2), D + 2, nseg, D, res, &M, &total);
    store(a, t, head, res, M, total);
}

/* qmm_paged_attention_sinks() over q8_0 pools k and v [blocks, block_size, Hkv, D / 32 * 34] bytes (D % 32 == 0).
   Returns 0, or -1 when out of memory or the shape is not one it takes. */
int qmm_paged_attention_q8(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v,
                           int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                           const int32_t *row_seq, const int32_t *row_lo, const int32_t *row_len, const float *sinks,
                           float scale, void *out) {
    if (D % Q8_BLOCK || Hkv <= 0 || H % Hkv) return -1;
    if (T <= 0) return 0;
    const int64_t nv = (int64_t)T * H;
    int8_t *qa = malloc((size_t)nv * D + sizeof(int16_t) * (size_t)nv * (D / 16));
    float *qd = malloc(sizeof(float) * (size_t)nv * (D / Q8_BLOCK));
    int *starts = malloc(sizeof(int) * ((size_t)T + 1));
    int64_t *part_at = malloc(sizeof(int64_t) * (size_t)T);
    if (!qa || !qd || !starts || !part_at) goto fail;
    qmm_quantize(q, q_bf16, D, (int)nv, D, qa, qd, (int16_t *)(qa + nv * D));
    int n = 0, units = 0, multi = 0;
    int64_t floats = 0;
    for (int t = 0; t < T; t++) {
        if (t == 0 || row_seq[t] != row_seq[t - 1] || t - starts[n - 1] == ROWS) starts[n++] = t;
        const int ns = nseg_of(row_len[t]);
        part_at[t] = floats;
        if (ns > 1) {
            floats += (int64_t)H * ns * (D + 2);
            multi++;
        }
    }
    starts[n] = T;
    int *nseg_b = malloc(sizeof(int) * (size_t)n);
    if (!nseg_b) goto fail;
    for (int b = 0; b < n; b++) {
        nseg_b[b] = 1;
        for (int t = starts[b]; t < starts[b + 1]; t++)
            nseg_b[b] = nseg_of(row_len[t]) > nseg_b[b] ? nseg_of(row_len[t]) : nseg_b[b];
        units += nseg_b[b] * Hkv;
    }
    int *unit = malloc(sizeof(int) * (3 * (size_t)units + (size_t)multi));
    float *part = floats ? malloc(sizeof(float) * (size_t)floats) : 0;
    if (!unit || (floats && !part)) {
        free(unit);
        free(part);
        free(nseg_b);
        goto fail;
    }
    /* segments outermost, so the tasks of one deep decode row spread over the threads */
    int u = 0;
    for (int b = 0; b < n; b++)
        for (int s = 0; s < nseg_b[b]; s++)
            for (int h = 0; h < Hkv; h++, u++) {
                unit[3 * u] = b;
                unit[3 * u + 1] = h;
                unit[3 * u + 2] = s;
            }
    q8attn_t a = {k, v, out, q_bf16, T, H, Hkv, D, block_size, tables, row_seq, row_lo, row_len, table_stride,
                  sinks, scale, qa, qd, starts, unit, part_at, part};
    pool_run(segment_task, &a, units, 1);
    if (multi) {
        int *rows = unit + 3 * (size_t)units, m = 0;
        for (int t = 0; t < T; t++)
            if (nseg_of(row_len[t]) > 1) rows[m++] = t;
        a.units = rows;
        pool_run(combine_task, &a, multi * H, multi >= 8); /* a few decode rows: on this thread, no hand-over */
    }
    free(part);
    free(unit);
    free(nseg_b);
    free(part_at);
    free(starts);
    free(qd);
    free(qa);
    return 0;
fail:
    free(part_at);
    free(starts);
    free(qd);
    free(qa);
    return -1;
}
