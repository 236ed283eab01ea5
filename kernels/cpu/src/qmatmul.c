/* Quantized matmul over GGUF block formats for CPUs: y[m, n] = sum_k x[m, k] * W[n, k].

   Activations are quantized per row to int8 in blocks of 32 (one float scale per block, like ggml's Q8_0),
   with the sum of each 16 values kept for the formats whose weights have an offset. Weight rows are the GGUF
   block bytes as stored in the file. Each weight block of 32 values is unpacked to (unsigned or signed) bytes
   and multiplied with its activation block in integer SIMD (AVX2 maddubs, or AVX-512 VNNI dpbusd when this
   file is compiled with -DQMM_VNNI), or on ARM with NEON (-DQMM_NEON: sdot where the CPU has the dot-product
   extension, widening multiplies otherwise); without either everything runs in portable C.

   Threads (pool.c) split the output rows. Each output value depends only on its own activation row and
   weight row, so results do not depend on the batch or on the thread count. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "half.h"
#include "qmatmul.h"
#if defined(QMM_AVX2)
#include <immintrin.h>
#elif defined(QMM_NEON)
#include <arm_neon.h>
#endif

enum { F_Q4_0 = 0, F_Q4_1 = 1, F_Q5_0 = 2, F_Q5_1 = 3, F_Q8_0 = 4, F_Q4_K = 5, F_Q5_K = 6, F_Q6_K = 7 };
/* Q4_0 / Q4_1 rows repacked at load (qmm_repack) for the SIMD kernels, same bytes per row. Each run of 8 blocks
   becomes a group: the 8 float16 scales d, (Q4_1) the 8 float16 minimums m, then 4 x 32 bytes where byte i of
   run p holds value i of block 2p in its low nibble and value i of block 2p + 1 in its high nibble. The last
   (blocks % 8) blocks of a row stay in the GGUF layout. So 8 scales convert in one instruction, the minimums
   enter as one vector multiply-add per group, and 32 bytes unpack to two blocks with one shift. */
enum { F_Q4_0_R8 = 8, F_Q4_1_R8 = 9 };
/* Weights of N % 8 == 0 rows repacked at load (qmm_repack) into bands of 8 rows, same bytes: each band's block
   (or K super-block) b of its 8 rows is one group of 8 x (block bytes), at band + b * 8 * (block bytes), holding
   the 8 rows' float16 scales side by side and their quants in runs of 32 bytes where bytes 4r..4r+3 are 4
   consecutive values of row r. One broadcast of 4 activation bytes then meets the same 4 values of 8 weight rows,
   so a maddubs gives 8 rows' partial sums in the lanes of one register: each unpacked weight register serves
   every activation row of a tile, the sums stay integer over a block of 32 (the integer sub-block scales folded
   in with madd), and the float work is one convert and fma per block for 8 weight rows (x8_* below). Q5_0 / Q5_1
   groups keep the 8 rows' fifth bits (qh) in 32 bytes after the scales: bits 2c and 2c + 1 of byte 4r + k are
   those of values 4c + k and 16 + 4c + k of row r, so each run's fifth bits sit at the same bytes as its nibbles. */
enum {
    F_Q4_K_X8 = 10, F_Q6_K_X8 = 11, F_Q5_K_X8 = 12, F_Q4_0_X8 = 13, F_Q4_1_X8 = 14, F_Q8_0_X8 = 15, F_Q5_0_X8 = 16,
    F_Q5_1_X8 = 17
};
/* MXFP4 (gpt-oss experts): blocks of 32 as one E8M0 exponent byte e and 16 bytes of 4-bit E2M1 codes (value i in
   the low nibble of byte i, value 16 + i in the high nibble, as Q4_0). A code indexes MXFP4_LEVELS, the E2M1 values
   doubled (small integers), and the scale is 2^(e - 128), the E8M0 scale halved (e8m0_half), so a block is int8
   values times a power of two. Its _X8 group: the 8 rows' exponent bytes, then 4 runs of 32 bytes as Q4_0_X8's. */
enum { F_MXFP4 = 18, F_MXFP4_X8 = 19, N_FORMATS = 20 };

static inline int is_x8(int fmt) { return (fmt >= F_Q4_K_X8 && fmt <= F_Q5_1_X8) || fmt == F_MXFP4_X8; }

/* MXFP4's power-of-two scale meets the activation scale before the integer sum in every kernel: d * sum alone
   overflows float32 from e = 241 on, though the result may be in range (the other formats' d never get near). */
static inline int is_mxfp4(int fmt) { return fmt == F_MXFP4 || fmt == F_MXFP4_X8; }

static const int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An E8M0 exponent byte as the halved scale 2^(e - 128), the bits ggml's ggml_e8m0_to_fp32_half builds: subnormal
   for e < 2, 2^127 for e = 255 (which E8M0 reserves for NaN; ggml and gguf-py read it as a number). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(QMM_VNNI)
const char *qmm_variant(void) { return "avx512vnni"; }
#elif defined(QMM_AVX2)
const char *qmm_variant(void) { return "avx2"; }
#elif defined(QMM_NEON) && defined(__ARM_FEATURE_DOTPROD)
const char *qmm_variant(void) { return "neondot"; }
#elif defined(QMM_NEON)
const char *qmm_variant(void) { return "neon"; }
#else
const char *qmm_variant(void) { return "scalar"; }
#endif

static inline float rd16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* bytes per block of 32 (or 256 for K formats) and values per block */
static const int BLOCK_BYTES[N_FORMATS] = {18, 20, 22, 24, 34, 144, 176, 210, 18, 20,
                                           144, 210, 176, 18, 20, 34, 22, 24, 17, 17};
static const int BLOCK_VALUES[N_FORMATS] = {32, 32, 32, 32, 32, 256, 256, 256, 32, 32,
                                            256, 256, 256, 32, 32, 32, 32, 32, 32, 32};

int qmm_block_bytes(int fmt) { return BLOCK_BYTES[fmt]; }
int qmm_format_count(void) { return N_FORMATS; } /* format ids 0 .. count - 1 are known to this build */
int qmm_block_values(int fmt) { return BLOCK_VALUES[fmt]; }

/* K-quant 6-bit scale and min j (0..7) of a Q4_K / Q5_K super-block */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* bytes of an _R8 group's scale fields (d, and m for Q4_1) */
static inline int r8_head(int fmt) { return fmt == F_Q4_0_R8 ? 16 : 32; }

/* Where block b of an _R8 row of nb blocks lives: its group's start (scale fields first) and its 32 packed bytes
   (value i of block j in the low nibble when j is even, else the high one), with j = b % 8; returns 0 for a block
   of the row's tail, which keeps the GGUF layout of its base format. */
static inline int r8_locate(int fmt, const uint8_t *row, int nb, int b, const uint8_t **x, const uint8_t **qs) {
    const int groups = nb / 8, gb = 8 * BLOCK_BYTES[fmt], j = b % 8;
    if (b >= 8 * groups) return 0;
    *x = row + (size_t)(b / 8) * gb;
    *qs = *x + r8_head(fmt) + 32 * (j / 2);
    return 1;
}

/* the tail of an _R8 row: its base format's blocks after the whole groups */
static inline const uint8_t *r8_tail(int fmt, const uint8_t *row, int nb) { return row + (size_t)(nb / 8) * 8 * BLOCK_BYTES[fmt]; }

/* Block b (of 32 values) of a weight row of nb blocks as w_i = d * sc[i / 16] * q_i + m. */
static void unpack32(int fmt, const uint8_t *row, int nb, int b, int q[32], float *d, int sc[2], float *m) {
    sc[0] = sc[1] = 1;
    *m = 0.0f;
    if (fmt == F_Q4_0_R8 || fmt == F_Q4_1_R8) {
        const uint8_t *x, *qs;
        const int j = b % 8;
        if (!r8_locate(fmt, row, nb, b, &x, &qs)) {
            unpack32(fmt == F_Q4_0_R8 ? F_Q4_0 : F_Q4_1, r8_tail(fmt, row, nb), nb, b - nb / 8 * 8, q, d, sc, m);
            return;
        }
        *d = rd16(x + 2 * j);
        if (fmt == F_Q4_1_R8) *m = rd16(x + 16 + 2 * j);
        for (int i = 0; i < 32; i++) q[i] = ((qs[i] >> (4 * (j & 1))) & 0xF) - (fmt == F_Q4_0_R8 ? 8 : 0);
        return;
    }
    if (fmt == F_MXFP4) {
        const uint8_t *x = row + (size_t)b * 17;
        *d = e8m0_half(x[0]);
        for (int i = 0; i < 16; i++) {
            q[i] = MXFP4_LEVELS[x[1 + i] & 0xF];
            q[i + 16] = MXFP4_LEVELS[x[1 + i] >> 4];
        }
        return;
    }
    if (fmt <= F_Q8_0) {
        const uint8_t *x = row + (size_t)b * BLOCK_BYTES[fmt];
        *d = rd16(x);
        if (fmt == F_Q8_0) {
            for (int i = 0; i < 32; i++) q[i] = (int8_t)x[2 + i];
            return;
        }
        const uint8_t *qs = x + 2;
        uint32_t qh = 0;
        if (fmt == F_Q4_1 || fmt == F_Q5_1) {
            *m = rd16(x + 2);
            qs += 2;
        }
        if (fmt == F_Q5_0 || fmt == F_Q5_1) {
            memcpy(&qh, qs, 4);
            qs += 4;
        }
        int off = fmt == F_Q4_0 ? 8 : fmt == F_Q5_0 ? 16 : 0;
        for (int i = 0; i < 16; i++) {
            int h0 = (qh >> i) & 1, h1 = (qh >> (i + 16)) & 1;
            q[i] = ((qs[i] & 0xF) | (h0 << 4)) - off;
            q[i + 16] = ((qs[i] >> 4) | (h1 << 4)) - off;
        }
        return;
    }
    const uint8_t *x = row + (size_t)(b / 8) * BLOCK_BYTES[fmt];
    int j = b % 8; /* sub-block of 32 within the super-block */
    if (fmt == F_Q6_K) {
        const uint8_t *ql = x, *qh = x + 128;
        const int8_t *scales = (const int8_t *)(x + 192);
        *d = rd16(x + 208);
        int half = j / 4, part = j % 4; /* 128-value half, then which of its 4 runs of 32 */
        ql += 64 * half;
        qh += 32 * half;
        for (int l = 0; l < 32; l++) {
            int lo = part & 1 ? ql[l + 32] : ql[l];
            lo = part >= 2 ? lo >> 4 : lo & 0xF;
            int hi = (qh[l] >> (2 * part)) & 3;
            q[l] = (lo | (hi << 4)) - 32;
        }
        sc[0] = scales[2 * j];
        sc[1] = scales[2 * j + 1];
        return;
    }
    float dd = rd16(x), dmin = rd16(x + 2);
    int s, mn;
    scale_min_k4(j, x + 4, &s, &mn);
    *d = dd * s;
    *m = -dmin * mn;
    if (fmt == F_Q4_K) {
        const uint8_t *qs = x + 16 + 32 * (j / 2);
        for (int l = 0; l < 32; l++) q[l] = j & 1 ? qs[l] >> 4 : qs[l] & 0xF;
    } else { /* Q5_K */
        const uint8_t *qh = x + 16, *qs = x + 48 + 32 * (j / 2);
        for (int l = 0; l < 32; l++) q[l] = (j & 1 ? qs[l] >> 4 : qs[l] & 0xF) | (((qh[l] >> j) & 1) << 4);
    }
}

