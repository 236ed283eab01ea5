/* A whole decoder stack for one flat batch of rows in one call, composed of the blocks layer.h declares. Per layer:

     h -> token mixer: the attention block (qkv matmul (+ bias) -> [q / k / v norms per head] -> RoPE + K/V write
          into the paged pool -> paged attention [window, sinks] -> [sigmoid gate, per value or per head] -> o
          matmul (+ bias)), or a recurrent mixer in its place (in_proj -> a Gated DeltaNet's qmm_gdn_mix, a gated
          short convolution's qmm_conv_mix or a Mamba-2 one's qmm_ssd_mix over the step's recurrent states ->
          out_proj)
       -> [RMSNorm] -> [times the branch scale] -> residual add + RMSNorm
       -> feed-forward: the gated MLP block (gate_up -> SiLU- or GELU-mul -> down; or up -> relu^2 -> down), or a
          Mixture-of-Experts one (moe_layer.c) in its place
       -> [RMSNorm] -> [times the branch scale] -> residual add -> [per-layer input] -> [scale] -> the next layer's
          RMSNorm.

   A layer runs the blocks its layer_t switches on; the bracketed steps are options, off when zero / NULL.

   It calls the same kernels, in the same order, with the same dtypes as the per-op path of the models
   (qmm/, attention.c, elementwise.c, gated_delta.c, short_conv.c, moe_layer.c), so its results are bit for bit those
   of that path (save the Mamba-2 mixer, whose per-op conv and norm are torch's: mamba2.c agrees with them to
   rounding); what it saves is the Python, ctypes and allocator work around every one of those kernels. Every kernel
   computes each row on its own in a fixed order, so a row's result does not depend on the batch. */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "attention_q8.h"
#include "elementwise.h"
#include "gated_delta.h"
#include "half.h"
#include "layer.h"
#include "lora.h"
#include "qmatmul.h"

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

/* One call's state: the model, the step, and the scratch every block shares (one allocation, `mem`). */
typedef struct {
    const decoder_t *m;
    int T, cache_fmt, block_size;
    const int32_t *row_seq, *row_len;
    const step_pools_t *pools;
    char *mem;
    float *qkv, *o, *gu, *act, *gp, *vk, *mix, *hm, *cs, *sn, *cs_l, *sn_l, *da;
    void *q;   /* the queries, then the attention output (bf16 beside a bf16 pool) */
    int16_t *sa;
    int8_t *qa;
    int32_t *win_lo, *win_len;
    int32_t have_window; /* the window win_lo / win_len hold */
} run_t;

/* An attention layer's sizes. */
typedef struct {
    int D, Hkv, qd, kvd, nqkv;
} attn_dims_t;

/* Where the attention's q, k and v rows lie after their norms. */
typedef struct {
    float *q, *k, *v;
    int64_t ldq, ldk, ldv;
} qkv_rows_t;

/* the output rows of a weight (all its parts) */
static int weight_rows(const qweight_t *w) {
    int rows = 0;
    for (int p = 0; p < w->n_parts; p++) rows += w->rows[p];
    return rows;
}

static void matmul(const qweight_t *w, int K, const run_t *r, float *out) {
    const int64_t ldo = weight_rows(w);
    int64_t col = 0;
    for (int p = 0; p < w->n_parts; p++) {
        qmm_matmul(w->fmt[p], w->w[p], w->row_bytes[p], w->rows[p], K, r->qa, r->da, r->sa, r->T, out + col, ldo);
        col += w->rows[p];
    }
}

static inline int imax(int a, int b) { return a > b ? a : b; }

/* f rounded to bfloat16 (nearest even) and back */
static inline float round_bf16(float f) {
    const uint32_t bits = f32_to_bits(f);
    return f32_from_bits((bits + 0x7fffu + ((bits >> 16) & 1)) & 0xffff0000u);
}

/* x [T, N] float32 (rows ldx apart, the first N of each) := rms_norm(x) * weight, row by row in place */
static void norm_in_place(float *x, int64_t ldx, int T, int N, const float *weight, float eps) {
    if (ldx == N) {
        qmm_add_rms_norm(x, 0, N, 0, weight, T, N, eps, 0, x, 0);
        return;
    }
    for (int t = 0; t < T; t++) qmm_add_rms_norm(x + (size_t)t * ldx, 0, N, 0, weight, 1, N, eps, 0, x + (size_t)t * ldx, 0);
}

