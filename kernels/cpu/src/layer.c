/* A whole Llama- or Gemma-family decoder stack for one flat batch of rows in one call: per layer
   RMSNorm -> quantize -> qkv matmul (+ bias) -> [Q/K RMSNorm per head] -> RoPE + K/V write into the paged pool ->
   paged attention [over a sliding window] -> o_proj -> [RMSNorm] -> residual add + RMSNorm -> gate_up ->
   SiLU- or GELU-mul -> down -> [RMSNorm] -> residual add + the next layer's RMSNorm. The bracketed steps are
   Qwen3's and Gemma 3's (Q/K norms, sandwich norms, GELU, sliding-window layers with their own RoPE base and,
   optionally, their own K/V pool). Gemma 4 adds per-layer head sizes, K/V heads and MLP widths, a weightless V
   norm, KV-shared layers (q only, attending over an earlier layer's K/V), the E models' per-layer input (gate ->
   GELU * the row's per-layer input -> projection -> RMSNorm -> residual add) and a layer output scale, both after
   the MLP's residual add and before the next layer's norm. Qwen3.5 adds Gated DeltaNet layers in place of the
   attention (`mixer`: in_proj matmul -> gated_delta.c's qmm_gdn_mix over the step's recurrent states in place ->
   out_proj matmul) and gated attention (`attn_gate`: [q | gate] heads, Q/K norms per head into rows of their own,
   the attention output times sigmoid(gate) before o_proj). A Mixture-of-Experts layer (layer_t.moe) runs
   moe_layer.c's whole feed-forward where the dense MLP would; gpt-oss adds attention sinks and an o_proj bias.

   It calls the same kernels, in the same order, with the same dtypes as the per-op path of
   edgeserve/models/llama.py (qmm/, attention.c, elementwise.c), so its results are bit for bit those of
   that path; what it saves is the Python, ctypes and allocator work around every one of those kernels. Every
   kernel computes each row on its own in a fixed order, so a row's result does not depend on the batch. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gdn_layer.h"

#include "attention.h"
#include "attention_q8.h"
#include "elementwise.h"
#include "gated_delta.h"
#include "layer.h"
#include "lora.h"
#include "moe_layer.h"
#include "qmatmul.h"

enum { MAX_PARTS = 4 };

/* Built with -DQMM_PROFILE (benchmarks/engine/profile_fused_step.py), the stack adds up wall time per section into
   qmm_profile_ns; ordinary builds compile the marks away. */
enum { P_NORM, P_QUANT, P_QKV, P_ROPE, P_ATTN, P_O, P_GATE_UP, P_SILU, P_DOWN, P_PLE, P_MOE, P_SECTIONS };
#if defined(QMM_PROFILE)
#include <time.h>
int64_t qmm_profile_ns[P_SECTIONS];
static int64_t prof_last;
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#define MARK_START() (prof_last = now_ns())
#define MARK(s)                                      \
    do {                                             \
        const int64_t t_ = now_ns();                 \
        qmm_profile_ns[s] += t_ - prof_last;         \
        prof_last = t_;                              \
    } while (0)
#else
#define MARK_START() ((void)0)
#define MARK(s) ((void)0)
#endif

/* A weight stacked from up to MAX_PARTS block-format parts along its output rows (BlockWeight's parts). */
typedef struct {
    int32_t n_parts;
    int32_t fmt[MAX_PARTS];
    int32_t rows[MAX_PARTS];
    int64_t row_bytes[MAX_PARTS];
    const uint8_t *w[MAX_PARTS];
} qweight_t;

