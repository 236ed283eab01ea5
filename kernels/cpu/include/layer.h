/* layer.c: the whole decoder layer stack for one flat batch of rows in one call, composed of blocks.

   A layer is a token mixer (the attention block, or a Gated DeltaNet mixer in its place), a feed-forward (the
   gated MLP block, or a Mixture-of-Experts one in its place) and, optionally, a per-layer input; each block's
   options are the fields of its struct, zero / NULL when off. A model's plan (its package's native_plan.py, or
   kernels.cpu.decoder for the Llama-like ones) fills these structs: a new architecture made of these blocks adds a
   plan, not a section here. kernels/cpu/blocks.py mirrors every struct (and gdn_layer.h's and moe_layer.h's) in ctypes;
   qmm_decoder_layout holds the two to the same layout (tests/kernels/test_cpu_decoder_layout.py). */
#pragma once
#include <stdint.h>

#include "conv_layer.h"
#include "gdn_layer.h"
#include "moe_layer.h"
#include "ssd_layer.h"

enum { QWEIGHT_MAX_PARTS = 4 };

/* A weight stacked from up to QWEIGHT_MAX_PARTS block-format parts along its output rows (BlockWeight's parts);
   n_parts 0: no weight. */
typedef struct {
    int32_t n_parts;
    int32_t fmt[QWEIGHT_MAX_PARTS];
    int32_t rows[QWEIGHT_MAX_PARTS];
    int64_t row_bytes[QWEIGHT_MAX_PARTS];
    const uint8_t *w[QWEIGHT_MAX_PARTS];
} qweight_t;

/* The attention block: qkv matmul (+ bias) -> [per-head q / k / v norms] -> RoPE + K/V write into the paged pool ->
   paged attention [over a sliding window, with sinks] -> [times the sigmoid gate, per value or per head] -> o matmul
   (+ bias). */
typedef struct {
    qweight_t qkv, o;        /* qkv: [q, k, v] rows (q alone when kv_shared; [q, k] when k_eq_v) */
    const float *qkv_bias;   /* float32 [q + 2 kv], or NULL */
    const float *q_norm, *k_norm; /* RMSNorm weights [D] of each q and k head before RoPE, or NULL */
    const float *v_norm;     /* RMSNorm weights [D] of each v head (ones: a weightless norm), or NULL */
    const float *sinks;      /* per-head sinks [H]: an extra logit in each head's softmax denominator, or NULL */
    const float *o_bias;     /* o's bias [hidden], added in the attention output's dtype, or NULL */
    int32_t D, Hkv;          /* this layer's head size and K/V heads (0: the decoder's) */
    int32_t window;          /* a sliding window (keys) over each row's last positions, 0: every position */
    int32_t local_rope;      /* RoPE from the decoder's local tables (cos_local / sin_local) */
    int32_t kv_shared;       /* qkv is q alone: no K/V written; attends over the pool slot layer_pool names */
    int32_t k_eq_v;          /* qkv is q and k: V is K before K's norm and RoPE */
    int32_t gate;            /* qkv is [q | gate] per head, then k, v: q and k normed per head into rows of their
                                own, the attention output times sigmoid(gate) before o */
    int32_t head_gate;       /* qkv ends with one gate row per head (after v): each head's attention output times
                                sigmoid(its gate) before o */
} attention_t;

/* A recurrent mixer in place of the attention: in_proj matmul -> a Gated DeltaNet (qmm_gdn_mix, gated_delta.c), a
   gated short convolution (qmm_conv_mix, short_conv.c) or a Mamba-2 mixer (qmm_ssd_mix, mamba2.c) over the step's
   recurrent states in place -> out_proj matmul. gdn, conv and ssd NULL: the layer attends. */
typedef struct {
    const gdn_layer_t *gdn;
    qweight_t in_proj, out_proj;
    const conv_layer_t *conv;
    const ssd_layer_t *ssd;
} mixer_t;

/* The gated MLP block: gate_up matmul -> SiLU- or GELU(tanh)-mul (decoder_t.gelu) -> down matmul; or, with relu2,
   the ungated one: up matmul (gate_up holds up alone, F rows) -> relu(x)^2 -> down matmul. */
