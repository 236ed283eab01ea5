/* LoRA adapters beside the quantized base matmuls of the fused decoder stack (layer.c): for each row t of a step
   that runs adapter slot[t] at scale s[t], out[t, :] += s[t] * (x[t, :] A^T) B^T, with the adapter's A [R, K] and,
   for each stacked part of the fused weight (q/k/v, gate/up), that part's B transposed [r_p, n_p] (its own
   alpha / r folded in), all float32 or all bfloat16. The base weight is never read or changed: a quantized base
   stays in its blocks and the adapter applies to the activations.

   The step's rows come grouped by adapter (segments), so each adapter's weights are read once per step whatever
   its number of rows: first t = x A^T for every row of a segment (a dot product per rank row of A), then
   out += t B^T per part, in 16-column vectors. Every value is accumulated in a fixed order that depends only on its
   row and column, so a row's result does not depend on the batch or the threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#if defined(__GNUC__) && !defined(__clang__)
/* 16-float vectors pass between this file's static functions only (inlined): no ABI reaches another unit */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

enum { LORA_MAX_PARTS = 3, LORA_GROUP = 4, LORA_COLS = 256, LORA_SPLIT = 4 /* phase 1 tasks per slot */ };

typedef struct {
    const void *a; /* [r, K], NULL: this adapter leaves the weight alone */
    int32_t r, n_parts;
    int32_t part_r0[LORA_MAX_PARTS], part_r[LORA_MAX_PARTS]; /* the part's rows of A */
    int32_t part_c0[LORA_MAX_PARTS], part_n[LORA_MAX_PARTS]; /* its output columns */
    const void *b[LORA_MAX_PARTS];                          /* [part_r, part_n] */
} lora_weight_t;

/* One step's adapters: tables[a] is slot a's [n_layers * 4] weights (qkv, o, gate_up, down per layer); the rows of
   slot a are seg_rows[seg_start[a] .. seg_start[a + 1] - 1]. */
typedef struct {
    int32_t n_adapters, w_bf16;
    const float *row_scale; /* [T] */
    const lora_weight_t *const *tables;
    const int32_t *seg_start, *seg_rows;
} lora_step_t;

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f load16(const void *p, int bf16, int64_t i) {
    v16f v;
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&v, &u, sizeof v);
    } else {
        memcpy(&v, (const float *)p + i, sizeof v);
    }
    return v;
}

static inline float load1(const void *p, int bf16, int64_t i) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

typedef struct {
    const lora_step_t *s;
    int layer, target, K, N, R;
    const float *x; /* [T, K] float32, row stride ldx */
    int64_t ldx, ldo;
    float *out, *t; /* t: [T, R] the rows' x A^T (times their scale) */
    int32_t *tasks; /* phase 2: (slot, part, first column) per task */
} lora_job_t;

static const lora_weight_t *weight(const lora_job_t *j, int slot) {
    const lora_weight_t *w = &j->s->tables[slot][4 * j->layer + j->target];
    return w->a ? w : 0;
}

/* t[row, r] = scale[row] * x[row] . A[r] for G rows and r in [r_lo, r_hi); G is a constant in each instance, so the
   accumulators stay in registers */
#define LORA_DOWN(G)                                                                                              \
    static void down_##G(const lora_job_t *j, const lora_weight_t *w, const int32_t *rows, int r_lo, int r_hi) {   \
        const int K = j->K, wb = j->s->w_bf16, k16 = K / 16 * 16;                                                \
        const float *xr[G];                                                                                        \
        for (int i = 0; i < G; i++) xr[i] = j->x + (int64_t)rows[i] * j->ldx;                                     \
        for (int r = r_lo; r < r_hi; r++) {                                                                        \
            v16f acc[G];                                                                                           \
            for (int i = 0; i < G; i++) acc[i] = (v16f){0};                                                        \
            for (int k = 0; k < k16; k += 16) {                                                                    \
                const v16f av = load16(w->a, wb, (int64_t)r * K + k);                                              \
                for (int i = 0; i < G; i++) {                                                                      \
                    v16f xv;                                                                                       \
                    memcpy(&xv, xr[i] + k, sizeof xv);                                                             \
                    acc[i] += xv * av;                                                                             \
                }                                                                                                  \
            }                                                                                                      \
            for (int i = 0; i < G; i++) {                                                                          \
                float sum = hsum(acc[i]);                                                                          \
                for (int k = k16; k < K; k++) sum += xr[i][k] * load1(w->a, wb, (int64_t)r * K + k);              \
                j->t[(int64_t)rows[i] * j->R + r] = j->s->row_scale[rows[i]] * sum;                               \
            }                                                                                                      \
        }                                                                                                          \
    }
