/* LoRA adapters beside the quantized base matmuls of the fused decoder stack (layer.c): for each row t of a step
   that runs adapter slot[t] at scale s[t], out[t, :] += s[t] * (x[t, :] A^T) B^T, with the adapter's A [R, K] and,
   for each stacked part of the fused weight (q/k/v, gate/up), that part's B transposed [r_p, n_p] (its own
   alpha / r folded in). Each weight is float32, bfloat16, or int8 with a float32 scale per rank row (of A, and of
   each B^T), the scales applied to the small [T, R] intermediate rather than to the weights. The base weight is
   never read or changed: a quantized base stays in its blocks and the adapter applies to the activations.

   The step's rows come grouped by adapter (segments), so each adapter's weights are read once per step whatever
   its number of rows: first t = x A^T for every row of a segment (a dot product per rank row of A, several rank
   rows at once), then out += t B^T per part, several 16-column vectors at once. B^T may be stored in panels of
   `part_pw` columns, each panel's [r_p, width] block contiguous, so that this second pass reads memory in order
   rather than r_p strided streams. Every value is accumulated in a fixed order that depends only on its row and
   column, so a row's result does not depend on the batch or the threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lora.h"
#include "pool.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
/* 16-float vectors pass between this file's static functions only (inlined): no ABI reaches another unit */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

enum { LORA_MAX_PARTS = 3, LORA_GROUP = 4, LORA_COLS = 256, LORA_SPLIT = 4 /* phase 1 tasks per slot */ };
enum { LORA_F32 = 0, LORA_BF16 = 1, LORA_I8 = 2 }; /* lora_weight_t.type */

typedef struct {
    const void *a;        /* [r, K], NULL: this adapter leaves the weight alone */
    const float *a_scale; /* [r] (int8 only) */
    int32_t r, n_parts, type, pad;
    int32_t part_r0[LORA_MAX_PARTS], part_r[LORA_MAX_PARTS]; /* the part's rows of A */
    int32_t part_c0[LORA_MAX_PARTS], part_n[LORA_MAX_PARTS]; /* its output columns */
    int32_t part_pw[LORA_MAX_PARTS];                        /* B^T's panel width (part_n: one row-major block) */
    const void *b[LORA_MAX_PARTS];                          /* [part_r, part_n] in panels */
    const float *b_scale[LORA_MAX_PARTS];                   /* [part_r] (int8 only) */
} lora_weight_t;

/* One step's adapters: tables[a] is slot a's [n_layers * 4] weights (qkv, o, gate_up, down per layer); the rows of
   slot a are seg_rows[seg_start[a] .. seg_start[a + 1] - 1]. */
typedef struct {
    int32_t n_adapters, pad;
    const float *row_scale; /* [T] */
    const lora_weight_t *const *tables;
    const int32_t *seg_start, *seg_rows;
} lora_step_t;

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int8_t v16c __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* 16 values from element i of p (of type TY, a constant in every caller) as float32; GCC scalarizes the generic
   vectors' int8 widening, hence the intrinsics */
static inline __attribute__((always_inline)) v16f load16(const void *p, const int TY, int64_t i) {
    v16f v;
    if (TY == LORA_BF16) {
#if defined(__AVX512F__)
        const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16);
        memcpy(&v, &u, sizeof v);
#else
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&v, &u, sizeof v);
#endif
    } else if (TY == LORA_I8) {
#if defined(__AVX512F__)
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
        memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
        const __m128i c = _mm_loadu_si128((const __m128i *)((const int8_t *)p + i));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
        memcpy(&v, &lo, sizeof lo);
        memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#else
        for (int k = 0; k < 16; k++) v[k] = (float)((const int8_t *)p)[i + k];
#endif
    } else {
        memcpy(&v, (const float *)p + i, sizeof v);
    }
    return v;
}

