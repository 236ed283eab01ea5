/* The grouped expert matmul of a Mixture-of-Experts layer: one projection of every expert (its parts stacked along
   the output rows, each part [experts, rows, bytes per row] of GGUF blocks) over a step's activation rows sorted
   by expert, in one call.

   The tasks are (active expert, part, chunk of weight rows); the pool's threads take them from one counter, so
   the experts of a decode step (a row or two each) run side by side instead of one small matmul after another.
   Each task is qmm/matmul.c's own task (qmm_rows) over the expert's contiguous activation rows, so every output is
   the same bits as a per-expert qmm_matmul gives, whatever the batch or the thread count. */

#include <stdint.h>
#include <stdlib.h>

#include "half.h"
#include "moe.h"
#include "pool.h"
#include "qmatmul.h"

typedef struct {
    int active, part, n0, n1;
} moe_task_t;

typedef struct {
    const moe_task_t *tasks;
    const int *fmt, *experts, *starts;
    const uint8_t *const *w;
    const int64_t *expert_bytes, *row_bytes, *col;
    int K;
    const int8_t *qa;
    const float *da, *fs;
    const int16_t *sa;
    float *out;
    int64_t ldo;
} moe_job_t;

static void run_task(void *ctx, int i) {
    const moe_job_t *j = (const moe_job_t *)ctx;
    const moe_task_t *t = &j->tasks[i];
    const int K = j->K, s = j->starts[t->active], m = j->starts[t->active + 1] - s, p = t->part;
    const uint8_t *w = j->w[p] + (int64_t)j->experts[t->active] * j->expert_bytes[p];
    qmm_rows(j->fmt[p], w, j->row_bytes[p], t->n0, t->n1, K, j->qa + (int64_t)s * K, j->da + (int64_t)s * (K / 32),
             j->sa + (int64_t)s * (K / 16), j->fs ? j->fs + (int64_t)s * (K / 32) : 0, m,
             j->out + (int64_t)s * j->ldo + j->col[p], j->ldo);
}

enum { TASKS_PER_THREAD = 8, MIN_CHUNK = 16, MAX_CHUNK = 512, MAX_PARTS = 4 };

/* out[r, :] (row stride ldo) = activation row r times its expert's weight, for the rows [starts[a], starts[a + 1])
   of each active expert experts[a] (a < n_active); the weight is n_parts parts stacked along its output rows: part
   p in format fmt[p] at w[p], expert e's rows at w[p] + e * expert_bytes[p], rows[p] rows of row_bytes[p] bytes
   and K values each. qa, da, sa: the quantized activations (qmm_quantize) of all starts[n_active] rows. Returns 0;
   -1 when its scratch memory could not be allocated, -2 for more than MAX_PARTS parts (nothing computed). */
int qmm_moe_matmul(int n_parts, const int *fmt, const uint8_t *const *w, const int64_t *expert_bytes,
                   const int64_t *row_bytes, const int *rows, int K, const int8_t *qa, const float *da,
                   const int16_t *sa, int n_active, const int *experts, const int *starts, float *out, int64_t ldo) {
    if (n_parts < 1 || n_parts > MAX_PARTS) return -2;
    if (n_active < 1) return 0;
    const int total_rows = starts[n_active] - starts[0];
    int64_t col[MAX_PARTS], weight_rows = 0;
    int needs_sums = 0;
    for (int p = 0; p < n_parts; p++) {
        col[p] = weight_rows;
        weight_rows += rows[p];
        needs_sums |= qmm_needs_sums(fmt[p]);
    }
    /* rows per task: a few tasks per thread over all the step's (expert, weight row) pairs; a multiple of 16 */
    const int64_t work = (int64_t)n_active * weight_rows, want = (int64_t)TASKS_PER_THREAD * pool_threads();
    int64_t chunk = (work + want - 1) / want;
    chunk = (chunk + MIN_CHUNK - 1) / MIN_CHUNK * MIN_CHUNK;
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk > MAX_CHUNK ? MAX_CHUNK : chunk;
    int64_t n_tasks = 0;
    for (int p = 0; p < n_parts; p++) n_tasks += (int64_t)n_active * ((rows[p] + chunk - 1) / chunk);
    moe_task_t *tasks = (moe_task_t *)malloc(n_tasks * sizeof(moe_task_t));
    float *fs = 0;
    if (needs_sums) fs = (float *)malloc(((int64_t)starts[n_active] * (K / 32) + 1) * sizeof(float));
    if (!tasks || (needs_sums && !fs)) {
        free(tasks);
        free(fs);
        return -1;
    }
    if (fs) qmm_offset_sums(da, sa, (int64_t)starts[n_active] * (K / 32), fs);
    int64_t i = 0;
    for (int a = 0; a < n_active; a++)
        for (int p = 0; p < n_parts; p++)
            for (int n0 = 0; n0 < rows[p]; n0 += (int)chunk) {
                moe_task_t t = {a, p, n0, n0 + chunk < rows[p] ? n0 + (int)chunk : rows[p]};
                tasks[i++] = t;
            }
    moe_job_t job = {tasks, fmt, experts, starts, w, expert_bytes, row_bytes, col, K, qa, da, fs, sa, out, ldo};
    pool_run(run_task, &job, (int)n_tasks, (int64_t)total_rows * weight_rows * K >= (1 << 16));
    free(tasks);
    free(fs);
    return 0;
}

