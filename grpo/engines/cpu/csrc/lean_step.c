/* One decode step of a Llama-style decoder (Llama, Qwen2, Mistral without sliding windows) in float32, on CPU,
 * in one call: grpo/native.py compiles this file with the system C compiler and grpo/decoding.py calls it once
 * per sampled token instead of ~60 small torch operators per layer.
 *
 * Per layer: RMSNorm, the stacked q/k/v product (+ bias), rotary embedding of q and k, k and v written into the
 * preallocated KV cache, attention over the cached positions (a key mask for left padding), the output product
 * added to the residual, RMSNorm, the stacked gate/up product, SiLU(gate) * up, the down product added to the
 * residual; at the end the final RMSNorm. The weights are the layer's (out, in) matrices (decoding.layer_products),
 * q/k/v and gate/up side by side, packed by lean_pack_rows.
 *
 * lean_head is the output layer's product for sampling, (rows, H) x (V, H)^T, streaming the packed weight once per
 * 16 rows.
 *
 * Single-threaded, no allocation: the caller passes scratch memory. Plain C that compilers vectorize
 * (-O3 -march=native), with AVX-512 intrinsics where the compiler would not (lean_head's kernel, the exps of SiLU
 * and attention, vecmath.h) and a plain-C path beside each; the results equal the torch step up to float32
 * rounding (tests/test_native.py, which also checks a build without AVX-512).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "vecmath.h"

typedef struct {
    const float *input_norm, *post_norm;  /* (H) */
    const float *qkv, *qkv_bias;          /* packed (H, Q + 2 KV), (Q + 2 KV) or NULL */
    const float *o, *o_bias;              /* (Q, H), (H) or NULL */
    const float *gate_up, *gate_up_bias;  /* (H, 2 I), (2 I) or NULL */
    const float *down, *down_bias;        /* (I, H), (H) or NULL */
    float *keys, *values;                 /* KV cache: (rows, kv_heads, capacity, head_dim) */
} Layer;

typedef struct {
    int32_t rows, hidden, q_heads, kv_heads, head_dim, inter, capacity, layers;
    float eps, scale;                     /* RMSNorm epsilon; attention scale (head_dim ** -0.5) */
    const float *embed;                   /* (vocab, H) */
    const float *final_norm;              /* (H) */
    const float *cos, *sin;               /* rotary tables: (capacity, head_dim), row p for position p */
    const Layer *layer;                   /* (layers) */
    float *scratch;                       /* see lean_scratch_floats() */
} Model;

/* Floats of scratch memory lean_step needs for a model of these sizes. */
int64_t lean_scratch_floats(int32_t rows, int32_t hidden, int32_t q, int32_t kv, int32_t inter, int32_t capacity) {
    return (int64_t)rows * (2 * hidden + q + 2 * kv + q + 3 * inter) + capacity;
}

/* The weights are packed once per rollout (lean_pack_rows) into panels of NB columns: panel p holds columns
 * p*NB .. p*NB+NB-1 of the (K, N) matrix as K contiguous rows of NB floats (zeros past column N), so a product
 * streams each panel sequentially instead of striding across the whole matrix. */
#define NB 32
#ifdef __AVX512F__
#define MB 8
#else
#define MB 4
#endif

/* 1 when this build has the AVX-512 paths (lean_head's kernel above all: without them it does not keep up with
 * oneDNN's product, which the caller then takes). */