/* Quantize x [T, K] (packed rows, bf16 when x_bf16) into the run's activation blocks. */
static void quantize(run_t *r, const void *x, int x_bf16, int K) {
    qmm_quantize(x, x_bf16, K, r->T, K, r->qa, r->da, r->sa);
}

/* Quantize float32 x [T, K] for a matmul, first rounding it to bf16 in hb when as_bf16 (as the per-op path casts
   activations it keeps in bf16). */
static void quantize_f32(run_t *r, const float *x, int K, int as_bf16, void *hb) {
    if (as_bf16) {
        qmm_to_bf16(x, (int64_t)r->T * K, hb);
        quantize(r, hb, 1, K);
    } else {
        quantize(r, x, 0, K);
    }
}

static attn_dims_t attn_dims(const decoder_t *m, const attention_t *a) {
    attn_dims_t d;
    d.D = a->D ? a->D : m->D;
    d.Hkv = a->Hkv ? a->Hkv : m->Hkv;
    d.qd = m->H * d.D;
    d.kvd = a->kv_shared ? 0 : d.Hkv * d.D;
    d.nqkv = (a->gate ? 2 * d.qd : d.qd) + (a->k_eq_v ? 1 : 2) * d.kvd + (a->head_gate ? m->H : 0);
    return d;
}

/* Whether the layer's token mixer is a recurrent one (else it attends, or has none). */
static int recurrent_mixer(const mixer_t *mx) { return mx->gdn || mx->conv || mx->ssd; }

/* A recurrent mixer's output width (out_proj's input) and its scratch per row. */
static int mixer_width(const mixer_t *mx) {
    return mx->gdn ? mx->gdn->Hv * mx->gdn->Dv : mx->ssd ? mx->ssd->H * mx->ssd->P : mx->conv->C;
}

static int64_t mixer_scratch_per_row(const mixer_t *mx) {
    return mx->gdn ? gdn_scratch_per_row(mx->gdn) : mx->ssd ? ssd_scratch_per_row(mx->ssd)
                                                             : conv_scratch_per_row(mx->conv);
}

/* ---- scratch ---- */

/* The widest layer's sizes (layers may differ), which size the scratch. */
typedef struct {
    int qd, nqkv, f, kvd, mix, mix_in;
} widths_t;

static widths_t layer_widths(const decoder_t *m) {
    widths_t w = {m->H * m->D, m->H * m->D + 2 * m->Hkv * m->D, m->F, m->Hkv * m->D, 0, 0};
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *L = m->layers + i;
        const attn_dims_t d = attn_dims(m, &L->attn);
        w.qd = imax(w.qd, d.qd);
        w.nqkv = imax(w.nqkv, d.qd + 2 * d.kvd + (L->attn.head_gate ? m->H : 0));
        w.f = imax(w.f, L->mlp.F ? L->mlp.F : m->F);
        w.kvd = imax(w.kvd, d.Hkv * d.D);
        if (recurrent_mixer(&L->mixer)) { /* the mixer's scratch and output; o's input width */
            const int vd = mixer_width(&L->mixer);
            w.nqkv = imax(w.nqkv, weight_rows(&L->mixer.in_proj));
            w.mix = imax(w.mix, (int)mixer_scratch_per_row(&L->mixer) + vd);
            w.mix_in = imax(w.mix_in, vd);
        } else if (L->attn.gate) { /* q and k normed into rows of their own, the gated output */
            w.nqkv = imax(w.nqkv, 2 * d.qd + 2 * d.Hkv * d.D);
            w.mix = imax(w.mix, 2 * d.qd + d.Hkv * d.D);
        } else if (L->attn.head_gate) { /* the gated output */
            w.mix = imax(w.mix, d.qd);
        }
    }
    return w;
}

