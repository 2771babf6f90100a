/* One forward pass of a Llama decoder over a slot KV cache, for x86-64 CPUs with AVX2 and FMA, and with
 * AVX512-BF16 dot products for the matrix products where the build defines SPECD_ISA_AVX512BF16.
 *
 * Built and loaded by decoder/native/build.py (gcc, ctypes; one library per instruction set, the best the CPU runs
 * chosen at start-up); driven by decoder/native/llama.py, which owns the weights, the cache and every check on the
 * arguments. This file trusts its caller.
 *
 * Why it exists: on a small model a decode step is a few dozen GEMVs plus a few hundred small element-wise ops.
 * Eager PyTorch pays a dispatch per op and MKL streams the weights at a fraction of the read bandwidth. Here a
 * whole pass is one call, and the GEMVs read the weights in bfloat16 when they are exactly representable in it
 * (an exact upcast: each product is computed in float32 from the same values a float32 model holds), so the
 * bytes per step halve without changing the model.
 *
 * Batch invariance: every token's outputs are computed by the same instructions in the same order, whatever the
 * number of tokens in the pass and whichever sequences they belong to. Each dot product accumulates one 8-lane
 * vector over the input in order, then reduces it in a fixed tree; attention and norms are per token. So a token's
 * logits are bit-identical whether it is verified among K drafts, decoded alone, or batched with other requests.
 *
 * Layout (row-major): weights [out, in]; activations [tokens, features]; the cache
 * [layers, slots, kv_heads, capacity, head_dim]; the rotary tables [positions, head_dim].
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *wqkv;  /* [(heads + 2 kv_heads) head_dim, hidden]: q, k, v stacked */
    const void *wo;    /* [hidden, heads head_dim] */
    const void *wgu;   /* [2 inter, hidden]: gate, then up */
    const void *wdown; /* [hidden, inter] */
    const float *ln1;  /* [hidden] input_layernorm */
    const float *ln2;  /* [hidden] post_attention_layernorm */
} Layer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    int32_t bf16; /* 1: the matrices hold bfloat16 bit patterns (uint16); 0: float32 */
    float eps, scale;
    const Layer *layer;  /* [layers] */
    const float *embed;  /* [vocab, hidden] float32 */
    const float *norm;   /* [hidden] */
    const void *head;    /* [vocab, hidden] */
    const float *cos, *sin; /* [positions, head_dim] */
    float *keys, *values;   /* the cache */
    int64_t slots, capacity;
} Model;

/* ---- matrix products: y[t][j] = sum_i x[t][i] w[j][i] ---------------------------------------------------- */
/*
 * Weights are packed by llama.py into panels of 16 outputs: panel p holds w[16p .. 16p+15][i] for every i, i-major,
 * so a panel streams as one contiguous run ([in, 16], outputs past `out` zero). In bfloat16 the 16 values of one i
 * are stored in the order 0-3, 8-11, 4-7, 12-15, so that interleaving zeros below them (unpacklo/unpackhi) yields
 * outputs 0-7 and 8-15 as float32, one instruction per 8 weights.
 *
 * Each output accumulates x[t][i] * w[j][i] over i = 0, 1, ... in one float32 FMA chain, whatever the blocking, so
 * a token's result does not depend on how many tokens share the pass (batch invariance). Blocking only chooses how
 * many chains run side by side: 4 panels x 1 token (8 chains) when one token streams the weights, 1 panel x up to
 * 6 tokens (12 chains, each converted weight vector reused 6 times) when several do.
 */

#define PANEL 16

/* How far ahead in a panel to prefetch; 1 KB measured best on the development machine (the GEMVs of a step,
 * 2 threads). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif

#ifndef PREFETCH_PANEL_AHEAD
#define PREFETCH_PANEL_AHEAD 1
#endif

static inline float hsum(__m256 v) { /* a fixed reduction tree */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void load_panel(const void *w, int64_t i, const int BF16, __m256 *lo,
                                                             __m256 *hi) {
    if (BF16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i * PANEL));
        *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
        *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
    } else {
        *lo = _mm256_loadu_ps((const float *)w + i * PANEL);
        *hi = _mm256_loadu_ps((const float *)w + i * PANEL + 8);
    }
}

static inline void store_outputs(float *y, int j, int out, __m256 lo, __m256 hi) {
    if (j + PANEL <= out) {
        _mm256_storeu_ps(y + j, lo);
        _mm256_storeu_ps(y + j + 8, hi);
    } else { /* the last panel, padded */
        float both[PANEL];
        _mm256_storeu_ps(both, lo);
        _mm256_storeu_ps(both + 8, hi);
        for (int k = 0; j + k < out; k++) y[j + k] = both[k];
    }
}

/* Four panels (from `first`) against one token: 8 accumulator chains. (Two kernels, not one with both counts as
 * parameters: gcc keeps a small accumulator array in registers, a larger one on the stack.) */
