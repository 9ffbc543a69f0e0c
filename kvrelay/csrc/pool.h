/* What gemv.c shares with the library's other CPU kernels (attention.c): its thread pool and
 * the CPU check. */
#ifndef KVRELAY_POOL_H
#define KVRELAY_POOL_H

typedef void (*pool_fn)(void *ctx, int chunk);

/* Calls fn(ctx, c) for every c in 0..num_chunks-1, spread over the pool's threads (sized by
 * gemv_set_threads), and returns when all are done. Calls are serialized. */
void pool_run(pool_fn fn, void *ctx, int num_chunks);

/* The pool's threads, the caller included. */
int pool_size(void);

/* True when the CPU has AVX2 and FMA (checked once), the kernels' fast paths. */
int kv_use_avx2(void);

/* True when the CPU also has AVX-512 (F, BW, VL) (checked once); _bf16: and its BF16 dot
 * products. */
int kv_use_avx512(void);
int kv_use_avx512_bf16(void);

#endif
