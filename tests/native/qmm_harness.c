/* Runs the quantized matmul of kernels/cpu/src/qmm on inputs read from stdin, for testing a build this machine
   cannot load (another architecture, under an emulator). Input: int32 fmt, N, K, M, repack (0/1); N weight rows of
   GGUF block bytes; M x K float32 activations. Output: the M x N float32 results of one call over all M rows,
   then the same rows computed one call per row. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "pool.h"
#include "qmatmul.h"

static void need(size_t got, size_t want) {
    if (got != want) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
}

int main(void) {
    int32_t hdr[5];
    need(fread(hdr, sizeof hdr[0], 5, stdin), 5);
    int fmt = hdr[0], N = hdr[1], K = hdr[2], M = hdr[3];
    int64_t row_bytes = (int64_t)K / qmm_block_values(fmt) * qmm_block_bytes(fmt);
    uint8_t *w = malloc((size_t)N * row_bytes), *packed = malloc((size_t)N * row_bytes);
    float *x = malloc(sizeof(float) * M * K), *out = malloc(sizeof(float) * M * N);
    int8_t *qa = malloc((size_t)M * K);
    float *da = malloc(sizeof(float) * M * (K / 32));
    int16_t *sa = malloc(sizeof(int16_t) * M * (K / 16));
    need(fread(w, 1, (size_t)N * row_bytes, stdin), (size_t)N * row_bytes);
    need(fread(x, sizeof(float), (size_t)M * K, stdin), (size_t)M * K);
    if (hdr[4] && qmm_repacked_format(fmt, N) >= 0) {
        qmm_repack(fmt, w, row_bytes, N, K, packed);
        fmt = qmm_repacked_format(fmt, N);
        w = packed;
    }
    qmm_set_threads(2);
    qmm_quantize(x, 0, K, M, K, qa, da, sa);
    qmm_matmul(fmt, w, row_bytes, N, K, qa, da, sa, M, out, N);
    fwrite(out, sizeof(float), (size_t)M * N, stdout);
    for (int r = 0; r < M; r++) {
        qmm_matmul(fmt, w, row_bytes, N, K, qa + (size_t)r * K, da + (size_t)r * (K / 32), sa + (size_t)r * (K / 16), 1,
                   out + (size_t)r * N, N);
    }
    fwrite(out, sizeof(float), (size_t)M * N, stdout);
    return 0;
}