/* Carve the run's scratch out of one allocation: float32 first, then the narrower types; -1 when out of memory. */
static int run_alloc(run_t *r) {
    const decoder_t *m = r->m;
    const int T = r->T, hidden = m->hidden, half = m->D / 2, w = m->ple_width, local = m->cos_local != 0;
    const int half_l = local && m->half_local ? m->half_local : half;
    const widths_t wd = layer_widths(m);
    const int kmax = imax(imax(imax(hidden, wd.qd), imax(wd.f, w)), wd.mix_in), act_max = imax(wd.f, w);
    /* kv_q8.h's KV_Q8_0 and KV_F16: queries and attention outputs in float32 (bf16 only beside a bf16 pool) */
    const size_t q_el = r->cache_fmt == 1 ? 2 : 4;
    size_t floats = (size_t)T * (wd.nqkv + hidden + 2 * (size_t)wd.f + act_max + 2 * half + (local ? 2 * half_l : 0) +
                                 kmax / 32 + 2 * (size_t)w + wd.kvd + wd.mix + hidden);
    size_t bytes = floats * 4 + (size_t)T * wd.qd * q_el + (size_t)T * kmax + (size_t)T * (kmax / 16) * 2 +
                   (size_t)T * 2 * sizeof(int32_t) + 64;
    r->mem = malloc(bytes);
    if (!r->mem) return -1;
    r->qkv = (float *)r->mem;
    r->o = r->qkv + (size_t)T * wd.nqkv;
    r->gu = r->o + (size_t)T * hidden;
    r->act = r->gu + (size_t)T * 2 * wd.f;
    r->gp = r->act + (size_t)T * act_max;   /* the per-layer input's gate and input rows */
    r->vk = r->gp + (size_t)T * 2 * w;       /* V = K's copy (k_eq_v layers) */
    r->mix = r->vk + (size_t)T * wd.kvd;     /* a mixer's scratch and output, or the gated attention's q, k, output */
    r->hm = r->mix + (size_t)T * wd.mix;     /* a MoE layer's normed input, float32 (its router's input) */
    r->cs = r->hm + (size_t)T * hidden;
    r->sn = r->cs + (size_t)T * half;
    r->cs_l = local ? r->sn + (size_t)T * half : r->cs;
    r->sn_l = local ? r->cs_l + (size_t)T * half_l : r->sn;
    r->da = local ? r->sn_l + (size_t)T * half_l : r->sn + (size_t)T * half;
    char *rest = (char *)(r->da + (size_t)T * (kmax / 32));
    r->q = rest;
    r->sa = (int16_t *)(rest + (size_t)T * wd.qd * q_el);
    r->qa = (int8_t *)(r->sa + (size_t)T * (kmax / 16));
    r->win_lo = (int32_t *)(r->qa + (size_t)T * kmax);
    r->win_len = r->win_lo + T;
    r->have_window = 0;
    return 0;
}

/* Each row's RoPE table rows (and the local tables'), gathered by position. */
static void rope_rows(run_t *r, const int64_t *positions) {
    const decoder_t *m = r->m;
    const int half = m->D / 2, half_l = m->half_local ? m->half_local : half;
    for (int t = 0; t < r->T; t++) {
        memcpy(r->cs + (size_t)t * half, m->cos + positions[t] * half, sizeof(float) * half);
        memcpy(r->sn + (size_t)t * half, m->sin + positions[t] * half, sizeof(float) * half);
        if (m->cos_local) {
            memcpy(r->cs_l + (size_t)t * half_l, m->cos_local + positions[t] * half_l, sizeof(float) * half_l);
            memcpy(r->sn_l + (size_t)t * half_l, m->sin_local + positions[t] * half_l, sizeof(float) * half_l);
        }
    }
}

/* ---- the attention block ---- */

/* qkv := the quantized h's q, k, v rows (+ LoRA, + bias); -1 when LoRA is out of memory. */
static int attn_project(run_t *r, int i, const attention_t *a, const attn_dims_t *d, const void *h) {
    const int T = r->T, hidden = r->m->hidden, n = d->nqkv;
    matmul(&a->qkv, hidden, r, r->qkv);
    if (r->pools->lora && qmm_lora_add(r->pools->lora, i, 0, h, r->m->act_bf16, hidden, T, hidden, r->qkv, n, n))
        return -1;
    if (a->qkv_bias)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < n; j++) r->qkv[(size_t)t * n + j] += a->qkv_bias[j];
    MARK(P_QKV);
    return 0;
}

