/*
 * Products of CPU steps of many rows on an AVX2 or AVX-512 CPU: y[M, N] = x[M, K] @ W (+ bias), with W
 * copied once, when the engine starts, into panels of 16 columns, each stored [K][16] (one
 * contiguous 36 KB stream for K = 576).
 *
 * Why not oneDNN's blocked copies there: a batched decode step reads every weight from memory
 * once, and on the AVX2 EPYC of BENCHMARKS.md oneDNN's float32 kernels reached 21-73 GFLOP/s on
 * SmolLM2's 30 layers at 8-64 rows (weights streaming from memory), against ~120 with the same
 * weights in cache: they wait on memory. This kernel reads a panel as one sequential stream
 * (prefetched ahead) and keeps a 6 x 16 tile of y in twelve registers over the whole K, so
 * each panel row (two vectors) feeds twelve multiply-adds: 1.3-1.6x oneDNN's speed at 8-64
 * rows there, 1.1x at 256 and 0.93x at 2,048 ("Packed panels" in BENCHMARKS.md). A block's
 * rows go in tiles as even as 6 allows, each of exactly its rows (8 rows: two tiles of 4, 16
 * multiply-adds a panel row, not 6 + 2 rows' 24): 1.05-1.15x at 8-256 rows.
 *
 * On AVX-512 a tile is 12 rows by two neighbouring panels (32 columns, 24 accumulators):
 * 1.27x the AVX2 tile at 16 rows, 1.5-1.7x at 64-2,048 on the Xeon of BENCHMARKS.md ("Packed
 * panels on AVX-512"), with the same sums.
 *
 *   panels_pack   W (float32 or bfloat16, stored [K, N] or [N, K]) -> float32 panels; columns
 *                 past N in the last panel are zeros
 *   panels_gemm   y = x @ W (+ bias), x and y float32; up to MC_FROM rows a panel is read once
 *                 for all rows (one stream from memory, the next panel fetched while the
 *                 first tile runs); more rows go in blocks of MC, each
 *                 block reading the panels again (from cache: a prefill chunk's x block stays
 *                 in L2 while the panels stream)
 *   panels_gemm_plain  the same on the plain weight, a panel packed as it is reached: the
 *                 same sums, for the steps that come before the copy exists
 *
 * Each output is a sum over k in order (float32; fused multiply-adds in the AVX2 tile, which
 * is the one used wherever the panels are chosen), so a row's result does not depend on the
 * other rows of the step or on the thread that computed it. Work is
 * split by panels over the kernels' pool (pool.h): the threads torch's OpenMP team uses in a
 * batched step.
 */
#include "bf16.h"
#include "pool.h"
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define KV_X86 1
#else
#define KV_X86 0
#endif

#define NR 16       /* columns of a panel: two AVX2 vectors */
#define MR 6        /* rows of an AVX2 register tile: 6 x 2 accumulators + 2 weights + 1 broadcast */
#define MR512 12    /* rows of an AVX-512 tile over two panels: 12 x 2 accumulators of 32 registers */
#ifndef MC
#define MC 48       /* rows of a block when the step has more than MC_FROM */
#endif
#define MC_FROM 128 /* up to this many rows, one block: each panel streams from memory once */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16 /* panel rows (1 KB) the first tile of a block prefetches ahead */
#endif
#define CHUNKS_PER_THREAD 4
#ifndef SPREAD_TILES
#define SPREAD_TILES 4 /* up to this many tiles a block, each asks for a share of the next panel */
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

#if KV_X86
/* Multiply-add rate of a register-only loop (12 independent chains, `iters` rounds): float32
 * FMAs (bf16 = 0, 32 flops an instruction) or AVX512-BF16 dot products (64), in flops a
 * nanosecond. */
