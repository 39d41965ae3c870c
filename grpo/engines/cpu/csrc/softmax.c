/* Softmax passes over float32 logits that torch would run as 5-8 separate operators, each reading and writing the
 * whole (rows, V) tensor: here one or two passes per row, with the exp vectorized (vecmath.h). grpo/native.py
 * builds this file with lean_step.c.
 *
 * lean_sample: one token per row by inverse CDF, the two-level search of grpo.generation.sample_rows
 *   (block sums of 1,024 entries, a float64 running sum over blocks, a float64 running sum inside the chosen
 *   block).
 * lean_tile_stats / lean_tile_grad / lean_tile_exp / lean_tile_shifted_exp: the elementwise part of one
 *   (positions x vocabulary block) tile of grpo.engines.head.logprobs' tiled LM head: the running log-sum-exp of the
 *   forward, d loss / d logits of the backward, the exps of hidden_loss's one-pass buffer and of its seeded pass.
 *
 * Single-threaded, no allocation. AVX-512 where the CPU has it, otherwise plain C; both give the torch
 * functions' results up to float32 rounding (tests/test_native.py).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vecmath.h"

/* max_j r[j] (NaN if any entry is NaN), after multiplying the row by `scale` in place when scale != 1. */
static float row_max(float *restrict r, int64_t n, float scale) {
#ifdef __AVX512F__
    __m512 top = _mm512_set1_ps(-INFINITY);
    const __m512 by = _mm512_set1_ps(scale);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = lanes(n - j);
        __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, r + j);
        if (scale != 1.0f) {
            v = _mm512_mul_ps(v, by);
            _mm512_mask_storeu_ps(r + j, k, v);
        }
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    return nan ? NAN : _mm512_reduce_max_ps(top);
#else
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        if (scale != 1.0f) r[j] *= scale;
        if (r[j] != r[j]) return NAN;
        top = r[j] > top ? r[j] : top;
    }
    return top;
#endif
}

#define CDF_BLOCK 1024

/* Floats of scratch memory lean_sample needs (one row's block running sums, as doubles, and one block's exps). */
int64_t lean_sample_scratch_floats(int32_t V) { return 2 * (int64_t)((V + CDF_BLOCK - 1) / CDF_BLOCK) + CDF_BLOCK; }

/* tokens[i] and logprobs[i] for each row i of logits (rows, V), drawn with uniforms[i] in [0, 1): token t when
 * cdf[t-1] <= u * total < cdf[t], where cdf sums exp(logit - max) left to right. Returns -1, or the first row whose
 * logits are non-finite or all -inf (nothing is sampled from it). */
int32_t lean_sample(int32_t rows, int32_t V, const float *restrict logits, const double *restrict uniforms,
                    float *restrict scratch, int64_t *restrict tokens, float *restrict logprobs) {
    const int64_t blocks = (V + CDF_BLOCK - 1) / CDF_BLOCK;
    double *restrict cdf = (double *)scratch;
    float *restrict e = scratch + 2 * blocks;
    for (int i = 0; i < rows; i++) {
        const float *r = logits + (size_t)i * V;
        const float top = row_max((float *)r, V, 1.0f);  /* scale 1: nothing is written */
        if (!isfinite(top)) return i;
        double total = 0.0;
        int64_t last = -1;  /* the last block with mass */
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n = V - b * CDF_BLOCK < CDF_BLOCK ? V - b * CDF_BLOCK : CDF_BLOCK;
            const float s = exp_sums(r + b * CDF_BLOCK, n, top, NULL, NULL);
            total += (double)s;
            cdf[b] = total;
            if (s > 0.0f) last = b;
        }
        if (!(total > 0.0) || !isfinite(total)) return i;
        const double target = uniforms[i] * total;
        int64_t block = 0;
        while (block < blocks && cdf[block] <= target) block++;
        if (block > last) block = last;  /* a target rounded up to the total: not past the last block with mass */
        const int64_t start = block * CDF_BLOCK, n = V - start < CDF_BLOCK ? V - start : CDF_BLOCK;
        exp_sums(r + start, n, top, e, NULL);  /* the same exps the block's sum was made of */
        double running = block > 0 ? cdf[block - 1] : 0.0;
        int64_t offset = 0, last_positive = n - 1;
        for (int64_t j = 0; j < n; j++) {
            running += (double)e[j];
            offset += running <= target;
            if (e[j] > 0.0f) last_positive = j;
        }
        if (offset >= n) offset = last_positive;  /* rounding left the target past the block's own sum */
        tokens[i] = start + offset;
        logprobs[i] = (r[start + offset] - top) - (float)log(total);
    }
    return -1;
}

