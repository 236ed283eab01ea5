/* AVX2 / VNNI dot products over _X8 bands: 8 weight rows in the lanes of a register (16 in a 512-bit one). */
#if defined(QMM_AVX2)
#include "simd.h"
#include "dot.h"

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

/* Block j's 8 rows' sub-block scales (int32 lanes) and minimum term (-dmin x min, float lanes) of a Q4_K / Q5_K
   _X8 group whose x8_scales_mins are sc, mn and whose -dmin is nmv. */
static inline __m256i x8_scale32(const uint8_t sc[64], int j) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * j)));
}
static inline __m256 x8_min_term(const uint8_t mn[64], int j, __m256 nmv) {
    return _mm256_mul_ps(nmv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 8 * j)))));
}

/* Run c (values 4c .. 4c + 3) of block j of a Q4_K / Q5_K _X8 group at g: the 8 rows' unsigned quants, 4 bits (Q5_K:
   | the fifth bit << 4). */
static inline __attribute__((always_inline)) __m256i x8_k_run(int fmt, const uint8_t *g, int j, int c) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)(g + (fmt == F_Q4_K_X8 ? 128 : 384) + 256 * (j / 2) + 32 * c));
    const __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(w, 4) : w, _mm256_set1_epi8(0x0F));
    if (fmt != F_Q5_K_X8) return u;
    const __m256i h = _mm256_loadu_si256((const __m256i *)(g + 128 + 32 * c));
    return _mm256_or_si256(u, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), 4),
                                               _mm256_set1_epi8(0x10)));
}

/* Run c (values 4c .. 4c + 3) of block j of a Q6_K _X8 group at g: the 8 rows' unsigned 6-bit quants. */
static inline __attribute__((always_inline)) __m256i x8_q6_run(const uint8_t *g, int j, int c) {
    const __m256i lw = _mm256_loadu_si256((const __m256i *)(g + q6x8_lo(j / 2) + 32 * c));
    const __m256i hw = _mm256_loadu_si256((const __m256i *)(g + q6x8_hi(j / 4) + 32 * c));
    const int part = j % 4;
    const __m256i hi = part == 0 ? _mm256_slli_epi16(hw, 4)
                     : part == 1 ? _mm256_slli_epi16(hw, 2)
                     : part == 2 ? hw
                                 : _mm256_srli_epi16(hw, 2);
    return _mm256_or_si256(_mm256_and_si256(j & 1 ? _mm256_srli_epi16(lw, 4) : lw, _mm256_set1_epi8(0x0F)),
                           _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
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
    } else if (fmt == F_Q8_0_X8) {
        /* signed weights: the sign trick, a madd per run (2 x 128 x 127 fills int16). VNNI (dpbusd): the weights
           offset to unsigned (q + 128, an xor of the sign bit) straight into dpbusd, then 128 x the block's activation
           sum taken off: the same integer sum q . a, so the same bits, in one instruction per run and row instead of
           four */
        const __m256i ones = _mm256_set1_epi16(1), x80 = _mm256_set1_epi8((char)0x80), n128 = _mm256_set1_epi16(128);
        (void)x80, (void)n128;
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = band + (size_t)b * gb;
            prefetch_ahead(g, gb);
            const __m256 dv = cvt8h(g);
            __m256i i32[NX];
            for (int r = 0; r < nr; r++) i32[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * c));
#if defined(QMM_VNNI)
                if (dpbusd) {
                    const __m256i u = _mm256_xor_si256(q, x80);
                    for (int r = 0; r < nr; r++) {
                        i32[r] = _mm256_dpbusd_epi32(i32[r], u, A4(r, b, c));
                        PIN(i32[r]);
                    }
                    continue;
                }
#endif
                const __m256i aq = _mm256_sign_epi8(q, q);
                for (int r = 0; r < nr; r++) {
                    const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(A4(r, b, c), q));
                    i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(p, ones));
                    PIN(i32[r]);
                }
            }
            for (int r = 0; r < nr; r++) {
                if (dpbusd)
                    i32[r] = _mm256_sub_epi32(i32[r], _mm256_madd_epi16(bcast4(a.sa + r * (a.lda / 16) + 2 * b), n128));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r]), _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))), acc[r]);
            }
        }
    } else if (fmt == F_Q4_K_X8 || fmt == F_Q5_K_X8) {
        /* maddubs: Q4_K sums all 8 runs of 4 values in int16 (8 x 2 x 15 x 127), then one madd with the rows'
           sub-block scales; Q5_K a madd every 2 runs. Both sums start at zero and every run adds (no first-run case).
           VNNI (dpbusd): a lane's (a row's) 4 products go straight into int32, so the block's 8 runs accumulate
           without int16 partial sums or madds, and the sub-block scale multiplies the block's sum once: the same
           integers, so the same bits. */
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g = band + (size_t)sb * gb;
            const __m256 dv = cvt8h(g), nmv = _mm256_sub_ps(_mm256_setzero_ps(), cvt8h(g + 16));
            __attribute__((aligned(32))) uint8_t sc[64], mn[64];
            x8_scales_mins(g + 32, sc, mn);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g + j * (gb / 8), gb / 8);
                const __m256i s32 = x8_scale32(sc, j), scv = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
                const __m256 mnv = x8_min_term(mn, j, nmv);
                __m256i s16[NX], i32[NX];
                for (int r = 0; r < nr; r++) s16[r] = i32[r] = _mm256_setzero_si256();
