/* bfloat16 matmuls for 16-bit (F16 / BF16) weight matrices, on CPUs with AVX-512 BF16 dot products.

   A weight [N, K] is packed once into panels of 16 rows; in a panel, k-pair j of the 16 rows fills one 512-bit
   register (lane i: row i's values 2j and 2j + 1), so one vdpbf16ps adds two k-steps of 16 outputs. Activations
   are rounded to bfloat16 (nearest even, as torch's .to(torch.bfloat16)); the sums and the output are float32,
   plus an optional float32 bias. A task is two panels (32 weight rows) against every activation row, 8 rows at a
   time (16 accumulators); tasks go to the native pool (pool.c).

   Only the x86 SIMD builds (QMM_AVX2) hold the kernel, compiled for AVX-512 BF16 by a target attribute;
   qmm_bf16_supported says whether this CPU runs it (elsewhere qmm_bf16_matmul refuses with -1). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_matmul.h"
#include "pool.h"

enum { BF16_PANEL = 16, BF16_MR = 8 };

/* uint16 values of a packed weight of N rows and K columns (panels of 16 rows, k padded to pairs, N to 32 rows) */
int64_t qmm_bf16_packed_size(int N, int K) {
    const int64_t panels = (N + 2 * BF16_PANEL - 1) / (2 * BF16_PANEL) * 2;
    return panels * ((K + 1) / 2) * 2 * BF16_PANEL;
}

/* Pack a bfloat16 weight w [N, K] (row stride ldw values) as qmm_bf16_matmul reads it; padding is zero. */
void qmm_bf16_pack(const uint16_t *w, int64_t ldw, int N, int K, uint16_t *dst) {
    const int pairs = (K + 1) / 2;
    const int64_t size = qmm_bf16_packed_size(N, K), panel = (int64_t)pairs * 2 * BF16_PANEL;
    memset(dst, 0, (size_t)size * sizeof(uint16_t));
    for (int n = 0; n < N; n++) {
        uint16_t *p = dst + (n / BF16_PANEL) * panel + 2 * (n % BF16_PANEL);
        for (int k = 0; k < K; k++) p[(int64_t)(k / 2) * 2 * BF16_PANEL + (k & 1)] = w[(int64_t)n * ldw + k];
    }
}

/* compilers that know the AVX-512 BF16 intrinsics (GCC 10+, clang 9+); older ones build the refusing stubs */
#if defined(__clang__)
#define BF16_COMPILER (__clang_major__ >= 9)
#elif defined(__GNUC__)
#define BF16_COMPILER (__GNUC__ >= 10)
#else
#define BF16_COMPILER 0
#endif

#if defined(QMM_AVX2) && defined(__x86_64__) && BF16_COMPILER
#include <immintrin.h>

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

int qmm_bf16_supported(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
    }
    return known;
}

/* M rows of x (float32, row stride ldx) as bfloat16 rows of `pairs` k-pairs (a zero past K when K is odd) */
BF16_TARGET static void round_rows(const float *x, int64_t ldx, int M, int K, int pairs, uint16_t *xb) {
    for (int m = 0; m < M; m++) {
        const float *row = x + (int64_t)m * ldx;
        uint16_t *o = xb + (int64_t)m * 2 * pairs;
        for (int k = 0; k < 2 * pairs; k += 32) {
            const int left = K - k, n = 2 * pairs - k < 32 ? 2 * pairs - k : 32;
            const __mmask16 lo = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __mmask16 hi = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, row + k + 16), _mm512_maskz_loadu_ps(lo, row + k));
            _mm512_mask_storeu_epi16(o + k, n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << n) - 1), (__m512i)v);
        }
    }
}

