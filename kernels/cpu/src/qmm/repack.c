/* The repacked layouts (_R8 rows, _X8 bands) written once at load. */
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "qmatmul.h"

/* The layout a weight of N rows in format fmt is repacked into at load: the _X8 bands where N % 8 == 0 and the
   format has them, else Q4_0 / Q4_1's _R8 rows; -1 where there is none. */
int qmm_repacked_format(int fmt, int N) {
#if !defined(QMM_NEON) /* the NEON kernels read the GGUF and _R8 layouts only */
    if (N % 8 == 0) {
        switch (fmt) {
        case F_Q4_0: return F_Q4_0_X8;
        case F_Q4_1: return F_Q4_1_X8;
        case F_Q5_0: return F_Q5_0_X8;
        case F_Q5_1: return F_Q5_1_X8;
        case F_Q8_0: return F_Q8_0_X8;
        case F_Q4_K: return F_Q4_K_X8;
        case F_Q5_K: return F_Q5_K_X8;
        case F_Q6_K: return F_Q6_K_X8;
        case F_MXFP4: return F_MXFP4_X8;
        }
    }
#endif
    return fmt == F_Q4_0 ? F_Q4_0_R8 : fmt == F_Q4_1 ? F_Q4_1_R8 : -1;
}

/* One group of an _X8 band: block (or super-block) s of the 8 rows x[r] (GGUF layout) into o (8 block sizes). */
static void repack_group_x8(int fmt, const uint8_t *const x[8], uint8_t *o) {
    memset(o, 0, (size_t)8 * BLOCK_BYTES[fmt]);
    for (int r = 0; r < 8; r++) {
        const uint8_t *s = x[r];
        if (fmt == F_MXFP4) {
            o[r] = s[0];
            for (int c = 0; c < 4; c++) memcpy(o + 8 + 32 * c + 4 * r, s + 1 + 4 * c, 4);
        } else if (fmt == F_Q8_0) {
            memcpy(o + 2 * r, s, 2);
            for (int c = 0; c < 8; c++) memcpy(o + 16 + 32 * c + 4 * r, s + 2 + 4 * c, 4);
        } else if (fmt == F_Q4_0 || fmt == F_Q4_1) {
            const int q0 = fmt == F_Q4_0 ? 16 : 32, sq = fmt == F_Q4_0 ? 2 : 4;
            memcpy(o + 2 * r, s, 2);
            if (fmt == F_Q4_1) memcpy(o + 16 + 2 * r, s + 2, 2);
            for (int c = 0; c < 4; c++) memcpy(o + q0 + 32 * c + 4 * r, s + sq + 4 * c, 4);
        } else if (fmt == F_Q5_0 || fmt == F_Q5_1) {
            const int xf = fmt == F_Q5_0 ? F_Q5_0_X8 : F_Q5_1_X8, sh = fmt == F_Q5_0 ? 2 : 4;
            uint32_t qh;
            memcpy(&qh, s + sh, 4);
            memcpy(o + 2 * r, s, 2);
            if (fmt == F_Q5_1) memcpy(o + 16 + 2 * r, s + 2, 2);
            for (int c = 0; c < 4; c++) {
                memcpy(o + x8_qs(xf) + 32 * c + 4 * r, s + sh + 4 + 4 * c, 4);
                for (int k = 0; k < 4; k++)
                    o[x8_qh(xf) + 4 * r + k] |= (uint8_t)(((qh >> (4 * c + k)) & 1) << (2 * c) |
                                                          ((qh >> (16 + 4 * c + k)) & 1) << (2 * c + 1));
            }
        } else if (fmt == F_Q4_K || fmt == F_Q5_K) {
            memcpy(o + 2 * r, s, 2);
            memcpy(o + 16 + 2 * r, s + 2, 2);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                scale_min_k4(j, s + 4, &sc, &mn);
                o[32 + 8 * j + r] = (uint8_t)((sc & 0xF) | (mn & 0xF) << 4);
                o[96 + 8 * (j % 4) + r] |= (uint8_t)(((sc >> 4) | (mn >> 4) << 2) << (j < 4 ? 0 : 4));
            }
            const int qo = fmt == F_Q4_K ? 128 : 384, sq = fmt == F_Q4_K ? 16 : 48;
            for (int c = 0; c < 8; c++) {
                if (fmt == F_Q5_K) memcpy(o + 128 + 32 * c + 4 * r, s + 16 + 4 * c, 4);
                for (int p = 0; p < 4; p++) memcpy(o + qo + 256 * p + 32 * c + 4 * r, s + sq + 32 * p + 4 * c, 4);
            }
        } else { /* Q6_K */
            memcpy(o + 2 * r, s + 208, 2);
            for (int i = 0; i < 16; i++) o[16 + 16 * (i / 2) + 2 * r + i % 2] = s[192 + i];
            for (int p = 0; p < 4; p++) { /* sub-blocks 2p, 2p + 1: parts 0, 1 (p even) or 2, 3 of half p / 2 */
                const uint8_t *ql = s + 64 * (p / 2);
                for (int c = 0; c < 8; c++) { /* 4 values at a time */
                    uint32_t a, b, v;
                    memcpy(&a, ql + 4 * c, 4);
                    memcpy(&b, ql + 32 + 4 * c, 4);
                    v = p % 2 == 0 ? (a & 0x0F0F0F0Fu) | (b & 0x0F0F0F0Fu) << 4 : (a >> 4 & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u);
                    memcpy(o + q6x8_lo(p) + 32 * c + 4 * r, &v, 4);
                }
            }
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 8; c++) memcpy(o + q6x8_hi(h) + 32 * c + 4 * r, s + 128 + 32 * h + 4 * c, 4);
        }
    }
}