static inline __attribute__((always_inline)) void panels4_token1(const void *w, int in, int out, const float *x,
                                                                 float *y, int first, const int BF16) {
    const int64_t panel_bytes = (int64_t)in * PANEL * (BF16 ? 2 : 4), step = PANEL * (BF16 ? 2 : 4);
    const char *base = (const char *)w + first * panel_bytes;
    __m256 acc[4][2];
    for (int p = 0; p < 4; p++) acc[p][0] = acc[p][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i++) {
        __m256 xv = _mm256_broadcast_ss(x + i);
        for (int p = 0; p < 4; p++) {
            const char *at = base + p * panel_bytes + i * step;
            _mm_prefetch(at + PREFETCH_BYTES, _MM_HINT_T0);
            __m256 lo, hi;
            load_panel(at, 0, BF16, &lo, &hi);
            acc[p][0] = _mm256_fmadd_ps(lo, xv, acc[p][0]);
            acc[p][1] = _mm256_fmadd_ps(hi, xv, acc[p][1]);
        }
    }
    for (int p = 0; p < 4; p++) store_outputs(y, (first + p) * PANEL, out, acc[p][0], acc[p][1]);
}

/* One panel against TB <= 6 tokens (from `t`): 2 TB chains, each converted weight vector used TB times. The
 * accumulators are named variables: as an array, gcc stored them to the stack on every iteration. */
#define ACC_DECLARE(k) __m256 lo##k = _mm256_setzero_ps(), hi##k = _mm256_setzero_ps()
#define ACC_STEP(k)                                                                                           \
    if (TB > k) {                                                                                             \
        __m256 xv = _mm256_broadcast_ss(xt + k * (int64_t)ldx + i);                                           \
        lo##k = _mm256_fmadd_ps(lo, xv, lo##k);                                                               \
        hi##k = _mm256_fmadd_ps(hi, xv, hi##k);                                                               \
    }
#define ACC_STORE(k) \
    if (TB > k) store_outputs(y + (int64_t)(t + k) * ldy, panel * PANEL, out, lo##k, hi##k)

static inline __attribute__((always_inline)) void panel1_tokens(const void *w, int in, int out, const float *x,
                                                                int ldx, float *y, int ldy, int panel, int t,
                                                                const int TB, const int BF16) {
    const int64_t step = PANEL * (BF16 ? 2 : 4);
    const char *base = (const char *)w + panel * in * step;
    const float *xt = x + (int64_t)t * ldx;
    ACC_DECLARE(0); ACC_DECLARE(1); ACC_DECLARE(2); ACC_DECLARE(3); ACC_DECLARE(4); ACC_DECLARE(5);
    const int64_t ahead = PREFETCH_PANEL_AHEAD ? in * step : PREFETCH_BYTES;
    for (int64_t i = 0; i < in; i++) {
        _mm_prefetch(base + i * step + ahead, _MM_HINT_T0);
        __m256 lo, hi;
        load_panel(base + i * step, 0, BF16, &lo, &hi);
        ACC_STEP(0) ACC_STEP(1) ACC_STEP(2) ACC_STEP(3) ACC_STEP(4) ACC_STEP(5)
    }
    ACC_STORE(0); ACC_STORE(1); ACC_STORE(2); ACC_STORE(3); ACC_STORE(4); ACC_STORE(5);
}

/* y[rows, out] = x[rows, in] w^T, the panels shared among the team's threads (call inside a parallel region,
 * from every thread; `rows` is the same for all of them). */
static inline __attribute__((always_inline)) void matmul_typed(const void *w, int out, int in, const float *x,
                                                               int ldx, int rows, float *y, int ldy,
                                                               const int BF16) {
    const int panels = (out + PANEL - 1) / PANEL;
    if (rows == 1) {
#pragma omp for schedule(static)
        for (int blk = 0; blk < panels / 4; blk++) panels4_token1(w, in, out, x, y, blk * 4, BF16);
        if (panels % 4) {
#pragma omp for schedule(static)
            for (int p = panels / 4 * 4; p < panels; p++) panel1_tokens(w, in, out, x, ldx, y, ldy, p, 0, 1, BF16);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
        int t = 0;
        for (; t + 6 <= rows; t += 6) panel1_tokens(w, in, out, x, ldx, y, ldy, p, t, 6, BF16);
        switch (rows - t) {
        case 5: panel1_tokens(w, in, out, x, ldx, y, ldy, p, t, 5, BF16); break;
        case 4: panel1_tokens(w, in, out, x, ldx, y, ldy, p, t, 4, BF16); break;
        case 3: panel1_tokens(w, in, out, x, ldx, y, ldy, p, t, 3, BF16); break;
        case 2: panel1_tokens(w, in, out, x, ldx, y, ldy, p, t, 2, BF16); break;
        case 1: panel1_tokens(w, in, out, x, ldx, y, ldy, p, t, 1, BF16); break;
        }
    }
}

#ifdef SPECD_ISA_AVX512BF16
/* ---- matrix products with bfloat16 dot products (AVX512-BF16) ------------------------------------------------ */
/*
 * Built only into the avx512bf16 library (build.py), which llama.py picks on CPUs reporting `avx512_bf16` for
 * weights that are exactly bfloat16. Panels of 16 outputs again, packed by input pairs: pair q of panel p holds
 * (w[16p + j][2q], w[16p + j][2q + 1]) for j = 0..15, one 64-byte vector. The tokens are rounded to bfloat16 once
 * per product (round to nearest even, `vcvtneps2bf16`), so a product's inputs are bfloat16 on both sides and one
 * `vdpbf16ps` does 32 multiply-adds.
 *
 * Each output is one lane: it accumulates pair 0, 1, 2, ... of its row in one chain, whatever the blocking, so
 * a token's result does not depend on how many tokens share the pass (batch invariance), exactly as in the AVX2
 * kernel above. The rounding of the tokens makes the logits differ from the AVX2 kernel's (within bfloat16
 * rounding of the activations); within this kernel they are the same bits alone, verified among K, or batched.
 * Blocking: 4 panels x 1 token when one token streams the weights; 2 panels x up to 12 tokens when several do, so
 * a verification of up to 11 drafts reads each weight once.
 */

#define DP_TILE 12

/* rows [t, t + rows) of x (float32, stride ldx) as bfloat16 in xb (stride in): the same instruction for every
 * element, the tail through a masked load, so a value's rounding never depends on its position */
static void tokens_to_bf16(const float *x, int ldx, int rows, int in, uint16_t *xb) {
#pragma omp for schedule(static)
    for (int t = 0; t < rows; t++) {
        const float *src = x + (int64_t)t * ldx;
        uint16_t *dst = xb + (int64_t)t * in;
        for (int i = 0; i < in; i += 16) {
            const __mmask16 tail = i + 16 <= in ? (__mmask16)0xFFFF : (__mmask16)((1u << (in - i)) - 1);
            __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, src + i));
            _mm256_mask_storeu_epi16(dst + i, tail, rounded);
        }
    }
}