/* The q / k / v norms per head (and V as K's copy); where the rows lie then. */
static qkv_rows_t attn_norms(run_t *r, const attention_t *a, const attn_dims_t *d) {
    const int T = r->T, H = r->m->H, D = d->D, qd = d->qd, kvd = d->kvd, n = d->nqkv;
    const float eps = r->m->eps;
    float *qkv = r->qkv;
    qkv_rows_t x = {qkv, qkv + qd, qkv + qd + kvd, n, n, n};
    if (a->k_eq_v && kvd) { /* V is K before its norm and RoPE */
        for (int t = 0; t < T; t++) memcpy(r->vk + (size_t)t * kvd, qkv + (size_t)t * n + qd, sizeof(float) * kvd);
        x.v = r->vk;
        x.ldv = kvd;
    }
    if (a->gate) { /* [q | gate] per head: q and k normed into rows of their own */
        x.q = r->mix;
        x.k = r->mix + (size_t)T * qd;
        qmm_head_rms_norm(qkv, n, 2 * D, 0, 0, 0, T, H, D, a->q_norm, eps, x.q);
        qmm_head_rms_norm(qkv + 2 * qd, n, D, 0, 0, 0, T, d->Hkv, D, a->k_norm, eps, x.k);
        x.v = qkv + 2 * qd + kvd;
        x.ldq = qd;
        x.ldk = kvd;
    } else if (a->q_norm)
        for (int t = 0; t < T; t++) {
            norm_in_place(qkv + (size_t)t * n, D, H, D, a->q_norm, eps);
            if (!a->kv_shared) norm_in_place(qkv + (size_t)t * n + qd, D, d->Hkv, D, a->k_norm, eps);
        }
    if (a->v_norm && !a->kv_shared)
        for (int t = 0; t < T; t++) norm_in_place(x.v + (size_t)t * x.ldv, D, d->Hkv, D, a->v_norm, eps);
    MARK(P_NORM);
    return x;
}

/* The rows' first attended position and key count under the layer's window (NULL / row_len without one). */
static void window_rows(run_t *r, int window, const int32_t **lo, const int32_t **len) {
    *lo = 0;
    *len = r->row_len;
    if (window <= 0) return;
    if (r->have_window != window) {
        for (int t = 0; t < r->T; t++) {
            r->win_len[t] = r->row_len[t] < window ? r->row_len[t] : window;
            r->win_lo[t] = r->row_len[t] - r->win_len[t];
        }
        r->have_window = window;
    }
    *lo = r->win_lo;
    *len = r->win_len;
}

/* RoPE + K/V write into layer i's pool slot, then paged attention: the output in r->q; -1 when out of memory. */
static int attend(run_t *r, int i, const attention_t *a, const attn_dims_t *d, const qkv_rows_t *x) {
    const step_pools_t *pools = r->pools;
    const int T = r->T, H = r->m->H, D = d->D, fmt = r->cache_fmt, q_bf16 = fmt == 1;
    const int Hkv = a->kv_shared ? 0 : d->Hkv; /* a KV-shared layer rotates its q alone: nothing written */
    const int pl = pools->layer_pool[2 * i], at = pools->layer_pool[2 * i + 1];
    const size_t cache_el = fmt == 2 ? 1 : (fmt ? 2 : 4);
    char *kc = (char *)pools->k[pl] + (size_t)at * pools->layer_stride[pl] * cache_el;
    char *vc = (char *)pools->v[pl] + (size_t)at * pools->layer_stride[pl] * cache_el;
    qmm_rope_write_kv_fmt(x->q, x->k, x->v, 0, x->ldq, x->ldk, x->ldv, a->local_rope ? r->cs_l : r->cs,
                          a->local_rope ? r->sn_l : r->sn, kc, vc, fmt, pools->slots[pl], T, H, Hkv, D, r->q,
                          q_bf16);
    MARK(P_ROPE);
    const int32_t *lo, *len;
    window_rows(r, a->window, &lo, &len);
    const int32_t *tables = pools->tables[pl];
    const int64_t ts = pools->table_stride[pl];
    if (fmt == 2) {
        if (qmm_paged_attention_q8(r->q, q_bf16, T, H, D, kc, vc, r->block_size, d->Hkv, tables, ts, r->row_seq, lo,
                                   len, a->sinks, r->m->scale, r->q))
            return -1;
    } else if (a->sinks) {
        qmm_paged_attention_sinks(r->q, q_bf16, T, H, D, kc, vc, fmt, r->block_size, d->Hkv, tables, ts, r->row_seq,
                                  lo, len, a->sinks, r->m->scale, r->q);
    } else {
        qmm_paged_attention_from(r->q, q_bf16, T, H, D, kc, vc, fmt, r->block_size, d->Hkv, tables, ts, r->row_seq,
                                 lo, len, r->m->scale, r->q);
    }
    MARK(P_ATTN);
    return 0;
}

/* o := the o matmul of the attention output [times sigmoid(gate), a gate per value or per head] (+ bias, + LoRA);
   -1 when out of memory. */
