/* A vectorized e^x shared by the CPU kernels (attention.c's softmax, rowops.h's SiLU). */
#ifndef KVRELAY_VEXP_H
#define KVRELAY_VEXP_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* e^x for x <= 0 (scores less their maximum), 8 at a time: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by its degree-6 Taylor-like minimax polynomial, 2^n put in the exponent bits. Relative
 * error about 2e-7; x below -87 (e^x under float's normal range) gives 0. */
__attribute__((target("avx2,fma"))) static inline __m256 exp_avx2(__m256 x) {
    const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(too_small, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

#endif
