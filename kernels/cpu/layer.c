/* A whole Llama-family decoder stack for one flat batch of rows in one call: per layer
   RMSNorm -> quantize -> qkv matmul (+ bias) -> RoPE + K/V write into the paged pool -> paged attention ->
   o_proj -> residual add + RMSNorm -> gate_up -> SiLU-mul -> down -> residual add + the next layer's RMSNorm.

   It calls the same kernels, in the same order, with the same dtypes as the per-op path of
   edgeserve/models/llama.py (qmatmul.c, attention.c, elementwise.c), so its results are bit for bit those of
   that path; what it saves is the Python, ctypes and allocator work around every one of those kernels. Every
   kernel computes each row on its own in a fixed order, so a row's result does not depend on the batch. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the kernels this file strings together (qmatmul.c, attention.c, elementwise.c) */
void qmm_quantize(const void *x, int is_bf16, int64_t ldx, int M, int K, int8_t *qa, float *da, int16_t *sa);
void qmm_matmul(int fmt, const uint8_t *w, int64_t row_bytes, int N, int K, const int8_t *qa, const float *da,
                const int16_t *sa, int M, float *out, int64_t ldo);
void qmm_paged_attention(const void *q, int q_bf16, int T, int H, int D, const void *k, const void *v, int kv_bf16,
                         int block_size, int Hkv, const int32_t *tables, int64_t table_stride,
                         const int32_t *row_seq, const int32_t *row_len, float scale, void *out);
void qmm_add_rms_norm(const void *x, int x_bf16, int64_t ldx, const float *residual, const float *weight, int T, int N,
                      float eps, float *new_residual, void *out, int out_bf16);
void qmm_rope_write_kv(const void *q, const void *k, const void *v, int in_bf16, int64_t ldq, int64_t ldk,
                       int64_t ldv, const float *cos, const float *sin, void *k_cache, void *v_cache, int cache_bf16,
                       const int64_t *slots, int T, int H, int Hkv, int D, void *q_out);
void qmm_silu_mul(const void *x, int bf16, int64_t ldx, int T, int F, float *out);

enum { MAX_PARTS = 4 };

/* Built with -DQMM_PROFILE (benchmarks/profile_fused_step.py), the stack adds up wall time per section into
   qmm_profile_ns; ordinary builds compile the marks away. */
enum { P_NORM, P_QUANT, P_QKV, P_ROPE, P_ATTN, P_O, P_GATE_UP, P_SILU, P_DOWN, P_SECTIONS };
#if defined(QMM_PROFILE)
#include <time.h>
int64_t qmm_profile_ns[P_SECTIONS];
static int64_t prof_last;
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#define MARK_START() (prof_last = now_ns())
#define MARK(s)                                      \
    do {                                             \
        const int64_t t_ = now_ns();                 \
        qmm_profile_ns[s] += t_ - prof_last;         \
        prof_last = t_;                              \
    } while (0)
#else
#define MARK_START() ((void)0)
#define MARK(s) ((void)0)
#endif

/* A weight stacked from up to MAX_PARTS block-format parts along its output rows (BlockWeight's parts). */
typedef struct {
    int32_t n_parts;
    int32_t fmt[MAX_PARTS];
    int32_t rows[MAX_PARTS];
    int64_t row_bytes[MAX_PARTS];
    const uint8_t *w[MAX_PARTS];
} qweight_t;

typedef struct {
    qweight_t qkv, o, gate_up, down;
    const float *qkv_bias;  /* float32 [q + 2 kv], or NULL */
    const float *post_norm; /* before the MLP */
    const float *next_norm; /* the next layer's input norm; the final norm after the last layer */
} layer_t;

typedef struct {
    int32_t n_layers, hidden, H, Hkv, D, F; /* F: the MLP's intermediate size */
    float eps, scale;
    int32_t act_bf16;        /* normed activations h in bfloat16 (else float32) */
    const float *first_norm; /* layer 0's input norm */
    const layer_t *layers;
    const float *cos, *sin; /* RoPE tables [positions, D / 2] */
} decoder_t;

static void matmul(const qweight_t *w, int K, const int8_t *qa, const float *da, const int16_t *sa, int M,
                   float *out) {
    int64_t ldo = 0;
    for (int p = 0; p < w->n_parts; p++) ldo += w->rows[p];
    int64_t col = 0;
    for (int p = 0; p < w->n_parts; p++) {
        qmm_matmul(w->fmt[p], w->w[p], w->row_bytes[p], w->rows[p], K, qa, da, sa, M, out + col, ldo);
        col += w->rows[p];
    }
}

static inline int imax(int a, int b) { return a > b ? a : b; }

