/* exp for softmax-style arguments, shared by lean_step.c and softmax.c: a scalar version that compilers can
 * inline anywhere and, where the CPU has AVX-512, a 16-lane one. Both compute 2^n * p(r) with |r| <= ln2/2 and
 * p a degree-7 Taylor polynomial (relative error < 2e-7), and return 0 below -87 (where float32 exp underflows),
 * so -inf (a filtered logit) gives 0, and NaN stays NaN. Meant for arguments <= 0 (after subtracting a maximum);
 * positive ones are exact up to 88 (hidden_loss's seeded pass gives them up to its cap; past 88 the 16-lane one
 * returns inf). The 16-lane one scales by 2^n with one scalef instruction (14% faster per exp_sums element than
 * building 2^n from its exponent bits, 0.40 against 0.47 ns). exp_sums, the softmax pass built on them, is shared
 * too. */
#ifndef GRPO_VECMATH_H
#define GRPO_VECMATH_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define GRPO_AVX2 1  /* the 8-lane paths, for CPUs with AVX2 and FMA but no AVX-512 (the scalar exp's branch keeps
                      * compilers from vectorizing the loops that call it: SiLU's pass ran ~7 ns per element) */
#endif

static inline float exp_nonpositive(float x) {
    if (!(x >= -87.0f)) return x == x ? 0.0f : x;  /* NaN returns before the (undefined) cast of NaN to int */
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t i; float f; } scale = {.i = (uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* max(x, -88) that keeps NaN (fmaxf would drop it): where exp is 0 anyway, and 0 * d stays finite for -inf. */
static inline float floor88(float x) { return x < -88.0f ? -88.0f : x; }

#ifdef __AVX512F__
static inline __m512 exp16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);  /* x >= -87, or NaN */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  /* max returns its second operand for NaN: NaN stays NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);  /* p 2^n in one instruction; inf past 88 */
}

/* The lanes of a 16-wide step that are inside a row with `left` entries to go. */
static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }
#endif

#ifdef GRPO_AVX2
/* exp16's 8-lane twin: the same polynomial; 2^n built from its exponent bits (no scalef without AVX-512). */
static inline __m256 exp8(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ);  /* x >= -87, or NaN */
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  /* max returns its second operand for NaN: NaN stays NaN */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* n in [-126, 128]: 2^n = (n + 127) << 23 as float bits, inf at n = 128 (x past 88), as exp16 */
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);
}

static inline float sum8(__m256 v) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

/* sum_j e_j, and sum_j e_j d_j into *sum_ed when it is not NULL, with d_j = max(r_j - top, -88) and e_j = exp(d_j)
 * (0 for -inf entries; NaN stays NaN: the floor keeps it). With `out`, e_j is also written to out[j] (out may be
 * r). The softmax of attention scores, of a sampled row's blocks, and of the LM head's logit tiles. */
static inline float exp_sums(const float *r, int64_t n, float top, float *out, float *sum_ed) {
#ifdef __AVX512F__
    __m512 se = _mm512_setzero_ps(), sd = _mm512_setzero_ps();
    const __m512 t = _mm512_set1_ps(top), floor = _mm512_set1_ps(-88.0f);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = lanes(n - j);
        const __m512 d = _mm512_maskz_max_ps(k, floor, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + j), t));
        const __m512 e = _mm512_maskz_mov_ps(k, exp16(d));
        se = _mm512_add_ps(se, e);
        sd = _mm512_fmadd_ps(e, d, sd);
        if (out) _mm512_mask_storeu_ps(out + j, k, e);
    }
    if (sum_ed) *sum_ed = _mm512_reduce_add_ps(sd);
    return _mm512_reduce_add_ps(se);
#else
    float se = 0.0f, sd = 0.0f;
    int64_t j = 0;
#ifdef GRPO_AVX2
    __m256 se8 = _mm256_setzero_ps(), sd8 = _mm256_setzero_ps();
    const __m256 t = _mm256_set1_ps(top), floor = _mm256_set1_ps(-88.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 d = _mm256_max_ps(floor, _mm256_sub_ps(_mm256_loadu_ps(r + j), t));
        const __m256 e = exp8(d);
        se8 = _mm256_add_ps(se8, e);
        sd8 = _mm256_fmadd_ps(e, d, sd8);
        if (out) _mm256_storeu_ps(out + j, e);
    }
    se = sum8(se8);
    sd = sum8(sd8);
#endif
    for (; j < n; j++) {
        const float d = floor88(r[j] - top), e = exp_nonpositive(d);
        se += e;
        sd += e * d;
        if (out) out[j] = e;
    }
    if (sum_ed) *sum_ed = sd;
    return se;
#endif
}

#endif
