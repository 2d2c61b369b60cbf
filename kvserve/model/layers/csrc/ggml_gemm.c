/* y = x W^T (+ bias) in fp32 over a weight kept in llama.cpp's (ggml's) quantized blocks: Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K.
 *
 * The block layouts, and their decoding into groups of GROUP = 32 quants with a scale d and an offset, are in
 * ggml_blocks.h; ggml_qdot.c is the faster path that quantizes x to int8 first (llama.cpp's numerics), this one
 * the exact one.
 *
 * Why: a decode step is bound by reading the weights, and these read 4.5 to 8.5 bits a weight where fp32 reads
 * 32. Each group is unpacked once into VEC-wide float vectors of its quants (bytes widened through 32-bit
 * integers: straight to floats gcc converts byte by byte, 3x slower), then every row of a tile of up to
 * TILE_ROWS rows of x takes d * (x . q) from it; the offset term (offset times the sum of x over the group)
 * uses sums of x computed once per call. A row's result does not depend on the other rows' values; its order of
 * summation does on their number (a tile of fewer rows spreads each row's groups over more sums, row_tile()).
 *
 * One row at a time the kernel is bound by its own instructions, not by the memory (Emerald Rapids reads 21 GB/s
 * on 2 threads; the kernel read Gemma 3's Q5_0 layers at 6): what is done once per group is what counts. Per
 * group now: no conversion and broadcast of its scale (a unit's 8 scales converted together, each read back by
 * its FMA's own broadcast), no offset term for Q4_0 / Q5_0 (centred quants), a K-quant block's 6-bit scales
 * unpacked in words, and on AVX-512 the quants widened once and split into nibbles in the lanes (quant_lanes);
 * per column one horizontal sum in registers, and the type and row count dispatched once per call. Measured
 * (Emerald Rapids, one thread, a 1024 x 1024 weight in cache, best of 5 alternations, ns a group of 32 before ->
 * after): AVX-512 Q4_0 3.6 -> 2.6, Q4_1 3.7 -> 2.3, Q5_0 6.1 -> 3.1, Q5_1 5.6 -> 3.5, Q8_0 2.9 -> 2.3, Q4_K
 * 4.5 -> 2.9, Q5_K 7.2 -> 3.7, Q6_K 7.4 -> 5.6; the AVX2 build 3.8 -> 3.2, 4.1 -> 3.1, 6.2 -> 5.4, 5.4 -> 4.4,
 * 3.5 -> 2.7, 4.8 -> 3.3, 7.1 -> 5.6, 8.9 -> 6.9. On the models' own weights from memory (2 threads, one row,
 * medians of 7 alternating passes): Gemma 3's layers and head 1.13-1.21x, SmolLM2's 1.15x (1.22x at 3 rows).
 *
 * Measured (2-core AMD EPYC Zen 2, AVX2), a 49152 x 576 weight: one row Q4_1 3.9 ms, Q8_0 3.4 ms, fp32 through
 * the small-GEMM panels 5.9 ms; 4 rows 6.9 / 6.5 / 6.4; 16 rows 28.5 / 27.0 / 12.8. Each row costs the kernel
 * the unpacking again per tile, the dense GEMMs nothing: from 5 rows (a second tile) the caller uses the dense layout
 * (GGML_MAX_ROWS in ggml.py; from 4 rows before the rewrite described above).
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "ggml_blocks.h"

#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8 /* one AVX2 register: a wider GNU vector is split and spilled */
#endif
#define TILE_ROWS 4 /* rows of x per pass over a weight row: 4 sums + 4 weight vectors + x in 16 registers */
#define PREFETCH_ROWS 8 /* how far ahead (weight rows) row_tile() asks for the blocks it will read */
#define COLUMN_RUNS 8   /* runs of columns per thread in the rows kernel */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A tree of vector adds, then of the last 4 lanes: a scalar loop over the lanes, once per output column, was
 * a tenth of a one-row step (the LM head has 262,144 columns on Gemma 3). */
static inline __attribute__((always_inline)) float hsum(vec v) {
#if VEC == 16 && defined(__AVX512F__)
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256((__m512)v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1)));
#elif VEC == 8 && defined(__AVX__)
    const __m256 half = (__m256)v;
#endif
#if (VEC == 16 && defined(__AVX512F__)) || (VEC == 8 && defined(__AVX__))
    const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
#else
    float lanes[VEC], s = 0.0f;
    memcpy(lanes, &v, sizeof lanes);
    for (int i = 0; i < VEC; i++) s += lanes[i];
    return s;
#endif
}

/* VEC of the 16 bytes (unsigned, or signed) from byte `first`, as floats: through 32-bit integers, which
 * compilers do in two instructions (straight to floats, gcc converts byte by byte). */
