/*
 * Skinny matrix products for CPU decode steps: y[M, N] = x[M, K] @ W, M small (1-4 rows).
 *
 * A decode step multiplies a handful of rows by every weight of the model once, so its
 * matmuls are bound by the bytes of W, not by arithmetic. MKL runs these shapes on one thread
 * (about 17 GB/s here, a core's read bandwidth); this library splits each product over a
 * small pool of threads so that every core streams its own contiguous share of W:
 *
 *   gemv_kn: W stored [K, N] (kvrelay's transposed projections). The K rows are split into
 *            chunks; a thread reads a chunk as eight sequential streams (one per eighth of
 *            its rows) into the chunk's own float32 partial of y, and the partials are summed
 *            in chunk order at the end, so a result never depends on which thread took which
 *            chunk.
 *   gemv_nk: W stored [N, K] (a tied embedding serving as the LM head). The N rows are split;
 *            each output is a dot product of one W row with each x row, four rows (one per
 *            quarter of the chunk) at a time.
 *
 * Why streams: a core reads memory fastest as a few long sequential streams that the hardware
 * prefetcher can run ahead of. Eight adjacent rows of a 576-column matrix are eight
 * interleaved 1.2 KB pieces of one page, which it does not follow: one core read 8 GB/s that
 * way against 14 GB/s from eight spans (Sapphire Rapids, BENCHMARKS.md "gemv streams").
 *
 * float32 and bfloat16 weights (x and y have W's dtype); accumulation is float32 and a
 * bfloat16 y is rounded to nearest even, as torch rounds. AVX2+FMA code is chosen at run time
 * (portable C otherwise), so the library builds with plain -O3 for any x86-64 or ARM host.
 *
 * The pool: gemv_set_threads(n) starts n - 1 helper threads. A call publishes its job under a
 * mutex and wakes the helpers, does share 0 itself, then waits for the others. A helper polls
 * for the next job for a short while after each one (a decode step's products come tens of
 * microseconds apart) and then sleeps on the condition variable, so an idle engine burns no
 * CPU. Calls come from one thread at a time (the engine's step loop); gemv_lock serializes
 * callers anyway.
 *
 * Batched steps run their jobs on OpenMP instead (gemv_use_openmp(1), set by the engine for
 * steps where torch runs on all threads): the same runtime (libgomp) and so the same threads
 * as torch's own parallel regions. Torch's OpenMP team spins on its cores for a while after
 * every torch op, so a helper of this pool woken between two torch ops got about half a core
 * (decode attention after a packed linear, 64 rows: 1.9 against 0.5 ms alone). A lone
 * decode step keeps this pool: torch runs on one thread then (no team spinning), and
 * libgomp's own wait between the step's many small jobs made it slower (bfloat16 SmolLM2:
 * 16.9 against 11-13 ms a step).
 */
#include <pthread.h>
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "pool.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_X86 1
#define KV_PAUSE() _mm_pause()
#else
#define KV_X86 0
#define KV_PAUSE() ((void)0)
#endif

#define MAX_THREADS 64
#define MAX_ROWS 8
#define MAX_NK_K 8192 /* the BF16 nk path's x copy: hidden sizes up to this */
#define CHUNKS_PER_THREAD 4 /* enough to even out a slow thread; 1 or 2 measured the same */
#define SPIN_POLLS 200 /* sched_yield()s a helper polls for the next job before sleeping */

enum { DT_F32 = 0, DT_BF16 = 1 };

typedef struct {
    int kind; /* 0: kn, 1: nk, 2: a pool_run callback */
    int dtype;
    int m, k, n;
    const void *w;
    float *xf;       /* [m, k] x in float32 */
    float *partials; /* kn: [chunks, m, n], one per chunk; nk: [m, n] */
    int chunk;       /* K rows (kn) or W rows (nk) per chunk */
    int num_chunks;
    pool_fn fn; /* kind 2: called once per chunk */
    void *ctx;
} Job;