/* P panels (from `panel`) against T tokens (from `t`): P x T chains. */
static inline __attribute__((always_inline)) void dp_block(const uint16_t *w, int in, int out, const uint16_t *xb,
                                                           float *y, int ldy, int panel, int t, const int P,
                                                           const int T) {
    const int64_t pairs = in / 2, panel_elems = pairs * 32;
    const int32_t *xp = (const int32_t *)(xb + (int64_t)t * in);
    const uint16_t *base = w + panel * panel_elems;
    __m512 acc[4][DP_TILE];
#pragma GCC unroll 4
    for (int p = 0; p < P; p++)
#pragma GCC unroll 12
        for (int k = 0; k < T; k++) acc[p][k] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; q++) {
        __m512bh wv[4];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            const uint16_t *at = base + p * panel_elems + q * 32;
            _mm_prefetch((const char *)at + PREFETCH_BYTES, _MM_HINT_T0);
            wv[p] = (__m512bh)_mm512_loadu_si512(at);
        }
#pragma GCC unroll 12
        for (int k = 0; k < T; k++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[k * pairs + q]);
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) acc[p][k] = _mm512_dpbf16_ps(acc[p][k], wv[p], xv);

        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        const int j = (panel + p) * PANEL;
        const __mmask16 mask = j + PANEL <= out ? (__mmask16)0xFFFF : (__mmask16)((1u << (out - j)) - 1);
#pragma GCC unroll 12
        for (int k = 0; k < T; k++) _mm512_mask_storeu_ps(y + (int64_t)(t + k) * ldy + j, mask, acc[p][k]);
    }
}

#define DP_TOKENS(P)                                                                                           \
    switch (T) {                                                                                               \
    case 1: dp_block(w, in, out, xb, y, ldy, p, t, P, 1); break;                                               \
    case 2: dp_block(w, in, out, xb, y, ldy, p, t, P, 2); break;                                               \
    case 3: dp_block(w, in, out, xb, y, ldy, p, t, P, 3); break;                                               \
    case 4: dp_block(w, in, out, xb, y, ldy, p, t, P, 4); break;                                               \
    case 5: dp_block(w, in, out, xb, y, ldy, p, t, P, 5); break;                                               \
    case 6: dp_block(w, in, out, xb, y, ldy, p, t, P, 6); break;                                               \
    case 7: dp_block(w, in, out, xb, y, ldy, p, t, P, 7); break;                                               \
    case 8: dp_block(w, in, out, xb, y, ldy, p, t, P, 8); break;                                               \
    case 9: dp_block(w, in, out, xb, y, ldy, p, t, P, 9); break;                                               \
    case 10: dp_block(w, in, out, xb, y, ldy, p, t, P, 10); break;                                             \
    case 11: dp_block(w, in, out, xb, y, ldy, p, t, P, 11); break;                                             \
    default: dp_block(w, in, out, xb, y, ldy, p, t, P, 12); break;                                             \
    }

