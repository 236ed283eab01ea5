/* attention_q8.c: paged attention over a q8_0 KV pool (kv_q8.h's block format). */
#pragma once
#include <stdint.h>

/* qmm_paged_attention_sinks' contract over q8_0 K/V blocks; nonzero when its scratch could not be allocated. */
int qmm_paged_attention_q8(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v,
                           int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                           const int32_t *row_seq, const int32_t *row_lo, const int32_t *row_len, const float *sinks,
                           float scale, void *out);
