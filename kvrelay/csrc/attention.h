/*
 * What attention.c (a row per query: decode tokens, the step's dispatch) and
 * attention_blocks.c (prefill segments' consecutive tokens in blocks) share: the job, the
 * pool's addressing and a few helpers. See attention.c's comment for the pool layout.
 */
#ifndef KVRELAY_ATTENTION_H
#define KVRELAY_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"
#include "vexp.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_X86 1
#else
#define KV_X86 0
#endif

#define MAX_HEAD_DIM 256
#define MAX_Q_PER_KV 16

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

typedef struct {
    int dtype, q_heads, kv_heads, head_dim, block_size, max_blocks, window;
    int heads_per_piece; /* kv heads one piece of work covers: all of them for a batch */
    float scale;
    const void *q;   /* [T, q_heads, head_dim] */
    const void *k;   /* [num_blocks, block_size, kv_heads, head_dim] */
    const void *v;
    const int64_t *rows;     /* [n] row of each sequence's query in q and out */
    const int32_t *tables;   /* [n, max_blocks] */
    const int32_t *ctx_lens; /* [n] keys each query attends over, its own included */
    const int32_t *row_table; /* [n] the table row of each query, NULL: its own (row i) */
    void *out;               /* [T, q_heads, head_dim], q's dtype */
} AttnJob;

#define KV_AVX512 "avx512f,avx512bw,avx512vl,avx2,fma"
#define KV_AVX512_BF16 "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"

/* Query i's block table. */
static inline const int32_t *table_of(const AttnJob *j, int i) {
    const int r = j->row_table != NULL ? j->row_table[i] : i;
    return j->tables + (size_t)r * j->max_blocks;
}

/* Row `index` (head_dim elements) of a float32 or bfloat16 array: a float32 row in place,
 * a bfloat16 one widened into buf. */
static inline const float *row_f32(const AttnJob *j, const void *base, size_t index, float *buf) {
    const size_t off = index * (size_t)j->head_dim;
    if (j->dtype == DT_F32) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    for (int d = 0; d < j->head_dim; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* Pool rows (of [num_blocks * block_size * kv_heads]) of keys t0..t0+nt-1 of sequence i, head h:
 * one division per tile, then a walk through the blocks. */
static inline void key_rows(const AttnJob *j, int i, int t0, int nt, int h, size_t *rows) {
    const int32_t *table = table_of(j, i);
    int b = t0 / j->block_size, off = t0 % j->block_size;
    for (int t = 0; t < nt; t++) {
        rows[t] = ((size_t)table[b] * j->block_size + off) * j->kv_heads + h;
        if (++off == j->block_size) {
            off = 0;
            b++;
        }
    }
}

static inline int min_int(int a, int b) { return a < b ? a : b; }

#if KV_X86
/* Pool rows rows[0..nt-1] of base (K or V) as float32 rows: a float32 pool's in place, a
 * bfloat16 pool's widened into buf [nt][head_dim]; out[nt..] up to a multiple of 8 repeat
 * row 0 (scored, never used). */
__attribute__((target("avx2,fma"))) static inline void tile_rows_avx2(const AttnJob *j, const void *base, const size_t *rows, int nt,
                                                              float *buf, const float **out) {
    const int hd = j->head_dim;
    for (int t = 0; t < nt; t++) {
        const size_t off = rows[t] * (size_t)hd;
        if (j->dtype == DT_F32) {
            out[t] = (const float *)base + off;
            continue;
        }
        const uint16_t *src = (const uint16_t *)base + off;
        float *dst = buf + (size_t)t * hd;
        for (int d = 0; d < hd; d += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(src + d));
            _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
        out[t] = dst;
    }
    for (int t = nt; t < ((nt + 7) & ~7); t++) out[t] = out[0];
}
#endif

#if KV_X86
/* o[0..n-1] = bfloat16(x * inv), n a multiple of 16: VCVTNEPS2BF16 rounds to nearest even and
 * keeps a NaN a NaN, as f32_to_bf16. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline void scale_to_bf16_avx512(const float *x, float inv, int n, uint16_t *o) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int d = 0; d < n; d += 16)
        _mm256_storeu_si256((__m256i *)(o + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + d), s)));
}
#endif

/* Prefill blocks (attention_blocks.c): the query rows i0..i0+count-1, one segment's
 * consecutive tokens, for every kv head; 0, or -1 when out of memory (nothing written). */
#define BLOCK_QUERIES 48      /* attend_block_bf16's query vectors a block (3 of 16) */
#define BLOCK_QUERIES_AVX2 24 /* attend_block_avx2's (3 of 8) */
#if KV_X86
__attribute__((visibility("hidden"))) int attend_block_bf16(const AttnJob *j, int i0, int count);
__attribute__((visibility("hidden"))) int attend_block_avx2(const AttnJob *j, int i0, int count);
#endif

#endif
