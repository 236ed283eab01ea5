/* Gated DeltaNet (Qwen3.5 / 3.6 linear attention) on the CPU, float32: the causal depthwise convolution with SiLU,
   and the gated delta rule, over a flat ragged batch whose states live in slot-indexed pools
   (kernels/gated_delta.py is the torch twin and says what is computed).

   The rule runs token by token for prompts too: per token and value head it is about 8 Dk Dv flops (decay, read,
   write, query) on a state that stays in cache (a task sweeps a block of 64 columns (AVX-512) or 32 of one head's
   state, 32 or 16 KiB at Dk = 128, through all the sequence's tokens), about 4 MFLOP a token at Qwen3.5's 32 heads
   of 128 x 128; at Qwen3.5-0.8B's 16 heads it was about 12% of a prefill's CPU time before the 64-column block
   (which made it about 1.5x faster on AVX-512). The chunked form does no fewer flops at these head sizes (its matmuls
   replace the per-token sweeps, and the chunk-local attention and triangular solve come on top); it pays where
   matmuls are much faster than vector loops (a GPU), not here: measured against the chunked torch twin in
   docs/PERFORMANCE.md.

   A conv task is a block of one sequence's tokens (each output a fixed sum of K products, then SiLU); a rule task
   owns a block of columns of a (sequence, value head) state and steps through the sequence's tokens in order. So
   the result does not depend on the thread count or on what else is in the batch. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gated_delta.h"
#include "pool.h"
#include "subnormals.h"

enum { CONV_BLOCK = 64, CONV_TOKENS = 16, CONV_MAX_K = 16, GDN_MAX_DIM = 512 };
/* the rule's column block: 64 columns (four 16-wide vectors per state row, o and kv in 8 of the 32 registers, more
   independent FMA chains) where the build has AVX-512; 32 where there are 16 vector registers */
#if defined(QMM_VNNI)
enum { COL_BLOCK = 64 };
#else
enum { COL_BLOCK = 32 };
#endif

/* out[i] = 1 / (1 + expf(-x[i])) for n values, with expf by range reduction (x = k ln2 + r) and a degree-6
   polynomial (within a few ulp of expf; inputs clamped to [-87, 88], where the sigmoid is 0 or 1 to float precision
   anyway). Each value on its own: the same bits whatever n and the lanes. AVX2 builds run it 8 lanes at a time in
   intrinsics (gcc does not vectorize the clamps' branches without -fno-trapping-math), the tail through a padded
   vector, so every value takes the same instructions; elsewhere plain C. */
#if defined(QMM_AVX2)
#include <immintrin.h>

static inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 v = _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
    v = _mm256_max_ps(_mm256_set1_ps(-87.0f), v); /* -87 > v ? -87 : v (a NaN stays) */
    v = _mm256_min_ps(_mm256_set1_ps(88.0f), v);  /* 88 < v ? 88 : v */
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 k = _mm256_sub_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187e-06f),
                                      _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), v));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, one);
    p = _mm256_fmadd_ps(p, r, one);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_div_ps(one, _mm256_fmadd_ps(p, _mm256_castsi256_ps(bits), one));
}

static inline void sigmoid_n(const float *restrict x, int n, float *restrict out) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, sigmoid8(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float pad[8] = {0};
        memcpy(pad, x + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(pad, sigmoid8(_mm256_loadu_ps(pad)));
        memcpy(out + i, pad, sizeof(float) * (size_t)(n - i));
    }
}
#else
static inline void sigmoid_n(const float *restrict x, int n, float *restrict out) {
    for (int i = 0; i < n; i++) {
        float v = -x[i];
        v = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
        const float k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
        const float r = (v - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
        float p = 1.0f / 720.0f;
        p = p * r + 1.0f / 120.0f;
        p = p * r + 1.0f / 24.0f;
        p = p * r + 1.0f / 6.0f;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        const int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, 4);
        out[i] = 1.0f / (1.0f + p * scale);
    }
}
#endif

/* sum of x[i]^2 over n values in 16 running sums (a vector's worth of lanes, whatever the build) added pairwise at
   the end: a fixed order for a given n */
