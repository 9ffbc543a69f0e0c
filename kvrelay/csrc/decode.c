/*
 * A whole decode step's decoder layers on CPU in one call: for its tokens (one per
 * sequence), every layer's RMSNorm, fused QKV projection (+ bias), rotary embedding, KV store,
 * paged attention, output projection, residual, RMSNorm, gate/up projection, SiLU-and-multiply,
 * down projection and residual, with no Python or torch op between them.
 *
 * A lone sequence's decode step reads every weight once (the matmuls, gemv.c, run at the
 * memory bound), but the ~45 small torch ops per layer around them cost as much again in
 * dispatch. This file does those ops in plain loops over a few hundred floats, in the order
 * and with the rounding of kvrelay's torch path (engine/models/llama.py): values are float32
 * throughout, and for a bfloat16 model each op's result is rounded to bfloat16 where torch's
 * op would round it, so both paths agree to float32 summation order.
 *
 * A float32 model whose projections have panels (panels.c) runs its batched decode steps here
 * too: their products on the panels, as the torch path's products of many rows are (the same
 * sums bit for bit), and the rest of each layer without the Python-issued ops around them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "rowops.h"

enum { W_IN_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_PER_LAYER };
enum { P_QKV, P_O, P_GATE_UP, P_DOWN, P_PER_LAYER }; /* a layer's panels, when there are */

int gemv(int kind, int dtype, int m, int k, int n, const void *x, const void *w, void *y);
int panels_gemm(int m, int k, int n, const float *x, const float *wp, const float *bias, float *y, int threads);
int decode_attention(int dtype, int n, int q_heads, int kv_heads, int head_dim, int block_size,
                     int max_blocks, int window, float scale, const void *q, const void *k,
                     const void *v, const int64_t *rows, const int32_t *tables,
                     const int32_t *ctx_lens, void *out);

typedef struct {
    int dtype, layers, hidden, q_heads, kv_heads, head_dim, inter, block_size, window;
    float eps, scale;
    const void *const *weights; /* W_PER_LAYER per layer; a missing bias is NULL */
    void *kv;                   /* [layers, 2, num_blocks, block_size, kv_heads, head_dim] */
    int64_t kv_layer_elems;     /* elements of one layer's [2, ...] pool */
    /* a float32 model's projections as panels (panels.c; P_PER_LAYER per layer), or NULL:
     * steps of more than panels_from rows take them, as the torch path's products do */
    const float *const *panels;
    int panels_from, threads;
} DecodeModel;

typedef struct {
    int m, max_blocks;
    const int64_t *slots, *rows;
    const int32_t *tables, *ctx_lens;
    const float *cos, *sin; /* [m, head_dim / 2], already rounded to the model's dtype */
} StepInputs;

typedef struct {
    float *h, *qkv, *q, *attn, *proj, *gate_up, *act; /* float32 work rows */
    void *in, *out;                                   /* dtype copies for gemv / attention */
} Buffers;

/* y[m, n] = x[m, k] @ w, x and y float32 rows, w in the model's dtype (gemv.c rounds y);
 * a step of more than panels_from rows on w's panels `wp` when there are (float32: no copies). */
static int matmul(const DecodeModel *md, Buffers *b, int kind, int m, int k, int n, const float *x, const void *w, const float *wp, float *y) {
    if (wp != NULL && m > md->panels_from && md->dtype == DT_F32) return panels_gemm(m, k, n, x, wp, NULL, y, md->threads) == 0 ? 0 : -1;
    for (size_t i = 0; i < (size_t)m * k; i++) put(md->dtype, b->in, i, x[i]);
    if (gemv(kind, md->dtype, m, k, n, b->in, w, b->out) != 0) return -1;
    for (size_t i = 0; i < (size_t)m * n; i++) y[i] = get(md->dtype, b->out, i);
    return 0;
}

/* h = RMSNorm(x) * w for rows r0..r1-1 (rowops.h). */
static void rms_norm(const DecodeModel *md, int r0, int r1, const float *x, const void *w, float *h) {
    for (int r = r0; r < r1; r++)
        norm_row(md->dtype, md->hidden, md->eps, x + (size_t)r * md->hidden, w, h + (size_t)r * md->hidden);
}

/* Rotates the q and k heads of qkv rows r0..r1-1 in place (rowops.h). */
static void rope(const DecodeModel *md, const StepInputs *in, int r0, int r1, float *qkv) {
    const int hd = md->head_dim, half = hd / 2, width = (md->q_heads + 2 * md->kv_heads) * hd;
    for (int r = r0; r < r1; r++)
        rope_row(md->dtype, md->q_heads + md->kv_heads, hd, in->cos + (size_t)r * half, in->sin + (size_t)r * half,
                 qkv + (size_t)r * width);
}

