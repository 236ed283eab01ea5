/* layer.c: the whole decoder layer stack for one flat batch of rows in one call. */
#pragma once
#include <stdint.h>

typedef struct decoder decoder_t;       /* the model's layers (layer.c; packed by kernels.cpu.decoder) */
typedef struct step_pools step_pools_t; /* one step's K/V pools, block tables, slots and states */

/* Run every layer over T rows (x: the residual stream, updated in place; h_out: the final-normed hidden states);
   0, or -1 when out of memory. */
int qmm_decoder_forward(const decoder_t *m, int T, const int64_t *positions, float *x, void *h_out, int cache_bf16,
                        int block_size, const int32_t *row_seq, const int32_t *row_len, const step_pools_t *pools);