static inline __attribute__((always_inline)) float load1(const void *p, const int TY, int64_t i) {
    if (TY == LORA_I8) return (float)((const int8_t *)p)[i];
    if (TY == LORA_F32) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* the address of element i of p (of type TY) */
static inline const void *elem(const void *p, const int TY, int64_t i) {
    return (const char *)p + i * (TY == LORA_I8 ? 1 : TY == LORA_BF16 ? 2 : 4);
}

/* the 16 lanes' sum in a fixed tree order (halves added pairwise), the same in every caller */
static inline float hsum(v16f v) {
    v8f a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;
    v4f c, d;
    memcpy(&c, &a, sizeof c);
    memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

typedef struct {
    const lora_step_t *s;
    int layer, target, K, N, R;
    const float *x; /* [T, K] float32, row stride ldx */
    int64_t ldx, ldo;
    float *out, *t; /* t: [T, R] the rows' x A^T (times their scale) */
    int32_t *tasks; /* phase 2: (slot, part, first column) per task */
    int n_tasks;
} lora_job_t;

static const lora_weight_t *weight(const lora_job_t *j, int slot) {
    const lora_weight_t *w = &j->s->tables[slot][4 * j->layer + j->target];
    return w->a ? w : 0;
}

/* t[row, r] = scale[row] * a_scale[r] * (x[row] . A[r]) for G rows and the RB rank rows r0 ..; G, RB and TY are
   constants in each instance, so the G * RB accumulators stay in registers and their chains of multiply-adds
   overlap. Each value is summed in the same order whatever G and RB are. */
static inline __attribute__((always_inline)) void down_block(const lora_job_t *j, const lora_weight_t *w,
                                                             const int32_t *rows, int r0, const int G, const int RB,
                                                             const int TY) {
    const int K = j->K, k16 = K / 16 * 16;
    const float *xr[LORA_GROUP];
    for (int i = 0; i < G; i++) xr[i] = j->x + (int64_t)rows[i] * j->ldx;
    v16f acc[4][LORA_GROUP];
    for (int b = 0; b < RB; b++)
        for (int i = 0; i < G; i++) acc[b][i] = (v16f){0};
    for (int k = 0; k < k16; k += 16) {
        v16f xv[LORA_GROUP];
        for (int i = 0; i < G; i++) memcpy(&xv[i], xr[i] + k, sizeof(v16f));
        for (int b = 0; b < RB; b++) {
            const int64_t ai = (int64_t)(r0 + b) * K + k;
            if (k % 64 == 0) __builtin_prefetch(elem(w->a, TY, ai + (int64_t)2 * RB * K)); /* the next rank rows */
            const v16f av = load16(w->a, TY, ai);
            for (int i = 0; i < G; i++) acc[b][i] += xv[i] * av;
        }
    }
    for (int b = 0; b < RB; b++)
        for (int i = 0; i < G; i++) {
            float sum = hsum(acc[b][i]);
            for (int k = k16; k < K; k++) sum += xr[i][k] * load1(w->a, TY, (int64_t)(r0 + b) * K + k);
            if (TY == LORA_I8) sum *= w->a_scale[r0 + b];
            j->t[(int64_t)rows[i] * j->R + r0 + b] = j->s->row_scale[rows[i]] * sum;
        }
}

/* Element (r, c) of part p's B^T: panels of pw columns, panel q's [r_p, width] block at q * pw * r_p. */
static inline int64_t b_index(const lora_weight_t *w, int p, int r, int c) {
    const int pw = w->part_pw[p], q = c / pw, width = (q + 1) * pw <= w->part_n[p] ? pw : w->part_n[p] - q * pw;
    return (int64_t)q * pw * w->part_r[p] + (int64_t)r * width + (c - q * pw);
}

/* out[row, n .. n + 16 NB) += t[row, the part's rows] B_part for G rows, the columns inside one panel: NB column
   vectors at once, so G * NB independent accumulators (each column's terms still added in rank order) */
static inline __attribute__((always_inline)) void up_block(const lora_job_t *j, const lora_weight_t *w, int p,
                                                           const int32_t *rows, int n, const int G, const int NB,
                                                           const int TY) {
    const int rp = w->part_r[p];
    const int64_t b0 = b_index(w, p, 0, n), stride = b_index(w, p, 1, n) - b0;
    const int64_t next = (int64_t)w->part_pw[p] * rp; /* a panel's elements ahead (past a part's end: harmless) */
    float *o[LORA_GROUP];
    const float *t[LORA_GROUP];
    for (int i = 0; i < G; i++) {
        o[i] = j->out + (int64_t)rows[i] * j->ldo + w->part_c0[p] + n;
        t[i] = j->t + (int64_t)rows[i] * j->R + w->part_r0[p];
    }
    v16f acc[4][LORA_GROUP];
    for (int c = 0; c < NB; c++)
        for (int i = 0; i < G; i++) memcpy(&acc[c][i], o[i] + 16 * c, sizeof(v16f));
    for (int r = 0; r < rp; r++) {
        float tr[LORA_GROUP];
        for (int i = 0; i < G; i++) tr[i] = TY == LORA_I8 ? t[i][r] * w->b_scale[p][r] : t[i][r];
        __builtin_prefetch(elem(w->b[p], TY, b0 + 2 * next + r * stride)); /* the next panel's row r */
        for (int c = 0; c < NB; c++) {
            const v16f bv = load16(w->b[p], TY, b0 + r * stride + 16 * c);
            for (int i = 0; i < G; i++) acc[c][i] += tr[i] * bv;
        }
    }
    for (int c = 0; c < NB; c++)
        for (int i = 0; i < G; i++) memcpy(o[i] + 16 * c, &acc[c][i], sizeof(v16f));
}

/* the same for columns n .. n1 one at a time (the last few of a panel) */
static inline __attribute__((always_inline)) void up_tail(const lora_job_t *j, const lora_weight_t *w, int p,
                                                          const int32_t *rows, int g, int n, int n1, const int TY) {
    for (int i = 0; i < g; i++) {
        float *o = j->out + (int64_t)rows[i] * j->ldo + w->part_c0[p];
        const float *t = j->t + (int64_t)rows[i] * j->R + w->part_r0[p];
        for (int c = n; c < n1; c++) {
            float acc = o[c];
            for (int r = 0; r < w->part_r[p]; r++) {
                const float tr = TY == LORA_I8 ? t[r] * w->b_scale[p][r] : t[r];
                acc += tr * load1(w->b[p], TY, b_index(w, p, r, c));
            }
            o[c] = acc;
        }
    }
}

typedef void (*down_fn)(const lora_job_t *, const lora_weight_t *, const int32_t *, int, int);
typedef void (*up_fn)(const lora_job_t *, const lora_weight_t *, int, const int32_t *, int, int);

/* down_block over rank rows [r_lo, r_hi) for G rows: about 8 accumulators */
#define DOWN_RANGE(TY, G, RB)                                                                                     \
    static void down_##TY##_##G(const lora_job_t *j, const lora_weight_t *w, const int32_t *rows, int r_lo,       \
                                int r_hi) {                                                                       \
        int r = r_lo;                                                                                             \
        for (; r + RB <= r_hi; r += RB) down_block(j, w, rows, r, G, RB, TY);                                     \
        for (; r < r_hi; r++) down_block(j, w, rows, r, G, 1, TY);                                                \
    }

/* up_block over columns [c, c1) of part p for G rows, panel by panel */
#define UP_RANGE(TY, G, NB)                                                                                       \
    static void up_##TY##_##G(const lora_job_t *j, const lora_weight_t *w, int p, const int32_t *rows, int c,     \
                              int c1) {                                                                           \
        const int pw = w->part_pw[p];                                                                             \
        while (c < c1) {                                                                                          \
            const int end = (c / pw + 1) * pw < c1 ? (c / pw + 1) * pw : c1;                                      \
            for (; c + 16 * NB <= end; c += 16 * NB) up_block(j, w, p, rows, c, G, NB, TY);                       \
            for (; c + 16 <= end; c += 16) up_block(j, w, p, rows, c, G, 1, TY);                                  \
            up_tail(j, w, p, rows, G, c, end, TY);                                                                \
            c = end;                                                                                              \
        }                                                                                                         \
    }

