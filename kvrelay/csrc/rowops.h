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

#if defined(__x86_64__) || defined(__i386__)
#define ROWOPS_X86 1
/* rnd, get and put eight values at a time, with the same results as the scalar ones:
 * narrowing adds 0x7fff plus the kept part's lowest bit (round to nearest even) and keeps a
 * NaN a quiet NaN. */
__attribute__((target("avx2,fma"))) static inline __m256 rnd_bf16_avx2(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

__attribute__((target("avx2,fma"))) static inline __m256 rnd8(int dtype, __m256 v) {
    return dtype == DT_BF16 ? rnd_bf16_avx2(v) : v;
}

__attribute__((target("avx2,fma"))) static inline __m256 get8(int dtype, const void *p, size_t i) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma"))) static inline void put8(int dtype, void *p, size_t i, __m256 v) {
    if (dtype == DT_F32) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(rnd_bf16_avx2(v)), 16);
    /* pack the eight 32-bit lanes' low halves (values < 2^16, so no saturation) in order */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}

/* get_row and put_row for the first multiple of eight values; return how many. */
__attribute__((target("avx2,fma"))) static inline int get_row_avx2(int dtype, const void *p, size_t i, int n, float *dst) {
    int c = 0;
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(dst + c, get8(dtype, p, i + c));
    return c;
}

__attribute__((target("avx2,fma"))) static inline int put_row_avx2(int dtype, void *p, size_t i, int n, const float *src) {
    int c = 0;
    for (; c + 8 <= n; c += 8) put8(dtype, p, i + c, _mm256_loadu_ps(src + c));
    return c;
}

/* The same on 16 lanes (AVX-512), with the same integer rounding, so the same results; a
 * last 8 go through the AVX2 helpers. Conversions, norms, rotary, SiLU and residual adds of a
 * 2,048-token bfloat16 prefill step were ~8% of its time on 8 lanes (perf, BENCHMARKS.md). */
#define ROWOPS_AVX512 "avx512f,avx512bw,avx512vl,avx2,fma"

__attribute__((target(ROWOPS_AVX512))) static inline __m512 rnd_bf16_avx512(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i kept = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(kept, _mm512_set1_epi32((int)0xffff0000u)));
}

__attribute__((target(ROWOPS_AVX512))) static inline __m512 rnd16(int dtype, __m512 v) {
    return dtype == DT_BF16 ? rnd_bf16_avx512(v) : v;
}

__attribute__((target(ROWOPS_AVX512))) static inline __m512 get16(int dtype, const void *p, size_t i) {
    if (dtype == DT_F32) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

__attribute__((target(ROWOPS_AVX512))) static inline void put16(int dtype, void *p, size_t i, __m512 v) {
    if (dtype == DT_F32) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(rnd_bf16_avx512(v)), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(hi));
}

__attribute__((target(ROWOPS_AVX512))) static inline int get_row_avx512(int dtype, const void *p, size_t i, int n, float *dst) {
    int c = 0;
    for (; c + 16 <= n; c += 16) _mm512_storeu_ps(dst + c, get16(dtype, p, i + c));
    return c + get_row_avx2(dtype, p, i + c, n - c, dst + c);
}

__attribute__((target(ROWOPS_AVX512))) static inline int put_row_avx512(int dtype, void *p, size_t i, int n, const float *src) {
    int c = 0;
    for (; c + 16 <= n; c += 16) put16(dtype, p, i + c, _mm512_loadu_ps(src + c));
    return c + put_row_avx2(dtype, p, i + c, n - c, src + c);
}
#else
#define ROWOPS_X86 0
#endif

/* How many leading values the AVX2 helper `call` took (each returns its count; the scalar
 * loop after it does the rest): 0 on a CPU without AVX2 or a build for another architecture,
 * where `call` is not compiled. */
#if ROWOPS_X86
#define AVX2_PREFIX(call) (kv_use_avx2() ? (call) : 0)
/* The same with a 16-lane helper taken first where the CPU has AVX-512. */
#define VEC_PREFIX(call512, call256) (kv_use_avx512() ? (call512) : kv_use_avx2() ? (call256) : 0)
#else
#define AVX2_PREFIX(call) 0
#define VEC_PREFIX(call512, call256) 0
#endif

/* dst[0:n] = the values p[i:i+n] as float32; put_row writes them back rounded to dtype. */
static inline void get_row(int dtype, const void *p, size_t i, int n, float *dst) {
    for (int c = VEC_PREFIX(get_row_avx512(dtype, p, i, n, dst), get_row_avx2(dtype, p, i, n, dst)); c < n; c++)
        dst[c] = get(dtype, p, i + c);
}

