/* The elementwise parts of a Llama-family decoder layer that torch runs as several operators, each reading and
 * writing whole activations, here one pass each, forward and backward (grpo/fused.py wraps them as autograd
 * functions for training):
 *
 * lean_swiglu / lean_swiglu_grad: h = silu(g) * u, the gated MLP's activation, and (dg, du) from dh. torch runs
 *   silu, mul (forward), mul, mul, silu_backward (backward) and keeps silu(g) for backward as well.
 * lean_rms_norm / lean_rms_norm_grad: y = w * x / sqrt(mean(x^2) + eps) per row, in the operation order of
 *   transformers' Llama RMSNorm, and (dx, dw) from dy. torch runs ~6 operators forward and ~10 backward.
 *
 * Single-threaded, no allocation. AVX-512 where the CPU has it, else AVX2 (vecmath.h's GRPO_AVX2), else plain C; all
 * give the torch functions' results up to float32 rounding (tests/test_fused.py). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vecmath.h"

/* sigmoid(g) from exp(-|g|) (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below; NaN stays NaN. */
static inline float sigmoid1(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

#ifdef __AVX512F__
static inline __m512 sigmoid16(__m512 g) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 one = _mm512_set1_ps(1.0f), inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(inv, negative, e, inv);
}
#endif

#ifdef GRPO_AVX2
static inline __m256 sigmoid8(__m256 g) {
    const __m256 e = exp8(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  /* -|g|: the sign bit set */
    const __m256 one = _mm256_set1_ps(1.0f), inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    return _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
}
#endif

void lean_swiglu(int64_t n, const float *restrict g, const float *restrict u, float *restrict h) {
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= n; j += 16) {
        const __m512 gv = _mm512_loadu_ps(g + j);
        _mm512_storeu_ps(h + j, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid16(gv)), _mm512_loadu_ps(u + j)));
    }
#elif defined(GRPO_AVX2)
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        _mm256_storeu_ps(h + j, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid8(gv)), _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) h[j] = g[j] * sigmoid1(g[j]) * u[j];
}

/* With s = sigmoid(g): du = dh silu(g) = dh g s, dg = dh u silu'(g) = dh u s (1 + g (1 - s)). */
void lean_swiglu_grad(int64_t n, const float *restrict dh, const float *restrict g, const float *restrict u,
                      float *restrict dg, float *restrict du) {
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j + 16 <= n; j += 16) {
        const __m512 gv = _mm512_loadu_ps(g + j), s = sigmoid16(gv), d = _mm512_loadu_ps(dh + j);
        _mm512_storeu_ps(du + j, _mm512_mul_ps(d, _mm512_mul_ps(gv, s)));
        const __m512 slope = _mm512_mul_ps(s, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one));
        _mm512_storeu_ps(dg + j, _mm512_mul_ps(_mm512_mul_ps(d, _mm512_loadu_ps(u + j)), slope));
    }
#elif defined(GRPO_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j), s = sigmoid8(gv), d = _mm256_loadu_ps(dh + j);
        _mm256_storeu_ps(du + j, _mm256_mul_ps(d, _mm256_mul_ps(gv, s)));
        const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
        _mm256_storeu_ps(dg + j, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + j)), slope));
    }
#endif
    for (; j < n; j++) {
        const float s = sigmoid1(g[j]);
        du[j] = dh[j] * (g[j] * s);
        dg[j] = (dh[j] * u[j]) * (s * (1.0f + g[j] * (1.0f - s)));
    }
}

/* sum_k a[k] b[k] (vectorized: a float reduction the compiler would keep in order, one add at a time). */
static inline float dot(const float *restrict a, const float *restrict b, int32_t n) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int32_t k = 0; k < n; k += 16) {
        const __mmask16 m = lanes(n - k);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, b + k), acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float acc = 0.0f;
    int32_t k = 0;
#ifdef GRPO_AVX2
    __m256 acc8 = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) acc8 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc8);
    acc = sum8(acc8);
#endif
    for (; k < n; k++) acc += a[k] * b[k];
    return acc;
#endif
}

/* Per row i of x (rows, H): r[i] = 1 / sqrt(mean(x_i^2) + eps), y_i = w * (x_i * r[i]). */
void lean_rms_norm(int64_t rows, int32_t H, const float *restrict x, const float *restrict w, float eps,
                   float *restrict y, float *restrict r) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * H;
        float *yi = y + i * H;
        const float ri = 1.0f / sqrtf(dot(xi, xi, H) / (float)H + eps);
        r[i] = ri;
        for (int32_t k = 0; k < H; k++) yi[k] = w[k] * (xi[k] * ri);
    }
}

/* With n_i = x_i r_i and g = dy_i w: dx_i = r_i (g - n_i mean(g n_i)), dw += dy_i n_i (dw is added to). */
void lean_rms_norm_grad(int64_t rows, int32_t H, const float *restrict dy, const float *restrict x,
                        const float *restrict w, const float *restrict r, float *restrict dx, float *restrict dw) {
    for (int64_t i = 0; i < rows; i++) {
        const float *dyi = dy + i * H, *xi = x + i * H;
        float *dxi = dx + i * H;
        const float ri = r[i];
        for (int32_t k = 0; k < H; k++) {
            dxi[k] = dyi[k] * w[k];  /* g, for now */
            dw[k] += dyi[k] * (xi[k] * ri);
        }
        const float c = dot(dxi, xi, H) * ri / (float)H;  /* mean(g n_i) */
        for (int32_t k = 0; k < H; k++) dxi[k] = ri * (dxi[k] - xi[k] * ri * c);
    }
}