typedef struct {
    qweight_t gate_up, down;
    int32_t F;     /* this layer's intermediate size (0: the decoder's) */
    int32_t relu2; /* ungated, squared ReLU (Nemotron-H's MLP blocks) */
} mlp_t;

/* A per-layer input after the feed-forward's residual add: x += rms_norm(proj(gelu_tanh(gate(x)) * the row's
   per-layer input)) * norm. gate.n_parts 0: none. */
typedef struct {
    qweight_t gate, proj; /* gate [width, hidden], projection [hidden, width] */
    const float *norm;
} ple_t;

/* The residual stream's norms and scale around the blocks. */
typedef struct {
    const float *mix_out;  /* RMSNorm of the token mixer's output before its residual add, or NULL */
    const float *ffn_in;   /* the RMSNorm after the mixer's residual add: the feed-forward's input */
    const float *ffn_out;  /* RMSNorm of the feed-forward's output before its residual add, or NULL */
    const float *next;     /* the next layer's input norm; the final norm after the last layer */
    float out_scale;       /* the residual stream's scale at the layer's end (0: none) */
    float branch_scale;    /* the mixer's and the feed-forward's outputs times this before their residual adds
                              (Granite's residual multiplier; 0: none) */
} norms_t;

/* A layer without a token mixer (attn.qkv without parts, no mixer) runs its feed-forward (the MLP block or the MoE
   one) on its input h (normed by the previous layer's norms.next); one without a feed-forward (no mlp.gate_up
   parts, no moe) adds the mixer's output and norms with norms.next. Nemotron-H's single-mixer blocks (its MoE
   blocks too) are such layers. */
typedef struct {
    attention_t attn;
    mixer_t mixer;    /* in place of attn where mixer.gdn, mixer.conv or mixer.ssd is set */
    mlp_t mlp;
    const moe_t *moe; /* a Mixture-of-Experts feed-forward (moe_layer.c) in place of mlp, or NULL */
    ple_t ple;
    norms_t norms;
} layer_t;

typedef struct decoder {
    int32_t n_layers, hidden, H, Hkv, D, F; /* F: the MLP's intermediate size */
    float eps, scale;
    int32_t act_bf16;        /* normed activations h in bfloat16 (else float32) */
    int32_t gelu;            /* the MLP's activation: GELU (tanh) instead of SiLU */
    const float *first_norm; /* layer 0's input norm */
    const layer_t *layers;
    const float *cos, *sin;             /* RoPE tables [positions, D / 2] */
    const float *cos_local, *sin_local; /* the local_rope layers' tables (NULL: the same) */
    int32_t half_local;                 /* the local tables' width (0: D / 2) */
    int32_t ple_width;                  /* the per-layer input width, 0 without */
} decoder_t;

/* One step's K/V: up to two pools (the main one and a second, e.g. for sliding-window layers), each [layers, blocks,
   block_size, Hkv, D] with its own block tables and slots; layer i lives in pool layer_pool[2i], at its layer
   layer_pool[2i + 1]. */
typedef struct step_pools {
    void *k[2], *v[2];
    int64_t layer_stride[2];
    const int32_t *tables[2];
    int64_t table_stride[2];
    const int64_t *slots[2];
    const int32_t *layer_pool;
    const void *lora;             /* the step's LoRA adapters (lora.c's lora_step_t), or NULL */
    const float *ple;             /* the step's per-layer inputs [T, n_layers, ple_width], or NULL */
    const gdn_step_t *recurrent;  /* the step's rows' recurrent-state slots for mixer layers, or NULL */
} step_pools_t;

/* Run every layer over T rows (x: the residual stream, updated in place; h_out: the final-normed hidden states);
   0, or -1 when out of memory. */
int qmm_decoder_forward(const decoder_t *m, int T, const int64_t *positions, float *x, void *h_out, int cache_bf16,
                        int block_size, const int32_t *row_seq, const int32_t *row_len, const step_pools_t *pools);

/* The layout of these structs (and gdn_layer.h's, conv_layer.h's, ssd_layer.h's and moe_layer.h's) for their ctypes
   mirror: sizeof of "layer_t", the offset of "layer_t.attn.qkv", ...; -1 for a name it does not know. */
int64_t qmm_decoder_layout(const char *name);
