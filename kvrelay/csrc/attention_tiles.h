/*
 * What attention.c's pieces of work and the vector steps they take over a tile of keys
 * (attention_tiles.c) share: a piece's running state (Piece), the steps of one vector path
 * (TileOps: a tile's scores, a chunk's softmax, a tile's values) and the three paths'
 * tables. attention.c walks a row's keys a chunk at a time and calls these per tile.
 */
#ifndef KVRELAY_ATTENTION_TILES_H
#define KVRELAY_ATTENTION_TILES_H

#include "attention.h"

#define TILE 16 /* keys scored before the running maximum is updated */
#define CHUNK 512        /* keys whose scores the SIMD path keeps before it updates the maximum */
#define CHUNK_STRIDE (CHUNK + 16) /* a query head's score row: a last tile's padding fits */

typedef struct {
    float q[MAX_Q_PER_KV][MAX_HEAD_DIM]; /* scaled queries of the kv head's group */
    float acc[MAX_Q_PER_KV][MAX_HEAD_DIM];
    float score[MAX_Q_PER_KV][TILE];
    float run_max[MAX_Q_PER_KV], run_sum[MAX_Q_PER_KV];
    float buf[MAX_HEAD_DIM]; /* a widened bfloat16 row */
    size_t rows[TILE];
    float *tile; /* [TILE, head_dim]: a tile's widened bfloat16 rows (the SIMD path) */
    const uint16_t *q_bf16; /* a bfloat16 job's query rows of the group, unscaled, in place */
    int acc_pairs; /* acc in the BF16 value path's order (value_tile_bf16_avx512), not d's */
} Piece;

/* The per-tile steps of one vector path. */
typedef struct {
    void (*score)(const AttnJob *j, Piece *p, const size_t *rows, int nt, float *s);
    void (*softmax)(const AttnJob *j, Piece *p, float *s, int cn);
    void (*value)(const AttnJob *j, Piece *p, const size_t *rows, int nt, const float *s);
} TileOps;

#if KV_X86
/* AVX2 (8 lanes, a bfloat16 pool widened), AVX-512 on a float32 pool, AVX-512 BF16 dot
 * products on a bfloat16 pool (attention.c's job_ops picks one). */
__attribute__((visibility("hidden"))) extern const TileOps OPS_AVX2, OPS_AVX512_F32, OPS_AVX512_BF16;
#endif

#endif