__attribute__((target("avx512f,avx512bf16"), noinline)) static double dot_rate(int bf16, long iters) {
    volatile float seed = 1e-3f;
    __m512 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps(seed * (float)i);
    const __m512 a = _mm512_set1_ps(seed), b = _mm512_set1_ps(seed * 2.f);
    const __m512bh ah = _mm512_cvtne2ps_pbh(a, a), bh = _mm512_cvtne2ps_pbh(b, b);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long n = 0; n < iters; n++) {
        if (bf16)
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], ah, bh);
        else
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(a, acc[i], b);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    float sink = 0.f;
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(acc[i]);
    seed = sink; /* the loops' results are used */
    const double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    return (double)iters * 12 * (bf16 ? 64 : 32) / (ns > 0 ? ns : 1);
}
#else
static double dot_rate(int bf16, long iters) {
    (void)bf16, (void)iters;
    return 0;
}
#endif

/* How many times float32 multiply-adds' flops AVX512-BF16's dot products compute (best of
 * three ~0.1 ms timings of each; 0 without AVX512-BF16), measured once: on the Zen 4 EPYC of
 * BENCHMARKS.md oneDNN's bfloat16 ran the offline workload 1.8x as fast as its float32, on
 * the Xeon the dot products issue at half the rate (80 against 161 GFLOP/s a core). */
double panels_bf16_dot_ratio(void) {
    static double ratio = -1;
    if (ratio < 0) {
        double f32 = 0, bf16 = 0;
        if (KV_X86 && kv_use_avx512_bf16()) {
            for (int i = 0; i < 3; i++) {
                const double f = dot_rate(0, 20000), b = dot_rate(1, 20000);
                f32 = f > f32 ? f : f32, bf16 = b > bf16 ? b : bf16;
            }
        }
        ratio = f32 > 0 ? bf16 / f32 : 0;
    }
    return ratio;
}

/* True where the panels are the faster copy: AVX2 and FMA (AVX-512 too: its tile spans two
 * panels), unless the CPU computes bfloat16 faster than float32, where oneDNN's bfloat16
 * kernels stay the choice: AMX (matrix tiles), or AVX512-BF16 dot products that outrun
 * float32 multiply-adds by a quarter (panels_bf16_dot_ratio). Elsewhere oneDNN's bfloat16 is no faster than
 * float32 multiply-adds on widened weights, and its float32 kernels wait on memory at 8-64
 * rows. */
int panels_preferred(void) {
#if KV_X86
    unsigned a = 0, b = 0, c = 0, d = 0;
    const int amx = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1u); /* AMX-BF16 */
    return kv_use_avx2() && !amx && panels_bf16_dot_ratio() < 1.25;
#else
    return 0;
#endif
}

/* Panel p of w (float32 or bfloat16; transposed = 1: stored [k, n], 0: stored [n, k], a tied
 * embedding as the LM head) as float32 [k][16], columns past n zero. */
static void pack_panel(int k, int n, const void *w, int dtype, int transposed, int p, float *panel) {
    for (int kk = 0; kk < k; kk++) {
        for (int c = 0; c < NR; c++) {
            const int col = p * NR + c;
            float v = 0.f;
            if (col < n) {
                const size_t i = transposed ? (size_t)kk * n + col : (size_t)col * k + kk;
                v = dtype == DT_F32 ? ((const float *)w)[i] : bf16_to_f32(((const uint16_t *)w)[i]);
            }
            panel[(size_t)kk * NR + c] = v;
        }
    }
}

/* Every panel of w into out (ceil(n / 16) * k * 16 floats). */
void panels_pack(int k, int n, const void *w, int dtype, int transposed, float *out) {
    const int np = (n + NR - 1) / NR;
    for (int p = 0; p < np; p++) pack_panel(k, n, w, dtype, transposed, p, out + (size_t)p * k * NR);
}

typedef struct {
    int m, k, n, np, chunks;
    const float *x, *wp, *bias; /* wp NULL: the plain weight w, each panel packed as it goes */
    float *y;
    const void *w;
    int dtype, transposed;
    int failed; /* a chunk could not allocate its panel buffer (plain weights) */
    int wide;   /* panels a tile spans: 2 on AVX-512 (a 16-lane vector each), else 1 */
} Gemm;

