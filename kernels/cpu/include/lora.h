/* lora.c: a step's LoRA adapters beside a base matmul. */
#pragma once
#include <stdint.h>

/* out += the adapters' x A^T B^T for `layer`'s weight `target` (`lora`: the step's lora_step_t). */
int qmm_lora_add(const void *lora, int layer, int target, const void *x, int x_bf16, int64_t ldx, int T, int K,
                 float *out, int64_t ldo, int N);