/* 6-bit scale and min of sub-block j of row r in an _X8 K group's 96 scale bytes (p): the low 4 bits of both at
   p[8 j + r], the high 2 bits of scale and min of sub-blocks j and j + 4 in p[64 + 8 (j % 4) + r] */
static inline void x8_scale_min(const uint8_t *p, int j, int r, int *sc, int *mn) {
    const int lo = p[8 * j + r], hi = p[64 + 8 * (j % 4) + r] >> (j < 4 ? 0 : 4);
    *sc = (lo & 0xF) | (hi & 3) << 4;
    *mn = (lo >> 4) | ((hi >> 2) & 3) << 4;
}

/* Offsets in a Q6_K _X8 group of run p (0..3) of low 4 bits (sub-blocks 2p, 2p + 1 in the nibbles) and run h
   (0, 1) of high 2 bits (sub-blocks 4h .. 4h + 3 in the bit pairs), ordered as the kernel first reads them:
   d [16], scales [128], high 0, low 0, low 1, high 1, low 2, low 3 (in order, the hardware prefetcher keeps up). */
static inline int q6x8_lo(int p) { return 400 + 256 * p + (p >= 2 ? 256 : 0); }
static inline int q6x8_hi(int h) { return 144 + 768 * h; }

/* Offsets in a Q4_0 / Q4_1 / Q5_0 / Q5_1 _X8 group of the fifth bits (Q5_0, Q5_1) and the runs of nibbles, after
   the scales d [8] and (Q4_1, Q5_1) the minimums m [8] at 16. */
static inline int x8_qh(int fmt) { return fmt == F_Q5_1_X8 ? 32 : 16; }
static inline int x8_qs(int fmt) {
    return fmt == F_Q4_0_X8 ? 16 : fmt == F_Q4_1_X8 ? 32 : fmt == F_Q5_0_X8 ? 48 : 64;
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

/* Dequantize rows `ids` of a weight (for embedding lookups): out[i, :] = W[ids[i], :] in float32. */
void qmm_dequant_rows(int fmt, const uint8_t *w, int64_t row_bytes, int K, const int64_t *ids, int n, float *out) {
    int q[32], sc[2];
    float d, m;
    for (int i = 0; i < n; i++) {
        for (int b = 0; b < K / 32; b++) {
            unpack_row(fmt, w, row_bytes, ids[i], K / 32, b, q, &d, sc, &m);
            for (int l = 0; l < 32; l++) out[(int64_t)i * K + b * 32 + l] = d * sc[l / 16] * q[l] + m;
        }
    }
}

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

/* ---- activation quantization ---------------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One block of 32 values (already float32 in buf) into q, its scale and its two sums of 16. */
__attribute__((unused)) static inline void quantize_block(const float *buf, int8_t *q, float *da, int16_t *sa) {
    float amax = 0.0f;
    for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(buf[l]));
    float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    int s0 = 0, s1 = 0;
    for (int l = 0; l < 32; l++) {
        int v = (int)nearbyintf(buf[l] * id);
        q[l] = (int8_t)v;
        if (l < 16) s0 += v; else s1 += v;
    }
    *da = d;
    sa[0] = (int16_t)s0;
    sa[1] = (int16_t)s1;
}

#if defined(QMM_AVX2)
#include <immintrin.h>
/* 8 values of x (float32 or bfloat16) as floats */
static inline __m256 load8_any(const void *x, int is_bf16, int64_t i) {
    if (is_bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

/* quantize_block in AVX2, the same bits: the maximum is exact in any order, x * id is one rounding either way, and
   the rounding to an integer follows the current rounding mode as nearbyintf does. */
static inline void quantize_block_avx2(const void *x, int is_bf16, int64_t i, int8_t *q, float *da, int16_t *sa) {
    __m256 v[4];
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) {
        v[c] = load8_any(x, is_bf16, i + 8 * c);
        mx = _mm256_max_ps(_mm256_and_ps(v[c], absmask), mx); /* a NaN lane keeps mx, as fmaxf ignores NaN */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4), d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i iv[4];
    for (int c = 0; c < 4; c++)
        iv[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[c], idv), _MM_FROUND_CUR_DIRECTION));
    /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
    const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p8);
    __m256i s = _mm256_hadd_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    s = _mm256_hadd_epi32(s, s); /* values 0-15: lanes 0 and 4; values 16-31: lanes 1 and 5 */
    *da = d;
    sa[0] = (int16_t)(_mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 4));
    sa[1] = (int16_t)(_mm256_extract_epi32(s, 1) + _mm256_extract_epi32(s, 5));
}
#endif

typedef struct {
    const void *x;
    int is_bf16, K, rows_per_task, M;
    int64_t ldx;
    int8_t *qa;
    float *da;
    int16_t *sa;
} quant_job_t;

static void quantize_rows(void *ctx, int task) {
    const quant_job_t *j = (const quant_job_t *)ctx;
    const int K = j->K, r1 = (task + 1) * j->rows_per_task < j->M ? (task + 1) * j->rows_per_task : j->M;
    for (int r = task * j->rows_per_task; r < r1; r++) {
        for (int b = 0; b < K / 32; b++) {
            const int64_t base = r * j->ldx + b * 32;
            int8_t *q = j->qa + (int64_t)r * K + b * 32;
            float *d = j->da + (int64_t)r * (K / 32) + b;
            int16_t *s = j->sa + (int64_t)r * (K / 16) + 2 * b;
#if defined(QMM_AVX2)
            quantize_block_avx2(j->x, j->is_bf16, base, q, d, s);
#else
            float buf[32];
            if (j->is_bf16) {
                const uint16_t *xs = (const uint16_t *)j->x + base;
                for (int l = 0; l < 32; l++) buf[l] = bf16_to_f32(xs[l]);
            } else {
                memcpy(buf, (const float *)j->x + base, sizeof buf);
            }
            quantize_block(buf, q, d, s);
#endif
        }
    }
}

/* Quantize M rows of x (float32, or bfloat16 when is_bf16) of K values (K % 32 == 0, row stride ldx
   elements) into qa [M, K] int8, da [M, K/32] scales and sa [M, K/16] sums of 16. Every block is quantized on
   its own, so how rows are split over threads changes no bits. */
void qmm_quantize(const void *x, int is_bf16, int64_t ldx, int M, int K, int8_t *qa, float *da, int16_t *sa) {
    /* rows of a few thousand values per task: smaller jobs cost more to hand over than they take */
    const int per = (8192 + K - 1) / K;
    quant_job_t j = {x, is_bf16, K, per, M, ldx, qa, da, sa};
    const int tasks = (M + per - 1) / per;
    pool_run(quantize_rows, &j, tasks, (int64_t)M * K >= 16384);
}

/* ---- dot products: one weight row against NR activation rows ------------------------------------- */

typedef struct {
    const int8_t *qa;
    const float *da;
    const int16_t *sa;
    const float *fs; /* da * (sum of the block's 32 values), [M, K/32]: the offset terms of Q4_1/Q5_1/Q4_K/Q5_K */
    int64_t lda;     /* values per activation row (K) */
} act_t;

/* the same activations from row r on */
static inline act_t act_from(act_t a, int64_t r) {
    act_t s = {a.qa + r * a.lda, a.da + r * (a.lda / 32), a.sa + r * (a.lda / 16), a.fs ? a.fs + r * (a.lda / 32) : 0,
               a.lda};
    return s;
}

__attribute__((unused)) static void dot_scalar(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int K, act_t a,
                                               int nr, float *out, int64_t ldo) {
    int q[32], sc[2];
    float d, m;
    float acc[4] = {0, 0, 0, 0};
    for (int b = 0; b < K / 32; b++) {
        unpack_row(fmt, w, row_bytes, n, K / 32, b, q, &d, sc, &m);
        for (int r = 0; r < nr; r++) {
            const int8_t *x = a.qa + r * a.lda + b * 32;
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++) s0 += q[l] * x[l];
            for (int l = 16; l < 32; l++) s1 += q[l] * x[l];
            const int16_t *sums = a.sa + r * (a.lda / 16) + 2 * b;
            const float da = a.da[r * (a.lda / 32) + b];
            if (is_mxfp4(fmt))
                acc[r] += da * d * (float)(s0 + s1);
            else
                acc[r] += da * (d * (float)(sc[0] * s0 + sc[1] * s1) + m * (float)(sums[0] + sums[1]));
        }
    }
    for (int r = 0; r < nr; r++) out[r * ldo] = acc[r];
}

#if defined(QMM_AVX2)

/* int32 x8 sums of 4 products of unsigned bytes u with signed bytes s */
static inline __m256i mul_u8s8(__m256i u, __m256i s) {
#if defined(QMM_VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* the same with the 16-value halves weighted by the scales in the 16-bit lanes of scv: c0 in lanes 0-7 (values
   0..15), c1 in lanes 8-15 (values 16..31); each 32-bit lane holds c | c << 16 */
