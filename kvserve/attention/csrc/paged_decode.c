/* Decode attention read in place from the paged KV cache (fp32 queries; the cache fp32, int8, fp8 or int4),
 * parallel over (sequence, KV heads) with OpenMP.
 *
 * Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; position p of a sequence lives at
 * flat slot block_table[p / block_size] * block_size + p % block_size. A work item streams one sequence's keys
 * and values once, in tiles of TILE positions, for the query heads of a range of KV heads, with an online
 * softmax (running max and sum per query head), so no key or value is copied anywhere.
 *
 * Sequences whose tables start with the same block ids (prefix-cache hits on one system prompt, the samples of
 * one prompt) hold the same keys there: a first pass reads those shared keys once per KV head for the queries
 * of the whole group (a tile's keys stay in L1 while every member's query heads use them) and leaves each
 * member's softmax state; the second pass, per sequence, goes on from it over the sequence's own keys, with the
 * very sums it would have had alone (see Cascade). Sixteen requests on a 1,024-token prompt read 16x fewer
 * bytes of it than sixteen independent walks.
 *
 * What made it fast, measured at SmolLM2's shapes (3 KV heads x 3 query heads, head_dim 64, 32 decodes):
 *   - head_dim known at compile time (a copy per common head_dim): 1.6x over a runtime head_dim;
 *   - GNU vector types (lowered to whatever SIMD the CPU has) for the dot products and the weighted sum of
 *     values, that sum held in registers across a tile, a tree-shaped horizontal sum, and fixed tile trip
 *     counts so that the softmax loops vectorise whole: 1.8x on K/V that sits in the cache;
 *   - the next tile's rows prefetched (the blocks are scattered in memory): 1.1x;
 *   - all KV heads of a sequence in one work item when there are enough sequences, so each token's K and V
 *     rows are read as one contiguous run: 1.1x on one thread, 1.3x on two.
 *
 * A quantized cache (kvserve/kv/quant.py) is read as its codes, a quarter (int8, fp8) or an eighth (int4) of
 * fp32's bytes plus 2 bytes a row (int4: 4 a group of up to 64 values). int8 codes are converted in registers where they lie: a score
 * block takes 8 keys (AVX2: 4) for all the query heads of their KV head, so each key vector is converted once
 * for the group, and the scales are folded into the scores and the weights (attend_keys). fp8 and int4 rows
 * are dequantized a tile at a time (kv_vectors.h's dequantize_row; int4 keys left rotated, the queries rotated
 * alike at the start) into an fp32 tile on the stack (24 KB at SmolLM2's shapes, L1 / L2) that
 * the fp32 inner products then read. History: converting codes inside each dot product one query head at a
 * time converted each row once per query head, which lost to the tile (Zen 2: 1.9x fp32's time for int8
 * against the tile's 1.6x); the group-wide score blocks won once the tile's store, reload and scaling were the
 * int8 kernel's cost. Measured on AMD EPYC Zen 2, AVX2, 2 cores shared with other work (benchmarks/kv_quant.py,
 * 32 decodes x 1,000 tokens, one layer, median of 5): fp32 5.1 ms, int8 7.0, fp8 9.9, int4 6.1 (before the
 * AVX2 changes below: 9.8, 14.4, 33.7, 15.5). Most of that cost turned out to be GCC 12 scalarising the
 * byte-to-int32 widening of every code (kv_vectors.h now widens with one vpmovsxbd / vpmovzxbd) and, in the
 * write, torch's round opening a parallel region (kv/quant.py). After both, on a quiet Zen 4 (same benchmark,
 * median of 9, interleaved, time against fp32's in the same run, before -> after): AVX-512 int8 1.05x -> 0.62x,
 * fp8 1.22x -> 0.76x, int4 0.47x -> 0.52x (noise); forced AVX2 int8 1.11x -> 0.55x, fp8 1.34x -> 0.75x, int4
 * 0.85x -> 0.76x. The quantized caches are now read faster than fp32's, as their 3.8x / 7.1x fewer bytes
 * should make them.
 *
 * No torch headers: the module is called through ctypes with raw pointers, so it builds in seconds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32
#define FLOATS_PER_LINE 16
/* A vec is one register: GCC lowers a wider GNU vector on AVX2 (16 floats in two ymm) badly where a scalar
 * multiplies it (the broadcast is built on the stack one float at a time, then reloaded: a store-forwarding stall
 * per weighted value row) and spills its sums. With 8 floats, dot8 and four sums per dot: one decode over 300-1,000 keys 2.9x faster on
 * Zen 2 (one thread), 32 decodes over 1,000 keys 1.9x (fp32) to 3.4x (fp8). */
#if defined(__AVX512F__)
#define VEC 16
#define NUM_REGISTERS 32
#else
#define VEC 8
#define NUM_REGISTERS 16
#endif
typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef float half_vec __attribute__((vector_size(VEC / 2 * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VEC * sizeof(int32_t))));
typedef uint8_t byte_vec __attribute__((vector_size(VEC)));
typedef int8_t signed_byte_vec __attribute__((vector_size(VEC)));

#include "kv_vectors.h"


typedef struct {
    float *out;                  /* [num_seqs rows, num_kv_heads * group, head_dim], rows out_row_stride apart */
    const float *q;              /* same shape, rows q_row_stride apart; heads head_dim apart */
    const void *k_cache;         /* [num_blocks, block_size, num_kv_heads, head_dim] values in the encoding */
    const void *v_cache;
    const void *k_params;        /* [num_blocks, block_size, num_kv_heads]: fp16 scale (+ int4's zero); NULL for RAW */
    const void *v_params;
    const int32_t *block_tables; /* [num_seqs, block_table_stride] */
    const int32_t *seq_lens;     /* [num_seqs]: keys per sequence, the new token included */
    int64_t out_row_stride, q_row_stride, block_table_stride, num_blocks;
    int num_kv_heads, group, head_dim, block_size, window; /* window <= 0: no sliding window */
    float scale;
    int encoding;
} DecodeArgs;

