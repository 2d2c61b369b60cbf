/* y = x W^T (+ bias) over a weight kept in ggml's quantized blocks (layouts in ggml_blocks.h), with x quantized
 * to int8 first, as llama.cpp does: each row of x in blocks of GROUP values, an int8 code per value and an fp32
 * scale per block,
 *
 *     dx = max |x| / 127,   qx = x * (1 / dx) rounded half to even,   sx = dx * sum(qx)   (dx = 0: qx = 0),
 *
 * then each weight group (a scale d, an offset, 32 quants qw) adds
 *
 *     d * dx * (qw . qx)  +  offset * sx          (Q6_K: qw . qx is the sum of its two runs of 16, each times its
 *                                                  int8 scale; its offset is 0)
 *
 * which is exactly (dequantized W) . (dx * qx): the result is that of x's quantized values, up to the order of
 * fp32 sums (kvserve/model/layers/ggml_qdot.py's twin quantizes x the same way, bit for bit). Each |x - dx qx|
 * <= dx / 2, which bounds the difference from the exact fp32 kernel (ggml_gemm.c) by sum |w| * dx / 2.
 *
 * Why: the exact kernel widens every quant to fp32 and spends its time on that and on the FMAs (~6 GB/s of
 * blocks on one Zen 2 core), where a decode step should be bound by reading the weights. Here a group's 32
 * quants stay bytes in one 256-bit register, and its dot with a row's codes is two instructions
 * (_mm256_maddubs_epi16: unsigned weight bytes times signed codes, pairs summed to int16; _mm256_madd_epi16 to
 * int32 lanes; a signed weight type takes its sign off the weight onto the codes first), then one conversion
 * and one FMA by d * dx per group and row; AVX-512 VNNI / AVX-VNNI do the first two in one
 * (_mm256_dpbusd_epi32). No overflow: a pair is at most 2 * 128 * 127 < 2^15, and Q6_K's pairs times its
 * scales at most 2 * 8128 * 128 < 2^31. A tile of TILE_COLS weight rows times up to TILE_ROWS rows of x keeps
 * independent FMA chains in flight (one chain would wait on the FMA's latency every group); threads split the
 * columns.
 *
 * Measured (2-core AMD EPYC Zen 2, AVX2, one thread: the other core and a half were busy with other jobs, so only
 * same-run ratios hold), one decode step's GEMMs of SmolLM2-135M (layers Q4_1, head Q8_0; benchmarks/cpu_gemm.py
 * --threads 1): 1 token 32.7 ms against 61.4 ms for the exact kernel and 62.6 ms for the dense fp32 panels; 2
 * tokens 54.5 / 55.1 / 64.7; 3 tokens 61.6 / 76.9 / 64.1; 4 tokens 91.3 / 93.1 / 61.8; 16 tokens 219.5 / 240.2 /
 * 153.6. A row costs about as much as the first (the integer dot, its conversion and FMA per group and row
 * dominate once the unpacking is shared): then from 4 rows up the caller used the dense layout (now 5: QDOT_MAX_ROWS in
 * ggml_qdot.py), which is why the dense copies stay (16 streams would take 1.4x to 1.8x longer on blocks alone).
 *
 * With AVX-512 BW and VL, a group of every type but Q8_0 is built in one register (nibble_group: the nibbles
 * split by a shift per half, Q5's fifth bits added under qh as a byte mask, Q6_K's high bits moved into place by
 * one shift), the type and row count are dispatched once per call (they were per tile of two columns), and each
 * block is asked for PREFETCH_ROWS weight rows ahead. Measured on Emerald Rapids (one thread, a 1024 x 1024
 * weight in cache, ns a group of 32, before -> after): Q4_0 2.9 -> 1.9, Q4_1 2.2 -> 1.8, Q5_0 4.0 -> 2.0, Q5_1
 * 3.3 -> 2.1, Q4_K 2.4 -> 2.2, Q5_K 4.0 -> 2.5, Q6_K 5.7 -> 3.2, Q8_0 1.9 -> 1.9; on Gemma 3's own weights from
 * memory (2 threads, one row, medians of 7 alternating passes), GB/s: Q5_0 5.4 -> 9.0, Q4_K 4.6 -> 7.8, Q6_K
 * 6.3 -> 9.1, Q8_0 9.7 -> 16.3, where the exact kernel reads 7.1, 7.2, 6.6 and 14.2.
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "ggml_blocks.h"

#define TILE_ROWS 4 /* rows of x per pass over a weight row */
#define TILE_COLS 2 /* weight rows per pass: TILE_COLS * TILE_ROWS sums + the group vectors in 16 registers */
#define PREFETCH_ROWS 8 /* how far ahead (weight rows) tile() asks for the blocks it will read */

/* x quantized: codes [m, k] int8, and per row and group its scale dx and dx * sum(codes). */
struct codes {
    const int8_t *q;
    const float *dx, *sx;
    int k, num_groups;
};

#if defined(__AVX2__)
/* The codes of a group of 32 from its 4 vectors of x times inverse: rounded half to even (the conversion's
 * default mode, as nearbyintf), each int32 cut to its low byte (as the scalar cast: a NaN's code is 0), and their
 * sum. */