static inline __m256i mul_u8s8_scv(__m256i u, __m256i s, __m256i scv) {
#if defined(QMM_VNNI)
    return _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), _mm256_srai_epi32(scv, 16));
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scv);
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 nibbles of 16 bytes: low nibbles are values 0..15, high nibbles 16..31 */
static inline __m256i nibbles32(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* 32 bits -> 32 bytes of 0x10 where the bit is set */
static inline __m256i bits32_x10(const uint8_t *p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

#define NRMAX 4

/* Generic loop body pieces: acc[r] += da * dw * isum (vector); accs[r] += m * (da * sum(a)) */
#define LOAD_A(r, b) _mm256_loadu_si256((const __m256i *)(a.qa + (r) * a.lda + (b) * 32))
#define DA(r, b) a.da[(r) * (a.lda / 32) + (b)]
#define FS(r, b) a.fs[(r) * (a.lda / 32) + (b)]

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* signed weights q (-128..127) times signed activations: the sign trick, since maddubs wants one unsigned side */
static inline __m256i mul_s8s8(__m256i q, __m256i aq, __m256i a) { return mul_u8s8(aq, _mm256_sign_epi8(a, q)); }

/* acc += float(p) * s */
static inline __m256 fma_block(__m256i p, float s, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc);
}

/* 8 bytes as 8 floats */
static inline __m256 u8x8_to_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The eight 6-bit scales and mins of a Q4_K / Q5_K super-block (ggml's packing) as bytes: sc[0..7], mn[0..7]. */
static inline void scales_mins_k4(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3];
    memcpy(u, q, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    uint32_t s0 = u[0] & k1, s1 = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    uint32_t m0 = u[1] & k1, m1 = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    memcpy(sc, &s0, 4);
    memcpy(sc + 4, &s1, 4);
    memcpy(mn, &m0, 4);
    memcpy(mn + 4, &m1, 4);
}

/* nw weight rows (row bytes apart) against nr activation rows (both compile-time constants after inlining): out[r *
   ldo + w] for w < nw, r < nr. Weights with an offset (-8, -16, -32) are made signed and multiplied with the sign
   trick, so no per-block correction is left; weights with a float minimum (Q4_1, Q5_1, Q4_K, Q5_K) stay unsigned
   and add m * (da * sum(a)) per block from the activation sums precomputed per call (a.fs). The float work per
   block, weight row and activation row is one convert and one fmadd into 8 lanes; the lanes are summed once per
   output. Every output gets the same sequence of operations whatever the tile shape, so results do not depend
   on the batch; the tile only sets how many independent accumulation chains run side by side. */
static inline __attribute__((always_inline)) void dot_simd(int fmt, const uint8_t *row, int64_t row_bytes, int K,
                                                            act_t a, int nw, int nr, float *out, int64_t ldo) {
    __m256 acc[2][NRMAX], accb[2][NRMAX]; /* accb: the odd blocks of the _R8 groups */
    float accs[2][NRMAX];
    for (int w = 0; w < nw; w++)
        for (int r = 0; r < nr; r++) {
            acc[w][r] = _mm256_setzero_ps();
            accb[w][r] = _mm256_setzero_ps();
            accs[w][r] = 0.0f;
        }
    const int nb = K / 32;
    if (fmt == F_Q4_0_R8 || fmt == F_Q4_1_R8) {
        const int groups = nb / 8, bb = BLOCK_BYTES[fmt], gb = 8 * bb, head = r8_head(fmt);
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        for (int g = 0; g < groups; g++) {
            const int b0 = 8 * g;
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)g * gb;
                const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x));
                /* Q4_0's offset of -8 is a minimum of -8 d */
                const __m256 mv = fmt == F_Q4_1_R8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + 16)))
                                                   : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f));
                /* the 8 blocks' scales times the activation scales, broadcast from memory per block */
                __attribute__((aligned(32))) float svb[NRMAX][8];
                for (int r = 0; r < nr; r++) {
                    _mm256_store_ps(svb[r], _mm256_mul_ps(dv, _mm256_loadu_ps(&DA(r, b0))));
                    acc[w][r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(&FS(r, b0)), acc[w][r]);
                }
                for (int p = 0; p < 4; p++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(x + head + 32 * p));
                    const __m256i u0 = _mm256_and_si256(q, low4), u1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                    for (int r = 0; r < nr; r++) {
                        /* even and odd blocks in two chains: one would wait on the fma latency */
                        acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mul_u8s8(u0, LOAD_A(r, b0 + 2 * p))),
                                                    _mm256_broadcast_ss(&svb[r][2 * p]), acc[w][r]);
                        accb[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mul_u8s8(u1, LOAD_A(r, b0 + 2 * p + 1))),
                                                     _mm256_broadcast_ss(&svb[r][2 * p + 1]), accb[w][r]);
                    }
                }
            }
        }
        for (int b = 8 * groups; b < nb; b++) { /* the tail, in the GGUF layout */
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)groups * gb + (size_t)(b - 8 * groups) * bb;
                const float d = h2f(x), m = fmt == F_Q4_1_R8 ? h2f(x + 2) : -8.0f * d;
                const __m256i u = nibbles32(x + (fmt == F_Q4_1_R8 ? 4 : 2));
                for (int r = 0; r < nr; r++) {
                    acc[w][r] = fma_block(mul_u8s8(u, LOAD_A(r, b)), DA(r, b) * d, acc[w][r]);
                    accs[w][r] = fmaf(m, FS(r, b), accs[w][r]);
                }
            }
        }
    } else if (fmt == F_Q4_0 || fmt == F_Q5_0) {
        const int bb = BLOCK_BYTES[fmt];
        for (int b = 0; b < nb; b++) {
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)b * bb;
                const float d = h2f(x);
                __m256i q = fmt == F_Q4_0 ? _mm256_sub_epi8(nibbles32(x + 2), _mm256_set1_epi8(8))
                                          : _mm256_sub_epi8(_mm256_or_si256(nibbles32(x + 6), bits32_x10(x + 2)),
                                                            _mm256_set1_epi8(16));
                const __m256i aq = _mm256_sign_epi8(q, q);
                for (int r = 0; r < nr; r++)
                    acc[w][r] = fma_block(mul_s8s8(q, aq, LOAD_A(r, b)), DA(r, b) * d, acc[w][r]);
            }
        }
    } else if (fmt == F_Q4_1 || fmt == F_Q5_1) {
        const int bb = BLOCK_BYTES[fmt];
        for (int b = 0; b < nb; b++) {
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)b * bb;
                const float d = h2f(x), m = h2f(x + 2);
                __m256i u = fmt == F_Q4_1 ? nibbles32(x + 4) : _mm256_or_si256(nibbles32(x + 8), bits32_x10(x + 4));
                for (int r = 0; r < nr; r++) {
                    acc[w][r] = fma_block(mul_u8s8(u, LOAD_A(r, b)), DA(r, b) * d, acc[w][r]);
                    accs[w][r] = fmaf(m, FS(r, b), accs[w][r]);
                }
            }
        }
    } else if (fmt == F_MXFP4) { /* the codes through the table to signed bytes, then as Q8_0 */
        const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_LEVELS));
        for (int b = 0; b < nb; b++) {
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)b * 17;
                const float d = e8m0_half(x[0]);
                const __m256i q = _mm256_shuffle_epi8(levels, nibbles32(x + 1)), aq = _mm256_sign_epi8(q, q);
                for (int r = 0; r < nr; r++)
                    acc[w][r] = fma_block(mul_s8s8(q, aq, LOAD_A(r, b)), DA(r, b) * d, acc[w][r]);
            }
        }
    } else if (fmt == F_Q8_0) {
        for (int b = 0; b < nb; b++) {
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)b * 34;
                const float d = h2f(x);
                __m256i q = _mm256_loadu_si256((const __m256i *)(x + 2));
                __m256i aq = _mm256_sign_epi8(q, q);
                for (int r = 0; r < nr; r++)
                    acc[w][r] = fma_block(mul_s8s8(q, aq, LOAD_A(r, b)), DA(r, b) * d, acc[w][r]);
            }
        }
    } else if (fmt == F_Q4_K || fmt == F_Q5_K) {
        /* per super-block: the 8 sub-block scales times each activation block's scale as one vector, the
           minimums' term as one vector fma; per block of 32 a lane of the former picked by a permute */
        const int bb = BLOCK_BYTES[fmt];
        const __m256i low4 = _mm256_set1_epi8(0x0F), x10 = _mm256_set1_epi8(0x10);
        for (int sb = 0; sb < nb / 8; sb++) {
            const int b8 = sb * 8;
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)sb * bb;
                uint8_t sc[8], mn[8];
                scales_mins_k4(x + 4, sc, mn);
                const __m256 scv = _mm256_mul_ps(_mm256_set1_ps(h2f(x)), u8x8_to_ps(sc));
                const __m256 mnv = _mm256_mul_ps(_mm256_set1_ps(-h2f(x + 2)), u8x8_to_ps(mn));
                __m256 sv[NRMAX];
                for (int r = 0; r < nr; r++) {
                    sv[r] = _mm256_mul_ps(scv, _mm256_loadu_ps(&DA(r, b8)));
                    acc[w][r] = _mm256_fmadd_ps(mnv, _mm256_loadu_ps(&FS(r, b8)), acc[w][r]);
                }
                const uint8_t *qs = x + (fmt == F_Q4_K ? 16 : 48);
                __m256i qh = fmt == F_Q5_K ? _mm256_loadu_si256((const __m256i *)(x + 16)) : _mm256_setzero_si256();
                for (int j2 = 0; j2 < 4; j2++) {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j2));
                    __m256i u0 = _mm256_and_si256(q, low4);
                    __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                    if (fmt == F_Q5_K) {
                        u0 = _mm256_or_si256(u0, _mm256_and_si256(_mm256_slli_epi16(qh, 4), x10));
                        u1 = _mm256_or_si256(u1, _mm256_and_si256(_mm256_slli_epi16(qh, 3), x10));
                        qh = _mm256_srli_epi16(qh, 2);
                    }
                    const int b0 = b8 + 2 * j2;
                    const __m256i i0 = _mm256_set1_epi32(2 * j2), i1 = _mm256_set1_epi32(2 * j2 + 1);
                    for (int r = 0; r < nr; r++) {
                        acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mul_u8s8(u0, LOAD_A(r, b0))),
                                                    _mm256_permutevar8x32_ps(sv[r], i0), acc[w][r]);
                        acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mul_u8s8(u1, LOAD_A(r, b0 + 1))),
                                                    _mm256_permutevar8x32_ps(sv[r], i1), acc[w][r]);
                    }
                }
            }
        }
    } else { /* Q6_K */
        const __m256i low4 = _mm256_set1_epi8(0x0F), x30 = _mm256_set1_epi8(0x30), m32 = _mm256_set1_epi8(32);
        for (int sb = 0; sb < nb / 8; sb++) {
            const int b8 = sb * 8;
            for (int w = 0; w < nw; w++) {
                const uint8_t *x = row + w * row_bytes + (size_t)sb * 210;
                const __m256 dv = _mm256_set1_ps(h2f(x + 208));
                __m256 sv[NRMAX];
                for (int r = 0; r < nr; r++) sv[r] = _mm256_mul_ps(dv, _mm256_loadu_ps(&DA(r, b8)));
                /* the 16 int8 scales as 32-bit lanes c | c << 16, scales 0-7 and 8-15 */
                const __m128i sc8 = _mm_loadu_si128((const __m128i *)(x + 192));
                __m256i c32[2] = {_mm256_cvtepi8_epi32(sc8), _mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))};
                for (int h = 0; h < 2; h++)
                    c32[h] = _mm256_or_si256(_mm256_and_si256(c32[h], _mm256_set1_epi32(0xFFFF)),
                                             _mm256_slli_epi32(c32[h], 16));
                for (int half = 0; half < 2; half++) {
                    const uint8_t *ql = x + 64 * half, *qhp = x + 128 + 32 * half;
                    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
                    __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                    __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
                    for (int part = 0; part < 4; part++) {
                        __m256i lo = part & 1 ? l1 : l0;
                        lo = part >= 2 ? _mm256_srli_epi16(lo, 4) : lo;
                        __m256i hi = part == 0 ? _mm256_slli_epi16(qh, 4)
                                   : part == 1 ? _mm256_slli_epi16(qh, 2)
                                   : part == 2 ? qh
                                               : _mm256_srli_epi16(qh, 2);
                        __m256i q = _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_and_si256(hi, x30));
                        const int j = 4 * half + part, b = b8 + j;
                        const __m256i qs = _mm256_sub_epi8(q, m32), aq = _mm256_sign_epi8(qs, qs);
                        /* scales 2j (values 0-15) and 2j + 1 (16-31): lanes 2j % 8 and 2j % 8 + 1 of c32[j / 4] */
                        const int l = (2 * j) % 8;
                        const __m256i scv = _mm256_permutevar8x32_epi32(
                            c32[j / 4], _mm256_setr_epi32(l, l, l, l, l + 1, l + 1, l + 1, l + 1));
                        const __m256i ij = _mm256_set1_epi32(j);
                        for (int r = 0; r < nr; r++) {
                            __m256i p = mul_u8s8_scv(aq, _mm256_sign_epi8(LOAD_A(r, b), qs), scv);
                            acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(sv[r], ij),
                                                        acc[w][r]);
                        }
                    }
                }
            }
        }
    }
    for (int w = 0; w < nw; w++)
        for (int r = 0; r < nr; r++) out[r * ldo + w] = hsum8(_mm256_add_ps(acc[w][r], accb[w][r])) + accs[w][r];
}