static inline float sum_squares(const float *restrict x, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[i + j] * x[i + j];
    for (; i < n; i++) acc[i & 15] += x[i] * x[i];
    for (int w = 8; w; w >>= 1)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

typedef struct {
    const float *x, *wt, *bias; /* wt: the weight transposed, [K, C]; bias [C] or NULL */
    int64_t ldx, slot_stride;
    int C, K, silu;
    const int32_t *cu, *slots, *task_seq, *task_t0; /* task i: tokens task_t0[i] .. + CONV_TOKENS of one sequence */
    const float *state;
    float *out;
} conv_t;

/* tokens t0 .. t1 - 1 of sequence b, channels c0 .. c0 + n - 1 */
static void conv_tokens(const conv_t *a, int b, int t0, int t1, int c0, int n, int K) {
    const int C = a->C, start = a->cu[b];
    const float *state = a->state + (int64_t)a->slots[b] * a->slot_stride; /* [K - 1, C] */
    for (int t = t0; t < t1; t++) {
        float acc[CONV_BLOCK], sig[CONV_BLOCK];
        for (int c = 0; c < n; c++) acc[c] = 0.0f;
        for (int j = 0; j < K; j++) {
            const int p = t - (K - 1) + j; /* input position; negative ones are in the state */
            const float *in = p < 0 ? state + (int64_t)(K - 1 + p) * C + c0 : a->x + (start + p) * a->ldx + c0;
            const float *restrict w = a->wt + (int64_t)j * C + c0;
            for (int c = 0; c < n; c++) acc[c] += w[c] * in[c];
        }
        if (a->bias)
            for (int c = 0; c < n; c++) acc[c] += a->bias[c0 + c];
        float *o = a->out + (int64_t)(start + t) * C + c0;
        if (!a->silu) {
            memcpy(o, acc, sizeof(float) * (size_t)n);
            continue;
        }
        sigmoid_n(acc, n, sig);
        for (int c = 0; c < n; c++) o[c] = acc[c] * sig[c]; /* silu */
    }
}

/* a block of up to CONV_TOKENS tokens of one sequence, all channels (rows read front to back, a channel block at
   a time); inputs before the sequence's first new token come from its conv state, which this pass only reads */
static void conv_block(void *ctx, int task) {
    const conv_t *a = (const conv_t *)ctx;
    const int b = a->task_seq[task], len = a->cu[b + 1] - a->cu[b];
    const int t0 = a->task_t0[task], t1 = t0 + CONV_TOKENS < len ? t0 + CONV_TOKENS : len;
    for (int c0 = 0; c0 < a->C; c0 += CONV_BLOCK) {
        const int n = a->C - c0 < CONV_BLOCK ? a->C - c0 : CONV_BLOCK;
        conv_tokens(a, b, t0, t1, c0, n, a->K);
    }
}

/* a conv state st [K - 1, C] after `len` more input rows x (ldx apart): row r holds input position
   len - (K - 1) + r; from the old state (only when len < K - 1) it is row r + len, which no earlier r overwrote */
static void push_conv_inputs(float *st, const float *x, int64_t ldx, int len, int C, int K) {
    for (int r = 0; r < K - 1; r++) {
        const int p = len - (K - 1) + r;
        memmove(st + (int64_t)r * C, p < 0 ? st + (int64_t)(r + len) * C : x + p * ldx, sizeof(float) * C);
    }
}

/* qmm_causal_conv, whose conv state of sequence b then holds the last K - 1 inputs of its first keep[b] rows
   (keep NULL: of all its rows) */
static void causal_conv(const float *x, int64_t ldx, int C, int K, const float *weight, const float *bias,
                        const int32_t *cu, int B, float *state, int64_t slot_stride, const int32_t *slots, int silu,
                        const int32_t *keep, float *out) {
    int tasks = 0;
    for (int b = 0; b < B; b++) tasks += (cu[b + 1] - cu[b] + CONV_TOKENS - 1) / CONV_TOKENS;
    int32_t *task_seq = malloc(sizeof(int32_t) * 2 * (size_t)(tasks ? tasks : 1)), *task_t0 = task_seq + tasks;
    float *wt = malloc(sizeof(float) * (size_t)C * K); /* every task reads the taps a channel block at a time */
    if (!task_seq || !wt) abort();
    for (int c = 0; c < C; c++)
        for (int j = 0; j < K; j++) wt[(int64_t)j * C + c] = weight[(int64_t)c * K + j];
    for (int b = 0, i = 0; b < B; b++)
        for (int t0 = 0; t0 < cu[b + 1] - cu[b]; t0 += CONV_TOKENS, i++) {
            task_seq[i] = b;
            task_t0[i] = t0;
        }
    conv_t a = {x, wt, bias, ldx, slot_stride, C, K, silu, cu, slots, task_seq, task_t0, state, out};
    pool_run(conv_block, &a, tasks, (int64_t)cu[B] * C * K >= 32768);
    free(task_seq);
    free(wt);
    for (int b = 0; b < B; b++)
        push_conv_inputs(state + (int64_t)slots[b] * slot_stride, x + cu[b] * ldx, ldx,
                         keep ? keep[b] : cu[b + 1] - cu[b], C, K);
}

/* out [T, C] = the causal depthwise conv of x [T, C] (rows ldx apart) with weight [C, K], plus bias [C] when not
   NULL, then SiLU when silu; sequence b owns rows cu[b] .. cu[b + 1] - 1 and continues from its conv state [K - 1, C]
   at state + slots[b] * slot_stride, which then holds its last K - 1 inputs. */
void qmm_causal_conv(const float *x, int64_t ldx, int C, int K, const float *weight, const float *bias,
                     const int32_t *cu, int B, float *state, int64_t slot_stride, const int32_t *slots, int silu,
                     float *out) {
    causal_conv(x, ldx, C, K, weight, bias, cu, B, state, slot_stride, slots, silu, NULL, out);
}

/* qmm_causal_conv with SiLU and no bias: the Gated DeltaNet's conv. */
void qmm_gdn_conv(const float *x, int64_t ldx, int C, int K, const float *weight, const int32_t *cu, int B,
                  float *state, int64_t slot_stride, const int32_t *slots, float *out) {
    qmm_causal_conv(x, ldx, C, K, weight, 0, cu, B, state, slot_stride, slots, 1, out);
}

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t ldq, ldk, ldv;
    int Hk, Hv, Dk, Dv, tiled, col_blocks;
    const int32_t *cu, *slots;
    float *state, *out;
    int64_t slot_stride;
    float scale;
    const int32_t *keep; /* per sequence: its rows that advance the state in place (NULL: all) */
} rule_t;

