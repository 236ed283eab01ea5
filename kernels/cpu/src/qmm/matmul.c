/* Quantized matmul over GGUF block formats for CPUs: y[m, n] = sum_k x[m, k] * W[n, k].

   Activations are quantized per row to int8 in blocks of 32 (one float scale per block, like ggml's Q8_0),
   with the sum of each 16 values kept for the formats whose weights have an offset. Weight rows are the GGUF
   block bytes as stored in the file. Each weight block of 32 values is unpacked to (unsigned or signed) bytes
   and multiplied with its activation block in integer SIMD (AVX2 maddubs, or AVX-512 VNNI dpbusd when this
   file is compiled with -DQMM_VNNI), or on ARM with NEON (-DQMM_NEON: sdot where the CPU has the dot-product
   extension, widening multiplies otherwise); without either everything runs in portable C.

   Threads (pool.c) split the output rows. Each output value depends only on its own activation row and
   weight row, so results do not depend on the batch or on the thread count. */

#include <stdint.h>
#include <stdlib.h>

#include "blocks.h"
#include "pool.h"
#include "qmatmul.h"

/* ---- the matmul: chunks of output rows as pool tasks ------------------------------------------------ */

typedef struct {
    int fmt, N, K, M, chunk;
    const uint8_t *w;
    int64_t row_bytes, ldo;
    act_t a;
    float *out;
} job_t;

enum { M_TILE = 64, TASKS_PER_THREAD = 8, MIN_CHUNK = 16, MAX_CHUNK = 512 };

/* weight rows [n0, n1) against M activation rows, tile by tile: the chunk's weight rows stay in cache while every
   tile of activation rows passes over them */
static void rows_task(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int M, float *out,
                      int64_t ldo) {
    for (int m0 = 0; m0 < M; m0 += M_TILE) {
        int mt = M - m0 < M_TILE ? M - m0 : M_TILE;
        qmm_dot_block(fmt, w, row_bytes, n0, n1, K, act_from(a, m0), mt, out + (int64_t)m0 * ldo, ldo);
    }
}

static void run_chunk(void *ctx, int c) {
    job_t *j = (job_t *)ctx;
    int n0 = c * j->chunk, n1 = n0 + j->chunk < j->N ? n0 + j->chunk : j->N;
    rows_task(j->fmt, j->w, j->row_bytes, n0, n1, j->K, j->a, j->M, j->out, j->ldo);
}

int qmm_needs_sums(int fmt) {
    return fmt == F_Q4_1 || fmt == F_Q5_1 || fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q4_0_R8 || fmt == F_Q4_1_R8 ||
           (is_x8(fmt) && fmt != F_Q6_K_X8 && fmt != F_Q8_0_X8 && fmt != F_MXFP4_X8);
}

void qmm_offset_sums(const float *da, const int16_t *sa, int64_t n, float *fs) {
    for (int64_t i = 0; i < n; i++) fs[i] = da[i] * (float)(sa[2 * i] + sa[2 * i + 1]);
}

void qmm_rows(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, const int8_t *qa, const float *da,
              const int16_t *sa, const float *fs, int M, float *out, int64_t ldo) {
    act_t a = {qa, da, sa, fs, K};
    rows_task(fmt, w, row_bytes, n0, n1, K, a, M, out, ldo);
}

/* y[m, n] (row stride ldo) = sum_k x[m, k] W[n, k] for the quantized activations (qa, da, sa) of M rows and a
   weight of N rows in format fmt (row_bytes bytes each, K values). */
void qmm_matmul(int fmt, const uint8_t *w, int64_t row_bytes, int N, int K, const int8_t *qa, const float *da,
                const int16_t *sa, int M, float *out, int64_t ldo) {
    float stack_fs[256], *fs = 0;
    if (qmm_needs_sums(fmt)) {
        int64_t n = (int64_t)M * (K / 32);
        fs = n <= 256 ? stack_fs : (float *)malloc(n * sizeof(float));
        if (!fs) abort();
        qmm_offset_sums(da, sa, n, fs);
    }
    /* Rows per task: a few tasks per thread, so that a thread the OS delays leaves little for the others to wait
       on, but not so many that taking tasks (one shared atomic each) costs much next to a small matmul. A
       multiple of 16 keeps the 4-row decode tiles whole. */
    int chunk = (N + TASKS_PER_THREAD * pool_threads() - 1) / (TASKS_PER_THREAD * pool_threads());
    chunk = (chunk + MIN_CHUNK - 1) / MIN_CHUNK * MIN_CHUNK;
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk > MAX_CHUNK ? MAX_CHUNK : chunk;
    job_t job = {fmt, N, K, M, chunk, w, row_bytes, ldo, {qa, da, sa, fs, K}, out};
    int chunks = (N + chunk - 1) / chunk;
    /* small jobs are not worth waking anyone */
    pool_run(run_chunk, &job, chunks, (int64_t)N * M * K >= (1 << 16));
    if (fs && fs != stack_fs) free(fs);
}

