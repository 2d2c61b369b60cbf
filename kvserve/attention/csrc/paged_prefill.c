/* Prefill attention read in place from the paged KV cache (fp32): causal, grouped-query, sliding window, each
 * chunk's queries over its cached context plus the chunk itself (whose K/V the caller has already written).
 *
 * Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; position p of a sequence lives at
 * flat slot block_table[p / block_size] * block_size + p % block_size. A work item is (chunk, KV head, tile of
 * queries_per_tile query positions): its rows are those positions x the KV head's group of query heads, laid
 * across the vector lanes (query-major: lane = position * group + head), so each key and value row loaded is
 * used by every row of the tile:
 *
 *     keys:   start ....... p_last - window + 1 ................... p_first ........ p_last
 *             |<- masked ------>|<- tiles of KEY_TILE keys, no mask ->|<- masked (diagonal) ->|
 *     start = p_first - window + 1 (or 0): older keys are skipped, but for those of start's tile: tiles lie on a
 *     grid of KEY_TILE keys from key 0, so that a row's sums do not depend on where its chunk was cut; without a
 *     window only the diagonal is masked
 *
 * Per key tile: the scores of every row against the tile's keys (queries transposed once per item, so a score
 * block is broadcast-FMAs of key elements with rows of queries, sums in registers), an online softmax down the
 * lanes (running max and sum per row), and the weighted sum of value rows into per-row accumulators, a block of
 * rows x head_dim vectors held in registers across the tile. OpenMP over work items, largest first, so one
 * chunk keeps every thread busy.
 *
 * Vectors are GNU vector types of one register (8 floats on AVX2, 16 on AVX-512), and the register blocks of
 * the two inner products are sized for that ISA's register file (16 or 32 registers).
 *
 * Measured on AMD EPYC Zen 2, AVX2, 2 cores: ms per layer (KV write + attention) at 2 threads, SDPA over gathered
 * K/V (TorchRefBackend) -> this kernel, best of 8 interleaved rounds of benchmarks/attention_backends.py in a quiet
 * spell (two runs beside other benchmarks, load ~3.5, gave 1.4-4.3x, the kernel ahead in every case):
 *   SmolLM2 (9 heads, 3 KV heads, head_dim 64)     512-token chunk on 0 cached:    12.6 -> 6.6  (1.9x)
 *                                                   512 on 512 cached:              25.9 -> 18.4 (1.4x)
 *                                                   512 on 1,400 cached:            49.5 -> 39.7 (1.25x)
 *                                                   4 chunks of 128 (0-700 cached): 13.7 -> 10.2 (1.35x)
 *                                                   32 queries on 1,024 cached:      2.5 -> 1.8  (1.35x)
 *   Gemma-3-270M sliding (4 heads, 1 KV head,      512-token chunk on 0 cached:    18.4 -> 9.7  (1.9x)
 *   head_dim 256, window 512)                      512 on 512 cached:              38.3 -> 19.3 (2.0x)
 *                                                   512 on 1,400 cached:            38.5 -> 19.1 (2.0x)
 *                                                   4 chunks of 128:                18.1 -> 12.9 (1.4x)
 *                                                   32 queries on 1,024 cached:      1.9 -> 1.4  (1.4x)
 * That is ~48 GFLOP/s over both cores at SmolLM2's shapes whatever the context (SDPA gains on long contexts,
 * where its GEMMs grow). One thread, SmolLM2, 512 on 0 cached: 24-25 ms -> 12.6 ms, 24 GFLOP/s, where
 * torch.matmul reaches 32 on the same core; the time splits about 35% scores, 35% weighted values, 20% exp (perf). Vectorising the mask and
 * 6-row value blocks (12 sums in flight, FMA latency 5 x 2 ports) gave ~5% each; more keys per score block when
 * a tile has only 1-2 lane vectors, and 16 / 32 / 64 lanes per tile at head_dim 256, changed nothing measurable.
 *
 * Quantized caches (kvserve/kv/quant.py) are dequantized a key tile at a time into fp32 rows on the stack, which
 * the tile's inner products then read as they read an fp32 cache: a prefill is bound by FLOPs, and each row
 * dequantized serves every query row of the tile.
 *
 * The encodings and the vector helpers (loads, exp, code conversion) are paged_decode.c's, from kv_vectors.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16          /* floats per vector register */