int32_t lean_wide_vectors(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

int64_t lean_packed_floats(int32_t K, int32_t N) { return (int64_t)K * ((N + NB - 1) / NB) * NB; }

/* Columns col0 .. col0+n-1 of a packed (K, N) matrix from a row-major (n, K) weight, PyTorch's (out, in) layout:
 * column c is row c - col0, so stacked projections (q/k/v, gate/up) are packed side by side without a stacked or
 * transposed copy. The call that fills column N-1 also zeroes the last panel's columns past N. */
void lean_pack_rows(int32_t K, int32_t N, int32_t col0, int32_t n, const float *restrict W, float *restrict packed) {
    for (int c = col0; c < col0 + n; c++) {
        float *restrict dst = packed + (size_t)(c / NB) * NB * K + c % NB;
        const float *restrict src = W + (size_t)(c - col0) * K;
        for (int k = 0; k < K; k++) dst[(size_t)k * NB] = src[k];
    }
    if (col0 + n == N)
        for (int c = N; c % NB; c++)
            for (int k = 0; k < K; k++) packed[(size_t)(c / NB) * NB * K + (size_t)k * NB + c % NB] = 0.0f;
}

/* Stores an (mb, nb) block of accumulators acc (row stride `stride`) into out's columns n0.. , plus bias. */
static inline void store_block(int mb, int nb, const float *acc, int stride, const float *restrict bias, int n0,
                               float *restrict out, int N) {
    for (int i = 0; i < mb; i++) {
        float *restrict o = out + (size_t)i * N + n0;
        const float *a = acc + (size_t)i * stride;
        for (int j = 0; j < nb; j++) o[j] = bias ? a[j] + bias[n0 + j] : a[j];
    }
}

#ifdef GRPO_AVX2
/* out (M, N) = x (M, K) @ W (K, N) + bias (N, or NULL), W packed by lean_pack_rows, for AVX2 without AVX-512: 16
 * registers of 8 floats. Each half panel (16 columns) times a block of 6 rows accumulates in 12 registers over all
 * of K, with 2 for the weights and 1 for the broadcast row value (the classic 6 x 16 kernel); the plain-C block
 * below spills at 4 x 32 on these registers. Every output is the same k-ordered sum of fused multiply-adds as
 * there. Zen 3, M 64: 47-52 -> 68-80 GFLOP/s for the default job's products (K 128 / 512, N 128 - 1024). */
#define RB 6
static void gemm(int M, int K, int N, const float *restrict x, const float *restrict packed,
                 const float *restrict bias, float *restrict out) {
    for (int n0 = 0; n0 < N; n0 += NB) {
        const int nb = N - n0 < NB ? N - n0 : NB;
        const float *restrict panel = packed + (size_t)n0 * K;
        for (int half = 0; half < nb; half += 16) {
            for (int m0 = 0; m0 < M; m0 += RB) {
                const float *r[RB];
                for (int i = 0; i < RB; i++) r[i] = x + (size_t)(m0 + i < M ? m0 + i : M - 1) * K;
                __m256 acc[RB][2];
                for (int i = 0; i < RB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
                const float *restrict w = panel + half;
                for (int k = 0; k < K; k++, w += NB) {
                    if (m0 == 0 && half == 0) __builtin_prefetch(w + 1024);  /* the next panel, 4 KB ahead */
                    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
                    for (int i = 0; i < RB; i++) {
                        const __m256 v = _mm256_broadcast_ss(r[i] + k);
                        acc[i][0] = _mm256_fmadd_ps(v, w0, acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(v, w1, acc[i][1]);
                    }
                }
                float block[RB][16];
                for (int i = 0; i < RB; i++) {
                    _mm256_storeu_ps(block[i], acc[i][0]);
                    _mm256_storeu_ps(block[i] + 8, acc[i][1]);
                }
                store_block(M - m0 < RB ? M - m0 : RB, nb - half < 16 ? nb - half : 16, &block[0][0], 16, bias,
                            n0 + half, out + (size_t)m0 * N, N);
            }
        }
    }
}
#else
/* out (M, N) = x (M, K) @ W (K, N) + bias (N, or NULL), W packed by lean_pack_rows. A block of MB rows x NB columns
 * is accumulated in registers over all of K; a panel is read from memory once and from cache for the other row
 * blocks. Rows past M repeat row M-1 and are not stored, so every block runs the same unrolled loop. */
static void gemm(int M, int K, int N, const float *restrict x, const float *restrict packed,
                 const float *restrict bias, float *restrict out) {
    for (int n0 = 0; n0 < N; n0 += NB) {
        const int nb = N - n0 < NB ? N - n0 : NB;
        const float *restrict panel = packed + (size_t)n0 * K;
        for (int m0 = 0; m0 < M; m0 += MB) {
            const float *rows[MB];
            for (int i = 0; i < MB; i++) rows[i] = x + (size_t)(m0 + i < M ? m0 + i : M - 1) * K;
            float acc[MB][NB];
            for (int i = 0; i < MB; i++)
                for (int j = 0; j < NB; j++) acc[i][j] = 0.0f;
            for (int k = 0; k < K; k++) {
                const float *restrict w = panel + (size_t)k * NB;
                if (m0 == 0) {  /* the first row block streams the panels: fetch 4 KB ahead (the next panel
                                 * follows this one in memory) */
                    __builtin_prefetch(w + 1024);
                    __builtin_prefetch(w + 1024 + 16);
                }
                for (int i = 0; i < MB; i++) {
                    const float xv = rows[i][k];
                    for (int j = 0; j < NB; j++) acc[i][j] += xv * w[j];
                }
            }
            store_block(M - m0 < MB ? M - m0 : MB, nb, &acc[0][0], NB, bias, n0, out + (size_t)m0 * N, N);
        }
    }
}
#endif

/* sum_j a[j] b[j], in 16 interleaved partial sums (a strict left-to-right float sum cannot be vectorized). */
static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float part[16] = {0.0f};
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int u = 0; u < 16; u++) part[u] += a[j + u] * b[j + u];
    float total = 0.0f;
    for (; j < n; j++) total += a[j] * b[j];
    for (int u = 0; u < 16; u++) total += part[u];
    return total;
}

/* y = weight * (x / sqrt(mean(x^2) + eps)), rows of width H. */
static void rms_norm(int rows, int H, const float *restrict x, const float *restrict weight, float eps,
                     float *restrict y) {
    for (int r = 0; r < rows; r++) {
        const float *restrict xr = x + (size_t)r * H;
        const float ss = dot(xr, xr, H);
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        float *restrict yr = y + (size_t)r * H;
        for (int j = 0; j < H; j++) yr[j] = weight[j] * (xr[j] * inv);
    }
}

/* x (d) rotated in place: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1). */
static void rotate(float *restrict x, const float *restrict cos, const float *restrict sin, int d) {
    const int half = d / 2;
    float tmp[512];
    for (int j = 0; j < half; j++) tmp[j] = x[j] * cos[j] - x[j + half] * sin[j];
    for (int j = half; j < d; j++) tmp[j] = x[j] * cos[j] + x[j - half] * sin[j];
    memcpy(x, tmp, (size_t)d * sizeof(float));
}

/* a = silu(g) * u over n entries, silu(g) = g / (1 + exp(-g)) computed with exp of -|g| (never positive). */
static void silu_times(int n, const float *restrict g, const float *restrict u, float *restrict a) {
    int j = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j < n; j += 16) {
        const __mmask16 k = lanes(n - j);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
        const __mmask16 positive = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
        const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(positive, e, one), _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(a + j, k, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_maskz_loadu_ps(k, u + j)));
    }