static int attn_output(run_t *r, int i, const attention_t *a, const attn_dims_t *d) {
    const int T = r->T, hidden = r->m->hidden, qd = d->qd, q_bf16 = r->cache_fmt == 1;
    if (a->gate) { /* the output times sigmoid(gate), in float32 */
        float *gated = r->mix + (size_t)T * (qd + d->kvd);
        qmm_sigmoid_gate(r->q, q_bf16, r->qkv + d->D, d->nqkv, 2 * d->D, 1, T, r->m->H, d->D, gated);
        quantize(r, gated, 0, qd);
    } else if (a->head_gate) { /* each head's output times sigmoid(its gate), the row's last H values */
        qmm_sigmoid_gate(r->q, q_bf16, r->qkv + d->nqkv - r->m->H, d->nqkv, 1, 0, T, r->m->H, d->D, r->mix);
        quantize(r, r->mix, 0, qd);
    } else {
        quantize(r, r->q, q_bf16, qd);
    }
    MARK(P_QUANT);
    matmul(&a->o, qd, r, r->o);
    if (a->o_bias) /* in the attention output's dtype, as the per-op path casts it */
        for (int t = 0; t < T; t++)
            for (int j = 0; j < hidden; j++)
                r->o[(size_t)t * hidden + j] += q_bf16 ? round_bf16(a->o_bias[j]) : a->o_bias[j];
    if (r->pools->lora && qmm_lora_add(r->pools->lora, i, 1, r->q, q_bf16, qd, T, qd, r->o, hidden, hidden))
        return -1;
    MARK(P_O);
    return 0;
}

/* The attention block of layer i over the quantized h: its output in r->o; -1 when out of memory. */
static int attention_block(run_t *r, int i, const attention_t *a, const void *h) {
    const attn_dims_t d = attn_dims(r->m, a);
    if (attn_project(r, i, a, &d, h)) return -1;
    const qkv_rows_t x = attn_norms(r, a, &d);
    if (attend(r, i, a, &d, &x)) return -1;
    return attn_output(r, i, a, &d);
}

/* ---- the other blocks ---- */

/* The recurrent mixer (a Gated DeltaNet, a gated short convolution or a Mamba-2 one) over the quantized h:
   in_proj, the mixer over the step's states, out_proj into r->o. */
static void mixer_block(run_t *r, const mixer_t *mx) {
    const int T = r->T, np = weight_rows(&mx->in_proj), vd = mixer_width(mx);
    const gdn_step_t *st = r->pools->recurrent;
    float *scratch = r->mix + (size_t)T * vd;
    matmul(&mx->in_proj, r->m->hidden, r, r->qkv);
    MARK(P_QKV);
    if (mx->gdn)
        qmm_gdn_mix(mx->gdn, st, T, r->qkv, np, scratch, r->mix);
    else if (mx->ssd)
        qmm_ssd_mix(mx->ssd, st, T, r->qkv, np, scratch, r->mix);
    else
        qmm_conv_mix(mx->conv, st, T, r->qkv, np, scratch, r->mix);
    MARK(P_ATTN);
    quantize(r, r->mix, 0, vd);
    matmul(&mx->out_proj, vd, r, r->o);
    MARK(P_O);
}

/* o *= the layer's branch scale, when it has one (before a residual add) */
static void scale_branch(run_t *r, const layer_t *L) {
    const float k = L->norms.branch_scale;
    if (k != 0.0f)
        for (size_t j = 0; j < (size_t)r->T * r->m->hidden; j++) r->o[j] *= k;
}

/* The gated MLP of layer i over the normed h: its output in r->o; -1 when LoRA is out of memory. */
static int mlp_block(run_t *r, int i, const mlp_t *p, const void *h) {
    const decoder_t *m = r->m;
    const int T = r->T, hidden = m->hidden, F = p->F ? p->F : m->F, G = p->relu2 ? F : 2 * F;
    const void *lora = r->pools->lora;
    quantize(r, h, m->act_bf16, hidden);
    MARK(P_QUANT);
    matmul(&p->gate_up, hidden, r, r->gu);
    if (lora && qmm_lora_add(lora, i, 2, h, m->act_bf16, hidden, T, hidden, r->gu, G, G)) return -1;
    MARK(P_GATE_UP);
    if (p->relu2)
        for (size_t j = 0; j < (size_t)T * F; j++) r->act[j] = r->gu[j] > 0.0f ? r->gu[j] * r->gu[j] : 0.0f;
    else if (m->gelu)
        qmm_gelu_tanh_mul(r->gu, 0, 2 * (int64_t)F, T, F, r->act);
    else
        qmm_silu_mul(r->gu, 0, 2 * (int64_t)F, T, F, r->act);
    MARK(P_SILU);
    quantize(r, r->act, 0, F);
    MARK(P_QUANT);
    matmul(&p->down, F, r, r->o);
    if (lora && qmm_lora_add(lora, i, 3, r->act, 0, F, T, F, r->o, hidden, hidden)) return -1;
    MARK(P_DOWN);
    return 0;
}