/* Writes rows r0..r1-1's k and v heads into their pool slots of this layer. */
static void store_kv(const DecodeModel *md, const StepInputs *in, int r0, int r1, const float *qkv, void *k_pool, void *v_pool) {
    const int hd = md->head_dim, kvw = md->kv_heads * hd, qw = md->q_heads * hd;
    const int width = qw + 2 * kvw;
    for (int r = r0; r < r1; r++) {
        const size_t base = (size_t)in->slots[r] * kvw;
        for (int c = 0; c < kvw; c++) {
            put(md->dtype, k_pool, base + c, qkv[(size_t)r * width + qw + c]);
            put(md->dtype, v_pool, base + c, qkv[(size_t)r * width + qw + kvw + c]);
        }
    }
}

/* attn[m, q_heads * head_dim] from the rotated q rows over this layer's pool. */
static int attend(const DecodeModel *md, const StepInputs *in, Buffers *b, const float *qkv, const void *k_pool, const void *v_pool) {
    const int qw = md->q_heads * md->head_dim, width = qw + 2 * md->kv_heads * md->head_dim;
    for (int r = 0; r < in->m; r++)
        for (int c = 0; c < qw; c++) put(md->dtype, b->in, (size_t)r * qw + c, qkv[(size_t)r * width + c]);
    if (decode_attention(md->dtype, in->m, md->q_heads, md->kv_heads, md->head_dim, md->block_size, in->max_blocks,
                         md->window, md->scale, b->in, k_pool, v_pool, in->rows, in->tables, in->ctx_lens, b->out) != 0)
        return -1;
    for (size_t i = 0; i < (size_t)in->m * qw; i++) b->attn[i] = get(md->dtype, b->out, i);
    return 0;
}

/* act = SiLU(gate) * up for rows r0..r1-1 (rowops.h). */
static void silu_mul(int dtype, int r0, int r1, int inter, const float *gate_up, float *act) {
    for (int r = r0; r < r1; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter;
        silu_mul_row(dtype, inter, g, g + inter, act + (size_t)r * inter);
    }
}

/* A layer's row ops between its products, on rows of the step: each row's values depend on
 * that row only, so a wide step splits them over the pool (ROWS_PER_CHUNK rows a chunk) and a
 * narrow one runs them here (a lone step's ops take microseconds; a pool round trip would
 * cost as much). SmolLM2, 49-64-row steps: 6.3-7.5 ms of row ops a step on the pool against
 * 8.1-8.2 on the calling thread (BENCHMARKS.md "Batched decode steps in one native call"). */
enum { OP_NORM_IN, OP_ROPE_STORE, OP_ADD_NORM_POST, OP_SILU, OP_ADD };
#define ROWS_PER_CHUNK 4

typedef struct {
    const DecodeModel *md;
    const StepInputs *in;
    Buffers *b;
    const void *const *w;
    float *x;
    void *k_pool, *v_pool;
    int op;
} RowOps;

static void row_ops_range(const RowOps *o, int r0, int r1) {
    const DecodeModel *md = o->md;
    Buffers *b = o->b;
    const size_t hid = md->hidden;
    switch (o->op) {
    case OP_NORM_IN: rms_norm(md, r0, r1, o->x, o->w[W_IN_NORM], b->h); break;
    case OP_ROPE_STORE:
        rope(md, o->in, r0, r1, b->qkv);
        store_kv(md, o->in, r0, r1, b->qkv, o->k_pool, o->v_pool);
        break;
    case OP_ADD_NORM_POST:
        add_rows(md->dtype, (size_t)(r1 - r0) * hid, o->x + r0 * hid, b->proj + r0 * hid);
        rms_norm(md, r0, r1, o->x, o->w[W_POST_NORM], b->h);
        break;
    case OP_SILU: silu_mul(md->dtype, r0, r1, md->inter, b->gate_up, b->act); break;
    default: add_rows(md->dtype, (size_t)(r1 - r0) * hid, o->x + r0 * hid, b->proj + r0 * hid); break;
    }
}

static void row_ops_chunk(void *ctx, int c) {
    const RowOps *o = ctx;
    const int r0 = c * ROWS_PER_CHUNK, r1 = r0 + ROWS_PER_CHUNK < o->in->m ? r0 + ROWS_PER_CHUNK : o->in->m;
    row_ops_range(o, r0, r1);
}

