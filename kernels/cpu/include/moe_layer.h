/* moe_layer.c: a whole Mixture-of-Experts feed-forward in one call. */
#pragma once
#include <stdint.h>

enum { EXPERT_PARTS = 4 };
/* ROUTE_SIGMOID_BIAS: sigmoid of each logit; the top k of sigmoid + choice_bias chosen; their sigmoids the weights
   (normalize: over their sum + norm_eps). Every route's weights end times scale (0: 1). */
enum { ROUTE_SOFTMAX_TOPK = 0, ROUTE_TOPK_SOFTMAX = 1, ROUTE_SIGMOID_BIAS = 2 };
/* ACT_RELU2: ungated experts (gate_up holds up alone, F rows; the shared expert's shared_F), relu(x)^2 */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_SWIGLU_OAI = 2, ACT_RELU2 = 3 };

/* One projection of every expert: up to EXPERT_PARTS parts stacked along the output rows, part p in format fmt[p]
   at w[p], expert e's rows at w[p] + e * expert_bytes[p] (a dense weight: one expert, expert_bytes 0). */
typedef struct {
    int32_t n_parts;
    int32_t fmt[EXPERT_PARTS];
    int32_t rows[EXPERT_PARTS];
    int64_t row_bytes[EXPERT_PARTS];
    int64_t expert_bytes[EXPERT_PARTS];
    const uint8_t *w[EXPERT_PARTS];
} experts_t;

/* The layer's plan (packed by kernels.cpu.moe_layer; its ctypes mirror, kernels.cpu.blocks.MoE, is held to this
   layout by qmm_decoder_layout). */
typedef struct moe {
    int32_t n_experts, k, hidden, F; /* F: one expert's intermediate size */
    int32_t route;                   /* ROUTE_* */
    int32_t normalize;               /* renormalize the chosen weights to sum to 1 (softmax_topk, sigmoid_bias) */
    int32_t act;                     /* ACT_* */
    float alpha, limit;              /* ACT_SWIGLU_OAI's */
    const float *router;             /* float32 [n_experts, hidden] */
    const float *router_bias;        /* [n_experts], or NULL */
    experts_t gate_up, down;         /* [E, 2F, hidden] (gate rows first; ACT_RELU2: [E, F, hidden]), [E, hidden, F] */
    const float *gate_up_bias;       /* [E, 2F] ([E, F] for ACT_RELU2), or NULL */
    const float *down_bias;          /* [E, hidden], or NULL */
    int32_t shared_F;                /* the shared expert's intermediate size, 0 without one */
    experts_t shared_gate_up, shared_down; /* one expert each */
    const float *shared_gate;        /* [hidden]: its output times sigmoid(h . shared_gate), or NULL */
    const float *choice_bias;        /* ROUTE_SIGMOID_BIAS: [E] added to the sigmoids to choose the top k, or NULL */
    float scale;                     /* the routing weights times this (0: 1; a routed scaling factor) */
    float norm_eps;                  /* ROUTE_SIGMOID_BIAS with normalize: added to the weights' sum */
} moe_t;

/* out = the MoE feed-forward of h (`m`: its plan); route_w / route_ids: the routing, where the caller keeps it. */
int qmm_moe_forward(const moe_t *m, int T, const void *h, int h_bf16, int64_t ldh, const float *route_w,
                    const int32_t *route_ids, int with_shared, float *out);
/* Free the kept scratch memory unless a call is using it. */
void qmm_moe_release(void);
