/* encoder_gelu.c: an encoder's feed-forward bias + GELU in one in-place pass (AVX-512 builds; -1 elsewhere). */
#pragma once
#include <stdint.h>

/* x [rows, cols] (rows ld apart) := GELU(x + bias), the erf form / the tanh form. */
int qmm_bias_gelu(float *x, int64_t ld, int rows, int cols, const float *bias);
int qmm_bias_gelu_tanh(float *x, int64_t ld, int rows, int cols, const float *bias);
