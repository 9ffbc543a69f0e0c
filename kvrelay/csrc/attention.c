/*
 * Paged attention for CPU: query rows against their sequences' cached keys and values, read in
 * place from the block pool (no gather into a padded copy). A decode token is one row; a
 * prefill segment is one row per token, each attending over the keys up to its own position
 * (causal), its sequence's table shared through row_table (the step's K/V are in the pool
 * already). One call covers a whole step's rows.
 *
 * Pool layout (one layer, kernels/attention.py): k and v are each [num_blocks, block_size,
 * kv_heads, head_dim]; token t of sequence i lives in block tables[i, t / block_size] at
 * offset t % block_size. Work is split by (sequence, kv head): each piece computes the
 * q_per_kv query heads that share that kv head (grouped-query attention without repeating
 * K/V), with a running maximum and sum (online softmax) over tiles of TILE keys, so each key
 * and value row is read once. Sums are float32; a bfloat16 pool and queries are widened in
 * registers and the output rounded to nearest even. The pieces run on gemv.c's pool.
 *
 * Three paths, the widest the CPU has: AVX-512 (16 lanes; a bfloat16 pool's scores as BF16 dot
 * products, VDPBF16PS, on the stored bfloat16 queries and keys, products exact and summed in
 * float32, the scale applied to the sum), AVX2 (8 lanes, bfloat16 widened), portable C. The
 * vector paths' steps over a tile of keys are attention_tiles.c's; this file walks the keys.
 */
#include "attention_tiles.h"

#define PREFETCH_TILES 2 /* how far ahead of the tile being computed its keys are fetched */

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* s[0:count] = e^(s - max); returns their sum. */
static float exp_shift(float *s, float max, int count) {
    float sum = 0.0f;
    for (int t = 0; t < count; t++) {
        s[t] = expf(s[t] - max);
        sum += s[t];
    }
    return sum;
}

/* One tile of keys t0..t0+nt-1: scores, the running maximum and sum, then the values
 * (portable C; the SIMD paths keep a chunk's scores instead: attend_chunks). */
static void attend_tile_c(const AttnJob *j, Piece *p, int i, int h, int t0, int nt, int qpk) {
    const int hd = j->head_dim;
    key_rows(j, i, t0, nt, h, p->rows);
    for (int t = 0; t < nt; t++) {
        const float *k = row_f32(j, j->k, p->rows[t], p->buf);
        for (int g = 0; g < qpk; g++) p->score[g][t] = dot(p->q[g], k, hd);
    }
    for (int g = 0; g < qpk; g++) {
        float tile_max = p->run_max[g];
        for (int t = 0; t < nt; t++) tile_max = p->score[g][t] > tile_max ? p->score[g][t] : tile_max;
        const float correction = expf(p->run_max[g] - tile_max); /* 0 on the first tile */
        for (int d = 0; d < hd; d++) p->acc[g][d] *= correction;
        p->run_sum[g] = p->run_sum[g] * correction + exp_shift(p->score[g], tile_max, nt);
        p->run_max[g] = tile_max;
    }
    for (int t = 0; t < nt; t++) {
        const float *v = row_f32(j, j->v, p->rows[t], p->buf);
        for (int g = 0; g < qpk; g++)
            for (int d = 0; d < hd; d++) p->acc[g][d] += p->score[g][t] * v[d];
    }
}

/* Starts query i's head group h: running maxima and sums, zero outputs, and the queries
 * (scaled, float32) unless the path reads them in place (`raw_q`: BF16 dot products). */
static void start_head(const AttnJob *j, Piece *p, int i, int h, int raw_q) {
    const int qpk = j->q_heads / j->kv_heads;
    const size_t q_row0 = (size_t)j->rows[i] * j->q_heads + (size_t)h * qpk;
    p->q_bf16 = j->dtype == DT_BF16 ? (const uint16_t *)j->q + q_row0 * j->head_dim : NULL;
    p->acc_pairs = 0;
    for (int g = 0; g < qpk; g++) {
        if (!raw_q) {
            const float *q = row_f32(j, j->q, q_row0 + g, p->buf);
            for (int d = 0; d < j->head_dim; d++) p->q[g][d] = q[d] * j->scale;
        }
        memset(p->acc[g], 0, sizeof(float) * j->head_dim);
        p->run_max[g] = -INFINITY;
        p->run_sum[g] = 0.0f;
    }
}