/* A job's chunks are claimed through `ticket` = generation << 32 | next chunk, so a thread
 * that wakes late can never claim a chunk of a later job with an earlier job's fields. */
static pthread_mutex_t pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t gemv_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static uint64_t generation = 0;
static uint64_t ticket = 0;
static int pending = 0; /* chunks of the current job not yet finished */
static int shutdown_flag = 0;
static int pool_threads = 1; /* including the caller */
static pthread_t helpers[MAX_THREADS];
static Job current;
static float *scratch = NULL;
static size_t scratch_floats = 0;
static int have_avx2 = -1;
static int use_openmp = 0; /* jobs run as OpenMP parallel loops (gemv_use_openmp) */

/* ------------------------------------------------------------------ portable kernels */

static inline float w_at(const void *w, int dtype, size_t i) {
    return dtype == DT_F32 ? ((const float *)w)[i] : bf16_to_f32(((const uint16_t *)w)[i]);
}

/* out[m, 0:n] += sum over rows k0..k1-1 of xf[m, k] * w[k, 0:n] */
static void kn_portable(const Job *j, int k0, int k1, float *out) {
    for (int k = k0; k < k1; k++) {
        for (int c = 0; c < j->n; c++) {
            float wv = w_at(j->w, j->dtype, (size_t)k * j->n + c);
            for (int r = 0; r < j->m; r++) out[(size_t)r * j->n + c] += j->xf[(size_t)r * j->k + k] * wv;
        }
    }
}

/* out[m, r] for rows r0..r1-1 of w [n, k] */
static void nk_portable(const Job *j, int r0, int r1, float *out) {
    for (int row = r0; row < r1; row++) {
        for (int r = 0; r < j->m; r++) {
            float acc = 0.0f;
            for (int c = 0; c < j->k; c++)
                acc += j->xf[(size_t)r * j->k + c] * w_at(j->w, j->dtype, (size_t)row * j->k + c);
            out[(size_t)r * j->n + row] = acc;
        }
    }
}

/* ------------------------------------------------------------------ AVX2 kernels */

#if KV_X86
__attribute__((target("avx2,fma"))) static inline __m256 load8(const void *w, int dtype, size_t i) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* out += rows k0..k1-1 of w [k, n]. The rows are cut into KN_STREAMS equal spans and a step
 * takes one row from each span, so the core reads KN_STREAMS long sequential streams at once
 * (rows left over after whole spans go one at a time at the end). Each W vector is loaded
 * once, and each x row's broadcasts are taken before the column loop (out may not alias x). */
#define KN_STREAMS 8
__attribute__((target("avx2,fma"))) static void kn_avx2(const Job *j, int k0, int k1, float *restrict out) {
    const int m = j->m, n = j->n, n8 = n & ~7;
    const float *restrict xf = j->xf;
    const int span = (k1 - k0) / KN_STREAMS;
    for (int i = 0; i < span; i++) {
        size_t base[KN_STREAMS];
        __m256 xb[MAX_ROWS][KN_STREAMS];
        for (int d = 0; d < KN_STREAMS; d++) {
            const int k = k0 + d * span + i;
            base[d] = (size_t)k * n;
            for (int r = 0; r < m; r++) xb[r][d] = _mm256_set1_ps(xf[(size_t)r * j->k + k]);
        }
        if (m == 1) {
            for (int c = 0; c < n8; c += 8) {
                __m256 acc = _mm256_loadu_ps(out + c);
                for (int d = 0; d < KN_STREAMS; d++)
                    acc = _mm256_fmadd_ps(xb[0][d], load8(j->w, j->dtype, base[d] + c), acc);
                _mm256_storeu_ps(out + c, acc);
            }
        } else {
            for (int c = 0; c < n8; c += 8) {
                __m256 wv[KN_STREAMS];
                for (int d = 0; d < KN_STREAMS; d++) wv[d] = load8(j->w, j->dtype, base[d] + c);
                for (int r = 0; r < m; r++) {
                    float *yr = out + (size_t)r * n + c;
                    __m256 acc = _mm256_loadu_ps(yr);
                    for (int d = 0; d < KN_STREAMS; d++) acc = _mm256_fmadd_ps(xb[r][d], wv[d], acc);
                    _mm256_storeu_ps(yr, acc);
                }
            }
        }
        for (int c = n8; c < n; c++)
            for (int r = 0; r < m; r++)
                for (int d = 0; d < KN_STREAMS; d++)
                    out[(size_t)r * n + c] += xf[(size_t)r * j->k + k0 + d * span + i] * w_at(j->w, j->dtype, base[d] + c);
    }
    kn_portable(j, k0 + KN_STREAMS * span, k1, out); /* rows left over after whole spans */
}

