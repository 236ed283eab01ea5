/* The dot products in portable C (builds without AVX2 or NEON): the reference the SIMD kernels match. */
#if !defined(QMM_AVX2) && !defined(QMM_NEON)
#include "unpack.h"

static void dot_scalar(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int K, act_t a, int nr, float *out,
                       int64_t ldo) {
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

void qmm_dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                   int64_t ldo) {
    for (int n = n0; n < n1; n++)
        for (int r = 0; r < nr; r += 4) {
            int k = nr - r < 4 ? nr - r : 4;
            dot_scalar(fmt, w, row_bytes, n, K, act_from(a, r), k, out + r * ldo + n, ldo);
        }
}

#endif