typedef struct {
    qweight_t qkv, o, gate_up, down;
    const float *qkv_bias;       /* float32 [q + 2 kv], or NULL */
    const float *q_norm, *k_norm; /* RMSNorm weights [D] of each q and k head before RoPE, or NULL */
    const float *attn_out_norm;  /* RMSNorm of the o_proj output before the residual add (Gemma), or NULL */
    const float *post_norm;      /* before the MLP */
    const float *mlp_out_norm;   /* RMSNorm of the MLP output before the residual add (Gemma), or NULL */
    const float *next_norm;      /* the next layer's input norm; the final norm after the last layer */
    int32_t window;              /* a sliding-window layer's window (keys), 0 for a global layer */
    int32_t local_rope;          /* RoPE from the decoder's local tables (Gemma 3's sliding layers) */
    /* Gemma 4 (all zero / NULL elsewhere) */
    int32_t D, Hkv, F;            /* this layer's head size, K/V heads and MLP width (0: the decoder's) */
    int32_t shared;               /* KV-shared: qkv is q alone; attends over the pool slot layer_pool names */
    const float *v_norm;          /* RMSNorm weights [D] of each v head (Gemma 4's weightless norm: ones), or NULL */
    qweight_t ple_gate, ple_proj; /* per-layer input gate [width, hidden] and projection [hidden, width] */
    const float *ple_norm;        /* RMSNorm of the projection before its residual add */
    float out_scale;              /* the residual stream's scale at the layer's end (0: none) */
    int32_t k_eq_v;               /* qkv is q and k: V is K before K's norm (Gemma 4's 31B global layers) */
    /* seams for the layer kinds beside attention + dense MLP (NULL: not this kind) */
    const void *moe;   /* a Mixture-of-Experts feed-forward in place of gate_up / down (moe.c) */
    const void *mixer; /* a linear-attention (Gated DeltaNet) layer in place of the attention (gated_delta.c) */
    /* Qwen3.5's gated attention: qkv is [q | gate] per head, then k, v; q and k normed per head (qmm_head_rms_norm,
       as the per-op path), the attention output times sigmoid(gate) before o */
    int32_t attn_gate;
    /* gpt-oss (NULL elsewhere) */
    const float *sinks;  /* per-head attention sinks [H]: an extra logit in each head's softmax denominator */
    const float *o_bias; /* o_proj's bias [hidden] */
} layer_t;

typedef struct decoder {
    int32_t n_layers, hidden, H, Hkv, D, F; /* F: the MLP's intermediate size */
    float eps, scale;
    int32_t act_bf16;        /* normed activations h in bfloat16 (else float32) */
    int32_t gelu;            /* the MLP's activation: GELU (tanh) instead of SiLU */
    const float *first_norm; /* layer 0's input norm */
    const layer_t *layers;
    const float *cos, *sin;             /* RoPE tables [positions, D / 2] */
    const float *cos_local, *sin_local; /* the local layers' tables (NULL: the same) */
    int32_t half_local;                 /* the local tables' width (0: D / 2; Gemma 4's sliding heads are narrower) */
    int32_t ple_width;                  /* the per-layer input width (Gemma 4's E models), 0 without */
} decoder_t;

/* One step's K/V: up to two pools (the main one and a sliding-window layers' one), each [layers, blocks,
   block_size, Hkv, D] with its own block tables and slots; layer i lives in pool layer_pool[2i], at its layer
   layer_pool[2i + 1]. */
typedef struct step_pools {
    void *k[2], *v[2];
    int64_t layer_stride[2];
    const int32_t *tables[2];
    int64_t table_stride[2];
    const int64_t *slots[2];
    const int32_t *layer_pool;
    const void *lora; /* the step's LoRA adapters (lora.c's lora_step_t), or NULL */
    const float *ple; /* the step's per-layer inputs [T, n_layers, ple_width] (decoder_t.ple_width), or NULL */
    const void *recurrent; /* the step's rows' recurrent-state slots for `mixer` layers (gated_delta.c), or NULL */
} step_pools_t;

/* the output rows of a weight (all its parts) */
static int weight_rows(const qweight_t *w) {
    int rows = 0;
    for (int p = 0; p < w->n_parts; p++) rows += w->rows[p];
    return rows;
}

static void matmul(const qweight_t *w, int K, const int8_t *qa, const float *da, const int16_t *sa, int M,
                   float *out) {
    const int64_t ldo = weight_rows(w);
    int64_t col = 0;
    for (int p = 0; p < w->n_parts; p++) {
        qmm_matmul(w->fmt[p], w->w[p], w->row_bytes[p], w->rows[p], K, qa, da, sa, M, out + col, ldo);
        col += w->rows[p];
    }
}

static inline int imax(int a, int b) { return a > b ? a : b; }

/* f rounded to bfloat16 (nearest even) and back */
static inline float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &bits, 4);
    return f;
}

/* x [T, N] float32 (rows ldx apart, the first N of each) := rms_norm(x) * weight, row by row in place */
static void norm_in_place(float *x, int64_t ldx, int T, int N, const float *weight, float eps) {
    if (ldx == N) {
        qmm_add_rms_norm(x, 0, N, 0, weight, T, N, eps, 0, x, 0);
        return;
    }
    for (int t = 0; t < T; t++) qmm_add_rms_norm(x + (size_t)t * ldx, 0, N, 0, weight, 1, N, eps, 0, x + (size_t)t * ldx, 0);
}

