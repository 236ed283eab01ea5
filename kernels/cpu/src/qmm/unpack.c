/* Weight rows dequantized to float32 (embedding lookups). */
#include "qmatmul.h"
#include "unpack.h"

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