/* kn_avx2 for a bfloat16 W on a CPU with AVX512-BF16, n a multiple of 32: the streams'
 * rows in pairs, two rows' 32 columns interleaved column by column (VPERMT2W: w0[c] w1[c]
 * ...), and VDPBF16PS adds x[k0] w0[c] + x[k1] w1[c] into 16 float32 columns, the x pair
 * broadcast as bfloat16 (xf holds x widened exactly, so its high halves are x). One
 * instruction does what widening the rows and eight FMAs did on 8 columns (the widening had
 * made the AVX2 product compute-bound from ~4 rows). Products are exact, sums float32 as
 * before, in another order (each pair's second row first). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void kn_bf16_avx512(const Job *j, int k0, int k1, float *restrict out) {
    const int m = j->m, n = j->n;
    const float *restrict xf = j->xf;
    const uint16_t *w = (const uint16_t *)j->w;
    const int span = (k1 - k0) / KN_STREAMS;
    __m512i lo_idx, hi_idx; /* lane 2c: row a's column c, lane 2c + 1: row b's (b's lanes 32-63) */
    {
        uint16_t lo[32], hi[32];
        for (int c = 0; c < 16; c++) {
            lo[2 * c] = (uint16_t)c, lo[2 * c + 1] = (uint16_t)(32 + c);
            hi[2 * c] = (uint16_t)(16 + c), hi[2 * c + 1] = (uint16_t)(48 + c);
        }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
    }
    for (int i = 0; i < span; i++) {
        const uint16_t *rows[KN_STREAMS];
        uint32_t xp[MAX_ROWS][KN_STREAMS / 2]; /* x's bfloat16 pair of each row pair */
        for (int d = 0; d < KN_STREAMS; d++) rows[d] = w + (size_t)(k0 + d * span + i) * n;
        for (int r = 0; r < m; r++)
            for (int e = 0; e < KN_STREAMS / 2; e++) {
                uint32_t a, b;
                memcpy(&a, xf + (size_t)r * j->k + k0 + 2 * e * span + i, 4);
                memcpy(&b, xf + (size_t)r * j->k + k0 + (2 * e + 1) * span + i, 4);
                xp[r][e] = (a >> 16) | (b & 0xffff0000u);
            }
        for (int c = 0; c < n; c += 32) {
            __m512i lo[KN_STREAMS / 2], hi[KN_STREAMS / 2];
            for (int e = 0; e < KN_STREAMS / 2; e++) {
                const __m512i a = _mm512_loadu_si512(rows[2 * e] + c), b = _mm512_loadu_si512(rows[2 * e + 1] + c);
                lo[e] = _mm512_permutex2var_epi16(a, lo_idx, b);
                hi[e] = _mm512_permutex2var_epi16(a, hi_idx, b);
            }
            for (int r = 0; r < m; r++) {
                float *yr = out + (size_t)r * n + c;
                __m512 acc0 = _mm512_loadu_ps(yr), acc1 = _mm512_loadu_ps(yr + 16);
                for (int e = 0; e < KN_STREAMS / 2; e++) {
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r][e]);
                    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)lo[e], xv);
                    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)hi[e], xv);
                }
                _mm512_storeu_ps(yr, acc0);
                _mm512_storeu_ps(yr + 16, acc1);
            }
        }
    }
    kn_portable(j, k0 + KN_STREAMS * span, k1, out); /* rows left over after whole spans */
}