/* Walks a sequence's positions through its block table without a division per key. */
typedef struct {
    const int32_t *table;
    int block, offset, remaining;
} KeyCursor;

static inline float horizontal_sum(vec v) {
    half_vec lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    const half_vec halves = lo + hi;
    float total = 0.0f;
    for (int i = 0; i < VEC / 2; i += 2) total += halves[i] + halves[i + 1];
    return total;
}

/* Whether every block that keys start .. seq_len - 1 live in is inside the cache (a corrupt table must not
 * make the kernel read outside it). */
static int blocks_in_cache(const DecodeArgs *a, const int32_t *table, int start, int seq_len) {
    for (int b = start / a->block_size; b <= (seq_len - 1) / a->block_size; b++)
        if (table[b] < 0 || table[b] >= a->num_blocks) return 0;
    return 1;
}

/* The cache offsets (in floats, to the first KV head of the item) of the next up to TILE keys; how many. */
static inline int next_tile(KeyCursor *c, int block_size, int64_t slot_stride, int64_t head_offset, int64_t *rows) {
    const int num_keys = c->remaining < TILE ? c->remaining : TILE;
    for (int t = 0; t < num_keys; t++) {
        rows[t] = ((int64_t)c->table[c->block] * block_size + c->offset) * slot_stride + head_offset;
        if (++c->offset == block_size) c->offset = 0, c->block++;
    }
    c->remaining -= num_keys;
    return num_keys;
}

/* Four independent sums: one chain of d / VEC dependent FMAs waits on the FMA's latency at every step. */
static inline __attribute__((always_inline)) float dot(const float *q, const float *k, const int d) {
    vec sums[4] = {{0}, {0}, {0}, {0}};
    int j = 0;
    for (; j + VEC <= d; j += VEC) sums[j / VEC % 4] += load(q + j) * load(k + j);
    float total = horizontal_sum((sums[0] + sums[1]) + (sums[2] + sums[3]));
    for (; j < d; j++) total += q[j] * k[j];
    return total;
}

#if VEC == 8 && defined(__AVX__)
#include <immintrin.h>
#define HAVE_DOT8
/* out[t] = q . k[rows[t]] for 8 keys: eight independent sums (no chain waits on the FMA's latency), folded into
 * one vector of the 8 dots by a tree of horizontal adds instead of a horizontal sum per key. d a multiple of 8. */
static inline __attribute__((always_inline)) void dot8(const float *q, const float *k, const int64_t *rows,
                                                       float *out, const int d) {
    vec sum[8];
    for (int t = 0; t < 8; t++) sum[t] = (vec){0};
    for (int j = 0; j < d; j += VEC) {
        const vec q_j = load(q + j);
        for (int t = 0; t < 8; t++) sum[t] += q_j * load(k + rows[t] + j);
    }
    __m256 pairs[4], quads[2];
    for (int i = 0; i < 4; i++) pairs[i] = _mm256_hadd_ps((__m256)sum[2 * i], (__m256)sum[2 * i + 1]);
    for (int i = 0; i < 2; i++) quads[i] = _mm256_hadd_ps(pairs[2 * i], pairs[2 * i + 1]);
    /* quads: [dots 0-3 over lanes 0-3 | dots 0-3 over lanes 4-7], then the same for keys 4-7 */
    const __m256 low = _mm256_permute2f128_ps(quads[0], quads[1], 0x20);
    const __m256 high = _mm256_permute2f128_ps(quads[0], quads[1], 0x31);
    store(out, (vec)_mm256_add_ps(low, high));
}
#endif

#if VEC == 16 && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DOT16
/* out[t] = q . k[rows[t]] for 16 keys, dot8's AVX-512 form: sixteen independent sums, folded into one vector of
 * the 16 dots by four levels of 128-bit and in-lane shuffles (three ops a dot where a horizontal sum per key took
 * about twelve: on 16 decodes over 2,000 tokens, per layer, the int8 cache's kernel was bound by those sums).
 * The folds leave the dot of sum a in lane 4 * (a % 4) + a / 4, so sum a takes key 4 * (a % 4) + a / 4 and
 * every key lands in its own lane. d a multiple of 16. */
static inline __attribute__((always_inline)) void dot16(const float *q, const float *k, const int64_t *rows,
                                                        float *out, const int d) {
    __m512 sum[16];
    for (int a = 0; a < 16; a++) sum[a] = _mm512_setzero_ps();
    for (int j = 0; j < d; j += 16) {
        const __m512 q_j = _mm512_loadu_ps(q + j);
        for (int a = 0; a < 16; a++)
            sum[a] = _mm512_fmadd_ps(q_j, _mm512_loadu_ps(k + rows[4 * (a % 4) + a / 4] + j), sum[a]);
    }
    __m512 halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; i++) /* sums 2i, 2i + 1: eight partials each, in the low and the high 256 bits */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(sum[2 * i], sum[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4(sum[2 * i], sum[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* sums 4i .. 4i + 3: four partials each, one 128-bit chunk a sum */
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* chunk c: two partials of sum 8i + c, then two of sum 8i + 4 + c */
        eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x88),
                                   _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xDD));
    /* chunk c: sums c, 4 + c, 8 + c, 12 + c, whole */
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88),
                                        _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD)));
}
#endif

/* The scale of int8 / fp8 row g (value index / head_dim). */
static inline float row_scale_of(const void *params, int64_t g) { return (float)((const _Float16 *)params)[g]; }

