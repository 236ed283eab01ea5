/* bf16_matmul.c: 16-bit weight matrices multiplied in bfloat16 (AVX-512 BF16 CPUs). */
#pragma once
#include <stdint.h>

/* Whether this build and CPU have the kernel. */
int qmm_bf16_supported(void);
/* uint16 values of a packed weight of N rows and K columns, and the packing of a bfloat16 weight w [N, K]. */
int64_t qmm_bf16_packed_size(int N, int K);
void qmm_bf16_pack(const uint16_t *w, int64_t ldw, int N, int K, uint16_t *dst);
/* out [M, N] = x [M, K] @ W.T (+ bias) for W packed by qmm_bf16_pack; -1: no kernel, -2: out of scratch memory. */
int qmm_bf16_matmul(const float *x, int64_t ldx, int M, int K, const uint16_t *w, int N, const float *bias,
                    float *out, int64_t ldo);