static void row_ops(RowOps *o, int op) {
    o->op = op;
    const int m = o->in->m;
    if (m > o->md->panels_from && m > ROWS_PER_CHUNK) pool_run(row_ops_chunk, o, (m + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK);
    else row_ops_range(o, 0, m);
}

static int layer(const DecodeModel *md, const StepInputs *in, Buffers *b, int i, float *x) {
    const void *const *w = md->weights + (size_t)i * W_PER_LAYER;
    static const float *const none[P_PER_LAYER] = {NULL};
    const float *const *wp = md->panels != NULL ? md->panels + (size_t)i * P_PER_LAYER : none;
    const size_t esize = md->dtype == DT_F32 ? 4 : 2;
    char *pool = (char *)md->kv + (size_t)i * md->kv_layer_elems * esize;
    void *k_pool = pool, *v_pool = pool + (size_t)md->kv_layer_elems / 2 * esize;
    const int m = in->m, hd = md->head_dim, n_qkv = (md->q_heads + 2 * md->kv_heads) * hd;
    RowOps ops = {md, in, b, w, x, k_pool, v_pool, 0};
    row_ops(&ops, OP_NORM_IN);
    if (matmul(md, b, 0, m, md->hidden, n_qkv, b->h, w[W_QKV], wp[P_QKV], b->qkv) != 0) return -1;
    if (w[W_QKV_BIAS] != NULL)
        for (int r = 0; r < m; r++)
            for (int c = 0; c < n_qkv; c++) {
                float *v = b->qkv + (size_t)r * n_qkv + c;
                *v = rnd(md->dtype, *v + get(md->dtype, w[W_QKV_BIAS], c));
            }
    row_ops(&ops, OP_ROPE_STORE);
    if (attend(md, in, b, b->qkv, k_pool, v_pool) != 0) return -1;
    if (matmul(md, b, 0, m, md->q_heads * hd, md->hidden, b->attn, w[W_O], wp[P_O], b->proj) != 0) return -1;
    row_ops(&ops, OP_ADD_NORM_POST);
    if (matmul(md, b, 0, m, md->hidden, 2 * md->inter, b->h, w[W_GATE_UP], wp[P_GATE_UP], b->gate_up) != 0) return -1;
    row_ops(&ops, OP_SILU);
    if (matmul(md, b, 0, m, md->inter, md->hidden, b->act, w[W_DOWN], wp[P_DOWN], b->proj) != 0) return -1;
    row_ops(&ops, OP_ADD);
    return 0;
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Runs every decoder layer for m decode tokens; x [m, hidden] (the model's dtype) holds the
 * embeddings on entry and the last layer's output on return. Returns 0, -1 on a refused
 * shape, -2 when out of memory. */
int decode_forward(const DecodeModel *md, int m, void *x, const void *cos, const void *sin, const int64_t *slots,
                   const int64_t *rows, const int32_t *tables, int max_blocks, const int32_t *ctx_lens) {
    if (m < 1 || (md->dtype != DT_F32 && md->dtype != DT_BF16) || md->head_dim % 2 != 0) return -1;
    const int hd = md->head_dim, half = hd / 2, n_qkv = (md->q_heads + 2 * md->kv_heads) * hd;
    const size_t widest = max3((size_t)n_qkv, 2 * (size_t)md->inter, (size_t)md->hidden);
    /* h, proj, x: hidden; qkv, attn: n_qkv; gate_up, act, in, out: widest; cos, sin: half */
    const size_t floats = (size_t)m * (3 * (size_t)md->hidden + 2 * (size_t)n_qkv + 4 * widest + 2 * (size_t)half);
    float *mem = (float *)malloc(floats * sizeof(float));
    if (mem == NULL) return -2;
    Buffers b = {0};
    float *p = mem, *xf, *cf, *sf;
    b.h = p, p += (size_t)m * md->hidden;
    b.qkv = p, p += (size_t)m * n_qkv;
    b.attn = p, p += (size_t)m * n_qkv;
    b.proj = p, p += (size_t)m * md->hidden;
    b.gate_up = p, p += (size_t)m * widest;
    b.act = p, p += (size_t)m * widest;
    cf = p, p += (size_t)m * half;
    sf = p, p += (size_t)m * half;
    xf = p, p += (size_t)m * md->hidden;
    b.in = p, p += (size_t)m * widest;
    b.out = p;
    for (size_t i = 0; i < (size_t)m * half; i++) {
        cf[i] = get(md->dtype, cos, i);
        sf[i] = get(md->dtype, sin, i);
    }
    for (size_t i = 0; i < (size_t)m * md->hidden; i++) xf[i] = get(md->dtype, x, i);
    const StepInputs in = {m, max_blocks, slots, rows, tables, ctx_lens, cf, sf};
    int code = 0;
    for (int i = 0; i < md->layers && code == 0; i++) code = layer(md, &in, &b, i, xf);
    if (code == 0)
        for (size_t i = 0; i < (size_t)m * md->hidden; i++) put(md->dtype, x, i, xf[i]);
    free(mem);
    return code;
}
