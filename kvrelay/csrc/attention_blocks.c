/*
 * Prefill attention in blocks: a segment's consecutive tokens (up to BLOCK_QUERIES query
 * vectors: rows x the query heads of a kv head) against their keys together, so that a key's
 * row is read once for all of them (attention.c takes the other rows one at a time and
 * dispatches the step's work). Two kernels: bfloat16 pools with AVX512-BF16 dot products, and
 * the AVX2 path (float32, or a bfloat16 pool widened).
 */
#include "attention.h"

#if KV_X86
/* Prefill blocks of a bfloat16 pool (AVX512-BF16): up to BLOCK_QUERIES query vectors
 * (consecutive rows of one segment x the query heads of a kv head) against their keys
 * together, so a key's row is read once for all of them instead of once a row. The row path
 * scores 16 keys of one query in 16 accumulators and folds them (hsum16_avx512); here the
 * queries are transposed once into column pairs, 16 queries a vector, and each key's pair of
 * columns is broadcast into VDPBF16PS: a score vector holds one key's scores for 16 queries,
 * no fold, and the softmax's maxima and sums run down the keys, lane by lane. The values are
 * interleaved in pairs of keys once per chunk (the row path does it per tile and query) and
 * each query's pair of probabilities is broadcast against them. Products as the row path's
 * (exact bfloat16 products summed in float32, probabilities rounded to bfloat16), so results
 * equal it up to the order of float32 sums. 2,048 tokens in 256-token segments, SmolLM2's
 * heads: 7.1 -> 3.5 ms a layer (BENCHMARKS.md "CPU attention"). A float32 version (a
 * multiply-add per column with each key's column broadcast) was tried and was slower than the
 * row path (256-token segments: 0.88x SDPA's time, the row path 0.66x): the row path's float32
 * products are already one multiply-add per 16 columns, and the bfloat16 rows gain from
 * dropping the fold and the per-query interleave, which float32 does not have. */
#define BLOCK_GROUPS (BLOCK_QUERIES / 16)
#define BLOCK_KEYS 64 /* keys a block scores before its online softmax steps */

typedef struct {
    __m512i qt[BLOCK_GROUPS][MAX_HEAD_DIM / 2]; /* queries' column pairs, 16 a vector */
    __m512 s[BLOCK_KEYS + 3][BLOCK_GROUPS];     /* a chunk's scores, then probabilities */
    uint32_t p2[BLOCK_KEYS / 2][BLOCK_QUERIES]; /* probabilities of pairs of keys, bfloat16 */
    __m512i vp[BLOCK_KEYS / 2][MAX_HEAD_DIM / 32][2]; /* values of pairs of keys, interleaved */
    float acc[BLOCK_QUERIES][MAX_HEAD_DIM];
    float corr[BLOCK_QUERIES], sum[BLOCK_QUERIES];
    __m512 run_max[BLOCK_GROUPS], run_sum[BLOCK_GROUPS];
    __m512i lane_pos[BLOCK_GROUPS]; /* the position of each lane's query */
} BlockBuf;

static __thread BlockBuf *block_buf;

/* Where a block's query vector x (row x / qpk, head x % qpk of kv head h) lives in q / out. */
static inline size_t block_row(const AttnJob *j, int i0, int h, int x) {
    const int qpk = j->q_heads / j->kv_heads;
    return (size_t)(j->rows[i0] + x / qpk) * j->q_heads + (size_t)h * qpk + x % qpk;
}

/* The thread's block buffer and the block's running state for one kv head; NULL when out of
 * memory. */
__attribute__((target(KV_AVX512))) static BlockBuf *block_start(const AttnJob *j, int i0, int nq) {
    if (block_buf == NULL && posix_memalign((void **)&block_buf, 64, sizeof(BlockBuf)) != 0) block_buf = NULL;
    BlockBuf *b = block_buf;
    if (b == NULL) return NULL;
    const int qpk = j->q_heads / j->kv_heads, pos0 = j->ctx_lens[i0] - 1;
    for (int g = 0; g < (nq + 15) / 16; g++) {
        int32_t pos[16]; /* lanes past the block's queries act as its last one */
        for (int x = 0; x < 16; x++) pos[x] = pos0 + min_int(16 * g + x, nq - 1) / qpk;
        b->lane_pos[g] = _mm512_loadu_si512(pos);
        b->run_max[g] = _mm512_set1_ps(-INFINITY);
        b->run_sum[g] = _mm512_setzero_ps();
    }
    for (int x = 0; x < ((nq + 3) & ~3); x++) memset(b->acc[x], 0, sizeof(float) * j->head_dim);
    return b;
}