/* ---- _X8 bands: 8 weight rows in the lanes of a register --------------------------------------------- */

#define NX 8 /* activation rows per pass over a band (8 beats 4 at batch 8 by 5-15%, spills and all) */

/* Keeps v in a register as computed here: without it GCC regroups a run of integer adds into a tree over the
   unrolled loop, and spills most of the products to the stack. */
#define PIN(v) __asm__("" : "+x"(v))

/* 4 bytes broadcast to the 8 lanes */
static inline __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __m256 cvt8h(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

#ifndef QMM_PF
#define QMM_PF 2048
#endif
/* Ask for the cache lines of the band QMM_PF bytes ahead of the `bytes` at p about to be read: a decode step streams
   every weight once from memory, and the hardware prefetcher alone leaves the loads waiting on part of them. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + QMM_PF + o, _MM_HINT_T0);
}

/* The 8 rows' 6-bit scales and mins of a Q4_K / Q5_K _X8 group (96 bytes at p, x8_scale_min) as bytes [8 j + r]. */
static inline void x8_scales_mins(const uint8_t *p, uint8_t sc[64], uint8_t mn[64]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), lo0 = _mm256_loadu_si256((const __m256i *)p),
                  lo1 = _mm256_loadu_si256((const __m256i *)(p + 32)), hi = _mm256_loadu_si256((const __m256i *)(p + 64));
    const __m256i x30 = _mm256_set1_epi8(0x30);
    _mm256_store_si256((__m256i *)sc, _mm256_or_si256(_mm256_and_si256(lo0, low4),
                                                      _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4)));
    _mm256_store_si256((__m256i *)mn, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), low4),
                                                      _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(12)), 2)));
    _mm256_store_si256((__m256i *)(sc + 32), _mm256_or_si256(_mm256_and_si256(lo1, low4), _mm256_and_si256(hi, x30)));
    _mm256_store_si256((__m256i *)(mn + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), low4),
                                                             _mm256_and_si256(_mm256_srli_epi16(hi, 2), x30)));
}

/* The 8 halved E8M0 scales (e8m0_half) of the exponent bytes at p. */
static inline __m256 e8m0_half8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* A band of 8 weight rows (one _X8 format) against nr <= NX activation rows: out[r * ldo + i] for row i of the band.
   Per block of 32 and activation row: 8 broadcasts of 4 activation bytes, each multiplied (maddubs) with the same 4
   values of the 8 weight rows, summed in int16 as far as they cannot overflow (|a| <= 127: 4-bit weights 8 runs,
   5-bit 4, 6-bit 2), then madd with the rows' integer sub-block scales into int32; one convert and fma by
   d * da per block, one fma of the minimum (or Q4_0's -8 d, Q6_K's -32 folded in as integers) by da * sum(a).
   With VNNI the K-quants (Q4_K, Q5_K, Q6_K) sum each block in int32 with dpbusd instead, and multiply by the
   sub-block scale once: the same integers, so the same bits as the AVX2 path, in about 0.4x (Q5_K) to 0.75x
   (Q4_K) of the time at prefill sizes (docs/PERFORMANCE.md).
   Every output gets the same operations in the same order whatever nr is, so results do not depend on the batch. */
static inline __attribute__((always_inline)) void dot_x8(int fmt, const uint8_t *band, int K, act_t a, int nr,
                                                          float *out, int64_t ldo, int dpbusd) {
    __m256 acc[NX];
    (void)dpbusd; /* only VNNI builds have the dpbusd branches */
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    const int nb = K / 32, gb = 8 * BLOCK_BYTES[fmt];
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#define A4(r, b, c) bcast4(a.qa + (r) * a.lda + (b) * 32 + 4 * (c))
    if (fmt == F_Q4_0_X8 || fmt == F_Q4_1_X8 || fmt == F_Q5_0_X8 || fmt == F_Q5_1_X8) {
        /* unsigned nibbles (| the fifth bit << 4); the offset of Q4_0 (-8) or Q5_0 (-16) is a minimum of -8 d or -16 d.
           4-bit: the 4 runs' products summed in int16 (8 x 2 x 15 x 127), then one madd; 5-bit: a madd every 2 runs
           (4 x 2 x 31 x 127). */
        const int five = fmt == F_Q5_0_X8 || fmt == F_Q5_1_X8, has_m = fmt == F_Q4_1_X8 || fmt == F_Q5_1_X8;
        const int q0 = x8_qs(fmt);
        const float off = fmt == F_Q4_0_X8 ? -8.0f : -16.0f;
        const __m256i ones = _mm256_set1_epi16(1), x10 = _mm256_set1_epi8(0x10);
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = band + (size_t)b * gb;
            prefetch_ahead(g, gb);
            const __m256 dv = cvt8h(g);
            const __m256 mv = has_m ? cvt8h(g + 16) : _mm256_mul_ps(dv, _mm256_set1_ps(off));
            const __m256i h = five ? _mm256_loadu_si256((const __m256i *)(g + x8_qh(fmt))) : _mm256_setzero_si256();
            __m256i s16[NX], i32[NX];
            if (five) /* (s16: never read before set; quiets GCC's -Wmaybe-uninitialized) */
                for (int r = 0; r < nr; r++) s16[r] = i32[r] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) { /* values 4c.. in the low nibbles, 16 + 4c.. in the high ones */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(g + q0 + 32 * c));
                __m256i u0 = _mm256_and_si256(w, low4), u1 = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
                if (five) { /* bits 2c, 2c + 1 of h to bit 4 (shifts by a constant once unrolled) */
                    const __m256i h0 = c < 2 ? _mm256_slli_epi16(h, 4 - 2 * c) : _mm256_srli_epi16(h, 2 * c - 4);
                    const __m256i h1 = c < 2 ? _mm256_slli_epi16(h, 3 - 2 * c) : _mm256_srli_epi16(h, 2 * c - 3);
                    u0 = _mm256_or_si256(u0, _mm256_and_si256(h0, x10));
                    u1 = _mm256_or_si256(u1, _mm256_and_si256(h1, x10));
                }
                for (int r = 0; r < nr; r++) {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, A4(r, b, c)),
                                                       _mm256_maddubs_epi16(u1, A4(r, b, c + 4)));
                    if (five) {
                        s16[r] = c & 1 ? _mm256_add_epi16(s16[r], p) : p;
                        PIN(s16[r]);
                        if (c & 1) i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(s16[r], ones));
                    } else {
                        s16[r] = c ? _mm256_add_epi16(s16[r], p) : p;
                        PIN(s16[r]);
                    }
                }
            }
            for (int r = 0; r < nr; r++) {
                const __m256 isum = _mm256_cvtepi32_ps(five ? i32[r] : _mm256_madd_epi16(s16[r], ones));
                acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))), acc[r]);
                acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(FS(r, b)), acc[r]);
            }
        }
    } else if (fmt == F_MXFP4_X8) {
        /* the codes through a table of the levels + 12 (unsigned, 0..24) so maddubs takes them as they are; a madd
           every 2 runs (2 x 2 x 24 x 127 fits int16); the 12 taken off in integers as 12 * (sum of the block's 32
           activations), which leaves the same integer sum as the signed levels give (no float minimum to
           overflow where the scale is near float32's largest) */
        const __m256i levels = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14,
                                                15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
        const __m256i ones = _mm256_set1_epi16(1), twelve = _mm256_set1_epi16(12);
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = band + (size_t)b * gb;
            prefetch_ahead(g, gb);
            const __m256 dv = e8m0_half8(g);
            __m256i s16[NX], i32[NX];
            for (int r = 0; r < nr; r++) s16[r] = i32[r] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) { /* values 4c.. in the low nibbles, 16 + 4c.. in the high ones */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(g + 8 + 32 * c));
                const __m256i u0 = _mm256_shuffle_epi8(levels, _mm256_and_si256(w, low4));
                const __m256i u1 = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(w, 4), low4));
                for (int r = 0; r < nr; r++) {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, A4(r, b, c)),
                                                       _mm256_maddubs_epi16(u1, A4(r, b, c + 4)));
                    s16[r] = c & 1 ? _mm256_add_epi16(s16[r], p) : p;
                    PIN(s16[r]);
                    if (c & 1) i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(s16[r], ones));
                }
            }
            for (int r = 0; r < nr; r++) {
                const __m256i corr = _mm256_madd_epi16(bcast4(a.sa + r * (a.lda / 16) + 2 * b), twelve);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i32[r], corr)),
                                         _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))), acc[r]);
            }
        }