static inline __attribute__((always_inline)) int group_codes(const __m256 x[4], float inverse, int8_t *q) {
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256i codes = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(inverse)));
        sum = _mm256_add_epi32(sum, _mm256_srai_epi32(_mm256_slli_epi32(codes, 24), 24)); /* as the byte holds */
        const __m256i bytes = _mm256_shuffle_epi8(codes, low_bytes); /* 4 bytes in each 128-bit lane */
        const int32_t lo = _mm256_extract_epi32(bytes, 0), hi = _mm256_extract_epi32(bytes, 4);
        memcpy(q + 8 * i, &lo, 4), memcpy(q + 8 * i + 4, &hi, 4);
    }
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    const __m128i quad = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(quad, _mm_shuffle_epi32(quad, 0xb1)));
}
#endif

/* One row of GROUP-value blocks of x into codes (see the header comment: the twin does the same in torch). With
 * AVX2 a group in four vectors, the same arithmetic: one value at a time, quantizing x was a tenth of the int8
 * strips kernel's time at 16 rows. With tile_codes() sharing a one-tile step between the threads, one step's
 * int8 GEMMs of SmolLM2 (gguf_kernels.py --batched, Zen 5): 16 rows 8.98 -> 8.11 ms, 32 rows 13.06 -> 12.45,
 * 64 rows 21.38 -> 20.39; forced to AVX2 13.69 -> 13.45 and 44.01 -> 42.74. */
static void quantize_row(const float *x, int k, int8_t *q, float *dx, float *sx) {
    for (int g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        float amax = 0.0f;
#if defined(__AVX2__)
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xg + 8 * i);
            /* max(a, m) is m where a is NaN: a NaN is ignored, as below */
            m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]), m);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
#else
        for (int j = 0; j < GROUP; j++) { /* as fmaxf (a NaN ignored), which gcc calls out of line */
            const float a = fabsf(xg[j]);
            amax = a > amax ? a : amax;
        }
#endif
        const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX2__)
        const int sum = group_codes(v, inverse, q + g * GROUP);
#else
        int sum = 0;
        for (int j = 0; j < GROUP; j++) {
            const float scaled = xg[j] * inverse; /* not finite only for an inf or NaN in x */
            const int code = isfinite(scaled) ? (int)nearbyintf(scaled) : INT_MIN; /* as the vector conversion's
                                                    "integer indefinite" (a C cast would be undefined) */
            q[g * GROUP + j] = (int8_t)code;
            sum += (int8_t)code;
        }
#endif
        dx[g] = d, sx[g] = d * (float)sum;
    }
}

#if defined(__AVX2__)
typedef __m256 sums; /* a tile entry's running sum, in lanes */

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* A group of a type of nibbles (every type but Q8_0) as its 32 quants in k order (unsigned; Q6_K's signed),
 * built in one register: the low and the high nibbles of a Q4_0-style block's 16 bytes split by one per-half
 * shift, a fifth bit added under a byte mask that is qh itself (group_bytes builds each run of 16 apart, the
 * fifth bits with shuffles and compares). */
static inline __attribute__((always_inline)) __m256i nibble_group(const int type, const uint8_t *block, int g) {
    const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
    if (type == Q4_K || type == Q5_K) { /* groups 2i and 2i + 1: the low and high nibbles of the same 32 bytes */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + (type == Q5_K ? 48 : 16) + 32 * (g / 2)));
        __m256i q = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(raw, 4) : raw, low);
        if (type == Q5_K) { /* bit g of each of 32 bytes */
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(block + 16));
            q = _mm256_mask_add_epi8(q, _mm256_test_epi8_mask(bits, _mm256_set1_epi8((char)(1 << g))), q, sixteen);
        }
        return q;
    }
    if (type == Q6_K) { /* see group_bytes: low nibbles of 32 bytes, bits 2 (g % 4) of 32 more, minus 32 */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 64 * (g / 4) + 32 * (g % 2)));
        const __m256i top = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * (g / 4)));
        const __m256i nibbles = _mm256_and_si256(g % 4 < 2 ? raw : _mm256_srli_epi16(raw, 4), low);
        /* bits 2 (g % 4) and 2 (g % 4) + 1 of each byte moved to bits 4 and 5 (16-bit shifts: the bits that
         * cross from the neighbouring byte are masked off) */
        const int shift = 4 - 2 * (g % 4);
        const __m256i moved = shift >= 0 ? _mm256_slli_epi16(top, shift) : _mm256_srli_epi16(top, -shift);
        const __m256i high = _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
        return _mm256_sub_epi8(_mm256_or_si256(nibbles, high), _mm256_set1_epi8(32));
    }
    const int has_qh = type == Q5_0 || type == Q5_1, has_min = type == Q4_1 || type == Q5_1;
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(block + 2 + 2 * has_min + 4 * has_qh)));
    __m256i q = _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), low);
    if (has_qh) {
        uint32_t qh;
        memcpy(&qh, block + 2 + 2 * has_min, 4);
        q = _mm256_mask_add_epi8(q, _cvtu32_mask32(qh), q, sixteen);
    }
    return q;
}
#endif

static inline __attribute__((always_inline)) __m256i group_vector(const int type, const uint8_t *block, int g,
                                                                  int *is_signed) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    if (type != Q8_0) {
        *is_signed = type == Q6_K;
        return nibble_group(type, block, g);
    }