/* y rows r..r+mr-1 (mr <= MR), columns of panel p (ncols of them), over the whole k. In the
 * AVX2 tile, rows past mr repeat row r (their sums are dropped), so every tile runs the same
 * code. */
static void tile_portable(const Gemm *g, const float *panel, int r, int mr, int p, int ncols) {
    for (int i = 0; i < mr; i++) {
        float acc[NR] = {0};
        const float *xr = g->x + (size_t)(r + i) * g->k;
        for (int kk = 0; kk < g->k; kk++)
            for (int c = 0; c < NR; c++) acc[c] += xr[kk] * panel[(size_t)kk * NR + c];
        float *yr = g->y + (size_t)(r + i) * g->n + (size_t)p * NR;
        for (int c = 0; c < ncols; c++) yr[c] = acc[c] + (g->bias ? g->bias[p * NR + c] : 0.f);
    }
}

#if KV_X86
/* The tile of ROWS rows (1..MR, a constant where it is inlined): 2 * ROWS accumulators, so a
 * tile of fewer rows does fewer multiply-adds, not MR rows' worth. prefetch: ask for the
 * panel's own rows PREFETCH_ROWS ahead (a block's first tile). next (or NULL): lines to ask
 * for into L2, all k of them one a step, or with SPREAD `lines` of them evenly over the k
 * steps (a constant too: the loop of the tiles that do not spread is the one it was). */
__attribute__((target("avx2,fma"), always_inline)) static inline void tile_avx2_rows(const Gemm *g, const float *panel, int r, int p, int ncols, int prefetch, const char *next, int lines, const int ROWS, const int SPREAD) {
    const int k = g->k;
    int due = 0;
    const float *xs[MR];
    __m256 acc[MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; i++) {
        xs[i] = g->x + (size_t)(r + i) * k;
        acc[i][0] = _mm256_setzero_ps(), acc[i][1] = _mm256_setzero_ps();
    }
    /* k unrolled by four: the loop's own instructions (index, compare, branch, prefetch
     * addresses) were a sixth of the 24-28 a step, against Zen 3's dispatch width; 0.90-0.98x
     * the time at 32-2,048 rows in an ad hoc harness, inside the noise of panels_ab.py and
     * engine_ab.py (BENCHMARKS "Panels: the tile's k loop unrolled") */
#pragma GCC unroll 4
    for (int kk = 0; kk < k; kk++) {
        const float *row = panel + (size_t)kk * NR;
        if (prefetch) _mm_prefetch((const char *)(row + PREFETCH_ROWS * NR), _MM_HINT_T0);
        if (!SPREAD) {
            if (next != NULL) _mm_prefetch(next + (size_t)kk * 64, _MM_HINT_T1);
        } else if (next != NULL && (due += lines) >= k) { /* `lines` of them over the k steps */
            due -= k;
            _mm_prefetch(next, _MM_HINT_T1);
            next += 64;
        }
        const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
#pragma GCC unroll 8
        for (int i = 0; i < ROWS; i++) {
            const __m256 b = _mm256_broadcast_ss(xs[i] + kk);
            acc[i][0] = _mm256_fmadd_ps(b, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, w1, acc[i][1]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; i++) {
        float *yr = g->y + (size_t)(r + i) * g->n + (size_t)p * NR;
        if (ncols == NR) { /* stored straight from the registers (a memcpy call was 1-2%) */
            if (g->bias != NULL) {
                acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_loadu_ps(g->bias + p * NR));
                acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_loadu_ps(g->bias + p * NR + 8));
            }
            _mm256_storeu_ps(yr, acc[i][0]), _mm256_storeu_ps(yr + 8, acc[i][1]);
            continue;
        }
        float out[NR];
        _mm256_storeu_ps(out, acc[i][0]), _mm256_storeu_ps(out + 8, acc[i][1]);
        if (g->bias != NULL)
            for (int c = 0; c < ncols; c++) out[c] += g->bias[p * NR + c];
        memcpy(yr, out, sizeof(float) * ncols);
    }
}