/* A chunk's scores b->s[0..nk-1] (keys c0..) become probabilities: keys after a lane's
 * position or before its window masked, then the online softmax's step down the keys; each
 * lane's rescaling of its output goes to b->corr. A last odd key's pair partner is zeroed. */
__attribute__((target(KV_AVX512))) static void block_softmax(const AttnJob *j, BlockBuf *b, int G, int c0, int nk, int pos0) {
    const int masked = c0 + nk - 1 > pos0 || j->window > 0;
    for (int g = 0; g < G; g++) {
        __m512 mx = b->run_max[g];
        for (int t = 0; t < nk; t++) {
            if (masked) {
                const __m512i kp = _mm512_set1_epi32(c0 + t);
                __mmask16 drop = _mm512_cmpgt_epi32_mask(kp, b->lane_pos[g]);
                if (j->window > 0)
                    drop |= _mm512_cmple_epi32_mask(kp, _mm512_sub_epi32(b->lane_pos[g], _mm512_set1_epi32(j->window)));
                b->s[t][g] = _mm512_mask_mov_ps(b->s[t][g], drop, _mm512_set1_ps(-INFINITY));
            }
            mx = _mm512_max_ps(mx, b->s[t][g]);
        }
        /* a lane with no key yet keeps 0 as its reference: e^(-inf - 0) = 0 */
        const __mmask16 none = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
        const __m512 ref = _mm512_mask_mov_ps(mx, none, _mm512_setzero_ps());
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < nk; t++) {
            const __m512 e = exp_avx512(_mm512_sub_ps(b->s[t][g], ref));
            b->s[t][g] = e;
            sum = _mm512_add_ps(sum, e);
        }
        if (nk % 2) b->s[nk][g] = _mm512_setzero_ps();
        const __m512 corr = exp_avx512(_mm512_sub_ps(b->run_max[g], ref)); /* 0 before any key */
        b->run_sum[g] = _mm512_fmadd_ps(b->run_sum[g], corr, sum);
        b->run_max[g] = mx;
        _mm512_storeu_ps(b->corr + 16 * g, corr);
    }
}

/* Scores of keys k[0..3] (bfloat16 column pairs) against G vectors of 16 queries, scaled. */
__attribute__((target(KV_AVX512_BF16), always_inline)) static inline void score4_bf16(const BlockBuf *b, int G, int pairs,
                                                                                        const uint32_t *const *k, __m512 scale,
                                                                                        __m512 out[][BLOCK_GROUPS]) {
    __m512 acc[4][BLOCK_GROUPS];
    for (int u = 0; u < 4; u++)
        for (int g = 0; g < G; g++) acc[u][g] = _mm512_setzero_ps();
    for (int d = 0; d < pairs; d++) {
        __m512bh q[BLOCK_GROUPS];
        for (int g = 0; g < G; g++) q[g] = (__m512bh)_mm512_load_si512(&b->qt[g][d]);
        for (int u = 0; u < 4; u++) {
            const __m512bh kv = (__m512bh)_mm512_set1_epi32((int)k[u][d]);
            for (int g = 0; g < G; g++) acc[u][g] = _mm512_dpbf16_ps(acc[u][g], q[g], kv);
        }
    }
    for (int u = 0; u < 4; u++)
        for (int g = 0; g < G; g++) out[u][g] = _mm512_mul_ps(acc[u][g], scale);
}

/* A bfloat16 block (AVX512-BF16): the block's query rows i0..i0+count-1 (one segment's
 * consecutive tokens) for every kv head. Returns 0, or -1 when out of memory (nothing written). */