#if defined(__AVX512F__)
static inline vec widen(bytes16 q, int first, int is_signed) {
    (void)first;
    __m128i raw;
    memcpy(&raw, &q, 16);
    const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
    return (vec)_mm512_cvtepi32_ps(wide);
}
#elif defined(__AVX2__)
static inline vec widen(bytes16 q, int first, int is_signed) {
    __m128i raw;
    memcpy(&raw, &q, 16);
    if (first) raw = _mm_srli_si128(raw, 8);
    const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
    return (vec)_mm256_cvtepi32_ps(wide);
}
#else
static inline vec widen(bytes16 q, int first, int is_signed) {
    float lanes[VEC];
    for (int i = 0; i < VEC; i++) lanes[i] = is_signed ? (float)(int8_t)q[first + i] : (float)q[first + i];
    return load(lanes);
}
#endif

/* Q4_0 and Q5_0 store q + 8 and q + 16: their quants are centred here (w = d * q, no offset), so that the rows
 * kernel has no offset term for them; gguf's own dequantization is d * (stored - 8 / 16), the same products. */
static inline int centre_of(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0; }

/* The scale d and offset of each group of a block, as the quants of group_quants() take them. */
static inline __attribute__((always_inline)) void group_scales(const int type, const uint8_t *block,
                                                               float d[SUPER_GROUPS], float offset[SUPER_GROUPS]) {
    block_scales(type, block, d, offset);
    if (centre_of(type)) offset[0] = 0.0f;
}

#if VEC == 16 && defined(__AVX512F__)
#define QUANTS_IN_LANES
/* A group straight in 32-bit lanes: its bytes widened once, the low and the high nibbles then masked and shifted
 * in the lanes (not each run of bytes split, then widened on its own), and a fifth bit added under a lane mask
 * taken from the 32-bit qh itself (group_bytes spreads it over bytes with shuffles and compares): Q5_0's group
 * in half the time (the header's figures). */
static inline __m512i lanes_of(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* Group g's quants of a type of nibbles (every type but Q8_0) as two vectors of 16 int32 (k order), centred for
 * Q4_0 and Q5_0, Q6_K's less 32 and not yet times its scales. */
static inline __attribute__((always_inline)) void quant_lanes(const int type, const uint8_t *block, int g,
                                                               __m512i q[2]) {
    const __m512i low = _mm512_set1_epi32(15);
    if (type == Q4_K || type == Q5_K) { /* groups 2i and 2i + 1: the low and high nibbles of the same 32 bytes */
        const uint8_t *nibbles = block + (type == Q5_K ? 48 : 16) + 32 * (g / 2);
        for (int h = 0; h < 2; h++) {
            const __m512i raw = lanes_of(nibbles + 16 * h);
            q[h] = g % 2 ? _mm512_srli_epi32(raw, 4) : _mm512_and_si512(raw, low);
            if (type == Q5_K) { /* bit g of each of 32 bytes */
                const __mmask16 fifth = _mm512_test_epi32_mask(lanes_of(block + 16 + 16 * h), _mm512_set1_epi32(1 << g));
                q[h] = _mm512_mask_add_epi32(q[h], fifth, q[h], _mm512_set1_epi32(16));
            }
        }
        return;
    }
    if (type == Q6_K) { /* see group_bytes: low nibbles of 32 bytes, bits 2 (g % 4) of 32 more, minus 32 */
        const uint8_t *nibbles = block + 64 * (g / 4) + 32 * (g % 2), *high = block + 128 + 32 * (g / 4);
        for (int h = 0; h < 2; h++) {
            const __m512i raw = lanes_of(nibbles + 16 * h), top = lanes_of(high + 16 * h);
            const __m512i quant = g % 4 < 2 ? _mm512_and_si512(raw, low) : _mm512_srli_epi32(raw, 4);
            const __m512i top_bits = _mm512_and_si512(_mm512_srli_epi32(top, 2 * (g % 4)), _mm512_set1_epi32(3));
            q[h] = _mm512_sub_epi32(_mm512_or_si512(quant, _mm512_slli_epi32(top_bits, 4)), _mm512_set1_epi32(32));
        }
        return;
    }
    const int has_qh = type == Q5_0 || type == Q5_1, has_min = type == Q4_1 || type == Q5_1;
    const __m512i raw = lanes_of(block + 2 + 2 * has_min + 4 * has_qh);
    q[0] = _mm512_and_si512(raw, low), q[1] = _mm512_srli_epi32(raw, 4);
    if (type == Q4_0) {
        for (int h = 0; h < 2; h++) q[h] = _mm512_sub_epi32(q[h], _mm512_set1_epi32(8));
    } else if (has_qh) {
        uint32_t qh;
        memcpy(&qh, block + 2 + 2 * has_min, 4);
        const __m512i sixteen = _mm512_set1_epi32(16);
        /* Q5_0 centred: stored - 16 is the nibble where the fifth bit is set, the nibble - 16 where not (the
         * bits inverted in a general register, not in the mask registers) */
        const uint32_t bits = type == Q5_0 ? ~qh : qh;
        for (int h = 0; h < 2; h++) {
            const __mmask16 lanes = _cvtu32_mask16(bits >> 16 * h & 0xffff);
            q[h] = type == Q5_0 ? _mm512_mask_sub_epi32(q[h], lanes, q[h], sixteen)
                                : _mm512_mask_add_epi32(q[h], lanes, q[h], sixteen);
        }
    }
}
#endif

/* Group g of a block as GROUP / VEC float vectors (k order): its quants (Q4_0, Q5_0: centred), and for Q6_K
 * times their int8 scale (an exact product), so that every type's group is d * q + offset. */
static inline __attribute__((always_inline)) void group_quants(const int type, const uint8_t *block, int g,
                                                               vec q[GROUP / VEC]) {
#ifdef QUANTS_IN_LANES
    if (type != Q8_0) {
        __m512i lanes[2];
        quant_lanes(type, block, g, lanes);
        for (int h = 0; h < 2; h++) q[h] = (vec)_mm512_cvtepi32_ps(lanes[h]);
        if (type == Q6_K)
            for (int h = 0; h < 2; h++) q[h] *= (float)group_scales16(block, g)[h];
        return;
    }
#endif
    bytes16 half[2];
    int is_signed = group_bytes(type, block, g, half);
    if (centre_of(type)) { /* as int8: stored - centre, in -16 .. 15 */
        half[0] -= (uint8_t)centre_of(type), half[1] -= (uint8_t)centre_of(type);
        is_signed = 1;
    }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 16 / VEC; j++) q[h * (16 / VEC) + j] = widen(half[h], j * VEC, is_signed);
    if (type == Q6_K) {
        const int8_t *scales = group_scales16(block, g);
        for (int j = 0; j < GROUP / VEC; j++) q[j] *= (float)scales[j * VEC / 16];
    }
}

typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));

static inline int32_t word_at(const uint8_t *p) {
    int32_t word;
    memcpy(&word, p, sizeof word);
    return word;
}

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x's GROUP values at xg times a group's quants, in lanes (the caller scales and sums them). */
static inline __attribute__((always_inline)) vec group_dot(const float *xg, const vec q[GROUP / VEC]) {
    vec dot = load(xg) * q[0];
    for (int j = 1; j < GROUP / VEC; j++) dot += load(xg + j * VEC) * q[j];
    return dot;
}

/* The scales and offsets of 8 consecutive blocks of a one-group type, as group_scales() gives each: their fp16
 * fields read, then converted together (one at a time, a conversion and a broadcast per group were a sixth
 * of a Q5_0 group's work). */
static inline __attribute__((always_inline)) void eight_blocks_scales(const int type, const uint8_t *first,
                                                                      float d[8], float offset[8]) {
    const int block_bytes = block_bytes_of(type), has_min = type == Q4_1 || type == Q5_1;
#if defined(__AVX2__) && defined(__F16C__)
    /* each block's first 4 bytes: d, then the minimum (or qh's first bytes); the low and the high fp16 words of
     * the 8 lanes packed into the low half of a register, then converted. The 8 words loaded one by one, not
     * gathered: AMD's gather is microcoded (Zen 5, a Q4_1 group in cache 1.34 -> 1.17 ns, the AVX2 build 1.99 ->
     * 1.79; SmolLM2's Q4_1 layers from memory 3.42 -> 3.31 ms, the AVX2 build 4.75 -> 4.33) */
    const __m256i fields = _mm256_setr_epi32(word_at(first), word_at(first + block_bytes),
                                             word_at(first + 2 * block_bytes), word_at(first + 3 * block_bytes),
                                             word_at(first + 4 * block_bytes), word_at(first + 5 * block_bytes),
                                             word_at(first + 6 * block_bytes), word_at(first + 7 * block_bytes));
    const __m256i low_words = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i d_words = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(fields, low_words), 0x08);
    _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm256_castsi256_si128(d_words)));
    if (has_min) {
        const __m256i min_words = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_srli_epi32(fields, 16), low_words), 0x08);
        _mm256_storeu_ps(offset, _mm256_cvtph_ps(_mm256_castsi256_si128(min_words)));
    } else {
        _mm256_storeu_ps(offset, _mm256_setzero_ps());
    }
#else
    for (int i = 0; i < 8; i++) {
        d[i] = half_to_float(first + i * block_bytes);
        offset[i] = has_min ? half_to_float(first + i * block_bytes + 2) : 0.0f;
    }
