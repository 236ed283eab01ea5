/* Per-token elementwise work of a decoder layer, fused: residual add + RMSNorm, RoPE + K/V write, SiLU-and-mul.
   Every row is computed on its own in a fixed order (batch-invariant); rows are split across the pool. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "elementwise.h"
#include "kv_q8.h"
#include "pool.h"

static inline float ld(const void *p, int bf16, int64_t i) {
    if (bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)p)[i];
}

/* f into p[i]: float32, bfloat16 (bf16 1, rounded to nearest even, NaN kept quiet) or float16 (bf16 KV_F16) */
static inline void st(void *p, int bf16, int64_t i, float f) {
    if (bf16 == KV_F16) {
        ((uint16_t *)p)[i] = f32_to_f16(f);
    } else if (bf16) {
        uint32_t bits;
        memcpy(&bits, &f, 4);
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            ((uint16_t *)p)[i] = (uint16_t)((bits >> 16) | 0x40);
        } else {
            ((uint16_t *)p)[i] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
        }
    } else {
        ((float *)p)[i] = f;
    }
}

#if defined(QMM_AVX2)
#include <immintrin.h>
/* st() of 8 floats at once */
static inline void st8(void *p, int bf16, int64_t i, __m256 f) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, f);
        return;
    }
    if (bf16 == KV_F16) { /* rounded to nearest even, as f32_to_f16() */
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
        return;
    }
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)),
                         _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i h = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}