/* The stored bytes of the value at index row (a multiple of head_dim: a row's first). */
static inline const uint8_t *row_bytes(const void *cache, int64_t row, const int enc) {
    return (const uint8_t *)cache + (enc == RAW ? row * 4 : enc == INT4 ? row / 2 : row);
}

/* Bytes that num_values stored values take in the encoding. */
static inline int encoded_bytes(int num_values, const int enc) {
    return enc == RAW ? num_values * 4 : enc == INT4 ? num_values / 2 : num_values;
}

/* The parameters of the row at value index row (a multiple of d): int4's of its first group. */
static inline const uint8_t *row_params(const void *params, int64_t row, const int d, const int enc) {
    return (const uint8_t *)params + (enc == INT4 ? row / int4_group(d) * 4 : row / d * 2);
}

static inline void prefetch_row(const void *cache, const void *params, int64_t row, int num_values, const int d,
                                const int enc) {
    const uint8_t *p = row_bytes(cache, row, enc);
    for (int i = 0; i < encoded_bytes(num_values, enc); i += 4 * FLOATS_PER_LINE) __builtin_prefetch(p + i);
    if (enc != RAW) __builtin_prefetch(row_params(params, row, d, enc));
}

/* How many query heads from h on (at most most) read the same KV head: a run that one register block serves. */
static inline int kv_head_run(const int64_t *kv_offset, int h, int num_queries, int most) {
    int n = 1;
    while (n < most && h + n < num_queries && kv_offset[h + n] == kv_offset[h]) n++;
    return n;
}

/* The next tile's K and V rows (and their parameters), prefetched a few cache lines at a time while this tile
 * is worked on: asking for a whole tile at once (about a hundred lines of int8 rows) stalled on the CPU's line
 * fill buffers, a sixth of the int8 kernel's time; paced over the tile's work, the waits overlap it. */
typedef struct {
    const uint8_t *k_cache, *v_cache;
    const void *k_params, *v_params;
    const int64_t *rows; /* value index of each row's first value */
    int num_rows, bytes_per_row, d, enc;
    int row, offset;     /* the next line to ask for */
} Prefetcher;

static inline Prefetcher prefetcher(const DecodeArgs *a, const int64_t *rows, int num_rows, int num_values,
                                    const int d, const int enc) {
    return (Prefetcher){a->k_cache, a->v_cache, a->k_params, a->v_params, rows, num_rows,
                        encoded_bytes(num_values, enc), d, enc, 0, 0};
}

/* How many lines prefetch_lines must ask for in each of num_calls calls to cover all the rows. */
static inline int lines_per_call(const Prefetcher *p, int num_calls) {
    const int lines_per_row = (p->bytes_per_row + 4 * FLOATS_PER_LINE - 1) / (4 * FLOATS_PER_LINE);
    return (p->num_rows * lines_per_row + num_calls - 1) / num_calls;
}

/* Asks for the next num_lines lines of K and of V (and a row's parameters with its first line). */
static inline void prefetch_lines(Prefetcher *p, int num_lines) {
    for (; num_lines > 0 && p->row < p->num_rows; num_lines--) {
        const int64_t row = p->rows[p->row];
        __builtin_prefetch(row_bytes(p->k_cache, row, p->enc) + p->offset);
        __builtin_prefetch(row_bytes(p->v_cache, row, p->enc) + p->offset);
        if (p->offset == 0 && p->enc != RAW) {
            __builtin_prefetch(row_params(p->k_params, row, p->d, p->enc));
            __builtin_prefetch(row_params(p->v_params, row, p->d, p->enc));
        }
        p->offset += 4 * FLOATS_PER_LINE;
        if (p->offset >= p->bytes_per_row) p->offset = 0, p->row++;
    }
}

/* VEC values of a row from value index index: fp32 loaded, int8 codes converted in registers (unscaled: their
 * scale is folded into the score or the weight). */
static inline __attribute__((always_inline)) vec values_at(const void *cache, int64_t index, const int enc) {
    if (enc == RAW) return load((const float *)cache + index);
    return codes_to_vec((const uint8_t *)cache + index, enc);
}

/* Keys a score block takes at once: with BLOCK_QUERIES query heads, their sums, the query vectors and a key
 * vector fill the registers (24 + 3 + 1 of 32 zmm; 12 + 3 + 1 of 16 ymm). */
#define BLOCK_KEYS (NUM_REGISTERS == 32 ? 8 : 4)
#define BLOCK_QUERIES 3

/* out[k] = the lanes of sums[k] added up, for the BLOCK_KEYS sums of a score block: one fold of all of them
 * (three or four levels of shuffles and adds) instead of a horizontal sum each. */
static inline __attribute__((always_inline)) void fold_keys(const vec *sums, float *out) {
#if VEC == 16 && defined(__AVX512F__)
    __m512 halves[4], quarters[2];
    for (int i = 0; i < 4; i++) /* sums 2i, 2i + 1: eight partials each, in the low and the high 256 bits */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)sums[2 * i], (__m512)sums[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4((__m512)sums[2 * i], (__m512)sums[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* sums 4i .. 4i + 3: four partials each, a 128-bit chunk a sum */
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
    /* chunk c: two partials of sum c, two of sum 4 + c; then each pair added, left in lanes 4c and 4c + 2 */
    __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(quarters[0], quarters[1], 0x88),
                                 _mm512_shuffle_ps(quarters[0], quarters[1], 0xDD));
    pairs = _mm512_add_ps(pairs, _mm512_shuffle_ps(pairs, pairs, 0xB1));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, pairs)));
