/* The AVX2 pieces the row and band dot products share (inline). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../../blocks.h"

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