/* y[rows, out] = bf16(x[rows, in]) w^T (call inside a parallel region, from every thread) */
static void matmul_dp(const uint16_t *w, int out, int in, const float *x, int ldx, int rows, float *y, int ldy,
                      uint16_t *xb) {
    const int panels = (out + PANEL - 1) / PANEL;
    tokens_to_bf16(x, ldx, rows, in, xb); /* its loop's barrier: every row converted before any product */
    if (rows == 1) {
#pragma omp for schedule(static)
        for (int p = 0; p < panels / 4 * 4; p += 4) dp_block(w, in, out, xb, y, ldy, p, 0, 4, 1);
        if (panels % 4) {
#pragma omp for schedule(static)
            for (int p = panels / 4 * 4; p < panels; p++) dp_block(w, in, out, xb, y, ldy, p, 0, 1, 1);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int p = 0; p < panels / 2 * 2; p += 2)
        for (int t = 0; t < rows; t += DP_TILE) {
            const int T = rows - t;
            DP_TOKENS(2)
        }
    if (panels % 2) {
#pragma omp single
        for (int t = 0, p = panels - 1; t < rows; t += DP_TILE) {
            const int T = rows - t;
            DP_TOKENS(1)
        }
    }
}
#define SPECD_ISA 1 /* specd_llama_isa(): the products above */
#else
#define SPECD_ISA 0 /* AVX2 + FMA only */
#endif

/* Which products this library was built with: 0 AVX2 + FMA, 1 AVX512-BF16 dot products (bf16 panels in pairs). */
int specd_llama_isa(void) { return SPECD_ISA; }

/* `xb`: scratch for the tokens as bfloat16 (the dot-product kernel's; unused otherwise) */
static void matmul(const void *w, int bf16, int out, int in, const float *x, int ldx, int rows, float *y,
                   int ldy, uint16_t *xb) {
#ifdef SPECD_ISA_AVX512BF16
    if (bf16) {
        matmul_dp((const uint16_t *)w, out, in, x, ldx, rows, y, ldy, xb);
        return;
    }
#else
    (void)xb;
#endif
    if (bf16)
        matmul_typed(w, out, in, x, ldx, rows, y, ldy, 1);
    else
        matmul_typed(w, out, in, x, ldx, rows, y, ldy, 0);
}

/* ---- exp ----------------------------------------------------------------------------------------------- */

/* e^x for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial; within 2 ulp of
 * the true value over the float range), so softmax and SiLU cost a few instructions per element, not a libm call. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

/* silu(gate) * up over n floats (n a multiple of 8) */
static void silu_mul(const float *gate, const float *up, int n, float *out) {
    for (int i = 0; i < n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
}

/* ---- per-token pieces -------------------------------------------------------------------------------------- */

static float sum_squares(const float *x, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return hsum(acc);
}

/* transformers' LlamaRMSNorm in float32: weight * (x * rsqrt(mean(x^2) + eps)) */
static void rms_norm(const float *x, const float *weight, int n, float eps, float *out) {
    float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

/* transformers' apply_rotary_pos_emb on one head: x * cos + rotate_half(x) * sin */
static void rope(float *x, const float *cos, const float *sin, int d) {
    int half = d / 2;
    float rotated[512];
    for (int i = 0; i < half; i++) rotated[i] = -x[i + half];
    for (int i = half; i < d; i++) rotated[i] = x[i - half];
    for (int i = 0; i < d; i++) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

static float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

/* One query head over the entries it sees: softmax(q k^T * scale) v. It sees the cache's entries 0..ctx-1, then
 * `n_extra` more, `extra` (a draft tree's row: its ancestors' entries and its own, root's child first), each in its
 * place in one score array: a tree's row sums exactly what its chain's row sums, in the same order. */
static void attend(const float *q, const float *keys, const float *values, int64_t ctx, const int64_t *extra,
                   int64_t n_extra, int d, float scale, float *scores, float *out) {
    float top = -INFINITY;
    const int64_t count = ctx + n_extra;
    for (int64_t p = 0; p < count; p++) {
        scores[p] = dot(q, keys + (p < ctx ? p : extra[p - ctx]) * d, d) * scale;
        if (scores[p] > top) top = scores[p];
    }
    int64_t p = 0;
    __m256 sums = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (; p + 8 <= count; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), shift));
        _mm256_storeu_ps(scores + p, e);
        sums = _mm256_add_ps(sums, e);
    }
    if (p < count) { /* the tail through the same instructions, padded */
        float pad[8] = {0};
        for (int64_t i = p; i < count; i++) pad[i - p] = scores[i] - top;
        float e[8];
        _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(pad)));
        for (int64_t i = p; i < count; i++) scores[i] = e[i - p];
    }
    float total = hsum(sums);
    for (int64_t i = p; i < count; i++) total += scores[i];
    float inverse = 1.0f / total;
    __m256 acc[8]; /* d <= 64 in registers; longer heads through memory */
    if (d <= 64) {
        for (int i = 0; i < d / 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t q = 0; q < count; q++) {
            __m256 weight = _mm256_set1_ps(scores[q] * inverse);
            const float *v = values + (q < ctx ? q : extra[q - ctx]) * d;
            for (int i = 0; i < d / 8; i++) acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int i = 0; i < d / 8; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
    } else {
        for (int i = 0; i < d; i++) out[i] = 0.0f;
        for (int64_t q = 0; q < count; q++) {
            __m256 weight = _mm256_set1_ps(scores[q] * inverse);
            const float *v = values + (q < ctx ? q : extra[q - ctx]) * d;
            for (int i = 0; i < d; i += 8)
                _mm256_storeu_ps(out + i, _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
        }
    }
}

/* The SiLU MLP of `n` tokens onto their residual stream: x += down(silu(gate(h)) * up(h)), `h` each token's normed
 * states ([n, hidden]; overwritten), `gu` and `act` scratch. Call inside a parallel region, from every thread. */
static void mlp_onto(const void *wgu, const void *wdown, int bf16, int hidden, int inter, int n, float *h, float *gu,
                     float *act, float *x, uint16_t *xb) {
    matmul(wgu, bf16, 2 * inter, hidden, h, hidden, n, gu, 2 * inter, xb);
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        const float *g = gu + (int64_t)t * 2 * inter;
        silu_mul(g, g + inter, inter, act + (int64_t)t * inter);
    }
    matmul(wdown, bf16, hidden, inter, act, inter, n, h, hidden, xb);
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        float *xr = x + (int64_t)t * hidden, *hr = h + (int64_t)t * hidden;
        for (int i = 0; i < hidden; i++) xr[i] = xr[i] + hr[i];
    }
}

