/* IEEE float16 <-> float32, exact and portable (no F16C needed): GGUF block scales and the q8_0 KV cache's. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) return sign ? -0.0f : 0.0f;
        float f = ldexpf((float)man, -24); /* subnormal */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float32 -> float16, rounded to nearest even (overflow to infinity, NaN kept) */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504 */
    if (ax < 0x38800000u) { /* a float16 subnormal (or zero): value / 2^-24, rounded to nearest even */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1); /* round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