#elif defined(GRPO_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp8(_mm256_or_ps(gv, _mm256_set1_ps(-0.0f)));  /* exp(-|g|) */
        const __m256 positive = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
        _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) {
        const float e = exp_nonpositive(-fabsf(g[j]));
        const float sig = g[j] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        a[j] = g[j] * sig * u[j];
    }
}

/* h = x + y, rows of width H (the residual add). */
static void add_into(size_t count, float *restrict x, const float *restrict y) {
    for (size_t j = 0; j < count; j++) x[j] += y[j];
}

/* One query head's attention over L cached positions: o (d) = softmax(scale q K^T, masked) V, keys and values (L, d)
 * rows; scores (L) is scratch. Masked keys (mask[t] == 0) get weight 0. */
static void attend(const float *restrict q, const float *restrict K, const float *restrict V, int L, int d,
                   float scale, const uint8_t *mask, float *restrict scores, float *restrict o) {
    float best = -INFINITY;
#ifdef GRPO_AVX2
    if (d % 8 == 0) {  /* 8 keys' dots at a time and a register-held output (the plain loops below ran ~10x slower
                        * per flop: one dependent chain and a horizontal sum per key, the output on the stack) */
        int t = 0;
        for (; t + 8 <= L; t += 8) {
            const float *restrict k = K + (size_t)t * d;
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k + (size_t)i * d));
            for (int j = 8; j < d; j += 8) {
                const __m256 qj = _mm256_loadu_ps(q + j);
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k + (size_t)i * d + j), a[i]);
            }
            const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                              _mm256_permute2f128_ps(u0, u1, 0x31));  /* keys t .. t+7 */
            _mm256_storeu_ps(scores + t, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
        }
        for (; t < L; t++) scores[t] = dot(q, K + (size_t)t * d, d) * scale;
        for (t = 0; t < L; t++) {
            if (mask && !mask[t]) scores[t] = -INFINITY;
            if (scores[t] > best) best = scores[t];
        }
        const __m256 inv = _mm256_set1_ps(1.0f / exp_sums(scores, L, best, scores, NULL));
        int j0 = 0;
        for (; j0 + 32 <= d; j0 += 32) {  /* 32 output dims at a time in 4 registers */
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (t = 0; t < L; t++) {
                const __m256 w = _mm256_broadcast_ss(scores + t);
                const float *restrict v = V + (size_t)t * d + j0;
                a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(o + j0, _mm256_mul_ps(a0, inv));
            _mm256_storeu_ps(o + j0 + 8, _mm256_mul_ps(a1, inv));
            _mm256_storeu_ps(o + j0 + 16, _mm256_mul_ps(a2, inv));
            _mm256_storeu_ps(o + j0 + 24, _mm256_mul_ps(a3, inv));
        }
        for (; j0 < d; j0 += 8) {
            __m256 a0 = _mm256_setzero_ps();
            for (t = 0; t < L; t++)
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + t), _mm256_loadu_ps(V + (size_t)t * d + j0), a0);
            _mm256_storeu_ps(o + j0, _mm256_mul_ps(a0, inv));
        }
        return;
    }