/* ---- the pass ---------------------------------------------------------------------------------------------- */

/* Where one token of a pass goes and what it sees: its slot, its rotary position, its cache entry, and the entries
 * its attention reads (`attend`: 0..ctx-1, then `n_extra` listed from `extra`). A chain's token sits at its
 * position and sees the entries up to it; a draft tree's token sits at its row, at its depth's position. */
typedef struct {
    int64_t slot, pos, entry, ctx, n_extra;
    const int64_t *extra;
} Token;

/* Which hidden states a pass hands out besides its logits: at every token, the states entering each of `layers`
 * (`count` of them, each below the model's layer count), side by side in `out` ([n, count * hidden]). */
typedef struct {
    const int64_t *layers;
    int64_t count;
    float *out;
} Tap;

/* Append `n` tokens (`tok`) to the cache and write the logits of the rows listed in `keep` ([kept]) to `logits`
 * ([kept, vocab]), and the states `tap` asks for (NULL: none). Returns 0, or -1 when scratch memory is short. */
static int forward_tokens(const Model *m, int n, const int64_t *tokens, const Token *tok, int kept,
                          const int64_t *keep, float *logits, const Tap *tap, int threads) {
    const int hidden = m->hidden, d = m->head_dim, heads = m->heads, kvh = m->kv_heads, inter = m->inter;
    const int qkv_width = (heads + 2 * kvh) * d, group = heads / kvh;
    int64_t longest = 0;
    for (int t = 0; t < n; t++)
        if (tok[t].ctx + tok[t].n_extra > longest) longest = tok[t].ctx + tok[t].n_extra;
    float *x = malloc(sizeof(float) * (size_t)n * hidden);
    float *h = malloc(sizeof(float) * (size_t)n * hidden);
    float *qkv = malloc(sizeof(float) * (size_t)n * qkv_width);
    float *att = malloc(sizeof(float) * (size_t)n * heads * d);
    float *gu = malloc(sizeof(float) * (size_t)n * 2 * inter);
    float *act = malloc(sizeof(float) * (size_t)n * inter);
    float *scores = malloc(sizeof(float) * (size_t)threads * longest);
    float *tail = malloc(sizeof(float) * (size_t)(kept > 0 ? kept : 1) * hidden);
    const int widest = inter > hidden ? (inter > heads * d ? inter : heads * d) : (hidden > heads * d ? hidden : heads * d);
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(n > kept ? n : (kept > 0 ? kept : 1)) * widest);
    int failed = !x || !h || !qkv || !att || !gu || !act || !scores || !tail || !xb;
    if (!failed) {
        const int64_t slot_stride = (int64_t)kvh * m->capacity * d;
        const int64_t layer_stride = m->slots * slot_stride;
        for (int t = 0; t < n; t++) memcpy(x + (int64_t)t * hidden, m->embed + tokens[t] * hidden, sizeof(float) * hidden);
#pragma omp parallel num_threads(threads)
        {
            float *my_scores = scores + (int64_t)omp_get_thread_num() * longest;
            for (int l = 0; l < m->layers; l++) {
                const Layer *L = &m->layer[l];
                float *layer_keys = m->keys + l * layer_stride, *layer_values = m->values + l * layer_stride;
                for (int64_t j = 0; tap && j < tap->count; j++)
                    if (tap->layers[j] == l) {
#pragma omp for schedule(static)
                        for (int t = 0; t < n; t++)
                            memcpy(tap->out + ((int64_t)t * tap->count + j) * hidden, x + (int64_t)t * hidden,
                                   sizeof(float) * hidden);
                    }
#pragma omp for schedule(static)
                for (int t = 0; t < n; t++) rms_norm(x + (int64_t)t * hidden, L->ln1, hidden, m->eps, h + (int64_t)t * hidden);
                matmul(L->wqkv, m->bf16, qkv_width, hidden, h, hidden, n, qkv, qkv_width, xb);
#pragma omp for schedule(static)
                for (int t = 0; t < n; t++) {  /* rotary embedding, then k and v into the cache */
                    float *row = qkv + (int64_t)t * qkv_width;
                    const float *c = m->cos + tok[t].pos * d, *s = m->sin + tok[t].pos * d;
                    for (int hd = 0; hd < heads + kvh; hd++) rope(row + hd * d, c, s, d);
                    for (int g = 0; g < kvh; g++) {
                        int64_t at = tok[t].slot * slot_stride + g * m->capacity * d + tok[t].entry * d;
                        memcpy(layer_keys + at, row + (heads + g) * d, sizeof(float) * d);
                        memcpy(layer_values + at, row + (heads + kvh + g) * d, sizeof(float) * d);
                    }
                }
#pragma omp for schedule(static) collapse(2)
                for (int t = 0; t < n; t++)
                    for (int hd = 0; hd < heads; hd++) {
                        int64_t base = tok[t].slot * slot_stride + (hd / group) * m->capacity * d;
                        attend(qkv + (int64_t)t * qkv_width + hd * d, layer_keys + base, layer_values + base,
                               tok[t].ctx, tok[t].extra, tok[t].n_extra, d, m->scale, my_scores,
                               att + ((int64_t)t * heads + hd) * d);
                    }
                matmul(L->wo, m->bf16, hidden, heads * d, att, heads * d, n, h, hidden, xb);
#pragma omp for schedule(static)
                for (int t = 0; t < n; t++) {
                    float *xr = x + (int64_t)t * hidden, *hr = h + (int64_t)t * hidden;
                    for (int i = 0; i < hidden; i++) xr[i] = xr[i] + hr[i];
                    rms_norm(xr, L->ln2, hidden, m->eps, hr);
                }
                mlp_onto(L->wgu, L->wdown, m->bf16, hidden, inter, n, h, gu, act, x, xb);
            }
#pragma omp for schedule(static)
            for (int o = 0; o < kept; o++) rms_norm(x + keep[o] * hidden, m->norm, hidden, m->eps, tail + (int64_t)o * hidden);
            matmul(m->head, m->bf16, m->vocab, hidden, tail, hidden, kept, logits, m->vocab, xb);
        }
    }
    free(x); free(h); free(qkv); free(att); free(gu); free(act); free(scores); free(tail); free(xb);
    return failed ? -1 : 0;
}

