/* encoder_attention.c: bidirectional attention of an encoder's padded batch (AVX-512 builds). */
#pragma once
#include <stdint.h>

/* Whether this build has the kernel. */
int qmm_encoder_attention_available(void);
/* out = softmax(q k^T * scale) v per sequence and head over each sequence's first lens[b] keys; -1: not taken. */
int qmm_encoder_attention(const float *q, int64_t ld_q, const float *k, int64_t ld_k, const float *v, int64_t ld_v,
                          int B, int T, int H, int D, const int32_t *lens, float scale, float *out, int64_t ld_o);
