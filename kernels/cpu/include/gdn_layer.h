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
    /* a verification step's drafts (Gated DeltaNet layers only): sequence b's first keep[b] rows advance its states
       in the pools; its rows after them run on a copy of the state that is dropped, and their inputs (up to
       spec_rows of them) are kept in spec for qmm_gdn_replay. keep NULL: every row advances the states. */
    const int32_t *keep;
    float *spec;               /* [linear layers, B, spec_rows, gdn_spec_per_row] */
    int64_t spec_layer_stride; /* values */
    int32_t spec_rows;
    /* rows still owed to the states (Gated DeltaNet layers only): an earlier verification's accepted drafts, kept as
       spec kept them and replayed here instead of by qmm_gdn_replay after that step. Sequence b's first owed_n[b]
       rows of linear layer l are at (float *)owed[b] + l * owed_layer_stride[b] (gdn_spec_per_row values apart);
       they advance its states before its rows of this step, in the same pass over the state. owed NULL: none. */
    const int64_t *owed, *owed_layer_stride;
    const int32_t *owed_n;
} gdn_step_t;

/* float32 values of scratch per row that qmm_gdn_mix takes */
static inline int64_t gdn_scratch_per_row(const gdn_layer_t *g) {
    return 2 * (int64_t)g->Hk * g->Dk + 2 * (int64_t)g->Hv * g->Dv + 2 * (int64_t)g->Hv;
}

/* float32 values qmm_gdn_mix keeps per draft row in gdn_step_t.spec: the conv's input and output rows, the gates */
static inline int64_t gdn_spec_per_row(const gdn_layer_t *g) {
    return 2 * (2 * (int64_t)g->Hk * g->Dk + (int64_t)g->Hv * g->Dv) + 2 * (int64_t)g->Hv;
}

void qmm_gdn_mix(const gdn_layer_t *g, const gdn_step_t *s, int T, const float *proj, int64_t ldp, float *scratch,
                 float *out);

/* After a verification step run with gdn_step_t.keep: advance sequence b's conv and recurrent states of this layer
   by its first accepted[b] draft rows (0: none), from the inputs the step kept in spec: the same kernels on the same
   values, so the states are bit for bit those a step over the accepted rows gives. */
void qmm_gdn_replay(const gdn_layer_t *g, const gdn_step_t *s, const int32_t *accepted);

#endif