/* Rewrite N rows (row_bytes apart, K values) of a weight in format fmt from src into dst (another buffer of the
   same size) in the layout of qmm_repacked_format(fmt, N). */
void qmm_repack(int fmt, const uint8_t *src, int64_t row_bytes, int N, int K, uint8_t *dst) {
    const int rfmt = qmm_repacked_format(fmt, N);
    if (rfmt < 0) return;
    if (is_x8(rfmt)) {
        const int bb = BLOCK_BYTES[fmt], groups = K / BLOCK_VALUES[fmt];
        for (int n8 = 0; n8 < N; n8 += 8)
            for (int g = 0; g < groups; g++) {
                const uint8_t *x[8];
                for (int r = 0; r < 8; r++) x[r] = src + (int64_t)(n8 + r) * row_bytes + (size_t)g * bb;
                repack_group_x8(fmt, x, dst + (int64_t)n8 * row_bytes + (size_t)g * 8 * bb);
            }
        return;
    }
    const int bb = BLOCK_BYTES[fmt], nb = K / 32, groups = nb / 8, gb = 8 * bb;
    const int head = r8_head(rfmt), qoff = fmt == F_Q4_1 ? 4 : 2;
    for (int n = 0; n < N; n++) {
        const uint8_t *s = src + n * row_bytes;
        uint8_t *o = dst + n * row_bytes;
        for (int g = 0; g < groups; g++, o += gb) {
            for (int j = 0; j < 8; j++) {
                const uint8_t *x = s + (size_t)(8 * g + j) * bb;
                memcpy(o + 2 * j, x, 2);
                if (fmt == F_Q4_1) memcpy(o + 16 + 2 * j, x + 2, 2);
            }
            for (int p = 0; p < 4; p++) {
                const uint8_t *x0 = s + (size_t)(8 * g + 2 * p) * bb + qoff, *x1 = x0 + bb;
                uint8_t *y = o + head + 32 * p;
                for (int i = 0; i < 16; i++) { /* values i (low nibbles) and 16 + i (high nibbles) of both blocks */
                    y[i] = (uint8_t)((x0[i] & 0xF) | (x1[i] << 4));
                    y[16 + i] = (uint8_t)((x0[i] >> 4) | (x1[i] & 0xF0));
                }
            }
        }
        memcpy(o, s + (size_t)groups * gb, (size_t)(nb - 8 * groups) * bb);
    }
}