__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows r0..r1-1 of w [n, k]: NK_STREAMS W rows at a time, one from each of NK_STREAMS equal
 * spans of the range (long sequential streams, as in kn_avx2), each multiplied by the x rows
 * two at a time, so that eight independent FMA chains hide the FMA latency. The first pair of
 * x rows reads the W rows from memory; later pairs find them in L1 (four rows of a 576-wide
 * matrix are 9 KB). One W row at a time, for every x row at once, had read the tied LM head
 * at 10 GB/s with 8 x rows against 32 GB/s with 1 or 2 (BENCHMARKS.md). Rows left over after
 * whole spans go one at a time at the end. Each output is its lanes' sums over the columns in
 * order, then the tail: the same order on both paths. */
#define NK_STREAMS 4
__attribute__((target("avx2,fma"))) static void nk_avx2(const Job *j, int r0, int r1, float *restrict out) {
    const int m = j->m, kk = j->k, k8 = kk & ~7;
    const float *restrict xf = j->xf;
    const int span = (r1 - r0) / NK_STREAMS;
    for (int i = 0; i < span; i++) {
        size_t base[NK_STREAMS];
        for (int d = 0; d < NK_STREAMS; d++) base[d] = (size_t)(r0 + d * span + i) * kk;
        for (int x0 = 0; x0 < m; x0 += 2) {
            const int pair = m - x0 >= 2;
            const float *xa = xf + (size_t)x0 * kk, *xb = pair ? xa + kk : xa;
            __m256 acc[2][NK_STREAMS];
            for (int r = 0; r < 2; r++)
                for (int d = 0; d < NK_STREAMS; d++) acc[r][d] = _mm256_setzero_ps();
            for (int c = 0; c < k8; c += 8) {
                const __m256 va = _mm256_loadu_ps(xa + c), vb = _mm256_loadu_ps(xb + c);
                for (int d = 0; d < NK_STREAMS; d++) {
                    const __m256 wv = load8(j->w, j->dtype, base[d] + c);
                    acc[0][d] = _mm256_fmadd_ps(wv, va, acc[0][d]);
                    if (pair) acc[1][d] = _mm256_fmadd_ps(wv, vb, acc[1][d]);
                }
            }
            for (int r = 0; r < 1 + pair; r++) {
                const float *xr = r ? xb : xa;
                for (int d = 0; d < NK_STREAMS; d++) {
                    float s = hsum(acc[r][d]);
                    for (int c = k8; c < kk; c++) s += xr[c] * w_at(j->w, j->dtype, base[d] + c);
                    out[(size_t)(x0 + r) * j->n + r0 + d * span + i] = s;
                }
            }
        }
    }
    for (int row = r0 + NK_STREAMS * span; row < r1; row++) {
        const size_t base = (size_t)row * kk;
        __m256 acc[MAX_ROWS];
        for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
        for (int c = 0; c < k8; c += 8) {
            __m256 wv = load8(j->w, j->dtype, base + c);
            for (int r = 0; r < m; r++)
                acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + (size_t)r * kk + c), acc[r]);
        }
        for (int r = 0; r < m; r++) {
            float s = hsum(acc[r]);
            for (int c = k8; c < kk; c++) s += xf[(size_t)r * kk + c] * w_at(j->w, j->dtype, base + c);
            out[(size_t)r * j->n + row] = s;
        }
    }
}
#endif

static int have_avx512 = -1, have_avx512_bf16 = -1;
static int allow_avx512 = 1; /* gemv_allow_avx512: tests turn it off to check the AVX2 path */

static void check_avx512(void) {
#if KV_X86
    if (have_avx512 < 0) {
        __builtin_cpu_init();
        have_avx512 = kv_use_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
        have_avx512_bf16 = have_avx512 && __builtin_cpu_supports("avx512bf16");
    }
#else
    have_avx512 = have_avx512_bf16 = 0;
#endif
}

