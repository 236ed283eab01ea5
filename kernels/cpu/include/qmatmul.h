/* The quantized matmul over GGUF block formats (src/qmm/): activation quantization, the matmul and its per-task
   piece, the load-time repacking, dequantization, and what the bindings ask of the formats. */
#pragma once
#include <stdint.h>

/* Quantize M rows of x (float32, or bfloat16 when is_bf16) of K values (K % 32 == 0, row stride ldx elements) into
   qa [M, K] int8, da [M, K/32] scales and sa [M, K/16] sums of 16. */
void qmm_quantize(const void *x, int is_bf16, int64_t ldx, int M, int K, int8_t *qa, float *da, int16_t *sa);

/* y[m, n] (row stride ldo) = sum_k x[m, k] W[n, k] for the quantized activations (qa, da, sa) of M rows and a weight
   of N rows in format fmt (row_bytes bytes each, K values). */
void qmm_matmul(int fmt, const uint8_t *w, int64_t row_bytes, int N, int K, const int8_t *qa, const float *da,
                const int16_t *sa, int M, float *out, int64_t ldo);

/* Whether weights of format `fmt` need the activations' offset sums (qmm_offset_sums). */
int qmm_needs_sums(int fmt);

/* fs[i] = da[i] * (sa[2i] + sa[2i + 1]) for n activation blocks: the offset terms of Q4_1 / Q5_1 / Q4_K / Q5_K. */
void qmm_offset_sums(const float *da, const int16_t *sa, int64_t n, float *fs);

/* out[m, n] (row stride ldo) for weight rows [n0, n1) of w against M quantized activation rows (qa, da, sa and,
   where qmm_needs_sums, fs), on the calling thread: exactly what one task of qmm_matmul computes. */
void qmm_rows(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, const int8_t *qa, const float *da,
              const int16_t *sa, const float *fs, int M, float *out, int64_t ldo);

/* The layout a weight of N rows in format fmt is repacked into at load (-1: none), and the repacking itself. */
int qmm_repacked_format(int fmt, int N);
void qmm_repack(int fmt, const uint8_t *src, int64_t row_bytes, int N, int K, uint8_t *dst);

/* Rows `ids` of a weight dequantized: out[i, :] = W[ids[i], :] in float32. */
void qmm_dequant_rows(int fmt, const uint8_t *w, int64_t row_bytes, int K, const int64_t *ids, int n, float *out);

/* Bytes and values per block of a format, how many format ids this build knows, and the build's variant name. */
int qmm_block_bytes(int fmt);
int qmm_block_values(int fmt);
int qmm_format_count(void);
const char *qmm_variant(void);