/* rows [0, mr) of xb against panels w0, w1 (32 weight rows from column n0; nv of them real): out (+ bias) */
BF16_TARGET static inline __attribute__((always_inline)) void tile(const int mr, const uint32_t *xb, int pairs,
                                                                   const uint32_t *w0, const uint32_t *w1,
                                                                   const float *bias, int n0, int nv, float *out,
                                                                   int64_t ldo) {
    __m512 acc0[BF16_MR], acc1[BF16_MR];
    for (int r = 0; r < mr; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int j = 0; j < pairs; j++) {
        const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + (int64_t)BF16_PANEL * j);
        const __m512bh b = (__m512bh)_mm512_loadu_si512(w1 + (int64_t)BF16_PANEL * j);
        for (int r = 0; r < mr; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[(int64_t)r * pairs + j]);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], a, xv);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], b, xv);
        }
    }
    const __mmask16 m0 = nv >= 16 ? 0xFFFF : (__mmask16)((1u << nv) - 1);
    const __mmask16 m1 = nv >= 32 ? 0xFFFF : nv > 16 ? (__mmask16)((1u << (nv - 16)) - 1) : 0;
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + n0 + 16) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(out + r * ldo + n0, m0, _mm512_add_ps(acc0[r], b0));
        _mm512_mask_storeu_ps(out + r * ldo + n0 + 16, m1, _mm512_add_ps(acc1[r], b1));
    }
}

typedef void (*tile_fn)(const uint32_t *, int, const uint32_t *, const uint32_t *, const float *, int, int, float *,
                        int64_t);
#define TILE(MR)                                                                                                \
    BF16_TARGET static void tile_##MR(const uint32_t *xb, int pairs, const uint32_t *w0, const uint32_t *w1,      \
                                      const float *bias, int n0, int nv, float *out, int64_t ldo) {             \
        tile(MR, xb, pairs, w0, w1, bias, n0, nv, out, ldo);                                                     \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
static const tile_fn TILES[BF16_MR] = {tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

typedef struct {
    const uint32_t *xb, *w;
    const float *bias;
    float *out;
    int64_t ldo;
    int M, N, pairs;
} bf16_job_t;

static void run_pair(void *ctx, int t) {
    const bf16_job_t *j = (const bf16_job_t *)ctx;
    const int64_t panel = (int64_t)j->pairs * BF16_PANEL; /* uint32 per panel */
    const uint32_t *w0 = j->w + 2 * t * panel, *w1 = w0 + panel;
    const int n0 = 2 * BF16_PANEL * t, nv = j->N - n0 < 2 * BF16_PANEL ? j->N - n0 : 2 * BF16_PANEL;
    for (int m = 0; m < j->M; m += BF16_MR) {
        const int mr = j->M - m < BF16_MR ? j->M - m : BF16_MR;
        TILES[mr - 1](j->xb + (int64_t)m * j->pairs, j->pairs, w0, w1, j->bias, n0, nv, j->out + m * j->ldo, j->ldo);
    }
}

/* out [M, N] (row stride ldo) = x [M, K] (float32, row stride ldx) @ W.T (+ bias [N]) for W packed by
   qmm_bf16_pack; 0, or -1 where this build or CPU has no kernel, -2 when scratch memory is short. */
int qmm_bf16_matmul(const float *x, int64_t ldx, int M, int K, const uint16_t *w, int N, const float *bias,
                    float *out, int64_t ldo) {
    if (!qmm_bf16_supported()) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int pairs = (K + 1) / 2;
    uint16_t *xb = (uint16_t *)malloc((size_t)M * 2 * pairs * sizeof(uint16_t));
    if (!xb) return -2;
    round_rows(x, ldx, M, K, pairs, xb);
    bf16_job_t job = {(const uint32_t *)xb, (const uint32_t *)w, bias, out, ldo, M, N, pairs};
    const int tasks = (N + 2 * BF16_PANEL - 1) / (2 * BF16_PANEL);
    pool_run(run_pair, &job, tasks, (int64_t)M * N * K >= (1 << 16));
    free(xb);
    return 0;
}

#else

int qmm_bf16_supported(void) { return 0; }

int qmm_bf16_matmul(const float *x, int64_t ldx, int M, int K, const uint16_t *w, int N, const float *bias,
                    float *out, int64_t ldo) {
    (void)x, (void)ldx, (void)M, (void)K, (void)w, (void)N, (void)bias, (void)out, (void)ldo;
    return -1;
}

#endif