static inline void put_row(int dtype, void *p, size_t i, int n, const float *src) {
    for (int c = VEC_PREFIX(put_row_avx512(dtype, p, i, n, src), put_row_avx2(dtype, p, i, n, src)); c < n; c++)
        put(dtype, p, i + c, src[c]);
}

#if ROWOPS_X86
/* sum_squares's eight partial sums, a vector's lanes (a product then a sum, as the scalar
 * loop: no fused multiply-add); returns how many values it took. */
__attribute__((target("avx2,fma"))) static inline int sum_squares_avx2(int n, const float *x, float *part) {
    __m256 acc = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    _mm256_storeu_ps(part, acc);
    return c;
}

/* add_rows for the first multiple of eight values; returns how many. */
__attribute__((target("avx2,fma"))) static inline size_t add_rows_avx2(int dtype, size_t count, float *x, const float *y) {
    size_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(x + i, rnd8(dtype, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i))));
    return i;
}

/* norm_row's products for the first multiple of eight values; returns how many. */
__attribute__((target("avx2,fma"))) static inline int norm_scale_avx2(int dtype, int n, float inv, const float *x,
                                                                     const void *w, float *h) {
    const __m256 iv = _mm256_set1_ps(inv);
    const int n8 = n & ~7;
    for (int c = 0; c < n8; c += 8) {
        const __m256 xn = _mm256_mul_ps(_mm256_loadu_ps(x + c), iv);
        if (dtype == DT_F32)
            _mm256_storeu_ps(h + c, _mm256_mul_ps(xn, _mm256_loadu_ps((const float *)w + c)));
        else
            _mm256_storeu_ps(h + c, rnd_bf16_avx2(_mm256_mul_ps(get8(DT_BF16, w, c), rnd_bf16_avx2(xn))));
    }
    return n8;
}

/* rope_row for one head, the first multiple of eight of its half pairs; returns how many. */
__attribute__((target("avx2,fma"))) static inline int rope_head_avx2(int dtype, int half, const float *cos, const float *sin,
                                                                    float *x) {
    const int half8 = half & ~7;
    for (int d = 0; d < half8; d += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + d), x2 = _mm256_loadu_ps(x + half + d);
        const __m256 c = _mm256_loadu_ps(cos + d), s = _mm256_loadu_ps(sin + d);
        _mm256_storeu_ps(x + d, rnd8(dtype, _mm256_sub_ps(rnd8(dtype, _mm256_mul_ps(x1, c)), rnd8(dtype, _mm256_mul_ps(x2, s)))));
        _mm256_storeu_ps(x + half + d, rnd8(dtype, _mm256_add_ps(rnd8(dtype, _mm256_mul_ps(x2, c)), rnd8(dtype, _mm256_mul_ps(x1, s)))));
    }
    return half8;
}
#endif

#if ROWOPS_X86
__attribute__((target(ROWOPS_AVX512))) static inline size_t add_rows_avx512(int dtype, size_t count, float *x, const float *y) {
    size_t i = 0;
    for (; i + 16 <= count; i += 16)
        _mm512_storeu_ps(x + i, rnd16(dtype, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i))));
    return i + add_rows_avx2(dtype, count - i, x + i, y + i);
}

__attribute__((target(ROWOPS_AVX512))) static inline int norm_scale_avx512(int dtype, int n, float inv, const float *x,
                                                                          const void *w, float *h) {
    const __m512 iv = _mm512_set1_ps(inv);
    const int n16 = n & ~15;
    for (int c = 0; c < n16; c += 16) {
        const __m512 xn = _mm512_mul_ps(_mm512_loadu_ps(x + c), iv);
        if (dtype == DT_F32)
            _mm512_storeu_ps(h + c, _mm512_mul_ps(xn, _mm512_loadu_ps((const float *)w + c)));
        else
            _mm512_storeu_ps(h + c, rnd_bf16_avx512(_mm512_mul_ps(get16(DT_BF16, w, c), rnd_bf16_avx512(xn))));
    }
    const void *w_rest = dtype == DT_F32 ? (const void *)((const float *)w + n16) : (const void *)((const uint16_t *)w + n16);
    return n16 + norm_scale_avx2(dtype, n - n16, inv, x + n16, w_rest, h + n16);
}

/* rope_head_avx2 on 16 lanes; a head whose half is not a multiple of 16 leaves the rest to
 * the scalar loop (the same formulas). */
__attribute__((target(ROWOPS_AVX512))) static inline int rope_head_avx512(int dtype, int half, const float *cos, const float *sin,
                                                                         float *x) {
    const int half16 = half & ~15;
    for (int d = 0; d < half16; d += 16) {
        const __m512 x1 = _mm512_loadu_ps(x + d), x2 = _mm512_loadu_ps(x + half + d);
        const __m512 c = _mm512_loadu_ps(cos + d), s = _mm512_loadu_ps(sin + d);
        _mm512_storeu_ps(x + d, rnd16(dtype, _mm512_sub_ps(rnd16(dtype, _mm512_mul_ps(x1, c)), rnd16(dtype, _mm512_mul_ps(x2, s)))));
        _mm512_storeu_ps(x + half + d, rnd16(dtype, _mm512_add_ps(rnd16(dtype, _mm512_mul_ps(x2, c)), rnd16(dtype, _mm512_mul_ps(x1, s)))));
    }
    return half16;
}
#endif