__attribute__((target(KV_AVX512_BF16))) int attend_block_bf16(const AttnJob *j, int i0, int count) {
    const int qpk = j->q_heads / j->kv_heads, hd = j->head_dim, pairs = hd / 2, chunks = hd / 32;
    const int nq = count * qpk, G = (nq + 15) / 16, nq4 = (nq + 3) & ~3;
    const int pos0 = j->ctx_lens[i0] - 1, end = j->ctx_lens[i0 + count - 1];
    const int kstart = j->window > 0 && pos0 + 1 > j->window ? pos0 + 1 - j->window : 0;
    const uint16_t *vs = (const uint16_t *)j->v;
    /* two rows of 16 (32) bfloat16 values interleaved: a0 b0 a1 b1 ..., pairs for VDPBF16PS */
    int16_t lo_idx[32], hi_idx[32], mix_idx[32];
    for (int x = 0; x < 16; x++) {
        lo_idx[2 * x] = (int16_t)x, lo_idx[2 * x + 1] = (int16_t)(32 + x);
        hi_idx[2 * x] = (int16_t)(16 + x), hi_idx[2 * x + 1] = (int16_t)(48 + x);
        mix_idx[2 * x] = (int16_t)x, mix_idx[2 * x + 1] = (int16_t)(16 + x);
    }
    const __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_loadu_si512(hi_idx), mix = _mm512_loadu_si512(mix_idx);
    const __m512 scale = _mm512_set1_ps(j->scale);
    size_t rows[BLOCK_KEYS];
    const uint32_t *kr[BLOCK_KEYS + 3];
    for (int h = 0; h < j->kv_heads; h++) {
        BlockBuf *b = block_start(j, i0, nq);
        if (b == NULL) return -1;
        for (int g = 0; g < G; g++) memset(b->qt[g], 0, sizeof(__m512i) * pairs);
        for (int x = 0; x < nq; x++) {
            const uint32_t *src = (const uint32_t *)((const uint16_t *)j->q + block_row(j, i0, h, x) * hd);
            uint32_t *dst = (uint32_t *)b->qt[x / 16] + x % 16;
            for (int d = 0; d < pairs; d++) dst[16 * d] = src[d];
        }
        for (int c0 = kstart; c0 < end; c0 += BLOCK_KEYS) {
            const int nk = min_int(BLOCK_KEYS, end - c0), np = (nk + 1) / 2;
            key_rows(j, i0, c0, nk, h, rows);
            for (int t = 0; t < nk; t++) kr[t] = (const uint32_t *)j->k + rows[t] * (size_t)pairs;
            for (int t = nk; t < ((nk + 3) & ~3); t++) kr[t] = kr[0]; /* scored, never used */
            for (int t = 0; t < nk; t += 4) {
                if (G == 1) score4_bf16(b, 1, pairs, kr + t, scale, b->s + t);
                else if (G == 2) score4_bf16(b, 2, pairs, kr + t, scale, b->s + t);
                else score4_bf16(b, 3, pairs, kr + t, scale, b->s + t);
            }
            block_softmax(j, b, G, c0, nk, pos0);
            for (int g = 0; g < G; g++)
                for (int t2 = 0; t2 < np; t2++) {
                    const __m256i pa = (__m256i)_mm512_cvtneps_pbh(b->s[2 * t2][g]);
                    const __m256i pb = (__m256i)_mm512_cvtneps_pbh(b->s[2 * t2 + 1][g]);
                    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(pa), pb, 1);
                    _mm512_storeu_si512(&b->p2[t2][16 * g], _mm512_permutexvar_epi16(mix, both));
                }
            /* keys 2t and 2t+1's values interleaved column by column (a zero row after an odd
             * last key), then each query's output rescaled and its probabilities added */
            for (int t2 = 0; t2 < np; t2++) {
                const uint16_t *va = vs + rows[2 * t2] * (size_t)hd;
                const uint16_t *vb = 2 * t2 + 1 < nk ? vs + rows[2 * t2 + 1] * (size_t)hd : NULL;
                for (int c = 0; c < chunks; c++) {
                    const __m512i a = _mm512_loadu_si512(va + 32 * c);
                    const __m512i bv = vb != NULL ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
                    b->vp[t2][c][0] = _mm512_permutex2var_epi16(a, lo, bv);
                    b->vp[t2][c][1] = _mm512_permutex2var_epi16(a, hi, bv);
                }
            }
            for (int x = 0; x < nq4; x += 4)
                for (int c = 0; c < chunks; c++) {
                    __m512 acc[4][2];
                    for (int u = 0; u < 4; u++) {
                        const __m512 cu = _mm512_set1_ps(b->corr[x + u]);
                        acc[u][0] = _mm512_mul_ps(cu, _mm512_loadu_ps(b->acc[x + u] + 32 * c));
                        acc[u][1] = _mm512_mul_ps(cu, _mm512_loadu_ps(b->acc[x + u] + 32 * c + 16));
                    }
                    for (int t2 = 0; t2 < np; t2++) {
                        const __m512bh v0 = (__m512bh)b->vp[t2][c][0], v1 = (__m512bh)b->vp[t2][c][1];
                        for (int u = 0; u < 4; u++) {
                            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)b->p2[t2][x + u]);
                            acc[u][0] = _mm512_dpbf16_ps(acc[u][0], v0, w);
                            acc[u][1] = _mm512_dpbf16_ps(acc[u][1], v1, w);
                        }
                    }
                    for (int u = 0; u < 4; u++) {
                        _mm512_storeu_ps(b->acc[x + u] + 32 * c, acc[u][0]);
                        _mm512_storeu_ps(b->acc[x + u] + 32 * c + 16, acc[u][1]);
                    }
                }
        }
        for (int g = 0; g < G; g++) _mm512_storeu_ps(b->sum + 16 * g, b->run_sum[g]);
        for (int x = 0; x < nq; x++) {
            const float inv = b->sum[x] > 0.0f ? 1.0f / b->sum[x] : 0.0f;
            scale_to_bf16_avx512(b->acc[x], inv, hd, (uint16_t *)j->out + block_row(j, i0, h, x) * hd);
        }
    }
    return 0;
}
#endif

