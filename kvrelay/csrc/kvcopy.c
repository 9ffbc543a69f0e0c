/* Fused copy-and-hash of KV slabs: XXH64 (seed 0) per slab, streamed over runs of bytes.
 *
 * A plain shared library with no Python C-API, loaded with ctypes (which releases the GIL for
 * the call), so the decode side's threads copy and hash in parallel. Each slab is a base
 * pointer; the same (offset, length) runs apply to every slab. A slab's digest is XXH64 of the
 * concatenation of its runs in order, however that byte stream is cut into runs, so it equals
 * xxhash.xxh64 (python-xxhash, the reference) of the same bytes.
 *
 *   kv_copy_hash_slabs  copies each run src -> dst and hashes the copied bytes in the same
 *                       pass: a 32-byte stripe is loaded once into registers, stored to dst
 *                       and fed to the hash, so what is hashed is exactly what was written
 *                       even if the source changes under us (another process's memory).
 *   kv_hash_slabs       the hash alone (the source side's checksum at lease time).
 *
 * The loop is ~30 instructions per 32 bytes, so the out-of-order window reaches only a few
 * cache lines ahead, and the hardware prefetchers stop at every 4 KiB page and every scattered
 * block: a prefetch cursor walks the same (slab, run) sequence PREFETCH_AHEAD bytes ahead of
 * the hash, one cache line of the source (and, when copying, of the destination, for writing)
 * per line hashed. On a 2-core EPYC VM it took 2 threads from about 55% of memcpy to 80-90%
 * and the hash alone to ~12 GB/s a core (DESIGN.md, Transport).
 *
 * XXH64 is written here from its public specification (xxHash's doc/xxhash_spec.md); no code
 * is copied. Portable C99 plus __builtin_prefetch (GCC, Clang): no intrinsics, no -march.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PRIME1 0x9E3779B185EBCA87ULL
#define PRIME2 0xC2B2AE3D27D4EB4FULL
#define PRIME3 0x165667B19E3779F9ULL
#define PRIME4 0x85EBCA77C2B2AE63ULL
#define PRIME5 0x27D4EB2F165667C5ULL
#define STRIPE 32
#define LINE 64
#define PREFETCH_AHEAD (64 * 1024) /* bytes: well within L2, a few DRAM latencies ahead */

typedef struct {
    uint64_t acc[4];
    uint64_t total_len;
    uint8_t buffer[STRIPE]; /* bytes of a stripe not yet consumed */
    size_t buffered;
} state_t;

/* The next line to prefetch: run `run` of slab `slab` (src and, if copying, dst), in the order
 * the hash reads them. `src` is NULL once every run has been covered. */
typedef struct {
    const uint8_t *const *src_bases;
    uint8_t *const *dst_bases; /* NULL: hash only */
    const int64_t *src_offsets, *dst_offsets, *lengths;
    size_t num_slabs, num_runs, slab, run;
    const uint8_t *src, *src_end;
    uint8_t *dst;
} cursor_t;

static void cursor_next_run(cursor_t *c) {
    for (; c->slab < c->num_slabs; c->slab++, c->run = 0) {
        for (; c->run < c->num_runs; c->run++) {
            if (c->lengths[c->run] <= 0) continue;
            c->src = c->src_bases[c->slab] + c->src_offsets[c->run];
            c->src_end = c->src + c->lengths[c->run];
            c->dst = c->dst_bases ? c->dst_bases[c->slab] + c->dst_offsets[c->run] : NULL;
            c->run++;
            return;
        }
    }
    c->src = NULL;
}

static inline void cursor_step(cursor_t *c) {
    if (!c->src) return;
    __builtin_prefetch(c->src, 0, 3);
    if (c->dst) {
        __builtin_prefetch(c->dst, 1, 3);
        c->dst += LINE;
    }
    c->src += LINE;
    if (c->src >= c->src_end) cursor_next_run(c);
}