#endif
    bytes16 half[2];
    *is_signed = group_bytes(type, block, g, half);
    __m128i low, high;
    memcpy(&low, &half[0], 16), memcpy(&high, &half[1], 16);
    return _mm256_set_m128i(high, low);
}

/* Multiplies each int16 pair sum by: 1, or for Q6_K its run's scale (lanes 0-7: the first 16 quants). */
static inline __m256i pair_weights(const int type, const uint8_t *block, int g) {
    if (type != Q6_K) return _mm256_set1_epi16(1);
    const int8_t *scales = group_scales16(block, g);
    return _mm256_set_m128i(_mm_set1_epi16(scales[1]), _mm_set1_epi16(scales[0]));
}

/* Int32 lanes summing to w . x, w unsigned bytes (a signed w's sign already moved onto x). */
static inline __m256i dot_lanes(const int type, __m256i w, __m256i x, __m256i weights) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if (type != Q6_K) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    if (type != Q6_K) return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#endif
    (void)type;
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), weights);
}

static inline float hsum(__m256 v) {
    const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

/* Group g of a block (scale d) against `rows` rows of codes from row r0, into sum[0 .. rows). */
static inline __attribute__((always_inline)) void group_dot(const int type, const int rows, const uint8_t *block,
                                                            int g, float d, const struct codes *x, int r0,
                                                            int group, sums sum[TILE_ROWS]) {
    int is_signed;
    __m256i w = group_vector(type, block, g, &is_signed);
    const __m256i weights = pair_weights(type, block, g), sign = w;
    if (is_signed) w = _mm256_sign_epi8(w, w); /* |w|: -128 becomes 128 as an unsigned byte */
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++) {
        __m256i codes;
        memcpy(&codes, x->q + (int64_t)(r0 + r) * x->k + group * GROUP, 32);
        if (is_signed) codes = _mm256_sign_epi8(codes, sign);
        const __m256 scale = _mm256_set1_ps(d * x->dx[(int64_t)(r0 + r) * x->num_groups + group]);
        sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(type, w, codes, weights)), scale, sum[r]);
    }
}
#else
typedef float sums;

static inline float hsum(float v) { return v; }

static inline __attribute__((always_inline)) void group_dot(const int type, const int rows, const uint8_t *block,
                                                            int g, float d, const struct codes *x, int r0,
                                                            int group, sums sum[TILE_ROWS]) {
    bytes16 half[2];
    const int is_signed = group_bytes(type, block, g, half);
    const int8_t *scales = type == Q6_K ? group_scales16(block, g) : NULL;
    for (int r = 0; r < rows; r++) {
        const int8_t *codes = x->q + (int64_t)(r0 + r) * x->k + group * GROUP;
        int dot = 0;
        for (int h = 0; h < 2; h++) {
            int run = 0;
            for (int j = 0; j < 16; j++)
                run += (is_signed ? (int8_t)half[h][j] : (int)half[h][j]) * codes[16 * h + j];
            dot += scales ? scales[h] * run : run;
        }
        sum[r] += d * x->dx[(int64_t)(r0 + r) * x->num_groups + group] * (float)dot;
    }
}
#endif

/* out[c][r] = row r0 + r of x (quantized) . weight row c, for `cols` weight rows (row_bytes apart) and `rows`
 * rows of x: each block's scales and each group are decoded once for all the rows. */
static inline __attribute__((always_inline)) void tile(const int type, const int rows, const int cols,
                                                       const struct codes *x, int r0, const uint8_t *weight,
                                                       int64_t row_bytes, int64_t ahead,
                                                       float out[TILE_COLS][TILE_ROWS]) {
    const int block_bytes = block_bytes_of(type), groups = block_groups(type);
    sums sum[TILE_COLS][TILE_ROWS];
    float offsets[TILE_COLS][TILE_ROWS];
    memset(sum, 0, sizeof sum), memset(offsets, 0, sizeof offsets);
    for (int b = 0; b < x->num_groups / groups; b++) {
#pragma GCC unroll 4 /* the tile's sums stay in registers only when every index is a constant */
        for (int c = 0; c < cols; c++) {
            const uint8_t *block = weight + c * row_bytes + (int64_t)b * block_bytes;
            /* as in ggml_gemm.c's rows kernel: the same block PREFETCH_ROWS weight rows on, asked for a block at
             * a time into every cache level (none: 0.8x on Gemma 3's Q8_0 head, one row, 2 threads; 4 rows ahead
             * and past the caches (NTA): Gemma 3's layers 0.91x, its head 0.89x, SmolLM2's head 0.85x) */
            for (int line = 0; line < block_bytes; line += 64) __builtin_prefetch(block + ahead + line, 0, 3);
            float d[SUPER_GROUPS], offset[SUPER_GROUPS];
            block_scales(type, block, d, offset);
#pragma GCC unroll 8 /* constant group numbers: the quants' bit positions become immediate shifts */
            for (int g = 0; g < groups; g++) {
                const int group = b * groups + g;
                group_dot(type, rows, block, g, d[g], x, r0, group, sum[c]);
#pragma GCC unroll 4
                for (int r = 0; r < rows; r++)
                    offsets[c][r] += offset[g] * x->sx[(int64_t)(r0 + r) * x->num_groups + group];
            }
        }
    }
    for (int c = 0; c < cols; c++)
        for (int r = 0; r < rows; r++) out[c][r] = hsum(sum[c][r]) + offsets[c][r];
}