#if defined(QMM_VNNI)
    } else if (dpbusd && fmt == F_Q8_0_X8) {
        /* VNNI: the signed weights offset to unsigned (q + 128, an xor of the sign bit) straight into dpbusd, then
           128 x the block's activation sum taken off: the same integer sum q . a as the sign trick's below, so the
           same bits, in one instruction per run and row instead of four */
        const __m256i x80 = _mm256_set1_epi8((char)0x80), n128 = _mm256_set1_epi16(128);
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = band + (size_t)b * gb;
            prefetch_ahead(g, gb);
            const __m256 dv = cvt8h(g);
            __m256i i32[NX];
            for (int r = 0; r < nr; r++) i32[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(g + 16 + 32 * c)), x80);
                for (int r = 0; r < nr; r++) {
                    i32[r] = _mm256_dpbusd_epi32(i32[r], u, A4(r, b, c));
                    PIN(i32[r]);
                }
            }
            for (int r = 0; r < nr; r++) {
                const __m256i corr = _mm256_madd_epi16(bcast4(a.sa + r * (a.lda / 16) + 2 * b), n128);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i32[r], corr)),
                                         _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))), acc[r]);
            }
        }
#endif
    } else if (fmt == F_Q8_0_X8) { /* signed weights: the sign trick, a madd per run (2 x 128 x 127 fills int16) */
        const __m256i ones = _mm256_set1_epi16(1);
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = band + (size_t)b * gb;
            prefetch_ahead(g, gb);
            const __m256 dv = cvt8h(g);
            __m256i i32[NX];
            for (int r = 0; r < nr; r++) i32[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * c)), aq = _mm256_sign_epi8(q, q);
                for (int r = 0; r < nr; r++) {
                    const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(A4(r, b, c), q));
                    i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(p, ones));
                    PIN(i32[r]);
                }
            }
            for (int r = 0; r < nr; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r]), _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))), acc[r]);
        }
#if defined(QMM_VNNI)
    } else if (dpbusd && (fmt == F_Q4_K_X8 || fmt == F_Q5_K_X8)) {
        /* VNNI: dpbusd sums a lane's (a row's) 4 products straight into int32, so the block's 8 runs accumulate
           without int16 partial sums or madds; the sub-block scale multiplies the block's integer sum once (the
           same integers as the maddubs path, so the same bits) */
        const __m256i x10 = _mm256_set1_epi8(0x10);
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g = band + (size_t)sb * gb, *qs = g + (fmt == F_Q4_K_X8 ? 128 : 384), *qh = g + 128;
            const __m256 dv = cvt8h(g), nmv = _mm256_sub_ps(_mm256_setzero_ps(), cvt8h(g + 16));
            __attribute__((aligned(32))) uint8_t sc[64], mn[64];
            x8_scales_mins(g + 32, sc, mn);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g + j * (gb / 8), gb / 8);
                const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * j)));
                const __m256 mnv = _mm256_mul_ps(
                    nmv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 8 * j)))));
                const __m128i jc = _mm_cvtsi32_si128(j);
                __m256i i32[NX];
                for (int r = 0; r < nr; r++) i32[r] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 256 * (j / 2) + 32 * c));
                    __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(w, 4) : w, low4);
                    if (fmt == F_Q5_K_X8) {
                        const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * c));
                        u = _mm256_or_si256(u, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h, jc), 4), x10));
                    }
                    for (int r = 0; r < nr; r++) {
                        i32[r] = _mm256_dpbusd_epi32(i32[r], u, A4(r, b, c));
                        PIN(i32[r]);
                    }
                }
                for (int r = 0; r < nr; r++) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(i32[r], s32)),
                                             _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))), acc[r]);
                    acc[r] = _mm256_fmadd_ps(mnv, _mm256_set1_ps(FS(r, b)), acc[r]);
                }
            }
        }
    } else if (dpbusd && fmt == F_Q6_K_X8) {
        /* Q6_K as below, the runs of values 0-15 and 16-31 summed by dpbusd apart (their scales differ) */
        const __m256i x30 = _mm256_set1_epi8(0x30);
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g = band + (size_t)sb * gb;
            const __m256 dv = cvt8h(g);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g + j * (gb / 8), gb / 8);
                const __m256i scp = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g + 16 + 16 * j)));
                /* int32 lane r: row r's scale of values 0-15 (the low int16 of scp's lane), 16-31 (the high one) */
                const __m256i se = _mm256_srai_epi32(_mm256_slli_epi32(scp, 16), 16), so = _mm256_srai_epi32(scp, 16);
                __m256i lo[NX], hi32[NX];
                for (int r = 0; r < nr; r++) lo[r] = hi32[r] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    const __m256i lw = _mm256_loadu_si256((const __m256i *)(g + q6x8_lo(j / 2) + 32 * c));
                    const __m256i hw = _mm256_loadu_si256((const __m256i *)(g + q6x8_hi(j / 4) + 32 * c));
                    const int part = j % 4;
                    const __m256i hi = part == 0 ? _mm256_slli_epi16(hw, 4)
                                     : part == 1 ? _mm256_slli_epi16(hw, 2)
                                     : part == 2 ? hw
                                                 : _mm256_srli_epi16(hw, 2);
                    const __m256i u = _mm256_or_si256(_mm256_and_si256(j & 1 ? _mm256_srli_epi16(lw, 4) : lw, low4),
                                                      _mm256_and_si256(hi, x30));
                    for (int r = 0; r < nr; r++) {
                        if (c < 4) {
                            lo[r] = _mm256_dpbusd_epi32(lo[r], u, A4(r, b, c));
                            PIN(lo[r]);
                        } else {
                            hi32[r] = _mm256_dpbusd_epi32(hi32[r], u, A4(r, b, c));
                            PIN(hi32[r]);
                        }
                    }
                }
                for (int r = 0; r < nr; r++) {
                    const __m256i corr = _mm256_madd_epi16(scp, bcast4(a.sa + r * (a.lda / 16) + 2 * b));
                    const __m256i i32 = _mm256_add_epi32(_mm256_mullo_epi32(lo[r], se), _mm256_mullo_epi32(hi32[r], so));
                    const __m256i isum = _mm256_sub_epi32(i32, _mm256_slli_epi32(corr, 5));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))),
                                             acc[r]);
                }
            }
        }
#endif
    } else if (fmt == F_Q4_K_X8 || fmt == F_Q5_K_X8) {
        const __m256i x10 = _mm256_set1_epi8(0x10);
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g = band + (size_t)sb * gb, *qs = g + (fmt == F_Q4_K_X8 ? 128 : 384), *qh = g + 128;
            const __m256 dv = cvt8h(g), nmv = _mm256_sub_ps(_mm256_setzero_ps(), cvt8h(g + 16));
            __attribute__((aligned(32))) uint8_t sc[64], mn[64];
            x8_scales_mins(g + 32, sc, mn);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g + j * (gb / 8), gb / 8);
                const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * j)));
                const __m256i scv = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
                const __m256 mnv = _mm256_mul_ps(
                    nmv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 8 * j)))));
                const __m128i jc = _mm_cvtsi32_si128(j);
                /* Q4_K: all 8 runs of 4 values in int16 (8 x 2 x 15 x 127), then one madd; Q5_K: a madd every 2 runs */
                __m256i s16[NX], i32[NX];
                for (int r = 0; r < nr; r++) i32[r] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c += 2) {
                    __m256i u[2];
                    for (int e = 0; e < 2; e++) {
                        const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 256 * (j / 2) + 32 * (c + e)));
                        u[e] = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(w, 4) : w, low4);
                        if (fmt == F_Q5_K_X8) {
                            const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * (c + e)));
                            u[e] = _mm256_or_si256(u[e], _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h, jc), 4), x10));
                        }
                    }
                    for (int r = 0; r < nr; r++) {
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], A4(r, b, c)),
                                                           _mm256_maddubs_epi16(u[1], A4(r, b, c + 1)));
                        if (fmt == F_Q5_K_X8) {
                            i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(p, scv));
                            PIN(i32[r]);
                        } else {
                            s16[r] = c ? _mm256_add_epi16(s16[r], p) : p;
                            PIN(s16[r]);
                        }
                    }
                }
                if (fmt == F_Q4_K_X8)
                    for (int r = 0; r < nr; r++) i32[r] = _mm256_madd_epi16(s16[r], scv);
                for (int r = 0; r < nr; r++) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r]), _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))),
                                             acc[r]);
                    acc[r] = _mm256_fmadd_ps(mnv, _mm256_set1_ps(FS(r, b)), acc[r]);
                }
            }
        }
    } else { /* Q6_K: unsigned 6-bit q, the -32 taken off as 32 * sum(scale * sums of 16 activations) */
        const __m256i x30 = _mm256_set1_epi8(0x30);
        const __m256i dup_lo = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5,
                                                4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
        const __m256i dup_hi = _mm256_add_epi8(dup_lo, _mm256_set1_epi8(2));
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g = band + (size_t)sb * gb;
            const __m256 dv = cvt8h(g);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g + j * (gb / 8), gb / 8);
                /* int16 lanes 2r, 2r + 1: row r's scales of values 0-15 and 16-31; each duplicated for the madd */
                const __m256i scp = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g + 16 + 16 * j)));
                const __m256i sce = _mm256_shuffle_epi8(scp, dup_lo), sco = _mm256_shuffle_epi8(scp, dup_hi);
                __m256i i32[NX];
                for (int r = 0; r < nr; r++) i32[r] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c += 2) { /* two runs of 4 values: at most 2 x 2 x 63 x 127 in int16 */
                    __m256i u[2];
                    for (int e = 0; e < 2; e++) {
                        const __m256i lw = _mm256_loadu_si256((const __m256i *)(g + q6x8_lo(j / 2) + 32 * (c + e)));
                        const __m256i hw = _mm256_loadu_si256((const __m256i *)(g + q6x8_hi(j / 4) + 32 * (c + e)));
                        const int part = j % 4;
                        const __m256i hi = part == 0 ? _mm256_slli_epi16(hw, 4)
                                         : part == 1 ? _mm256_slli_epi16(hw, 2)
                                         : part == 2 ? hw
                                                     : _mm256_srli_epi16(hw, 2);
                        u[e] = _mm256_or_si256(_mm256_and_si256(j & 1 ? _mm256_srli_epi16(lw, 4) : lw, low4),
                                               _mm256_and_si256(hi, x30));
                    }
                    const __m256i scv = c < 4 ? sce : sco;
                    for (int r = 0; r < nr; r++) {
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], A4(r, b, c)),
                                                           _mm256_maddubs_epi16(u[1], A4(r, b, c + 1)));
                        i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(p, scv));
                        PIN(i32[r]);
                    }
                }
                for (int r = 0; r < nr; r++) {
                    const __m256i corr = _mm256_madd_epi16(scp, bcast4(a.sa + r * (a.lda / 16) + 2 * b));
                    const __m256i isum = _mm256_sub_epi32(i32[r], _mm256_slli_epi32(corr, 5));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))),
                                             acc[r]);
                }
            }
        }
    }