/* Run every layer over T rows. x [T, hidden] float32: the embeddings in, the residual stream out; h_out
   [T, hidden] (bf16 when act_bf16): the final-normed hidden states. The K/V pools are [layers, blocks,
   block_size, Hkv, D] (bf16 when cache_bf16, layer_stride elements per layer); row t is at position
   positions[t], writes its K/V at slot slots[t] and attends to the first row_len[t] positions of sequence
   row_seq[t] (block table tables[row_seq[t] * table_stride ...]). Returns 0, or -1 when out of memory. */
int qmm_decoder_forward(const decoder_t *m, int T, const int64_t *positions, float *x, void *h_out, void *k_pool,
                        void *v_pool, int cache_bf16, int64_t layer_stride, int block_size, const int32_t *tables,
                        int64_t table_stride, const int32_t *row_seq, const int32_t *row_len, const int64_t *slots) {
    if (T <= 0) return 0;
    const int hidden = m->hidden, H = m->H, Hkv = m->Hkv, D = m->D, F = m->F, half = D / 2;
    const int qd = H * D, kvd = Hkv * D, nqkv = qd + 2 * kvd, kmax = imax(imax(hidden, qd), F);
    const size_t cache_el = cache_bf16 ? 2 : 4;
    /* one allocation per call: float32 scratch first, then the narrower types */
    size_t floats = (size_t)T * (nqkv + hidden + 2 * (size_t)F + F + 2 * half + kmax / 32);
    size_t bytes = floats * 4 + (size_t)T * qd * cache_el + (size_t)T * kmax + (size_t)T * (kmax / 16) * 2 + 64;
    char *mem = malloc(bytes);
    if (!mem) return -1;
    float *qkv = (float *)mem, *o = qkv + (size_t)T * nqkv, *gu = o + (size_t)T * hidden, *act = gu + (size_t)T * 2 * F;
    float *cs = act + (size_t)T * F, *sn = cs + (size_t)T * half, *da = sn + (size_t)T * half;
    char *rest = (char *)(da + (size_t)T * (kmax / 32));
    void *q = rest;
    int16_t *sa = (int16_t *)(rest + (size_t)T * qd * cache_el);
    int8_t *qa = (int8_t *)(sa + (size_t)T * (kmax / 16));
    for (int t = 0; t < T; t++) {
        memcpy(cs + (size_t)t * half, m->cos + positions[t] * half, sizeof(float) * half);
        memcpy(sn + (size_t)t * half, m->sin + positions[t] * half, sizeof(float) * half);
    }
    void *h = h_out;
    MARK_START();
    qmm_add_rms_norm(x, 0, hidden, 0, m->first_norm, T, hidden, m->eps, 0, h, m->act_bf16);
    MARK(P_NORM);
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *L = m->layers + i;
        char *kc = (char *)k_pool + (size_t)i * layer_stride * cache_el;
        char *vc = (char *)v_pool + (size_t)i * layer_stride * cache_el;
        qmm_quantize(h, m->act_bf16, hidden, T, hidden, qa, da, sa);
        MARK(P_QUANT);
        matmul(&L->qkv, hidden, qa, da, sa, T, qkv);
        if (L->qkv_bias)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < nqkv; j++) qkv[(size_t)t * nqkv + j] += L->qkv_bias[j];
        MARK(P_QKV);
        qmm_rope_write_kv(qkv, qkv + qd, qkv + qd + kvd, 0, nqkv, nqkv, nqkv, cs, sn, kc, vc, cache_bf16, slots, T, H,
                          Hkv, D, q);
        MARK(P_ROPE);
        qmm_paged_attention(q, cache_bf16, T, H, D, kc, vc, cache_bf16, block_size, Hkv, tables, table_stride, row_seq,
                            row_len, m->scale, q);
        MARK(P_ATTN);
        qmm_quantize(q, cache_bf16, qd, T, qd, qa, da, sa);
        MARK(P_QUANT);
        matmul(&L->o, qd, qa, da, sa, T, o);
        MARK(P_O);
        qmm_add_rms_norm(o, 0, hidden, x, L->post_norm, T, hidden, m->eps, x, h, m->act_bf16);
        MARK(P_NORM);
        qmm_quantize(h, m->act_bf16, hidden, T, hidden, qa, da, sa);
        MARK(P_QUANT);
        matmul(&L->gate_up, hidden, qa, da, sa, T, gu);
        MARK(P_GATE_UP);
        qmm_silu_mul(gu, 0, 2 * (int64_t)F, T, F, act);
        MARK(P_SILU);
        qmm_quantize(act, 0, F, T, F, qa, da, sa);
        MARK(P_QUANT);
        matmul(&L->down, F, qa, da, sa, T, o);
        MARK(P_DOWN);
        qmm_add_rms_norm(o, 0, hidden, x, L->next_norm, T, hidden, m->eps, x, h, m->act_bf16);
        MARK(P_NORM);
    }
    free(mem);
    return 0;
}
