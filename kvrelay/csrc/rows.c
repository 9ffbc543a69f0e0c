/*
 * The small ops of a Llama decoder layer for a batched step (any number of token rows), in
 * the library's thread pool: residual add + RMSNorm, rotary embedding in place, SiLU-and-
 * multiply. kvrelay's torch path runs each of them as 2-8 torch ops (a bfloat16 model's
 * also convert to float32 and back); with 64 rows of 576 values, each such op costs ~25 us of
 * dispatch and thread start, about a fifth of a batched CPU step's time (BENCHMARKS.md,
 * "Peers"). The row math is rowops.h's, the same as decode.c's, so a batched step and a
 * fused decode step round a bfloat16 model's values the same way. x, h, qk, gate_up, out, w,
 * cos and sin are in the model's dtype (0 float32, 1 bfloat16) and contiguous by rows.
 */
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "rowops.h"

enum { OP_NORM, OP_ROPE, OP_SILU };

#define PARALLEL_VALUES 16384 /* below this many values a call runs on the caller alone */

typedef struct {
    int op, dtype, m, n;
    int heads, head_dim, stride; /* rope: heads per row, values per head, row stride */
    float eps;
    void *x;
    const void *delta, *w, *cos, *sin;
    void *out;
    int rows_per_chunk;
    int failed;
} RowsJob;

static void run_rows(RowsJob *j, int r0, int r1) {
    const int dt = j->dtype;
    const int width = j->op == OP_ROPE ? j->heads * j->head_dim : j->op == OP_SILU ? 2 * j->n : j->n;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(width + j->n + j->head_dim));
    if (buf == NULL) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *row = buf, *res = buf + width, *trig = res + j->n;
    for (int r = r0; r < r1; r++) {
        if (j->op == OP_NORM) {
            const size_t base = (size_t)r * j->n;
            get_row(dt, j->x, base, j->n, row);
            if (j->delta != NULL) { /* x = x + delta, rounded as torch's add, written back */
                get_row(dt, j->delta, base, j->n, res);
                add_rows(dt, (size_t)j->n, row, res);
                put_row(dt, j->x, base, j->n, row);
            }
            norm_row(dt, j->n, j->eps, row, j->w, res);
            put_row(dt, j->out, base, j->n, res);
        } else if (j->op == OP_ROPE) {
            const int half = j->head_dim / 2;
            const size_t base = (size_t)r * j->stride;
            get_row(dt, j->x, base, width, row);
            get_row(dt, j->cos, (size_t)r * half, half, trig);
            get_row(dt, j->sin, (size_t)r * half, half, trig + half);
            rope_row(dt, j->heads, j->head_dim, trig, trig + half, row);
            put_row(dt, j->x, base, width, row);
        } else {
            const size_t base = (size_t)r * 2 * j->n;
            get_row(dt, j->x, base, width, row);
            silu_mul_row(dt, j->n, row, row + j->n, res);
            put_row(dt, j->out, (size_t)r * j->n, j->n, res);
        }
    }
    free(buf);
}

static void rows_chunk(void *ctx, int chunk) {
    RowsJob *j = (RowsJob *)ctx;
    const int r0 = chunk * j->rows_per_chunk;
    const int r1 = r0 + j->rows_per_chunk < j->m ? r0 + j->rows_per_chunk : j->m;
    run_rows(j, r0, r1);
}

static int run(RowsJob *j, size_t values) {
    if (j->m < 1 || (j->dtype != DT_F32 && j->dtype != DT_BF16)) return -1;
    if (values < PARALLEL_VALUES || j->m == 1) {
        run_rows(j, 0, j->m);
    } else {
        const int chunks = j->m < 16 ? j->m : 16;
        j->rows_per_chunk = (j->m + chunks - 1) / chunks;
        pool_run(rows_chunk, j, (j->m + j->rows_per_chunk - 1) / j->rows_per_chunk);
    }
    return j->failed ? -2 : 0;
}

/* h[m, n] = RMSNorm(x) * w; with delta, first x += delta (in place, rounded as torch's add).
 * Returns 0, -1 on a refused argument, -2 when out of memory. */
int rows_add_rms_norm(int dtype, int m, int n, float eps, void *x, const void *delta, const void *w, void *h) {
    RowsJob j = {OP_NORM, dtype, m, n, 0, 0, 0, eps, x, delta, w, NULL, NULL, h, 0, 0};
    return n < 1 ? -1 : run(&j, (size_t)m * n);
}

/* Rotates the first `heads` heads (head_dim values each) of every row of qk in place; rows
 * are `stride` values apart; cos and sin are [m, head_dim / 2]. */
int rows_rope(int dtype, int m, int heads, int head_dim, int stride, void *qk, const void *cos, const void *sin) {
    RowsJob j = {OP_ROPE, dtype, m, 0, heads, head_dim, stride, 0.0f, qk, NULL, NULL, cos, sin, NULL, 0, 0};
    if (heads < 1 || head_dim < 2 || head_dim % 2 != 0 || stride < heads * head_dim) return -1;
    return run(&j, (size_t)m * heads * head_dim);
}

/* out[m, n] = SiLU(gate_up[:, :n]) * gate_up[:, n:]. */
int rows_silu_mul(int dtype, int m, int n, const void *gate_up, void *out) {
    RowsJob j = {OP_SILU, dtype, m, n, 0, 0, 0, 0.0f, (void *)gate_up, NULL, NULL, NULL, NULL, out, 0, 0};
    return n < 1 ? -1 : run(&j, (size_t)m * 2 * n);
}