/* One (m, b) tile of logits (row stride ld) of the LM head's forward, vocabulary entries v0 .. v0+b: scale the
 * tile by inv_t in place (1 / temperature), take target[i] = x[i, y[i] - v0] for the rows whose target is in the
 * tile, and fold the tile into each row's running max M, s = sum exp(x - M) and, when s2 is not NULL,
 * s2 = sum exp(x - M) (x - M). When the max moves from M to M', s and s2 are rescaled by exp(M - M') and s2 also
 * gains (M - M') s. Rows start from M = -inf, s = s2 = 0. */
void lean_tile_stats(int32_t m, int32_t b, int64_t ld, float *restrict x, float inv_t, const int64_t *restrict y,
                     int64_t v0, float *restrict target, float *restrict run_max, float *restrict s,
                     float *restrict s2) {
    for (int i = 0; i < m; i++) {
        float *restrict r = x + (size_t)i * ld;
        const float top = row_max(r, b, inv_t);
        const int64_t t = y[i] - v0;
        if (t >= 0 && t < b) target[i] = r[t];
        if (top != top) {  /* a NaN logit: the row's statistics become NaN, as torch's would */
            run_max[i] = s[i] = NAN;
            if (s2) s2[i] = NAN;
            continue;
        }
        const float old = run_max[i], now = old > top ? old : top;
        if (now == -INFINITY) continue;  /* every entry so far is -inf: nothing to add yet */
        float sum_ed;
        const float sum_e = exp_sums(r, b, now, NULL, &sum_ed);
        const float shift = old == -INFINITY ? 0.0f : old - now, rescale = old == -INFINITY ? 0.0f : expf(shift);
        if (s2) s2[i] = rescale * (s2[i] + shift * s[i]) + sum_ed;
        s[i] = rescale * s[i] + sum_e;
        run_max[i] = now;
    }
}

/* x <- exp(x - row_max) in place for one (m, b) tile of logits whose rows' maxima over the whole vocabulary are
 * known, adding sum exp(x - row_max) to s and, when s2 is not NULL, sum exp(x - row_max) (x - row_max) to s2. */
void lean_tile_exp(int32_t m, int32_t b, int64_t ld, float *restrict x, const float *restrict row_max,
                   float *restrict s, float *restrict s2) {
    for (int i = 0; i < m; i++) {
        float *r = x + (size_t)i * ld, sum_ed;
        s[i] += exp_sums(r, b, row_max[i], r, &sum_ed);
        if (s2) s2[i] += sum_ed;
    }
}

/* x <- exp(min(x - shift_i, cap)) in place for one (m, b) tile of hidden_loss's seeded pass, whose rows are shifted
 * by an estimate of their log-sum-exp instead of their maximum (so x - shift is about <= 0), adding sum e to s and,
 * when s2 is not NULL, sum e d to s2 with d = min(max(x - shift, -88), cap), and folding each row's largest
 * x - shift_i before capping into top (NaN entries are passed over there; they reach s and s2). */
