/* The 16-bit floats <-> float32, exact and portable (no F16C needed): IEEE float16 (GGUF block scales, the float16
   and q8_0 KV caches) and bfloat16 (activations, the bf16 KV cache). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

/* the float32 of these bits; the bits of a float32 */
static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* bfloat16 -> float32 (exact) */
static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* float32 -> bfloat16, rounded to nearest even (NaN kept a NaN) */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t bits = f32_to_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) return sign ? -0.0f : 0.0f;
        float f = ldexpf((float)man, -24); /* subnormal */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    return f32_from_bits(bits);
}

/* float32 -> float16, rounded to nearest even (overflow to infinity, NaN kept) */
static inline uint16_t f32_to_f16(float f) {
    const uint32_t x = f32_to_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504 */
    if (ax < 0x38800000u) { /* a float16 subnormal (or zero): value / 2^-24, rounded to nearest even */
        return (uint16_t)(sign | (uint32_t)nearbyintf(f32_from_bits(ax) * 16777216.0f));
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1); /* round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
