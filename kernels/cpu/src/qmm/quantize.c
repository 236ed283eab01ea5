/* Activations quantized per row to int8 blocks of 32 (one float scale each, and the sums of 16). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "pool.h"
#include "qmatmul.h"

/* One block of 32 values (already float32 in buf) into q, its scale and its two sums of 16. */
__attribute__((unused)) static inline void quantize_block(const float *buf, int8_t *q, float *da, int16_t *sa) {
    float amax = 0.0f;
    for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(buf[l]));
    float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    int s0 = 0, s1 = 0;
    for (int l = 0; l < 32; l++) {
        int v = (int)nearbyintf(buf[l] * id);
        q[l] = (int8_t)v;
        if (l < 16) s0 += v; else s1 += v;
    }
    *da = d;
    sa[0] = (int16_t)s0;
    sa[1] = (int16_t)s1;
}

#if defined(QMM_AVX2)
#include "arch/x86/quantize.h"
#endif

typedef struct {
    const void *x;
    int is_bf16, K, rows_per_task, M;
    int64_t ldx;
    int8_t *qa;
    float *da;
    int16_t *sa;
} quant_job_t;

static void quantize_rows(void *ctx, int task) {
    const quant_job_t *j = (const quant_job_t *)ctx;
    const int K = j->K, r1 = (task + 1) * j->rows_per_task < j->M ? (task + 1) * j->rows_per_task : j->M;
    for (int r = task * j->rows_per_task; r < r1; r++) {
        for (int b = 0; b < K / 32; b++) {
            const int64_t base = r * j->ldx + b * 32;
            int8_t *q = j->qa + (int64_t)r * K + b * 32;
            float *d = j->da + (int64_t)r * (K / 32) + b;
            int16_t *s = j->sa + (int64_t)r * (K / 16) + 2 * b;
#if defined(QMM_AVX2)
            quantize_block_avx2(j->x, j->is_bf16, base, q, d, s);
#else
            float buf[32];
            if (j->is_bf16) {
                const uint16_t *xs = (const uint16_t *)j->x + base;
                for (int l = 0; l < 32; l++) buf[l] = bf16_to_f32(xs[l]);
            } else {
                memcpy(buf, (const float *)j->x + base, sizeof buf);
            }
            quantize_block(buf, q, d, s);
#endif
        }
    }
}

/* Quantize M rows of x (float32, or bfloat16 when is_bf16) of K values (K % 32 == 0, row stride ldx
   elements) into qa [M, K] int8, da [M, K/32] scales and sa [M, K/16] sums of 16. Every block is quantized on
   its own, so how rows are split over threads changes no bits. */
void qmm_quantize(const void *x, int is_bf16, int64_t ldx, int M, int K, int8_t *qa, float *da, int16_t *sa) {
    /* rows of a few thousand values per task: smaller jobs cost more to hand over than they take */
    const int per = (8192 + K - 1) / K;
    quant_job_t j = {x, is_bf16, K, per, M, ldx, qa, da, sa};
    const int tasks = (M + per - 1) / per;
    pool_run(quantize_rows, &j, tasks, (int64_t)M * K >= 16384);
}

