/*
 * The vector steps of CPU paged attention over one tile of keys (attention.c walks the keys;
 * see its comment): a tile's scores against a kv head's query group, a chunk's softmax with
 * the running maximum, sum and output rescaled once, and a tile's values weighted into the
 * output. AVX2 (8 lanes; a bfloat16 pool widened in registers), AVX-512 (16 lanes), and
 * AVX-512 BF16 (a bfloat16 pool's scores and values as VDPBF16PS dot products, exact
 * products summed in float32).
 */
#include "attention_tiles.h"

#if KV_X86
/* The sums of a[0..7]'s lanes, as one vector (lane i = the sum of a[i]). */
__attribute__((target("avx2,fma"))) static inline __m256 hsum8_avx2(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);
    /* lo = [0 1 2 3 | 0 1 2 3] halves, hi likewise for 4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* Scores of a tile's keys (rows[0..nt-1], one kv head's) against the head's query group:
 * s[g * CHUNK_STRIDE + t]; eight keys at a time into eight accumulators reduced together
 * (lanes past nt are written, never read). */
__attribute__((target("avx2,fma"))) static void score_tile_avx2(const AttnJob *j, Piece *p, const size_t *rows, int nt, float *s) {
    const int hd = j->head_dim, padded = (nt + 7) & ~7, qpk = j->q_heads / j->kv_heads;
    const float *kr[TILE];
    tile_rows_avx2(j, j->k, rows, nt, p->tile, kr);
    for (int g = 0; g < qpk; g++) {
        for (int t = 0; t < padded; t += 8) {
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8) {
                const __m256 qv = _mm256_loadu_ps(p->q[g] + d);
                for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t + u] + d), acc[u]);
            }
            _mm256_storeu_ps(s + (size_t)g * CHUNK_STRIDE + t, hsum8_avx2(acc));
        }
    }
}

/* A chunk's scores s[g][0..cn-1] become e^(score - the chunk's maximum); each query head's
 * maximum and sum are the chunk's. Every chunk is a partial of its own (attention.c's
 * attend_chunks clears the piece before it and folds it into the keys before it afterwards),
 * so there is no running state to rescale: the output is still zero here. */
__attribute__((target("avx2,fma"))) static void softmax_chunk_avx2(const AttnJob *j, Piece *p, float *s, int cn) {
    const int qpk = j->q_heads / j->kv_heads, padded = (cn + 7) & ~7;
    for (int g = 0; g < qpk; g++) {
        float *sg = s + (size_t)g * CHUNK_STRIDE;
        for (int t = cn; t < padded; t++) sg[t] = -INFINITY; /* e^-inf = 0: no lane is skipped */
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int t = 0; t < padded; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + t));
        float lanes[8], max = -INFINITY, sum = 0.0f;
        _mm256_storeu_ps(lanes, mv);
        for (int u = 0; u < 8; u++) max = lanes[u] > max ? lanes[u] : max;
        const __m256 m = _mm256_set1_ps(max);
        __m256 sv = _mm256_setzero_ps();
        for (int t = 0; t < padded; t += 8) {
            const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m));
            _mm256_storeu_ps(sg + t, e);
            sv = _mm256_add_ps(sv, e);
        }
        _mm256_storeu_ps(lanes, sv);
        for (int u = 0; u < 8; u++) sum += lanes[u];
        p->run_sum[g] = sum;
        p->run_max[g] = max;
    }
}

/* The tile's values weighted by their probabilities s[g * CHUNK_STRIDE + t], added to the
 * output: a query head's 64-column slice stays in registers over the tile. A loop over the
 * group's heads inside the key loop would index an accumulator array by a run-time count,
 * which the compiler keeps in memory: every multiply-add then waits on a store and a load
 * (4x slower, measured). */
__attribute__((target("avx2,fma"))) static void value_tile_avx2(const AttnJob *j, Piece *p, const size_t *rows, int nt, const float *s) {
    const int hd = j->head_dim, qpk = j->q_heads / j->kv_heads;
    const float *vr[TILE];
    tile_rows_avx2(j, j->v, rows, nt, p->tile, vr);
    for (int g = 0; g < qpk; g++) {
        const float *sg = s + (size_t)g * CHUNK_STRIDE;
        int d = 0;
        for (; d + 64 <= hd; d += 64) {
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_loadu_ps(p->acc[g] + d + 8 * u);
            for (int t = 0; t < nt; t++) {
                const __m256 w = _mm256_set1_ps(sg[t]);
                for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr[t] + d + 8 * u), acc[u]);
            }
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(p->acc[g] + d + 8 * u, acc[u]);
        }
        for (; d < hd; d += 8) {
            __m256 acc = _mm256_loadu_ps(p->acc[g] + d);
            for (int t = 0; t < nt; t++) acc = _mm256_fmadd_ps(_mm256_set1_ps(sg[t]), _mm256_loadu_ps(vr[t] + d), acc);
            _mm256_storeu_ps(p->acc[g] + d, acc);
        }
    }
}