#define SCORE_LANES 3   /* score block: up to 3 lane vectors x SCORE_KEYS keys = 24 of 32 registers */
#define SCORE_KEYS 8
#define VALUE_ROWS 6    /* weighted values: 6 rows x VALUE_VECS vectors of head_dim = 24 of 32 registers */
#define VALUE_VECS 4
#else
#define VEC 8
#define SCORE_LANES 3   /* 3 x 4 sums + 3 query vectors + 1 broadcast key element = 16 registers */
#define SCORE_KEYS 4
#define VALUE_ROWS 6    /* 6 x 2 sums + 2 value vectors + 1 broadcast weight; 12 sums hide the FMA latency */
#define VALUE_VECS 2
#endif
#define KEY_TILE 32
#define FLOATS_PER_LINE 16
#define MAX_TILE_LANES 64 /* bounds the per-item stack arrays */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VEC * sizeof(int32_t))));
typedef uint8_t byte_vec __attribute__((vector_size(VEC)));
typedef int8_t signed_byte_vec __attribute__((vector_size(VEC)));

#include "kv_vectors.h"

#define MAX_SCORE_KEYS 8

/* A tile's scores laid out [key][query lane] (width lanes, a multiple of VEC; num_keys rows) turned into softmax
 * weights against each lane's running max, updating the running max and sum; correction: the factor each lane's
 * accumulator must be scaled by (0 on the first tile, while the max is -inf). */
static inline __attribute__((always_inline)) void softmax_down_lanes(float *scores, int num_keys, int width,
                                                                     float *max_w, float *sum_w,
                                                                     float *correction) {
    for (int lane = 0; lane < width; lane += VEC) {
        const vec old_max = load(max_w + lane);
        vec new_max = old_max;
        for (int t = 0; t < num_keys; t++) new_max = max_vec(load(scores + t * width + lane), new_max);
        const vec lane_correction = exp_nonpositive_vec(old_max - new_max); /* 0 on the first tile */
        vec sum = load(sum_w + lane) * lane_correction;
        for (int t = 0; t < num_keys; t++) {
            const vec weights = exp_nonpositive_vec(load(scores + t * width + lane) - new_max);
            store(scores + t * width + lane, weights);
            sum += weights;
        }
        store(max_w + lane, new_max);
        store(sum_w + lane, sum);
        store(correction + lane, lane_correction);
    }
}

/* The scores of keys t .. t + num_keys - 1 (num_keys <= MAX_SCORE_KEYS, fixed per call) against lane_vecs vectors
 * of transposed queries (lane_vecs <= SCORE_LANES), all lane_vecs x num_keys sums in registers: per element of the
 * keys, lane_vecs loads of queries feed lane_vecs x num_keys broadcast-FMAs. */
static inline __attribute__((always_inline)) void score_block(const int lane_vecs, const int num_keys,
                                                              const float *q_t, int width, const float *k_cache,
                                                              const int64_t *rows, float *scores, const int d) {
    vec s[MAX_SCORE_KEYS][SCORE_LANES];
    for (int j = 0; j < num_keys; j++)
        for (int l = 0; l < lane_vecs; l++) s[j][l] = (vec){0};
    for (int i = 0; i < d; i++) {
        vec q_i[SCORE_LANES];
        for (int l = 0; l < lane_vecs; l++) q_i[l] = load(q_t + i * width + l * VEC);
        for (int j = 0; j < num_keys; j++) {
            const float k_ji = k_cache[rows[j] + i];
            for (int l = 0; l < lane_vecs; l++) s[j][l] += k_ji * q_i[l];
        }
    }
    for (int j = 0; j < num_keys; j++)
        for (int l = 0; l < lane_vecs; l++) store(scores + j * width + l * VEC, s[j][l]);
}


