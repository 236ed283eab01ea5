/* elementwise.c: the per-token work between the matmuls (norms, RoPE + K/V write, gated activations, bf16). */
#pragma once
#include <stdint.h>

/* new_residual = x + residual (residual NULL: x alone); out = RMSNorm(new_residual) * weight. */
void qmm_add_rms_norm(const void *x, int x_bf16, int64_t ldx, const float *residual, const float *weight, int T, int N,
                      float eps, float *new_residual, void *out, int out_bf16);
/* Rotate q and k (rotate-half), write k and v at their slots of a bfloat16 / float32 pool, q into q_out. */
void qmm_rope_write_kv(const void *q, const void *k, const void *v, int in_bf16, int64_t ldq, int64_t ldk,
                       int64_t ldv, const float *cos, const float *sin, void *k_cache, void *v_cache, int cache_bf16,
                       const int64_t *slots, int T, int H, int Hkv, int D, void *q_out);
/* The same into a pool of kv_q8.h's format `cache_fmt`, q_out in bfloat16 or float32. */
void qmm_rope_write_kv_fmt(const void *q, const void *k, const void *v, int in_bf16, int64_t ldq, int64_t ldk,
                           int64_t ldv, const float *cos, const float *sin, void *k_cache, void *v_cache, int cache_fmt,
                           const int64_t *slots, int T, int H, int Hkv, int D, void *q_out, int q_bf16);
/* out[t, :F] = act(gate) * up over rows [gate | up] of x. */
void qmm_silu_mul(const void *x, int bf16, int64_t ldx, int T, int F, float *out);
void qmm_gelu_tanh_mul(const void *x, int bf16, int64_t ldx, int T, int F, float *out);
void qmm_swiglu_oai_mul(const void *x, int bf16, int64_t ldx, int T, int F, float alpha, float limit, float *out);
/* float32 -> bfloat16, round to nearest even (torch's conversion). */
void qmm_to_bf16(const float *x, int64_t n, uint16_t *out);
/* out [R, N] = (rms_norm(x * a) * weight + y * b) * c, row by row (float32). */
void qmm_scaled_norm_add(const float *x, const float *y, const float *weight, int R, int N, float eps, float a, float b,
                         float c, float *out);
/* x [n] := tanh(x / cap) * cap in place (float32; logit soft-capping). */
void qmm_softcap(float *x, int64_t n, float cap);
