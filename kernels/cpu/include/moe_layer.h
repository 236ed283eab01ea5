/* moe_layer.c: a whole Mixture-of-Experts feed-forward in one call. */
#pragma once
#include <stdint.h>

typedef struct moe moe_t; /* the layer's plan (moe_layer.c; packed by kernels.cpu.moe_layer) */

/* out = the MoE feed-forward of h (`m`: its plan); route_w / route_ids: the routing, where the caller keeps it. */
int qmm_moe_forward(const moe_t *m, int T, const void *h, int h_bf16, int64_t ldh, const float *route_w,
                    const int32_t *route_ids, int with_shared, float *out);
/* Free the kept scratch memory unless a call is using it. */
void qmm_moe_release(void);
