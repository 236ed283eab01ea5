/* The Mamba-2 mixer block between its projections (ssd_layer.h), float32, over a ragged batch whose conv and SSM
   states live in the engine's state pool: the causal depthwise conv + bias + SiLU over [x | B | C]
   (gated_delta.c's qmm_causal_conv), dt = softplus(dt + dt_bias), the SSD recurrence (ssd.c's qmm_ssd_rule) with each
   sequence's state updated in place, then the gated group RMSNorm with z. kernels/torch/mamba2.py's mamba2_mixer is
   the torch twin (the same steps; torch sums in its own orders, so the two agree to float32 rounding). Each row's
   dt and norm are computed on their own, the conv and the recurrence per sequence: the result does not depend on
   the thread count or on what else is in the batch. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "gated_delta.h"
#include "pool.h"
#include "ssd.h"
#include "ssd_layer.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

typedef struct {
    const float *y, *z, *weight;
    int64_t ldz;
    int W, G;
    float eps;
    float *out;
} gated_norm_t;

/* one (row, group): g = y * silu(z) over the group's W / G values, out = g / rms(g) * weight (weight NULL: g) */
static void gated_norm_group(void *ctx, int task) {
    const gated_norm_t *a = (const gated_norm_t *)ctx;
    const int t = task / a->G, n = a->W / a->G, c0 = task % a->G * n;
    const float *y = a->y + (int64_t)t * a->W + c0, *z = a->z + t * a->ldz + c0;
    float *o = a->out + (int64_t)t * a->W + c0;
    float ss = 0.0f;
    for (int i = 0; i < n; i++) {
        o[i] = y[i] * silu(z[i]);
        ss += o[i] * o[i];
    }
    if (!a->weight) return;
    const float scale = 1.0f / sqrtf(ss / n + a->eps);
    for (int i = 0; i < n; i++) o[i] = o[i] * scale * a->weight[c0 + i];
}

/* out [T, H P] = the Mamba-2 mixer of proj [T, H P + C + H] ([z | x B C | dt], rows ldp apart), the conv and SSM
   states of Mamba-2 layer s->index updated in place; scratch: ssd_scratch_per_row(s) * T floats, and out holds y
   on the way. */
void qmm_ssd_mix(const ssd_layer_t *s, const gdn_step_t *st, int T, const float *proj, int64_t ldp, float *scratch,
                 float *out) {
    const int inner = s->H * s->P, gn = s->G * s->N, C = inner + 2 * gn;
    float *xbc = scratch, *dt = xbc + (size_t)T * C;
    if (T <= 0) return;
    qmm_causal_conv(proj + inner, ldp, C, s->K, s->conv_weight, s->conv_bias, st->cu, st->B,
                    st->conv + s->index * st->conv_layer_stride, st->conv_slot_stride, st->slots, 1, xbc);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < s->H; h++)
            dt[(int64_t)t * s->H + h] = softplus_torch(proj[t * ldp + inner + C + h] + s->dt_bias[h]);
    qmm_ssd_rule(xbc, xbc + inner, xbc + inner + gn, C, dt, s->A, s->D, s->H, s->P, s->N, s->G, st->cu, st->B,
                 st->state + s->index * st->state_layer_stride, st->state_slot_stride, st->slots, out);
    gated_norm_t a = {out, proj, s->norm, ldp, inner, s->G, s->eps, out};
    pool_run(gated_norm_group, &a, T * s->G, (int64_t)T * inner >= 16384);
}