#undef A4
    for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#if defined(QMM_VNNI)
/* ---- two _X8 bands (16 weight rows) in the 16 lanes of a 512-bit register (K-quants, VNNI builds) ----------
   Lanes 0-7 hold band n's rows, lanes 8-15 band n + 8's, so each broadcast of 4 activation bytes meets 16 weight rows
   and the per-block float work serves 16 rows. Per lane the operations are dot_x8's VNNI path's, in the same order
   (the int32 block sums are exact, whatever order dpbusd adds them in), so a row gets the same bits in a 16-row
   pass as in an 8-row one: a matmul's result does not depend on how its rows were split into tasks. On a CPU with
   a full-width AVX-512 unit (Zen 5) a 512-bit dpbusd costs about what a 256-bit one does. */
#define PINZ(v) __asm__("" : "+v"(v))
/* Tiles of fewer activation rows keep the 8-row pass: at 1-4 rows a step streams the weights from memory, and the
   two bands' interleaved reads made a decode step about 1.1-1.3x slower (measured, one thread, docs/PERFORMANCE.md);
   the bits are the same either way. */
#ifndef X16_MIN_ROWS
#define X16_MIN_ROWS 8
#endif

static inline __m512i cat256(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* 8 bytes at p0 then 8 at p1 */
static inline __m128i cat64(const uint8_t *p0, const uint8_t *p1) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p0), _mm_loadl_epi64((const __m128i *)p1));
}

/* the 8 float16 values at p0, then the 8 at p1 */
static inline __m512 cvt16h(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                                   _mm_loadu_si128((const __m128i *)p1), 1));
}

static inline __m512i bcast4z(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Bands at w and w + band_bytes (rows n .. n + 15) against nr <= NX activation rows: out[r * ldo + i], i < 16. */
static inline __attribute__((always_inline)) void dot_x16(int fmt, const uint8_t *w, int64_t band_bytes, int K,
                                                          act_t a, int nr, float *out, int64_t ldo) {
    __m512 acc[NX];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    const int nb = K / 32, gb = 8 * BLOCK_BYTES[fmt];
    const __m512i low4 = _mm512_set1_epi8(0x0F);
#define A4Z(r, b, c) bcast4z(a.qa + (r) * a.lda + (b) * 32 + 4 * (c))
    if (fmt == F_Q8_0_X8) { /* dot_x8's VNNI Q8_0 path: weights offset to unsigned, 128 x the activation sum off */
        const __m512i x80 = _mm512_set1_epi8((char)0x80), n128 = _mm512_set1_epi16(128);
        for (int b = 0; b < nb; b++) {
            const uint8_t *g0 = w + (size_t)b * gb, *g1 = g0 + band_bytes;
            prefetch_ahead(g0, gb);
            prefetch_ahead(g1, gb);
            const __m512 dv = cvt16h(g0, g1);
            __m512i u[8];
            for (int c = 0; c < 8; c++) u[c] = _mm512_xor_si512(cat256(g0 + 16 + 32 * c, g1 + 16 + 32 * c), x80);
            for (int r = 0; r < nr; r++) {
                __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], A4Z(r, b, 0));
                __m512i f = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], A4Z(r, b, 1));
                for (int c = 2; c < 8; c += 2) {
                    e = _mm512_dpbusd_epi32(e, u[c], A4Z(r, b, c));
                    f = _mm512_dpbusd_epi32(f, u[c + 1], A4Z(r, b, c + 1));
                }
                const __m512i corr = _mm512_madd_epi16(bcast4z(a.sa + r * (a.lda / 16) + 2 * b), n128);
                const __m512i i32 = _mm512_sub_epi32(_mm512_add_epi32(e, f), corr);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(dv, _mm512_set1_ps(DA(r, b))), acc[r]);
                PINZ(acc[r]);
            }
        }
    } else if (fmt == F_Q4_K_X8 || fmt == F_Q5_K_X8) {
        const __m512i x10 = _mm512_set1_epi8(0x10);
        const int q0 = fmt == F_Q4_K_X8 ? 128 : 384;
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g0 = w + (size_t)sb * gb, *g1 = g0 + band_bytes;
            const __m512 dv = cvt16h(g0, g1), nmv = _mm512_sub_ps(_mm512_setzero_ps(), cvt16h(g0 + 16, g1 + 16));
            __attribute__((aligned(32))) uint8_t sc0[64], mn0[64], sc1[64], mn1[64];
            x8_scales_mins(g0 + 32, sc0, mn0);
            x8_scales_mins(g1 + 32, sc1, mn1);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g0 + j * (gb / 8), gb / 8);
                prefetch_ahead(g1 + j * (gb / 8), gb / 8);
                const __m512i s32 = _mm512_cvtepu8_epi32(cat64(sc0 + 8 * j, sc1 + 8 * j));
                const __m512 mnv = _mm512_mul_ps(nmv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(cat64(mn0 + 8 * j, mn1 + 8 * j))));
                const __m128i jc = _mm_cvtsi32_si128(j);
                __m512i u[8];
                for (int c = 0; c < 8; c++) {
                    const int o = q0 + 256 * (j / 2) + 32 * c;
                    const __m512i wv = cat256(g0 + o, g1 + o);
                    u[c] = _mm512_and_si512(j & 1 ? _mm512_srli_epi16(wv, 4) : wv, low4);
                    if (fmt == F_Q5_K_X8) {
                        const __m512i h = cat256(g0 + 128 + 32 * c, g1 + 128 + 32 * c);
                        u[c] = _mm512_or_si512(u[c], _mm512_and_si512(_mm512_slli_epi16(_mm512_srl_epi16(h, jc), 4), x10));
                    }
                }
                for (int r = 0; r < nr; r++) {
                    __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], A4Z(r, b, 0));
                    __m512i f = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], A4Z(r, b, 1));
                    for (int c = 2; c < 8; c += 2) {
                        e = _mm512_dpbusd_epi32(e, u[c], A4Z(r, b, c));
                        f = _mm512_dpbusd_epi32(f, u[c + 1], A4Z(r, b, c + 1));
                    }
                    const __m512i i32 = _mm512_mullo_epi32(_mm512_add_epi32(e, f), s32);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(dv, _mm512_set1_ps(DA(r, b))), acc[r]);
                    acc[r] = _mm512_fmadd_ps(mnv, _mm512_set1_ps(FS(r, b)), acc[r]);
                    PINZ(acc[r]);
                }
            }
        }
    } else { /* Q6_K */
        const __m512i x30 = _mm512_set1_epi8(0x30);
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g0 = w + (size_t)sb * gb, *g1 = g0 + band_bytes;
            const __m512 dv = cvt16h(g0, g1);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g0 + j * (gb / 8), gb / 8);
                prefetch_ahead(g1 + j * (gb / 8), gb / 8);
                const __m512i scp = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(g0 + 16 + 16 * j))),
                    _mm_loadu_si128((const __m128i *)(g1 + 16 + 16 * j)), 1));
                const __m512i se = _mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16), so = _mm512_srai_epi32(scp, 16);
                const int part = j % 4;
                __m512i u[8];
                for (int c = 0; c < 8; c++) {
                    const int lo_off = q6x8_lo(j / 2) + 32 * c, hi_off = q6x8_hi(j / 4) + 32 * c;
                    const __m512i lw = cat256(g0 + lo_off, g1 + lo_off), hw = cat256(g0 + hi_off, g1 + hi_off);
                    const __m512i hi = part == 0 ? _mm512_slli_epi16(hw, 4)
                                     : part == 1 ? _mm512_slli_epi16(hw, 2)
                                     : part == 2 ? hw
                                                 : _mm512_srli_epi16(hw, 2);
                    u[c] = _mm512_or_si512(_mm512_and_si512(j & 1 ? _mm512_srli_epi16(lw, 4) : lw, low4),
                                           _mm512_and_si512(hi, x30));
                }
                for (int r = 0; r < nr; r++) {
                    __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], A4Z(r, b, 0));
                    __m512i f = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4], A4Z(r, b, 4));
                    for (int c = 1; c < 4; c++) {
                        e = _mm512_dpbusd_epi32(e, u[c], A4Z(r, b, c));
                        f = _mm512_dpbusd_epi32(f, u[c + 4], A4Z(r, b, c + 4));
                    }
                    const __m512i corr = _mm512_madd_epi16(scp, bcast4z(a.sa + r * (a.lda / 16) + 2 * b));
                    const __m512i i32 = _mm512_add_epi32(_mm512_mullo_epi32(e, se), _mm512_mullo_epi32(f, so));
                    const __m512i isum = _mm512_sub_epi32(i32, _mm512_slli_epi32(corr, 5));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, _mm512_set1_ps(DA(r, b))), acc[r]);
                    PINZ(acc[r]);
                }
            }
        }
    }