static void finish_head(const AttnJob *j, const Piece *p, int i, int h) {
    const int qpk = j->q_heads / j->kv_heads, hd = j->head_dim;
    const size_t q_row0 = (size_t)j->rows[i] * j->q_heads + (size_t)h * qpk;
    for (int g = 0; g < qpk; g++) {
        const float inv = p->run_sum[g] > 0.0f ? 1.0f / p->run_sum[g] : 0.0f;
        const size_t off = (q_row0 + g) * (size_t)hd;
        if (j->dtype == DT_F32) {
            float *o = (float *)j->out + off;
            for (int d = 0; d < hd; d++) o[d] = p->acc[g][d] * inv;
            continue;
        }
        uint16_t *o = (uint16_t *)j->out + off;
#if KV_X86
        if (p->acc_pairs) { /* only the BF16 path sets it: hd is a multiple of 32 */
            /* acc[32c + 16 half + i] holds column 32c + 8 (i / 4) + 4 half + i % 4 */
            float cols[MAX_HEAD_DIM];
            for (int x = 0; x < hd; x++) {
                const int c = x / 32, half = x % 32 / 16, k = x % 16;
                cols[32 * c + 8 * (k / 4) + 4 * half + k % 4] = p->acc[g][x];
            }
            scale_to_bf16_avx512(cols, inv, hd, o);
            continue;
        }
#endif
        for (int d = 0; d < hd; d++) o[d] = f32_to_bf16(p->acc[g][d] * inv);
    }
}

/* A head group's state as a flat partial: qpk * hd floats of output, then qpk running maxima,
 * then qpk sums. */
static size_t partial_floats(const AttnJob *j) {
    const int qpk = j->q_heads / j->kv_heads;
    return (size_t)qpk * j->head_dim + 2 * (size_t)qpk;
}

static void save_state(const AttnJob *j, const Piece *p, float *to) {
    const int qpk = j->q_heads / j->kv_heads, hd = j->head_dim;
    for (int g = 0; g < qpk; g++) memcpy(to + (size_t)g * hd, p->acc[g], sizeof(float) * hd);
    memcpy(to + (size_t)qpk * hd, p->run_max, sizeof(float) * qpk);
    memcpy(to + (size_t)qpk * hd + qpk, p->run_sum, sizeof(float) * qpk);
}

static void load_state(const AttnJob *j, Piece *p, const float *from) {
    const int qpk = j->q_heads / j->kv_heads, hd = j->head_dim;
    for (int g = 0; g < qpk; g++) memcpy(p->acc[g], from + (size_t)g * hd, sizeof(float) * hd);
    memcpy(p->run_max, from + (size_t)qpk * hd, sizeof(float) * qpk);
    memcpy(p->run_sum, from + (size_t)qpk * hd + qpk, sizeof(float) * qpk);
}

/* The state start_head leaves (the queries kept): a chunk computed after it is a partial of
 * its own, as if no key came before it. */
static void clear_state(const AttnJob *j, Piece *p) {
    const int qpk = j->q_heads / j->kv_heads;
    for (int g = 0; g < qpk; g++) {
        memset(p->acc[g], 0, sizeof(float) * j->head_dim);
        p->run_max[g] = -INFINITY;
        p->run_sum[g] = 0.0f;
    }
}

/* later = earlier + later, two partials of consecutive keys (flat, partial_floats; `later` in
 * place): both rescaled to their common maximum and added, the earlier first. Every path folds
 * a row's chunks this way, one after another from its first: a row walked in one piece and a
 * lone row whose chunks ran on different threads (split_rows) get the same bits. */
