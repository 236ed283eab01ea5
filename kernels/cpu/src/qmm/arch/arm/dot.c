/* The dot products in NEON (sdot where the CPU has the dot-product extension, widening multiplies
   otherwise): the portable code's integers, so its bits. */
#if defined(QMM_NEON)
#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#include "../../blocks.h"

/* unpack32 in NEON: block b of a weight row as 32 signed bytes (q[0]: values 0-15, q[1]: 16-31) with the same
   d, sc and m (locate32 finds them); every format's values fit a signed byte */
static void unpack32_neon(int fmt, const uint8_t *row, int nb, int b, int8x16_t q[2], float *d, int sc[2], float *m) {
    const uint8x16_t low4 = vdupq_n_u8(0xF);
    uint8x16_t lo, hi;
    block32_t v;
    locate32(fmt, row, nb, b, &v);
    *d = v.d;
    *m = v.m;
    sc[0] = v.sc[0];
    sc[1] = v.sc[1];
    if (v.kind == B_BYTES) {
        q[0] = vld1q_s8((const int8_t *)v.qs);
        q[1] = vld1q_s8((const int8_t *)v.qs + 16);
        return;
    }
    if (v.kind == B_LEVELS) { /* the codes through the table of levels */
        const int8x16_t levels = vld1q_s8(MXFP4_LEVELS);
        const uint8x16_t x = vld1q_u8(v.qs);
        q[0] = vqtbl1q_s8(levels, vandq_u8(x, low4));
        q[1] = vqtbl1q_s8(levels, vshrq_n_u8(x, 4));
        return;
    }
    if (v.kind == B_SPLIT) {
        const uint8x16_t x = vld1q_u8(v.qs);
        lo = vandq_u8(x, low4);
        hi = vshrq_n_u8(x, 4);
        if (v.five) { /* bit i of qh is the fifth bit of value i */
            static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
            const uint32_t qh = v.qh32;
            const uint8x16_t sel = vld1q_u8(bit), b4 = vdupq_n_u8(0x10);
            const uint8x16_t h0 = vcombine_u8(vdup_n_u8(qh & 0xFF), vdup_n_u8((qh >> 8) & 0xFF));
            const uint8x16_t h1 = vcombine_u8(vdup_n_u8((qh >> 16) & 0xFF), vdup_n_u8(qh >> 24));
            lo = vorrq_u8(lo, vandq_u8(vtstq_u8(h0, sel), b4));
            hi = vorrq_u8(hi, vandq_u8(vtstq_u8(h1, sel), b4));
        }
    } else { /* B_RUN */
        lo = vld1q_u8(v.qs);
        hi = vld1q_u8(v.qs + 16);
        if (v.shift) {
            lo = vshrq_n_u8(lo, 4);
            hi = vshrq_n_u8(hi, 4);
        } else {
            lo = vandq_u8(lo, low4);
            hi = vandq_u8(hi, low4);
        }
        if (v.qh) { /* the high bits under hmask, from bit hshift of qh[l], as bits 4.. of value l */
            const int8x16_t shift = vdupq_n_s8((int8_t)-v.hshift);
            const uint8x16_t mask = vdupq_n_u8((uint8_t)v.hmask);
            lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(v.qh), shift), mask), 4));
            hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(v.qh + 16), shift), mask), 4));
        }
    }
    q[0] = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8((int8_t)v.off));
    q[1] = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8((int8_t)v.off));
}

/* the exact integer sum of 16 byte products */
static inline int32_t dot16(int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vaddvq_s32(vdotq_s32(vdupq_n_s32(0), a, b));
#else
    int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vaddvq_s32(vpadalq_s16(s, vmull_s8(vget_high_s8(a), vget_high_s8(b))));
#endif
}

/* dot_scalar with NEON unpacking and integer sums: the same integers, so the same floats in the same order */
static void dot_neon(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int K, act_t a, int nr, float *out,
                     int64_t ldo) {
    const uint8_t *row = w + n * row_bytes;
    int8x16_t q[2];
    int sc[2];
    float d, m;
    float acc[4] = {0, 0, 0, 0};
    for (int b = 0; b < K / 32; b++) {
        unpack32_neon(fmt, row, K / 32, b, q, &d, sc, &m);
        for (int r = 0; r < nr; r++) {
            const int8_t *x = a.qa + r * a.lda + b * 32;
            const int s0 = dot16(q[0], vld1q_s8(x)), s1 = dot16(q[1], vld1q_s8(x + 16));
            acc[r] += block_term(fmt, a, r, b, s0, s1, d, sc, m);
        }
    }
    for (int r = 0; r < nr; r++) out[r * ldo] = acc[r];
}

void qmm_dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                   int64_t ldo) {
    dot_rows_by4(dot_neon, fmt, w, row_bytes, n0, n1, K, a, nr, out, ldo);
}

#endif