/* ---- float32 weights (the router): out[t, n] = sum_k x[t, k] w[n, k] ------------------------------------------ */

#if defined(QMM_AVX2)
#include <immintrin.h>
#endif

typedef struct {
    const void *x;
    int is_bf16, T, N, K, rows_per_task;
    int64_t ldx, ldo;
    const float *w;
    float *out, *xf; /* xf: the rows of x as float32 when x is bfloat16 */
} f32_job_t;

/* one fixed-order dot product: 8 lanes (or 1 in portable C) over K, then a fixed reduction, then the tail */
static float dot_f32(const float *a, const float *b, int K) {
    int k = 0;
    float s = 0.0f;
#if defined(QMM_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    s = _mm_cvtss_f32(q);
#endif
    for (; k < K; k++) s += a[k] * b[k];
    return s;
}

static void f32_rows(void *ctx, int task) {
    const f32_job_t *j = (const f32_job_t *)ctx;
    const int t1 = (task + 1) * j->rows_per_task < j->T ? (task + 1) * j->rows_per_task : j->T;
    for (int t = task * j->rows_per_task; t < t1; t++) {
        const float *xr;
        if (j->is_bf16) {
            float *buf = j->xf + (int64_t)t * j->K;
            const uint16_t *src = (const uint16_t *)j->x + (int64_t)t * j->ldx;
            for (int k = 0; k < j->K; k++) buf[k] = bf16_to_f32(src[k]);
            xr = buf;
        } else {
            xr = (const float *)j->x + (int64_t)t * j->ldx;
        }
        for (int n = 0; n < j->N; n++) j->out[(int64_t)t * j->ldo + n] = dot_f32(xr, j->w + (int64_t)n * j->K, j->K);
    }
}

/* out[t, n] (row stride ldo) = x[t, :] . w[n, :] for T rows of x (float32, or bfloat16 when is_bf16; row stride ldx)
   and a float32 weight w [N, K]: each value one fixed-order dot product, so a row's result does not depend on the
   other rows or the threads. Returns 0, or -1 when its scratch memory could not be allocated. */
int qmm_f32_matmul(const void *x, int is_bf16, int64_t ldx, int T, const float *w, int N, int K, float *out,
                   int64_t ldo) {
    if (T < 1) return 0;
    float *xf = 0;
    if (is_bf16 && !(xf = (float *)malloc((int64_t)T * K * sizeof(float)))) return -1;
    const int per = (int)((65536 + (int64_t)N * K - 1) / ((int64_t)N * K)); /* rows of at least 64k products */
    f32_job_t job = {x, is_bf16, T, N, K, per, ldx, ldo, w, out, xf};
    pool_run(f32_rows, &job, (T + per - 1) / per, (int64_t)T * N * K >= (1 << 17));
    free(xf);
    return 0;
}