int kv_use_avx512(void) {
    check_avx512();
    return have_avx512;
}

int kv_use_avx512_bf16(void) {
    check_avx512();
    return have_avx512_bf16;
}

/* Lets (1) or stops (0) bfloat16 products taking the AVX512-BF16 path; returns the previous
 * setting (on < 0: leaves it). */
int gemv_allow_avx512(int on) {
    const int old = allow_avx512;
    if (on >= 0) allow_avx512 = on;
    return old;
}

int kv_use_avx2(void) {
#if KV_X86
    if (have_avx2 < 0) {
        __builtin_cpu_init();
        have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return have_avx2;
#else
    return 0;
#endif
}

#if KV_X86
/* nk_avx2 for a bfloat16 W on a CPU with AVX512-BF16, k a multiple of 32: each W row and x row
 * are already pairs along k, so VDPBF16PS takes 32 of each as stored (x narrowed back from xf,
 * exactly) into 16 float32 partial sums, reduced at the row's end; NK_STREAMS W rows (one from
 * each span) against the x rows two at a time, as nk_avx2. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void nk_bf16_avx512(const Job *j, int r0, int r1, float *restrict out) {
    const int m = j->m, kk = j->k;
    const uint16_t *w = (const uint16_t *)j->w;
    uint16_t xb[MAX_ROWS][MAX_NK_K]; /* x in bfloat16 (kk <= MAX_NK_K, checked by the caller) */
    for (int r = 0; r < m; r++)
        for (int c = 0; c < kk; c++) {
            uint32_t bits;
            memcpy(&bits, j->xf + (size_t)r * kk + c, 4);
            xb[r][c] = (uint16_t)(bits >> 16);
        }
    const int span = (r1 - r0) / NK_STREAMS;
    for (int i = 0; i < span + (r1 - r0 - NK_STREAMS * span); i++) {
        /* whole spans' rows four at a time, then the rows left over one at a time */
        const int streams = i < span ? NK_STREAMS : 1;
        int row[NK_STREAMS];
        for (int d = 0; d < streams; d++) row[d] = i < span ? r0 + d * span + i : r0 + NK_STREAMS * span + (i - span);
        for (int x0 = 0; x0 < m; x0 += 2) {
            const int pair = m - x0 >= 2;
            __m512 acc[2][NK_STREAMS];
            for (int r = 0; r < 2; r++)
                for (int d = 0; d < NK_STREAMS; d++) acc[r][d] = _mm512_setzero_ps();
            for (int c = 0; c < kk; c += 32) {
                const __m512bh va = (__m512bh)_mm512_loadu_si512(xb[x0] + c);
                const __m512bh vb = (__m512bh)_mm512_loadu_si512(xb[pair ? x0 + 1 : x0] + c);
                for (int d = 0; d < streams; d++) {
                    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (size_t)row[d] * kk + c);
                    acc[0][d] = _mm512_dpbf16_ps(acc[0][d], wv, va);
                    if (pair) acc[1][d] = _mm512_dpbf16_ps(acc[1][d], wv, vb);
                }
            }
            for (int r = 0; r < 1 + pair; r++)
                for (int d = 0; d < streams; d++) out[(size_t)(x0 + r) * j->n + row[d]] = _mm512_reduce_add_ps(acc[r][d]);
        }
    }
}
#endif

/* ------------------------------------------------------------------ chunks of a job */