#if defined(QMM_VNNI)
                if (dpbusd) {
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        const __m256i u = x8_k_run(fmt, g, j, c);
                        for (int r = 0; r < nr; r++) {
                            i32[r] = _mm256_dpbusd_epi32(i32[r], u, A4(r, b, c));
                            PIN(i32[r]);
                        }
                    }
                    for (int r = 0; r < nr; r++) i32[r] = _mm256_mullo_epi32(i32[r], s32);
                } else
#endif
                {
#pragma GCC unroll 4
                    for (int c = 0; c < 8; c += 2) {
                        const __m256i u0 = x8_k_run(fmt, g, j, c), u1 = x8_k_run(fmt, g, j, c + 1);
                        for (int r = 0; r < nr; r++) {
                            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, A4(r, b, c)),
                                                               _mm256_maddubs_epi16(u1, A4(r, b, c + 1)));
                            if (fmt == F_Q5_K_X8) {
                                i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(p, scv));
                                PIN(i32[r]);
                            } else {
                                s16[r] = _mm256_add_epi16(s16[r], p);
                                PIN(s16[r]);
                            }
                        }
                    }
                    if (fmt == F_Q4_K_X8)
                        for (int r = 0; r < nr; r++) i32[r] = _mm256_madd_epi16(s16[r], scv);
                }
                for (int r = 0; r < nr; r++) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r]), _mm256_mul_ps(dv, _mm256_set1_ps(DA(r, b))),
                                             acc[r]);
                    acc[r] = _mm256_fmadd_ps(mnv, _mm256_set1_ps(FS(r, b)), acc[r]);
                }
            }
        }
    } else { /* Q6_K: unsigned 6-bit q, the -32 taken off as 32 * sum(scale * sums of 16 activations) */
        const __m256i dup_lo = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5,
                                                4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
        const __m256i dup_hi = _mm256_add_epi8(dup_lo, _mm256_set1_epi8(2));
        for (int sb = 0; sb < nb / 8; sb++) {
            const uint8_t *g = band + (size_t)sb * gb;
            const __m256 dv = cvt8h(g);
            for (int j = 0; j < 8; j++) {
                const int b = 8 * sb + j;
                prefetch_ahead(g + j * (gb / 8), gb / 8);
                /* int16 lanes 2r, 2r + 1: row r's scales of values 0-15 and 16-31 */
                const __m256i scp = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g + 16 + 16 * j)));
                __m256i i32[NX];
                for (int r = 0; r < nr; r++) i32[r] = _mm256_setzero_si256();
#if defined(QMM_VNNI)
                if (dpbusd) { /* the runs of values 0-15 and 16-31 summed by dpbusd apart (their scales differ) */
                    const __m256i se = _mm256_srai_epi32(_mm256_slli_epi32(scp, 16), 16), so = _mm256_srai_epi32(scp, 16);
                    __m256i hi32[NX];
                    for (int r = 0; r < nr; r++) hi32[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        const __m256i u = x8_q6_run(g, j, c);
                        for (int r = 0; r < nr; r++) {
                            if (c < 4) {
                                i32[r] = _mm256_dpbusd_epi32(i32[r], u, A4(r, b, c));
                                PIN(i32[r]);
                            } else {
                                hi32[r] = _mm256_dpbusd_epi32(hi32[r], u, A4(r, b, c));
                                PIN(hi32[r]);
                            }
                        }
                    }
                    for (int r = 0; r < nr; r++)
                        i32[r] = _mm256_add_epi32(_mm256_mullo_epi32(i32[r], se), _mm256_mullo_epi32(hi32[r], so));
                } else
#endif
                { /* each scale duplicated for the madd; two runs of 4 values: at most 2 x 2 x 63 x 127 in int16 */
                    const __m256i sce = _mm256_shuffle_epi8(scp, dup_lo), sco = _mm256_shuffle_epi8(scp, dup_hi);
#pragma GCC unroll 4
                    for (int c = 0; c < 8; c += 2) {
                        const __m256i u0 = x8_q6_run(g, j, c), u1 = x8_q6_run(g, j, c + 1), scv = c < 4 ? sce : sco;
                        for (int r = 0; r < nr; r++) {
                            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, A4(r, b, c)),
                                                               _mm256_maddubs_epi16(u1, A4(r, b, c + 1)));
                            i32[r] = _mm256_add_epi32(i32[r], _mm256_madd_epi16(p, scv));
                            PIN(i32[r]);
                        }
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