void lean_tile_shifted_exp(int32_t m, int32_t b, int64_t ld, float *restrict x, const float *restrict shift,
                           float cap, float *restrict s, float *restrict s2, float *restrict top) {
    for (int i = 0; i < m; i++) {
        float *restrict r = x + (size_t)i * ld, row_top, sum_e, sum_ed;
#ifdef __AVX512F__
        __m512 se = _mm512_setzero_ps(), sd = _mm512_setzero_ps(), hi = _mm512_set1_ps(-INFINITY);
        const __m512 t = _mm512_set1_ps(shift[i]), floor = _mm512_set1_ps(-88.0f), c = _mm512_set1_ps(cap);
        for (int64_t j = 0; j < b; j += 16) {
            const __mmask16 k = lanes(b - j);
            __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + j), t);
            hi = _mm512_mask_max_ps(hi, k, d, hi);  /* max(d, hi) is hi where d is NaN */
            d = _mm512_min_ps(c, _mm512_max_ps(floor, d));  /* both keep NaN (the second operand) */
            const __m512 e = _mm512_maskz_mov_ps(k, exp16(d));
            se = _mm512_add_ps(se, e);
            sd = _mm512_fmadd_ps(e, d, sd);
            _mm512_mask_storeu_ps(r + j, k, e);
        }
        row_top = _mm512_reduce_max_ps(hi), sum_e = _mm512_reduce_add_ps(se), sum_ed = _mm512_reduce_add_ps(sd);
#else
        row_top = -INFINITY, sum_e = 0.0f, sum_ed = 0.0f;
        for (int64_t j = 0; j < b; j++) {
            float d = r[j] - shift[i];
            row_top = d > row_top ? d : row_top;  /* false for NaN */
            d = floor88(d);
            d = d > cap ? cap : d;
            const float e = exp_nonpositive(d);
            sum_e += e;
            sum_ed += e * d;
            r[j] = e;
        }
#endif
        s[i] += sum_e;
        if (s2) s2[i] += sum_ed;
        top[i] = row_top > top[i] ? row_top : top[i];
    }
}

/* The backward of one such tile, in place: x[i, j] <- -p_ij (g_i + gh_i (log p_ij + H_i)) with
 * log p_ij = x_ij inv_t - lse_i: d loss / d logits without the target column's +g_i (added by the caller), for
 * d loss / d logp = g and, when gh is not NULL, d loss / d entropy = gh and the entropies H. A NaN logit or lse
 * gives NaN (so the trainer's non-finite check sees it); log p is floored at -88 elsewhere, where p is 0 anyway. */
void lean_tile_grad(int32_t m, int32_t b, int64_t ld, float *restrict x, float inv_t, const float *restrict lse,
                    const float *restrict g, const float *restrict gh, const float *restrict entropy) {
    for (int i = 0; i < m; i++) {
        float *restrict r = x + (size_t)i * ld;
        const float l = lse[i], gi = g[i], ghi = gh ? gh[i] : 0.0f, hi = gh ? entropy[i] : 0.0f;
#ifdef __AVX512F__
        const __m512 vl = _mm512_set1_ps(l), vg = _mm512_set1_ps(gi), vgh = _mm512_set1_ps(ghi),
                     vh = _mm512_set1_ps(hi), by = _mm512_set1_ps(inv_t), floor = _mm512_set1_ps(-88.0f);
        for (int64_t j = 0; j < b; j += 16) {
            const __mmask16 k = lanes(b - j);
            /* max(floor, NaN) is NaN: a NaN logit or lse stays NaN (torch gives NaN there too) */
            const __m512 log_p = _mm512_max_ps(floor, _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, r + j), by, vl));
            const __m512 factor = _mm512_fmadd_ps(vgh, _mm512_add_ps(log_p, vh), vg);
            _mm512_mask_storeu_ps(r + j, k, _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), exp16(log_p)), factor));
        }
#else
        for (int64_t j = 0; j < b; j++) {
            const float log_p = floor88(r[j] * inv_t - l);
            r[j] = -exp_nonpositive(log_p) * (gi + ghi * (log_p + hi));
        }
#endif
    }
}