/* Columns first .. n of `rows` rows of x from r0, in tiles of TILE_COLS weight rows (the last may be one). */
static inline __attribute__((always_inline)) void column_tiles(const int type, const int rows, const struct codes *x,
                                                               int r0, const uint8_t *weight, int64_t row_bytes,
                                                               const float *bias, float *y, int64_t y_stride,
                                                               int first, int n) {
    int c0 = first;
    for (; c0 + TILE_COLS <= n; c0 += TILE_COLS) {
        float out[TILE_COLS][TILE_ROWS];
        /* the last tiles ask for their own blocks again: never past the weight */
        const int64_t ahead = (c0 + TILE_COLS + PREFETCH_ROWS <= n ? PREFETCH_ROWS : 0) * row_bytes;
        tile(type, rows, TILE_COLS, x, r0, weight + c0 * row_bytes, row_bytes, ahead, out);
        for (int c = 0; c < TILE_COLS; c++)
            for (int r = 0; r < rows; r++)
                y[(r0 + r) * y_stride + c0 + c] = out[c][r] + (bias ? bias[c0 + c] : 0.0f);
    }
    if (c0 < n) {
        float out[TILE_COLS][TILE_ROWS];
        tile(type, rows, 1, x, r0, weight + c0 * row_bytes, row_bytes, 0, out);
        for (int r = 0; r < rows; r++) y[(r0 + r) * y_stride + c0] = out[0][r] + (bias ? bias[c0] : 0.0f);
    }
}

/* column_tiles() with the type and the row count compile-time constants: dispatched once per call and tile of
 * rows, not per tile of columns. */
static void column_tiles_of(int type, int rows, const struct codes *x, int r0, const uint8_t *weight,
                            int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int first, int n) {
#define CASE(t, m)                                                                                                \
    if (type == t && rows == m) {                                                                                 \
        column_tiles(t, m, x, r0, weight, row_bytes, bias, y, y_stride, first, n);                                \
        return;                                                                                                   \
    }
#define TYPE(t) CASE(t, 1) CASE(t, 2) CASE(t, 3) CASE(t, 4)
    TYPE(Q4_0) TYPE(Q4_1) TYPE(Q5_0) TYPE(Q5_1) TYPE(Q8_0) TYPE(Q4_K) TYPE(Q5_K) TYPE(Q6_K)
#undef TYPE
#undef CASE
}

/* The column tiles from `first` to n, every row of x. */
static void columns(int type, const struct codes *x, int m, const uint8_t *weight, int64_t row_bytes,
                    const float *bias, float *y, int64_t y_stride, int first, int n) {
    for (int r0 = 0; r0 < m; r0 += TILE_ROWS)
        column_tiles_of(type, m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS, x, r0, weight, row_bytes, bias, y, y_stride,
                        first, n);
}

/* x [m, k] (rows x_stride apart) quantized into codes [m, k] and dx, sx [m, k / GROUP] (the twin's inputs,
 * for tests); k a multiple of GROUP. */
void kvserve_ggml_quantize_rows(int8_t *q, float *dx, float *sx, const float *x, int64_t x_stride, int m, int k) {
    for (int i = 0; i < m; i++)
        quantize_row(x + i * x_stride, k, q + (int64_t)i * k, dx + (int64_t)i * (k / GROUP),
                     sx + (int64_t)i * (k / GROUP));
}

/* y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart), quantized, times W [n, k] in blocks of `type`
 * (rows row_bytes apart), plus bias (NULL: none). k must be a multiple of the type's block (32 or 256 values).
 * Returns 0, or -1 for a type it does not read or a failed allocation (nothing written then). */
int kvserve_ggml_qdot_gemm(float *y, int64_t y_stride, const float *x, int64_t x_stride, const uint8_t *weight,
                           int64_t row_bytes, int type, const float *bias, int m, int n, int k, int num_threads) {
    if (row_bytes_of(type, k) == 0 || row_bytes < row_bytes_of(type, k)) return -1;
    const int num_groups = k / GROUP;
    int8_t *q = malloc((size_t)m * k + 2 * (size_t)m * num_groups * sizeof(float) + 1);
    if (!q) return -1;
    float *dx = (float *)(q + (size_t)m * k), *sx = dx + (size_t)m * num_groups; /* k: a multiple of 32 */
    kvserve_ggml_quantize_rows(q, dx, sx, x, x_stride, m, k);
    const struct codes codes = {q, dx, sx, k, num_groups};
#pragma omp parallel num_threads(num_threads) /* a contiguous run of columns per thread */
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int num_tiles = (n + TILE_COLS - 1) / TILE_COLS;
        const int first = (int)((int64_t)num_tiles * t / threads) * TILE_COLS;
        const int end = (int)((int64_t)num_tiles * (t + 1) / threads) * TILE_COLS;
        columns(type, &codes, m, weight, row_bytes, bias, y, y_stride, first, end < n ? end : n);
    }
    free(q);
    return 0;
}

