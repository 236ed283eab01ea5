/* Causal attention of query rows over a paged K/V pool, in float32.

   Each (row, kv head) task reads its keys in one fixed order with one fixed summation order, so a row's result
   does not depend on what else is in the batch or on how its prompt was chunked: batch invariance without
   float64. The query heads that share a kv head (GQA) are done together, so each key is read once. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#if defined(QMM_AVX2)
#include <immintrin.h>
#endif

static inline float bf16_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

static inline void load_row(const void *base, int bf16, int64_t index, int D, float *out) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + index * D;
        for (int d = 0; d < D; d++) out[d] = bf16_f32(p[d]);
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
    for (; d < D; d++) s += a[d] * bf16_f32(b[d]);
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
} attn_t;

/* a K or V row as float32: the pool's own memory when it is float32, else converted into buf */
static inline const float *kv_row(const void *base, int bf16, int64_t index, int D, float *buf) {
    if (!bf16) return (const float *)base + index * D;
    load_row(base, 1, index, D, buf);
    return buf;
}

/* s[j] = exp(s[j] - max) / sum over j < L, summed in key order (the order every caller has always had) */
static void softmax(float *s, int L) {
    float mx = -INFINITY, sum = 0.0f;
    for (int j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
    for (int j = 0; j < L; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    float inv = 1.0f / sum;
    for (int j = 0; j < L; j++) s[j] *= inv;
}

static void attend_task(void *ctx, int task) {
    const attn_t *a = (const attn_t *)ctx;
    const int group = a->H / a->Hkv, t = task / a->Hkv, kvh = task % a->Hkv, D = a->D, bs = a->block_size;
    const int L = a->row_len[t];
    const int32_t *table = a->tables + (int64_t)a->row_seq[t] * a->table_stride;
    float *buf = malloc(sizeof(float) * ((size_t)group * (L + 2 * D) + (size_t)D));
    float *scores = buf, *acc = buf + (size_t)group * L, *qf = acc + (size_t)group * D, *row = qf + (size_t)group * D;
    for (int g = 0; g < group; g++) load_row(a->q, a->q_bf16, (int64_t)t * a->H + kvh * group + g, D, qf + (size_t)g * D);
    /* keys block by block: no division per key */
    for (int j0 = 0, b = 0; j0 < L; j0 += bs, b++) {
        const int64_t first = (int64_t)table[b] * bs;
        const int n = L - j0 < bs ? L - j0 : bs;
        for (int o = 0; o < n; o++) {
#if defined(QMM_AVX2)
            if (a->kv_bf16) {
                const uint16_t *kr = (const uint16_t *)a->k + ((first + o) * a->Hkv + kvh) * D;
                for (int g = 0; g < group; g++)
                    scores[(size_t)g * L + j0 + o] = dot_bf16(qf + (size_t)g * D, kr, D) * a->scale;
                continue;
            }
#endif
            const float *kr = kv_row(a->k, a->kv_bf16, (first + o) * a->Hkv + kvh, D, row);
            for (int g = 0; g < group; g++) scores[(size_t)g * L + j0 + o] = dot(qf + (size_t)g * D, kr, D) * a->scale;
        }
    }
    for (int g = 0; g < group; g++) {
        softmax(scores + (size_t)g * L, L);
        memset(acc + (size_t)g * D, 0, sizeof(float) * D);
    }
    for (int j0 = 0, b = 0; j0 < L; j0 += bs, b++) {
        const int64_t first = (int64_t)table[b] * bs;
        const int n = L - j0 < bs ? L - j0 : bs;
        for (int o = 0; o < n; o++) {
#if defined(QMM_AVX2)
            if (a->kv_bf16 && D % 8 == 0) { /* out[d] += p * v[d] as one FMA per value, as the loop below compiles */
                const uint16_t *vr = (const uint16_t *)a->v + ((first + o) * a->Hkv + kvh) * D;
                for (int g = 0; g < group; g++) {
                    __m256 p = _mm256_set1_ps(scores[(size_t)g * L + j0 + o]);
                    float *out = acc + (size_t)g * D;
                    for (int d = 0; d < D; d += 8) {
                        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(vr + d))), 16);
                        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(p, _mm256_castsi256_ps(w), _mm256_loadu_ps(out + d)));
                    }
                }
                continue;
            }
#endif
            const float *vr = kv_row(a->v, a->kv_bf16, (first + o) * a->Hkv + kvh, D, row);
            for (int g = 0; g < group; g++) {
                float p = scores[(size_t)g * L + j0 + o], *out = acc + (size_t)g * D;
                for (int d = 0; d < D; d++) out[d] += p * vr[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        int64_t index = ((int64_t)t * a->H + kvh * group + g) * D;
        if (a->q_bf16) {
            uint16_t *o = (uint16_t *)a->out + index;
            for (int d = 0; d < D; d++) o[d] = f32_bf16(acc[(size_t)g * D + d]);
        } else {
            memcpy((float *)a->out + index, acc + (size_t)g * D, sizeof(float) * D);
        }
    }
    free(buf);
}

/* out[t, h, :] = softmax(scale * q[t, h] . K[keys of row t]) V for T query rows of H heads of size D (q and out
   in bf16 when q_bf16, else float32; out may be q); row t attends to the first row_len[t] positions of sequence
   row_seq[t], whose blocks are tables[row_seq[t] * table_stride + ...]; the pools are
   [blocks, block_size, Hkv, D] (bf16 when kv_bf16). */
void qmm_paged_attention(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v, int kv_bf16,
                         int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                         const int32_t *row_seq, const int32_t *row_len, float scale, void *out) {
    attn_t a = {q, k, v, out, q_bf16, kv_bf16, H, Hkv, D, block_size, tables, row_seq, row_len, table_stride, scale};
    pool_run(attend_task, &a, T * Hkv, 1);
}