#define LORA_TYPE(TY)                                                                                             \
    DOWN_RANGE(TY, 1, 4) DOWN_RANGE(TY, 2, 4) DOWN_RANGE(TY, 3, 2) DOWN_RANGE(TY, 4, 2)                           \
    UP_RANGE(TY, 1, 4) UP_RANGE(TY, 2, 4) UP_RANGE(TY, 3, 2) UP_RANGE(TY, 4, 2)
LORA_TYPE(0)
LORA_TYPE(1)
LORA_TYPE(2)

/* [type][rows in the group - 1] */
static const down_fn DOWN[3][LORA_GROUP] = {{down_0_1, down_0_2, down_0_3, down_0_4},
                                            {down_1_1, down_1_2, down_1_3, down_1_4},
                                            {down_2_1, down_2_2, down_2_3, down_2_4}};
static const up_fn UP[3][LORA_GROUP] = {{up_0_1, up_0_2, up_0_3, up_0_4},
                                        {up_1_1, up_1_2, up_1_3, up_1_4},
                                        {up_2_1, up_2_2, up_2_3, up_2_4}};

/* phase 1, task = (slot, a quarter of its rank): t = scale * x A^T for the slot's rows, LORA_GROUP at a time */
static void lora_down(void *ctx, int task) {
    const lora_job_t *j = (const lora_job_t *)ctx;
    const int slot = task / LORA_SPLIT, q = task % LORA_SPLIT;
    const lora_weight_t *w = weight(j, slot);
    if (!w) return;
    const int r_lo = w->r * q / LORA_SPLIT, r_hi = w->r * (q + 1) / LORA_SPLIT;
    const int32_t *rows = j->s->seg_rows + j->s->seg_start[slot];
    const int m = j->s->seg_start[slot + 1] - j->s->seg_start[slot];
    for (int g = 0; g < m; g += LORA_GROUP)
        DOWN[w->type][(m - g < LORA_GROUP ? m - g : LORA_GROUP) - 1](j, w, rows + g, r_lo, r_hi);
}