/* The weight bytes one pass streams, for the benchmarks' roofline line. */
int64_t specd_llama_weight_bytes(const Model *m) {
    int64_t per_layer = (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim * m->hidden
                        + (int64_t)m->hidden * m->heads * m->head_dim + 3LL * m->inter * m->hidden;
    return (per_layer * m->layers + (int64_t)m->vocab * m->hidden) * (m->bf16 ? 2 : 4);
}

/* The pool's form of a pass: `rows` sequences, row r described by desc[4r .. 4r+3] = (slot, start, count, kept),
 * its `count` tokens next in `tokens`, appended at entries start.. of its slot; the logits of each row's last
 * `kept` tokens, row after row. `parents` (NULL: every row a chain, token i at position start + i) gives, per
 * token, its parent's index within its row: -1 for a row's first token (the root), an earlier index for every other
 * (a draft tree; a chain is i - 1). A tree's token sits at entry start + i and position start + its depth, and sees
 * the entries before the row, the root's and its ancestors'. Returns 0; -1 when scratch memory is short; -2 for a
 * token id outside the vocabulary; -3 for a row outside the cache; -4 for a parent that is not an earlier token of
 * its row; -5 for a tapped layer outside the model. `tap_layers` ([tap_count]; 0: no tap) asks for every token's
 * states entering those layers, written to `features` ([sum(count), tap_count * hidden]). */
int specd_llama_forward_rows(const Model *m, int rows, const int64_t *desc, const int64_t *tokens,
                             const int64_t *parents, float *logits, const int64_t *tap_layers, int64_t tap_count,
                             float *features, int threads) {
    int64_t n = 0, kept = 0;
    for (int r = 0; r < rows; r++) {
        n += desc[4 * r + 2];
        kept += desc[4 * r + 3];
    }
    for (int64_t t = 0; t < n; t++) /* a bad id would read past the embedding table: refuse the pass */
        if (tokens[t] < 0 || tokens[t] >= m->vocab) return -2;
    for (int64_t j = 0; j < tap_count; j++)
        if (tap_layers[j] < 0 || tap_layers[j] >= m->layers) return -5;
    for (int r = 0, t = 0; r < rows; r++) {
        const int64_t s = desc[4 * r], start = desc[4 * r + 1], count = desc[4 * r + 2], last = desc[4 * r + 3];
        if (s < 0 || s >= m->slots || start < 0 || count < 1 || start + count > m->capacity || last < 0 || last > count)
            return -3;
        for (int64_t i = 0; parents && i < count; i++, t++)
            if (i == 0 ? parents[t] != -1 : (parents[t] < 0 || parents[t] >= i)) return -4;
    }
    Token *tok = malloc(sizeof(Token) * (size_t)n);
    int64_t *keep = malloc(sizeof(int64_t) * (size_t)(kept > 0 ? kept : 1));
    int64_t *depth = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *paths = NULL; /* each tree token's entries below the root, root's child first */
    int status = -1;
    if (tok && keep && depth) {
        int64_t t = 0, k = 0, listed = 0;
        for (int r = 0; r < rows; r++) {
            const int64_t count = desc[4 * r + 2];
            for (int64_t i = 0; i < count; i++, t++) {
                depth[t] = parents && i > 0 ? depth[t - i + parents[t]] + 1 : i;
                listed += parents ? depth[t] : 0;
            }
        }
        paths = malloc(sizeof(int64_t) * (size_t)(listed > 0 ? listed : 1));
        t = 0, listed = 0;
        for (int r = 0; paths && r < rows; r++) {
            const int64_t s = desc[4 * r], start = desc[4 * r + 1], count = desc[4 * r + 2], last = desc[4 * r + 3];
            for (int64_t i = 0; i < count; i++, t++) {
                Token *x = &tok[t];
                x->slot = s;
                x->entry = start + i;
                x->pos = start + depth[t];
                if (parents) { /* the root's entry and those of the path down to this token */
                    x->ctx = start + 1;
                    x->n_extra = depth[t];
                    x->extra = paths + listed;
                    for (int64_t at = i, j = depth[t] - 1; j >= 0; at = parents[t - i + at], j--)
                        paths[listed + j] = start + at;
                    listed += depth[t];
                } else {
                    x->ctx = start + i + 1;
                    x->n_extra = 0;
                    x->extra = NULL;
                }
                if (i >= count - last) keep[k++] = t;
            }
        }
        const Tap tap = {tap_layers, tap_count, features};
        if (paths) status = forward_tokens(m, (int)n, tokens, tok, (int)kept, keep, logits, tap_count > 0 ? &tap : NULL,
                                           threads);
    }
    free(tok); free(keep); free(depth); free(paths);
    return status;
}

/* ---- an EAGLE-3 draft head (decoder/heads/model.py) ------------------------------------------------------------- */

/* One head's weights (packed like a layer's) and one sequence's cache of its layer ([kv_heads, capacity, head_dim]). */
typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, inter, draft_vocab, features;
    int32_t bf16, norm_before_residual;
    float eps, scale;
    const void *fc;      /* [hidden, features] */
    const float *fc_bias; /* [hidden] */
    const void *wqkv;    /* [(heads + 2 kv_heads) head_dim, 2 hidden]: q, k, v stacked */
    const void *wo;      /* [hidden, heads head_dim] */
    const void *wgu;     /* [2 inter, hidden] */
    const void *wdown;   /* [hidden, inter] */
    const float *ln_in, *ln_hidden, *ln_post, *norm; /* [hidden] each */
    const void *head;    /* [draft_vocab, hidden] */
    const float *embed;  /* [vocab, hidden] float32 */
    const float *cos, *sin; /* [capacity, head_dim] */
    float *keys, *values;   /* [kv_heads, capacity, head_dim] */
    int64_t capacity;
} Head;

