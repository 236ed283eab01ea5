/* The gated delta rule with the recurrent state kept after every row (gated_delta_rows.h).

   Each row runs through gated_delta.c's own qmm_gdn_rule as a one-row batch (its decode-row path, which takes the
   same operations in the same order as its multi-row path: the same bits), then the sequence's state is copied out.
   So the state kept after row j is bit for bit the state a recompute of rows 0..j from the step's start state gives,
   and the outputs are qmm_gdn_rule's over the whole batch. */
#include <string.h>

#include "gated_delta.h"
#include "gated_delta_rows.h"

void qmm_gdn_rule_rows(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                       const float *g, const float *beta, int Hk, int Hv, int Dk, int Dv, int tiled, const int32_t *cu,
                       int B, float *state, int64_t slot_stride, const int32_t *slots, float scale, float *out,
                       float *row_states) {
    const int64_t per_row = (int64_t)Hv * Dk * Dv;
    const int32_t one[2] = {0, 1};
    for (int b = 0; b < B; b++) {
        const float *st = state + (int64_t)slots[b] * slot_stride;
        for (int64_t t = cu[b]; t < cu[b + 1]; t++) {
            qmm_gdn_rule(q + t * ldq, ldq, k + t * ldk, ldk, v + t * ldv, ldv, g + t * Hv, beta + t * Hv, Hk, Hv, Dk,
                         Dv, tiled, one, 1, state, slot_stride, slots + b, scale, out + t * Hv * Dv);
            memcpy(row_states + t * per_row, st, sizeof(float) * per_row);
        }
    }
}