#endif
}

/* y[r] = sum over groups of d * (x_r . q) + offset * (sum of x_r over the group), for ROWS rows of x against
 * one weight row: each block's scales and each group are unpacked once for all the rows. The weight row goes
 * in units of 8 groups (a K-quant block, or 8 blocks of a one-group type) whose scales and offsets are decoded
 * together, and whose offset terms are one product of 8 lanes with x_sums; the blocks of a one-group type past
 * the last whole unit go one at a time. */
static inline __attribute__((always_inline)) void row_tile(const int type, const int rows, const float *x,
                                                           int64_t x_stride, const float *x_sums, int num_groups,
                                                           const uint8_t *weight_row, const uint8_t *ahead,
                                                           float out[TILE_ROWS]) {
    const int block_bytes = block_bytes_of(type), groups = block_groups(type);
    const int unit_blocks = groups == 1 ? 8 : 1, unit_bytes = unit_blocks * block_bytes;
    const int has_offset = type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K;
    /* a row's groups go in turn to TILE_ROWS / rows sums (as many sums as a full tile holds): with one sum a row,
     * each group waits for the last group's FMA (4 cycles), which bound one-row Q8_0 steps. Gemma 3's file, one
     * row, 2 threads, Zen 5, medians of 7 alternating passes in two runs: the Q8_0 head 33 -> 42-50 GB/s,
     * all of it 8.59 -> 6.71 and 9.04 -> 7.58 ms; 2 rows 8.77 -> 7.90; the AVX2 build's Q8_0 1.07x; the nibble
     * types, bound by their unpacking, level (docs/results/session28-zen5) */
    const int chains = TILE_ROWS / rows;
    vec sum[TILE_ROWS][TILE_ROWS];
    vec8 unit_offsets[TILE_ROWS]; /* each lane one group of a unit's eight */
    float offsets[TILE_ROWS];
    for (int r = 0; r < rows; r++) {
        for (int chain = 0; chain < chains; chain++) sum[chain][r] = (vec){0};
        unit_offsets[r] = (vec8){0}, offsets[r] = 0.0f;
    }
    int group = 0;
    for (; group + 8 <= num_groups; group += 8) {
        const uint8_t *unit = weight_row + (int64_t)group / groups * block_bytes;
        /* the unpacking is compute-bound: unasked, the memory reads wait for it instead of overlapping it; a
         * unit at a time, as a burst of prefetches is dropped. Measured on Gemma 3's and SmolLM2's own weights
         * (one row, 2 threads, Emerald Rapids): Q8_0 1.24-1.34x, Q4_1 1.10x, Q5_0 1.05-1.11x, Q4_K 1.08-1.11x,
         * and Q6_K 0.69-0.75x, which is therefore not asked for. Into every cache level (T0), 8 weight rows
         * ahead, not past the others (NTA) 4 ahead: Gemma 3's layers 1.11x and head 1.20x, SmolLM2's layers
         * 1.15x (medians of 9 alternating passes; the AVX2 build's Gemma layers 1.09x) */
        if (type != Q6_K)
            for (int line = 0; line < unit_bytes; line += 64)
                __builtin_prefetch(ahead + (unit - weight_row) + line, 0, 3);
        float d[SUPER_GROUPS], offset[SUPER_GROUPS];
        if (groups == 1)
            eight_blocks_scales(type, unit, d, offset);
        else
            group_scales(type, unit, d, offset);
        /* each group's scale read back from memory, broadcast by the load itself: held in a register, gcc moves
         * each lane out to broadcast it, two shuffles a group on the port the unpacking needs */
        const float *scale = d;
        __asm__("" : "+r"(scale) : : "memory");
#pragma GCC unroll 8 /* constant group numbers: the quants' bit positions become immediate shifts */
        for (int g = 0; g < SUPER_GROUPS; g++) {
            vec q[GROUP / VEC];
            if (groups == 1)
                group_quants(type, unit + g * block_bytes, 0, q);
            else
                group_quants(type, unit, g, q);
            for (int r = 0; r < rows; r++)
                sum[g % chains][r] += scale[g] * group_dot(x + r * x_stride + (group + g) * GROUP, q);
        }
        if (has_offset)
            for (int r = 0; r < rows; r++)
                unit_offsets[r] += load8(offset) * load8(x_sums + r * num_groups + group);
    }
    for (; group < num_groups; group++) { /* one-group types only: k is a whole number of K-quant blocks */
        const uint8_t *block = weight_row + (int64_t)group * block_bytes;
        float d[SUPER_GROUPS], offset[SUPER_GROUPS];
        group_scales(type, block, d, offset);
        vec q[GROUP / VEC];
        group_quants(type, block, 0, q);
        for (int r = 0; r < rows; r++) {
            sum[0][r] += d[0] * group_dot(x + r * x_stride + group * GROUP, q);
            if (has_offset) offsets[r] += offset[0] * x_sums[r * num_groups + group];
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int chain = 1; chain < chains; chain++) sum[0][r] += sum[chain][r];
        const vec8 o = unit_offsets[r];
        out[r] = hsum(sum[0][r]) + (((o[0] + o[4]) + (o[1] + o[5])) + ((o[2] + o[6]) + (o[3] + o[7])) + offsets[r]);
    }
}

