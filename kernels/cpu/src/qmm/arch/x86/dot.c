/* The dot products in AVX2 (maddubs) and AVX-512 VNNI (dpbusd): bands.c for the _X8 layouts, rows.c for the
   others. */
#if defined(QMM_AVX2)
#include "dot.h"

/* weight rows [n0, n1) against activation rows [0, nr) */
void qmm_dot_block(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                   int64_t ldo) {
    if (is_x8(fmt))
        qmm_dot_bands(fmt, w, row_bytes, n0, n1, K, a, nr, out, ldo);
    else
        qmm_dot_rows(fmt, w, row_bytes, n0, n1, K, a, nr, out, ldo);
}

#endif