static void run_chunk(int c) {
    const Job *j = &current;
    if (j->kind == 2) {
        j->fn(j->ctx, c);
    } else if (j->kind == 0) {
        int k0 = c * j->chunk, k1 = k0 + j->chunk;
        if (k1 > j->k) k1 = j->k;
        float *out = j->partials + (size_t)c * j->m * j->n;
        memset(out, 0, (size_t)j->m * j->n * sizeof(float));
#if KV_X86
        if (j->dtype == DT_BF16 && j->n % 32 == 0 && allow_avx512 && kv_use_avx512_bf16()) {
            kn_bf16_avx512(j, k0, k1, out);
            return;
        }
        if (kv_use_avx2()) {
            kn_avx2(j, k0, k1, out);
            return;
        }
#endif
        kn_portable(j, k0, k1, out);
    } else {
        int r0 = c * j->chunk, r1 = r0 + j->chunk;
        if (r1 > j->n) r1 = j->n;
#if KV_X86
        if (j->dtype == DT_BF16 && j->k % 32 == 0 && j->k <= MAX_NK_K && allow_avx512 && kv_use_avx512_bf16()) {
            nk_bf16_avx512(j, r0, r1, j->partials);
            return;
        }
        if (kv_use_avx2()) {
            nk_avx2(j, r0, r1, j->partials);
            return;
        }
#endif
        nk_portable(j, r0, r1, j->partials);
    }
}

/* Claims and runs chunks of job `gen` until none is left (or a later job has started). */
static void work(uint64_t gen) {
    for (;;) {
        uint64_t cur = __atomic_load_n(&ticket, __ATOMIC_ACQUIRE);
        for (;;) {
            if ((cur >> 32) != (gen & 0xffffffffu)) return;
            if ((cur & 0xffffffffu) >= (uint64_t)current.num_chunks) return; /* also a closed job */
            if (__atomic_compare_exchange_n(&ticket, &cur, cur + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                break;
        }
        run_chunk((int)(cur & 0xffffffffu));
        __atomic_sub_fetch(&pending, 1, __ATOMIC_ACQ_REL);
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    uint64_t seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    for (;;) {
        int polls = 0;
        while (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen && polls < SPIN_POLLS) {
            sched_yield(); /* a runnable thread on this core (torch's OpenMP team) goes first */
            polls++;
        }
        if (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen) {
            pthread_mutex_lock(&pool_mutex);
            while (generation == seen && !shutdown_flag) pthread_cond_wait(&pool_wake, &pool_mutex);
            pthread_mutex_unlock(&pool_mutex);
        }
        if (__atomic_load_n(&shutdown_flag, __ATOMIC_ACQUIRE)) return NULL;
        seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        work(seen);
    }
}

static void stop_pool(void) {
    pthread_mutex_lock(&pool_mutex);
    __atomic_store_n(&shutdown_flag, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mutex);
    for (int t = 1; t < pool_threads; t++) pthread_join(helpers[t], NULL);
    shutdown_flag = 0;
    pool_threads = 1;
}

/* Sets the pool to n threads (the caller included); returns the count in effect. */
int gemv_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&gemv_lock);
    if (n != pool_threads) {
        stop_pool();
        for (int t = 1; t < n; t++) {
            if (pthread_create(&helpers[t], NULL, helper_main, NULL) != 0) break;
            pool_threads = t + 1;
        }
    }
    int result = pool_threads;
    pthread_mutex_unlock(&gemv_lock);
    return result;
}

/* Jobs run on OpenMP's threads (1) or this library's pool (0); returns the mode in effect
 * (always 0 when built without OpenMP). */
int gemv_use_openmp(int on) {
    pthread_mutex_lock(&gemv_lock);
#ifdef _OPENMP
    use_openmp = on != 0;
#else
    (void)on;
#endif
    const int result = use_openmp;
    pthread_mutex_unlock(&gemv_lock);
    return result;
}

static int ensure_scratch(size_t floats) {
    if (floats <= scratch_floats) return 1;
    float *grown = (float *)realloc(scratch, floats * sizeof(float));
    if (grown == NULL) return 0;
    scratch = grown;
    scratch_floats = floats;
    return 1;
}

/* Publishes the job, works on it, and returns once every chunk is done. The caller claims
 * chunks too, so a helper that is descheduled (a busy machine) delays only a chunk it has
 * already claimed, never the whole product. */
static void run_job(void) {
#ifdef _OPENMP
    if (use_openmp && pool_threads > 1 && current.num_chunks > 1) {
        const int threads = pool_threads < current.num_chunks ? pool_threads : current.num_chunks;
        /* dynamic: a descheduled thread delays only the chunk it holds */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int c = 0; c < current.num_chunks; c++) run_chunk(c);
        return;
    }
#endif
    __atomic_store_n(&pending, current.num_chunks, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool_mutex);
    uint64_t gen = __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
    __atomic_store_n(&ticket, (gen & 0xffffffffu) << 32, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mutex);
    work(gen);
    int polls = 0;
    while (__atomic_load_n(&pending, __ATOMIC_ACQUIRE) > 0) {
        if (++polls < 1000) {
            KV_PAUSE();
        } else {
            sched_yield();
        }
    }
    /* Close the job before the caller writes the next one into `current`. A helper that read
     * this job's ticket just before it ran out, and was descheduled, would otherwise compare
     * that ticket with the next job's chunk count and claim a chunk that does not exist: it
     * ran the next job's half-written fields (a crash, or wrong sums) and took from the next
     * job's pending count. Its claim is a compare-and-swap on the ticket, so once the ticket
     * reads "no chunk left" it fails whatever `current` holds. */
    __atomic_store_n(&ticket, ((gen & 0xffffffffu) << 32) | 0xffffffffu, __ATOMIC_RELEASE);
}