/* Append `n` entries at cache entries start.. (rotary positions the same): entry t joins `tokens[t]`'s embedding with
 * `features[t]` projected by fc (NULL: with `fused[t]`, the head's own output, as drafting feeds it). Writes every
 * entry's layer output to `out` ([n, hidden]) and the last entry's draft-vocabulary logits to `logits`. Returns 0,
 * or -1 when scratch memory is short. Batch-invariant like the pass: each entry by the same instructions. */
int specd_eagle_forward(const Head *m, int n, const int64_t *tokens, const float *features, const float *fused,
                        int64_t start, float *out, float *logits, int threads) {
    const int hidden = m->hidden, d = m->head_dim, heads = m->heads, kvh = m->kv_heads, inter = m->inter;
    const int qkv_width = (heads + 2 * kvh) * d, group = heads / kvh;
    float *residual = malloc(sizeof(float) * (size_t)n * hidden);
    float *a = malloc(sizeof(float) * (size_t)n * 2 * hidden);
    float *qkv = malloc(sizeof(float) * (size_t)n * qkv_width);
    float *att = malloc(sizeof(float) * (size_t)n * heads * d);
    float *h = malloc(sizeof(float) * (size_t)n * hidden);
    float *gu = malloc(sizeof(float) * (size_t)n * 2 * inter);
    float *act = malloc(sizeof(float) * (size_t)n * inter);
    float *scores = malloc(sizeof(float) * (size_t)threads * (start + n));
    float *tail = malloc(sizeof(float) * hidden);
    const int in_most = m->features > 2 * hidden ? m->features : 2 * hidden;
    const int widest = in_most > inter ? in_most : inter;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)n * widest);
    int failed = !residual || !a || !qkv || !att || !h || !gu || !act || !scores || !tail || !xb;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *my_scores = scores + (int64_t)omp_get_thread_num() * (start + n);
            if (features) {
                matmul(m->fc, m->bf16, hidden, m->features, features, m->features, n, residual, hidden, xb);
#pragma omp for schedule(static)
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < hidden; i++) residual[(int64_t)t * hidden + i] += m->fc_bias[i];
            } else {
#pragma omp for schedule(static)
                for (int t = 0; t < n; t++)
                    memcpy(residual + (int64_t)t * hidden, fused + (int64_t)t * hidden, sizeof(float) * hidden);
            }