typedef struct {
    float *out;                   /* [num_tokens, num_kv_heads * group, head_dim], rows out_row_stride apart */
    const float *q;               /* same shape, rows q_row_stride apart; heads head_dim apart */
    const void *k_cache;          /* [num_blocks, block_size, num_kv_heads, head_dim] values in the encoding */
    const void *v_cache;
    const void *k_params;         /* [num_blocks, block_size, num_kv_heads]: fp16 scale (+ int4's zero); NULL for RAW */
    const void *v_params;
    const int32_t *block_tables;  /* [num_chunks, block_table_stride] */
    const int32_t *seq_lens;      /* [num_chunks]: keys after the chunk (cached context + the chunk) */
    const int32_t *query_starts;  /* [num_chunks]: row of the chunk's first query in q and out */
    const int32_t *query_lens;    /* [num_chunks] */
    int64_t out_row_stride, q_row_stride, block_table_stride, num_blocks;
    int num_kv_heads, group, head_dim, block_size, window; /* window <= 0: no sliding window */
    int queries_per_tile;
    float scale;
    int encoding;
} PrefillArgs;

/* A work item: queries first_query .. first_query + num_queries - 1 of a chunk, one KV head. */
typedef struct {
    int chunk, kv_head, first_query, num_queries;
} Item;

/* A tile's key and value rows dequantized into k_tile and v_tile ([num_keys, d]), by the encoding's copy. */
static inline __attribute__((always_inline)) void dequantize_tile(const PrefillArgs *a, const int64_t *rows,
                                                                  int num_keys, float *k_tile, float *v_tile,
                                                                  const int d) {
#define DEQUANTIZE(E)                                                                                             \
    for (int t = 0; t < num_keys; t++) {                                                                          \
        dequantize_row(a->k_cache, a->k_params, rows[t], k_tile + t * d, d, E);                                   \
        dequantize_row(a->v_cache, a->v_params, rows[t], v_tile + t * d, d, E);                                   \
    }                                                                                                             \
    break;
    switch (a->encoding) {
    case INT8: DEQUANTIZE(INT8)
    case FP8: DEQUANTIZE(FP8)
    default: DEQUANTIZE(INT4)
    }
#undef DEQUANTIZE
}

/* Cache offsets (floats, to the item's KV head) of keys first .. first + num_keys - 1 of a block table; keys before
 * start (masked) read start's row. */
static inline void key_rows(const PrefillArgs *a, const int32_t *table, int first, int start, int num_keys,
                            int64_t head_offset, int64_t *rows) {
    const int64_t slot_stride = (int64_t)a->num_kv_heads * a->head_dim;
    const int skipped = first < start ? start - first : 0; /* masked keys before the window: start's row stands in
                                                              (their blocks may be freed), weighted 0 */
    int block = (first + skipped) / a->block_size, offset = (first + skipped) % a->block_size;
    for (int t = 0; t < num_keys; t++) {
        rows[t] = ((int64_t)table[block] * a->block_size + offset) * slot_stride + head_offset;
        if (t >= skipped && ++offset == a->block_size) offset = 0, block++;
    }
}

/* A tile's scores [key][lane] over all width lanes, SCORE_LANES vectors of lanes at a time. */
static inline __attribute__((always_inline)) void tile_scores(const float *q_t, int width, const float *k_cache,
                                                              const int64_t *rows, int num_keys, float *scores,
                                                              const int d) {
#define SCORE_BLOCKS(L)                                                                                           \
    {                                                                                                             \
        int t = 0;                                                                                                \
        for (; t + SCORE_KEYS <= num_keys; t += SCORE_KEYS)                                                       \
            score_block(L, SCORE_KEYS, q, width, k_cache, rows + t, out + t * width, d);                          \
        for (; t < num_keys; t++) score_block(L, 1, q, width, k_cache, rows + t, out + t * width, d);             \
        break;                                                                                                    \
    }
    for (int lane = 0; lane < width; lane += SCORE_LANES * VEC) {
        const float *q = q_t + lane;
        float *out = scores + lane;
        switch ((width - lane) / VEC) {
        case 1: SCORE_BLOCKS(1)
        case 2: SCORE_BLOCKS(2)
        default: SCORE_BLOCKS(3)
        }
    }
#undef SCORE_BLOCKS
}

/* -inf on the scores of keys a row may not see: later than its position (query_pos, per lane), or window or more
 * before it. Only tiles that reach past the item's first query position, or back past its last query's window,
 * need this. */