/* M(F, NR) for NR = 1 .. 8: one specialization of a kernel per activation-row count */
#define EACH_NR(M, F) M(F, 1) M(F, 2) M(F, 3) M(F, 4) M(F, 5) M(F, 6) M(F, 7) M(F, 8)
/* format F's row of a table of those specializations, named NAME_F_NR */
#define NR_ROW(NAME, F)                                                                                     \
    [F] = {NAME##_##F##_1, NAME##_##F##_2, NAME##_##F##_3, NAME##_##F##_4,                                  \
           NAME##_##F##_5, NAME##_##F##_6, NAME##_##F##_7, NAME##_##F##_8}

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

/* The 32-bit lane sums over one activation block at qa (32 int8 values, 4 a lane group) of the 8 weight runs u:
   sum over c of u[c] . qa[4c .. 4c + 3], in two chains (integers: the order does not change the sum). */
static inline __attribute__((always_inline)) __m512i dpbusd8(const __m512i u[8], const int8_t *qa) {
    __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], bcast4z(qa));
    __m512i f = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], bcast4z(qa + 4));
    for (int c = 2; c < 8; c += 2) {
        e = _mm512_dpbusd_epi32(e, u[c], bcast4z(qa + 4 * c));
        f = _mm512_dpbusd_epi32(f, u[c + 1], bcast4z(qa + 4 * c + 4));
    }
    return _mm512_add_epi32(e, f);
}

/* Bands at w and w + band_bytes (rows n .. n + 15) against nr <= NX activation rows: out[r * ldo + i], i < 16. */
static inline __attribute__((always_inline)) void dot_x16(int fmt, const uint8_t *w, int64_t band_bytes, int K,
                                                          act_t a, int nr, float *out, int64_t ldo) {
    __m512 acc[NX];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    const int nb = K / 32, gb = 8 * BLOCK_BYTES[fmt];
    const __m512i low4 = _mm512_set1_epi8(0x0F);
#define ROW(r, b) (a.qa + (r) * a.lda + (b) * 32) /* activation row r's block b */
#define A4Z(r, b, c) bcast4z(ROW(r, b) + 4 * (c))
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
                const __m512i corr = _mm512_madd_epi16(bcast4z(a.sa + r * (a.lda / 16) + 2 * b), n128);
                const __m512i i32 = _mm512_sub_epi32(dpbusd8(u, ROW(r, b)), corr);
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
                    const __m512i i32 = _mm512_mullo_epi32(dpbusd8(u, ROW(r, b)), s32);
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
#undef ROW
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

typedef void (*x16_fn)(const uint8_t *, int64_t, int, act_t, float *, int64_t);
#define X16_NR(F, NR)                                                                                       \
    static void dot_x16_##F##_##NR(const uint8_t *w, int64_t bb, int K, act_t a, float *out, int64_t ldo) { \
        dot_x16(F, w, bb, K, a, NR, out, ldo);                                                              \
    }
#define X16_FMT(F) EACH_NR(X16_NR, F)
X16_FMT(F_Q4_K_X8)
X16_FMT(F_Q5_K_X8)
X16_FMT(F_Q6_K_X8)
X16_FMT(F_Q8_0_X8)
#define X16_ROW(F) NR_ROW(dot_x16, F)
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
#define X8_FMT(F) EACH_NR(X8_NR, F)
X8_FMT(F_Q4_K_X8)
X8_FMT(F_Q6_K_X8)
X8_FMT(F_Q5_K_X8)
X8_FMT(F_Q4_0_X8)
X8_FMT(F_Q4_1_X8)
X8_FMT(F_Q8_0_X8)
X8_FMT(F_Q5_0_X8)
X8_FMT(F_Q5_1_X8)
X8_FMT(F_MXFP4_X8)
#define X8_ROW(F) NR_ROW(dot_x8, F)
static const x8_fn X8[N_FORMATS][NX] = {X8_ROW(F_Q4_K_X8), X8_ROW(F_Q6_K_X8), X8_ROW(F_Q5_K_X8), X8_ROW(F_Q4_0_X8),
                                        X8_ROW(F_Q4_1_X8), X8_ROW(F_Q8_0_X8), X8_ROW(F_Q5_0_X8), X8_ROW(F_Q5_1_X8),
                                        X8_ROW(F_MXFP4_X8)};

void qmm_dot_bands(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                  int64_t ldo) {
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
}

#endif