/* The sums of a[0..15]'s lanes, as one vector (lane t = the sum of a[t]): pairs of vectors
 * folded within 128-bit lanes, then across them. */
__attribute__((target(KV_AVX512))) static inline __m512 hsum16_avx512(const __m512 *a) {
    __m512 b[8], c[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [A0+A2, B0+B2, A1+A3, B1+B3] */
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per 128-bit lane: keys 4k..4k+3, that lane's part of each */
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
        c[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* the four 128-bit lanes' parts: lanes 0+1 and 2+3, then the two halves */
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* Scores of a tile's keys against the head's query group, sixteen keys in sixteen
 * accumulators reduced together: float32 rows by fused multiply-adds on the scaled queries. */
__attribute__((target(KV_AVX512))) static void score_tile_f32_avx512(const AttnJob *j, Piece *p, const size_t *rows, int nt, float *s) {
    const int hd = j->head_dim, qpk = j->q_heads / j->kv_heads;
    const float *kr[TILE];
    for (int t = 0; t < TILE; t++) kr[t] = (const float *)j->k + rows[t < nt ? t : 0] * (size_t)hd;
    for (int g = 0; g < qpk; g++) {
        __m512 acc[TILE];
        for (int u = 0; u < TILE; u++) acc[u] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 16) {
            const __m512 qv = _mm512_loadu_ps(p->q[g] + d);
            for (int u = 0; u < TILE; u++) acc[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[u] + d), acc[u]);
        }
        _mm512_storeu_ps(s + (size_t)g * CHUNK_STRIDE, hsum16_avx512(acc));
    }
}

/* The same for a bfloat16 pool: VDPBF16PS multiplies 32 stored bfloat16 query and key
 * elements exactly and adds the products in float32; the scale multiplies the sum. */
__attribute__((target(KV_AVX512_BF16))) static void score_tile_bf16_avx512(const AttnJob *j, Piece *p, const size_t *rows, int nt, float *s) {
    const int hd = j->head_dim, qpk = j->q_heads / j->kv_heads;
    const uint16_t *kr[TILE];
    for (int t = 0; t < TILE; t++) kr[t] = (const uint16_t *)j->k + rows[t < nt ? t : 0] * (size_t)hd;
    const __m512 scale = _mm512_set1_ps(j->scale);
    for (int g = 0; g < qpk; g++) {
        const uint16_t *q = p->q_bf16 + (size_t)g * hd;
        __m512 acc[TILE];
        for (int u = 0; u < TILE; u++) acc[u] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
            for (int u = 0; u < TILE; u++)
                acc[u] = _mm512_dpbf16_ps(acc[u], qv, (__m512bh)_mm512_loadu_si512(kr[u] + d));
        }
        _mm512_storeu_ps(s + (size_t)g * CHUNK_STRIDE, _mm512_mul_ps(hsum16_avx512(acc), scale));
    }
}

/* softmax_chunk_avx2 on 16 lanes. */
__attribute__((target(KV_AVX512))) static void softmax_chunk_avx512(const AttnJob *j, Piece *p, float *s, int cn) {
    const int qpk = j->q_heads / j->kv_heads, padded = (cn + 15) & ~15;
    for (int g = 0; g < qpk; g++) {
        float *sg = s + (size_t)g * CHUNK_STRIDE;
        for (int t = cn; t < padded; t++) sg[t] = -INFINITY;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < padded; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
        const float max = _mm512_reduce_max_ps(mv);
        const __m512 m = _mm512_set1_ps(max);
        __m512 sv = _mm512_setzero_ps();
        for (int t = 0; t < padded; t += 16) {
            const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
            _mm512_storeu_ps(sg + t, e);
            sv = _mm512_add_ps(sv, e);
        }
        p->run_sum[g] = _mm512_reduce_add_ps(sv);
        p->run_max[g] = max;
    }
}

/* value_tile_avx2 on 16 lanes: a bfloat16 tile widened once, then each query head's output
 * slice (up to 128 columns, eight registers) kept in registers over the tile's keys. */