/* A tile of mr rows; lines < k: `next` is its share of the next panel, asked for a line at a
 * time over its k steps (SPREAD), else the whole of it, a line a step. */
#define TILE_CASE(ROWS)                                                                                \
    case ROWS:                                                                                         \
        if (lines < g->k) tile_avx2_rows(g, panel, r, p, ncols, prefetch, next, lines, ROWS, 1);       \
        else tile_avx2_rows(g, panel, r, p, ncols, prefetch, next, lines, ROWS, 0);                    \
        break;
__attribute__((target("avx2,fma"))) static void tile_avx2(const Gemm *g, const float *panel, int r, int mr, int p, int ncols, int prefetch, const char *next, int lines) {
    switch (mr) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
        TILE_CASE(5)
    default:
        TILE_CASE(6)
    }
}
#undef TILE_CASE

/* The AVX-512 tile: ROWS rows (1..MR512) by the columns of panels p and, where TWO, p + 1 (a
 * 16-lane vector each; panel p + 1 follows panel p in memory), over the whole k, in the same
 * order and with the same fused multiply-adds as the AVX2 tile: the same sums, bit for bit.
 * Two panels a tile, so a k step's two weight vectors feed 2 x ROWS multiply-adds against
 * ROWS + 2 loads (one panel would make it a load per multiply-add, which the two load ports
 * cannot keep up with beside the two FMA ports). prefetch: the panels' own rows PREFETCH_ROWS
 * ahead (a block's first tile); next (or NULL): `lines` lines to ask for into L2, spread over
 * the k steps (at most two a step). */
__attribute__((target("avx512f"), always_inline)) static inline void tile_avx512_rows(const Gemm *g, const float *panel, int r, int p, int prefetch, const char *next, int lines, const int ROWS, const int TWO) {
    const int k = g->k;
    const float *panel1 = panel + (size_t)k * NR;
    /* row i of x at xb[i / 3] + (i % 3) * stride: four pointers and the stride in registers
     * (twelve row pointers were kept in vector registers, and each move to a general one took
     * a port the multiply-adds need) */
    const size_t stride = (size_t)k * sizeof(float);
    const char *xb[MR512 / 3];
    __m512 acc[MR512][2];
    int due = 0;
#pragma GCC unroll 4
    for (int j = 0; j < (ROWS + 2) / 3; j++) xb[j] = (const char *)(g->x + (size_t)(r + 3 * j) * k);
#pragma GCC unroll 12
    for (int i = 0; i < ROWS; i++) acc[i][0] = _mm512_setzero_ps(), acc[i][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int kk = 0; kk < k; kk++) {
        const float *row0 = panel + (size_t)kk * NR, *row1 = panel1 + (size_t)kk * NR;
        if (prefetch) {
            _mm_prefetch((const char *)(row0 + PREFETCH_ROWS * NR), _MM_HINT_T0);
            if (TWO) _mm_prefetch((const char *)(row1 + PREFETCH_ROWS * NR), _MM_HINT_T0);
        }
        if (next != NULL && (due += lines) >= k) {
            due -= k;
            _mm_prefetch(next, _MM_HINT_T1);
            next += 64;
            if (due >= k) {
                due -= k;
                _mm_prefetch(next, _MM_HINT_T1);
                next += 64;
            }
        }
        const __m512 w0 = _mm512_loadu_ps(row0);
        const __m512 w1 = TWO ? _mm512_loadu_ps(row1) : _mm512_setzero_ps();
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            const __m512 b = _mm512_set1_ps(*(const float *)(xb[i / 3] + (i % 3) * stride));
            acc[i][0] = _mm512_fmadd_ps(b, w0, acc[i][0]);
            if (TWO) acc[i][1] = _mm512_fmadd_ps(b, w1, acc[i][1]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < (ROWS + 2) / 3; j++) xb[j] += sizeof(float);
    }
    for (int h = 0; h < 1 + TWO; h++) {
        const int col0 = (p + h) * NR, ncols = g->n - col0 < NR ? g->n - col0 : NR;
        const __mmask16 mask = (__mmask16)((1u << ncols) - 1u);
        const __m512 bias = g->bias != NULL ? _mm512_maskz_loadu_ps(mask, g->bias + col0) : _mm512_setzero_ps();
#pragma GCC unroll 12
        for (int i = 0; i < ROWS; i++) {
            __m512 v = acc[i][h];
            if (g->bias != NULL) v = _mm512_add_ps(v, bias);
            _mm512_mask_storeu_ps(g->y + (size_t)(r + i) * g->n + col0, mask, v);
        }
    }
}