/* Steps of more rows: the int8 strips kernel, the same numerics as the column tiles above (d * dx * (qw . qx) +
 * offset * sx per group, with the same codes), laid out as ggml_gemm.c's strips kernel is. QSTRIP weight rows at
 * a time are decoded into a strip of unsigned bytes, once per call; the rows of x go across the lanes, QV rows a
 * vector, each lane 4 consecutive codes of its row (the codes transposed once per call), and each 4 weight bytes
 * are broadcast to every lane: one dpbusd (VNNI) adds 4 products to each of QV rows' sums, where the exact
 * kernel's FMA adds one. Each unit of values sharing a scale (32; Q6_K's runs of 16) ends in an integer sum per
 * row and weight row, which is converted and scaled into a float sum once.
 *
 * Unsigned weight bytes: the nibble types' quants are (offset carries the centres of Q4_0 and Q5_0); Q6_K's
 * quants (-32 .. 31) and Q8_0's (-128 .. 127, with VNNI) are stored plus a shift (32, 128), and shift * (sum of
 * the unit's codes) comes off the integer sum, which stays exact. Without VNNI, maddubs adds two products in
 * int16 saturating: a shifted Q8_0 byte (up to 255) times a code (up to 127) twice overflows, so Q8_0 keeps its
 * sign there and moves it onto the codes (sign_epi8), as the column tiles do.
 *
 * Measured (AMD Zen 5, 2 threads, one step's GEMMs of SmolLM2 on its own Q4_1 / Q8_0 blocks, benchmarks/cpu_gemm.py's
 * `int8` column against `panels`, the dense fp32 copy, and `mapped`, the exact strips): 16 rows 8.1 ms against
 * 10.4 and 17.3; 64 rows 19.5 against 35.5 and 50.0; 256 rows 81.5 against 145.5 and 176.7. Forced to AVX2
 * (maddubs, no VNNI): 12.7 / 19.4 / 22.6, 45.5 / 68.4 / 76.6, 160.9 / 270.2 / 298.6. The column tiles stay faster
 * to 4 rows (4 rows: 8.0 ms against 8.3; 5 rows: 10.1 against 8.3; the same crossover forced to AVX2), so
 * QDOT_MAX_ROWS (ggml_qdot.py) still hands them the steps of up to 4 rows. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QV 16     /* rows of x a vector */
#define QSTRIP 8  /* 8 integer + 8 float sums + the codes' vector and the unit's scales, of 32 registers */
#elif defined(__AVX2__)
#define QV 8
#define QSTRIP 4  /* 4 + 4 sums + the codes, a broadcast and the constants, of 16 registers */
#else
#define QV 8
#define QSTRIP 4
#endif

typedef int32_t qi __attribute__((vector_size(QV * sizeof(int32_t))));
typedef float qf __attribute__((vector_size(QV * sizeof(float))));

/* a VNNI dot in this build's vector width: 512-bit with AVX-512 VNNI, 256-bit with AVX-VNNI or AVX-512 VL */
#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) ||                                                         \
    (!defined(__AVX512F__) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))))
#define HAS_VNNI 1
#else
#define HAS_VNNI 0
#endif
/* Q8_0's bytes: shifted to unsigned where the dot product cannot overflow (VNNI), else signed (see above). */
#define Q8_0_SHIFT (HAS_VNNI ? 128 : 0)

static inline int unit_of(int type) { return type == Q6_K ? 16 : GROUP; }
static inline int shift_of(int type) { return type == Q6_K ? 32 : type == Q8_0 ? Q8_0_SHIFT : 0; }

#if !HAS_VNNI && (defined(__AVX2__) || (defined(__AVX512F__) && defined(__AVX512BW__)))
/* maddubs: the products of w's bytes with the lane's 4 codes summed in pairs, in int16. Several dwords' pair
 * sums are added in int16 before one madd widens them (int16_run), where they cannot overflow: a pair is at most
 * 2 * 31 * 127 for the nibble types (4 of them fit), 2 * 63 * 127 for shifted Q6_K (2), and 2 * 128 * 127 for
 * Q8_0 with its sign on the codes (1). SmolLM2's file forced to AVX2 (gguf_kernels.py --batched, Zen 5): a madd
 * per dword took 17.2 / 57.9 / 225.7 ms at 16 / 64 / 256 rows, one per run 14.2 / 44.3 / 175.5. */
#define PAIRS_IN_INT16
typedef int16_t qs __attribute__((vector_size(QV * sizeof(int32_t))));

static inline int int16_run(int type) { return type == Q8_0 ? 1 : type == Q6_K ? 2 : 4; }

static inline __attribute__((always_inline)) qs pair_sums(const int type, int32_t w, qi x) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i wv = _mm512_set1_epi32(w), xv = (__m512i)x;
    if (type == Q8_0) { /* |w| onto unsigned bytes, its sign onto the codes (AVX-512 has no sign_epi8) */
        xv = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
        wv = _mm512_abs_epi8(wv);
    }
    return (qs)_mm512_maddubs_epi16(wv, xv);
#else
    __m256i wv = _mm256_set1_epi32(w), xv = (__m256i)x;
    if (type == Q8_0) xv = _mm256_sign_epi8(xv, wv), wv = _mm256_abs_epi8(wv);
    return (qs)_mm256_maddubs_epi16(wv, xv);
#endif
}

static inline __attribute__((always_inline)) qi widened(qs pairs) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return (qi)_mm512_madd_epi16((__m512i)pairs, _mm512_set1_epi16(1));
#else
    return (qi)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(1));
#endif
}
#endif

#if !defined(PAIRS_IN_INT16)
/* acc + in each lane the sum of the 4 products of w's bytes (unsigned; Q8_0 without VNNI: signed) with the
 * lane's 4 codes. */
