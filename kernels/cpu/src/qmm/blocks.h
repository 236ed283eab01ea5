/* The GGUF block formats the quantized matmul reads, their repacked layouts, and the helpers every qmm unit
   shares to find a block's bits and scales (private to src/qmm; the API is include/qmatmul.h). */
#pragma once
#include <stdint.h>
#include <string.h>

#include "half.h"

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

/* Where block b (of 32 values) of a weight row of nb blocks (GGUF or _R8 layout) keeps its bits, and its scales: what
   the portable reading (unpack32) and the NEON one (arch/arm) share, so each layout is spelled out once. */
enum { B_BYTES, B_LEVELS, B_SPLIT, B_RUN };
typedef struct {
    int kind; /* B_BYTES: 32 int8 at qs; B_LEVELS: MXFP4 codes as B_SPLIT's nibbles through MXFP4_LEVELS;
                 B_SPLIT: 16 bytes at qs, value i in the low nibble of qs[i], value 16 + i in the high one, fifth bits
                 (Q5_0 / Q5_1, five) bit i of qh32; B_RUN: value l in bits shift..shift+3 of qs[l] and, where qh,
                 bits hshift.. of qh[l] under hmask as its bits 4.. */
    const uint8_t *qs, *qh;
    uint32_t qh32;
    int five, shift, hshift, hmask, off; /* off: subtracted from each value */
    float d, m;
    int sc[2];
} block32_t;

static inline void locate32(int fmt, const uint8_t *row, int nb, int b, block32_t *v) {
    v->sc[0] = v->sc[1] = 1;
    v->m = 0.0f;
    v->qh = 0;
    v->qh32 = 0;
    v->five = v->shift = v->hshift = v->hmask = v->off = 0;
    if (fmt == F_Q4_0_R8 || fmt == F_Q4_1_R8) {
        const uint8_t *x, *qs;
        const int j = b % 8;
        if (!r8_locate(fmt, row, nb, b, &x, &qs)) {
            locate32(fmt == F_Q4_0_R8 ? F_Q4_0 : F_Q4_1, r8_tail(fmt, row, nb), nb, b - nb / 8 * 8, v);
            return;
        }
        v->d = rd16(x + 2 * j);
        if (fmt == F_Q4_1_R8) v->m = rd16(x + 16 + 2 * j);
        v->kind = B_RUN;
        v->qs = qs;
        v->shift = 4 * (j & 1);
        v->off = fmt == F_Q4_0_R8 ? 8 : 0;
        return;
    }
    if (fmt == F_MXFP4) {
        const uint8_t *x = row + (size_t)b * 17;
        v->d = e8m0_half(x[0]);
        v->kind = B_LEVELS;
        v->qs = x + 1;
        return;
    }
    if (fmt <= F_Q8_0) {
        const uint8_t *x = row + (size_t)b * BLOCK_BYTES[fmt];
        v->d = rd16(x);
        if (fmt == F_Q8_0) {
            v->kind = B_BYTES;
            v->qs = x + 2;
            return;
        }
        const uint8_t *qs = x + 2;
        if (fmt == F_Q4_1 || fmt == F_Q5_1) {
            v->m = rd16(x + 2);
            qs += 2;
        }
        if (fmt == F_Q5_0 || fmt == F_Q5_1) {
            memcpy(&v->qh32, qs, 4);
            qs += 4;
            v->five = 1;
        }
        v->kind = B_SPLIT;
        v->qs = qs;
        v->off = fmt == F_Q4_0 ? 8 : fmt == F_Q5_0 ? 16 : 0;
        return;
    }
    const uint8_t *x = row + (size_t)(b / 8) * BLOCK_BYTES[fmt];
    const int j = b % 8; /* sub-block of 32 within the super-block */
    v->kind = B_RUN;
    if (fmt == F_Q6_K) {
        const int half = j / 4, part = j % 4; /* 128-value half, then which of its 4 runs of 32 */
        const int8_t *scales = (const int8_t *)(x + 192);
        v->qs = x + 64 * half + (part & 1 ? 32 : 0);
        v->shift = part >= 2 ? 4 : 0;
        v->qh = x + 128 + 32 * half;
        v->hshift = 2 * part;
        v->hmask = 3;
        v->off = 32;
        v->d = rd16(x + 208);
        v->sc[0] = scales[2 * j];
        v->sc[1] = scales[2 * j + 1];
        return;
    }
    float dd = rd16(x), dmin = rd16(x + 2);
    int s, mn;
    scale_min_k4(j, x + 4, &s, &mn);
    v->d = dd * s;
    v->m = -dmin * mn;
    v->qs = x + (fmt == F_Q4_K ? 16 : 48) + 32 * (j / 2);
    v->shift = 4 * (j & 1);
    if (fmt == F_Q5_K) { /* bit j of qh[l] is the fifth bit of value l */
        v->qh = x + 16;
        v->hshift = j;
        v->hmask = 1;
    }
}

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

/* Activation row r's term of weight block b from the block's integer sums of 16 products s0 (values 0-15) and s1
   (16-31), its scale d, sub-block scales sc and offset m: the float arithmetic of the portable and NEON dot
   products (one expression for both, so one rounding order and the same bits). */
static inline float block_term(int fmt, act_t a, int r, int b, int s0, int s1, float d, const int sc[2], float m) {
    const int16_t *sums = a.sa + r * (a.lda / 16) + 2 * b;
    const float da = a.da[r * (a.lda / 32) + b];
    if (is_mxfp4(fmt)) return da * d * (float)(s0 + s1);
    return da * (d * (float)(sc[0] * s0 + sc[1] * s1) + m * (float)(sums[0] + sums[1]));
}

/* A dot product of weight row n against up to 4 activation rows (out[r * ldo], r < nr), and qmm_dot_block's walk
   over such products for the portable and NEON builds. */
typedef void dot4_fn(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int K, act_t a, int nr, float *out,
                     int64_t ldo);
static inline void dot_rows_by4(dot4_fn *dot, int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K,
                                act_t a, int nr, float *out, int64_t ldo) {
    for (int n = n0; n < n1; n++)
        for (int r = 0; r < nr; r += 4) dot(fmt, w, row_bytes, n, K, act_from(a, r), nr - r < 4 ? nr - r : 4,
                                            out + r * ldo + n, ldo);
}

/* weight rows [n0, n1) against activation rows [0, nr) of a: out[r * ldo + n] (arch/x86, arch/arm or
   dot_scalar.c, whichever the build's ISA has) */
void qmm_dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                   int64_t ldo);