#elif VEC == 8 && defined(__AVX__)
    /* [sum 0, 1, 2, 3 over lanes 0-3 | the same over lanes 4-7], then the halves added */
    const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps((__m256)sums[0], (__m256)sums[1]),
                                        _mm256_hadd_ps((__m256)sums[2], (__m256)sums[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
#else
    for (int k = 0; k < BLOCK_KEYS; k++) out[k] = horizontal_sum(sums[k]);
#endif
}

/* scores[p * TILE + k] = q_p . key k for num_queries (<= BLOCK_QUERIES) query heads of one KV head (q_p at
 * q + p * d) and the BLOCK_KEYS keys at value indices rows[k] (int8 codes: unscaled dots). Each key vector is
 * loaded and converted once for all the query heads. d a multiple of VEC. */
static inline __attribute__((always_inline)) void block_scores(const int num_queries, const float *q,
                                                               const void *cache, const int64_t *rows,
                                                               float *scores, const int d, const int enc) {
    vec sums[BLOCK_QUERIES][BLOCK_KEYS];
    for (int p = 0; p < num_queries; p++)
        for (int k = 0; k < BLOCK_KEYS; k++) sums[p][k] = (vec){0};
    for (int j = 0; j < d; j += VEC) {
        vec q_j[BLOCK_QUERIES];
        for (int p = 0; p < num_queries; p++) q_j[p] = load(q + p * d + j);
        for (int k = 0; k < BLOCK_KEYS; k++) {
            const vec k_j = values_at(cache, rows[k] + j, enc);
            for (int p = 0; p < num_queries; p++) sums[p][k] += q_j[p] * k_j;
        }
    }
    for (int p = 0; p < num_queries; p++) fold_keys(sums[p], scores + p * TILE);
}

/* A tile's scores (query h's at scores + h * TILE) for num_queries query heads, those of one KV head (equal
 * kv_offset) BLOCK_QUERIES at a time, read from the int8 keys in place; the dots are multiplied by their rows'
 * scales. rows is padded to a whole number of score blocks (the padding's scores are overwritten by the
 * caller). The next tile's lines are asked for a few at a time between the score blocks. */
static inline __attribute__((always_inline)) void tile_scores(const float *q, int num_queries,
                                                              const int64_t *kv_offset, const void *keys,
                                                              const void *params, const int64_t *rows,
                                                              int num_keys, Prefetcher *next, float *scores,
                                                              const int d, const int enc) {
    int num_runs = 0; /* score blocks per key block */
    for (int h = 0; h < num_queries; num_runs++) h += kv_head_run(kv_offset, h, num_queries, BLOCK_QUERIES);
    const int num_lines = lines_per_call(next, (num_keys + BLOCK_KEYS - 1) / BLOCK_KEYS * num_runs);
    for (int t = 0; t < num_keys; t += BLOCK_KEYS) {
        int64_t block_rows[BLOCK_KEYS];
        for (int h = 0; h < num_queries;) {
            const int n = kv_head_run(kv_offset, h, num_queries, BLOCK_QUERIES);
            prefetch_lines(next, num_lines);
            for (int k = 0; k < BLOCK_KEYS; k++) block_rows[k] = rows[t + k] + kv_offset[h];
            const float *q_h = q + h * d;
            float *out = scores + h * TILE + t;
            switch (n) { /* a constant count each: the sums stay in registers */
            case 3: block_scores(3, q_h, keys, block_rows, out, d, enc); break;
            case 2: block_scores(2, q_h, keys, block_rows, out, d, enc); break;
            default: block_scores(1, q_h, keys, block_rows, out, d, enc);
            }
            for (int k = 0; k < BLOCK_KEYS && t + k < num_keys; k++) {
                const float key_scale = row_scale_of(params, block_rows[k] / d);
                for (int p = 0; p < n; p++) out[p * TILE + k] *= key_scale;
            }
            h += n;
        }
    }
}

/* Turn one tile's scores (padded to TILE with -inf) into softmax weights against each query head's running
 * max, rescaling what is already accumulated when that max grows. */
static inline __attribute__((always_inline)) void softmax_tile(float *scores, int num_heads, const int d,
                                                               float *acc, float *row_max, float *row_sum) {
    for (int h = 0; h < num_heads; h++) {
        float *s = scores + h * TILE, tile_max = -INFINITY;
#pragma omp simd reduction(max : tile_max)
        for (int t = 0; t < TILE; t++) tile_max = s[t] > tile_max ? s[t] : tile_max;
        const float new_max = tile_max > row_max[h] ? tile_max : row_max[h];
        const float correction = exp_nonpositive_vec((vec){0} + (row_max[h] - new_max))[0]; /* 0 at first */
        float tile_sum = 0.0f;
        for (int t = 0; t < TILE; t += VEC) {
            const vec weights = exp_nonpositive_vec(load(s + t) - new_max);
            store(s + t, weights);
            tile_sum += horizontal_sum(weights);
        }
        row_sum[h] = row_sum[h] * correction + tile_sum;
        row_max[h] = new_max;
        float *acc_h = acc + h * d;
#pragma omp simd
        for (int i = 0; i < d; i++) acc_h[i] *= correction;
    }
}

/* acc += sum over the tile's keys of weight * value row for num_queries query heads of one KV head (query p's
 * accumulator at acc + p * d, its weights at weights + p * TILE; rows at value index rows[t] + kv_offset, fp32 or
 * codes whose scale the weights carry), the num_queries x head_dim / VEC sums held in registers: each value row
 * is loaded (and converted) once for all of them, and there are enough independent sums to keep both FMA units
 * busy (one query's four on AVX-512 at head_dim 64 left half the FMAs waiting on the one before). */
static inline __attribute__((always_inline)) void weighted_values(float *acc, const float *weights,
                                                                  const int num_queries, const void *cache,
                                                                  int64_t kv_offset, const int64_t *rows,
                                                                  int num_keys, const int d, const int enc) {
    const int num_vecs = d / VEC;
    vec sum[num_queries][num_vecs > 0 ? num_vecs : 1];
    for (int p = 0; p < num_queries; p++)
        for (int j = 0; j < num_vecs; j++) sum[p][j] = load(acc + p * d + j * VEC);
    for (int t = 0; t < num_keys; t++) {
        const int64_t row = rows[t] + kv_offset;
        for (int j = 0; j < num_vecs; j++) {
            const vec v_j = values_at(cache, row + j * VEC, enc);
            for (int p = 0; p < num_queries; p++) sum[p][j] += weights[p * TILE + t] * v_j;
        }
        for (int i = num_vecs * VEC; i < d; i++) /* fp32 only: codes are read in place only in whole vectors */
            for (int p = 0; p < num_queries; p++)
                acc[p * d + i] += weights[p * TILE + t] * ((const float *)cache)[row + i];
    }
    for (int p = 0; p < num_queries; p++)
        for (int j = 0; j < num_vecs; j++) store(acc + p * d + j * VEC, sum[p][j]);
}

/* weighted_values for every query head, as many of one KV head at a time as keep their sums within half the
 * registers (the queries of a KV head are consecutive, kv_offset equal). Codes' weights are first multiplied by
 * their rows' scales. */
static inline __attribute__((always_inline)) void weighted_values_by_kv_head(float *acc, const float *scores,
                                                                             int num_queries,
                                                                             const int64_t *kv_offset,
                                                                             const void *values,
                                                                             const void *params,
                                                                             const int64_t *rows, int num_keys,
                                                                             const int d, const int enc) {
    const int num_vecs = d / VEC;
    const int most = num_vecs <= NUM_REGISTERS / 8 ? 4 : num_vecs <= NUM_REGISTERS / 4 ? 2 : 1;
    float scaled[enc == RAW ? 1 : 4 * TILE], row_scale[enc == RAW ? 1 : TILE];
    for (int h = 0; h < num_queries;) {
        const int n = kv_head_run(kv_offset, h, num_queries, most);
        float *out = acc + h * d;
        const float *weights = scores + h * TILE;
        if (enc != RAW) {
            for (int t = 0; t < num_keys; t++) row_scale[t] = row_scale_of(params, (rows[t] + kv_offset[h]) / d);
            for (int p = 0; p < n; p++)
                for (int t = 0; t < num_keys; t++) scaled[p * TILE + t] = weights[p * TILE + t] * row_scale[t];
            weights = scaled;
        }
        switch (n) { /* a constant count each: the sums stay in registers */
        case 4: weighted_values(out, weights, 4, values, kv_offset[h], rows, num_keys, d, enc); break;
        case 3: weighted_values(out, weights, 3, values, kv_offset[h], rows, num_keys, d, enc); break;
        case 2: weighted_values(out, weights, 2, values, kv_offset[h], rows, num_keys, d, enc); break;
        default: weighted_values(out, weights, 1, values, kv_offset[h], rows, num_keys, d, enc);
        }
        h += n;
    }
}

/* The tile's num_keys rows (num_kv KV heads of d values from value index rows[t]) dequantized into
 * tile[t][num_kv * d]; row t of the next tile (num_next rows at next_rows) prefetched beside row t. Prefetching a
 * whole tile at once stalled on the CPU's line fill buffers (a fifth of the int8 kernel's time, 16 decodes over
 * 2,000 tokens); spread over the dequantization, the waits overlap its work. */
static inline __attribute__((always_inline)) void dequantize_tile(const void *cache, const void *params,
                                                                  const int64_t *rows, int num_keys, int num_kv,
                                                                  float *tile, const int64_t *next_rows,
                                                                  int num_next, const int d, const int enc) {
    for (int t = 0; t < num_keys; t++) {
        if (t < num_next) prefetch_row(cache, params, next_rows[t], num_kv * d, d, enc);
        for (int h = 0; h < num_kv; h++)
            dequantize_row(cache, params, rows[t] + h * d, tile + ((int64_t)t * num_kv + h) * d, d, enc);
    }
    for (int t = num_keys; t < num_next; t++) prefetch_row(cache, params, next_rows[t], num_kv * d, d, enc);
}


/* The scores of a tile's fp32 keys (rows in floats from keys), one query head at a time: 16 (AVX-512) or 8
 * (AVX2) keys a dot product fold. The next tile's lines are asked for between the query heads. */
static inline __attribute__((always_inline)) void float_scores(const float *q, int num_queries,
                                                               const int64_t *kv_offset, const float *keys,
                                                               const int64_t *rows, int num_keys, Prefetcher *next,
                                                               float *scores, const int d) {
    const int num_lines = lines_per_call(next, num_queries);
    for (int h = 0; h < num_queries; h++) {
        float *s = scores + h * TILE;
        const float *k = keys + kv_offset[h];
        int t = 0;
#ifdef HAVE_DOT8
        if (d % VEC == 0)
            for (; t + 8 <= num_keys; t += 8) dot8(q + h * d, k, rows + t, s + t, d);
#endif
#ifdef HAVE_DOT16
        if (d % VEC == 0)
            for (; t + 16 <= num_keys; t += 16) dot16(q + h * d, k, rows + t, s + t, d);
#endif
        for (; t < num_keys; t++) s[t] = dot(q + h * d, k + rows[t], d);
        prefetch_lines(next, num_lines);
    }
}

/* Streams the keys under the cursor through the online-softmax state (acc, row_max, row_sum) of num_queries
 * query heads; query h reads KV head (h / group) % num_kv of the item, which starts head_offset floats into a
 * slot. One sequence's heads (num_kv KV heads), or the heads of one KV head for a whole sharing group.
 *
 * fp32 rows and int8 codes are read where they lie; an int8 key or value vector, converted in registers once,
 * serves all the query heads of its KV head, its scale folded into the scores and the weights. Against
 * dequantizing each tile into an fp32 tile first, that dropped a store, a reload and a multiply of every value:
 * 16 decodes over 2,000 tokens, a layer of 30, 1.3x faster on AVX-512 (1.04x on AVX2). fp8 and int4 (whose
 * conversions need more registers than AVX2 has to spare; in registers they measured 0.67x and 0.40x there) and
 * a head_dim that is not a multiple of VEC are dequantized a tile at a time. */
static inline __attribute__((always_inline)) void attend_keys(const DecodeArgs *a, KeyCursor *cursor,
                                                              int64_t head_offset, int num_kv, int num_queries,
                                                              const float *q, float *acc, float *row_max,
                                                              float *row_sum, const int d, const int enc) {
    const int in_place = enc == RAW || (enc == INT8 && d % VEC == 0), read_enc = in_place ? enc : RAW;
    const int64_t slot_stride = (int64_t)a->num_kv_heads * d, tile_stride = (int64_t)num_kv * d;
    float scores[num_queries * TILE], tile[in_place ? 1 : TILE * tile_stride];
    int64_t rows[TILE], next_rows[TILE], tile_rows[TILE], kv_offset[num_queries];
    for (int h = 0; h < num_queries; h++) kv_offset[h] = (int64_t)(h / a->group % num_kv) * d;
    for (int t = 0; t < TILE; t++) tile_rows[t] = t * tile_stride;
    const void *keys = in_place ? a->k_cache : tile, *values = in_place ? a->v_cache : tile;
    const int64_t *read_rows = in_place ? rows : tile_rows;

    int num_next = next_tile(cursor, a->block_size, slot_stride, head_offset, next_rows);
    while (num_next > 0) {
        const int num_keys = num_next;
        memcpy(rows, next_rows, num_keys * sizeof *rows);
        for (int t = num_keys; t < TILE; t++) rows[t] = rows[0]; /* whole score blocks; their scores overwritten */
        num_next = next_tile(cursor, a->block_size, slot_stride, head_offset, next_rows);
        /* the tile's dequantization asks for the next tile's rows itself */
        Prefetcher next = prefetcher(a, next_rows, in_place ? num_next : 0, num_kv * d, d, enc);
        if (!in_place)
            dequantize_tile(a->k_cache, a->k_params, rows, num_keys, num_kv, tile, next_rows, num_next, d, enc);
        if (read_enc == INT8)
            tile_scores(q, num_queries, kv_offset, keys, a->k_params, read_rows, num_keys, &next, scores, d, enc);
        else
            float_scores(q, num_queries, kv_offset, keys, read_rows, num_keys, &next, scores, d);
        for (int h = 0; h < num_queries; h++)
            for (int t = num_keys; t < TILE; t++) scores[h * TILE + t] = -INFINITY;
        softmax_tile(scores, num_queries, d, acc, row_max, row_sum);
        if (!in_place)
            dequantize_tile(a->v_cache, a->v_params, rows, num_keys, num_kv, tile, next_rows, num_next, d, enc);
        weighted_values_by_kv_head(acc, scores, num_queries, kv_offset, values, a->v_params, read_rows, num_keys, d,
                                   read_enc);
    }
}

/* Sequences of a step that share their leading blocks (a prefix-cache hit, or the samples of one prompt):
 * their shared keys are attended once per KV head for all their queries ("cascade" attention), and each
 * sequence then goes on from that state over its own keys.
 *
 * Batch-invariant: a sequence's output is bit for bit the same whether it shares the step's keys or attends
 * alone. The group pass runs attend_keys, whose arithmetic for one query head depends on neither the other
 * query heads nor how many there are, over whole tiles from the sequence's first key (a shared length is a
 * multiple of TILE), so the state it leaves is the state the sequence's own walk has at that key; and the keys
 * are never cut into runs merged afterwards. Cuts that depended on the step (its sharers' common blocks, the
 * threads' work) changed the sums, and with a quantized cache the codes later layers' K/V rounded to. */
typedef struct {
    int *shared_len;   /* [num_seqs]: leading keys the group pass covered (0: the sequence attends alone) */
    float *state;      /* [num_seqs * num_heads, head_dim + 2]: acc, running max, running sum after them */
    int *members;      /* the sharing sequences, one group after another */
    int *chunk_first;  /* [num_chunks]: a chunk is members[chunk_first[c] .. chunk_first[c + 1]) */
    int num_chunks;
} Cascade;

#define MAX_SHARED_QUERIES 64 /* query heads per group work item: bounds its stack arrays */

/* The shared keys of one chunk of a group, for the query heads of one KV head; 0, or 1 on a bad block id. */
static inline __attribute__((always_inline)) int attend_shared(const DecodeArgs *a, const Cascade *c, int chunk,
                                                                int kv_head, const int d) {
    const int enc = a->encoding; /* at run time: one copy per head_dim serves every encoding */
    const int first = c->chunk_first[chunk], count = c->chunk_first[chunk + 1] - first, group = a->group;
    const int leader = c->members[first], num_queries = count * group, num_heads = a->num_kv_heads * group;
    const int num_keys = c->shared_len[leader];
    const int64_t head_offset = (int64_t)kv_head * d;
    KeyCursor cursor = {a->block_tables + leader * a->block_table_stride, 0, 0, num_keys};
    if (!blocks_in_cache(a, cursor.table, 0, num_keys)) return 1;
    float q[num_queries * d], acc[num_queries * d], row_max[num_queries], row_sum[num_queries];
    for (int m = 0; m < count; m++) {
        const float *q_in = a->q + c->members[first + m] * a->q_row_stride + head_offset * group;
        for (int i = 0; i < group * d; i++) q[m * group * d + i] = q_in[i] * a->scale;
    }
    memset(acc, 0, sizeof acc);
    for (int h = 0; h < num_queries; h++) row_max[h] = -INFINITY, row_sum[h] = 0.0f;
    attend_keys(a, &cursor, head_offset, 1, num_queries, q, acc, row_max, row_sum, d, enc);
    for (int h = 0; h < num_queries; h++) {
        const int seq = c->members[first + h / group];
        float *state = c->state + ((int64_t)seq * num_heads + kv_head * group + h % group) * (d + 2);
        memcpy(state, acc + h * d, d * sizeof(float));
        state[d] = row_max[h], state[d + 1] = row_sum[h];
    }
    return 0;
}

/* One sequence, KV heads first_kv_head .. first_kv_head + num_kv - 1 and their query heads, from where the
 * group pass left it (if it had one); 0, or 1 if its block table names a block outside the cache (then
 * nothing is written). */
static inline __attribute__((always_inline)) int attend(const DecodeArgs *a, const Cascade *c, int seq,
                                                         int first_kv_head, int num_kv, const int d,
                                                         const int enc) {
    const int group = a->group, num_heads = num_kv * group, seq_len = a->seq_lens[seq];
    const int num_shared = c->shared_len[seq]; /* only sequences within their window share */
    const int window_start = a->window > 0 && seq_len > a->window ? seq_len - a->window : 0;
    const int start = num_shared > window_start ? num_shared : window_start;
    const int64_t head_offset = (int64_t)first_kv_head * d;
    KeyCursor cursor = {a->block_tables + seq * a->block_table_stride, start / a->block_size,
                        start % a->block_size, seq_len - start};
    if (!blocks_in_cache(a, cursor.table, start, seq_len)) return 1;
    float q[num_heads * d], acc[num_heads * d], row_max[num_heads], row_sum[num_heads];

    const float *q_in = a->q + seq * a->q_row_stride + head_offset * group;
    for (int i = 0; i < num_heads * d; i++) q[i] = q_in[i] * a->scale;
    for (int h = 0; h < num_heads; h++) {
        if (num_shared) {
            const float *state = c->state + ((int64_t)seq * a->num_kv_heads * group + first_kv_head * group + h) *
                                                (d + 2);
            memcpy(acc + h * d, state, d * sizeof(float));
            row_max[h] = state[d], row_sum[h] = state[d + 1];
        } else {
            memset(acc + h * d, 0, d * sizeof(float));
            row_max[h] = -INFINITY, row_sum[h] = 0.0f;
        }
    }
    attend_keys(a, &cursor, head_offset, num_kv, num_heads, q, acc, row_max, row_sum, d, enc);

    float *out = a->out + seq * a->out_row_stride + head_offset * group;
    for (int h = 0; h < num_heads; h++) {
        const float inv_sum = 1.0f / row_sum[h];
        for (int i = 0; i < d; i++) out[h * d + i] = acc[h * d + i] * inv_sum;
    }
    return 0;
}

typedef int (*AttendFn)(const DecodeArgs *, const Cascade *, int, int, int);
typedef int (*SharedFn)(const DecodeArgs *, const Cascade *, int, int);
/* A copy per head_dim (64 / 128 / 256 known at compile time, any other at run time) for the group pass, whose
 * tile dequantization is shared by the whole group, and per (head_dim, encoding) for the sequences' own keys. */
#define HEAD_DIM_COPY(D, NAME)                                                                                    \
    static int shared_##NAME(const DecodeArgs *a, const Cascade *c, int chunk, int h) {                         \
        return attend_shared(a, c, chunk, h, D);                                                                  \
    }
