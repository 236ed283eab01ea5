/* AVX2 / VNNI dot products over weight rows in the GGUF or _R8 layout (dot_simd), in tiles of 2 or 1 weight rows x 4 activation rows, or 1 x 1. */
#if defined(QMM_AVX2)
#include "simd.h"
#include "dot.h"

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

void qmm_dot_rows(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                  int64_t ldo) {
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

#endif
