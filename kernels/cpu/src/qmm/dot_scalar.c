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
            acc[r] += block_term(fmt, a, r, b, s0, s1, d, sc, m);
        }
    }
    for (int r = 0; r < nr; r++) out[r * ldo] = acc[r];
}

void qmm_dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                   int64_t ldo) {
    dot_rows_by4(dot_scalar, fmt, w, row_bytes, n0, n1, K, a, nr, out, ldo);
}

#endif