static inline __attribute__((always_inline)) qi dot4(const int type, qi acc, int32_t w, qi x) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    (void)type;
    return (qi)_mm512_dpbusd_epi32((__m512i)acc, _mm512_set1_epi32(w), (__m512i)x);
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    (void)type;
    return (qi)_mm256_dpbusd_avx_epi32((__m256i)acc, _mm256_set1_epi32(w), (__m256i)x);
#elif defined(__AVX2__)
    (void)type;
    return (qi)_mm256_dpbusd_epi32((__m256i)acc, _mm256_set1_epi32(w), (__m256i)x);
#else
    for (int l = 0; l < QV; l++)
        for (int b = 0; b < 4; b++) {
            const int byte = (w >> 8 * b) & 0xff, weight = type == Q8_0 && !HAS_VNNI ? (int8_t)byte : byte;
            acc[l] += weight * (int8_t)(x[l] >> 8 * b);
        }
    return acc;
#endif
}
#endif

static inline int32_t dword(const uint8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return four;
}

/* Group g of a block as 32 bytes in k order, as the strips hold them: unsigned, shifted by shift_of(type). */
static inline __attribute__((always_inline)) void strip_bytes(const int type, const uint8_t *block, int g,
                                                              uint8_t out[GROUP]) {
    const uint8_t shift = (uint8_t)shift_of(type);
#if defined(__AVX2__)
    int is_signed;
    __m256i q = group_vector(type, block, g, &is_signed);
    if (shift) q = _mm256_add_epi8(q, _mm256_set1_epi8((char)shift));
    memcpy(out, &q, GROUP);
#else
    bytes16 half[2];
    group_bytes(type, block, g, half);
    half[0] += shift, half[1] += shift;
    memcpy(out, half, GROUP);
#endif
}

/* x quantized for the strips: per tile of QV rows, its codes [k / 4][QV] (4 codes a lane), dx and sx [k / GROUP]
 * [QV], and each unit's sum of codes times the shift [k / unit][QV] (rows past m: zeros). */
typedef struct {
    qi *codes, *shifted_sums;
    qf *dx, *sx;
    int tiles, k;
} TiledCodes;

/* Groups g0 .. g1 - 1 of tile `tile` of x [m, k] (rows x_stride apart; rows past m: zeros): each row's run of
 * them quantized into q, dx and sx of scratch, then laid out in t. A step of fewer tiles than threads splits
 * each tile's groups between them (its rows would share cache lines), so that no thread waits on another: at 16
 * rows one thread quantized them all. */
static void tile_codes(TiledCodes *t, int tile, int g0, int g1, const float *x, int64_t x_stride, int m, int type,
                       int8_t *q, float *dx, float *sx) {
    const int k = t->k, unit = unit_of(type), shift = shift_of(type), num_groups = k / GROUP;
    const int width = (g1 - g0) * GROUP, units_per_group = GROUP / unit;
    qi *codes = t->codes + (size_t)tile * (k / 4) + g0 * (GROUP / 4);
    qi *sums = t->shifted_sums + (size_t)tile * (k / unit) + g0 * units_per_group;
    qf *tile_dx = t->dx + (size_t)tile * num_groups + g0, *tile_sx = t->sx + (size_t)tile * num_groups + g0;
    for (int l = 0; l < QV; l++) {
        const int r = tile * QV + l;
        if (r < m) {
            kvserve_ggml_quantize_rows(q, dx, sx, x + (int64_t)r * x_stride + g0 * GROUP, x_stride, 1, width);
        } else {
            memset(q, 0, (size_t)width), memset(dx, 0, (size_t)(g1 - g0) * sizeof(float));
            memset(sx, 0, (size_t)(g1 - g0) * sizeof(float));
        }
        for (int kq = 0; kq < width / 4; kq++) memcpy((int32_t *)&codes[kq] + l, q + 4 * kq, 4);
        for (int u = 0; shift && u < width / unit; u++) { /* the unshifted types never read them */
            int sum = 0;
            for (int j = 0; j < unit; j++) sum += q[u * unit + j];
            sums[u][l] = shift * sum;
        }
        for (int g = 0; g < g1 - g0; g++) tile_dx[g][l] = dx[g], tile_sx[g][l] = sx[g];
    }
}

/* A strip of QSTRIP weight rows: per unit its bytes [QSTRIP][unit] and scales and offsets [QSTRIP]. */
typedef struct {
    uint8_t *bytes;
    float *scale, *offset;
} QStrip;

static inline int has_offset(int type) { return type != Q8_0 && type != Q6_K; }

