/* Bidirectional attention for encoders (BERT-family embedding models and rerankers) on the native pool.

   q, k, v, out: [B, T, H, D] float32 (rows of H * D values, row strides ld_*); sequence b's queries attend to its
   first lens[b] keys (right padding), every query row of it alike (padding rows too: their output is unused).
   A task is one sequence and one head: it transposes the head's keys to [D, L] in scratch once, then, 16 query
   rows at a time, takes the scores 8 query rows x 16 keys at a time (one fma per d), a float32 softmax (exp by a degree-6
   polynomial and vscalefps), then the weighed sum of the value rows, 8 rows (D 32) or 4 rows (D 64) at a time.
   Each output row's arithmetic does not depend on the other rows or the batch. D is 32 or 64 (else -1: the caller
   runs torch's attention), on AVX-512 builds; elsewhere qmm_encoder_attention refuses with -1. */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "simd_exp.h"

#if defined(QMM_VNNI)
#include <immintrin.h>

enum { QB = 16, RB = 8 };

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_key_make(void) { pthread_key_create(&scratch_key, free); }

/* this thread's scratch of at least `bytes` (kept for its next task; freed when the thread ends) */
static float *scratch(size_t bytes) {
    pthread_once(&scratch_once, scratch_key_make);
    size_t *buf = (size_t *)pthread_getspecific(scratch_key);
    if (buf && buf[0] >= bytes) return (float *)(buf + 8);
    free(buf);
    buf = (size_t *)malloc(bytes + 8 * sizeof(size_t));
    if (buf) buf[0] = bytes;
    pthread_setspecific(scratch_key, buf);
    return buf ? (float *)(buf + 8) : 0;
}

typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t ld_q, ld_k, ld_v, ld_o;
    int T, H, D;
    const int32_t *lens;
    float scale;
} enc_attn_t;

/* scores s[r][j] (row stride ls) = scale * q_r . k_j for nr <= RB query rows and keys j < L (kt: [D, ls]) */
static inline __attribute__((always_inline)) void scores(const float *const *qr, int nr, const float *kt, int ls,
                                                         int L, int D, float scale, float *s) {
    for (int j = 0; j < L; j += 16) {
        const __mmask16 m = L - j >= 16 ? 0xFFFF : (__mmask16)((1u << (L - j)) - 1);
        __m512 acc[RB];
        for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 kv = _mm512_loadu_ps(kt + (int64_t)d * ls + j);
            for (int r = 0; r < RB; r++)
                if (r < nr) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kv, acc[r]);
        }
        for (int r = 0; r < nr; r++) _mm512_mask_storeu_ps(s + (int64_t)r * ls + j, m, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
    }
}

/* s[0 .. L) -> e^(s - max) in place; returns 1 / their sum */
static inline float softmax_row(float *s, int L) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    for (int j = 0; j < L; j += 16) {
        const __mmask16 m = L - j >= 16 ? 0xFFFF : (__mmask16)((1u << (L - j)) - 1);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), m, s + j));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < L; j += 16) {
        const __mmask16 m = L - j >= 16 ? 0xFFFF : (__mmask16)((1u << (L - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top)));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* out_r = inv_r * sum_j p[r][j] v_j for nr <= NR rows, DV = D / 16 vectors per row */
static inline __attribute__((always_inline)) void weigh(const float *p, int ls, int nr, int NR, int DV,
                                                        const float *v, int64_t ld_v, int L, const float *inv,
                                                        float *const *orow) {
    __m512 acc[RB * 4];
    if (nr > NR) nr = NR; /* (callers never pass more; tells the compiler every stored accumulator was set) */
    for (int i = 0; i < NR * DV; i++) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j < L; j++) {
        const float *vj = v + (int64_t)j * ld_v;
        __m512 vv[4];
        for (int c = 0; c < DV; c++) vv[c] = _mm512_loadu_ps(vj + 16 * c);
        for (int r = 0; r < NR; r++) {
            if (r >= nr) break;
            const __m512 pr = _mm512_set1_ps(p[(int64_t)r * ls + j]);
            for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_fmadd_ps(pr, vv[c], acc[r * DV + c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(orow[r] + 16 * c, _mm512_mul_ps(acc[r * DV + c], _mm512_set1_ps(inv[r])));
}

static void attend_task(void *ctx, int task) {
    const enc_attn_t *a = (const enc_attn_t *)ctx;
    const int h = task % a->H, b = task / a->H;
    const int L = a->lens[b], D = a->D;
    const int ls = (L + 15) & ~15;
    float *kt = scratch(((size_t)D * ls + (size_t)QB * ls) * sizeof(float));
    if (!kt) abort();
    float *s = kt + (size_t)D * ls;
    const float *kb = a->k + (int64_t)b * a->T * a->ld_k + h * D, *vb = a->v + (int64_t)b * a->T * a->ld_v + h * D;
    for (int d = 0; d < D; d++)
        for (int j = 0; j < L; j++) kt[(int64_t)d * ls + j] = kb[(int64_t)j * a->ld_k + d];
    for (int t0 = 0; t0 < a->T; t0 += QB) {
        const int nq = a->T - t0 < QB ? a->T - t0 : QB;
        const float *qr[QB];
        float *orow[QB];
        float inv[QB];
        for (int r = 0; r < nq; r++) {
            qr[r] = a->q + ((int64_t)b * a->T + t0 + r) * a->ld_q + h * D;
            orow[r] = a->out + ((int64_t)b * a->T + t0 + r) * a->ld_o + h * D;
        }
        for (int r = 0; r < nq; r += RB)
            scores(qr + r, nq - r < RB ? nq - r : RB, kt, ls, L, D, a->scale, s + (int64_t)r * ls);
        for (int r = 0; r < nq; r++) inv[r] = softmax_row(s + (int64_t)r * ls, L);
        if (D == 32)
            for (int r = 0; r < nq; r += 8) weigh(s + (int64_t)r * ls, ls, nq - r, 8, 2, vb, a->ld_v, L, inv + r, orow + r);
        else
            for (int r = 0; r < nq; r += 4) weigh(s + (int64_t)r * ls, ls, nq - r, 4, 4, vb, a->ld_v, L, inv + r, orow + r);
    }
}

int qmm_encoder_attention_available(void) { return 1; }

int qmm_encoder_attention(const float *q, int64_t ld_q, const float *k, int64_t ld_k, const float *v, int64_t ld_v,
                          int B, int T, int H, int D, const int32_t *lens, float scale, float *out, int64_t ld_o) {
    if (D != 32 && D != 64) return -1;
    for (int b = 0; b < B; b++)
        if (lens[b] < 1 || lens[b] > T) return -2;
    enc_attn_t a = {q, k, v, out, ld_q, ld_k, ld_v, ld_o, T, H, D, lens, scale};
    pool_run(attend_task, &a, B * H, (int64_t)T * T * H * D >= (1 << 16));
    return 0;
}

#else

int qmm_encoder_attention_available(void) { return 0; }

int qmm_encoder_attention(const float *q, int64_t ld_q, const float *k, int64_t ld_k, const float *v, int64_t ld_v,
                          int B, int T, int H, int D, const int32_t *lens, float scale, float *out, int64_t ld_o) {
    (void)q, (void)ld_q, (void)k, (void)ld_k, (void)v, (void)ld_v, (void)B, (void)T, (void)H, (void)D, (void)lens;
    (void)scale, (void)out, (void)ld_o;
    return -1;
}

#endif
