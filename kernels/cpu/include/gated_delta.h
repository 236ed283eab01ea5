/* gated_delta.c: the Gated DeltaNet mixer's kernels (gdn_layer.h: its layer struct and qmm_gdn_mix) and the per-head
   norms and sigmoid output gate of gated attention. */
#pragma once
#include <math.h>
#include <stdint.h>

/* torch's softplus (beta 1, threshold 20: x above 20 is x) */
static inline float softplus_torch(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* RMSNorm of each [T, H] head of x (D values, heads ldhx apart), times weight; gated by SiLU(z) where z is given. */
void qmm_head_rms_norm(const float *x, int64_t ldx, int64_t ldhx, const float *z, int64_t ldz, int64_t ldhz, int T,
                       int H, int D, const float *weight, float eps, float *out);
/* out = o * sigmoid(gate), per head: a gate per value (lde 1) or one per head (lde 0). */
void qmm_sigmoid_gate(const void *o, int o_bf16, const float *gate, int64_t ldg, int64_t ldhg, int64_t lde, int T,
                      int H, int D, float *out);
/* The causal depthwise conv (+ bias when not NULL, then SiLU when silu) over a ragged batch, each sequence from its
   conv state (the Gated DeltaNet's: SiLU, no bias; Mamba-2's: SiLU and a bias; a short convolution's: neither). */
void qmm_causal_conv(const float *x, int64_t ldx, int C, int K, const float *weight, const float *bias,
                     const int32_t *cu, int B, float *state, int64_t slot_stride, const int32_t *slots, int silu,
                     float *out);
/* The Gated DeltaNet's causal depthwise conv + SiLU over a ragged batch, each sequence from its conv state. */
void qmm_gdn_conv(const float *x, int64_t ldx, int C, int K, const float *weight, const int32_t *cu, int B,
                  float *state, int64_t slot_stride, const int32_t *slots, float *out);
/* The gated delta rule token by token over a ragged batch, each sequence's recurrent state updated in place. */
void qmm_gdn_rule(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                  const float *g, const float *beta, int Hk, int Hv, int Dk, int Dv, int tiled, const int32_t *cu,
                  int B, float *state, int64_t slot_stride, const int32_t *slots, float scale, float *out);
/* g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), per [T, Hv] value. */
void qmm_gdn_gates(const float *a, int64_t lda, const float *b, int64_t ldb, int T, int Hv, const float *A_log,
                   const float *dt_bias, float *g, float *beta);
