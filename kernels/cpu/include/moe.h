/* moe.c: the grouped expert matmul and the float32 router matmul. */
#pragma once
#include <stdint.h>

/* Every active expert's rows [starts[i], starts[i + 1]) through its weight (n_parts stacked parts), in one call. */
int qmm_moe_matmul(int n_parts, const int *fmt, const uint8_t *const *w, const int64_t *expert_bytes,
                   const int64_t *row_bytes, const int *rows, int K, const int8_t *qa, const float *da,
                   const int16_t *sa, int n_active, const int *experts, const int *starts, float *out, int64_t ldo);
/* out = x w^T in float32 (a router's logits). */
int qmm_f32_matmul(const void *x, int is_bf16, int64_t ldx, int T, const float *w, int N, int K, float *out,
                   int64_t ldo);