#undef A4Z
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

typedef void (*x16_fn)(const uint8_t *, int64_t, int, act_t, float *, int64_t);
#define X16_NR(F, NR)                                                                                       \
    static void dot_x16_##F##_##NR(const uint8_t *w, int64_t bb, int K, act_t a, float *out, int64_t ldo) { \
        dot_x16(F, w, bb, K, a, NR, out, ldo);                                                              \
    }
#define X16_FMT(F) X16_NR(F, 1) X16_NR(F, 2) X16_NR(F, 3) X16_NR(F, 4) X16_NR(F, 5) X16_NR(F, 6) X16_NR(F, 7) X16_NR(F, 8)
X16_FMT(F_Q4_K_X8)
X16_FMT(F_Q5_K_X8)
X16_FMT(F_Q6_K_X8)
X16_FMT(F_Q8_0_X8)
#define X16_ROW(F)                                                                                          \
    [F] = {dot_x16_##F##_1, dot_x16_##F##_2, dot_x16_##F##_3, dot_x16_##F##_4,                              \
           dot_x16_##F##_5, dot_x16_##F##_6, dot_x16_##F##_7, dot_x16_##F##_8}
static const x16_fn X16[N_FORMATS][NX] = {X16_ROW(F_Q4_K_X8), X16_ROW(F_Q5_K_X8), X16_ROW(F_Q6_K_X8),
                                          X16_ROW(F_Q8_0_X8)};
#endif

/* The K-quants' dpbusd path (VNNI builds) for tiles of 2+ activation rows; a single row (a one-stream decode step,
   the output head) keeps the maddubs path, which measured 1.02x-1.19x faster there (all of the 0.8B Qwen3.5 shape's
   matrices, streamed once per step). Both give the same bits. */
#if defined(QMM_VNNI)
#define X8_DPBUSD(NR) ((NR) >= 2)
#else
#define X8_DPBUSD(NR) 0
#endif
typedef void (*x8_fn)(const uint8_t *, int, act_t, float *, int64_t);
#define X8_NR(F, NR)                                                                                        \
    static void dot_x8_##F##_##NR(const uint8_t *band, int K, act_t a, float *out, int64_t ldo) {          \
        dot_x8(F, band, K, a, NR, out, ldo, X8_DPBUSD(NR));                                                 \
    }
#define X8_FMT(F) X8_NR(F, 1) X8_NR(F, 2) X8_NR(F, 3) X8_NR(F, 4) X8_NR(F, 5) X8_NR(F, 6) X8_NR(F, 7) X8_NR(F, 8)
X8_FMT(F_Q4_K_X8)
X8_FMT(F_Q6_K_X8)
X8_FMT(F_Q5_K_X8)
X8_FMT(F_Q4_0_X8)
X8_FMT(F_Q4_1_X8)
X8_FMT(F_Q8_0_X8)
X8_FMT(F_Q5_0_X8)
X8_FMT(F_Q5_1_X8)
X8_FMT(F_MXFP4_X8)
#define X8_ROW(F)                                                                                           \
    [F] = {dot_x8_##F##_1, dot_x8_##F##_2, dot_x8_##F##_3, dot_x8_##F##_4,                                  \
           dot_x8_##F##_5, dot_x8_##F##_6, dot_x8_##F##_7, dot_x8_##F##_8}
static const x8_fn X8[N_FORMATS][NX] = {X8_ROW(F_Q4_K_X8), X8_ROW(F_Q6_K_X8), X8_ROW(F_Q5_K_X8), X8_ROW(F_Q4_0_X8),
                                        X8_ROW(F_Q4_1_X8), X8_ROW(F_Q8_0_X8), X8_ROW(F_Q5_0_X8), X8_ROW(F_Q5_1_X8),
                                        X8_ROW(F_MXFP4_X8)};

/* tiles: 2 or 1 weight rows x 4 activation rows (prompt rows), 1 x 1 (decode rows and what is left) */
#define DOT_FMT(F)                                                                                          \
    static void dot_##F##_2x4(const uint8_t *row, int64_t rb, int K, act_t a, float *out, int64_t ldo) {   \
        dot_simd(F, row, rb, K, a, 2, 4, out, ldo);                                                         \
    }                                                                                                       \
    static void dot_##F##_1x4(const uint8_t *row, int64_t rb, int K, act_t a, float *out, int64_t ldo) {   \
        dot_simd(F, row, rb, K, a, 1, 4, out, ldo);                                                         \
    }                                                                                                       \
    static void dot_##F##_1x1(const uint8_t *row, int64_t rb, int K, act_t a, float *out, int64_t ldo) {   \
        dot_simd(F, row, rb, K, a, 1, 1, out, ldo);                                                         \
    }
DOT_FMT(F_Q4_0)
DOT_FMT(F_Q4_1)
DOT_FMT(F_Q5_0)
DOT_FMT(F_Q5_1)
DOT_FMT(F_Q8_0)
DOT_FMT(F_Q4_K)
DOT_FMT(F_Q5_K)
DOT_FMT(F_Q6_K)
DOT_FMT(F_Q4_0_R8)
DOT_FMT(F_Q4_1_R8)
DOT_FMT(F_MXFP4)

typedef void (*dot_fn)(const uint8_t *, int64_t, int, act_t, float *, int64_t);
#define DOT_TABLE(S)                                                                                        \
    {dot_F_Q4_0_##S, dot_F_Q4_1_##S, dot_F_Q5_0_##S, dot_F_Q5_1_##S,                                        \
     dot_F_Q8_0_##S, dot_F_Q4_K_##S, dot_F_Q5_K_##S, dot_F_Q6_K_##S, dot_F_Q4_0_R8_##S, dot_F_Q4_1_R8_##S, \
     [F_MXFP4] = dot_F_MXFP4_##S}
static const dot_fn DOT2x4[N_FORMATS] = DOT_TABLE(2x4), DOT1x4[N_FORMATS] = DOT_TABLE(1x4),
                    DOT1x1[N_FORMATS] = DOT_TABLE(1x1);

/* weight rows [n0, n1) against activation rows [0, nr): groups of 4 activation rows two (or one) weight rows at a time,
   then the rest of the activation rows (decode) one at a time */
static void dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr,
                      float *out, int64_t ldo) {
    if (is_x8(fmt)) { /* band by band (n0, n1: multiples of 8), every tile of activation rows over each band */
        const x8_fn *fn = X8[fmt];
        int n = n0;
#if defined(QMM_VNNI)
        const x16_fn *fn16 = X16[fmt];
        if (fn16[0] && nr >= X16_MIN_ROWS) /* two bands at a time while two are left */
            for (; n + 16 <= n1; n += 16) {
                const uint8_t *band = w + (int64_t)n * row_bytes;
                for (int r = 0; r < nr; r += NX) {
                    const int k = nr - r < NX ? nr - r : NX;
                    fn16[k - 1](band, 8 * row_bytes, K, act_from(a, r), out + r * ldo + n, ldo);
                }
            }
#endif
        for (; n < n1; n += 8) {
            const uint8_t *band = w + (int64_t)n * row_bytes;
            for (int r = 0; r < nr; r += NX) {
                const int k = nr - r < NX ? nr - r : NX;
                fn[k - 1](band, K, act_from(a, r), out + r * ldo + n, ldo);
            }
        }
        return;
    }
    int r = 0;
    for (; r + 4 <= nr; r += 4) {
        const act_t ar = act_from(a, r);
        float *o = out + r * ldo;
        int n = n0;
        /* the _R8 kernels keep a scale vector per activation row: 2 x 4 of them spill registers */
        for (; fmt != F_Q4_0_R8 && fmt != F_Q4_1_R8 && n + 2 <= n1; n += 2)
            DOT2x4[fmt](w + n * row_bytes, row_bytes, K, ar, o + n, ldo);
        for (; n < n1; n++) DOT1x4[fmt](w + n * row_bytes, row_bytes, K, ar, o + n, ldo);
    }
    /* Decode rows one weight row at a time: several weight rows side by side (more independent chains) win on
       weights in cache but lose about 1.7x when they stream from memory, as a decode step's do: the interleaved
       reads defeat the hardware prefetcher (docs/PERFORMANCE.md). */
    for (; r < nr; r++) {
        const act_t ar = act_from(a, r);
        for (int n = n0; n < n1; n++) DOT1x1[fmt](w + n * row_bytes, row_bytes, K, ar, out + r * ldo + n, ldo);
    }
}

#elif defined(QMM_NEON)

/* unpack32 in NEON: block b of a weight row as 32 signed bytes (q[0]: values 0-15, q[1]: 16-31) with the same
   d, sc and m; every format's values fit a signed byte */
