/* One core reading a [k, n] weight for y = x @ w, x one row: rows taken eight adjacent at a
 * time (gemv.c before) against one row from each of eight equal spans (gemv.c now). Built
 * and run by gemv_streams.py; prints "shape dtype order GB/s" lines. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ROWS 8

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx2,fma"))) static inline __m256 load8(const void *w, int bf16, size_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* spans = 0: rows k, k+1, ..., k+7; spans = 1: rows i, i+span, ..., i+7*span */
__attribute__((target("avx2,fma"))) static void product(const void *w, int bf16, const float *x, int k, int n, int spans, float *out) {
    memset(out, 0, sizeof(float) * n);
    const int steps = k / ROWS, span = k / ROWS;
    for (int i = 0; i < steps; i++) {
        size_t base[ROWS];
        __m256 xb[ROWS];
        for (int d = 0; d < ROWS; d++) {
            const int row = spans ? i + d * span : i * ROWS + d;
            base[d] = (size_t)row * n;
            xb[d] = _mm256_set1_ps(x[row]);
        }
        for (int c = 0; c + 8 <= n; c += 8) {
            __m256 acc = _mm256_loadu_ps(out + c);
            for (int d = 0; d < ROWS; d++) acc = _mm256_fmadd_ps(xb[d], load8(w, bf16, base[d] + c), acc);
            _mm256_storeu_ps(out + c, acc);
        }
    }
}

int main(int argc, char **argv) {
    const size_t total = argc > 1 ? (size_t)atoll(argv[1]) : (size_t)400 << 20; /* bytes streamed per run */
    const int shapes[][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
    float *x = malloc(sizeof(float) * 4096), *out = malloc(sizeof(float) * 4096);
    for (int i = 0; i < 4096; i++) x[i] = 0.001f * (i % 17);
    for (int s = 0; s < 4; s++) {
        const int k = shapes[s][0], n = shapes[s][1];
        for (int bf16 = 0; bf16 < 2; bf16++) {
            const size_t bytes = (size_t)k * n * (bf16 ? 2 : 4), copies = total / bytes;
            unsigned char *w = aligned_alloc(64, (bytes * copies + 63) / 64 * 64);
            for (size_t i = 0; i < (size_t)k * n * copies; i++) { /* normal numbers near 1 (no denormals) */
                if (bf16) {
                    ((uint16_t *)w)[i] = (uint16_t)(0x3f80 + i % 61);
                } else {
                    ((float *)w)[i] = 1.0f + (float)(i % 61) / 64.0f;
                }
            }
            double best[2] = {1e30, 1e30};
            for (int rep = 0; rep < 5; rep++) {
                for (int spans = 0; spans < 2; spans++) { /* interleaved */
                    double t = now();
                    for (size_t c = 0; c < copies; c++) product(w + c * bytes, bf16, x, k, n, spans, out);
                    t = now() - t;
                    if (t < best[spans]) best[spans] = t;
                }
            }
            for (int spans = 0; spans < 2; spans++)
                printf("%dx%d %s %s %.2f\n", k, n, bf16 ? "bfloat16" : "float32", spans ? "spans" : "adjacent",
                       (double)(bytes * copies) / best[spans] / 1e9);
            free(w);
        }
    }
    return 0;
}