#if KV_X86
/* Prefill blocks on AVX2 (float32 or a widened bfloat16 pool): up to BLOCK_QUERIES_AVX2 query
 * vectors (consecutive rows of one segment x the query heads of a kv head) against their keys
 * together. The row path scores eight keys of one query in eight accumulators and folds them,
 * a query load and eight key loads a multiply-add group, and reads each value row once per
 * query; here the queries are transposed once, eight a vector, and each key's column is
 * broadcast against them (three query loads and four broadcasts feed twelve multiply-adds),
 * the softmax runs down the keys lane by lane, and the values go through a 6 x 16 tile of
 * outputs in registers (six probabilities broadcast, two value loads, twelve multiply-adds).
 * Results equal the row path's up to the order of float32 sums. */
#define BLOCK_GROUPS_AVX2 (BLOCK_QUERIES_AVX2 / 8)

typedef struct {
    __m256 qt[BLOCK_GROUPS_AVX2][MAX_HEAD_DIM];   /* scaled queries' columns, 8 a vector */
    __m256 s[BLOCK_KEYS + 3][BLOCK_GROUPS_AVX2];  /* a chunk's scores, then probabilities */
    float acc[BLOCK_QUERIES_AVX2][MAX_HEAD_DIM];
    float corr[BLOCK_QUERIES_AVX2], sum[BLOCK_QUERIES_AVX2];
    float kw[BLOCK_KEYS * MAX_HEAD_DIM], vw[BLOCK_KEYS * MAX_HEAD_DIM]; /* widened bfloat16 rows */
    __m256 run_max[BLOCK_GROUPS_AVX2], run_sum[BLOCK_GROUPS_AVX2];
    __m256i lane_pos[BLOCK_GROUPS_AVX2]; /* the position of each lane's query */
} BlockBufAvx2;

static __thread BlockBufAvx2 *block_buf_avx2;