LORA_DOWN(1)
LORA_DOWN(2)
LORA_DOWN(3)
LORA_DOWN(4)

/* out[row, n0 .. n1) += t[row, the part's rows] B_part for G rows (n1 - n0 a multiple of 16, or the part's tail) */
#define LORA_UP(G)                                                                                                \
    static void up_##G(const lora_job_t *j, const lora_weight_t *w, int p, const int32_t *rows, int c, int c1) {  \
        const int wb = j->s->w_bf16, np = w->part_n[p], rp = w->part_r[p], v1 = c + (c1 - c) / 16 * 16;         \
        float *o[G];                                                                                               \
        const float *t[G];                                                                                         \
        for (int i = 0; i < G; i++) {                                                                              \
            o[i] = j->out + (int64_t)rows[i] * j->ldo + w->part_c0[p];                                             \
            t[i] = j->t + (int64_t)rows[i] * j->R + w->part_r0[p];                                                 \
        }                                                                                                          \
        for (int n = c; n < v1; n += 16) {                                                                         \
            v16f acc[G];                                                                                           \
            for (int i = 0; i < G; i++) memcpy(&acc[i], o[i] + n, sizeof(v16f));                                   \
            for (int r = 0; r < rp; r++) {                                                                         \
                const v16f bv = load16(w->b[p], wb, (int64_t)r * np + n);                                          \
                for (int i = 0; i < G; i++) acc[i] += t[i][r] * bv;                                                \
            }                                                                                                      \
            for (int i = 0; i < G; i++) memcpy(o[i] + n, &acc[i], sizeof(v16f));                                   \
        }                                                                                                          \
        for (int n = v1; n < c1; n++)                                                                              \
            for (int i = 0; i < G; i++) {                                                                          \
                float acc = o[i][n];                                                                               \
                for (int r = 0; r < rp; r++) acc += t[i][r] * load1(w->b[p], wb, (int64_t)r * np + n);           \
                o[i][n] = acc;                                                                                     \
            }                                                                                                      \
    }
LORA_UP(1)
LORA_UP(2)
LORA_UP(3)
LORA_UP(4)

/* phase 1, task = (slot, a quarter of its rank): t = scale * x A^T for the slot's rows, LORA_GROUP at a time */
static void lora_down(void *ctx, int task) {
    const lora_job_t *j = (const lora_job_t *)ctx;
    const int slot = task / LORA_SPLIT, q = task % LORA_SPLIT;
    const lora_weight_t *w = weight(j, slot);
    if (!w) return;
    const int r_lo = w->r * q / LORA_SPLIT, r_hi = w->r * (q + 1) / LORA_SPLIT;
    const int32_t *rows = j->s->seg_rows + j->s->seg_start[slot];
    const int m = j->s->seg_start[slot + 1] - j->s->seg_start[slot];
    for (int g = 0; g < m; g += LORA_GROUP) {
        switch (m - g < LORA_GROUP ? m - g : LORA_GROUP) {
        case 1: down_1(j, w, rows + g, r_lo, r_hi); break;
        case 2: down_2(j, w, rows + g, r_lo, r_hi); break;
        case 3: down_3(j, w, rows + g, r_lo, r_hi); break;
        default: down_4(j, w, rows + g, r_lo, r_hi);
        }
    }
}