/* y's columns c0 .. c1 (rows y_stride apart) for `rows` rows of x: every weight row (one column) read once for
 * all of them. */
static inline __attribute__((always_inline)) void row_tiles(const int type, const int rows, const float *x,
                                                            int64_t x_stride, const float *x_sums, int num_groups,
                                                            const uint8_t *weight, int64_t row_bytes, int n, int c0,
                                                            int c1, const float *bias, float *y, int64_t y_stride) {
    for (int c = c0; c < c1; c++) {
        /* the last rows ask for their own blocks again: never past the weight */
        const uint8_t *ahead = weight + (int64_t)(c + PREFETCH_ROWS < n ? c + PREFETCH_ROWS : c) * row_bytes;
        float out[TILE_ROWS];
        row_tile(type, rows, x, x_stride, x_sums, num_groups, weight + (int64_t)c * row_bytes, ahead, out);
        for (int r = 0; r < rows; r++) y[r * y_stride + c] = out[r] + (bias ? bias[c] : 0.0f);
    }
}

/* row_tiles() with the type and the row count compile-time constants: dispatched once per call and row tile,
 * not per column. */
static void row_tiles_of(int type, int rows, const float *x, int64_t x_stride, const float *x_sums,
                         int num_groups, const uint8_t *weight, int64_t row_bytes, int n, int c0, int c1,
                         const float *bias, float *y, int64_t y_stride) {
#define CASE(t, m)                                                                                                \
    if (type == t && rows == m) {                                                                                 \
        row_tiles(t, m, x, x_stride, x_sums, num_groups, weight, row_bytes, n, c0, c1, bias, y, y_stride);        \
        return;                                                                                                   \
    }
#define TYPE(t) CASE(t, 1) CASE(t, 2) CASE(t, 3) CASE(t, 4)
    TYPE(Q4_0) TYPE(Q4_1) TYPE(Q5_0) TYPE(Q5_1) TYPE(Q8_0) TYPE(Q4_K) TYPE(Q5_K) TYPE(Q6_K)
#undef TYPE
#undef CASE
}

/* y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart) times W [n, k] in blocks of `type` (rows
 * row_bytes apart), plus bias (NULL: none). k must be a multiple of the type's block (32 or 256 values).
 * Returns 0, or -1 for a type it does not read or a failed allocation (nothing written then). */
int kvserve_ggml_gemm_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, const uint8_t *weight,
                          int64_t row_bytes, int type, const float *bias, int m, int n, int k, int num_threads) {
    if (row_bytes_of(type, k) == 0 || row_bytes < row_bytes_of(type, k)) return -1;
    const int num_groups = k / GROUP;
    float *x_sums = malloc((size_t)m * num_groups * sizeof(float) + 1);
    if (!x_sums) return -1;
    for (int i = 0; i < m; i++)
        for (int g = 0; g < num_groups; g++) {
            float s = 0.0f;
            for (int j = 0; j < GROUP; j++) s += x[i * x_stride + g * GROUP + j];
            x_sums[i * num_groups + g] = s;
        }
#pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int c0 = (int)((int64_t)n * t / threads), c1 = (int)((int64_t)n * (t + 1) / threads);
        for (int i = 0; i < m; i += TILE_ROWS)
            row_tiles_of(type, m - i < TILE_ROWS ? m - i : TILE_ROWS, x + i * x_stride, x_stride,
                         x_sums + i * num_groups, num_groups, weight, row_bytes, n, c0, c1, bias, y + i * y_stride,
                         y_stride);
    }
    free(x_sums);
    return 0;
}

/* One block's values, d * q + offset per group, into out. */
static inline __attribute__((always_inline)) void dequantize_block(const int type, const uint8_t *block,
                                                                   float *out) {
    float d[SUPER_GROUPS], offset[SUPER_GROUPS];
    group_scales(type, block, d, offset);
    for (int g = 0; g < block_groups(type); g++) {
        vec q[GROUP / VEC];
        group_quants(type, block, g, q);
        for (int j = 0; j < GROUP / VEC; j++) {
            const vec values = d[g] * q[j] + offset[g];
            memcpy(out + g * GROUP + j * VEC, &values, sizeof values);
        }
    }
}