#endif
    for (int t = 0; t < L; t++) {
        scores[t] = (mask && !mask[t]) ? -INFINITY : dot(q, K + (size_t)t * d, d) * scale;
        if (scores[t] > best) best = scores[t];
    }
    const float total = exp_sums(scores, L, best, scores, NULL);  /* masked keys (-inf) get 0 */
    for (int j0 = 0; j0 < d; j0 += 64) {  /* 64 output dims at a time stay in registers */
        const int w = d - j0 < 64 ? d - j0 : 64;
        float acc[64] = {0.0f};
        for (int t = 0; t < L; t++) {
            const float p = scores[t];
            const float *restrict v = V + (size_t)t * d + j0;
            for (int j = 0; j < w; j++) acc[j] += p * v[j];
        }
        for (int j = 0; j < w; j++) o[j0 + j] = acc[j] / total;
    }
}

/* One token per row. tokens, positions: (rows). length: positions already in the cache (this token is written
 * at index length). key_mask: (rows, mask_stride) bytes, nonzero where a row may attend (left padding is 0), or
 * NULL when every cached position is real. out: (rows, H), the final normed hidden states. */
void lean_step(const Model *m, const int64_t *tokens, const int64_t *positions, int32_t length,
               const uint8_t *key_mask, int64_t mask_stride, float *out) {
    const int R = m->rows, H = m->hidden, d = m->head_dim, QH = m->q_heads, KVH = m->kv_heads, I = m->inter;
    const int Q = QH * d, KV = KVH * d, W3 = Q + 2 * KV, L = length + 1, group = QH / KVH;
    float *x = m->scratch, *h = x + (size_t)R * H, *qkv = h + (size_t)R * H, *att = qkv + (size_t)R * W3;
    float *gu = att + (size_t)R * Q, *act = gu + (size_t)R * 2 * I, *scores = act + (size_t)R * I;
    for (int r = 0; r < R; r++) memcpy(x + (size_t)r * H, m->embed + (size_t)tokens[r] * H, (size_t)H * sizeof(float));
    for (int li = 0; li < m->layers; li++) {
        const Layer *ly = &m->layer[li];
        rms_norm(R, H, x, ly->input_norm, m->eps, h);
        gemm(R, H, W3, h, ly->qkv, ly->qkv_bias, qkv);
        for (int r = 0; r < R; r++) {
            float *row = qkv + (size_t)r * W3;
            const float *c = m->cos + (size_t)positions[r] * d, *s = m->sin + (size_t)positions[r] * d;
            for (int head = 0; head < QH + KVH; head++) rotate(row + (size_t)head * d, c, s, d);
            for (int kh = 0; kh < KVH; kh++) {
                const size_t at = (((size_t)r * KVH + kh) * m->capacity + length) * d;
                memcpy(ly->keys + at, row + Q + (size_t)kh * d, (size_t)d * sizeof(float));
                memcpy(ly->values + at, row + Q + KV + (size_t)kh * d, (size_t)d * sizeof(float));
            }
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *mask = key_mask ? key_mask + (size_t)r * mask_stride : NULL;
            for (int qh = 0; qh < QH; qh++) {
                const size_t base = ((size_t)r * KVH + qh / group) * m->capacity * d;
                attend(qkv + (size_t)r * W3 + (size_t)qh * d, ly->keys + base, ly->values + base, L, d, m->scale,
                       mask, scores, att + (size_t)r * Q + (size_t)qh * d);
            }
        }
        gemm(R, Q, H, att, ly->o, ly->o_bias, h);
        add_into((size_t)R * H, x, h);
        rms_norm(R, H, x, ly->post_norm, m->eps, h);
        gemm(R, H, 2 * I, h, ly->gate_up, ly->gate_up_bias, gu);
        for (int r = 0; r < R; r++) silu_times(I, gu + (size_t)r * 2 * I, gu + (size_t)r * 2 * I + I,
                                               act + (size_t)r * I);
        gemm(R, I, H, act, ly->down, ly->down_bias, h);
        add_into((size_t)R * H, x, h);
    }
    rms_norm(R, H, x, m->final_norm, m->eps, out);
}