static void unpack32_neon(int fmt, const uint8_t *row, int nb, int b, int8x16_t q[2], float *d, int sc[2], float *m) {
    const uint8x16_t low4 = vdupq_n_u8(0xF);
    uint8x16_t lo, hi;
    int off = 0;
    sc[0] = sc[1] = 1;
    *m = 0.0f;
    if (fmt == F_MXFP4) { /* the codes through the table of levels */
        const uint8_t *x = row + (size_t)b * 17;
        const int8x16_t levels = vld1q_s8(MXFP4_LEVELS);
        const uint8x16_t v = vld1q_u8(x + 1);
        *d = e8m0_half(x[0]);
        q[0] = vqtbl1q_s8(levels, vandq_u8(v, low4));
        q[1] = vqtbl1q_s8(levels, vshrq_n_u8(v, 4));
        return;
    }
    if (fmt == F_Q4_0_R8 || fmt == F_Q4_1_R8) {
        const uint8_t *x, *qs;
        const int j = b % 8;
        if (!r8_locate(fmt, row, nb, b, &x, &qs)) {
            unpack32_neon(fmt == F_Q4_0_R8 ? F_Q4_0 : F_Q4_1, r8_tail(fmt, row, nb), nb, b - nb / 8 * 8, q, d, sc, m);
            return;
        }
        *d = rd16(x + 2 * j);
        if (fmt == F_Q4_1_R8) *m = rd16(x + 16 + 2 * j);
        lo = vld1q_u8(qs);
        hi = vld1q_u8(qs + 16);
        if (j & 1) {
            lo = vshrq_n_u8(lo, 4);
            hi = vshrq_n_u8(hi, 4);
        } else {
            lo = vandq_u8(lo, low4);
            hi = vandq_u8(hi, low4);
        }
        off = fmt == F_Q4_0_R8 ? 8 : 0;
    } else if (fmt <= F_Q8_0) {
        const uint8_t *x = row + (size_t)b * BLOCK_BYTES[fmt];
        *d = rd16(x);
        if (fmt == F_Q8_0) {
            q[0] = vld1q_s8((const int8_t *)x + 2);
            q[1] = vld1q_s8((const int8_t *)x + 18);
            return;
        }
        const uint8_t *qs = x + 2;
        uint32_t qh = 0;
        if (fmt == F_Q4_1 || fmt == F_Q5_1) {
            *m = rd16(x + 2);
            qs += 2;
        }
        if (fmt == F_Q5_0 || fmt == F_Q5_1) {
            memcpy(&qh, qs, 4);
            qs += 4;
        }
        const uint8x16_t v = vld1q_u8(qs);
        lo = vandq_u8(v, low4);
        hi = vshrq_n_u8(v, 4);
        if (fmt == F_Q5_0 || fmt == F_Q5_1) { /* bit i of qh is the fifth bit of value i */
            static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
            const uint8x16_t sel = vld1q_u8(bit), b4 = vdupq_n_u8(0x10);
            const uint8x16_t h0 = vcombine_u8(vdup_n_u8(qh & 0xFF), vdup_n_u8((qh >> 8) & 0xFF));
            const uint8x16_t h1 = vcombine_u8(vdup_n_u8((qh >> 16) & 0xFF), vdup_n_u8(qh >> 24));
            lo = vorrq_u8(lo, vandq_u8(vtstq_u8(h0, sel), b4));
            hi = vorrq_u8(hi, vandq_u8(vtstq_u8(h1, sel), b4));
        }
        off = fmt == F_Q4_0 ? 8 : fmt == F_Q5_0 ? 16 : 0;
    } else {
        const uint8_t *x = row + (size_t)(b / 8) * BLOCK_BYTES[fmt];
        const int j = b % 8; /* sub-block of 32 within the super-block */
        if (fmt == F_Q6_K) {
            const int half = j / 4, part = j % 4; /* 128-value half, then which of its 4 runs of 32 */
            const uint8_t *ql = x + 64 * half + (part & 1 ? 32 : 0), *qh = x + 128 + 32 * half;
            lo = vld1q_u8(ql);
            hi = vld1q_u8(ql + 16);
            if (part >= 2) {
                lo = vshrq_n_u8(lo, 4);
                hi = vshrq_n_u8(hi, 4);
            } else {
                lo = vandq_u8(lo, low4);
                hi = vandq_u8(hi, low4);
            }
            const int8x16_t shift = vdupq_n_s8((int8_t)(-2 * part));
            const uint8x16_t three = vdupq_n_u8(3);
            lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(qh), shift), three), 4));
            hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(qh + 16), shift), three), 4));
            const int8_t *scales = (const int8_t *)(x + 192);
            *d = rd16(x + 208);
            sc[0] = scales[2 * j];
            sc[1] = scales[2 * j + 1];
            off = 32;
        } else {
            float dd = rd16(x), dmin = rd16(x + 2);
            int s, mn;
            scale_min_k4(j, x + 4, &s, &mn);
            *d = dd * s;
            *m = -dmin * mn;
            const uint8_t *qs = x + (fmt == F_Q4_K ? 16 : 48) + 32 * (j / 2);
            lo = vld1q_u8(qs);
            hi = vld1q_u8(qs + 16);
            if (j & 1) {
                lo = vshrq_n_u8(lo, 4);
                hi = vshrq_n_u8(hi, 4);
            } else {
                lo = vandq_u8(lo, low4);
                hi = vandq_u8(hi, low4);
            }
            if (fmt == F_Q5_K) { /* bit j of qh[l] is the fifth bit of value l */
                const int8x16_t shift = vdupq_n_s8((int8_t)-j);
                const uint8x16_t one = vdupq_n_u8(1);
                lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(x + 16), shift), one), 4));
                hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(x + 32), shift), one), 4));
            }
        }
    }
    q[0] = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8((int8_t)off));
    q[1] = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8((int8_t)off));
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
static void dot_neon(int fmt, const uint8_t *row, int K, act_t a, int nr, float *out, int64_t ldo) {
    int8x16_t q[2];
    int sc[2];
    float d, m;
    float acc[4] = {0, 0, 0, 0};
    for (int b = 0; b < K / 32; b++) {
        unpack32_neon(fmt, row, K / 32, b, q, &d, sc, &m);
        for (int r = 0; r < nr; r++) {
            const int8_t *x = a.qa + r * a.lda + b * 32;
            const int s0 = dot16(q[0], vld1q_s8(x)), s1 = dot16(q[1], vld1q_s8(x + 16));
            const int16_t *sums = a.sa + r * (a.lda / 16) + 2 * b;
            const float da = a.da[r * (a.lda / 32) + b];
            if (is_mxfp4(fmt))
                acc[r] += da * d * (float)(s0 + s1);
            else
                acc[r] += da * (d * (float)(sc[0] * s0 + sc[1] * s1) + m * (float)(sums[0] + sums[1]));
        }
    }
    for (int r = 0; r < nr; r++) out[r * ldo] = acc[r];
}

static void dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr,
                      float *out, int64_t ldo) {
    for (int n = n0; n < n1; n++)
        for (int r = 0; r < nr; r += 4) {
            int k = nr - r < 4 ? nr - r : 4;
            dot_neon(fmt, w + n * row_bytes, K, act_from(a, r), k, out + r * ldo + n, ldo);
        }
}

#else

static void dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr,
                      float *out, int64_t ldo) {
    for (int n = n0; n < n1; n++)
        for (int r = 0; r < nr; r += 4) {
            int k = nr - r < 4 ? nr - r : 4;
            dot_scalar(fmt, w, row_bytes, n, K, act_from(a, r), k, out + r * ldo + n, ldo);
        }
}

#endif

/* ---- the matmul: chunks of output rows as pool tasks ------------------------------------------------ */

typedef struct {
    int fmt, N, K, M, chunk;
    const uint8_t *w;
    int64_t row_bytes, ldo;
    act_t a;
    float *out;
} job_t;

enum { M_TILE = 64, TASKS_PER_THREAD = 8, MIN_CHUNK = 16, MAX_CHUNK = 512 };

/* weight rows [n0, n1) against M activation rows, tile by tile: the chunk's weight rows stay in cache while every
   tile of activation rows passes over them */
static void rows_task(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int M, float *out,
                      int64_t ldo) {
    for (int m0 = 0; m0 < M; m0 += M_TILE) {
        int mt = M - m0 < M_TILE ? M - m0 : M_TILE;
        dot_block(fmt, w, row_bytes, n0, n1, K, act_from(a, m0), mt, out + (int64_t)m0 * ldo, ldo);
    }
}

static void run_chunk(void *ctx, int c) {
    job_t *j = (job_t *)ctx;
    int n0 = c * j->chunk, n1 = n0 + j->chunk < j->N ? n0 + j->chunk : j->N;
    rows_task(j->fmt, j->w, j->row_bytes, n0, n1, j->K, j->a, j->M, j->out, j->ldo);
}

int qmm_needs_sums(int fmt) {
    return fmt == F_Q4_1 || fmt == F_Q5_1 || fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q4_0_R8 || fmt == F_Q4_1_R8 ||
           (is_x8(fmt) && fmt != F_Q6_K_X8 && fmt != F_Q8_0_X8 && fmt != F_MXFP4_X8);
}

void qmm_offset_sums(const float *da, const int16_t *sa, int64_t n, float *fs) {
    for (int64_t i = 0; i < n; i++) fs[i] = da[i] * (float)(sa[2 * i] + sa[2 * i + 1]);
}

void qmm_rows(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, const int8_t *qa, const float *da,
              const int16_t *sa, const float *fs, int M, float *out, int64_t ldo) {
    act_t a = {qa, da, sa, fs, K};
    rows_task(fmt, w, row_bytes, n0, n1, K, a, M, out, ldo);
}

/* y[m, n] (row stride ldo) = sum_k x[m, k] W[n, k] for the quantized activations (qa, da, sa) of M rows and a
   weight of N rows in format fmt (row_bytes bytes each, K values). */
void qmm_matmul(int fmt, const uint8_t *w, int64_t row_bytes, int N, int K, const int8_t *qa, const float *da,
                const int16_t *sa, int M, float *out, int64_t ldo) {
    float stack_fs[256], *fs = 0;
    if (qmm_needs_sums(fmt)) {
        int64_t n = (int64_t)M * (K / 32);
        fs = n <= 256 ? stack_fs : (float *)malloc(n * sizeof(float));
        if (!fs) abort();
        qmm_offset_sums(da, sa, n, fs);
    }
    /* Rows per task: a few tasks per thread, so that a thread the OS delays leaves little for the others to wait
       on, but not so many that taking tasks (one shared atomic each) costs much next to a small matmul. A
       multiple of 16 keeps the 4-row decode tiles whole. */
    int chunk = (N + TASKS_PER_THREAD * pool_threads() - 1) / (TASKS_PER_THREAD * pool_threads());
    chunk = (chunk + MIN_CHUNK - 1) / MIN_CHUNK * MIN_CHUNK;
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk > MAX_CHUNK ? MAX_CHUNK : chunk;
    job_t job = {fmt, N, K, M, chunk, w, row_bytes, ldo, {qa, da, sa, fs, K}, out};
    int chunks = (N + chunk - 1) / chunk;
    /* small jobs are not worth waking anyone */
    pool_run(run_chunk, &job, chunks, (int64_t)N * M * K >= (1 << 16));
    if (fs && fs != stack_fs) free(fs);
}
