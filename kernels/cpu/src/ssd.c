/* The SSD (Mamba-2) recurrence on the CPU, float32, token by token over a ragged batch whose states live in a
   slot-indexed pool (ssd.h says what is computed; kernels/torch/mamba2.py is the torch twin).

   A task is one (sequence, head): it walks the sequence's tokens in order over the head's [P, N] state, each state
   row read once and written once a token (decay, input, output dot in one pass), where the torch twin gathers the
   states, makes four temporaries of the whole state and scatters it back. The state of a head (P x N floats, 32 KiB
   at 64 x 128) stays in cache across a prompt's tokens. So the result does not depend on the thread count or on what
   else is in the batch. */

#include <math.h>
#include <stdint.h>

#include "pool.h"
#include "ssd.h"
#include "subnormals.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

typedef struct {
    const float *x, *B, *C, *dt, *A, *D;
    int64_t ldx, slot_stride;
    int H, P, N, G;
    const int32_t *cu, *slots;
    float *state, *y;
} ssd_t;

/* row[n] = row[n] * decay + xd * b[n] for n < N; returns sum of row[n] * c[n] (the updated row). */
static float ssd_row(float *restrict row, const float *restrict b, const float *restrict c, int N, float decay,
                     float xd) {
    int n = 0;
    float acc = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vd = _mm256_set1_ps(decay), vx = _mm256_set1_ps(xd);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; n + 16 <= N; n += 16) {
        __m256 r0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + n), vd, _mm256_mul_ps(vx, _mm256_loadu_ps(b + n)));
        __m256 r1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + n + 8), vd, _mm256_mul_ps(vx, _mm256_loadu_ps(b + n + 8)));
        _mm256_storeu_ps(row + n, r0);
        _mm256_storeu_ps(row + n + 8, r1);
        s0 = _mm256_fmadd_ps(r0, _mm256_loadu_ps(c + n), s0);
        s1 = _mm256_fmadd_ps(r1, _mm256_loadu_ps(c + n + 8), s1);
    }
    __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    acc = _mm_cvtss_f32(h);
#endif
    for (; n < N; n++) {
        const float r = row[n] * decay + xd * b[n];
        row[n] = r;
        acc += r * c[n];
    }
    return acc;
}

static void ssd_head_task(const ssd_t *a, int task) {
    const int h = task % a->H, seq = task / a->H, P = a->P, N = a->N;
    const int g = h / (a->H / a->G);
    float *S = a->state + (int64_t)a->slots[seq] * a->slot_stride + (int64_t)h * P * N;
    const float A = a->A[h], D = a->D[h];
    for (int t = a->cu[seq]; t < a->cu[seq + 1]; t++) {
        const float dt = a->dt[(int64_t)t * a->H + h], decay = expf(dt * A);
        const float *x = a->x + t * a->ldx + (int64_t)h * P;
        const float *b = a->B + t * a->ldx + (int64_t)g * N, *c = a->C + t * a->ldx + (int64_t)g * N;
        float *y = a->y + ((int64_t)t * a->H + h) * P;
        for (int p = 0; p < P; p++)
            y[p] = ssd_row(S + (int64_t)p * N, b, c, N, decay, dt * x[p]) + D * x[p];
    }
}

/* A head's task with subnormal floats flushed to zero (subnormals.h): a decayed state full of them. */
static void ssd_head(void *ctx, int task) {
    const fp_mode_t mode = subnormals_off();
    ssd_head_task((const ssd_t *)ctx, task);
    fp_mode_restore(mode);
}

void qmm_ssd_rule(const float *x, const float *B, const float *C, int64_t ldx, const float *dt, const float *A,
                  const float *D, int H, int P, int N, int G, const int32_t *cu, int nseq, float *state,
                  int64_t slot_stride, const int32_t *slots, float *y) {
    ssd_t a = {x, B, C, dt, A, D, ldx, slot_stride, H, P, N, G, cu, slots, state, y};
    pool_run(ssd_head, &a, nseq * H, (int64_t)cu[nseq] * H * P * N >= 65536);
}
