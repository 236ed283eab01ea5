/* Gated DeltaNet (Qwen3.5 / 3.6 linear attention) on the CPU, float32: the causal depthwise convolution with SiLU,
   and the gated delta rule, over a flat ragged batch whose states live in slot-indexed pools
   (kernels/gated_delta.py is the torch twin and says what is computed).

   The rule runs token by token for prompts too. Per token and value head it reads and writes the head's
   Dk x Dv state twice (decay and read, then write and query): 4 Dk Dv flops, about as many as the token's share
   of the layer's projections at Qwen3.5's shapes, and the state (64 KiB at 128 x 128) stays in the core's cache
   for the whole sequence. The chunked form would do the same work as small matmuls plus a triangular solve per
   chunk, which pays on a GPU and not here (measured: docs/PERFORMANCE.md).

   Each task owns whole state blocks (a sequence's channels block for the convolution, a (sequence, value head)
   pair for the rule) and steps through the sequence's tokens in order, so the result does not depend on the
   thread count or on what else is in the batch. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

enum { CONV_BLOCK = 64, CONV_MAX_K = 16, GDN_MAX_DIM = 512 };

typedef struct {
    const float *x, *weight;
    int64_t ldx, slot_stride;
    int C, K, blocks;
    const int32_t *cu, *slots;
    float *state, *out;
} conv_t;

static inline float silu(float a) { return a / (1.0f + expf(-a)); }

/* one sequence's channels c0 .. c0 + n - 1: outputs, then its last K - 1 inputs back into its state */
static void conv_block(void *ctx, int task) {
    const conv_t *a = (const conv_t *)ctx;
    const int b = task / a->blocks, c0 = task % a->blocks * CONV_BLOCK, K = a->K, C = a->C;
    const int n = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK;
    const int start = a->cu[b], len = a->cu[b + 1] - start;
    float *state = a->state + (int64_t)a->slots[b] * a->slot_stride; /* [K - 1, C] */
    float w[CONV_MAX_K][CONV_BLOCK];
    for (int c = 0; c < n; c++)
        for (int j = 0; j < K; j++) w[j][c] = a->weight[(int64_t)(c0 + c) * K + j];
    for (int t = 0; t < len; t++) {
        float acc[CONV_BLOCK];
        for (int c = 0; c < n; c++) acc[c] = 0.0f;
        for (int j = 0; j < K; j++) {
            const int p = t - (K - 1) + j; /* input position; negative ones are in the state */
            const float *in = p < 0 ? state + (int64_t)(K - 1 + p) * C + c0 : a->x + (start + p) * a->ldx + c0;
            for (int c = 0; c < n; c++) acc[c] += w[j][c] * in[c];
        }
        float *o = a->out + (int64_t)(start + t) * C + c0;
        for (int c = 0; c < n; c++) o[c] = silu(acc[c]);
    }
    /* new row r holds input position len - (K - 1) + r; from the old state (only when len < K - 1) it is row
       r + len, which no earlier r overwrote */
    for (int r = 0; r < K - 1; r++) {
        const int p = len - (K - 1) + r;
        const float *in = p < 0 ? state + (int64_t)(r + len) * C + c0 : a->x + (start + p) * a->ldx + c0;
        memmove(state + (int64_t)r * C + c0, in, sizeof(float) * n);
    }
}

/* out [T, C] = silu(causal depthwise conv of x [T, C] (rows ldx apart) with weight [C, K]), sequence b owning rows
   cu[b] .. cu[b + 1] - 1 and continuing from its conv state [K - 1, C] at state + slots[b] * slot_stride, which
   then holds its last K - 1 inputs. */
void qmm_gdn_conv(const float *x, int64_t ldx, int C, int K, const float *weight, const int32_t *cu, int B,
                  float *state, int64_t slot_stride, const int32_t *slots, float *out) {
    const int blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK;
    conv_t a = {x, weight, ldx, slot_stride, C, K, blocks, cu, slots, state, out};
    pool_run(conv_block, &a, B * blocks, (int64_t)cu[B] * C * K >= 32768);
}

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t ldq, ldk, ldv;
    int Hk, Hv, Dk, Dv;
    const int32_t *cu, *slots;
    float *state, *out;
    int64_t slot_stride;
    float scale;
} rule_t;

/* x * scale / sqrt(sum x^2 + 1e-6) */
static void l2norm(const float *x, int n, float scale, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float f = scale / sqrtf(ss + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * f;
}

/* one (sequence, value head): its tokens in order against the head's state S [Dk, Dv] */
static void rule_head(void *ctx, int task) {
    const rule_t *a = (const rule_t *)ctx;
    const int b = task / a->Hv, h = task % a->Hv, hk = h / (a->Hv / a->Hk), Dk = a->Dk, Dv = a->Dv;
    float *restrict S = a->state + (int64_t)a->slots[b] * a->slot_stride + (int64_t)h * Dk * Dv;
    float qn[GDN_MAX_DIM], kn[GDN_MAX_DIM], kv[GDN_MAX_DIM], delta[GDN_MAX_DIM];
    for (int t = a->cu[b]; t < a->cu[b + 1]; t++) {
        l2norm(a->q + t * a->ldq + (int64_t)hk * Dk, Dk, a->scale, qn);
        l2norm(a->k + t * a->ldk + (int64_t)hk * Dk, Dk, 1.0f, kn);
        const float decay = expf(a->g[(int64_t)t * a->Hv + h]), beta = a->beta[(int64_t)t * a->Hv + h];
        const float *restrict v = a->v + t * a->ldv + (int64_t)h * Dv;
        for (int j = 0; j < Dv; j++) kv[j] = 0.0f;
        for (int i = 0; i < Dk; i++) { /* S *= decay; kv = S^T k */
            float *restrict row = S + (int64_t)i * Dv;
            const float ki = kn[i];
            for (int j = 0; j < Dv; j++) {
                row[j] *= decay;
                kv[j] += row[j] * ki;
            }
        }
        for (int j = 0; j < Dv; j++) delta[j] = (v[j] - kv[j]) * beta;
        float *restrict o = a->out + ((int64_t)t * a->Hv + h) * Dv;
        for (int j = 0; j < Dv; j++) o[j] = 0.0f;
        for (int i = 0; i < Dk; i++) { /* S += k delta^T; o = S^T q */
            float *restrict row = S + (int64_t)i * Dv;
            const float ki = kn[i], qi = qn[i];
            for (int j = 0; j < Dv; j++) {
                row[j] += ki * delta[j];
                o[j] += row[j] * qi;
            }
        }
    }
}

/* The gated delta rule: q, k [T, Hk, Dk] (rows ldq / ldk apart), v [T, Hv, Dv] (rows ldv apart), g, beta [T, Hv];
   q and k L2-normalized here, q also scaled; value head h reads q/k head h / (Hv / Hk); sequence b owns rows
   cu[b] .. cu[b + 1] - 1 and its state [Hv, Dk, Dv] at state + slots[b] * slot_stride, updated in place;
   out [T, Hv, Dv]. */
void qmm_gdn_rule(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                  const float *g, const float *beta, int Hk, int Hv, int Dk, int Dv, const int32_t *cu, int B,
                  float *state, int64_t slot_stride, const int32_t *slots, float scale, float *out) {
    rule_t a = {q, k, v, g, beta, ldq, ldk, ldv, Hk, Hv, Dk, Dv, cu, slots, state, out, slot_stride, scale};
    pool_run(rule_head, &a, B * Hv, (int64_t)cu[B] * Hv * Dk * Dv >= 65536);
}