/* y[m, n] = x[m, k] @ w; kind 0: w is [k, n]; kind 1: w is [n, k]. Returns 0 on success. */
int gemv(int kind, int dtype, int m, int k, int n, const void *x, const void *w, void *y) {
    if (m < 1 || m > MAX_ROWS || k < 1 || n < 1 || (kind != 0 && kind != 1)) return -1;
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    pthread_mutex_lock(&gemv_lock);
    const int threads = pool_threads;
    /* about four chunks per thread: whole unrolled row groups, enough to even out the load */
    const int rows = kind == 0 ? k : n;
    const int align = kind == 0 ? KN_STREAMS : NK_STREAMS;
    int chunk = (rows + CHUNKS_PER_THREAD * threads - 1) / (CHUNKS_PER_THREAD * threads);
    chunk = (chunk + align - 1) / align * align;
    const int num_chunks = (rows + chunk - 1) / chunk;
    const size_t count = (size_t)m * n;
    const size_t xf_floats = (size_t)m * k;
    const size_t part_floats = kind == 0 ? count * num_chunks : count;
    if (!ensure_scratch(xf_floats + part_floats)) {
        pthread_mutex_unlock(&gemv_lock);
        return -2;
    }
    float *xf = scratch;
    if (dtype == DT_F32) {
        memcpy(xf, x, xf_floats * sizeof(float));
    } else {
        for (size_t i = 0; i < xf_floats; i++) xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    float *partials = scratch + xf_floats;
    current = (Job){kind, dtype, m, k, n, w, xf, partials, chunk, num_chunks, NULL, NULL};
    run_job();
    if (kind == 0) {
        for (int c = 1; c < num_chunks; c++) {
            const float *p = partials + (size_t)c * count;
            for (size_t i = 0; i < count; i++) partials[i] += p[i];
        }
    }
    if (dtype == DT_F32) {
        memcpy(y, partials, count * sizeof(float));
    } else {
        for (size_t i = 0; i < count; i++) ((uint16_t *)y)[i] = f32_to_bf16(partials[i]);
    }
    pthread_mutex_unlock(&gemv_lock);
    return 0;
}

/* The pool's threads, the caller included (pool.h). */
int pool_size(void) { return __atomic_load_n(&pool_threads, __ATOMIC_RELAXED); }

/* Runs fn(ctx, 0..num_chunks-1) on the pool (pool.h), the caller included. */
void pool_run(pool_fn fn, void *ctx, int num_chunks) {
    if (num_chunks < 1) return;
    pthread_mutex_lock(&gemv_lock);
    current = (Job){2, 0, 0, 0, 0, NULL, NULL, NULL, 0, num_chunks, fn, ctx};
    run_job();
    pthread_mutex_unlock(&gemv_lock);
}
