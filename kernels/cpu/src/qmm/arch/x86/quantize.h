/* One activation block quantized in AVX2 (quantize.c's hot loop, inlined there). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
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
