/* What qmatmul.c shares with the other kernels (moe.c): the per-task piece of its matmul. */
#pragma once
#include <stdint.h>

/* Whether weights of format `fmt` need the activations' offset sums (qmm_offset_sums). */
int qmm_needs_sums(int fmt);

/* fs[i] = da[i] * (sa[2i] + sa[2i + 1]) for n activation blocks: the offset terms of Q4_1 / Q5_1 / Q4_K / Q5_K. */
void qmm_offset_sums(const float *da, const int16_t *sa, int64_t n, float *fs);

/* out[m, n] (row stride ldo) for weight rows [n0, n1) of w against M quantized activation rows (qa, da, sa and,
   where qmm_needs_sums, fs), on the calling thread: exactly what one task of qmm_matmul computes. */
void qmm_rows(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, const int8_t *qa, const float *da,
              const int16_t *sa, const float *fs, int M, float *out, int64_t ldo);