/* phase 2, task = (slot, part, LORA_COLS columns from c): out[row, cols] += t[row, part's rows] B_part */
static void lora_up(void *ctx, int task) {
    const lora_job_t *j = (const lora_job_t *)ctx;
    const int slot = j->tasks[3 * task], p = j->tasks[3 * task + 1], c = j->tasks[3 * task + 2];
    const lora_weight_t *w = weight(j, slot);
    const int c1 = c + LORA_COLS < w->part_n[p] ? c + LORA_COLS : w->part_n[p];
    const int32_t *rows = j->s->seg_rows + j->s->seg_start[slot];
    const int m = j->s->seg_start[slot + 1] - j->s->seg_start[slot];
    for (int g = 0; g < m; g += LORA_GROUP)
        UP[w->type][(m - g < LORA_GROUP ? m - g : LORA_GROUP) - 1](j, w, p, rows + g, c, c1);
}

/* task = slot: phases 1 and 2 of one slot's rows (its phase 2 tasks are consecutive in j->tasks) */
static void lora_slot(void *ctx, int slot) {
    const lora_job_t *j = (const lora_job_t *)ctx;
    if (!weight(j, slot)) return;
    for (int q = 0; q < LORA_SPLIT; q++) lora_down(ctx, slot * LORA_SPLIT + q);
    for (int task = 0; task < j->n_tasks; task++)
        if (j->tasks[3 * task] == slot) lora_up(ctx, task);
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
            int k = 0;
            for (; k + 16 <= K; k += 16) {
                const v16f v = load16(x, LORA_BF16, (int64_t)row * ldx + k);
                memcpy(xf + (int64_t)row * K + k, &v, sizeof v);
            }
            for (; k < K; k++) xf[(int64_t)row * K + k] = load1(x, LORA_BF16, (int64_t)row * ldx + k);
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
                      tasks, n_tasks};
    if ((int64_t)rows * R * (K + N) >= (1 << 23)) { /* prompt chunks: every slot's work split over the threads */
        pool_run(lora_down, &job, s->n_adapters * LORA_SPLIT, 1);
        pool_run(lora_up, &job, n_tasks, 1);
    } else { /* decode: a slot's split costs more dispatches than it saves; the slots side by side instead */
        pool_run(lora_slot, &job, s->n_adapters, 1);
    }
    free(t);
    return 0;
}
