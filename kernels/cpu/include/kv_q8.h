/* The q8_0 KV cache format, shared by the K/V write (elementwise.c) and the attention that reads it
   (attention_q8.c).

   A head row of D values (D % 32 == 0) is D / 32 blocks laid out as GGUF's block_q8_0: a float16 scale d and 32
   int8 values q, value i = d * q[i]; the row is D / 32 * 34 bytes. A pool is uint8 [blocks, block_size, Hkv,
   D / 32 * 34]. Quantized as ggml's reference does: d = max |x| / 127, q = round(x / d) (half away from zero),
   the scale stored as float16 (rounded to nearest even). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

/* the KV pool formats a kernel's `kv_bf16` / `cache_bf16` argument takes (KV_F16: IEEE half, llama.cpp's default
   KV type: 3 more mantissa bits than bfloat16, with the queries and outputs then in float32) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_Q8_0 = 2, KV_F16 = 3 };
enum { Q8_BLOCK = 32, Q8_BYTES = 34 };

static inline int64_t q8_row_bytes(int D) { return (int64_t)D / Q8_BLOCK * Q8_BYTES; }

static inline float q8_scale(const uint8_t *block) {
    uint16_t h;
    memcpy(&h, block, 2);
    return f16_to_f32(h);
}

/* x [D] (float32) as a q8_0 row at out (D / 32 * 34 bytes) */
static inline void q8_quantize_row(const float *x, int D, uint8_t *out) {
    for (int b = 0; b < D / Q8_BLOCK; b++, x += Q8_BLOCK, out += Q8_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_BLOCK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = f32_to_f16(d);
        memcpy(out, &h, 2);
        for (int i = 0; i < Q8_BLOCK; i++) out[2 + i] = (uint8_t)(int8_t)roundf(x[i] * id);
    }
}