/* The k values of one weight row, block by block (the type a constant in each call). */
static void decode_row(int type, const uint8_t *row, int k, float *out) {
    const int block_bytes = block_bytes_of(type), block_values = GROUP * block_groups(type);
    for (int b = 0; b < k / block_values; b++) {
        const uint8_t *block = row + (int64_t)b * block_bytes;
        switch (type) {
        case Q4_0: dequantize_block(Q4_0, block, out + b * block_values); break;
        case Q4_1: dequantize_block(Q4_1, block, out + b * block_values); break;
        case Q5_0: dequantize_block(Q5_0, block, out + b * block_values); break;
        case Q5_1: dequantize_block(Q5_1, block, out + b * block_values); break;
        case Q8_0: dequantize_block(Q8_0, block, out + b * block_values); break;
        case Q4_K: dequantize_block(Q4_K, block, out + b * block_values); break;
        case Q5_K: dequantize_block(Q5_K, block, out + b * block_values); break;
        default: dequantize_block(Q6_K, block, out + b * block_values); break;
        }
    }
}

/* out [n, k] = the fp32 values of W [n, k] in blocks of `type` (rows row_bytes apart): d * q + offset, in
 * fp32 as gguf's reference computes them (up to the rounding of a fused multiply-add). For the dense layouts
 * of larger steps, at load. Returns 0, or -1 for a type it does not read. */
int kvserve_ggml_dequantize(float *out, const uint8_t *weight, int64_t row_bytes, int type, int n, int k,
                            int num_threads) {
    if (row_bytes_of(type, k) == 0 || row_bytes < row_bytes_of(type, k)) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < n; c++) decode_row(type, weight + (int64_t)c * row_bytes, k, out + (int64_t)c * k);
    return 0;
}

/* Whether this build multiplies a one-row step faster on Q8_0 blocks than on blocks of `type`, which
 * kvserve_ggml_as_q8_0() then converts at load. Only Q5_0 on builds without AVX-512: there its group is unpacked
 * a byte at a time (fifth bits spread by shuffles and compares, each run of 16 bytes widened on its own), and a
 * Q8_0 group is four widenings. Measured on Gemma 3's 81 Q5_0 tensors from memory (one row, 2 threads, Zen 4,
 * medians of 9 alternating passes): the AVX2 build 3.34 ms as Q5_0 against 2.41 as Q8_0, though Q8_0 reads 1.55x
 * the bytes; the AVX-512 build, which builds a Q5_0 group in its lanes (quant_lanes), 2.20 against 2.65. Q4_0, as
 * cheap to unpack as Q8_0, gained only 1.10x for twice the bytes: not converted. */
int kvserve_ggml_prefers_q8_0(int type) {
#ifdef QUANTS_IN_LANES
    (void)type;
    return 0;
#else
    return type == Q5_0;
#endif
}

/* out [n, k / 32 blocks of 34 bytes] = W [n, k] in Q5_0 blocks as Q8_0 blocks of the same values: each block's
 * fp16 d as it is, each quant less its centre 16 as an int8 (-16 .. 15), so that d * q is the same product in
 * every kernel. Returns 0, or -1 for another type. */
int kvserve_ggml_as_q8_0(uint8_t *out, const uint8_t *weight, int64_t row_bytes, int type, int n, int k,
                         int num_threads) {
    if (type != Q5_0 || row_bytes_of(type, k) == 0 || row_bytes < row_bytes_of(type, k)) return -1;
    const int block_bytes = block_bytes_of(type), blocks = k / GROUP, out_bytes = block_bytes_of(Q8_0);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < n; c++)
        for (int b = 0; b < blocks; b++) {
            const uint8_t *block = weight + (int64_t)c * row_bytes + (int64_t)b * block_bytes;
            uint8_t *converted = out + ((int64_t)c * blocks + b) * out_bytes;
            bytes16 half[2];
            group_bytes(type, block, 0, half);
            for (int h = 0; h < 2; h++) half[h] -= (uint8_t)centre_of(type);
            memcpy(converted, block, 2);
            memcpy(converted + 2, half, sizeof half);
        }
    return 0;
}

/* Steps of more rows: the strips kernel. STRIP weight rows at a time are decoded into fp32 (a strip, in a
 * thread's buffer), and every row of x takes its dot products with them, the rows of x across the vector lanes
 * (x transposed once per call, in passes of rows, so a k's values of VEC rows are one load) and each weight value
 * broadcast: ROW_VECS x STRIP sums in registers, a strip decoded once per pass of rows. Each output is one chain
 * of FMAs over k in order: a row's result does not depend on the other rows of the step. The kernel decodes
 * every weight at least once per call, which the dense panels (small_gemm.c) never do: it serves steps where no
 * dense copy is kept (--load-format mmap), from 9 rows up (the rows kernel's cost grows with the rows; this
 * one's is flat up to a vector of rows); ggml.py states the measured crossovers. */
