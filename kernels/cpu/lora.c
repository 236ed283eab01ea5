/* LoRA adapters beside the quantized base matmuls of the fused decoder stack (layer.c): for each row t of a step
   that runs adapter slot[t] at scale s[t], out[t, :] += s[t] * (x[t, :] @ at) @ bt, with the adapter's float32
   at [K, R] (A transposed) and bt [R, N] (B transposed, its own alpha / r folded in). The base weight is never
   read or changed: a quantized base stays in its blocks and the adapter applies to the activations.

   Both products are written as axpy loops over contiguous rows (R lanes, then N lanes), which vectorize without
   reassociating any sum, so a row's result does not depend on the batch or the threads. */

#include <stdint.h>
#include <string.h>

#include "pool.h"

/* One fused weight's pair (NULL at: this adapter leaves that weight alone). */
typedef struct {
    const float *at, *bt;
    int32_t r;
} lora_weight_t;

/* One step's adapters: tables[a] is adapter slot a's [n_layers * 4] pairs (qkv, o, gate_up, down per layer). */
typedef struct {
    int32_t n_adapters;
    const int32_t *row_slot; /* [T]: the row's adapter slot, -1 for the base alone */
    const float *row_scale;  /* [T] */
    const lora_weight_t *const *tables;
} lora_step_t;

typedef struct {
    const lora_step_t *s;
    int layer, target, K, N, chunks;
    const void *x;
    int x_bf16;
    int64_t ldx, ldo;
    float *out;
} lora_job_t;

static inline float lora_bf16(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)h << 16};
    return v.f;
}

static void lora_task(void *ctx, int task) {
    const lora_job_t *j = (const lora_job_t *)ctx;
    const int t = task / j->chunks, c = task % j->chunks;
    const int slot = j->s->row_slot[t];
    if (slot < 0) return;
    const lora_weight_t *w = &j->s->tables[slot][4 * j->layer + j->target];
    if (!w->at || w->r <= 0) return;
    const int R = w->r, K = j->K;
    float tmp[R];
    memset(tmp, 0, sizeof(float) * R);
    for (int k = 0; k < K; k++) {
        const float xv = j->x_bf16 ? lora_bf16(((const uint16_t *)j->x)[(int64_t)t * j->ldx + k])
                                   : ((const float *)j->x)[(int64_t)t * j->ldx + k];
        const float *row = w->at + (int64_t)k * R;
        for (int r = 0; r < R; r++) tmp[r] += xv * row[r];
    }
    const int per = (j->N + j->chunks - 1) / j->chunks, n0 = c * per, n1 = n0 + per < j->N ? n0 + per : j->N;
    float *out = j->out + (int64_t)t * j->ldo;
    const float scale = j->s->row_scale[t];
    for (int r = 0; r < R; r++) {
        const float v = scale * tmp[r];
        const float *row = w->bt + (int64_t)r * j->N;
        for (int n = n0; n < n1; n++) out[n] += v * row[n];
    }
}

/* out [T, N] (row stride ldo, float32) += each row's adapter update of x [T, K] (float32, or bfloat16 when x_bf16;
   row stride ldx) for fused weight `target` (0 qkv, 1 o_proj, 2 gate_up, 3 down) of `layer`. */
void qmm_lora_add(const void *lora, int layer, int target, const void *x, int x_bf16, int64_t ldx, int T, int K,
                  float *out, int64_t ldo, int N) {
    const lora_step_t *s = (const lora_step_t *)lora;
    if (!s || T <= 0) return;
    const int threads = pool_threads();
    const int chunks = T >= threads ? 1 : threads;
    lora_job_t job = {s, layer, target, K, N, chunks, x, x_bf16, ldx, ldo, out};
    pool_run(lora_task, &job, T * chunks, (int64_t)T * (K + N) * 16 >= (1 << 16));
}