static void fold_partial(const AttnJob *j, const float *earlier, float *later) {
    const int qpk = j->q_heads / j->kv_heads, hd = j->head_dim;
    const float *e_max = earlier + (size_t)qpk * hd, *e_sum = e_max + qpk;
    float *l_max = later + (size_t)qpk * hd, *l_sum = l_max + qpk;
    for (int g = 0; g < qpk; g++) {
        const float m = e_max[g] > l_max[g] ? e_max[g] : l_max[g];
        const float ce = e_max[g] == -INFINITY ? 0.0f : expf(e_max[g] - m);
        const float cl = l_max[g] == -INFINITY ? 0.0f : expf(l_max[g] - m);
        const float *ea = earlier + (size_t)g * hd;
        float *la = later + (size_t)g * hd;
        for (int d = 0; d < hd; d++) la[d] = ea[d] * ce + la[d] * cl;
        l_sum[g] = e_sum[g] * ce + l_sum[g] * cl;
        l_max[g] = m;
    }
}

/* Asks for the cache lines of keys t0..t0+nt-1 of sequence i in `base` (the pool's K or V),
 * kv heads h0..h0+nh-1 of each, a few tiles before they are computed. A sequence's blocks lie
 * anywhere in the pool, so the hardware prefetchers lose the stream at every block and each
 * tile would otherwise start with a wait on memory: a 64-sequence step over 1,000-token
 * contexts ran at 6 GB/s. The lines go to L2 (prefetcht2), not L1: a tile's rows for every
 * head, K and V, are 24 KB in float32, and fetching the next ones into a 32 KB L1 evicted the
 * rows in use (one tile of 32 keys fetched into L1 ran slower than two of 16 into L2,
 * BENCHMARKS.md). Only the piece's own heads: a lone row's step splits its kv heads between
 * threads, and each fetching every head's row had read the keys three times over (SmolLM2,
 * bfloat16, 2,000 keys: BENCHMARKS.md "CPU attention: a lone row's prefetch"). */
static void prefetch_span(const AttnJob *j, const void *base, int i, int t0, int nt, int h0, int nh) {
    const size_t esize = j->dtype == DT_F32 ? 4 : 2;
    const size_t token_bytes = (size_t)j->kv_heads * j->head_dim * esize; /* a token's heads */
    const size_t head_bytes = (size_t)j->head_dim * esize, from = h0 * head_bytes, to = (h0 + nh) * head_bytes;
    const int32_t *table = table_of(j, i);
    for (int t = t0; t < t0 + nt;) {
        const int b = t / j->block_size, off = t % j->block_size;
        const int run = j->block_size - off < t0 + nt - t ? j->block_size - off : t0 + nt - t;
        const char *first = (const char *)base + ((size_t)table[b] * j->block_size + off) * token_bytes;
        if (nh == j->kv_heads) { /* the run's rows are contiguous */
            for (size_t x = 0; x < run * token_bytes; x += 64) __builtin_prefetch(first + x, 0, 1);
        } else {
            for (int r = 0; r < run; r++) {
                const char *row = first + r * token_bytes;
                const uintptr_t a = ((uintptr_t)(row + from)) & ~(uintptr_t)63, end = (uintptr_t)(row + to);
                for (uintptr_t x = a; x < end; x += 64) __builtin_prefetch((const char *)x, 0, 1);
            }
        }
        t += run;
    }
}

static void prefetch_tile(const AttnJob *j, int i, int t0, int nt, int h0, int nh) {
    prefetch_span(j, j->k, i, t0, nt, h0, nh);
    prefetch_span(j, j->v, i, t0, nt, h0, nh);
}

#if KV_X86

/* What a tile fetches ahead: keys t..t+n-1 of `base` (NULL: nothing). */
typedef struct {
    const void *base;
    int t, n;
} Fetch;

/* Part `part` of `heads` of f's keys (kv heads hs..hs+heads-1 of each): a tile's fetch is
 * spread over its heads' products instead of issued at once before them. A burst of ~100
 * prefetches (a tile's K for every head) filled the core's miss buffers and stalled it until
 * they drained, whether the lines came from memory or from L3: 30 layers of 32 bfloat16
 * sequences over 290 keys took 18.1 ms with the burst, 11.7 ms spread over the three heads
 * (BENCHMARKS.md "CPU attention"). */
static void fetch_part(const AttnJob *j, const Fetch *f, int i, int hs, int heads, int part) {
    const int a = f->t + f->n * part / heads, b = f->t + f->n * (part + 1) / heads;
    if (f->base != NULL && b > a) prefetch_span(j, f->base, i, a, b - a, hs, heads);
}