/* x * scale / sqrt(sum x^2 + 1e-6) */
static void l2norm(const float *restrict x, int n, float scale, float *restrict out) {
    const float f = scale / sqrtf(sum_squares(x, n) + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * f;
}

/* token t's normalized q and k for value head h */
static inline void token_qk(const rule_t *a, int t, int h, float *qn, float *kn) {
    const int hk = a->tiled ? h % a->Hk : h / (a->Hv / a->Hk);
    l2norm(a->q + t * a->ldq + (int64_t)hk * a->Dk, a->Dk, a->scale, qn);
    l2norm(a->k + t * a->ldk + (int64_t)hk * a->Dk, a->Dk, 1.0f, kn);
}

/* The state's rows are Dv floats apart (512 bytes at Dv = 128), a block's part of each one or two cache lines: the
   hardware's prefetchers, which stay within a 4 KiB page (8 rows), miss most of a block whose state comes from
   memory (every decode step: a step's states are far larger than the caches), so the first sweep asks for the rows
   PREFETCH_ROWS ahead itself. */
enum { PREFETCH_ROWS = 8 };

static inline void prefetch_cols(const float *row, int n) {
    for (int c = 0; c < n; c += 16) __builtin_prefetch(row + c, 1, 3);
}

/* S[i][c] += k[i] * delta[c], then o[c] += S[i][c] * q[i], for rows i < Dk in order and columns c < n of a state
   slice S whose rows are ld floats apart. */
static inline __attribute__((always_inline)) void write_and_query(float *restrict S, int64_t ld, int Dk, int n,
                                                                  const float *k, const float *q, const float *delta,
                                                                  float *restrict o) {
    for (int i = 0; i < Dk; i++) {
        float *restrict row = S + (int64_t)i * ld;
        const float ki = k[i], qi = q[i];
        for (int c = 0; c < n; c++) {
            const float r = row[c] + ki * delta[c];
            row[c] = r;
            o[c] += r * qi;
        }
    }
}

/* S *= decay, then kv[c] = sum over rows i of S[i][c] * k[i], for rows i < Dk in order and columns c < n of a state
   slice whose rows are ld floats apart (asking for the rows PREFETCH_ROWS ahead when `prefetch`) */
static inline __attribute__((always_inline)) void decay_and_read(float *restrict S, int64_t ld, int Dk, int n,
                                                                 float decay, const float *k, float *restrict kv,
                                                                 int prefetch) {
    for (int c = 0; c < n; c++) kv[c] = 0.0f;
    for (int i = 0; i < Dk; i++) {
        float *restrict row = S + (int64_t)i * ld;
        const float ki = k[i];
        if (prefetch && i + PREFETCH_ROWS < Dk) prefetch_cols(row + (int64_t)PREFETCH_ROWS * ld, n);
        for (int c = 0; c < n; c++) {
            const float r = row[c] * decay;
            row[c] = r;
            kv[c] += r * ki;
        }
    }
}

/* a copy [Dk, n] (rows n apart) of a state slice whose rows are ld floats apart: where a step's draft rows run */
static float *copy_block(const float *S, int64_t ld, int Dk, int n) {
    float *out = malloc(sizeof(float) * (size_t)Dk * n);
    if (!out) abort();
    for (int i = 0; i < Dk; i++) memcpy(out + (int64_t)i * n, S + (int64_t)i * ld, sizeof(float) * n);
    return out;
}

/* Columns c0 .. c0 + n - 1 of one (sequence, value head)'s state S [Dk, Dv] through all the sequence's tokens.
   A column of S evolves on its own (its delta, its output value), so a block of columns is a task: with n =
   COL_BLOCK its Dk x n floats stay in L1 and kv / o in registers. The write-and-query sweep of token t and the
   decay-and-read sweep of token t + 1 are one pass over the block (the same operations in the same order as two
   passes, so the same bits). Rows from the sequence's keep on (a verification step's drafts) run on a copy of the
   block, so the state in place stops after the kept rows. */
static inline __attribute__((always_inline)) void rule_cols(const rule_t *a, int b, int h, int c0, int n) {
    const int Dk = a->Dk, Dv = a->Dv, t0 = a->cu[b], t1 = a->cu[b + 1];
    if (t0 == t1) return;
    const int kend = a->keep ? t0 + a->keep[b] : t1; /* the first row that runs on the copy */
    float *restrict S = a->state + (int64_t)a->slots[b] * a->slot_stride + (int64_t)h * Dk * Dv + c0;
    float *copy = NULL;
    int64_t ld = Dv;
    float qn[2][GDN_MAX_DIM], kn[2][GDN_MAX_DIM];
    float kv[COL_BLOCK], o[COL_BLOCK], delta[COL_BLOCK];
    int cur = 0;
    for (int i = 0; i < PREFETCH_ROWS && i < Dk; i++) prefetch_cols(S + (int64_t)i * Dv, n);
    if (kend == t0) {
        S = copy = copy_block(S, ld, Dk, n);
        ld = n;
    }
    token_qk(a, t0, h, qn[0], kn[0]);
    float decay = expf(a->g[(int64_t)t0 * a->Hv + h]);
    decay_and_read(S, ld, Dk, n, decay, kn[0], kv, 1); /* token t0: S *= decay; kv = S^T k */
    for (int t = t0; t < t1; t++, cur ^= 1) {
        const float beta = a->beta[(int64_t)t * a->Hv + h];
        const float *v = a->v + t * a->ldv + (int64_t)h * Dv + c0;
        for (int c = 0; c < n; c++) {
            delta[c] = (v[c] - kv[c]) * beta;
            kv[c] = 0.0f;
            o[c] = 0.0f;
        }
        const float *kc = kn[cur], *qc = qn[cur], *kx = kn[cur ^ 1];
        if (t + 1 < t1 && t + 1 != kend) { /* S += k delta^T; o = S^T q; then token t + 1: S *= decay; kv = S^T k */
            token_qk(a, t + 1, h, qn[cur ^ 1], kn[cur ^ 1]);
            decay = expf(a->g[(int64_t)(t + 1) * a->Hv + h]);
            for (int i = 0; i < Dk; i++) {
                float *restrict row = S + (int64_t)i * ld;
                const float ki = kc[i], qi = qc[i], kxi = kx[i];
                for (int c = 0; c < n; c++) {
                    float r = row[c] + ki * delta[c];
                    o[c] += r * qi;
                    r *= decay;
                    row[c] = r;
                    kv[c] += r * kxi;
                }
            }
        } else { /* the last token, or the last kept one: S += k delta^T; o = S^T q */
            write_and_query(S, ld, Dk, n, kc, qc, delta, o);
            if (t + 1 < t1) { /* the drafts after it: on a copy of the block from here */
                S = copy = copy_block(S, ld, Dk, n);
                ld = n;
                token_qk(a, t + 1, h, qn[cur ^ 1], kn[cur ^ 1]);
                decay = expf(a->g[(int64_t)(t + 1) * a->Hv + h]);
                decay_and_read(S, ld, Dk, n, decay, kn[cur ^ 1], kv, 0);
            }
        }
        memcpy(a->out + ((int64_t)t * a->Hv + h) * Dv + c0, o, sizeof(float) * n);
    }
    free(copy);
}

/* A sequence's only token (a decode row) through one value head's whole state S [Dk, Dv], row by row: each column
   takes the same operations in the same order as in rule_cols (decay and read, then write and query, summed over
   the rows in order), so the same bits, but the state streams through memory front to back instead of a block's
   strided slice of each row: one pass reads it from memory, the second finds it in L2. */
static void rule_head_token(const rule_t *a, int b, int h) {
    const int Dk = a->Dk, Dv = a->Dv, t = a->cu[b];
    float *restrict S = a->state + (int64_t)a->slots[b] * a->slot_stride + (int64_t)h * Dk * Dv;
    float qn[GDN_MAX_DIM], kn[GDN_MAX_DIM], kv[GDN_MAX_DIM], o[GDN_MAX_DIM], delta[GDN_MAX_DIM];
    for (int i = 0; i < PREFETCH_ROWS && i < Dk; i++) prefetch_cols(S + (int64_t)i * Dv, Dv);
    token_qk(a, t, h, qn, kn);
    const float decay = expf(a->g[(int64_t)t * a->Hv + h]);
    for (int c = 0; c < Dv; c++) kv[c] = 0.0f;
    for (int i = 0; i < Dk; i++) { /* S *= decay; kv = S^T k */
        float *restrict row = S + (int64_t)i * Dv;
        const float ki = kn[i];
        if (i + PREFETCH_ROWS < Dk) prefetch_cols(row + (int64_t)PREFETCH_ROWS * Dv, Dv);
        for (int c = 0; c < Dv; c++) {
            const float r = row[c] * decay;
            row[c] = r;
            kv[c] += r * ki;
        }
    }
    const float beta = a->beta[(int64_t)t * a->Hv + h];
    const float *v = a->v + t * a->ldv + (int64_t)h * Dv;
    for (int c = 0; c < Dv; c++) {
        delta[c] = (v[c] - kv[c]) * beta;
        o[c] = 0.0f;
    }
    write_and_query(S, Dv, Dk, Dv, kn, qn, delta, o); /* S += k delta^T; o = S^T q */
    memcpy(a->out + ((int64_t)t * a->Hv + h) * Dv, o, sizeof(float) * Dv);
}

static void rule_task(const rule_t *a, int task) {
    const int jb = task % a->col_blocks, h = task / a->col_blocks % a->Hv, b = task / a->col_blocks / a->Hv;
    if (a->cu[b + 1] - a->cu[b] == 1 && (!a->keep || a->keep[b])) { /* a decode row: the head's first block task
                                                                      takes its whole state */
        if (jb == 0) rule_head_token(a, b, h);
        return;
    }
    const int c0 = jb * COL_BLOCK, n = a->Dv - c0 < COL_BLOCK ? a->Dv - c0 : COL_BLOCK;
    if (n == COL_BLOCK)
        rule_cols(a, b, h, c0, COL_BLOCK); /* the loops over a constant width: unrolled, kv / o in registers */
    else
        rule_cols(a, b, h, c0, n);
}

/* A rule task with subnormal floats flushed to zero (subnormals.h): about 2x the rule's speed at a decode row and 3x
   at a verification's rows on the 0.8B shape's states. */
static void rule_block(void *ctx, int task) {
    const fp_mode_t mode = subnormals_off();
    rule_task((const rule_t *)ctx, task);
    fp_mode_restore(mode);
}

/* The gated delta rule: q, k [T, Hk, Dk] (rows ldq / ldk apart), v [T, Hv, Dv] (rows ldv apart), g, beta [T, Hv];
   q and k L2-normalized here, q also scaled; value head h reads q/k head h / (Hv / Hk), or h % Hk when `tiled`
   (llama.cpp's GGUF head order); sequence b owns rows cu[b] .. cu[b + 1] - 1 and its state [Hv, Dk, Dv] at
   state + slots[b] * slot_stride, updated in place; out [T, Hv, Dv]. */
static void gdn_rule(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                     const float *g, const float *beta, int Hk, int Hv, int Dk, int Dv, int tiled, const int32_t *cu,
                     int B, float *state, int64_t slot_stride, const int32_t *slots, float scale,
                     const int32_t *keep, float *out) {
    const int col_blocks = (Dv + COL_BLOCK - 1) / COL_BLOCK;
    rule_t a = {q, k, v, g, beta, ldq, ldk, ldv, Hk, Hv, Dk, Dv, tiled, col_blocks, cu, slots, state, out,
                slot_stride, scale, keep};
    pool_run(rule_block, &a, B * Hv * col_blocks, (int64_t)cu[B] * Hv * Dk * Dv >= 65536);
}

void qmm_gdn_rule(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                  const float *g, const float *beta, int Hk, int Hv, int Dk, int Dv, int tiled, const int32_t *cu,
                  int B, float *state, int64_t slot_stride, const int32_t *slots, float scale, float *out) {
    gdn_rule(q, ldq, k, ldk, v, ldv, g, beta, Hk, Hv, Dk, Dv, tiled, cu, B, state, slot_stride, slots, scale, NULL,
             out);
}

/* ---- the hybrid's output gates and per-head norms ------------------------------------------------------------
   Row kernels over [T, H, D] heads read in place (any token and head stride, so the views of a fused projection's
   output need no copies): each (token, head) row is computed on its own in a fixed order, so a row's result does
   not depend on T or on the other rows. */

static inline float bf16_value(const uint16_t *p, int64_t i) {
    uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

typedef struct {
    const float *x, *z, *weight;
    int64_t ldx, ldhx, ldz, ldhz;
    int H, D;
    float eps;
    float *out;
} head_norm_t;

/* out row = x / rms(x) * weight, times silu(z) when z is given */
static void head_norm_row(void *ctx, int task) {
    const head_norm_t *a = (const head_norm_t *)ctx;
    const int t = task / a->H, h = task % a->H, D = a->D;
    const float *restrict x = a->x + t * a->ldx + h * a->ldhx;
    float *restrict o = a->out + ((int64_t)t * a->H + h) * D;
    const float scale = 1.0f / sqrtf(sum_squares(x, D) / D + a->eps);
    if (!a->z) {
        for (int i = 0; i < D; i++) o[i] = x[i] * scale * a->weight[i];
        return;
    }
    const float *restrict z = a->z + t * a->ldz + h * a->ldhz;
    float sig[GDN_MAX_DIM];
    sigmoid_n(z, D, sig);
    for (int i = 0; i < D; i++) o[i] = x[i] * scale * a->weight[i] * (z[i] * sig[i]);
}

/* out [T, H, D] float32 = rms_norm(x[t, h]) * weight [D] (RMSNorm over each head), times silu(z[t, h]) when z is
   not NULL (Qwen3.5's gated RMSNorm); x[t, h] at x + t * ldx + h * ldhx, z[t, h] likewise; D <= 512. */
void qmm_head_rms_norm(const float *x, int64_t ldx, int64_t ldhx, const float *z, int64_t ldz, int64_t ldhz, int T,
                       int H, int D, const float *weight, float eps, float *out) {
    head_norm_t a = {x, z, weight, ldx, ldhx, ldz, ldhz, H, D, eps, out};
    pool_run(head_norm_row, &a, T * H, (int64_t)T * H * D >= 16384);
}

typedef struct {
    const void *o;
    int o_bf16;
    const float *gate;
    int64_t ldg, ldhg, lde;
    int H, D;
    float *out;
} sigmoid_gate_t;

static void sigmoid_gate_row(void *ctx, int task) {
    const sigmoid_gate_t *a = (const sigmoid_gate_t *)ctx;
    const int t = task / a->H, h = task % a->H, D = a->D;
    const int64_t at = ((int64_t)t * a->H + h) * D;
    const float *restrict g = a->gate + t * a->ldg + h * a->ldhg;
    float sig[GDN_MAX_DIM];
    sigmoid_n(g, a->lde ? D : 1, sig); /* lde 0: one gate for the head's D values */
    float *out = a->out + at; /* may be o */
    for (int i = 0; i < D; i++)
        out[i] = (a->o_bf16 ? bf16_value((const uint16_t *)a->o, at + i) : ((const float *)a->o)[at + i]) *
                 sig[a->lde ? i : 0];
}

/* out [T, H, D] float32 = o * sigmoid(gate) (a gated attention output): o [T, H, D] contiguous (bf16 when o_bf16),
   gate[t, h, i] at gate + t * ldg + h * ldhg + i * lde: lde 1, a gate per value (Qwen3.5's), or 0, one scalar per
   head (LFM3's); D <= 512; out may be o when o is float32. */
void qmm_sigmoid_gate(const void *o, int o_bf16, const float *gate, int64_t ldg, int64_t ldhg, int64_t lde, int T,
                      int H, int D, float *out) {
    sigmoid_gate_t a = {o, o_bf16, gate, ldg, ldhg, lde, H, D, out};
    pool_run(sigmoid_gate_row, &a, T * H, (int64_t)T * H * D >= 16384);
}

/* ---- the gates and the whole layer between its projections --------------------------------------------------- */

/* g [T, Hv] = -exp(A_log) * softplus(a + dt_bias) (the log-decay, <= 0) and beta [T, Hv] = sigmoid(b), from the
   projections a, b [T, Hv] (rows lda / ldb apart): kernels.gated_delta.delta_gates. softplus as torch's (x above 20
   is x). Each value on its own: the same bits whatever T. */
void qmm_gdn_gates(const float *a, int64_t lda, const float *b, int64_t ldb, int T, int Hv, const float *A_log,
                   const float *dt_bias, float *g, float *beta) {
    for (int t = 0; t < T; t++) {
        const float *at = a + t * lda;
        for (int h = 0; h < Hv; h++) {
            g[(int64_t)t * Hv + h] = -expf(A_log[h]) * softplus_torch(at[h] + dt_bias[h]);
        }
        sigmoid_n(b + t * ldb, Hv, beta + (int64_t)t * Hv);
    }
}

#include "gdn_layer.h"

/* the inputs of each sequence's rows after its keep[b] (at most spec_rows) into s->spec: [conv input | conv
   output | decay | beta] per row */
static void keep_draft_rows(const gdn_layer_t *g, const gdn_step_t *s, const float *proj, int64_t ldp,
                            const float *x, const float *decay, const float *beta) {
    const int C = 2 * g->Hk * g->Dk + g->Hv * g->Dv, Hv = g->Hv;
    const int64_t R = gdn_spec_per_row(g);
    for (int b = 0; b < s->B; b++)
        for (int t = s->cu[b] + s->keep[b], j = 0; t < s->cu[b + 1] && j < s->spec_rows; t++, j++) {
            float *dst = s->spec + g->index * s->spec_layer_stride + ((int64_t)b * s->spec_rows + j) * R;
            memcpy(dst, proj + t * ldp, sizeof(float) * C);
            memcpy(dst + C, x + (int64_t)t * C, sizeof(float) * C);
            memcpy(dst + 2 * C, decay + (int64_t)t * Hv, sizeof(float) * Hv);
            memcpy(dst + 2 * C + Hv, beta + (int64_t)t * Hv, sizeof(float) * Hv);
        }
}

/* the gated delta rule over the step's rows with each sequence's owed rows before them (qmm_gdn_mix's rule when
   s->owed is set): one ragged batch of both, the owed rows' conv outputs and gates taken from where they were kept,
   the owed rows in place like kept ones (their outputs dropped), so the state passes through memory once for both;
   o [T, Hv Dv] gets the step's rows' outputs */
static void rule_with_owed(const gdn_layer_t *g, const gdn_step_t *s, int T, const float *x, const float *decay,
                           const float *beta, float *o) {
    const int kd = g->Hk * g->Dk, vd = g->Hv * g->Dv, C = 2 * kd + vd, Hv = g->Hv, B = s->B;
    const int64_t R = gdn_spec_per_row(g);
    int P = 0;
    for (int b = 0; b < B; b++) P += s->owed_n[b];
    const int64_t N = (int64_t)T + P;
    float *xa = malloc(sizeof(float) * (size_t)N * (C + 2 * Hv + vd));
    int32_t *cu = malloc(sizeof(int32_t) * (size_t)(2 * B + 1));
    if (!xa || !cu) abort();
    float *da = xa + N * C, *ba = da + N * Hv, *oa = ba + N * Hv;
    int32_t *keep = cu + B + 1;
    cu[0] = 0;
    for (int b = 0; b < B; b++) {
        const int n = s->owed_n[b], t0 = s->cu[b], len = s->cu[b + 1] - t0;
        const float *rows = (const float *)(intptr_t)s->owed[b] + g->index * s->owed_layer_stride[b];
        for (int j = 0; j < n; j++) {
            const int64_t t = cu[b] + j;
            memcpy(xa + t * C, rows + j * R + C, sizeof(float) * C);
            memcpy(da + t * Hv, rows + j * R + 2 * C, sizeof(float) * Hv);
            memcpy(ba + t * Hv, rows + j * R + 2 * C + Hv, sizeof(float) * Hv);
        }
        const int64_t t = cu[b] + n;
        memcpy(xa + t * C, x + (int64_t)t0 * C, sizeof(float) * (size_t)len * C);
        memcpy(da + t * Hv, decay + (int64_t)t0 * Hv, sizeof(float) * (size_t)len * Hv);
        memcpy(ba + t * Hv, beta + (int64_t)t0 * Hv, sizeof(float) * (size_t)len * Hv);
        keep[b] = n + (s->keep ? s->keep[b] : len);
        cu[b + 1] = cu[b] + n + len;
    }
    gdn_rule(xa, C, xa + kd, C, xa + 2 * kd, C, da, ba, g->Hk, Hv, g->Dk, g->Dv, g->tiled, cu, B,
             s->state + g->index * s->state_layer_stride, s->state_slot_stride, s->slots, g->scale, keep, oa);
    for (int b = 0; b < B; b++)
        memcpy(o + (int64_t)s->cu[b] * vd, oa + (int64_t)(cu[b] + s->owed_n[b]) * vd,
               sizeof(float) * (size_t)(s->cu[b + 1] - s->cu[b]) * vd);
    free(cu);
    free(xa);
}

/* out [T, Hv Dv] float32 = a Gated DeltaNet layer between its projections, for proj [T, C + Hv Dv + 2 Hv] (in_proj's
   output [conv qkv | z | b | a], rows ldp apart): the causal conv + SiLU, the gates, the gated delta rule and the
   gated RMSNorm, each sequence's conv and recurrent states of linear layer g->index updated in place (by its owed
   rows first when s->owed is set; by its first s->keep[b] rows when keep is set, the later rows' inputs kept in
   s->spec); the same kernels in the same order as kernels.dispatch.gated_delta_net on the CPU. scratch:
   gdn_scratch_per_row(g) * T floats. */
void qmm_gdn_mix(const gdn_layer_t *g, const gdn_step_t *s, int T, const float *proj, int64_t ldp, float *scratch,
                 float *out) {
    const int kd = g->Hk * g->Dk, vd = g->Hv * g->Dv, C = 2 * kd + vd;
    float *x = scratch, *decay = x + (size_t)T * C, *beta = decay + (size_t)T * g->Hv, *o = beta + (size_t)T * g->Hv;
    int owed = 0;
    if (s->owed)
        for (int b = 0; b < s->B; b++)
            if (s->owed_n[b] > 0) {
                owed = 1;
                push_conv_inputs(s->conv + g->index * s->conv_layer_stride + (int64_t)s->slots[b] * s->conv_slot_stride,
                                 (const float *)(intptr_t)s->owed[b] + g->index * s->owed_layer_stride[b],
                                 gdn_spec_per_row(g), s->owed_n[b], C, g->K);
            }
    causal_conv(proj, ldp, C, g->K, g->conv_weight, 0, s->cu, s->B, s->conv + g->index * s->conv_layer_stride,
                s->conv_slot_stride, s->slots, 1, s->keep, x);
    qmm_gdn_gates(proj + C + vd + g->Hv, ldp, proj + C + vd, ldp, T, g->Hv, g->A_log, g->dt_bias, decay, beta);
    if (s->keep && s->spec) keep_draft_rows(g, s, proj, ldp, x, decay, beta);
    if (owed)
        rule_with_owed(g, s, T, x, decay, beta, o);
    else
        gdn_rule(x, C, x + kd, C, x + 2 * kd, C, decay, beta, g->Hk, g->Hv, g->Dk, g->Dv, g->tiled, s->cu, s->B,
                 s->state + g->index * s->state_layer_stride, s->state_slot_stride, s->slots, g->scale, s->keep, o);
    qmm_head_rms_norm(o, vd, g->Dv, proj + C, ldp, g->Dv, T, g->Hv, g->Dv, g->norm, g->eps, out);
}

void qmm_gdn_replay(const gdn_layer_t *g, const gdn_step_t *s, const int32_t *accepted) {
    const int kd = g->Hk * g->Dk, vd = g->Hv * g->Dv, C = 2 * kd + vd, Hv = g->Hv;
    const int64_t R = gdn_spec_per_row(g);
    for (int b = 0; b < s->B; b++) {
        const int n = accepted[b] < s->spec_rows ? accepted[b] : s->spec_rows;
        if (n <= 0) continue;
        const float *rows = s->spec + g->index * s->spec_layer_stride + (int64_t)b * s->spec_rows * R;
        float *decay = malloc(sizeof(float) * (size_t)n * (2 * Hv + vd));
        if (!decay) abort();
        float *beta = decay + (size_t)n * Hv, *o = beta + (size_t)n * Hv;
        for (int j = 0; j < n; j++) {
            memcpy(decay + (int64_t)j * Hv, rows + j * R + 2 * C, sizeof(float) * Hv);
            memcpy(beta + (int64_t)j * Hv, rows + j * R + 2 * C + Hv, sizeof(float) * Hv);
        }
        const int32_t cu[2] = {0, n};
        /* the conv state takes the rows' inputs (their conv outputs were kept) */
        push_conv_inputs(s->conv + g->index * s->conv_layer_stride + (int64_t)s->slots[b] * s->conv_slot_stride,
                         rows, R, n, C, g->K);
        gdn_rule(rows + C, R, rows + C + kd, R, rows + C + 2 * kd, R, decay, beta, g->Hk, g->Hv, g->Dk, g->Dv,
                 g->tiled, cu, 1, s->state + g->index * s->state_layer_stride, s->state_slot_stride, s->slots + b,
                 g->scale, NULL, o);
        free(decay);
    }
}