static void cursor_start(cursor_t *c) {
    cursor_next_run(c);
    for (size_t k = 0; k < PREFETCH_AHEAD; k += LINE) cursor_step(c);
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t round64(uint64_t acc, uint64_t lane) {
    acc += lane * PRIME2;
    return rotl64(acc, 31) * PRIME1;
}

static inline uint64_t merge64(uint64_t hash, uint64_t acc) {
    hash ^= round64(0, acc);
    return hash * PRIME1 + PRIME4;
}

static void reset(state_t *s) {
    s->acc[0] = PRIME1 + PRIME2;
    s->acc[1] = PRIME2;
    s->acc[2] = 0;
    s->acc[3] = 0 - PRIME1;
    s->total_len = 0;
    s->buffered = 0;
}

static inline void consume(uint64_t acc[4], const uint8_t *stripe) {
    acc[0] = round64(acc[0], read64(stripe));
    acc[1] = round64(acc[1], read64(stripe + 8));
    acc[2] = round64(acc[2], read64(stripe + 16));
    acc[3] = round64(acc[3], read64(stripe + 24));
}

/* Feeds `len` bytes; when `dst` is not NULL also copies them there. Every byte is read from
 * `src` once: the bytes hashed are the bytes stored. Steps `c` one line per 64 bytes. */
static void update(state_t *s, uint8_t *dst, const uint8_t *src, size_t len, cursor_t *c) {
    s->total_len += len;
    if (s->buffered) {
        size_t take = STRIPE - s->buffered < len ? STRIPE - s->buffered : len;
        memcpy(s->buffer + s->buffered, src, take);
        if (dst) {
            memcpy(dst, s->buffer + s->buffered, take);
            dst += take;
        }
        s->buffered += take;
        src += take;
        len -= take;
        if (s->buffered < STRIPE) return;
        consume(s->acc, s->buffer);
        s->buffered = 0;
    }
    uint64_t a0 = s->acc[0], a1 = s->acc[1], a2 = s->acc[2], a3 = s->acc[3];
    size_t num_stripes = len / STRIPE;
    if (dst) {
        for (size_t i = 0; i < num_stripes; i++, src += STRIPE, dst += STRIPE) {
            if (i & 1) cursor_step(c);
            uint64_t w[4];
            memcpy(w, src, STRIPE);
            memcpy(dst, w, STRIPE);
            a0 = round64(a0, read64((const uint8_t *)&w[0]));
            a1 = round64(a1, read64((const uint8_t *)&w[1]));
            a2 = round64(a2, read64((const uint8_t *)&w[2]));
            a3 = round64(a3, read64((const uint8_t *)&w[3]));
        }
    } else {
        for (size_t i = 0; i < num_stripes; i++, src += STRIPE) {
            if (i & 1) cursor_step(c);
            a0 = round64(a0, read64(src));
            a1 = round64(a1, read64(src + 8));
            a2 = round64(a2, read64(src + 16));
            a3 = round64(a3, read64(src + 24));
        }
    }
    s->acc[0] = a0, s->acc[1] = a1, s->acc[2] = a2, s->acc[3] = a3;
    len -= num_stripes * STRIPE;
    if (len) {
        memcpy(s->buffer, src, len);
        if (dst) memcpy(dst, s->buffer, len);
        s->buffered = len;
    }
}

static uint64_t digest(const state_t *s) {
    uint64_t h;
    if (s->total_len >= STRIPE) {
        h = rotl64(s->acc[0], 1) + rotl64(s->acc[1], 7) + rotl64(s->acc[2], 12) +
            rotl64(s->acc[3], 18);
        for (int i = 0; i < 4; i++) h = merge64(h, s->acc[i]);
    } else {
        h = PRIME5; /* seed 0 */
    }
    h += s->total_len;
    const uint8_t *p = s->buffer;
    size_t left = s->buffered;
    for (; left >= 8; left -= 8, p += 8) h = rotl64(h ^ round64(0, read64(p)), 27) * PRIME1 + PRIME4;
    if (left >= 4) {
        h = rotl64(h ^ (uint64_t)read32(p) * PRIME1, 23) * PRIME2 + PRIME3;
        left -= 4, p += 4;
    }
    for (; left; left--, p++) h = rotl64(h ^ *p * PRIME5, 11) * PRIME1;
    h ^= h >> 33;
    h *= PRIME2;
    h ^= h >> 29;
    h *= PRIME3;
    h ^= h >> 32;
    return h;
}

/* For slab i in [0, num_slabs): copies run j (src_bases[i] + src_offsets[j] ->
 * dst_bases[i] + dst_offsets[j], lengths[j] bytes) for each j in order, and writes XXH64 of
 * the copied bytes to digests[i]. Runs must not overlap within a destination slab. */
void kv_copy_hash_slabs(size_t num_slabs, const uint8_t *const *src_bases,
                        uint8_t *const *dst_bases, size_t num_runs, const int64_t *src_offsets,
                        const int64_t *dst_offsets, const int64_t *lengths, uint64_t *digests) {
    cursor_t c = {.src_bases = src_bases, .dst_bases = dst_bases, .src_offsets = src_offsets,
                  .dst_offsets = dst_offsets, .lengths = lengths, .num_slabs = num_slabs,
                  .num_runs = num_runs};
    cursor_start(&c);
    for (size_t i = 0; i < num_slabs; i++) {
        state_t s;
        reset(&s);
        for (size_t j = 0; j < num_runs; j++)
            update(&s, dst_bases[i] + dst_offsets[j], src_bases[i] + src_offsets[j],
                   (size_t)lengths[j], &c);
        digests[i] = digest(&s);
    }
}

/* For slab i: XXH64 of runs (bases[i] + offsets[j], lengths[j]) in order, into digests[i]. */
void kv_hash_slabs(size_t num_slabs, const uint8_t *const *bases, size_t num_runs,
                   const int64_t *offsets, const int64_t *lengths, uint64_t *digests) {
    cursor_t c = {.src_bases = bases, .src_offsets = offsets, .lengths = lengths,
                  .num_slabs = num_slabs, .num_runs = num_runs};
    cursor_start(&c);
    for (size_t i = 0; i < num_slabs; i++) {
        state_t s;
        reset(&s);
        for (size_t j = 0; j < num_runs; j++)
            update(&s, NULL, bases[i] + offsets[j], (size_t)lengths[j], &c);
        digests[i] = digest(&s);
    }
}