__attribute__((target(KV_AVX512))) static void value_tile_avx512(const AttnJob *j, Piece *p, const size_t *rows, int nt, const float *s) {
    const int hd = j->head_dim, qpk = j->q_heads / j->kv_heads;
    const float *vr[TILE];
    for (int t = 0; t < nt; t++) {
        const size_t off = rows[t] * (size_t)hd;
        if (j->dtype == DT_F32) {
            vr[t] = (const float *)j->v + off;
            continue;
        }
        const uint16_t *src = (const uint16_t *)j->v + off;
        float *dst = p->tile + (size_t)t * hd;
        for (int d = 0; d < hd; d += 16) {
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
            _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
        vr[t] = dst;
    }
    for (int g = 0; g < qpk; g++) {
        const float *sg = s + (size_t)g * CHUNK_STRIDE;
        int d = 0;
        for (; d + 128 <= hd; d += 128) {
            __m512 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm512_loadu_ps(p->acc[g] + d + 16 * u);
            for (int t = 0; t < nt; t++) {
                const __m512 w = _mm512_set1_ps(sg[t]);
                for (int u = 0; u < 8; u++) acc[u] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr[t] + d + 16 * u), acc[u]);
            }
            for (int u = 0; u < 8; u++) _mm512_storeu_ps(p->acc[g] + d + 16 * u, acc[u]);
        }
        for (; d + 64 <= hd; d += 64) {
            __m512 acc[4];
            for (int u = 0; u < 4; u++) acc[u] = _mm512_loadu_ps(p->acc[g] + d + 16 * u);
            for (int t = 0; t < nt; t++) {
                const __m512 w = _mm512_set1_ps(sg[t]);
                for (int u = 0; u < 4; u++) acc[u] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr[t] + d + 16 * u), acc[u]);
            }
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(p->acc[g] + d + 16 * u, acc[u]);
        }
        for (; d < hd; d += 16) {
            __m512 acc = _mm512_loadu_ps(p->acc[g] + d);
            for (int t = 0; t < nt; t++) acc = _mm512_fmadd_ps(_mm512_set1_ps(sg[t]), _mm512_loadu_ps(vr[t] + d), acc);
            _mm512_storeu_ps(p->acc[g] + d, acc);
        }
    }
}

/* A bfloat16 tile's values as BF16 dot products too: each pair of keys' value rows interleaved
 * column by column (a, b -> a0 b0 a1 b1 ..., within 128-bit lanes, so the columns come out in
 * the order finish_head undoes), each query head's pair of probabilities rounded to bfloat16
 * and broadcast, and VDPBF16PS adds a0 p_t + b0 p_t+1 into a float32 accumulator: a key's row
 * is read and widened once per tile instead of once per head, and half the multiply-adds. The
 * probabilities' rounding (relative 2^-9) is what torch's bfloat16 SDPA does on CPU too. */
__attribute__((target(KV_AVX512_BF16))) static void value_tile_bf16_avx512(const AttnJob *j, Piece *p, const size_t *rows, int nt, const float *s) {
    const int hd = j->head_dim, qpk = j->q_heads / j->kv_heads, chunks = hd / 32, pairs = (nt + 1) / 2;
    const uint16_t *v = (const uint16_t *)j->v;
    __m512i *vp = (__m512i *)(void *)p->tile; /* [pairs][chunks][lo, hi] */
    for (int t2 = 0; t2 < pairs; t2++) {
        const uint16_t *a = v + rows[2 * t2] * (size_t)hd;
        const uint16_t *b = 2 * t2 + 1 < nt ? v + rows[2 * t2 + 1] * (size_t)hd : NULL;
        for (int c = 0; c < chunks; c++) {
            const __m512i av = _mm512_loadu_si512(a + 32 * c);
            const __m512i bv = b != NULL ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + (t2 * chunks + c) * 2, _mm512_unpacklo_epi16(av, bv));
            _mm512_storeu_si512(vp + (t2 * chunks + c) * 2 + 1, _mm512_unpackhi_epi16(av, bv));
        }
    }
    p->acc_pairs = 1;
    for (int g = 0; g < qpk; g++) {
        uint32_t w[TILE / 2]; /* pairs of probabilities: a tile's positions past nt hold 0 */
        _mm256_storeu_si256((__m256i *)w, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + (size_t)g * CHUNK_STRIDE)));
        float *acc_g = p->acc[g];
        int c = 0;
        for (; c + 2 <= chunks; c += 2) {
            __m512 acc[4];
            for (int u = 0; u < 4; u++) acc[u] = _mm512_loadu_ps(acc_g + 32 * c + 16 * u);
            for (int t2 = 0; t2 < pairs; t2++) {
                const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)w[t2]);
                const __m512i *row = vp + (t2 * chunks + c) * 2;
                for (int u = 0; u < 4; u++) acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(row + u), wv);
            }
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc_g + 32 * c + 16 * u, acc[u]);
        }
        for (; c < chunks; c++) {
            __m512 acc[2];
            for (int u = 0; u < 2; u++) acc[u] = _mm512_loadu_ps(acc_g + 32 * c + 16 * u);
            for (int t2 = 0; t2 < pairs; t2++) {
                const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)w[t2]);
                const __m512i *row = vp + (t2 * chunks + c) * 2;
                for (int u = 0; u < 2; u++) acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(row + u), wv);
            }
            for (int u = 0; u < 2; u++) _mm512_storeu_ps(acc_g + 32 * c + 16 * u, acc[u]);
        }
    }
}

const TileOps OPS_AVX2 = {score_tile_avx2, softmax_chunk_avx2, value_tile_avx2};
const TileOps OPS_AVX512_F32 = {score_tile_f32_avx512, softmax_chunk_avx512, value_tile_avx512};
const TileOps OPS_AVX512_BF16 = {score_tile_bf16_avx512, softmax_chunk_avx512, value_tile_bf16_avx512};
#endif