static inline void mask_tile(float *scores, int width, const int32_t *query_pos, int first_key, int num_keys,
                             int window) {
    const ivec no_window = (ivec){0} + (window > 0 ? 0 : -1); /* all ones: nothing is too old */
    for (int t = 0; t < num_keys; t++)
        for (int lane = 0; lane < width; lane += VEC) {
            ivec pos;
            memcpy(&pos, query_pos + lane, sizeof pos);
            const ivec key = (ivec){0} + (first_key + t);
            const ivec visible = (key <= pos) & ((key > pos - window) | no_window);
            const vec s = load(scores + t * width + lane);
            store(scores + t * width + lane, (vec)((visible & (ivec)s) | (~visible & (ivec)((vec){0} - INFINITY))));
        }
}

/* acc[r][j..j + num_vecs) = acc * correction + sum over the tile's keys of weight[t][r] * value row t, for
 * num_rows rows from first_lane, the sums in registers. */
static inline __attribute__((always_inline)) void value_block(const int num_rows, const int num_vecs, float *acc,
                                                              int j, const float *weights, int width,
                                                              int first_lane, const float *correction,
                                                              const float *v_cache, const int64_t *rows,
                                                              int num_keys, const int d) {
    vec sum[VALUE_ROWS][VALUE_VECS];
    for (int r = 0; r < num_rows; r++)
        for (int s = 0; s < num_vecs; s++)
            sum[r][s] = load(acc + (first_lane + r) * d + j + s * VEC) * correction[first_lane + r];
    for (int t = 0; t < num_keys; t++) {
        const float *v = v_cache + rows[t] + j;
        vec v_s[VALUE_VECS];
        for (int s = 0; s < num_vecs; s++) v_s[s] = load(v + s * VEC);
        for (int r = 0; r < num_rows; r++) {
            const float w = weights[t * width + first_lane + r];
            for (int s = 0; s < num_vecs; s++) sum[r][s] += w * v_s[s];
        }
    }
    for (int r = 0; r < num_rows; r++)
        for (int s = 0; s < num_vecs; s++) store(acc + (first_lane + r) * d + j + s * VEC, sum[r][s]);
}

/* value_block over the whole vectors of head_dim for num_rows rows from first_lane. */
static inline __attribute__((always_inline)) void value_rows(const int num_rows, float *acc, const float *weights,
                                                             int width, int first_lane, const float *correction,
                                                             const float *v_cache, const int64_t *rows,
                                                             int num_keys, const int d) {
    int j = 0;
    for (; j + VALUE_VECS * VEC <= d; j += VALUE_VECS * VEC)
        value_block(num_rows, VALUE_VECS, acc, j, weights, width, first_lane, correction, v_cache, rows, num_keys, d);
    for (; j + VEC <= d; j += VEC)
        value_block(num_rows, 1, acc, j, weights, width, first_lane, correction, v_cache, rows, num_keys, d);
}

/* acc = acc * correction + weights^T . values over all width lanes (a multiple of VEC, so of 2), VALUE_ROWS rows
 * at a time and then 2; the elements of head_dim past its last whole vector one by one. */
static inline __attribute__((always_inline)) void tile_values(float *acc, const float *weights, int width,
                                                              const float *correction, const float *v_cache,
                                                              const int64_t *rows, int num_keys, const int d) {
    int lane = 0;
    for (; lane + VALUE_ROWS <= width; lane += VALUE_ROWS)
        value_rows(VALUE_ROWS, acc, weights, width, lane, correction, v_cache, rows, num_keys, d);
    for (; lane < width; lane += 2)
        value_rows(2, acc, weights, width, lane, correction, v_cache, rows, num_keys, d);
    const int whole = d / VEC * VEC;
    for (lane = 0; lane < width && whole < d; lane++) {
        float *acc_lane = acc + lane * d;
        for (int i = whole; i < d; i++) acc_lane[i] *= correction[lane];
        for (int t = 0; t < num_keys; t++)
            for (int i = whole; i < d; i++) acc_lane[i] += weights[t * width + lane] * v_cache[rows[t] + i];
    }
}

/* Whether every block holding keys first .. last is inside the cache (a corrupt table must not make the
 * kernel read outside it). */
