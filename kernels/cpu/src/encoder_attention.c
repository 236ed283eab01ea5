/* Bidirectional attention for encoders (BERT-family embedding models and rerankers, vision towers) on the native pool.

   q, k, v, out: [B, T, H, D] float32 (rows of H * D values, row strides ld_*); sequence b's queries attend to its
   first lens[b] keys (right padding), every query row of it alike (padding rows too: their output is unused).
   A task is one sequence, one head and QB query rows: it transposes the head's keys to [D, L] in scratch once per
   sequence and head, then walks the keys KB at a time (so the scores, the keys' block and the values' block stay in
   cache however long the sequence: a vision tower's 4,096 patches): the scores 8 query rows x 16 keys at a time (one
   fma per d), an online float32 softmax (exp by a degree-6 polynomial and vscalefps; each row's running sum and
   output rescaled by e^(old max - new max) when a block raises its max), then the weighed sum of the block's value
   rows, 8 rows (D <= 32), 4 rows (D <= 80) or 2 rows at a time. Each output row's arithmetic depends only on its own
   query and its sequence's keys and values, not on the other rows or the batch. D is a multiple of 8 up to 128 (else
   -1: the caller runs torch's attention), on AVX-512 builds; elsewhere qmm_encoder_attention refuses with -1. */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "encoder_attention.h"
#include "pool.h"
#include "simd_exp.h"

#if defined(QMM_VNNI)
#include <immintrin.h>

enum { QB = 32, KB = 256, G = 8 }; /* query rows a task (two vectors of lanes), keys a block, keys / dims a tile */

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
    int T, H, D, QT; /* QT: query blocks per sequence */
    const int32_t *lens;
    float scale;
} enc_attn_t;

/* s[j][0 .. QB) = scale * q_lane . k_j for keys j0 <= j < j0 + nk (nk <= G); qt: the queries [D][QB] */
static inline void scores(const float *qt, const float *k, int64_t ld_k, int j0, int nk, int D, float scale, float *s) {
    __m512 acc[2][G];
    const float *kr[G];
    for (int g = 0; g < G; g++) {
        acc[0][g] = acc[1][g] = _mm512_setzero_ps();
        kr[g] = k + (int64_t)(j0 + (g < nk ? g : 0)) * ld_k;
    }
    for (int d = 0; d < D; d++) {
        const __m512 a0 = _mm512_loadu_ps(qt + d * QB), a1 = _mm512_loadu_ps(qt + d * QB + 16);
        for (int g = 0; g < G; g++) {
            const __m512 b = _mm512_set1_ps(kr[g][d]);
            acc[0][g] = _mm512_fmadd_ps(a0, b, acc[0][g]);
            acc[1][g] = _mm512_fmadd_ps(a1, b, acc[1][g]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < nk; g++) {
        _mm512_storeu_ps(s + (int64_t)(j0 + g) * QB, _mm512_mul_ps(acc[0][g], sc));
        _mm512_storeu_ps(s + (int64_t)(j0 + g) * QB + 16, _mm512_mul_ps(acc[1][g], sc));
    }
}

/* ot[d][lane] += sum_j p[j][lane] v_j[d] over the block's n keys (v: its first value row) for dims d0 .. d0 + G */
static inline void weigh(const float *p, int n, const float *v, int64_t ld_v, int d0, float *ot) {
    __m512 acc[2][G];
    for (int g = 0; g < G; g++) {
        acc[0][g] = _mm512_loadu_ps(ot + (d0 + g) * QB);
        acc[1][g] = _mm512_loadu_ps(ot + (d0 + g) * QB + 16);
    }
    for (int j = 0; j < n; j++) {
        const float *vj = v + (int64_t)j * ld_v + d0;
        const __m512 p0 = _mm512_loadu_ps(p + (int64_t)j * QB), p1 = _mm512_loadu_ps(p + (int64_t)j * QB + 16);
        for (int g = 0; g < G; g++) {
            const __m512 b = _mm512_set1_ps(vj[g]);
            acc[0][g] = _mm512_fmadd_ps(p0, b, acc[0][g]);
            acc[1][g] = _mm512_fmadd_ps(p1, b, acc[1][g]);
        }
    }
    for (int g = 0; g < G; g++) {
        _mm512_storeu_ps(ot + (d0 + g) * QB, acc[0][g]);
        _mm512_storeu_ps(ot + (d0 + g) * QB + 16, acc[1][g]);
    }
}

/* the block's scores s[0 .. n) -> e^(s - new max) in place; the running max m, sum l and output ot (D rows of
   lanes) rescaled by e^(old max - new max) */
static inline void online_softmax(float *s, int n, __m512 m[2], __m512 l[2], float *ot, int D) {
    for (int h = 0; h < 2; h++) {
        __m512 mx = m[h];
        for (int j = 0; j < n; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + (int64_t)j * QB + 16 * h));
        const __m512 c = exp16(_mm512_sub_ps(m[h], mx)); /* the first block: e^(-inf) = 0 */
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            float *sj = s + (int64_t)j * QB + 16 * h;
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sj), mx));
            _mm512_storeu_ps(sj, e);
            sum = _mm512_add_ps(sum, e);
        }
        l[h] = _mm512_fmadd_ps(l[h], c, sum);
        m[h] = mx;
        for (int d = 0; d < D; d++) {
            float *o = ot + d * QB + 16 * h;
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), c));
        }
    }
}