/* Quantize float32 x [T, K] (packed rows) for a matmul, first rounding it to bf16 in hb when as_bf16 (as the per-op
   path casts activations it keeps in bf16). */
static void quantize_f32(const float *x, int T, int K, int as_bf16, void *hb, int8_t *qa, float *da, int16_t *sa) {
    if (as_bf16) {
        qmm_to_bf16(x, (int64_t)T * K, hb);
        qmm_quantize(hb, 1, K, T, K, qa, da, sa);
    } else {
        qmm_quantize(x, 0, K, T, K, qa, da, sa);
    }
}

/* Gemma 4's per-layer input, after the MLP's residual add: x += rms_norm(ple_proj(gelu_tanh(ple_gate(x)) *
   ple)) * ple_norm, with x and the GELU product rounded to bf16 before their matmuls when act_bf16 (as the per-op
   path casts them). ple: this layer's rows [T, width], `ple_ld` values apart; o [T, hidden], gp [T, 2 width],
   act [T, width] and hb (h's memory) scratch. */
static void per_layer_input(const decoder_t *m, const layer_t *L, int T, float *x, const float *ple, int64_t ple_ld,
                            void *hb, int8_t *qa, float *da, int16_t *sa, float *o, float *gp, float *act) {
    const int hidden = m->hidden, w = m->ple_width;
    quantize_f32(x, T, hidden, m->act_bf16, hb, qa, da, sa);
    matmul(&L->ple_gate, hidden, qa, da, sa, T, o);
    for (int t = 0; t < T; t++) {
        memcpy(gp + (size_t)t * 2 * w, o + (size_t)t * w, sizeof(float) * w);
        memcpy(gp + (size_t)t * 2 * w + w, ple + (size_t)t * ple_ld, sizeof(float) * w);
    }
    qmm_gelu_tanh_mul(gp, 0, 2 * (int64_t)w, T, w, act);
    quantize_f32(act, T, w, m->act_bf16, hb, qa, da, sa);
    matmul(&L->ple_proj, w, qa, da, sa, T, o);
    norm_in_place(o, hidden, T, hidden, L->ple_norm, m->eps);
    for (size_t j = 0; j < (size_t)T * hidden; j++) x[j] += o[j];
}

/* Run every layer over T rows. x [T, hidden] float32: the embeddings in, the residual stream out; h_out
   [T, hidden] (bf16 when act_bf16): the final-normed hidden states. The K/V pools (bf16 when cache_bf16 is 1; q8_0
   bytes, kv_q8.h, when it is 2, float16 when it is 3, with the attention's queries and outputs then in float32, as
   the per-op path) are
   `pools`'; row t is at position positions[t], writes its K/V at slot slots[t] of each pool and attends to the
   first row_len[t] positions of sequence row_seq[t] (the last `window` of them in a sliding-window layer).
   Returns 0, or -1 when out of memory. */
