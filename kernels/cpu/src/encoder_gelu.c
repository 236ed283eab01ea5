/* GELU (erf form, as BERT's `gelu` and torch's F.gelu; or the tanh form, as SigLIP's `gelu_pytorch_tanh`) of an
   encoder's feed-forward up projection, with its bias added first, in place, on AVX-512 builds: x <- gelu(x + bias)
   over rows of `cols` values. erf by Abramowitz and
   Stegun 7.1.26 (erfc(z) = t (a1 + t (a2 + ...)) e^(-z^2), t = 1 / (1 + p z); erf's error under 1.5e-7), e^ by
   exp16.
   The tanh form as x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3), with e^ of -2|u| only (exp16's range).
   Rows go to the native pool in groups. Elsewhere qmm_bias_gelu(_tanh) refuses with -1 (the caller runs torch's). */

#include <stdint.h>

#include "encoder_gelu.h"
#include "pool.h"
#include "simd_exp.h"

#if defined(QMM_VNNI)

typedef struct {
    float *x;
    const float *bias;
    int64_t ld;
    int cols, rows, per, tanh_form;
} gelu_job_t;

static inline __m512 gelu16(__m512 v) {
    const __m512 z = _mm512_mul_ps(_mm512_abs_ps(v), _mm512_set1_ps(0.70710678118654752f));
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f),
                                                                         _mm512_set1_ps(1.0f)));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    /* erfc(z) = t p(t) e^(-z^2); 1 + erf(v / sqrt 2) is erfc(z) for v < 0 (no cancellation there) and 2 - erfc(z)
       otherwise: gelu = v (1 + erf) / 2 */
    const __m512 erfc = _mm512_mul_ps(_mm512_mul_ps(p, t), exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, z))));
    const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 one_plus_erf = _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(2.0f), erfc), erfc);
    return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(0.5f)), one_plus_erf);
}

static inline __m512 gelu_tanh16(__m512 v) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(cube, _mm512_set1_ps(0.044715f), v));
    const __m512 t = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(u))); /* e^(-2|u|) in (0, 1] */
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), t));
    const __mmask16 neg = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(v, _mm512_mask_mul_ps(inv, neg, inv, t)); /* sigmoid(2u): 1 / (1 + t), or t / (1 + t) */
}

static void gelu_rows(void *ctx, int task) {
    const gelu_job_t *j = (const gelu_job_t *)ctx;
    const int r1 = (task + 1) * j->per < j->rows ? (task + 1) * j->per : j->rows;
    for (int r = task * j->per; r < r1; r++) {
        float *row = j->x + (int64_t)r * j->ld;
        for (int c = 0; c < j->cols; c += 16) {
            const __mmask16 m = j->cols - c >= 16 ? 0xFFFF : (__mmask16)((1u << (j->cols - c)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(m, row + c);
            if (j->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, j->bias + c));
            _mm512_mask_storeu_ps(row + c, m, j->tanh_form ? gelu_tanh16(v) : gelu16(v));
        }
    }
}

static int bias_gelu(float *x, int64_t ld, int rows, int cols, const float *bias, int tanh_form) {
    if (rows <= 0 || cols <= 0) return 0;
    const int per = (16384 + cols - 1) / cols; /* about 16K values a task */
    gelu_job_t j = {x, bias, ld, cols, rows, per, tanh_form};
    pool_run(gelu_rows, &j, (rows + per - 1) / per, (int64_t)rows * cols >= 32768);
    return 0;
}

int qmm_bias_gelu(float *x, int64_t ld, int rows, int cols, const float *bias) {
    return bias_gelu(x, ld, rows, cols, bias, 0);
}

int qmm_bias_gelu_tanh(float *x, int64_t ld, int rows, int cols, const float *bias) {
    return bias_gelu(x, ld, rows, cols, bias, 1);
}

#else

int qmm_bias_gelu(float *x, int64_t ld, int rows, int cols, const float *bias) {
    (void)x, (void)ld, (void)rows, (void)cols, (void)bias;
    return -1;
}

int qmm_bias_gelu_tanh(float *x, int64_t ld, int rows, int cols, const float *bias) {
    (void)x, (void)ld, (void)rows, (void)cols, (void)bias;
    return -1;
}

#endif