/* The Mixture-of-Experts feed-forward over the normed rows h (float32, or bf16 when h_bf16): its output in r->o. */
static int moe_block(run_t *r, const moe_t *moe, const void *h, int h_bf16) {
    if (qmm_moe_forward(moe, r->T, h, h_bf16, r->m->hidden, 0, 0, 1, r->o)) return -1;
    MARK(P_MOE);
    return 0;
}

/* Layer i's per-layer input, after the feed-forward's residual add: x += rms_norm(proj(gelu_tanh(gate(x)) *
   ple)) * norm, with x and the GELU product rounded to bf16 before their matmuls when act_bf16 (as the per-op
   path casts them); hb (h's memory) is scratch. */
static void ple_block(run_t *r, int i, const ple_t *p, float *x, void *hb) {
    const decoder_t *m = r->m;
    const int T = r->T, hidden = m->hidden, w = m->ple_width;
    const float *ple = r->pools->ple + (size_t)i * w;
    const int64_t ple_ld = (int64_t)m->n_layers * w;
    quantize_f32(r, x, hidden, m->act_bf16, hb);
    matmul(&p->gate, hidden, r, r->o);
    for (int t = 0; t < T; t++) {
        memcpy(r->gp + (size_t)t * 2 * w, r->o + (size_t)t * w, sizeof(float) * w);
        memcpy(r->gp + (size_t)t * 2 * w + w, ple + (size_t)t * ple_ld, sizeof(float) * w);
    }
    qmm_gelu_tanh_mul(r->gp, 0, 2 * (int64_t)w, T, w, r->act);
    quantize_f32(r, r->act, w, m->act_bf16, hb);
    matmul(&p->proj, w, r, r->o);
    norm_in_place(r->o, hidden, T, hidden, p->norm, m->eps);
    for (size_t j = 0; j < (size_t)T * hidden; j++) x[j] += r->o[j];
}

/* ---- the layer and the stack ---- */

/* The feed-forward's residual add, [the per-layer input], [the scale], and the next layer's norm into h. */
static void layer_end(run_t *r, int i, const layer_t *L, float *x, void *h) {
    const decoder_t *m = r->m;
    const int T = r->T, hidden = m->hidden;
    if (L->norms.ffn_out) norm_in_place(r->o, hidden, T, hidden, L->norms.ffn_out, m->eps);
    scale_branch(r, L);
    if (L->ple.gate.n_parts || L->norms.out_scale != 0.0f) {
        for (size_t j = 0; j < (size_t)T * hidden; j++) x[j] += r->o[j];
        MARK(P_NORM);
        if (L->ple.gate.n_parts) ple_block(r, i, &L->ple, x, h);
        MARK(P_PLE);
        if (L->norms.out_scale != 0.0f)
            for (size_t j = 0; j < (size_t)T * hidden; j++) x[j] *= L->norms.out_scale;
        qmm_add_rms_norm(x, 0, hidden, 0, L->norms.next, T, hidden, m->eps, 0, h, m->act_bf16);
    } else {
        qmm_add_rms_norm(r->o, 0, hidden, x, L->norms.next, T, hidden, m->eps, x, h, m->act_bf16);
    }
    MARK(P_NORM);
}