/* phase 2, task = (slot, part, LORA_COLS columns from c): out[row, cols] += t[row, part's rows] B_part */
static void lora_up(void *ctx, int task) {
    const lora_job_t *j = (const lora_job_t *)ctx;
    const int slot = j->tasks[3 * task], p = j->tasks[3 * task + 1], c = j->tasks[3 * task + 2];
    const lora_weight_t *w = weight(j, slot);
    const int c1 = c + LORA_COLS < w->part_n[p] ? c + LORA_COLS : w->part_n[p];
    const int32_t *rows = j->s->seg_rows + j->s->seg_start[slot];
    const int m = j->s->seg_start[slot + 1] - j->s->seg_start[slot];
    for (int g = 0; g < m; g += LORA_GROUP) {
        switch (m - g < LORA_GROUP ? m - g : LORA_GROUP) {
        case 1: up_1(j, w, p, rows + g, c, c1); break;
        case 2: up_2(j, w, p, rows + g, c, c1); break;
        case 3: up_3(j, w, p, rows + g, c, c1); break;
        default: up_4(j, w, p, rows + g, c, c1);
        }
    }
}

/* out [T, N] (row stride ldo, float32) += each row's adapter update of x [T, K] (float32, or bfloat16 when x_bf16;
   row stride ldx) for fused weight `target` (0 qkv, 1 o_proj, 2 gate_up, 3 down) of `layer`; `lora` is the step's
   lora_step_t. Returns 0, or -1 when its scratch memory could not be allocated. */
int qmm_lora_add(const void *lora, int layer, int target, const void *x, int x_bf16, int64_t ldx, int T, int K,
                  float *out, int64_t ldo, int N) {
    const lora_step_t *s = (const lora_step_t *)lora;
    if (!s || T <= 0) return 0;
    int R = 0, n_tasks = 0, rows = s->seg_start[s->n_adapters];
    for (int a = 0; a < s->n_adapters; a++) {
        const lora_weight_t *w = &s->tables[a][4 * layer + target];
        if (!w->a) continue;
        R = w->r > R ? w->r : R;
        for (int p = 0; p < w->n_parts; p++) n_tasks += (w->part_n[p] + LORA_COLS - 1) / LORA_COLS;
    }
    if (!R || !rows) return 0;
    float *t = malloc(sizeof(float) * ((size_t)T * R + (x_bf16 ? (size_t)T * K : 0)) + sizeof(int32_t) * 3 * n_tasks);
    if (!t) return -1;
    float *xf = t + (size_t)T * R;
    int32_t *tasks = (int32_t *)(xf + (x_bf16 ? (size_t)T * K : 0));
    if (x_bf16) { /* the adapters' rows as float32, once */
        for (int i = 0; i < rows; i++) {
            const int row = s->seg_rows[i];
            for (int k = 0; k < K; k++) xf[(int64_t)row * K + k] = load1(x, 1, (int64_t)row * ldx + k);
        }
    }
    int n = 0;
    for (int a = 0; a < s->n_adapters; a++) {
        const lora_weight_t *w = &s->tables[a][4 * layer + target];
        if (!w->a) continue;
        for (int p = 0; p < w->n_parts; p++)
            for (int c = 0; c < w->part_n[p]; c += LORA_COLS) {
                tasks[3 * n] = a, tasks[3 * n + 1] = p, tasks[3 * n + 2] = c;
                n++;
            }
    }
    lora_job_t job = {s, layer, target, K, N, R, x_bf16 ? xf : (const float *)x, x_bf16 ? K : ldx, ldo, out, t,
                      tasks};
    /* a pool dispatch costs more than a decode step's few million multiply-adds: threads for prompt chunks only */
    const int parallel = (int64_t)rows * R * (K + N) >= (1 << 23);
    pool_run(lora_down, &job, s->n_adapters * LORA_SPLIT, parallel);
    pool_run(lora_up, &job, n_tasks, parallel);
    free(t);
    return 0;
}
