/* A Gated DeltaNet (Qwen3.5 linear-attention) layer as the fused layer stack (layer.c) runs it, in place of the
   attention: layer.c does the in_proj matmul ([conv q | k | v, z, b, a] per row: its layer_t.qkv) and the out_proj
   one (its layer_t.o); qmm_gdn_mix (gated_delta.c) does everything between them over the step's recurrent states,
   read and written in place in the engine's state pool (edgeserve/engine/cache/state_pool.py). */
#ifndef GDN_LAYER_H
#define GDN_LAYER_H

#include <stdint.h>

typedef struct {
    int32_t Hk, Hv, Dk, Dv, K; /* key / value heads and sizes, the conv kernel width */
    int32_t tiled;             /* value head h reads key head h % Hk (GGUF order), else h / (Hv / Hk) */
    int32_t index;             /* the layer's index among the linear layers (its layer in the state pool) */
    float eps, scale;          /* the gated RMSNorm's epsilon; the query scale (Dk^-0.5) */
    const float *conv_weight;  /* [C, K], C = 2 Hk Dk + Hv Dv */
    const float *A_log, *dt_bias; /* [Hv] */
    const float *norm;         /* [Dv]: the gated RMSNorm's weight */
} gdn_layer_t;

/* One step's recurrent states: the pools [slots, linear layers, ...] (float32) and the ragged batch (sequence b owns
   the step's rows cu[b] .. cu[b + 1] - 1 and slot slots[b]). */
typedef struct {
    float *conv;
    int64_t conv_slot_stride, conv_layer_stride; /* values */
    float *state;
    int64_t state_slot_stride, state_layer_stride;
    const int32_t *cu, *slots;
    int32_t B;
} gdn_step_t;

/* float32 values of scratch per row that qmm_gdn_mix takes */
static inline int64_t gdn_scratch_per_row(const gdn_layer_t *g) {
    return 2 * (int64_t)g->Hk * g->Dk + 2 * (int64_t)g->Hv * g->Dv + 2 * (int64_t)g->Hv;
}

void qmm_gdn_mix(const gdn_layer_t *g, const gdn_step_t *s, int T, const float *proj, int64_t ldp, float *scratch,
                 float *out);

#endif