static int blocks_in_cache(const PrefillArgs *a, const int32_t *table, int first, int last) {
    for (int b = first / a->block_size; b <= last / a->block_size; b++)
        if (table[b] < 0 || table[b] >= a->num_blocks) return 0;
    return 1;
}

/* One work item; 0, or 1 if its keys lie in a block outside the cache (then nothing is written). */
static inline __attribute__((always_inline)) int attend_tile(const PrefillArgs *a, Item item, const int d) {
    const int group = a->group, num_lanes = item.num_queries * group;
    const int width = (num_lanes + VEC - 1) / VEC * VEC;
    const int seq_len = a->seq_lens[item.chunk], query_len = a->query_lens[item.chunk];
    const int first_pos = seq_len - query_len + item.first_query, last_pos = first_pos + item.num_queries - 1;
    const int start = a->window > 0 && first_pos - a->window + 1 > 0 ? first_pos - a->window + 1 : 0;
    const int32_t *table = a->block_tables + item.chunk * a->block_table_stride;
    if (!blocks_in_cache(a, table, start, last_pos)) return 1;
    /* Key tiles on a grid of KEY_TILE from key 0, whatever the item's first query: a row then sums its keys in the
     * same groups wherever its chunk was cut (so in any batch); the keys before start are masked. */
    const int first_tile_key = start - start % KEY_TILE;
    const int64_t head_offset = (int64_t)item.kv_head * d;

    float q_t[d * width], acc[width * d], scores[KEY_TILE * width];
    float row_max[width], row_sum[width], correction[width];
    int32_t query_pos[width]; /* the padding lanes take the last position: never all masked, never written */
    const int64_t first_row = a->query_starts[item.chunk] + item.first_query;
    memset(q_t, 0, sizeof q_t); /* the padding lanes score 0 and are never written out */
    for (int lane = 0; lane < num_lanes; lane++) {
        const float *q = a->q + (first_row + lane / group) * a->q_row_stride + head_offset * group + lane % group * d;
        for (int i = 0; i < d; i++) q_t[i * width + lane] = q[i] * a->scale;
    }
    for (int lane = 0; lane < width; lane++) {
        row_max[lane] = -INFINITY, row_sum[lane] = 0.0f;
        query_pos[lane] = lane < num_lanes ? first_pos + lane / group : last_pos;
    }
    memset(acc, 0, sizeof acc);

    int64_t rows[KEY_TILE], tile_rows[KEY_TILE];
    const int quantized = a->encoding != RAW;
    float k_tile[quantized ? KEY_TILE * d : 1], v_tile[quantized ? KEY_TILE * d : 1];
    for (int t = 0; t < KEY_TILE; t++) tile_rows[t] = (int64_t)t * d;
    const float *keys = quantized ? k_tile : a->k_cache, *values = quantized ? v_tile : a->v_cache;
    const int64_t *read_rows = quantized ? tile_rows : rows;
    for (int first_key = first_tile_key; first_key <= last_pos; first_key += KEY_TILE) {
        const int num_keys = last_pos + 1 - first_key < KEY_TILE ? last_pos + 1 - first_key : KEY_TILE;
        key_rows(a, table, first_key, start, num_keys, head_offset, rows);
        if (quantized) dequantize_tile(a, rows, num_keys, k_tile, v_tile, d);
        tile_scores(q_t, width, keys, read_rows, num_keys, scores, d);
        const int reaches_future = first_key + num_keys - 1 > first_pos;
        const int reaches_past_window = a->window > 0 && first_key <= last_pos - a->window;
        if (reaches_future || reaches_past_window)
            mask_tile(scores, width, query_pos, first_key, num_keys, a->window);
        softmax_down_lanes(scores, num_keys, width, row_max, row_sum, correction);
        tile_values(acc, scores, width, correction, values, read_rows, num_keys, d);
    }

    for (int lane = 0; lane < num_lanes; lane++) {
        float *out = a->out + (first_row + lane / group) * a->out_row_stride + head_offset * group + lane % group * d;
        const float inv_sum = 1.0f / row_sum[lane];
        for (int i = 0; i < d; i++) out[i] = acc[lane * d + i] * inv_sum;
    }
    return 0;
}