/* Query i's keys start..len-1 for the heads hs..hs+heads-1 (p[0..heads-1]), a chunk of
 * CHUNK keys at a time: every key's scores first (reading K), one softmax over the chunk, then
 * the values (reading V). An online softmax per tile of 16 keys spent more on its maximum,
 * rescaling and sum than on the tile's products; per chunk it is once per 512 keys. Each
 * pass fetches its array PREFETCH_TILES tiles ahead, and at its end the other pass's first
 * tiles (`fetch` 0: none, the keys are in cache). `scores` holds heads * q_per_kv rows of
 * CHUNK_STRIDE; `stash`, 2 * heads partials (partial_floats), the keys before a chunk and the
 * chunk's own, folded (fold_partial) once the chunk is done. */
static void attend_chunks(const AttnJob *j, Piece *p, int heads, int i, int hs, int start, int len, float *scores,
                          float *stash, const TileOps *ops, int fetch) {
    const int qpk = j->q_heads / j->kv_heads, ahead_keys = PREFETCH_TILES * TILE;
    const size_t head_scores = (size_t)qpk * CHUNK_STRIDE;
    size_t rows0[CHUNK], rows[TILE]; /* the chunk's head-0 pool rows, for both passes */
    for (int t = start; fetch && t < min_int(len, start + ahead_keys); t += TILE) /* later chunks' */
        prefetch_span(j, j->k, i, t, min_int(TILE, len - t), hs, heads); /* first tiles: the pass before */
    const size_t pf = partial_floats(j);
    for (int c0 = start; c0 < len; c0 += CHUNK) {
        const int end = min_int(len, c0 + CHUNK);
        if (c0 > start) { /* the keys so far set aside: this chunk is a partial of its own */
            for (int h = 0; h < heads; h++) {
                save_state(j, &p[h], stash + h * pf);
                clear_state(j, &p[h]);
            }
        }
        key_rows(j, i, c0, end - c0, 0, rows0);
        for (int t0 = c0; t0 < end; t0 += TILE) {
            const int nt = min_int(TILE, end - t0), ahead = t0 + ahead_keys;
            Fetch f = {NULL, 0, 0};
            if (!fetch) {
            } else if (ahead < end) f = (Fetch){j->k, ahead, min_int(TILE, end - ahead)};
            else if (c0 + ahead - end < end) f = (Fetch){j->v, c0 + ahead - end, min_int(TILE, end - (c0 + ahead - end))};
            for (int h = 0; h < heads; h++) {
                fetch_part(j, &f, i, hs, heads, h);
                for (int t = 0; t < nt; t++) rows[t] = rows0[t0 - c0 + t] + hs + h;
                ops->score(j, &p[h], rows, nt, scores + h * head_scores + (t0 - c0));
            }
        }
        for (int h = 0; h < heads; h++) ops->softmax(j, &p[h], scores + h * head_scores, end - c0);
        for (int t0 = c0; t0 < end; t0 += TILE) {
            const int nt = min_int(TILE, end - t0), ahead = t0 + ahead_keys;
            Fetch f = {NULL, 0, 0};
            if (!fetch) {
            } else if (ahead < end) f = (Fetch){j->v, ahead, min_int(TILE, end - ahead)};
            else if (ahead < len) f = (Fetch){j->k, ahead, min_int(TILE, len - ahead)}; /* the next chunk's */
            for (int h = 0; h < heads; h++) {
                fetch_part(j, &f, i, hs, heads, h);
                for (int t = 0; t < nt; t++) rows[t] = rows0[t0 - c0 + t] + hs + h;
                ops->value(j, &p[h], rows, nt, scores + h * head_scores + (t0 - c0));
            }
        }
        if (c0 > start) {
            for (int h = 0; h < heads; h++) {
                float *later = stash + (heads + h) * pf;
                save_state(j, &p[h], later);
                fold_partial(j, stash + h * pf, later);
                load_state(j, &p[h], later);
            }
        }
    }
}
#endif

/* The widest path the kernel may take (tests lower it to check the narrower ones). */
static int isa_cap = ISA_AVX512;