/* The output layer for sampling: logits (rows, V) = h (rows, K) @ W^T + bias, W the (V, K) weight of the linear
 * layer packed by lean_pack_head into panels of 16 vocabulary entries: panel p holds rows p*16 .. p*16+15 of W
 * transposed, K contiguous groups of 16 floats (zeros past V). With a 151k vocabulary the weight (155 MB) does
 * not fit in any cache, so the product is bound by streaming it from memory: each panel is read once for 16 rows
 * of h, with a software prefetch 4 KB ahead (16 ms per token on the benchmark's machine, against 25 ms for
 * oneDNN's packed product). */
#define HB 16

int64_t lean_head_packed_floats(int32_t K, int32_t V) { return (int64_t)K * ((V + HB - 1) / HB) * HB; }

#ifdef __AVX512F__
/* r[0..15] (16 rows of 16 floats) transposed in registers: r[c] becomes column c. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 2; i++)
        for (int c = 0; c < 4; c++) {
            t[8 * i + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
            t[8 * i + 4 + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0xDD);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
    }
}
#endif

void lean_pack_head(int32_t K, int32_t V, const float *restrict W, float *restrict packed) {
    for (int v0 = 0; v0 < V; v0 += HB) {
        float *restrict panel = packed + (size_t)v0 * K;
        int k0 = 0;
#ifdef __AVX512F__
        if (v0 + HB <= V)  /* a full panel: 16 x 16 blocks transposed in registers */
            for (; k0 + 16 <= K; k0 += 16) {
                __m512 r[16];
                for (int j = 0; j < HB; j++) r[j] = _mm512_loadu_ps(W + (size_t)(v0 + j) * K + k0);
                transpose16(r);
                for (int c = 0; c < 16; c++) _mm512_storeu_ps(panel + (size_t)(k0 + c) * HB, r[c]);
            }
#endif
        for (int k = k0; k < K; k++)
            for (int j = 0; j < HB; j++) panel[(size_t)k * HB + j] = v0 + j < V ? W[(size_t)(v0 + j) * K + k] : 0.0f;
    }
}

void lean_head(int32_t rows, int32_t K, int32_t V, const float *restrict h, const float *restrict packed,
               const float *restrict bias, float *restrict out) {
    for (int m0 = 0; m0 < rows; m0 += HB) {
        const int mb = rows - m0 < HB ? rows - m0 : HB;
        const float *x[HB];  /* rows past the end repeat the last row and are not stored */
        for (int i = 0; i < HB; i++) x[i] = h + (size_t)(m0 + (i < mb ? i : mb - 1)) * K;
        for (int v0 = 0; v0 < V; v0 += HB) {
            const float *restrict panel = packed + (size_t)v0 * K;
            const int vb = V - v0 < HB ? V - v0 : HB;
#ifdef __AVX512F__
            __m512 acc[HB];
            for (int i = 0; i < HB; i++) acc[i] = _mm512_setzero_ps();
            for (int k = 0; k < K; k++) {
                const __m512 w = _mm512_loadu_ps(panel + (size_t)k * HB);
                _mm_prefetch((const char *)(panel + (size_t)k * HB + 1024), _MM_HINT_T0);
                for (int i = 0; i < HB; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i][k]), w, acc[i]);
            }
            const __mmask16 keep = (__mmask16)((1u << vb) - 1u);
            const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + v0) : _mm512_setzero_ps();
            for (int i = 0; i < mb; i++)
                _mm512_mask_storeu_ps(out + (size_t)(m0 + i) * V + v0, keep, bias ? _mm512_add_ps(acc[i], b) : acc[i]);
#else
            float acc[HB][HB];
            for (int i = 0; i < HB; i++)
                for (int j = 0; j < HB; j++) acc[i][j] = 0.0f;
            for (int k = 0; k < K; k++)
                for (int i = 0; i < HB; i++)
                    for (int j = 0; j < HB; j++) acc[i][j] += x[i][k] * panel[(size_t)k * HB + j];
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < vb; j++)
                    out[(size_t)(m0 + i) * V + v0 + j] = bias ? acc[i][j] + bias[v0 + j] : acc[i][j];
#endif
        }
    }
}
