/* The small per-row ops of a Llama decoder layer, on float32 rows, with a bfloat16 model's
 * values rounded where kvrelay's torch path (engine/models/llama.py) rounds them. Shared by
 * decode.c (a whole decode step in one call) and rows.c (the same ops for batched steps). */
#ifndef KVRELAY_ROWOPS_H
#define KVRELAY_ROWOPS_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "pool.h"
#include "vexp.h"

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float rnd(int dtype, float v) { return dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline float get(int dtype, const void *p, size_t i) {
    return dtype == DT_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void put(int dtype, void *p, size_t i, float v) {
    if (dtype == DT_F32) {
        ((float *)p)[i] = v;
    } else {
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    }
}

/* The sum of x[c]^2 in eight running partial sums (c mod 8), added pairwise at the end. */
static inline float sum_squares(int n, const float *x) {
    float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int c = 0;
    for (; c + 8 <= n; c += 8)
        for (int l = 0; l < 8; l++) part[l] += x[c + l] * x[c + l];
    float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; c < n; c++) ss += x[c] * x[c];
    return ss;
}

/* h = RMSNorm(x) * w over n values: float32 for a float32 model; for bfloat16, the normalized
 * value is rounded and then its product with the weight is (llama.rms_norm). */
static inline void norm_row(int dtype, int n, float eps, const float *x, const void *w, float *h) {
    const float inv = 1.0f / sqrtf(sum_squares(n, x) / (float)n + eps);
    if (dtype == DT_F32) {
        for (int c = 0; c < n; c++) h[c] = x[c] * inv * ((const float *)w)[c];
    } else {
        for (int c = 0; c < n; c++) h[c] = rnd(DT_BF16, get(DT_BF16, w, c) * rnd(DT_BF16, x[c] * inv));
    }
}

/* Rotates `heads` heads of head_dim values in place by half-split pairs (llama.apply_rope);
 * cos and sin hold head_dim / 2 values, already rounded to the model's dtype. */
static inline void rope_row(int dtype, int heads, int hd, const float *cos, const float *sin, float *row) {
    const int half = hd / 2;
    for (int hh = 0; hh < heads; hh++) {
        float *x = row + (size_t)hh * hd;
        for (int d = 0; d < half; d++) {
            const float x1 = x[d], x2 = x[d + half];
            x[d] = rnd(dtype, rnd(dtype, x1 * cos[d]) - rnd(dtype, x2 * sin[d]));
            x[d + half] = rnd(dtype, rnd(dtype, x2 * cos[d]) + rnd(dtype, x1 * sin[d]));
        }
    }
}

#if defined(__x86_64__) || defined(__i386__)
/* out[0:n8] = SiLU(g) = g * sigmoid(g), sigmoid from t = e^-|g| (never overflows): 1 / (1 + t)
 * for g >= 0, t / (1 + t) below. */
__attribute__((target("avx2,fma"))) static inline void silu_avx2(int n8, const float *g, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int c = 0; c < n8; c += 8) {
        const __m256 x = _mm256_loadu_ps(g + c);
        const __m256 t = exp_avx2(_mm256_or_ps(x, sign)); /* e^-|x| */
        const __m256 num = _mm256_blendv_ps(t, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, t))));
    }
}
#endif

/* act = SiLU(gate) * up over n values, each op rounded as torch's (F.silu, then the product). */
static inline void silu_mul_row(int dtype, int n, const float *gate, const float *up, float *act) {
    int c = 0;
#if defined(__x86_64__) || defined(__i386__)
    if (kv_use_avx2()) {
        c = n & ~7;
        silu_avx2(c, gate, act);
        for (int i = 0; i < c; i++) act[i] = rnd(dtype, rnd(dtype, act[i]) * up[i]);
    }
#endif
    for (; c < n; c++) { /* silu_avx2's formula, so a value's result does not depend on its position */
        const float t = expf(-fabsf(gate[c]));
        act[c] = rnd(dtype, rnd(dtype, gate[c] * ((gate[c] >= 0.0f ? 1.0f : t) / (1.0f + t))) * up[c]);
    }
}

#endif
