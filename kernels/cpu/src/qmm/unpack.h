/* A weight block of any layout as 32 integers with its scale, sub-block scales and minimum: the portable
   reading of every format (dequantization, the scalar dot products; arch/arm reads the same blocks in NEON). */
#pragma once
#include "blocks.h"

/* Block b (of 32 values) of a weight row of nb blocks as w_i = d * sc[i / 16] * q_i + m. */
static void unpack32(int fmt, const uint8_t *row, int nb, int b, int q[32], float *d, int sc[2], float *m) {
    block32_t v;
    locate32(fmt, row, nb, b, &v);
    *d = v.d;
    *m = v.m;
    sc[0] = v.sc[0];
    sc[1] = v.sc[1];
    const uint8_t *qs = v.qs;
    if (v.kind == B_BYTES) {
        for (int i = 0; i < 32; i++) q[i] = (int8_t)qs[i];
    } else if (v.kind == B_LEVELS) {
        for (int i = 0; i < 16; i++) {
            q[i] = MXFP4_LEVELS[qs[i] & 0xF];
            q[i + 16] = MXFP4_LEVELS[qs[i] >> 4];
        }
    } else if (v.kind == B_SPLIT) {
        for (int i = 0; i < 16; i++) {
            int h0 = (v.qh32 >> i) & 1, h1 = (v.qh32 >> (i + 16)) & 1;
            q[i] = ((qs[i] & 0xF) | (h0 << 4)) - v.off;
            q[i + 16] = ((qs[i] >> 4) | (h1 << 4)) - v.off;
        }
    } else {
        for (int l = 0; l < 32; l++)
            q[l] = (((qs[l] >> v.shift) & 0xF) | (v.qh ? ((v.qh[l] >> v.hshift) & v.hmask) << 4 : 0)) - v.off;
    }
}

/* Block b of row r (0..7) of a band of 8 rows in an _X8 layout, as unpack32 gives it. */
static void unpack32_x8(int fmt, const uint8_t *band, int r, int b, int q[32], float *d, int sc[2], float *m) {
    sc[0] = sc[1] = 1;
    *m = 0.0f;
    const int j = b % 8; /* sub-block of a K super-block */
    if (fmt == F_MXFP4_X8) { /* e [8], then 4 runs as Q4_0_X8's */
        const uint8_t *g = band + (size_t)b * 8 * 17;
        *d = e8m0_half(g[r]);
        for (int l = 0; l < 32; l++) {
            const int c = (l % 16) / 4, e = l / 16;
            q[l] = MXFP4_LEVELS[(g[8 + 32 * c + 4 * r + l % 4] >> (4 * e)) & 0xF];
        }
        return;
    }
    if (fmt == F_Q8_0_X8) { /* d [8], then 8 runs of 4 values */
        const uint8_t *g = band + (size_t)b * 8 * 34;
        *d = rd16(g + 2 * r);
        for (int l = 0; l < 32; l++) q[l] = (int8_t)g[16 + 32 * (l / 4) + 4 * r + l % 4];
        return;
    }
    if (fmt == F_Q4_0_X8 || fmt == F_Q4_1_X8 || fmt == F_Q5_0_X8 || fmt == F_Q5_1_X8) {
        const uint8_t *g = band + (size_t)b * 8 * BLOCK_BYTES[fmt], *qs = g + x8_qs(fmt), *qh = g + x8_qh(fmt);
        const int five = fmt == F_Q5_0_X8 || fmt == F_Q5_1_X8;
        *d = rd16(g + 2 * r);
        if (fmt == F_Q4_1_X8 || fmt == F_Q5_1_X8) *m = rd16(g + 16 + 2 * r);
        for (int l = 0; l < 32; l++) { /* values l and 16 + l share a byte */
            const int c = (l % 16) / 4, e = l / 16, at = 4 * r + l % 4;
            q[l] = (qs[32 * c + at] >> (4 * e)) & 0xF;
            if (five) q[l] |= ((qh[at] >> (2 * c + e)) & 1) << 4;
            q[l] -= fmt == F_Q4_0_X8 ? 8 : fmt == F_Q5_0_X8 ? 16 : 0;
        }
        return;
    }
    const uint8_t *g = band + (size_t)(b / 8) * 8 * BLOCK_BYTES[fmt];
    if (fmt == F_Q6_K_X8) { /* d [8], scales [16 j + 2 r + h], the runs of q6x8_lo / q6x8_hi */
        *d = rd16(g + 2 * r);
        for (int l = 0; l < 32; l++) {
            const int at = 32 * (l / 4) + 4 * r + l % 4;
            const int lo = (g[q6x8_lo(j / 2) + at] >> (4 * (j & 1))) & 0xF, hi = (g[q6x8_hi(j / 4) + at] >> (2 * (j % 4))) & 3;
            q[l] = (lo | hi << 4) - 32;
        }
        sc[0] = (int8_t)g[16 + 16 * j + 2 * r];
        sc[1] = (int8_t)g[16 + 16 * j + 2 * r + 1];
        return;
    }
    /* Q4_K / Q5_K: d [8], dmin [8], scales (x8_scale_min), (Q5_K) high bits, low 4 bits as for Q6_K */
    int s, mn;
    x8_scale_min(g + 32, j, r, &s, &mn);
    *d = rd16(g + 2 * r) * s;
    *m = -rd16(g + 16 + 2 * r) * mn;
    const uint8_t *qs = g + (fmt == F_Q4_K_X8 ? 128 : 384), *qh = g + 128;
    for (int l = 0; l < 32; l++) {
        const int at = 32 * (l / 4) + 4 * r + l % 4;
        q[l] = (qs[256 * (j / 2) + at] >> (4 * (j & 1))) & 0xF;
        if (fmt == F_Q5_K_X8) q[l] |= ((qh[at] >> j) & 1) << 4;
    }
}

/* Block b of weight row n (rows row_bytes apart from w, nb blocks each) in any format. */
static void unpack_row(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int nb, int b, int q[32], float *d,
                       int sc[2], float *m) {
    if (is_x8(fmt))
        unpack32_x8(fmt, w + (n - n % 8) * row_bytes, (int)(n % 8), b, q, d, sc, m);
    else
        unpack32(fmt, w + n * row_bytes, nb, b, q, d, sc, m);
}