int qmm_decoder_forward(const decoder_t *m, int T, const int64_t *positions, float *x, void *h_out, int cache_bf16,
                        int block_size, const int32_t *row_seq, const int32_t *row_len, const step_pools_t *pools) {
    if (T <= 0) return 0;
    const int hidden = m->hidden, H = m->H, half = m->D / 2, w = m->ple_width;
    const int local = m->cos_local != 0, half_l = local && m->half_local ? m->half_local : half;
    /* the widest layer's sizes (Gemma 4's vary by layer) size the scratch */
    int qd_max = H * m->D, nqkv_max = qd_max + 2 * m->Hkv * m->D, f_max = m->F, kvd_max = m->Hkv * m->D;
    int mix_max = 0, mix_in = 0; /* Qwen3.5's scratch per row (a mixer's or the gated attention's), o's input width */
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *L = m->layers + i;
        const int D = L->D ? L->D : m->D, Hkv = L->Hkv ? L->Hkv : m->Hkv, F = L->F ? L->F : m->F;
        qd_max = imax(qd_max, H * D);
        nqkv_max = imax(nqkv_max, H * D + (L->shared ? 0 : 2 * Hkv * D));
        f_max = imax(f_max, F);
        kvd_max = imax(kvd_max, Hkv * D);
        if (L->mixer) {
            const gdn_layer_t *g = L->mixer;
            nqkv_max = imax(nqkv_max, weight_rows(&L->qkv));
            mix_max = imax(mix_max, (int)gdn_scratch_per_row(g) + g->Hv * g->Dv);
            mix_in = imax(mix_in, g->Hv * g->Dv);
        } else if (L->attn_gate) {
            nqkv_max = imax(nqkv_max, 2 * H * D + 2 * Hkv * D);
            mix_max = imax(mix_max, 2 * H * D + Hkv * D);
        }
    }
    const int kmax = imax(imax(imax(hidden, qd_max), imax(f_max, w)), mix_in), act_max = imax(f_max, w);
    /* kv_q8.h's KV_Q8_0 and KV_F16: queries and attention outputs in float32 (bf16 only beside a bf16 pool) */
    const int q8 = cache_bf16 == 2, q_bf16 = cache_bf16 == 1;
    const size_t cache_el = q8 ? 1 : (cache_bf16 ? 2 : 4), q_el = q_bf16 ? 2 : 4;
    /* one allocation per call: float32 scratch first, then the narrower types */
    size_t floats = (size_t)T * (nqkv_max + hidden + 2 * (size_t)f_max + act_max + 2 * half +
                                 (local ? 2 * half_l : 0) + kmax / 32 + 2 * (size_t)w + kvd_max + mix_max + hidden);
    size_t bytes = floats * 4 + (size_t)T * qd_max * q_el + (size_t)T * kmax + (size_t)T * (kmax / 16) * 2 +
                   (size_t)T * 2 * sizeof(int32_t) + 64;
    char *mem = malloc(bytes);
    if (!mem) return -1;
    float *qkv = (float *)mem, *o = qkv + (size_t)T * nqkv_max, *gu = o + (size_t)T * hidden;
    float *act = gu + (size_t)T * 2 * f_max, *gp = act + (size_t)T * act_max;
    float *vk = gp + (size_t)T * 2 * w; /* V = K's copy (k_eq_v layers) */
    float *mix = vk + (size_t)T * kvd_max; /* Qwen3.5's: a mixer's scratch and output, or gated q, k and output */
    float *hm = mix + (size_t)T * mix_max; /* a MoE layer's normed input, float32 (its router's input) */
    float *cs = hm + (size_t)T * hidden, *sn = cs + (size_t)T * half;
    float *cs_l = local ? sn + (size_t)T * half : cs, *sn_l = local ? cs_l + (size_t)T * half_l : sn;
    float *da = (local ? sn_l + (size_t)T * half_l : sn + (size_t)T * half);
    char *rest = (char *)(da + (size_t)T * (kmax / 32));
    void *q = rest;
    int16_t *sa = (int16_t *)(rest + (size_t)T * qd_max * q_el);
    int8_t *qa = (int8_t *)(sa + (size_t)T * (kmax / 16));
    int32_t *win_lo = (int32_t *)(qa + (size_t)T * kmax), *win_len = win_lo + T;
    int32_t have_window = 0; /* the window win_lo / win_len hold */
    for (int t = 0; t < T; t++) {
        memcpy(cs + (size_t)t * half, m->cos + positions[t] * half, sizeof(float) * half);
        memcpy(sn + (size_t)t * half, m->sin + positions[t] * half, sizeof(float) * half);
        if (local) {
            memcpy(cs_l + (size_t)t * half_l, m->cos_local + positions[t] * half_l, sizeof(float) * half_l);
            memcpy(sn_l + (size_t)t * half_l, m->sin_local + positions[t] * half_l, sizeof(float) * half_l);
        }
    }
    void *h = h_out;
    MARK_START();
    qmm_add_rms_norm(x, 0, hidden, 0, m->first_norm, T, hidden, m->eps, 0, h, m->act_bf16);
    MARK(P_NORM);
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *L = m->layers + i;
        const int D = L->D ? L->D : m->D, Hkv = L->Hkv ? L->Hkv : m->Hkv, F = L->F ? L->F : m->F;
        const int qd = H * D, kvd = L->shared ? 0 : Hkv * D;
        const int nqkv = (L->attn_gate ? 2 * qd : qd) + (L->k_eq_v ? 1 : 2) * kvd;
        const int pl = pools->layer_pool[2 * i], at = pools->layer_pool[2 * i + 1];
        char *kc = (char *)pools->k[pl] + (size_t)at * pools->layer_stride[pl] * cache_el;
        char *vc = (char *)pools->v[pl] + (size_t)at * pools->layer_stride[pl] * cache_el;
        qmm_quantize(h, m->act_bf16, hidden, T, hidden, qa, da, sa);
        MARK(P_QUANT);
        if (L->mixer) { /* Gated DeltaNet in place of the attention: in_proj, the mixer, out_proj */
            const gdn_layer_t *g = L->mixer;
            const int np = weight_rows(&L->qkv), vd = g->Hv * g->Dv;
            matmul(&L->qkv, hidden, qa, da, sa, T, qkv);
            MARK(P_QKV);
            qmm_gdn_mix(g, pools->recurrent, T, qkv, np, mix + (size_t)T * vd, mix);
            MARK(P_ATTN);
            qmm_quantize(mix, 0, vd, T, vd, qa, da, sa);
            matmul(&L->o, vd, qa, da, sa, T, o);
            MARK(P_O);
            goto mixed;
        }
        matmul(&L->qkv, hidden, qa, da, sa, T, qkv);
        if (pools->lora && qmm_lora_add(pools->lora, i, 0, h, m->act_bf16, hidden, T, hidden, qkv, nqkv, nqkv)) goto oom;
        if (L->qkv_bias)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < nqkv; j++) qkv[(size_t)t * nqkv + j] += L->qkv_bias[j];
        MARK(P_QKV);
        float *v = qkv + qd + kvd, *qin = qkv, *kin = qkv + qd;
        int64_t ldv = nqkv, ldq = nqkv, ldk = nqkv;
        if (L->k_eq_v && kvd) { /* V is K before its norm and RoPE */
            for (int t = 0; t < T; t++) memcpy(vk + (size_t)t * kvd, qkv + (size_t)t * nqkv + qd, sizeof(float) * kvd);
            v = vk;
            ldv = kvd;
        }
        if (L->attn_gate) { /* [q | gate] per head: q and k normed into rows of their own */
            qin = mix;
            kin = mix + (size_t)T * qd;
            qmm_head_rms_norm(qkv, nqkv, 2 * D, 0, 0, 0, T, H, D, L->q_norm, m->eps, qin);
            qmm_head_rms_norm(qkv + 2 * qd, nqkv, D, 0, 0, 0, T, Hkv, D, L->k_norm, m->eps, kin);
            v = qkv + 2 * qd + kvd;
            ldq = qd;
            ldk = kvd;
        } else if (L->q_norm)
            for (int t = 0; t < T; t++) {
                norm_in_place(qkv + (size_t)t * nqkv, D, H, D, L->q_norm, m->eps);
                if (!L->shared) norm_in_place(qkv + (size_t)t * nqkv + qd, D, Hkv, D, L->k_norm, m->eps);
            }
        if (L->v_norm && !L->shared)
            for (int t = 0; t < T; t++) norm_in_place(v + (size_t)t * ldv, D, Hkv, D, L->v_norm, m->eps);
        MARK(P_NORM);
        /* a KV-shared layer rotates its q alone (no K/V heads: nothing written) */
        qmm_rope_write_kv_fmt(qin, kin, v, 0, ldq, ldk, ldv, L->local_rope ? cs_l : cs,
                              L->local_rope ? sn_l : sn, kc, vc, cache_bf16, pools->slots[pl], T, H,
                              L->shared ? 0 : Hkv, D, q, q_bf16);
        MARK(P_ROPE);
        const int32_t *lo = 0, *len = row_len;
        if (L->window > 0) {
            if (have_window != L->window) {
                for (int t = 0; t < T; t++) {
                    win_len[t] = row_len[t] < L->window ? row_len[t] : L->window;
                    win_lo[t] = row_len[t] - win_len[t];
                }
                have_window = L->window;
            }
            lo = win_lo;
            len = win_len;
        }
        if (q8) {
            if (qmm_paged_attention_q8(q, q_bf16, T, H, D, kc, vc, block_size, Hkv, pools->tables[pl],
                                       pools->table_stride[pl], row_seq, lo, len, L->sinks, m->scale, q)) {
                free(mem);
                return -1;
            }
        } else if (L->sinks) {
            qmm_paged_attention_sinks(q, q_bf16, T, H, D, kc, vc, cache_bf16, block_size, Hkv, pools->tables[pl],
                                      pools->table_stride[pl], row_seq, lo, len, L->sinks, m->scale, q);
        } else {
            qmm_paged_attention_from(q, q_bf16, T, H, D, kc, vc, cache_bf16, block_size, Hkv, pools->tables[pl],
                                     pools->table_stride[pl], row_seq, lo, len, m->scale, q);
        }
        MARK(P_ATTN);
        if (L->attn_gate) { /* the output times sigmoid(gate), in float32 */
            float *gated = mix + (size_t)T * (qd + kvd);
            qmm_sigmoid_gate(q, q_bf16, qkv + D, nqkv, 2 * D, T, H, D, gated);
            qmm_quantize(gated, 0, qd, T, qd, qa, da, sa);
        } else {
            qmm_quantize(q, q_bf16, qd, T, qd, qa, da, sa);
        }
        MARK(P_QUANT);
        matmul(&L->o, qd, qa, da, sa, T, o);
        if (L->o_bias) /* in the attention output's dtype, as the per-op path casts it */
            for (int t = 0; t < T; t++)
                for (int j = 0; j < hidden; j++)
                    o[(size_t)t * hidden + j] += q_bf16 ? round_bf16(L->o_bias[j]) : L->o_bias[j];
        if (pools->lora && qmm_lora_add(pools->lora, i, 1, q, q_bf16, qd, T, qd, o, hidden, hidden)) goto oom;
        MARK(P_O);
    mixed:
        if (L->attn_out_norm) norm_in_place(o, hidden, T, hidden, L->attn_out_norm, m->eps);
        /* a MoE layer's input stays float32: rounded to bf16, a router near-tie flips experts (issue 54) */
        qmm_add_rms_norm(o, 0, hidden, x, L->post_norm, T, hidden, m->eps, x, L->moe ? (void *)hm : h,
                         L->moe ? 0 : m->act_bf16);
        MARK(P_NORM);
        if (L->moe) { /* a Mixture-of-Experts feed-forward (moe_layer.c) in place of the dense MLP */
            if (qmm_moe_forward(L->moe, T, hm, 0, hidden, 0, 0, 1, o)) goto oom;
            MARK(P_MOE);
        } else {
            qmm_quantize(h, m->act_bf16, hidden, T, hidden, qa, da, sa);
            MARK(P_QUANT);
            matmul(&L->gate_up, hidden, qa, da, sa, T, gu);
            if (pools->lora && qmm_lora_add(pools->lora, i, 2, h, m->act_bf16, hidden, T, hidden, gu, 2 * F, 2 * F))
                goto oom;
            MARK(P_GATE_UP);
            if (m->gelu)
                qmm_gelu_tanh_mul(gu, 0, 2 * (int64_t)F, T, F, act);
            else
                qmm_silu_mul(gu, 0, 2 * (int64_t)F, T, F, act);
            MARK(P_SILU);
            qmm_quantize(act, 0, F, T, F, qa, da, sa);
            MARK(P_QUANT);
            matmul(&L->down, F, qa, da, sa, T, o);
            if (pools->lora && qmm_lora_add(pools->lora, i, 3, act, 0, F, T, F, o, hidden, hidden)) goto oom;
            MARK(P_DOWN);
        }
        if (L->mlp_out_norm) norm_in_place(o, hidden, T, hidden, L->mlp_out_norm, m->eps);
        if (L->ple_gate.n_parts || L->out_scale != 0.0f) { /* Gemma 4: more after the MLP's residual add */
            for (size_t j = 0; j < (size_t)T * hidden; j++) x[j] += o[j];
            MARK(P_NORM);
            if (L->ple_gate.n_parts)
                per_layer_input(m, L, T, x, pools->ple + (size_t)i * w, (int64_t)m->n_layers * w, h, qa, da, sa, o,
                                gp, act);
            MARK(P_PLE);
            if (L->out_scale != 0.0f)
                for (size_t j = 0; j < (size_t)T * hidden; j++) x[j] *= L->out_scale;
            qmm_add_rms_norm(x, 0, hidden, 0, L->next_norm, T, hidden, m->eps, 0, h, m->act_bf16);
        } else {
            qmm_add_rms_norm(o, 0, hidden, x, L->next_norm, T, hidden, m->eps, x, h, m->act_bf16);
        }
        MARK(P_NORM);
    }
    free(mem);
    return 0;
oom:
    free(mem);
    return -1;
}
