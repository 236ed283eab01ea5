/* gated_delta_rows.c: the gated delta rule keeping the recurrent state after every row (speculative verification). */
#pragma once
#include <stdint.h>

/* qmm_gdn_rule over the same ragged batch, row by row, also writing each sequence's state [Hv, Dk, Dv] after each of
   its rows t into row_states + t * Hv * Dk * Dv: a partly accepted run of drafts restores the state of its last
   accepted row instead of computing those rows again. */
void qmm_gdn_rule_rows(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                       const float *g, const float *beta, int Hk, int Hv, int Dk, int Dv, int tiled, const int32_t *cu,
                       int B, float *state, int64_t slot_stride, const int32_t *slots, float scale, float *out,
                       float *row_states);