/* Scores of keys k[0..3] against G vectors of 8 (scaled) queries: out[u][g]. */
__attribute__((target("avx2,fma"), always_inline)) static inline void score4_avx2(const BlockBufAvx2 *b, int G, int hd,
                                                                                 const float *const *k, __m256 out[][BLOCK_GROUPS_AVX2]) {
    __m256 acc[4][BLOCK_GROUPS_AVX2];
    for (int u = 0; u < 4; u++)
        for (int g = 0; g < G; g++) acc[u][g] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d++) {
        __m256 q[BLOCK_GROUPS_AVX2];
        for (int g = 0; g < G; g++) q[g] = b->qt[g][d];
        for (int u = 0; u < 4; u++) {
            const __m256 kv = _mm256_broadcast_ss(k[u] + d);
            for (int g = 0; g < G; g++) acc[u][g] = _mm256_fmadd_ps(q[g], kv, acc[u][g]);
        }
    }
    for (int u = 0; u < 4; u++)
        for (int g = 0; g < G; g++) out[u][g] = acc[u][g];
}

/* A chunk's scores b->s[0..nk-1] (keys c0..) become probabilities, as block_softmax's. */
__attribute__((target("avx2,fma"))) static void block_softmax_avx2(const AttnJob *j, BlockBufAvx2 *b, int G, int c0, int nk,
                                                                  int pos0) {
    const int masked = c0 + nk - 1 > pos0 || j->window > 0;
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    for (int g = 0; g < G; g++) {
        __m256 mx = b->run_max[g];
        const __m256i after_window = _mm256_sub_epi32(b->lane_pos[g], _mm256_set1_epi32(j->window - 1));
        for (int t = 0; t < nk; t++) {
            if (masked) {
                const __m256i kp = _mm256_set1_epi32(c0 + t);
                __m256i drop = _mm256_cmpgt_epi32(kp, b->lane_pos[g]); /* after the query */
                if (j->window > 0) drop = _mm256_or_si256(drop, _mm256_cmpgt_epi32(after_window, kp));
                b->s[t][g] = _mm256_blendv_ps(b->s[t][g], minus_inf, _mm256_castsi256_ps(drop));
            }
            mx = _mm256_max_ps(mx, b->s[t][g]);
        }
        /* a lane with no key yet keeps 0 as its reference: e^(-inf - 0) = 0 */
        const __m256 ref = _mm256_blendv_ps(mx, _mm256_setzero_ps(), _mm256_cmp_ps(mx, minus_inf, _CMP_EQ_OQ));
        __m256 sum = _mm256_setzero_ps();
        for (int t = 0; t < nk; t++) {
            const __m256 e = exp_avx2(_mm256_sub_ps(b->s[t][g], ref));
            b->s[t][g] = e;
            sum = _mm256_add_ps(sum, e);
        }
        const __m256 corr = exp_avx2(_mm256_sub_ps(b->run_max[g], ref)); /* 0 before any key */
        b->run_sum[g] = _mm256_fmadd_ps(b->run_sum[g], corr, sum);
        b->run_max[g] = mx;
        _mm256_storeu_ps(b->corr + 8 * g, corr);
    }
}

/* Outputs x..x+5, columns c..c+8*W-1: rescaled, then the chunk's values weighted by their
 * probabilities added (W: 2 vectors, or 1 for a last 8 columns). */
__attribute__((target("avx2,fma"), always_inline)) static inline void value6_avx2(BlockBufAvx2 *b, int x, int c, int W, int nk,
                                                                                 const float *const *v) {
    __m256 acc[6][2];
    for (int u = 0; u < 6; u++) {
        const __m256 cu = _mm256_broadcast_ss(b->corr + x + u);
        for (int w = 0; w < W; w++) acc[u][w] = _mm256_mul_ps(cu, _mm256_loadu_ps(b->acc[x + u] + c + 8 * w));
    }
    for (int t = 0; t < nk; t++) {
        const float *p = (const float *)b->s[t] + x;
        __m256 vv[2];
        for (int w = 0; w < W; w++) vv[w] = _mm256_loadu_ps(v[t] + c + 8 * w);
        for (int u = 0; u < 6; u++) {
            const __m256 pu = _mm256_broadcast_ss(p + u);
            for (int w = 0; w < W; w++) acc[u][w] = _mm256_fmadd_ps(pu, vv[w], acc[u][w]);
        }
    }
    for (int u = 0; u < 6; u++)
        for (int w = 0; w < W; w++) _mm256_storeu_ps(b->acc[x + u] + c + 8 * w, acc[u][w]);
}

