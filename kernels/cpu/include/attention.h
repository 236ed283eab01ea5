/* attention.c: paged attention over float32 / bfloat16 / float16 KV pools, and the exp it shares. */
#pragma once
#include <stdint.h>

/* Each query row attends to keys [row_lo, row_lo + row_len) of its sequence's blocks (a sliding window from row_lo). */
void qmm_paged_attention_from(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v,
                              int kv_bf16, int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                              const int32_t *row_seq, const int32_t *row_lo, const int32_t *row_len, float scale,
                              void *out);
/* The same with one learned sink logit per query head in each row's softmax (NULL: none). */
void qmm_paged_attention_sinks(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v,
                               int kv_bf16, int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                               const int32_t *row_seq, const int32_t *row_lo, const int32_t *row_len,
                               const float *sinks, float scale, void *out);
/* Merge nseg partial softmax segments (each D values, its max and its sum; `stride` apart) into one output row. */
void qmm_attn_combine(const float *part, int64_t stride, int nseg, int D, float *out, float *max_out,
                      float *total_out);
/* expf of n values, bit for bit glibc's (four at a time where the build has AVX2). */
void qmm_exp(const float *x, int n, float *out);
/* qmm_paged_attention_from() with every row's keys from position 0. */
void qmm_paged_attention(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v, int kv_bf16,
                         int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                         const int32_t *row_seq, const int32_t *row_len, float scale, void *out);
