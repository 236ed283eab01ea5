/* A whole Mixture-of-Experts feed-forward for a step's rows in one call: the router's float32 logits (+ bias), the
   routing (softmax over every expert then the top k, optionally renormalized; gpt-oss's top k of the logits then
   a softmax over them; or the sigmoid of each logit, the top k chosen by sigmoid plus a per-expert bias, weighed
   by their sigmoids, optionally renormalized, as LFM2-MoE's and Nemotron-H's; each route's weights times a scale),
   the rows grouped by expert (a stable counting sort: an expert's rows stay in token order), the grouped expert
   matmuls of moe.c (gate/up parts, expert biases, SiLU-, GELU- or gpt-oss's clamped SwiGLU-mul, or relu(x)^2 of
   ungated experts, down), each token's expert outputs summed in its own slot order, and an optional shared expert
   (sigmoid-gated or not) added last.

   The fused layer stack (layer.c) calls it where a dense layer runs its MLP, and the per-op path
   (edgeserve.models.moe through kernels.cpu.moe_layer) calls it too, so both are one implementation. Every step
   works on each row on its own in a fixed order, so a token's output does not depend on the batch. */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "elementwise.h"
#include "moe.h"
#include "moe_layer.h"
#include "qmatmul.h"

/* Scratch memory kept between calls, up to KEEP_BYTES, one buffer for the process: a prompt chunk's scratch is
   tens of MB, which malloc maps fresh on every call, and faulting those pages in again each layer costs as much as
   a good part of the layer's matmuls. A call that finds it in use (another thread's), or needs more, allocates
   and frees its own. qmm_moe_release gives it back (a model's MoE layers going away). */
enum { KEEP_BYTES = 128 << 20 };
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static char *kept;
static size_t kept_bytes;

/* `bytes` of scratch: the kept buffer (*kept_out 1) or a fresh one (0); NULL when out of memory */
static char *scratch(size_t bytes, int *kept_out) {
    *kept_out = 0;
    if (bytes > KEEP_BYTES || pthread_mutex_trylock(&kept_lock) != 0) return malloc(bytes);
    if (bytes > kept_bytes) {
        free(kept);
        kept = malloc(bytes);
        kept_bytes = kept ? bytes : 0;
        if (!kept) {
            pthread_mutex_unlock(&kept_lock);
            return 0;
        }
    }
    *kept_out = 1;
    return kept;
}

static void scratch_done(char *mem, int was_kept) {
    if (was_kept)
        pthread_mutex_unlock(&kept_lock);
    else
        free(mem);
}

/* Free the kept scratch memory unless a call is using it. */
void qmm_moe_release(void) {
    if (pthread_mutex_trylock(&kept_lock) != 0) return;
    free(kept);
    kept = 0;
    kept_bytes = 0;
    pthread_mutex_unlock(&kept_lock);
}

static int run_experts(const experts_t *e, int K, const int8_t *qa, const float *da, const int16_t *sa, int n_active,
                       const int *ids, const int *starts, float *out) {
    int64_t ldo = 0;
    int rows[EXPERT_PARTS];
    for (int p = 0; p < e->n_parts; p++) {
        rows[p] = e->rows[p];
        ldo += rows[p];
    }
    return qmm_moe_matmul(e->n_parts, e->fmt, e->w, e->expert_bytes, e->row_bytes, rows, K, qa, da, sa, n_active, ids,
                          starts, out, ldo);
}

/* The rows of one expert's gate_up output: 2F (gate, up), or F for the ungated ACT_RELU2 */
static int gate_up_rows(const moe_t *m, int F) { return m->act == ACT_RELU2 ? F : 2 * F; }

static void activation(const moe_t *m, const float *gu, int n, int F, float *out) {
    if (m->act == ACT_RELU2)
        for (size_t j = 0; j < (size_t)n * F; j++) out[j] = gu[j] > 0.0f ? gu[j] * gu[j] : 0.0f;
    else if (m->act == ACT_SWIGLU_OAI)
        qmm_swiglu_oai_mul(gu, 0, 2 * (int64_t)F, n, F, m->alpha, m->limit, out);
    else if (m->act == ACT_GELU_TANH)
        qmm_gelu_tanh_mul(gu, 0, 2 * (int64_t)F, n, F, out);
    else
        qmm_silu_mul(gu, 0, 2 * (int64_t)F, n, F, out);
}