/* ld() of 8 values at once */
static inline __m256 ld8(const void *p, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

typedef struct {
    const void *x;
    int x_bf16;
    int64_t ldx;
    const float *residual, *weight;
    float *new_residual;
    void *out;
    int out_bf16, N;
    float eps;
} norm_t;

static void norm_row(void *ctx, int t) {
    const norm_t *a = (const norm_t *)ctx;
    const int N = a->N;
    float *r = a->new_residual + (int64_t)t * N;
    const float *res = a->residual ? a->residual + (int64_t)t * N : 0;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
#if defined(QMM_AVX2)
    /* lane l of the vector is acc[l]: the scalar loop's sums (as GCC contracts them, v * v fused into the add) */
    __m256 accv = _mm256_setzero_ps();
    for (; i + 8 <= N; i += 8) {
        __m256 v = ld8(a->x, a->x_bf16, t * a->ldx + i);
        if (res) {
            v = _mm256_add_ps(_mm256_loadu_ps(res + i), v);
            _mm256_storeu_ps(r + i, v);
        }
        accv = _mm256_fmadd_ps(v, v, accv);
    }
    _mm256_storeu_ps(acc, accv);
#endif
    for (; i < N; i++) {
        float v = res ? res[i] + ld(a->x, a->x_bf16, t * a->ldx + i) : ld(a->x, a->x_bf16, t * a->ldx + i);
        if (res) r[i] = v;
        acc[i & 7] += v * v;
    }
    const float *src = res ? r : 0;
    float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    float scale = 1.0f / sqrtf(ss / N + a->eps);
    i = 0;
#if defined(QMM_AVX2)
    const __m256 sv = _mm256_set1_ps(scale);
    for (; i + 8 <= N; i += 8) {
        const __m256 v = src ? _mm256_loadu_ps(src + i) : ld8(a->x, a->x_bf16, t * a->ldx + i);
        st8(a->out, a->out_bf16, (int64_t)t * N + i, _mm256_mul_ps(_mm256_mul_ps(v, sv), _mm256_loadu_ps(a->weight + i)));
    }
#endif
    for (; i < N; i++) {
        float v = src ? src[i] : ld(a->x, a->x_bf16, t * a->ldx + i);
        st(a->out, a->out_bf16, (int64_t)t * N + i, v * scale * a->weight[i]);
    }
}

/* out = rms_norm(residual + x) * weight (out in bf16 when out_bf16), new_residual = residual + x (float32);
   with residual NULL: out = rms_norm(x) * weight and new_residual untouched. */
void qmm_add_rms_norm(const void *x, int x_bf16, int64_t ldx, const float *residual, const float *weight, int T, int N,
                      float eps, float *new_residual, void *out, int out_bf16) {
    norm_t a = {x, x_bf16, ldx, residual, weight, new_residual, out, out_bf16, N, eps};
    pool_run(norm_row, &a, T, (int64_t)T * N >= 32768);
}

typedef struct {
    const void *q, *k, *v;
    int in_bf16;
    int64_t ldq, ldk, ldv;
    const float *cos, *sin;
    void *k_cache, *v_cache, *q_out;
    int cache_bf16, H, Hkv, D; /* cache_bf16: the pool's format, KV_F32 / KV_BF16 / KV_Q8_0 / KV_F16 (kv_q8.h) */
    const int64_t *slots;
    int q_bf16; /* q_out in bfloat16 */
} rope_t;


static void rope_row(void *ctx, int t) {
    const rope_t *a = (const rope_t *)ctx;
    const int D = a->D, half = D / 2;
    const float *c = a->cos + (int64_t)t * half, *s = a->sin + (int64_t)t * half;
    const int q8 = a->cache_bf16 == KV_Q8_0;
    float row[q8 ? D : 1]; /* a K or V head in float32 before it is quantized */
    for (int h = 0; h < a->H + a->Hkv; h++) {
        const int is_q = h < a->H, to_row = q8 && !is_q;
        const void *src = is_q ? a->q : a->k;
        int64_t base = is_q ? t * a->ldq + (int64_t)h * D : t * a->ldk + (int64_t)(h - a->H) * D;
        void *dst = is_q ? a->q_out : (to_row ? (void *)row : a->k_cache);
        int64_t obase = is_q ? ((int64_t)t * a->H + h) * D : (to_row ? 0 : (a->slots[t] * a->Hkv + (h - a->H)) * D);
        const int out_bf16 = is_q ? a->q_bf16 : (to_row ? 0 : a->cache_bf16);
        int i = 0;
#if defined(QMM_AVX2)
        /* the scalar loop's operations as GCC contracts them with FMA: x1 c - (x2 s) and x2 c + (x1 s) */
        if (!a->in_bf16)
            for (; i + 8 <= half; i += 8) {
                const __m256 x1 = _mm256_loadu_ps((const float *)src + base + i);
                const __m256 x2 = _mm256_loadu_ps((const float *)src + base + half + i);
                const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                st8(dst, out_bf16, obase + i, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
                st8(dst, out_bf16, obase + half + i, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
            }
#endif
        for (; i < half; i++) {
            float x1 = ld(src, a->in_bf16, base + i), x2 = ld(src, a->in_bf16, base + half + i);
            st(dst, out_bf16, obase + i, x1 * c[i] - x2 * s[i]);
            st(dst, out_bf16, obase + half + i, x2 * c[i] + x1 * s[i]);
        }
        if (to_row) q8_quantize_row(row, D, (uint8_t *)a->k_cache + (a->slots[t] * a->Hkv + (h - a->H)) * q8_row_bytes(D));
    }
    for (int h = 0; h < a->Hkv; h++) {
        int64_t base = t * a->ldv + (int64_t)h * D, obase = (a->slots[t] * a->Hkv + h) * D;
        if (q8) {
            for (int i = 0; i < D; i++) row[i] = ld(a->v, a->in_bf16, base + i);
            q8_quantize_row(row, D, (uint8_t *)a->v_cache + (a->slots[t] * a->Hkv + h) * q8_row_bytes(D));
            continue;
        }
        int i = 0;
#if defined(QMM_AVX2)
        if (!a->in_bf16)
            for (; i + 8 <= D; i += 8)
                st8(a->v_cache, a->cache_bf16, obase + i, _mm256_loadu_ps((const float *)a->v + base + i));
#endif
        for (; i < D; i++) st(a->v_cache, a->cache_bf16, obase + i, ld(a->v, a->in_bf16, base + i));
    }
}

/* Rotate q [T, H, D] and k [T, Hkv, D] (rows ldq / ldk values apart) by cos/sin [T, D/2] (rotate-half layout),
   write rotated k and v at their slots of the pools [slots, Hkv, D] and rotated q to q_out [T, H, D], all in the
   cache dtype. */
void qmm_rope_write_kv(const void *q, const void *k, const void *v, int in_bf16, int64_t ldq, int64_t ldk,
                       int64_t ldv, const float *cos, const float *sin, void *k_cache, void *v_cache, int cache_bf16,
                       const int64_t *slots, int T, int H, int Hkv, int D, void *q_out) {
    rope_t a = {q, k, v, in_bf16, ldq, ldk, ldv, cos, sin, k_cache, v_cache, q_out, cache_bf16, H, Hkv, D, slots,
                cache_bf16};
    pool_run(rope_row, &a, T, T >= 4);
}

/* qmm_rope_write_kv() into pools of format cache_fmt (KV_F32 / KV_BF16 / KV_Q8_0 / KV_F16, kv_q8.h: a q8_0 pool is
   [slots, Hkv, D / 32 * 34] bytes, each K and V head quantized from its float32 value) with q_out in bf16 when
   q_bf16 */
void qmm_rope_write_kv_fmt(const void *q, const void *k, const void *v, int in_bf16, int64_t ldq, int64_t ldk,
                           int64_t ldv, const float *cos, const float *sin, void *k_cache, void *v_cache, int cache_fmt,
                           const int64_t *slots, int T, int H, int Hkv, int D, void *q_out, int q_bf16) {
    rope_t a = {q, k, v, in_bf16, ldq, ldk, ldv, cos, sin, k_cache, v_cache, q_out, cache_fmt, H, Hkv, D, slots,
                q_bf16};
    pool_run(rope_row, &a, T, T >= 4);
}

typedef struct {
    const void *x;
    int bf16;
    int64_t ldx;
    float *out;
    int F, chunks; /* column chunks of SILU_CHUNK per row */
    int gelu;      /* GELU (tanh approximation) instead of SiLU */
    int oai;       /* gpt-oss's clamped SwiGLU instead (alpha, limit) */
    float alpha, limit;
} silu_t;

enum { SILU_CHUNK = 512 };

/* both activations are gate * sigmoid(z): z = gate for SiLU, z = 2 sqrt(2 / pi) (gate + 0.044715 gate^3) for
   GELU's tanh form (0.5 (1 + tanh(u)) = sigmoid(2u)); gate / (1 + expf(-z)) */
static void silu_chunk(void *ctx, int task) {
    const silu_t *a = (const silu_t *)ctx;
    const int t = task / a->chunks, i0 = task % a->chunks * SILU_CHUNK;
    const int n = a->F - i0 < SILU_CHUNK ? a->F - i0 : SILU_CHUNK;
    float g[SILU_CHUNK], e[SILU_CHUNK];
    for (int i = 0; i < n; i++) {
        const float x = ld(a->x, a->bf16, t * a->ldx + i0 + i);
        g[i] = a->gelu ? -1.5957691216057308f * (x + 0.044715f * x * x * x) : -x;
    }
    float *out = a->out + (int64_t)t * a->F + i0;
    if (a->oai) { /* gate' = min(gate, limit); (clamp(up, +-limit) + 1) * gate' / (1 + expf(-alpha gate')) */
        for (int i = 0; i < n; i++) {
            const float x = ld(a->x, a->bf16, t * a->ldx + i0 + i);
            g[i] = x < a->limit ? x : a->limit;
            e[i] = -a->alpha * g[i];
        }
        qmm_exp(e, n, e);
        for (int i = 0; i < n; i++) {
            float u = ld(a->x, a->bf16, t * a->ldx + a->F + i0 + i);
            u = u < -a->limit ? -a->limit : (u > a->limit ? a->limit : u);
            out[i] = (u + 1.0f) * (g[i] / (1.0f + e[i]));
        }
        return;
    }
    qmm_exp(g, n, e);
    for (int i = 0; i < n; i++)
        out[i] = ld(a->x, a->bf16, t * a->ldx + i0 + i) / (1.0f + e[i]) * ld(a->x, a->bf16, t * a->ldx + a->F + i0 + i);
}

/* out [T, F] (float32) = silu(gate) * up for rows [gate | up] of x (ldx values apart): gate / (1 + expf(-gate)) *
   up per value, with the exponentials computed a chunk at a time. */
void qmm_silu_mul(const void *x, int bf16, int64_t ldx, int T, int F, float *out) {
    const int chunks = (F + SILU_CHUNK - 1) / SILU_CHUNK;
    silu_t a = {x, bf16, ldx, out, F, chunks, 0, 0, 0.0f, 0.0f};
    pool_run(silu_chunk, &a, T * chunks, (int64_t)T * F >= 8192);
}

/* out [T, F] (float32) = gelu_tanh(gate) * up for rows [gate | up] of x (Gemma's MLP), as qmm_silu_mul */
void qmm_gelu_tanh_mul(const void *x, int bf16, int64_t ldx, int T, int F, float *out) {
    const int chunks = (F + SILU_CHUNK - 1) / SILU_CHUNK;
    silu_t a = {x, bf16, ldx, out, F, chunks, 1, 0, 0.0f, 0.0f};
    pool_run(silu_chunk, &a, T * chunks, (int64_t)T * F >= 8192);
}

/* out [T, F] (float32) = gpt-oss's clamped SwiGLU of rows [gate | up] of x: (clamp(up, -limit, limit) + 1) *
   g * sigmoid(alpha g) with g = min(gate, limit), as qmm_silu_mul */
void qmm_swiglu_oai_mul(const void *x, int bf16, int64_t ldx, int T, int F, float alpha, float limit, float *out) {
    const int chunks = (F + SILU_CHUNK - 1) / SILU_CHUNK;
    silu_t a = {x, bf16, ldx, out, F, chunks, 0, 1, alpha, limit};
    pool_run(silu_chunk, &a, T * chunks, (int64_t)T * F >= 8192);
}

/* out [n] = x [n] rounded to bfloat16 (nearest even), as torch's float32 -> bfloat16 cast */
void qmm_to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) st(out, 1, i, x[i]);
}

typedef struct {
    const float *x, *y, *weight;
    float *out;
    int N;
    float eps, a, b, c;
} norm_add_t;

static void norm_add_row(void *ctx, int r) {
    const norm_add_t *p = (const norm_add_t *)ctx;
    const int N = p->N;
    const float *x = p->x + (int64_t)r * N, *y = p->y + (int64_t)r * N;
    float *out = p->out + (int64_t)r * N;
    float ss = 0.0f;
    for (int i = 0; i < N; i++) {
        const float v = x[i] * p->a;
        ss += v * v;
    }
    const float scale = 1.0f / sqrtf(ss / N + p->eps);
    for (int i = 0; i < N; i++) out[i] = ((x[i] * p->a) * scale * p->weight[i] + y[i] * p->b) * p->c;
}

/* out [R, N] = (rms_norm(x * a) * weight + y * b) * c, row by row (float32; Gemma 4's per-layer inputs: the
   embedding's projection normed, plus the per-layer table's rows) */
void qmm_scaled_norm_add(const float *x, const float *y, const float *weight, int R, int N, float eps, float a, float b,
                         float c, float *out) {
    norm_add_t p = {x, y, weight, out, N, eps, a, b, c};
    pool_run(norm_add_row, &p, R, (int64_t)R * N >= 32768);
}

typedef struct {
    float *x;
    int64_t n;
    float cap;
} softcap_t;

enum { SOFTCAP_CHUNK = 16384 };

/* tanh(u) = 1 - 2 / (1 + exp(2u)), with the exponentials qmm_exp's (vectorized) a stack block at a time */
static void softcap_chunk(void *ctx, int task) {
    const softcap_t *p = (const softcap_t *)ctx;
    const int64_t i0 = (int64_t)task * SOFTCAP_CHUNK, i1 = i0 + SOFTCAP_CHUNK < p->n ? i0 + SOFTCAP_CHUNK : p->n;
    const float two_over = 2.0f / p->cap, cap = p->cap;
    float e[SILU_CHUNK];
    for (int64_t b = i0; b < i1; b += SILU_CHUNK) {
        const int n = i1 - b < SILU_CHUNK ? (int)(i1 - b) : SILU_CHUNK;
        float *x = p->x + b;
        for (int i = 0; i < n; i++) e[i] = x[i] * two_over;
        qmm_exp(e, n, e);
        for (int i = 0; i < n; i++) x[i] = cap - 2.0f * cap / (1.0f + e[i]);
    }
}

/* x [n] := tanh(x / cap) * cap in place (float32; final logit soft-capping), in chunks on the pool's threads */
void qmm_softcap(float *x, int64_t n, float cap) {
    softcap_t p = {x, n, cap};
    const int tasks = (int)((n + SOFTCAP_CHUNK - 1) / SOFTCAP_CHUNK);
    pool_run(softcap_chunk, &p, tasks, n >= (1 << 20)); /* a few rows: quicker here than waking the pool */
}
