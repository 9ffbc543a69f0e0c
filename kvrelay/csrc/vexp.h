/* A vectorized e^x shared by the CPU kernels (attention.c's softmax, rowops.h's SiLU). */
#ifndef KVRELAY_VEXP_H
#define KVRELAY_VEXP_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* e^x = 2^n e^r: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so that r is exact),
 * e^r by a degree-6 Taylor-like minimax polynomial, 2^n put in the exponent bits. Relative
 * error about 2e-7; x below -87 (e^x under float's normal range) gives 0. */
#define VEXP_MIN (-87.0f)
#define VEXP_LOG2E 1.44269504f
#define VEXP_LN2_HI 0.693359375f
#define VEXP_LN2_LO (-2.12194440e-4f)
#define VEXP_P0 1.9875691500e-4f
#define VEXP_P1 1.3981999507e-3f
#define VEXP_P2 8.3334519073e-3f
#define VEXP_P3 4.1665795894e-2f
#define VEXP_P4 1.6666665459e-1f
#define VEXP_P5 5.0000001201e-1f

/* e^x for x <= 0 (scores less their maximum), 8 at a time. */
__attribute__((target("avx2,fma"))) static inline __m256 exp_avx2(__m256 x) {
    const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(VEXP_MIN), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(VEXP_MIN));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(VEXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(VEXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(VEXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(VEXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(VEXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(VEXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(VEXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(VEXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(VEXP_P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(too_small, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

/* The same, 16 at a time (AVX-512). */
__attribute__((target("avx512f"))) static inline __m512 exp_avx512(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(VEXP_MIN), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(VEXP_MIN));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(VEXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VEXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VEXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(VEXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(VEXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(VEXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(VEXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(VEXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(VEXP_P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(bits));
}
#endif

#endif