/* ids [k]: the k highest of scores [E] in falling order (ties: the lower id first) */
static void top_k(const float *scores, int E, int k, int32_t *ids) {
    for (int j = 0; j < k; j++) { /* selection: k is small */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
        }
        ids[j] = best;
    }
}

/* ROUTE_SIGMOID_BIAS of one row: e_buf [E] := the sigmoids of logits [E], logits := them plus choice_bias (the
   scores the top k is chosen by), the weights the chosen sigmoids (over their sum + norm_eps with normalize) */
static void route_sigmoid(const moe_t *m, float *logits, float *e_buf, float *weights, int32_t *ids) {
    const int E = m->n_experts, k = m->k;
    for (int e = 0; e < E; e++) e_buf[e] = -logits[e];
    qmm_exp(e_buf, E, e_buf);
    for (int e = 0; e < E; e++) {
        e_buf[e] = 1.0f / (1.0f + e_buf[e]);
        logits[e] = m->choice_bias ? e_buf[e] + m->choice_bias[e] : e_buf[e];
    }
    top_k(logits, E, k, ids);
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += weights[j] = e_buf[ids[j]];
    if (m->normalize)
        for (int j = 0; j < k; j++) weights[j] /= sum + m->norm_eps;
}

/* Row t's routing from its logits [E] (clobbered): the k chosen experts in order of falling logit (of falling score
   for ROUTE_SIGMOID_BIAS; ties: the lower id first) and their weights, times the scale. */
static void route_row(const moe_t *m, float *logits, float *e_buf, float *weights, int32_t *ids) {
    const int E = m->n_experts, k = m->k;
    if (m->route == ROUTE_SIGMOID_BIAS) {
        route_sigmoid(m, logits, e_buf, weights, ids);
    } else {
        top_k(logits, E, k, ids);
        const float top = logits[ids[0]];
        const int of_top = m->route == ROUTE_TOPK_SOFTMAX, n = of_top ? k : E; /* the softmax's experts */
        for (int i = 0; i < n; i++) e_buf[i] = (of_top ? logits[ids[i]] : logits[i]) - top;
        qmm_exp(e_buf, n, e_buf);
        float sum = 0.0f;
        for (int i = 0; i < n; i++) sum += e_buf[i];
        for (int j = 0; j < k; j++) weights[j] = (of_top ? e_buf[j] : e_buf[ids[j]]) / sum;
        if (m->normalize && !of_top) {
            float s = 0.0f;
            for (int j = 0; j < k; j++) s += weights[j];
            for (int j = 0; j < k; j++) weights[j] /= s;
        }
    }
    if (m->scale != 0.0f)
        for (int j = 0; j < k; j++) weights[j] *= m->scale;
}

/* The routing of T rows: weights [T, k] and expert ids [T, k] from h [T, hidden] (ldh values apart). logits
   [T, E] and e_buf [E] are scratch. Returns 0, -1 when out of memory. */
static int route(const moe_t *m, int T, const void *h, int h_bf16, int64_t ldh, float *logits, float *e_buf,
                 float *weights, int32_t *ids) {
    const int E = m->n_experts;
    if (qmm_f32_matmul(h, h_bf16, ldh, T, m->router, E, m->hidden, logits, E)) return -1;
    for (int t = 0; t < T; t++) {
        float *l = logits + (size_t)t * E;
        if (m->router_bias)
            for (int e = 0; e < E; e++) l[e] += m->router_bias[e];
        route_row(m, l, e_buf, weights + (size_t)t * m->k, ids + (size_t)t * m->k);
    }
    return 0;
}