typedef int (*AttendFn)(const PrefillArgs *, Item);
#define HEAD_DIM_COPY(D) \
    static int attend_##D(const PrefillArgs *a, Item item) { return attend_tile(a, item, D); }
HEAD_DIM_COPY(64)
HEAD_DIM_COPY(128)
HEAD_DIM_COPY(256)
static int attend_any(const PrefillArgs *a, Item item) { return attend_tile(a, item, a->head_dim); }

/* The work items, the tiles holding the latest queries (the most keys) first; NULL when out of memory. */
static Item *plan_items(const PrefillArgs *a, int num_chunks, int *num_items) {
    const int per_tile = a->queries_per_tile;
    int num_tiles = 0, longest = 0;
    for (int c = 0; c < num_chunks; c++) {
        const int tiles = (a->query_lens[c] + per_tile - 1) / per_tile;
        num_tiles += tiles;
        longest = tiles > longest ? tiles : longest;
    }
    Item *items = malloc((size_t)num_tiles * a->num_kv_heads * sizeof(Item) + 1);
    if (!items) return NULL;
    int n = 0;
    for (int from_end = 0; from_end < longest; from_end++) /* round-robin over chunks, last tiles first */
        for (int c = 0; c < num_chunks; c++) {
            const int tiles = (a->query_lens[c] + per_tile - 1) / per_tile, tile = tiles - 1 - from_end;
            if (tile < 0) continue;
            const int first = tile * per_tile, rest = a->query_lens[c] - first;
            for (int h = 0; h < a->num_kv_heads; h++)
                items[n++] = (Item){c, h, first, rest < per_tile ? rest : per_tile};
        }
    *num_items = n;
    return items;
}

/* The number of query positions per work item: a whole number of vectors of lanes where the group allows,
 * about target_lanes lanes, at most MAX_TILE_LANES. */
int kvserve_paged_prefill_queries_per_tile(int group, int target_lanes) {
    int base = 1;
    while (base * group % VEC && base < VEC) base++;
    int tile = base * (target_lanes / (base * group) > 1 ? target_lanes / (base * group) : 1);
    while (tile > 1 && tile * group > MAX_TILE_LANES) tile--;
    return tile;
}

/* Causal attention of each chunk's queries over keys 0 .. seq_len - 1 of its sequence (the chunk's own keys
 * already written). Returns how many work items met a block id outside the cache's num_blocks (0 when all is
 * well), or -1 when memory for the plan could not be had. */
int kvserve_paged_prefill_f32(float *out, int64_t out_row_stride, const float *q, int64_t q_row_stride,
                              const void *k_cache, const void *v_cache, const void *k_params,
                              const void *v_params, int encoding, int64_t num_blocks,
                              const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                              const int32_t *query_starts, const int32_t *query_lens, int num_chunks,
                              int num_kv_heads, int group, int head_dim, int block_size, int window,
                              int queries_per_tile, float scale, int num_threads) {
    float *rotated = NULL; /* int4 keys are stored rotated: the queries are rotated alike */
    if (encoding == INT4) {
        int64_t num_rows = 0; /* through the last chunk's last query */
        for (int c = 0; c < num_chunks; c++)
            num_rows = query_starts[c] + query_lens[c] > num_rows ? query_starts[c] + query_lens[c] : num_rows;
        rotated = rotated_queries(q, q_row_stride, num_rows, num_kv_heads * group, head_dim);
        if (!rotated) return -1;
        q = rotated, q_row_stride = (int64_t)num_kv_heads * group * head_dim;
    }
    const PrefillArgs a = {out, q, k_cache, v_cache, k_params, v_params, block_tables, seq_lens, query_starts,
                           query_lens, out_row_stride, q_row_stride, block_table_stride, num_blocks, num_kv_heads,
                           group, head_dim, block_size, window, queries_per_tile, scale, encoding};
    const AttendFn attend_fn = head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128
                             : head_dim == 256 ? attend_256 : attend_any;
    int num_items = 0, num_bad = 0;
    Item *items = plan_items(&a, num_chunks, &num_items);
    if (items) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : num_bad)
        for (int i = 0; i < num_items; i++) num_bad += attend_fn(&a, items[i]);
    }
    free(items);
    free(rotated);
    return items ? num_bad : -1;
}