#pragma omp for schedule(static)
            for (int t = 0; t < n; t++) {
                float *row = a + (int64_t)t * 2 * hidden, *res = residual + (int64_t)t * hidden;
                rms_norm(m->embed + tokens[t] * hidden, m->ln_in, hidden, m->eps, row);
                rms_norm(res, m->ln_hidden, hidden, m->eps, row + hidden);
                if (m->norm_before_residual) memcpy(res, row + hidden, sizeof(float) * hidden);
            }
            matmul(m->wqkv, m->bf16, qkv_width, 2 * hidden, a, 2 * hidden, n, qkv, qkv_width, xb);
#pragma omp for schedule(static)
            for (int t = 0; t < n; t++) {
                float *row = qkv + (int64_t)t * qkv_width;
                const float *c = m->cos + (start + t) * d, *s = m->sin + (start + t) * d;
                for (int hd = 0; hd < heads + kvh; hd++) rope(row + hd * d, c, s, d);
                for (int g = 0; g < kvh; g++) {
                    int64_t at = (int64_t)g * m->capacity * d + (start + t) * d;
                    memcpy(m->keys + at, row + (heads + g) * d, sizeof(float) * d);
                    memcpy(m->values + at, row + (heads + kvh + g) * d, sizeof(float) * d);
                }
            }
#pragma omp for schedule(static) collapse(2)
            for (int t = 0; t < n; t++)
                for (int hd = 0; hd < heads; hd++) {
                    int64_t base = (int64_t)(hd / group) * m->capacity * d;
                    attend(qkv + (int64_t)t * qkv_width + hd * d, m->keys + base, m->values + base, start + t + 1,
                           NULL, 0, d, m->scale, my_scores, att + ((int64_t)t * heads + hd) * d);
                }
            matmul(m->wo, m->bf16, hidden, heads * d, att, heads * d, n, h, hidden, xb);
#pragma omp for schedule(static)
            for (int t = 0; t < n; t++) {
                float *xr = out + (int64_t)t * hidden, *hr = h + (int64_t)t * hidden;
                const float *rr = residual + (int64_t)t * hidden;
                for (int i = 0; i < hidden; i++) xr[i] = rr[i] + hr[i];
                rms_norm(xr, m->ln_post, hidden, m->eps, hr);
            }
            mlp_onto(m->wgu, m->wdown, m->bf16, hidden, inter, n, h, gu, act, out, xb);
#pragma omp single
            rms_norm(out + (int64_t)(n - 1) * hidden, m->norm, hidden, m->eps, tail);
            matmul(m->head, m->bf16, m->draft_vocab, hidden, tail, hidden, 1, logits, m->draft_vocab, xb);
        }
    }
    free(residual); free(a); free(qkv); free(att); free(h); free(gu); free(act); free(scores); free(tail); free(xb);
    return failed ? -1 : 0;
}
