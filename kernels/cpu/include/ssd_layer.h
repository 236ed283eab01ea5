/* A Mamba-2 mixer as the fused layer stack (layer.c) runs it, in place of the attention: layer.c does the in_proj
   matmul ([z | x B C | dt] per row: its mixer_t.in_proj) and the out_proj one (mixer_t.out_proj); qmm_ssd_mix
   (mamba2.c) does everything between them over the step's conv and SSM states, read and written in place in the
   engine's state pool (edgeserve/engine/cache/state_pool.py's mamba2 kind). kernels/torch/mamba2.py's mamba2_mixer is the
   torch twin. This block knows no model. */
#ifndef SSD_LAYER_H
#define SSD_LAYER_H

#include <stdint.h>

#include "gdn_layer.h"

typedef struct {
    int32_t H, P, N, G, K;       /* heads, head size, state size, groups of B / C, the conv kernel width */
    int32_t index;               /* the layer's index among the Mamba-2 layers (its layer in the state pool) */
    float eps;                   /* the gated group RMSNorm's epsilon */
    const float *conv_weight;    /* [C, K], C = H P + 2 G N (x | B | C channels) */
    const float *conv_bias;      /* [C], or NULL */
    const float *dt_bias, *A, *D; /* [H]; A = -exp(A_log) */
    const float *norm;           /* [H P]: the gated group RMSNorm's weight, or NULL: y * silu(z) alone */
} ssd_layer_t;

/* float32 values of scratch per row that qmm_ssd_mix takes: the conv output and dt */
static inline int64_t ssd_scratch_per_row(const ssd_layer_t *s) {
    return (int64_t)s->H * s->P + 2 * (int64_t)s->G * s->N + s->H;
}

/* The mixer between its projections: proj [T, H P + C + H] rows ldp apart ([z | x B C | dt]) to out [T, H P], the
   gated and normed y that out_proj takes; each sequence of the step's ragged batch (gdn_step_t: cu, slots, its conv
   pool [slots, layers, K - 1, C] and state pool [slots, layers, H, P, N]) continues from and updates its states. */
void qmm_ssd_mix(const ssd_layer_t *s, const gdn_step_t *st, int T, const float *proj, int64_t ldp, float *scratch,
                 float *out);

#endif