/* The path a job of this dtype and head size takes: ISA_C, ISA_AVX2 or ISA_AVX512. */
static int job_isa(int dtype, int head_dim) {
    if (isa_cap >= ISA_AVX512 && head_dim % (dtype == DT_BF16 ? 32 : 16) == 0 &&
        (dtype == DT_BF16 ? kv_use_avx512_bf16() : kv_use_avx512()))
        return ISA_AVX512;
    if (isa_cap >= ISA_AVX2 && head_dim % 8 == 0 && kv_use_avx2()) return ISA_AVX2;
    return ISA_C;
}

/* Sets the widest path the kernel may take (cap < 0: leaves it); returns the previous cap. */
int attention_set_isa(int cap) {
    const int old = isa_cap;
    if (cap >= 0) isa_cap = cap;
    return old;
}

/* The path a job of this dtype and head size would take now. */
int attention_isa(int dtype, int head_dim) { return job_isa(dtype, head_dim); }

#if KV_X86
/* The vector path's steps for a job, NULL for portable C. */
static const TileOps *job_ops(int dtype, int head_dim) {
    const int isa = job_isa(dtype, head_dim);
    if (isa == ISA_AVX512) return dtype == DT_BF16 ? &OPS_AVX512_BF16 : &OPS_AVX512_F32;
    return isa == ISA_AVX2 ? &OPS_AVX2 : NULL;
}
#endif

/* A thread's working memory, kept between calls: Piece is ~34 KB a kv head, and a malloc per
 * piece of work cost as much as a short sequence's keys. */
static __thread Piece *piece_buf;
static __thread int piece_cap;
static __thread float *score_buf;
static __thread size_t score_cap;

static Piece *pieces(int heads) {
    if (heads > piece_cap) {
        Piece *grown = (Piece *)realloc(piece_buf, sizeof(Piece) * heads);
        if (grown == NULL) return NULL;
        piece_buf = grown;
        piece_cap = heads;
    }
    return piece_buf;
}

static float *score_rows(size_t floats) {
    if (floats > score_cap) {
        float *grown = (float *)realloc(score_buf, sizeof(float) * floats);
        if (grown == NULL) return NULL;
        score_buf = grown;
        score_cap = floats;
    }
    return score_buf;
}

/* A piece is query i's kv heads h0..h0+heads_per_piece-1, walked together, so a token's row of
 * all heads (contiguous in the pool) is read from memory once and then from cache: in chunks
 * with vectors (attend_chunks), else a tile at a time in portable C with an online softmax
 * per tile. */
static void attend(void *ctx, int piece) {
    const AttnJob *j = (const AttnJob *)ctx;
    const int per_seq = j->kv_heads / j->heads_per_piece;
    const int i = piece / per_seq, h0 = piece % per_seq * j->heads_per_piece;
    const int qpk = j->q_heads / j->kv_heads;
    const int len = j->ctx_lens[i];
    const int start = j->window > 0 && len > j->window ? len - j->window : 0;
    Piece one, *p = j->heads_per_piece == 1 ? &one : pieces(j->heads_per_piece);
    if (p == NULL) p = &one; /* out of memory: one head at a time */
    const int heads = p == &one ? 1 : j->heads_per_piece;
    float tile[TILE * MAX_HEAD_DIM]; /* a tile's widened bfloat16 rows, used within one call */
    for (int h = 0; h < heads; h++) p[h].tile = tile;
    float *scores = NULL;
#if KV_X86
    const TileOps *ops = job_ops(j->dtype, j->head_dim);
    const size_t score_floats = (size_t)heads * qpk * CHUNK_STRIDE;
    if (ops != NULL) scores = score_rows(score_floats + 2 * (size_t)heads * partial_floats(j));
    const int raw_q = ops == &OPS_AVX512_BF16;
    /* a prefill token's keys are its segment's, which the token before it just read: they
     * are in cache, and prefetching them again cost more than it saved */
    const int fetch = j->row_table == NULL || i == 0 || j->row_table[i - 1] != j->row_table[i];
#else
    const int raw_q = 0;
#endif
    for (int hs = h0; hs < h0 + j->heads_per_piece; hs += heads) {
        for (int h = 0; h < heads; h++) start_head(j, &p[h], i, hs + h, raw_q);
#if KV_X86
        if (scores != NULL) {
            attend_chunks(j, p, heads, i, hs, start, len, scores, scores + score_floats, ops, fetch);
            for (int h = 0; h < heads; h++) finish_head(j, &p[h], i, hs + h);
            continue;
        }
#endif
        for (int t = start; t < start + PREFETCH_TILES * TILE && t < len; t += TILE)
            prefetch_tile(j, i, t, min_int(TILE, len - t), hs, heads); /* the first tiles, now */
        for (int t0 = start; t0 < len; t0 += TILE) {
            const int ahead = t0 + PREFETCH_TILES * TILE;
            if (ahead < len) prefetch_tile(j, i, ahead, min_int(TILE, len - ahead), hs, heads);
            for (int h = 0; h < heads; h++) attend_tile_c(j, &p[h], i, hs + h, t0, min_int(TILE, len - t0), qpk);
        }
        for (int h = 0; h < heads; h++) finish_head(j, &p[h], i, hs + h);
    }
}

