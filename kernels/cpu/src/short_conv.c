/* The gated short convolution (LFM2's mixer between its projections) on the CPU, float32: for in_proj's rows
   [B | C | x], out = C * conv(B * x), the conv the causal depthwise one of gated_delta.c (qmm_causal_conv, without
   its SiLU) over a flat ragged batch whose conv states live in a slot-indexed pool. kernels/torch/short_conv.py is
   the torch twin and says what is computed; the per-op path (kernels.dispatch.gated_short_conv) and the fused stack
   (layer.c's mixer block, conv_layer.h) both call this, so they agree bit for bit. Each row's values are its own
   products in a fixed order: the result does not depend on the batch or the thread count. */

#include <stdint.h>

#include "conv_layer.h"
#include "gated_delta.h"

void qmm_short_conv(const float *proj, int64_t ldp, int C, int K, const float *weight, const int32_t *cu, int B,
                    float *state, int64_t slot_stride, const int32_t *slots, float *scratch, float *out) {
    const int T = cu[B];
    for (int t = 0; t < T; t++) { /* the conv's input: B * x */
        const float *restrict b = proj + (int64_t)t * ldp, *restrict x = b + 2 * (int64_t)C;
        float *restrict bx = scratch + (int64_t)t * C;
        for (int c = 0; c < C; c++) bx[c] = b[c] * x[c];
    }
    qmm_causal_conv(scratch, C, C, K, weight, 0, cu, B, state, slot_stride, slots, 0, out);
    for (int t = 0; t < T; t++) { /* times C */
        const float *restrict g = proj + (int64_t)t * ldp + C;
        float *restrict o = out + (int64_t)t * C;
        for (int c = 0; c < C; c++) o[c] = g[c] * o[c];
    }
}

void qmm_conv_mix(const conv_layer_t *c, const gdn_step_t *s, int T, const float *proj, int64_t ldp, float *scratch,
                  float *out) {
    (void)T; /* s->cu[s->B]: the step's rows */
    qmm_short_conv(proj, ldp, c->C, c->K, c->weight, s->cu, s->B, s->conv + c->index * s->conv_layer_stride,
                   s->conv_slot_stride, s->slots, scratch, out);
}