/* Weight rows c0 .. c0 + cols - 1 into the strip (rows past cols keep what they held: never stored). */
static inline __attribute__((always_inline)) void decode_strip(const int type, const uint8_t *weight,
                                                               int64_t row_bytes, int c0, int cols, int k,
                                                               const QStrip *s) {
    const int groups = block_groups(type), unit = unit_of(type), units_per_group = GROUP / unit;
    /* the strip's pointers in registers: a store through a byte pointer might otherwise change them */
    uint8_t *const strip = s->bytes;
    float *const scales = s->scale, *const offsets = s->offset;
    for (int j = 0; j < cols; j++)
        for (int b = 0; b < k / (GROUP * groups); b++) {
            const uint8_t *block = weight + (int64_t)(c0 + j) * row_bytes + (int64_t)b * block_bytes_of(type);
            float d[SUPER_GROUPS], offset[SUPER_GROUPS];
            block_scales(type, block, d, offset);
            for (int g = 0; g < groups; g++) {
                uint8_t bytes[GROUP];
                strip_bytes(type, block, g, bytes);
                for (int h = 0; h < units_per_group; h++) {
                    const int u = (b * groups + g) * units_per_group + h;
                    memcpy(strip + ((int64_t)u * QSTRIP + j) * unit, bytes + h * unit, unit);
                    scales[u * QSTRIP + j] = type == Q6_K ? d[g] * (float)group_scales16(block, g)[h] : d[g];
                    if (has_offset(type)) offsets[u * QSTRIP + j] = offset[g];
                }
            }
        }
}

/* y's columns c0 .. c0 + cols - 1 for tile `tile` of x (num_rows real rows) against a decoded strip, asking for
 * num_lines cache lines from `ahead` on the way (a few per unit: a burst of prefetches is dropped). */
static inline __attribute__((always_inline)) void qstrip_tile(const int type, const TiledCodes *x, int tile,
                                                              int num_rows, const QStrip *s, int cols,
                                                              const float *bias, float *y, int64_t y_stride,
                                                              const uint8_t *ahead, int num_lines) {
    const int k = x->k, unit = unit_of(type), num_groups = k / GROUP;
    const qi *codes = x->codes + (size_t)tile * (k / 4), *shifted = x->shifted_sums + (size_t)tile * (k / unit);
    const qf *dx = x->dx + (size_t)tile * num_groups, *sx = x->sx + (size_t)tile * num_groups;
    qf sum[QSTRIP];
#pragma GCC unroll 16
    for (int j = 0; j < QSTRIP; j++) sum[j] = (qf){0};
    const int units = k / unit;
    int owed = 0; /* lines, in units of 1 / units */
    for (int u = 0; u < units; u++) {
        for (owed += num_lines; owed >= units; owed -= units, ahead += 64) __builtin_prefetch(ahead, 0, 3);
        const uint8_t *bytes = s->bytes + (int64_t)u * QSTRIP * unit;
        qi acc[QSTRIP];
#pragma GCC unroll 16
        for (int j = 0; j < QSTRIP; j++) acc[j] = (qi){0};
#if defined(PAIRS_IN_INT16)
        /* a column's run of pair sums at a time: runs of every column at once hold more registers than AVX2
         * has (SmolLM2's file forced to AVX2: 16 rows 15.3 against 14.6 ms, 64 rows 51.9 against 45.2) */
        for (int kq = 0; kq < unit / 4; kq += int16_run(type))
#pragma GCC unroll 16
            for (int j = 0; j < QSTRIP; j++) {
                qs pairs = (qs){0};
#pragma GCC unroll 4
                for (int r = kq; r < kq + int16_run(type); r++)
                    pairs += pair_sums(type, dword(bytes + j * unit + 4 * r), codes[u * (unit / 4) + r]);
                acc[j] += widened(pairs);
            }
#else
        /* each vector of codes taken by every column in turn: the columns' sums are independent chains */
#pragma GCC unroll 8
        for (int kq = 0; kq < unit / 4; kq++)
#pragma GCC unroll 16
            for (int j = 0; j < QSTRIP; j++)
                acc[j] = dot4(type, acc[j], dword(bytes + j * unit + 4 * kq), codes[u * (unit / 4) + kq]);
#endif
        const qf dxu = dx[u * unit / GROUP];
#pragma GCC unroll 16
        for (int j = 0; j < QSTRIP; j++) {
            const qi exact = shift_of(type) ? acc[j] - shifted[u] : acc[j];
            sum[j] += __builtin_convertvector(exact, qf) * (dxu * s->scale[u * QSTRIP + j]);
            if (has_offset(type)) sum[j] += sx[u] * s->offset[u * QSTRIP + j];
        }
    }
    for (int j = 0; j < cols; j++)
        for (int l = 0; l < num_rows; l++) y[(int64_t)l * y_stride + j] = sum[j][l] + (bias ? bias[j] : 0.0f);
}

/* Columns a thread's strips gather in a buffer before they go to y, a run of each row at a time, and the
 * buffer's row stride (not a power of two). Straight to y, a tile's outputs are short runs in rows of y that are
 * often a multiple of 4 KiB apart (gate and up: 3,072 columns), all in one set of the L1 cache (ggml_gemm.c's
 * strips kernel measured the same): 3,072 x 576 at 64 rows, in cache, 320 -> 235 us. */
#define QBUFFERED (16 * QSTRIP)
#define QBUFFER_STRIDE (QBUFFERED + 8)

/* A thread's strips (QSTRIP columns each) from c0 to c1, every tile of x (the type a constant), through out
 * [m, QBUFFER_STRIDE]. */
