/* ssd.c: the state-space duality (Mamba-2) recurrence over a ragged batch, token by token, each sequence's state
   updated in place in its slot of a float32 pool (kernels/torch/mamba2.py is the torch twin). */
#pragma once
#include <stdint.h>

/* For sequence b (rows cu[b] .. cu[b + 1] - 1, state [H, P, N] at state + slots[b] * slot_stride), head h (group
   h / (H / G)) and token t: state = exp(dt[t, h] * A[h]) * state + dt[t, h] x[t, h] B[t, g]^T, then
   y[t, h] = state C[t, g] + D[h] x[t, h]. x [T, H * P], B and C [T, G * N] rows ldx apart (columns of one conv
   output), dt [T, H] contiguous, y [T, H, P] contiguous; float32 throughout. */
void qmm_ssd_rule(const float *x, const float *B, const float *C, int64_t ldx, const float *dt, const float *A,
                  const float *D, int H, int P, int N, int G, const int32_t *cu, int nseq, float *state,
                  int64_t slot_stride, const int32_t *slots, float *y);