#define COPY(D, E, NAME)                                                                                          \
    static int attend_##NAME(const DecodeArgs *a, const Cascade *c, int s, int h, int n) {                       \
        return attend(a, c, s, h, n, D, E);                                                                       \
    }
#define ENCODING_COPIES(D, NAME) COPY(D, RAW, NAME##_f32) COPY(D, INT8, NAME##_int8) COPY(D, FP8, NAME##_fp8) \
    COPY(D, INT4, NAME##_int4) HEAD_DIM_COPY(D, NAME)
ENCODING_COPIES(64, 64)
ENCODING_COPIES(128, 128)
ENCODING_COPIES(256, 256)
ENCODING_COPIES(a->head_dim, any)
#define BY_ENCODING(NAME) {attend_##NAME##_f32, attend_##NAME##_int8, attend_##NAME##_fp8, attend_##NAME##_int4}
static const AttendFn ATTEND[4][4] = {BY_ENCODING(64), BY_ENCODING(128), BY_ENCODING(256), BY_ENCODING(any)};
static const SharedFn SHARED[4] = {shared_64, shared_128, shared_256, shared_any};

/* The keys of num_blocks blocks that whole tiles cover: what a group pass may take. */
static inline int whole_tiles(int num_blocks, int block_size) {
    return (int)((int64_t)num_blocks * block_size / TILE * TILE);
}

/* Groups the sequences whose block tables start with the same blocks. A group's shared length is the blocks
 * all its members have in common with its first member, counting only blocks before each member's last one (so
 * every shared key is older than every member's new token), cut down to whole tiles, and none for a sequence past
 * its sliding window. Groups are cut into chunks of at most MAX_SHARED_QUERIES query heads, and into more when
 * that leaves a thread without work (each chunk then reads the shared keys, while they are in the caches). Fills
 * c (owning its arrays; free with free_cascade); -1 when out of memory. */
static int plan_cascade(const DecodeArgs *a, int num_seqs, int num_threads, Cascade *c) {
    const int n = num_seqs, bs = a->block_size;
    int *leader_of = malloc(n * sizeof(int)), *blocks = malloc(n * sizeof(int)), *size = calloc(n, sizeof(int));
    c->shared_len = calloc(n, sizeof(int));
    c->members = malloc(n * sizeof(int));
    c->chunk_first = malloc((n + 1) * sizeof(int));
    c->state = NULL, c->num_chunks = 0;
    if (!leader_of || !blocks || !size || !c->shared_len || !c->members || !c->chunk_first) goto fail;
    for (int i = 0; i < n; i++) {
        const int seq_len = a->seq_lens[i];
        const int own = a->window > 0 && seq_len > a->window ? 0 : (seq_len - 1) / bs;
        const int32_t *table = a->block_tables + i * a->block_table_stride;
        leader_of[i] = -1;
        for (int j = 0; j < i && own > 0; j++) {
            if (leader_of[j] != j) continue;
            const int32_t *leader_table = a->block_tables + j * a->block_table_stride;
            if (leader_table[0] != table[0]) continue;
            int common = 0;
            while (common < blocks[j] && common < own && leader_table[common] == table[common]) common++;
            blocks[j] = common, leader_of[i] = j, size[j]++;
            break;
        }
        if (leader_of[i] < 0 && own > 0) leader_of[i] = i, blocks[i] = own, size[i] = 1;
    }
    int num_groups = 0;
    for (int j = 0; j < n; j++)
        num_groups += leader_of[j] == j && size[j] > 1 && whole_tiles(blocks[j], bs) > 0;
    const int per_chunk = MAX_SHARED_QUERIES / a->group > 1 ? MAX_SHARED_QUERIES / a->group : 1;
    /* chunks a group needs for every thread to have two items (KV heads x chunks) */
    const int busy_chunks = num_groups ? (2 * num_threads + num_groups * a->num_kv_heads - 1) /
                                             (num_groups * a->num_kv_heads) : 0;
    int next = 0;
    for (int j = 0; j < n && num_groups; j++) {
        const int shared = whole_tiles(blocks[j], bs);
        if (leader_of[j] != j || size[j] < 2 || shared == 0) continue;
        int chunks = (size[j] + per_chunk - 1) / per_chunk;
        chunks = chunks < busy_chunks ? (busy_chunks < size[j] ? busy_chunks : size[j]) : chunks;
        const int first = next;
        for (int i = j; i < n; i++)
            if (leader_of[i] == j) c->members[next++] = i, c->shared_len[i] = shared;
        for (int k = 0; k < chunks; k++) c->chunk_first[c->num_chunks++] = first + (int)((int64_t)size[j] * k / chunks);
    }
    c->chunk_first[c->num_chunks] = next;
    if (num_groups) {
        c->state = malloc((size_t)n * a->num_kv_heads * a->group * (a->head_dim + 2) * sizeof(float));
        if (!c->state) goto fail;
    }
    free(leader_of), free(blocks), free(size);
    return 0;
fail:
    free(leader_of), free(blocks), free(size);
    free(c->shared_len), free(c->members), free(c->chunk_first);
    return -1;
}

static void free_cascade(Cascade *c) { free(c->shared_len), free(c->members), free(c->chunk_first), free(c->state); }

/* Attention of one query token per sequence over its cached keys; the step's own key is already written.
 * Returns how many work items met a block id outside the cache's num_blocks (0 when all is well), or -1 when
 * memory for the plan could not be had. */
int kvserve_paged_decode_f32(float *out, int64_t out_row_stride, const float *q, int64_t q_row_stride,
                             const void *k_cache, const void *v_cache, const void *k_params,
                             const void *v_params, int encoding, int64_t num_blocks,
                             const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                             int num_seqs, int num_kv_heads, int group, int head_dim, int block_size, int window,
                             float scale, int num_threads) {
    float *rotated = NULL; /* int4 keys are stored rotated: the queries are rotated alike */
    if (encoding == INT4) {
        rotated = rotated_queries(q, q_row_stride, num_seqs, num_kv_heads * group, head_dim);
        if (!rotated) return -1;
        q = rotated, q_row_stride = (int64_t)num_kv_heads * group * head_dim;
    }
    const DecodeArgs a = {out, q, k_cache, v_cache, k_params, v_params, block_tables, seq_lens, out_row_stride,
                          q_row_stride, block_table_stride, num_blocks, num_kv_heads, group, head_dim, block_size,
                          window, scale, encoding};
    const int copy = head_dim == 64 ? 0 : head_dim == 128 ? 1 : head_dim == 256 ? 2 : 3;
    const AttendFn attend_fn = ATTEND[copy][encoding];
    const SharedFn shared_fn = SHARED[copy];
    Cascade cascade;
    if (plan_cascade(&a, num_seqs, num_threads, &cascade)) {
        free(rotated);
        return -1;
    }
    int num_bad = 0;
    /* the groups' shared keys first: every (chunk, KV head) item writes its members' states */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : num_bad) \
    if (cascade.num_chunks > 0) /* no threads woken for a step without groups */
    for (int item = 0; item < cascade.num_chunks * num_kv_heads; item++)
        num_bad += shared_fn(&a, &cascade, item / num_kv_heads, item % num_kv_heads);
    /* whole sequences per item when they are enough to keep every thread busy, else one KV head per item */
    const int kv_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
    const int items_per_seq = num_kv_heads / kv_per_item;
    /* dynamic: sequences differ tenfold in length */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : num_bad)
    for (int item = 0; item < num_seqs * items_per_seq; item++)
        num_bad += attend_fn(&a, &cascade, item / items_per_seq, item % items_per_seq * kv_per_item, kv_per_item);
    free_cascade(&cascade);
    free(rotated);
    return num_bad;
}