/* The shared expert of T rows added to out [T, hidden]: qa/da/sa are h's quantized rows; gu [T, 2 shared_F] (or
   [T, shared_F] ungated), act
   [T, shared_F], q8 / d8 / s8 (room for T rows of shared_F) and y [T, hidden] scratch. */
static int shared_expert(const moe_t *m, int T, const void *h, int h_bf16, int64_t ldh, const int8_t *qa,
                         const float *da, const int16_t *sa, float *gu, float *act, int8_t *q8, float *d8, int16_t *s8,
                         float *y, float *out) {
    const int hidden = m->hidden, S = m->shared_F, zero = 0;
    const int starts[2] = {0, T};
    if (run_experts(&m->shared_gate_up, hidden, qa, da, sa, 1, &zero, starts, gu)) return -1;
    activation(m, gu, T, S, act);
    qmm_quantize(act, 0, S, T, S, q8, d8, s8);
    if (run_experts(&m->shared_down, S, q8, d8, s8, 1, &zero, starts, y)) return -1;
    if (m->shared_gate) {
        float *g = gu; /* T logits, then their sigmoids (gu is free again) */
        if (qmm_f32_matmul(h, h_bf16, ldh, T, m->shared_gate, 1, hidden, g, 1)) return -1;
        for (int t = 0; t < T; t++) g[t] = -g[t];
        qmm_exp(g, T, g);
        for (int t = 0; t < T; t++) {
            const float s = 1.0f / (1.0f + g[t]);
            for (int j = 0; j < hidden; j++) y[(size_t)t * hidden + j] *= s;
        }
    }
    for (size_t j = 0; j < (size_t)T * hidden; j++) out[j] += y[j];
    return 0;
}

/* out [T, hidden] (float32) = the MoE feed-forward of the normed rows h [T, hidden] (bfloat16 when h_bf16, else
   float32; ldh values apart): routed by the layer's router, or, when route_w / route_ids ([T, k] float32 / int32)
   are given, by those (a model that routes its own way); plus the shared expert when with_shared. Returns 0, -1
   when out of memory, -2 for a layer the kernels do not take (sizes not multiples of 32, too many parts). */