static inline __attribute__((always_inline)) void qstrips(const int type, const TiledCodes *x, int m,
                                                          const uint8_t *weight, int64_t row_bytes,
                                                          const float *bias, float *y, int64_t y_stride, int n,
                                                          int c0, int c1, QStrip *s, float *out) {
    const int end = c1 < n ? c1 : n;
    for (int first = c0; first < end; first += QBUFFERED) {
        const int buffered = end - first < QBUFFERED ? end - first : QBUFFERED;
        for (int c = first; c < first + buffered; c += QSTRIP) {
            const int cols = end - c < QSTRIP ? end - c : QSTRIP;
            decode_strip(type, weight, row_bytes, c, cols, x->k, s);
            /* the next strip's blocks, asked for while the first tile works: unasked, its decoding waits */
            const int next_cols = end - c - QSTRIP < QSTRIP ? end - c - QSTRIP : QSTRIP;
            const int num_lines = next_cols > 0 ? (int)((next_cols * row_bytes + 63) / 64) : 0;
            for (int tile = 0; tile < x->tiles; tile++)
                qstrip_tile(type, x, tile, m - tile * QV < QV ? m - tile * QV : QV, s, cols, bias ? bias + c : NULL,
                            out + (int64_t)tile * QV * QBUFFER_STRIDE + (c - first), QBUFFER_STRIDE,
                            weight + (int64_t)(c + QSTRIP) * row_bytes, tile == 0 ? num_lines : 0);
        }
        for (int r = 0; r < m; r++)
            memcpy(y + (int64_t)r * y_stride + first, out + (int64_t)r * QBUFFER_STRIDE, buffered * sizeof(float));
    }
}

static void qstrips_of(int type, const TiledCodes *x, int m, const uint8_t *weight, int64_t row_bytes,
                       const float *bias, float *y, int64_t y_stride, int n, int c0, int c1, QStrip *s, float *out) {
    switch (type) {
#define TYPE(t)                                                                                                   \
    case t: qstrips(t, x, m, weight, row_bytes, bias, y, y_stride, n, c0, c1, s, out); break;
        TYPE(Q4_0) TYPE(Q4_1) TYPE(Q5_0) TYPE(Q5_1) TYPE(Q8_0) TYPE(Q4_K) TYPE(Q5_K) TYPE(Q6_K)
#undef TYPE
    }
}

/* kvserve_ggml_qdot_gemm()'s product by the int8 strips kernel, for steps of more rows: the threads quantize x a
 * tile of rows each in turn, then take their runs of strips. */
int kvserve_ggml_qdot_gemm_strips(float *y, int64_t y_stride, const float *x, int64_t x_stride,
                                  const uint8_t *weight, int64_t row_bytes, int type, const float *bias, int m,
                                  int n, int k, int num_threads) {
    if (row_bytes_of(type, k) == 0 || row_bytes < row_bytes_of(type, k)) return -1;
    const int unit = unit_of(type), num_groups = k / GROUP, tiles = (m + QV - 1) / QV;
    const size_t per_tile = (size_t)k / 4 + (size_t)k / unit; /* vectors of codes and of shifted sums */
    TiledCodes tiled = {aligned_alloc(64, ((size_t)tiles * per_tile * sizeof(qi) + 63) / 64 * 64), NULL,
                        aligned_alloc(64, ((size_t)tiles * 2 * num_groups * sizeof(qf) + 63) / 64 * 64), NULL,
                        tiles, k};
    int failed = !tiled.codes || !tiled.dx;
    if (!failed) {
        tiled.shifted_sums = tiled.codes + (size_t)tiles * (k / 4);
        tiled.sx = tiled.dx + (size_t)tiles * num_groups;
        const int num_strips = (n + QSTRIP - 1) / QSTRIP;
#pragma omp parallel num_threads(num_threads)
        {
            const int threads = omp_get_num_threads(), t = omp_get_thread_num();
            /* scratch: a row's codes, dx and sx, then the strip's bytes, scales and offsets */
            const size_t row_size = (size_t)k + 2 * (size_t)num_groups * sizeof(float);
            const size_t strip_size = (size_t)QSTRIP * k + 2 * (size_t)QSTRIP * (k / unit) * sizeof(float);
            uint8_t *scratch = calloc(1, row_size > strip_size ? row_size : strip_size);
            float *out = malloc((size_t)tiles * QV * QBUFFER_STRIDE * sizeof(float));
            if (scratch) { /* whole tiles a thread; fewer tiles than threads: a share of each tile's groups */
                float *dx = (float *)(scratch + (size_t)k);
                const int split = tiles < threads;
                for (int tile = split ? 0 : t; tile < tiles; tile += split ? 1 : threads)
                    tile_codes(&tiled, tile, split ? (int)((int64_t)num_groups * t / threads) : 0,
                               split ? (int)((int64_t)num_groups * (t + 1) / threads) : num_groups, x, x_stride, m,
                               type, (int8_t *)scratch, dx, dx + num_groups);
            }
#pragma omp barrier
            if (scratch && out) {
                memset(scratch, 0, strip_size);
                float *scale = (float *)(scratch + (size_t)QSTRIP * k);
                QStrip s = {scratch, scale, scale + (size_t)QSTRIP * (k / unit)};
                qstrips_of(type, &tiled, m, weight, row_bytes, bias, y, y_stride, n,
                           (int)((int64_t)num_strips * t / threads) * QSTRIP,
                           (int)((int64_t)num_strips * (t + 1) / threads) * QSTRIP, &s, out);
            } else {
#pragma omp atomic write
                failed = 1;
            }
            free(scratch);
            free(out);
        }
    }
    free(tiled.codes);
    free(tiled.dx);
    return failed ? -1 : 0;
}
