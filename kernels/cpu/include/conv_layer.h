/* A gated short-convolution mixer (LFM2-style) as the fused layer stack (layer.c) runs it, in place of the
   attention: layer.c does the in_proj matmul ([B | C | x] per row, C channels each: its mixer_t.in_proj) and the
   out_proj one (mixer_t.out_proj); qmm_conv_mix (short_conv.c) does C * conv(B * x) between them, the causal
   depthwise conv of width K continuing from each sequence's conv state (its last K - 1 inputs), read and written in
   place in the engine's state pool over the same ragged-batch description as Gated DeltaNet's (gdn_step_t; its
   recurrent-state fields unused). The block knows no model: a plan (models/archs/lfm2/native_plan.py) fills it. */
#ifndef CONV_LAYER_H
#define CONV_LAYER_H

#include <stdint.h>

#include "gdn_layer.h"

typedef struct {
    int32_t C, K;         /* channels, the conv kernel width */
    int32_t index;        /* the layer's index among the conv layers (its layer in the state pool) */
    const float *weight;  /* float32 [C, K] */
} conv_layer_t;

/* float32 values of scratch per row that qmm_conv_mix takes */
static inline int64_t conv_scratch_per_row(const conv_layer_t *c) { return c->C; }

/* out [T, C] float32 = C * conv(B * x) for proj [T, 3C] ([B | C | x], rows ldp apart), each sequence's conv state of
   conv layer c->index updated in place. scratch: conv_scratch_per_row(c) * T floats. */
void qmm_conv_mix(const conv_layer_t *c, const gdn_step_t *s, int T, const float *proj, int64_t ldp, float *scratch,
                  float *out);

/* The same over explicit arguments: the state pool view [slots, K - 1, C] (slots slot_stride values apart) and the
   ragged batch (sequence b: rows cu[b] .. cu[b + 1] - 1, slot slots[b]). */
void qmm_short_conv(const float *proj, int64_t ldp, int C, int K, const float *weight, const int32_t *cu, int B,
                    float *state, int64_t slot_stride, const int32_t *slots, float *scratch, float *out);

#endif