int qmm_moe_forward(const moe_t *m, int T, const void *h, int h_bf16, int64_t ldh, const float *route_w,
                    const int32_t *route_ids, int with_shared, float *out) {
    if (T <= 0) return 0;
    const int E = m->n_experts, k = m->k, hidden = m->hidden, F = m->F, S = with_shared ? m->shared_F : 0;
    if (hidden % 32 || F % 32 || S % 32 || k < 1 || k > E) return -2;
    const int N = T * k, fmax = F > S ? F : S;
    const int nmax = N > T ? N : T;
    /* float32 scratch, then the narrower types */
    size_t floats = (size_t)T * E + E + (size_t)N + (size_t)T * (hidden / 32) + (size_t)nmax * 2 * fmax +
                    (size_t)nmax * fmax + (size_t)nmax * (fmax / 32) + (size_t)nmax * hidden;
    size_t bytes = floats * 4 + (size_t)N * 4 * 2 + (size_t)(E + 1) * 4 * 3 + (size_t)T * hidden +
                   (size_t)T * (hidden / 16) * 2 + (size_t)N * hidden + (size_t)N * (hidden / 32) * 4 +
                   (size_t)N * (hidden / 16) * 2 + (size_t)nmax * fmax + (size_t)nmax * (fmax / 16) * 2 + 64;
    int was_kept;
    char *mem = scratch(bytes, &was_kept);
    if (!mem) return -1;
    float *logits = (float *)mem, *e_buf = logits + (size_t)T * E, *weights = e_buf + E;
    float *da = weights + N, *gu = da + (size_t)T * (hidden / 32), *act = gu + (size_t)nmax * 2 * fmax;
    float *d8 = act + (size_t)nmax * fmax, *y = d8 + (size_t)nmax * (fmax / 32);
    float *ds = (float *)(y + (size_t)nmax * hidden); /* the sorted rows' activation scales */
    int32_t *ids = (int32_t *)(ds + (size_t)N * (hidden / 32)), *order = ids + N; /* order: sorted -> flat row */
    int32_t *count = order + N, *active = count + E + 1; /* active: then their starts (E + 1 each) */
    int32_t *starts = active + E + 1;
    int8_t *qa = (int8_t *)(starts + E + 1), *qs = qa + (size_t)T * hidden, *q8 = qs + (size_t)N * hidden;
    int16_t *sa = (int16_t *)(q8 + (size_t)nmax * fmax), *ss = sa + (size_t)T * (hidden / 16);
    int16_t *s8 = ss + (size_t)N * (hidden / 16);
    int rc = -1;
    if (route_w) {
        memcpy(weights, route_w, sizeof(float) * N);
        memcpy(ids, route_ids, sizeof(int32_t) * N);
        for (int i = 0; i < N; i++)
            if (ids[i] < 0 || ids[i] >= E) {
                rc = -2;
                goto done;
            }
    } else if (route(m, T, h, h_bf16, ldh, logits, e_buf, weights, ids)) {
        goto done;
    }
    qmm_quantize(h, h_bf16, ldh, T, hidden, qa, da, sa);
    /* group the (token, slot) rows by expert, stable: a counting sort over the flat rows */
    memset(count, 0, sizeof(int32_t) * (E + 1));
    for (int i = 0; i < N; i++) count[ids[i] + 1]++;
    int n_active = 0;
    for (int e = 0; e < E; e++) {
        if (count[e + 1]) {
            active[n_active] = e;
            starts[n_active++] = count[e];
        }
        count[e + 1] += count[e];
    }
    starts[n_active] = N;
    for (int i = 0; i < N; i++) order[count[ids[i]]++] = i;
    for (int r = 0; r < N; r++) { /* gather each sorted row's quantized token */
        const int t = order[r] / k;
        memcpy(qs + (size_t)r * hidden, qa + (size_t)t * hidden, hidden);
        memcpy(ds + (size_t)r * (hidden / 32), da + (size_t)t * (hidden / 32), sizeof(float) * (hidden / 32));
        memcpy(ss + (size_t)r * (hidden / 16), sa + (size_t)t * (hidden / 16), sizeof(int16_t) * (hidden / 16));
    }
    if (run_experts(&m->gate_up, hidden, qs, ds, ss, n_active, active, starts, gu)) goto done;
    if (m->gate_up_bias)
        for (int r = 0; r < N; r++) {
            const int G = gate_up_rows(m, F);
            const float *b = m->gate_up_bias + (size_t)ids[order[r]] * G;
            float *g = gu + (size_t)r * G;
            for (int j = 0; j < G; j++) g[j] += b[j];
        }
    activation(m, gu, N, F, act);
    qmm_quantize(act, 0, F, N, F, q8, d8, s8);
    if (run_experts(&m->down, F, q8, d8, s8, n_active, active, starts, y)) goto done;
    if (m->down_bias)
        for (int r = 0; r < N; r++) {
            const float *b = m->down_bias + (size_t)ids[order[r]] * hidden;
            float *o = y + (size_t)r * hidden;
            for (int j = 0; j < hidden; j++) o[j] += b[j];
        }
    /* each token's slots summed in slot order; where: flat row -> sorted row (in gu, free now) */
    int32_t *where = (int32_t *)gu;
    for (int r = 0; r < N; r++) where[order[r]] = r;
    for (int t = 0; t < T; t++) {
        float *o = out + (size_t)t * hidden;
        const float *w = weights + (size_t)t * k;
        const float *y0 = y + (size_t)where[t * k] * hidden;
        for (int j = 0; j < hidden; j++) o[j] = y0[j] * w[0];
        for (int s = 1; s < k; s++) {
            const float *ys = y + (size_t)where[t * k + s] * hidden;
            for (int j = 0; j < hidden; j++) o[j] += ys[j] * w[s];
        }
    }
    if (S && shared_expert(m, T, h, h_bf16, ldh, qa, da, sa, gu, act, q8, d8, s8, y, out)) goto done;
    rc = 0;
done:
    scratch_done(mem, was_kept);
    return rc;
}