static void attend_task(void *ctx, int task) {
    const enc_attn_t *a = (const enc_attn_t *)ctx;
    const int qb = task % a->QT, h = (task / a->QT) % a->H, b = task / a->QT / a->H;
    const int L = a->lens[b], D = a->D, t0 = qb * QB;
    const int nq = a->T - t0 < QB ? a->T - t0 : QB;
    float *qt = scratch((size_t)(2 * D + KB) * QB * sizeof(float));
    if (!qt) abort();
    float *ot = qt + (size_t)D * QB, *s = ot + (size_t)D * QB;
    const float *kb = a->k + (int64_t)b * a->T * a->ld_k + h * D, *vb = a->v + (int64_t)b * a->T * a->ld_v + h * D;
    for (int r = 0; r < QB; r++) {
        const float *qr = a->q + ((int64_t)b * a->T + t0 + r) * a->ld_q + h * D;
        for (int d = 0; d < D; d++) qt[d * QB + r] = r < nq ? qr[d] : 0.0f;
    }
    for (int i = 0; i < D * QB; i++) ot[i] = 0.0f;
    __m512 m[2] = {_mm512_set1_ps(-__builtin_inff()), _mm512_set1_ps(-__builtin_inff())};
    __m512 l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j0 = 0; j0 < L; j0 += KB) {
        const int n = L - j0 < KB ? L - j0 : KB;
        const float *kblock = kb + (int64_t)j0 * a->ld_k;
        for (int j = 0; j < n; j += G) scores(qt, kblock, a->ld_k, j, n - j < G ? n - j : G, D, a->scale, s);
        online_softmax(s, n, m, l, ot, D);
        for (int d0 = 0; d0 < D; d0 += G) weigh(s, n, vb + (int64_t)j0 * a->ld_v, a->ld_v, d0, ot);
    }
    float inv[QB];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l[0]));
    _mm512_storeu_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l[1]));
    for (int r = 0; r < nq; r++) {
        float *orow = a->out + ((int64_t)b * a->T + t0 + r) * a->ld_o + h * D;
        for (int d = 0; d < D; d++) orow[d] = ot[d * QB + r] * inv[r];
    }
}

int qmm_encoder_attention_available(void) { return 1; }

int qmm_encoder_attention(const float *q, int64_t ld_q, const float *k, int64_t ld_k, const float *v, int64_t ld_v,
                          int B, int T, int H, int D, const int32_t *lens, float scale, float *out, int64_t ld_o) {
    if (D % G || D < G || D > 128) return -1;
    for (int b = 0; b < B; b++)
        if (lens[b] < 1 || lens[b] > T) return -2;
    const int QT = (T + QB - 1) / QB;
    enc_attn_t a = {q, k, v, out, ld_q, ld_k, ld_v, ld_o, T, H, D, QT, lens, scale};
    pool_run(attend_task, &a, B * H * QT, (int64_t)T * T * H * D >= (1 << 16));
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