/* x[0:count] = x + y, rounded to dtype (a residual add, as torch's). */
static inline void add_rows(int dtype, size_t count, float *x, const float *y) {
    for (size_t i = VEC_PREFIX(add_rows_avx512(dtype, count, x, y), add_rows_avx2(dtype, count, x, y)); i < count; i++)
        x[i] = rnd(dtype, x[i] + y[i]);
}

/* The sum of x[c]^2 in eight running partial sums (c mod 8), added pairwise at the end. */
static inline float sum_squares(int n, const float *x) {
    float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int c = AVX2_PREFIX(sum_squares_avx2(n, x, part));
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
    const int c0 = VEC_PREFIX(norm_scale_avx512(dtype, n, inv, x, w, h), norm_scale_avx2(dtype, n, inv, x, w, h));
    if (dtype == DT_F32) {
        for (int c = c0; c < n; c++) h[c] = x[c] * inv * ((const float *)w)[c];
    } else {
        for (int c = c0; c < n; c++) h[c] = rnd(DT_BF16, get(DT_BF16, w, c) * rnd(DT_BF16, x[c] * inv));
    }
}

/* Rotates `heads` heads of head_dim values in place by half-split pairs (llama.apply_rope);
 * cos and sin hold head_dim / 2 values, already rounded to the model's dtype. */
static inline void rope_row(int dtype, int heads, int hd, const float *cos, const float *sin, float *row) {
    const int half = hd / 2;
    for (int hh = 0; hh < heads; hh++) {
        float *x = row + (size_t)hh * hd;
        for (int d = VEC_PREFIX(rope_head_avx512(dtype, half, cos, sin, x), rope_head_avx2(dtype, half, cos, sin, x)); d < half;
             d++) {
            const float x1 = x[d], x2 = x[d + half];
            x[d] = rnd(dtype, rnd(dtype, x1 * cos[d]) - rnd(dtype, x2 * sin[d]));
            x[d + half] = rnd(dtype, rnd(dtype, x2 * cos[d]) + rnd(dtype, x1 * sin[d]));
        }
    }
}

#if ROWOPS_X86
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

/* silu_mul_row for the first multiple of eight values (SiLU, rounded, times up, rounded);
 * returns how many. */
__attribute__((target("avx2,fma"))) static inline int silu_mul_avx2(int dtype, int n, const float *gate, const float *up, float *act) {
    const int n8 = n & ~7;
    silu_avx2(n8, gate, act);
    for (int i = 0; i < n8; i += 8)
        _mm256_storeu_ps(act + i, rnd8(dtype, _mm256_mul_ps(rnd8(dtype, _mm256_loadu_ps(act + i)), _mm256_loadu_ps(up + i))));
    return n8;
}
#endif

#if ROWOPS_X86
/* silu_mul_avx2 on 16 lanes (exp_avx512 is exp_avx2's formula), a last 8 on 8. */
__attribute__((target(ROWOPS_AVX512))) static inline int silu_mul_avx512(int dtype, int n, const float *gate, const float *up,
                                                                        float *act) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const int n16 = n & ~15;
    for (int c = 0; c < n16; c += 16) {
        const __m512 x = _mm512_loadu_ps(gate + c);
        const __m512 t = exp_avx512(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign))); /* e^-|x| */
        const __m512 num = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), one);
        const __m512 silu = _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(one, t)));
        _mm512_storeu_ps(act + c, rnd16(dtype, _mm512_mul_ps(rnd16(dtype, silu), _mm512_loadu_ps(up + c))));
    }
    return n16 + silu_mul_avx2(dtype, n - n16, gate + n16, up + n16, act + n16);
}
#endif

/* act = SiLU(gate) * up over n values, each op rounded as torch's (F.silu, then the product). */
static inline void silu_mul_row(int dtype, int n, const float *gate, const float *up, float *act) {
    /* the tail uses silu_avx2's formula, so a value's result does not depend on its position */
    for (int c = VEC_PREFIX(silu_mul_avx512(dtype, n, gate, up, act), silu_mul_avx2(dtype, n, gate, up, act)); c < n; c++) {
        const float t = expf(-fabsf(gate[c]));
        act[c] = rnd(dtype, rnd(dtype, gate[c] * ((gate[c] >= 0.0f ? 1.0f : t) / (1.0f + t))) * up[c]);
    }
}

#endif