/* Layer i: the token mixer, the feed-forward, the residual stream's norms; -1 when out of memory. */
static int layer_forward(run_t *r, int i, float *x, void *h) {
    const decoder_t *m = r->m;
    const layer_t *L = m->layers + i;
    const int T = r->T, hidden = m->hidden;
    const int mixes = recurrent_mixer(&L->mixer) || L->attn.qkv.n_parts;
    const int feeds = L->moe || L->mlp.gate_up.n_parts;
    if (mixes) {
        quantize(r, h, m->act_bf16, hidden);
        MARK(P_QUANT);
        if (recurrent_mixer(&L->mixer))
            mixer_block(r, &L->mixer);
        else if (attention_block(r, i, &L->attn, h))
            return -1;
        if (L->norms.mix_out) norm_in_place(r->o, hidden, T, hidden, L->norms.mix_out, m->eps);
        scale_branch(r, L);
        /* a MoE layer's input stays float32: rounded to bf16, a router near-tie flips experts (issue 54); a layer
           without a feed-forward ends here with the next layer's norm */
        const float *norm = feeds ? L->norms.ffn_in : L->norms.next;
        qmm_add_rms_norm(r->o, 0, hidden, x, norm, T, hidden, m->eps, x, L->moe ? (void *)r->hm : h,
                         L->moe ? 0 : m->act_bf16);
        MARK(P_NORM);
        if (!feeds) return 0;
    }
    /* a layer without a token mixer feeds on h as the previous layer normed it (in the activations' dtype) */
    if (L->moe ? moe_block(r, L->moe, mixes ? (const void *)r->hm : h, mixes ? 0 : m->act_bf16)
               : mlp_block(r, i, &L->mlp, h))
        return -1;
    layer_end(r, i, L, x, h);
    return 0;
}

/* Run every layer over T rows. x [T, hidden] float32: the embeddings in, the residual stream out; h_out
   [T, hidden] (bf16 when act_bf16): the final-normed hidden states. The K/V pools (bf16 when cache_bf16 is 1; q8_0
   bytes, kv_q8.h, when it is 2, float16 when it is 3, with the attention's queries and outputs then in float32, as
   the per-op path) are `pools`'; row t is at position positions[t], writes its K/V at slot slots[t] of each pool
   and attends to the first row_len[t] positions of sequence row_seq[t] (the last `window` of them in a
   sliding-window layer). Returns 0, or -1 when out of memory. */
int qmm_decoder_forward(const decoder_t *m, int T, const int64_t *positions, float *x, void *h_out, int cache_bf16,
                        int block_size, const int32_t *row_seq, const int32_t *row_len, const step_pools_t *pools) {
    if (T <= 0) return 0;
    run_t r = {.m = m, .T = T, .cache_fmt = cache_bf16, .block_size = block_size, .row_seq = row_seq,
               .row_len = row_len, .pools = pools};
    if (run_alloc(&r)) return -1;
    rope_rows(&r, positions);
    MARK_START();
    qmm_add_rms_norm(x, 0, m->hidden, 0, m->first_norm, T, m->hidden, m->eps, 0, h_out, m->act_bf16);
    MARK(P_NORM);
    int rc = 0;
    for (int i = 0; i < m->n_layers && !rc; i++) rc = layer_forward(&r, i, x, h_out);
    free(r.mem);
    return rc;
}

/* ---- the structs' layout, for their ctypes mirror ---- */