/* Query row i, every kv head (a piece of attend's with heads_per_piece = kv_heads). */
static void attend_rows_of(const AttnJob *j, int i) {
    AttnJob row = *j;
    row.heads_per_piece = j->kv_heads;
    attend(&row, i);
}

#if KV_X86
/* A unit of a split row: kv head h (-1: every kv head) over keys c0..c1-1 (one chunk), its
 * partial in `part` (every head: kv_heads partials, one after another). */
typedef struct {
    int i, h, c0, c1;
    float *part;
} Unit;

typedef struct {
    const AttnJob *job;
    Unit *units;
    const TileOps *ops;
    int failed; /* a thread had no memory for its scores */
} UnitsJob;

static void attend_unit(void *ctx, int u) {
    UnitsJob *w = (UnitsJob *)ctx;
    const AttnJob *j = w->job;
    Unit *un = &w->units[u];
    /* every kv head of the chunk (h < 0): a token's heads are one contiguous row */
    const int heads = un->h < 0 ? j->kv_heads : 1, h0 = un->h < 0 ? 0 : un->h;
    Piece one, *p = heads == 1 ? &one : pieces(heads);
    float *scores = score_rows((size_t)heads * (j->q_heads / j->kv_heads) * CHUNK_STRIDE);
    if (p == NULL || scores == NULL) {
        __atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float tile[TILE * MAX_HEAD_DIM];
    for (int h = 0; h < heads; h++) {
        p[h].tile = tile;
        start_head(j, &p[h], un->i, h0 + h, w->ops == &OPS_AVX512_BF16);
    }
    attend_chunks(j, p, heads, un->i, h0, un->c0, un->c1, scores, NULL, w->ops, 1); /* one chunk: no fold */
    for (int h = 0; h < heads; h++) save_state(j, &p[h], un->part + h * partial_floats(j));
}

/* A step of up to SPLIT_ROWS rows, one of whose keys span more than one chunk: a unit of work
 * per (chunk, kv head) instead of a piece per kv head, so that the threads share a long row's
 * keys, not only its heads (SmolLM2's 3 kv heads on 2 threads ran 2:1, the row at 4-5 GB/s).
 * The caller takes it where the step has fewer than two pieces a thread (two rows of
 * SmolLM2's already split 3:3, and units only added work there). The units' partials are
 * folded in chunk order (fold_partial), as one piece walking the row folds them: the same
 * bits. Returns 0, or -1 where every row fits one chunk or memory runs out (the caller's
 * pieces then compute the rows). */
#define SPLIT_ROWS 16 /* the most rows a split step takes */

/* Whether a split step's units take every kv head of a chunk (True) or one each. A chunk's
 * keys for every head are whole token rows, contiguous in the pool (12 KB runs in a block of
 * SmolLM2's float32 keys), which memory serves faster than one head's 256 bytes of every 768:
 * 0.58-0.81x the time for a lone row of 1,000-4,000 keys (BENCHMARKS "CPU attention: a lone
 * row's chunks with all their heads"). But there are kv_heads times fewer units to share out:
 * a row of 600 keys is a chunk of 512 and one of 88, 1.21x the time on two threads. So every
 * head where the threads' busiest share of whole chunks (units taken in order, each by the
 * least busy thread, as the pool hands them out) stays within ALL_HEADS_GAIN of an even
 * share of all the keys. */
#define ALL_HEADS_GAIN 1.4f
#define MAX_THREADS_SPLIT 64 /* threads the share is reckoned for (more: as 64) */
static int split_all_heads(const AttnJob *j, int n, const int *starts, const int *chunks, int most) {
    const int threads = pool_size() < 1 ? 1 : pool_size();
    const int t = threads < MAX_THREADS_SPLIT ? threads : MAX_THREADS_SPLIT;
    long load[MAX_THREADS_SPLIT] = {0}, total = 0, busiest = 0;
    for (int c = 0; c < most; c++) /* in split_rows' order: the rows' first chunks, then... */
        for (int i = 0; i < n; i++) {
            if (c >= chunks[i]) continue;
            const int keys = min_int(j->ctx_lens[i] - starts[i] - c * CHUNK, CHUNK);
            int least = 0;
            for (int x = 1; x < t; x++) least = load[x] < load[least] ? x : least;
            load[least] += keys;
            total += keys;
            busiest = load[least] > busiest ? load[least] : busiest;
        }
    return (float)busiest <= ALL_HEADS_GAIN * (float)total / (float)t;
}

static int split_rows(const AttnJob *j, int n, const TileOps *ops) {
    int chunks[SPLIT_ROWS], starts[SPLIT_ROWS], first[SPLIT_ROWS], most = 1, count = 0;
    if (n > SPLIT_ROWS) return -1;
    for (int i = 0; i < n; i++) {
        const int len = j->ctx_lens[i];
        starts[i] = j->window > 0 && len > j->window ? len - j->window : 0;
        chunks[i] = len - starts[i] > CHUNK ? (len - starts[i] + CHUNK - 1) / CHUNK : 1;
        most = chunks[i] > most ? chunks[i] : most;
        first[i] = count; /* row i's partials: parts[first[i] + c * kv_heads + h] */
        count += chunks[i] * j->kv_heads;
    }
    if (most < 2) return -1;
    const size_t pf = partial_floats(j);
    Unit *units = (Unit *)malloc(sizeof(Unit) * count);
    float *parts = (float *)malloc(sizeof(float) * pf * count);
    UnitsJob w = {j, units, ops, 0};
    if (units != NULL && parts != NULL) {
        const int all = split_all_heads(j, n, starts, chunks, most);
        int u = 0; /* run chunk by chunk: the rows' first chunks, then their second ones... */
        for (int c = 0; c < most; c++)
            for (int i = 0; i < n; i++)
                for (int h = 0; c < chunks[i] && h < (all ? 1 : j->kv_heads); h++) {
                    const int c0 = starts[i] + c * CHUNK;
                    float *part = parts + (size_t)(first[i] + c * j->kv_heads + h) * pf;
                    units[u++] = (Unit){i, all ? -1 : h, c0, min_int(j->ctx_lens[i], c0 + CHUNK), part};
                }
        pool_run(attend_unit, &w, u);
    }
    const int done = units != NULL && parts != NULL && !w.failed;
    for (int i = 0; done && i < n; i++) {
        for (int h = 0; h < j->kv_heads; h++) {
            float *state = parts + (size_t)(first[i] + h) * pf;
            for (int c = 1; c < chunks[i]; c++) {
                float *later = parts + (size_t)(first[i] + c * j->kv_heads + h) * pf;
                fold_partial(j, state, later);
                state = later;
            }
            Piece whole;
            load_state(j, &whole, state);
            whole.acc_pairs = ops == &OPS_AVX512_BF16; /* the layout its value tiles leave */
            finish_head(j, &whole, i, h);
        }
    }
    free(units);
    free(parts);
    return done ? 0 : -1;
}
#endif

/* A step's work as blocks of a prefill segment's tokens and single rows. */
typedef struct {
    int first, count; /* query rows first..first+count-1 */
    int block;        /* 1: rows of a segment of more than one token (a block, even of one row) */
} Item;

typedef struct {
    const AttnJob *job;
    const Item *items;
    int avx2; /* blocks by attend_block_avx2, else attend_block_bf16 */
} ItemsJob;

#if KV_X86
static void attend_item(void *ctx, int index) {
    const ItemsJob *w = (const ItemsJob *)ctx;
    const Item it = w->items[index];
    const int done = !it.block ? -1
                     : w->avx2    ? attend_block_avx2(w->job, it.first, it.count)
                                  : attend_block_bf16(w->job, it.first, it.count);
    if (done != 0) /* a single row, or out of memory: a row at a time */
        for (int i = it.first; i < it.first + it.count; i++) attend_rows_of(w->job, i);
}
#endif

/* Attention for n query rows (see the file comment); row_table NULL: row i uses table row i;
 * window 0 = none. Returns 0, or -1 for a shape this kernel does not take (the caller then
 * uses the torch path). */
int paged_attention_rows(int dtype, int n, int q_heads, int kv_heads, int head_dim, int block_size,
                         int max_blocks, int window, float scale, const void *q, const void *k,
                         const void *v, const int64_t *rows, const int32_t *tables,
                         const int32_t *ctx_lens, const int32_t *row_table, void *out) {
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    if (n < 1 || kv_heads < 1 || q_heads % kv_heads != 0 || q_heads / kv_heads > MAX_Q_PER_KV) return -1;
    if (head_dim < 1 || head_dim > MAX_HEAD_DIM || block_size < 1 || max_blocks < 1) return -1;
    /* a batch splits by query (a token's heads read together); a few queries by kv head, so
     * that every thread of the pool has work */
    const int per_piece = n >= 4 ? kv_heads : 1;
    AttnJob job = {dtype, q_heads, kv_heads, head_dim, block_size, max_blocks, window, per_piece,
                   scale, q, k, v, rows, tables, ctx_lens, row_table, out};
#if KV_X86
    const int isa = job_isa(dtype, head_dim), bf16_dot = dtype == DT_BF16 && isa == ISA_AVX512;
    if (row_table != NULL && n >= 4 && (bf16_dot || isa == ISA_AVX2)) {
        /* prefill segments' consecutive tokens in blocks (attend_block_bf16 with BF16 dot
         * products, else attend_block_avx2; a float32 pool on AVX-512 keeps the row path), the
         * rest a row each: one item of work per block or row */
        const int per_block = (bf16_dot ? BLOCK_QUERIES : BLOCK_QUERIES_AVX2) / (q_heads / kv_heads);
        Item *items = per_block > 1 ? (Item *)malloc(sizeof(Item) * n) : NULL;
        if (items != NULL) {
            int count = 0;
            for (int i = 0; i < n;) {
                int e = i + 1; /* the segment's consecutive tokens from row i */
                while (e < n && row_table[e] == row_table[i] && rows[e] == rows[e - 1] + 1 &&
                       ctx_lens[e] == ctx_lens[e - 1] + 1)
                    e++;
                /* every token of a segment in a block, a last one alone too, so that a token's
                 * sums do not depend on how its segment splits; a lone row (a decode token, a
                 * one-token segment) takes the row path, as in a step of decode tokens only */
                for (int f = i; f < e; f += per_block) items[count++] = (Item){f, min_int(per_block, e - f), e - i > 1};
                i = e;
            }
            ItemsJob items_job = {&job, items, !bf16_dot};
            pool_run(attend_item, &items_job, count);
            free(items);
            return 0;
        }
    }
    if (n * kv_heads < 2 * pool_size()) { /* under two pieces a thread: a long row's chunks shared */
        const TileOps *ops = job_ops(dtype, head_dim);
        if (ops != NULL && split_rows(&job, n, ops) == 0) return 0;
    }
#endif
    pool_run(attend, &job, n * (kv_heads / per_piece));
    return 0;
}

/* Decode attention: one query row per table row. */
int decode_attention(int dtype, int n, int q_heads, int kv_heads, int head_dim, int block_size,
                     int max_blocks, int window, float scale, const void *q, const void *k,
                     const void *v, const int64_t *rows, const int32_t *tables,
                     const int32_t *ctx_lens, void *out) {
    return paged_attention_rows(dtype, n, q_heads, kv_heads, head_dim, block_size, max_blocks, window, scale, q,
                                k, v, rows, tables, ctx_lens, NULL, out);
}