#if defined(__AVX512F__)
#define STRIP 12 /* 2 x 12 sums + 2 vectors of x of the 32 registers; each broadcast folds into its FMA */
#else
/* 2 x 6 sums + 2 vectors of x + 1 broadcast of the 16 registers. Strips of 4 took 1.06x the time at 12 and 16
 * rows, 1.09x at 64 and 256 (SmolLM2's file with no dense copy, Zen 5 forced to AVX2, gguf_kernels.py --batched) */
#define STRIP 6
#endif
#define ROW_VECS 2

/* y[rows, cols] for ROW_VECS * VEC rows (of which num_rows are real) of xt [k, width] against a decoded strip
 * [STRIP, k] (rows past num_cols are zeros), pulling num_lines cache lines from `ahead` toward the cache on the
 * way, spread over the k loop (a burst of prefetches is dropped). */
static inline __attribute__((always_inline)) void strip_tile(const int vecs, const float *xt, int width,
                                                             const float *strip, int k, float *y, int64_t y_stride,
                                                             int num_rows, int num_cols, const float *bias,
                                                             const uint8_t *ahead, int num_lines) {
    vec sum[ROW_VECS][STRIP];
    int owed = 0; /* in units of 1 / k lines */
#pragma GCC unroll 2
    for (int i = 0; i < vecs; i++)
#pragma GCC unroll 12
        for (int j = 0; j < STRIP; j++) sum[i][j] = (vec){0};
    for (int kk = 0; kk < k; kk++) {
        for (owed += num_lines; owed >= k; owed -= k, ahead += 64) __builtin_prefetch(ahead, 0, 3);
        vec xv[ROW_VECS];
#pragma GCC unroll 2
        for (int i = 0; i < vecs; i++) xv[i] = load(xt + (int64_t)kk * width + i * VEC);
#pragma GCC unroll 12
        for (int j = 0; j < STRIP; j++) {
            const float w = strip[(int64_t)j * k + kk];
#pragma GCC unroll 2
            for (int i = 0; i < vecs; i++) sum[i][j] += xv[i] * w;
        }
    }
    for (int j = 0; j < num_cols; j++)
        for (int i = 0; i < vecs; i++) {
            float lanes[VEC];
            memcpy(lanes, &sum[i][j], sizeof lanes);
            for (int l = 0; l < VEC && i * VEC + l < num_rows; l++)
                y[(int64_t)(i * VEC + l) * y_stride + j] = lanes[l] + (bias ? bias[j] : 0.0f);
        }
}

/* Columns a thread's strips put in a buffer before they go to y, a run of each row at a time. Straight to y, a
 * strip's outputs are one short run in each row of x, and y's rows are often a multiple of 4 KiB apart (3,072
 * columns: 12 KiB), so that every run falls in the same set of the L1 cache and evicts the strip and x from it.
 * One step's GEMMs of SmolLM2 with no dense copy at 32 rows (cpu_gemm.py's `mapped`, Zen 5): 37.8 -> 24.7 ms;
 * gate and up alone (3,072 x 576, in cache) 512 -> 271 us, where 3,000 columns took 289 before. */
#define BUFFERED_COLUMNS (16 * STRIP)

/* x goes to the strips transposed, in passes of rows: pass p holds rows p * width .. (p + 1) * width - 1 as
 * [k, width], its rows zero past m. A pass is as many rows as keep it within PASS_BYTES (in L2), so that the next
 * strip finds it there; a strip is decoded again for each further pass. One [k, m] block for every row, as
 * before, held k rows of m values apart: at 1,024 rows 4 KiB, so that a tile's k values of x all fell in a few
 * sets of L1 and L2 and came from L3 (the AVX2 build's GEMMs of SmolLM2 at 1,024 rows took 3.2x their time at
 * 512, down 576 x 1,536 alone 4x). */
#define PASS_BYTES (256 * 1024)

typedef struct {
    float *xt;       /* [passes, k, width] */
    int width, passes;
} Passes;

/* x [m, k] (rows x_stride apart) in passes; xt NULL if it cannot be allocated. */
static Passes passes_of(const float *x, int64_t x_stride, int m, int k, int num_threads) {
    const int tile = ROW_VECS * VEC, fitting = PASS_BYTES / ((int)sizeof(float) * k) / tile * tile;
    const int m_pad = (m + VEC - 1) / VEC * VEC, pass_rows = fitting > tile ? fitting : tile;
    Passes p = {NULL, m_pad < pass_rows ? m_pad : pass_rows, 0};
    p.passes = (m + p.width - 1) / p.width;
    p.xt = aligned_alloc(64, ((size_t)p.passes * k * p.width * sizeof(float) + 63) / 64 * 64);
    if (!p.xt) return p;
    /* a line of x (16 values of k) at a time */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int k0 = 0; k0 < k; k0 += 16)
        for (int r = 0; r < p.passes * p.width; r++) {
            float *column = p.xt + ((int64_t)(r / p.width) * k * p.width + r % p.width);
            for (int kk = k0; kk < k0 + 16 && kk < k; kk++)
                column[(int64_t)kk * p.width] = r < m ? x[(int64_t)r * x_stride + kk] : 0.0f;
        }
    return p;
}