#define SIZE(T) {#T, (int64_t)sizeof(T)}
#define AT(T, f) {#T "." #f, (int64_t)offsetof(T, f)}
static const struct {
    const char *name;
    int64_t value;
} LAYOUT[] = {
    SIZE(qweight_t), AT(qweight_t, n_parts), AT(qweight_t, fmt), AT(qweight_t, rows), AT(qweight_t, row_bytes),
    AT(qweight_t, w),
    SIZE(attention_t), AT(attention_t, qkv), AT(attention_t, o), AT(attention_t, qkv_bias), AT(attention_t, q_norm),
    AT(attention_t, k_norm), AT(attention_t, v_norm), AT(attention_t, sinks), AT(attention_t, o_bias),
    AT(attention_t, D), AT(attention_t, Hkv), AT(attention_t, window), AT(attention_t, local_rope),
    AT(attention_t, kv_shared), AT(attention_t, k_eq_v), AT(attention_t, gate), AT(attention_t, head_gate),
    SIZE(mixer_t), AT(mixer_t, gdn), AT(mixer_t, in_proj), AT(mixer_t, out_proj), AT(mixer_t, conv), AT(mixer_t, ssd),
    SIZE(mlp_t), AT(mlp_t, gate_up), AT(mlp_t, down), AT(mlp_t, F), AT(mlp_t, relu2),
    SIZE(ple_t), AT(ple_t, gate), AT(ple_t, proj), AT(ple_t, norm),
    SIZE(norms_t), AT(norms_t, mix_out), AT(norms_t, ffn_in), AT(norms_t, ffn_out), AT(norms_t, next),
    AT(norms_t, out_scale), AT(norms_t, branch_scale),
    SIZE(layer_t), AT(layer_t, attn), AT(layer_t, mixer), AT(layer_t, mlp), AT(layer_t, moe), AT(layer_t, ple),
    AT(layer_t, norms),
    SIZE(decoder_t), AT(decoder_t, n_layers), AT(decoder_t, hidden), AT(decoder_t, H), AT(decoder_t, Hkv),
    AT(decoder_t, D), AT(decoder_t, F), AT(decoder_t, eps), AT(decoder_t, scale), AT(decoder_t, act_bf16),
    AT(decoder_t, gelu), AT(decoder_t, first_norm), AT(decoder_t, layers), AT(decoder_t, cos), AT(decoder_t, sin),
    AT(decoder_t, cos_local), AT(decoder_t, sin_local), AT(decoder_t, half_local), AT(decoder_t, ple_width),
    SIZE(step_pools_t), AT(step_pools_t, k), AT(step_pools_t, v), AT(step_pools_t, layer_stride),
    AT(step_pools_t, tables), AT(step_pools_t, table_stride), AT(step_pools_t, slots), AT(step_pools_t, layer_pool),
    AT(step_pools_t, lora), AT(step_pools_t, ple), AT(step_pools_t, recurrent),
    SIZE(gdn_layer_t), AT(gdn_layer_t, Hk), AT(gdn_layer_t, Hv), AT(gdn_layer_t, Dk), AT(gdn_layer_t, Dv),
    AT(gdn_layer_t, K), AT(gdn_layer_t, tiled), AT(gdn_layer_t, index), AT(gdn_layer_t, eps), AT(gdn_layer_t, scale),
    AT(gdn_layer_t, conv_weight), AT(gdn_layer_t, A_log), AT(gdn_layer_t, dt_bias), AT(gdn_layer_t, norm),
    SIZE(gdn_step_t), AT(gdn_step_t, conv), AT(gdn_step_t, conv_slot_stride), AT(gdn_step_t, conv_layer_stride),
    AT(gdn_step_t, state), AT(gdn_step_t, state_slot_stride), AT(gdn_step_t, state_layer_stride),
    AT(gdn_step_t, cu), AT(gdn_step_t, slots), AT(gdn_step_t, B),
    AT(gdn_step_t, keep), AT(gdn_step_t, spec), AT(gdn_step_t, spec_layer_stride), AT(gdn_step_t, spec_rows),
    AT(gdn_step_t, owed), AT(gdn_step_t, owed_layer_stride), AT(gdn_step_t, owed_n),
    SIZE(experts_t), AT(experts_t, n_parts), AT(experts_t, fmt), AT(experts_t, rows), AT(experts_t, row_bytes),
    AT(experts_t, expert_bytes), AT(experts_t, w),
    SIZE(moe_t), AT(moe_t, n_experts), AT(moe_t, k), AT(moe_t, hidden), AT(moe_t, F), AT(moe_t, route),
    AT(moe_t, normalize), AT(moe_t, act), AT(moe_t, alpha), AT(moe_t, limit), AT(moe_t, router),
    AT(moe_t, router_bias), AT(moe_t, gate_up), AT(moe_t, down), AT(moe_t, gate_up_bias), AT(moe_t, down_bias),
    AT(moe_t, shared_F), AT(moe_t, shared_gate_up), AT(moe_t, shared_down), AT(moe_t, shared_gate),
    AT(moe_t, choice_bias), AT(moe_t, scale), AT(moe_t, norm_eps),
    SIZE(ssd_layer_t), AT(ssd_layer_t, H), AT(ssd_layer_t, P), AT(ssd_layer_t, N), AT(ssd_layer_t, G),
    AT(ssd_layer_t, K), AT(ssd_layer_t, index), AT(ssd_layer_t, eps), AT(ssd_layer_t, conv_weight),
    AT(ssd_layer_t, conv_bias), AT(ssd_layer_t, dt_bias), AT(ssd_layer_t, A), AT(ssd_layer_t, D),
    AT(ssd_layer_t, norm),
    SIZE(conv_layer_t), AT(conv_layer_t, C), AT(conv_layer_t, K), AT(conv_layer_t, index), AT(conv_layer_t, weight),
};

int64_t qmm_decoder_layout(const char *name) {
    for (size_t i = 0; i < sizeof(LAYOUT) / sizeof(LAYOUT[0]); i++)
        if (!strcmp(LAYOUT[i].name, name)) return LAYOUT[i].value;
    return -1;
}