#define TILE_CASE(ROWS)                                                                                \
    case ROWS:                                                                                         \
        if (two) tile_avx512_rows(g, panel, r, p, prefetch, next, lines, ROWS, 1);                     \
        else tile_avx512_rows(g, panel, r, p, prefetch, next, lines, ROWS, 0);                         \
        break;
__attribute__((target("avx512f"))) static void tile_avx512(const Gemm *g, const float *panel, int two, int r, int mr, int p, int prefetch, const char *next, int lines) {
    switch (mr) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
        TILE_CASE(5)
        TILE_CASE(6)
        TILE_CASE(7)
        TILE_CASE(8)
        TILE_CASE(9)
        TILE_CASE(10)
        TILE_CASE(11)
    default:
        TILE_CASE(12)
    }
}
#undef TILE_CASE
#endif

/* Chunk c of g->chunks: its share of the units (g->wide panels each; the first nu % chunks
 * chunks one unit more, so the larger come first), for every block of rows. */
static void run_chunk(void *ctx, int c) {
    const Gemm *g = ctx;
    const int w = g->wide, nu = (g->np + w - 1) / w;
    const int q = nu / g->chunks, rem = nu % g->chunks;
    const int u0 = c * q + (c < rem ? c : rem), u1 = u0 + q + (c < rem);
    const int block = g->m > MC_FROM ? MC : g->m;
    const int mr_max = w == 2 ? MR512 : MR;
    float *buf = NULL; /* plain weights: the panels being used, packed from w */
    if (g->wp == NULL && (buf = malloc(sizeof(float) * g->k * NR * w)) == NULL) {
        __atomic_store_n((int *)&g->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int m0 = 0; m0 < g->m; m0 += block) {
        const int m1 = m0 + block < g->m ? m0 + block : g->m;
        for (int u = u0; u < u1; u++) {
            const int p = u * w, two = w == 2 && p + 1 < g->np;
            const int ncols = g->n - p * NR < NR ? g->n - p * NR : NR;
            if (buf != NULL)
                for (int h = 0; h <= two; h++) pack_panel(g->k, g->n, g->w, g->dtype, g->transposed, p + h, buf + (size_t)h * g->k * NR);
            const float *panel = buf != NULL ? buf : g->wp + (size_t)p * g->k * NR;
            /* a step of up to MC_FROM rows reads each panel once, from memory: the block's
             * first tile also asks for the chunk's next panel into L2, a line (of its k) a
             * step, so the memory stream goes on while the other tiles compute from cache
             * (paired A/B 1.01-1.05x at 16-128 rows; BENCHMARKS "Panels"). In a block of
             * up to SPREAD_TILES tiles each tile asks for its share of the lines
             * instead: the first one's burst of k prefetches stalled it while the others,
             * few, asked for nothing (1.09-1.29x at 9-18 rows when the host is busy,
             * 1.18-1.27x when it is quiet). Spread over more tiles it hurt in the host's busy
             * spells (0.72-0.89x at 64-2,048 rows; BENCHMARKS "Panels: the next panel's
             * lines spread over the tiles") */
            const int pn = p + w, next_panels = g->np - pn < w ? g->np - pn : w;
            const char *next = g->wp != NULL && g->m <= MC_FROM && u + 1 < u1 ? (const char *)(g->wp + (size_t)pn * g->k * NR) : NULL;
            const int next_lines = next != NULL ? g->k * next_panels : 0;
            /* the block's rows in tiles as even as the tile allows (8 rows: 4 + 4, not 6 + 2) */
            const int tiles = (m1 - m0 + mr_max - 1) / mr_max;
            for (int t = 0, r = m0, mr = 0; t < tiles; t++, r += mr) {
                mr = (m1 - r + (tiles - t) - 1) / (tiles - t);
                const int prefetch = g->wp != NULL && r == m0;
                /* this tile's share of the next panels' lines: all of them for the first
                 * tile of a block of more than SPREAD_TILES tiles, else an even share */
                const int l0 = tiles > SPREAD_TILES ? 0 : (int)((long)t * next_lines / tiles);
                const int l1 = tiles > SPREAD_TILES ? (t == 0 ? next_lines : 0) : (int)((long)(t + 1) * next_lines / tiles);
                const char *share = next != NULL && l1 > l0 ? next + (size_t)l0 * 64 : NULL;
#if KV_X86
                if (w == 2) {
                    tile_avx512(g, panel, two, r, mr, p, prefetch, share, l1 - l0);
                    continue;
                }
                if (kv_use_avx2()) {
                    tile_avx2(g, panel, r, mr, p, ncols, prefetch, share, l1 - l0);
                    continue;
                }
#endif
                tile_portable(g, panel, r, mr, p, ncols);
            }
        }
    }
    free(buf);
}

static int allow_wide = 1; /* panels_allow_avx512: tests turn it off to compare the two tiles */

/* Lets (1) or stops (0) the products taking the AVX-512 tile; returns the previous setting
 * (on < 0: leaves it). */
int panels_allow_avx512(int on) {
    const int old = allow_wide;
    if (on >= 0) allow_wide = on;
    return old;
}

static int run(Gemm *g, int threads) {
    const int want = (threads < 1 ? 1 : threads) * CHUNKS_PER_THREAD;
    g->np = (g->n + NR - 1) / NR;
#if KV_X86
    g->wide = allow_wide && kv_use_avx512() ? 2 : 1;
#else
    g->wide = 1;
#endif
    const int nu = (g->np + g->wide - 1) / g->wide;
    /* shares as even as the units allow, the larger first: the pool's threads take chunks in
     * turn, so a thread's sum differs from another's by at most a unit. Chunks of a rounded-up
     * size (36 panels: seven of 5 and one of 1) left one thread 20 panels against 16 on
     * SmolLM2's o and down products (BENCHMARKS "Panels: the tile's k loop unrolled") */
    g->chunks = nu < want ? nu : want;
    pool_run(run_chunk, g, g->chunks);
    return g->failed ? -2 : 0;
}

/* y[m, n] = x[m, k] @ W + bias (bias may be NULL), W as panels_pack wrote it. threads: the
 * pool's size, to cut the panels into CHUNKS_PER_THREAD chunks a thread. Returns 0, or -1 for
 * a bad shape. */
int panels_gemm(int m, int k, int n, const float *x, const float *wp, const float *bias, float *y, int threads) {
    if (m < 1 || k < 1 || n < 1 || wp == NULL) return -1;
    Gemm g = {m, k, n, 0, 0, x, wp, bias, y, NULL, DT_F32, 1, 0}; /* run() sets wide */
    return run(&g, threads);
}

/* The same product on the plain weight w (float32 or bfloat16, stored as panels_pack takes
 * it), each panel packed into a thread's buffer as it is reached: the same sums, bit for bit,
 * as panels_gemm on panels_pack's copy (a step's result does not depend on whether the copy
 * exists yet). Returns 0, -1 for a bad shape or dtype, -2 out of memory. */
int panels_gemm_plain(int m, int k, int n, const float *x, const void *w, int dtype, int transposed, const float *bias, float *y, int threads) {
    if (m < 1 || k < 1 || n < 1 || w == NULL || (dtype != DT_F32 && dtype != DT_BF16)) return -1;
    Gemm g = {m, k, n, 0, 0, x, NULL, bias, y, w, dtype, transposed, 0};
    return run(&g, threads);
}