/* An AVX2 block: the query rows i0..i0+count-1 (one segment's consecutive tokens) for every kv
 * head. Returns 0, or -1 when out of memory (nothing written). */
__attribute__((target("avx2,fma"))) int attend_block_avx2(const AttnJob *j, int i0, int count) {
    const int qpk = j->q_heads / j->kv_heads, hd = j->head_dim;
    const int nq = count * qpk, G = (nq + 7) / 8, nq6 = (nq + 5) / 6 * 6;
    const int pos0 = j->ctx_lens[i0] - 1, end = j->ctx_lens[i0 + count - 1];
    const int kstart = j->window > 0 && pos0 + 1 > j->window ? pos0 + 1 - j->window : 0;
    if (block_buf_avx2 == NULL && posix_memalign((void **)&block_buf_avx2, 64, sizeof(BlockBufAvx2)) != 0)
        block_buf_avx2 = NULL;
    BlockBufAvx2 *b = block_buf_avx2;
    if (b == NULL) return -1;
    size_t rows[BLOCK_KEYS];
    const float *kr[BLOCK_KEYS + 7], *vr[BLOCK_KEYS + 7]; /* tile_rows_avx2 pads to 8 */
    float qrow[MAX_HEAD_DIM];
    for (int h = 0; h < j->kv_heads; h++) {
        for (int g = 0; g < G; g++) {
            int32_t pos[8]; /* lanes past the block's queries act as its last one */
            for (int x = 0; x < 8; x++) pos[x] = pos0 + min_int(8 * g + x, nq - 1) / qpk;
            b->lane_pos[g] = _mm256_loadu_si256((const __m256i *)pos);
            b->run_max[g] = _mm256_set1_ps(-INFINITY);
            b->run_sum[g] = _mm256_setzero_ps();
            for (int d = 0; d < hd; d++) b->qt[g][d] = _mm256_setzero_ps();
        }
        for (int x = 0; x < nq; x++) {
            const float *q = row_f32(j, j->q, block_row(j, i0, h, x), qrow);
            float *dst = (float *)b->qt[x / 8] + x % 8;
            for (int d = 0; d < hd; d++) dst[8 * d] = q[d] * j->scale;
        }
        for (int x = 0; x < nq6; x++) memset(b->acc[x], 0, sizeof(float) * hd);
        /* chunks at multiples of BLOCK_KEYS (a window's first keys masked), so that a query's
         * sums are the same whichever block it is in */
        for (int c0 = kstart - kstart % BLOCK_KEYS; c0 < end; c0 += BLOCK_KEYS) {
            const int nk = min_int(BLOCK_KEYS, end - c0);
            key_rows(j, i0, c0, nk, h, rows);
            tile_rows_avx2(j, j->k, rows, nk, b->kw, kr);
            for (int t = 0; t < nk; t += 4) {
                if (G == 1) score4_avx2(b, 1, hd, kr + t, b->s + t);
                else if (G == 2) score4_avx2(b, 2, hd, kr + t, b->s + t);
                else score4_avx2(b, 3, hd, kr + t, b->s + t);
            }
            block_softmax_avx2(j, b, G, c0, nk, pos0);
            tile_rows_avx2(j, j->v, rows, nk, b->vw, vr);
            for (int x = 0; x < nq6; x += 6) {
                int c = 0;
                for (; c + 16 <= hd; c += 16) value6_avx2(b, x, c, 2, nk, vr);
                if (c < hd) value6_avx2(b, x, c, 1, nk, vr);
            }
        }
        for (int g = 0; g < G; g++) _mm256_storeu_ps(b->sum + 8 * g, b->run_sum[g]);
        for (int x = 0; x < nq; x++) {
            const float inv = b->sum[x] > 0.0f ? 1.0f / b->sum[x] : 0.0f;
            const size_t off = block_row(j, i0, h, x) * (size_t)hd;
            for (int d = 0; d < hd; d++) {
                const float o = b->acc[x][d] * inv;
                if (j->dtype == DT_F32) ((float *)j->out)[off + d] = o;
                else ((uint16_t *)j->out)[off + d] = f32_to_bf16(o);
            }
        }
    }
    return 0;
}
#endif