/* Strips c0 .. c1 - 1 of y [m, n] (rows y_stride apart) against x's passes: each decoded into strip [STRIP, k]
 * once per pass, its outputs gathered in out [m, BUFFERED_COLUMNS]. */
static void strips_of(float *y, int64_t y_stride, const Passes *x, const uint8_t *weight, int64_t row_bytes,
                      int type, const float *bias, int m, int n, int k, int c0, int c1, float *strip, float *out) {
    const int end = c1 * STRIP < n ? c1 * STRIP : n;
    for (int first = c0 * STRIP; first < end; first += BUFFERED_COLUMNS) {
        const int cols = end - first < BUFFERED_COLUMNS ? end - first : BUFFERED_COLUMNS;
        for (int pass = 0; pass < x->passes; pass++) {
            const float *xt = x->xt + (int64_t)pass * k * x->width;
            const int pass_first = pass * x->width, pass_end = m - pass_first < x->width ? m : pass_first + x->width;
            for (int c = 0; c < cols; c += STRIP) {
                const int num_cols = cols - c < STRIP ? cols - c : STRIP;
                for (int j = 0; j < num_cols; j++)
                    decode_row(type, weight + (int64_t)(first + c + j) * row_bytes, k, strip + (int64_t)j * k);
                const float *b = bias ? bias + first + c : NULL;
                /* the next strip's blocks, asked for while this one's first tile works: unasked, the reads wait
                 * for the FMAs. SmolLM2's file (gguf_kernels.py --batched, Zen 5, 2 threads): 16 rows 19.1 ->
                 * 16.1 ms, 64 rows 46.5 -> 42.3; the AVX2 build 26.0 -> 22.7, 79.5 -> 76.1. Two strips ahead was
                 * no better */
                const int next = first + c + STRIP, next_rows = end - next < STRIP ? end - next : STRIP;
                const uint8_t *ahead = weight + (int64_t)next * row_bytes;
                int num_lines = next_rows > 0 ? (int)((next_rows * row_bytes + 63) / 64) : 0;
                for (int r = pass_first; r < pass_end; r += ROW_VECS * VEC) {
                    float *o = out + (int64_t)r * BUFFERED_COLUMNS + c;
                    const float *xr = xt + (r - pass_first);
                    if (pass_end - r > VEC)
                        strip_tile(2, xr, x->width, strip, k, o, BUFFERED_COLUMNS, pass_end - r, num_cols, b, ahead,
                                   num_lines);
                    else
                        strip_tile(1, xr, x->width, strip, k, o, BUFFERED_COLUMNS, pass_end - r, num_cols, b, ahead,
                                   num_lines);
                    num_lines = 0;
                }
            }
        }
        for (int r = 0; r < m; r++)
            memcpy(y + (int64_t)r * y_stride + first, out + (int64_t)r * BUFFERED_COLUMNS, cols * sizeof(float));
    }
}

/* kvserve_ggml_gemm_f32()'s product by the strips kernel, for steps of more rows (the rows of a strip past n,
 * the last strip's, hold earlier weights: their sums are computed and never stored). */
int kvserve_ggml_gemm_strips_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride,
                                 const uint8_t *weight, int64_t row_bytes, int type, const float *bias, int m, int n,
                                 int k, int num_threads) {
    if (row_bytes_of(type, k) == 0 || row_bytes < row_bytes_of(type, k)) return -1;
    const Passes passes = passes_of(x, x_stride, m, k, num_threads);
    if (!passes.xt) return -1;
    const int num_strips = (n + STRIP - 1) / STRIP;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        float *strip = calloc((size_t)STRIP * k, sizeof(float));
        float *out = malloc((size_t)m * BUFFERED_COLUMNS * sizeof(float));
        if (strip && out)
            strips_of(y, y_stride, &passes, weight, row_bytes, type, bias, m, n, k,
                      (int)((int64_t)num_strips * t / threads), (int)((int64_t)num_strips * (t + 1) / threads), strip,
                      out);
        else
#pragma omp atomic write
            failed = 1;
        free(strip);
        free(out);
    }
    free(passes.xt);
    return failed ? -1 : 0;
}
