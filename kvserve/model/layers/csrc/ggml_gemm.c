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
 * uses sums of x computed once per call. A row's result does not depend on the other rows of the step.
 *
 * Measured (2-core AMD EPYC Zen 2, AVX2), a 49152 x 576 weight: one row Q4_1 3.9 ms, Q8_0 3.4 ms, fp32 through
 * the small-GEMM panels 5.9 ms; 4 rows 6.9 / 6.5 / 6.4; 16 rows 28.5 / 27.0 / 12.8. Each row costs the kernel
 * the unpacking again per tile, the dense GEMMs nothing: from 4 rows up the caller uses the dense layout.
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_blocks.h"

#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8 /* one AVX2 register: a wider GNU vector is split and spilled */
#endif
#define TILE_ROWS 4 /* rows of x per pass over a weight row: 4 sums + 4 weight vectors + x in 16 registers */
#define PREFETCH_ROWS 4 /* how far ahead (weight rows) row_tile() asks for the blocks it will read */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(vec v) {
    float lanes[VEC], s = 0.0f;
    memcpy(lanes, &v, sizeof lanes);
    for (int i = 0; i < VEC; i++) s += lanes[i];
    return s;
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

/* Group g of a block as GROUP / VEC float vectors (k order): its quants, and for Q6_K times their int8 scale
 * (an exact product), so that every type's group is d * q + offset. */
static inline __attribute__((always_inline)) void group_quants(const int type, const uint8_t *block, int g,
                                                               vec q[GROUP / VEC]) {
    bytes16 half[2];
    const int is_signed = group_bytes(type, block, g, half);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 16 / VEC; j++) q[h * (16 / VEC) + j] = widen(half[h], j * VEC, is_signed);
    if (type == Q6_K) {
        const int8_t *scales = group_scales16(block, g);
        for (int j = 0; j < GROUP / VEC; j++) q[j] *= (float)scales[j * VEC / 16];
    }
}

/* y[r] = sum over groups of d * (x_r . q) + offset * (sum of x_r over the group), for ROWS rows of x against
 * one weight row: each block's scales and each group are unpacked once for all the rows; the offsets' sums
 * come from x_sums. */
static inline __attribute__((always_inline)) void row_tile(const int type, const int rows, const float *x,
                                                           int64_t x_stride, const float *x_sums, int num_groups,
                                                           const uint8_t *weight_row, const uint8_t *ahead,
                                                           float out[TILE_ROWS]) {
    const int block_bytes = block_bytes_of(type), groups = block_groups(type);
    vec sum[TILE_ROWS];
    float offsets[TILE_ROWS];
    for (int r = 0; r < rows; r++) sum[r] = (vec){0}, offsets[r] = 0.0f;
    for (int b = 0; b < num_groups / groups; b++) {
        const uint8_t *block = weight_row + (int64_t)b * block_bytes;
        /* the unpacking is compute-bound: unasked, the memory reads wait for it instead of overlapping it; a
         * block at a time, as a burst of prefetches is dropped. Measured on Gemma 3's and SmolLM2's own weights
         * (one row, 2 threads, Emerald Rapids): Q8_0 1.24-1.34x, Q4_1 1.10x, Q5_0 1.05-1.11x, Q4_K 1.08-1.11x,
         * and Q6_K 0.69-0.75x, which is therefore not asked for */
        if (type != Q6_K)
            for (int line = 0; line < block_bytes; line += 64)
                __builtin_prefetch(ahead + (int64_t)b * block_bytes + line, 0, 0);
        float d[SUPER_GROUPS], offset[SUPER_GROUPS];
        block_scales(type, block, d, offset);
#pragma GCC unroll 8 /* constant group numbers: the quants' bit positions become immediate shifts */
        for (int g = 0; g < groups; g++) {
            vec q[GROUP / VEC];
            group_quants(type, block, g, q);
            const int group = b * groups + g;
            for (int r = 0; r < rows; r++) {
                const float *xg = x + r * x_stride + group * GROUP;
                vec dot = load(xg) * q[0];
                for (int j = 1; j < GROUP / VEC; j++) dot += load(xg + j * VEC) * q[j];
                sum[r] += d[g] * dot;
                offsets[r] += offset[g] * x_sums[r * num_groups + group];
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(sum[r]) + offsets[r];
}

/* row_tile() with the type and the row count compile-time constants. */
static void row_tile_of(int type, int rows, const float *x, int64_t x_stride, const float *x_sums, int num_groups,
                        const uint8_t *weight_row, const uint8_t *ahead, float out[TILE_ROWS]) {
#define CASE(t, n)                                                                                                \
    if (type == t && rows == n) {                                                                                 \
        row_tile(t, n, x, x_stride, x_sums, num_groups, weight_row, ahead, out);                                  \
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
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < n; c++) {
        const uint8_t *weight_row = weight + (int64_t)c * row_bytes;
        /* the last rows ask for their own blocks again: never past the weight */
        const uint8_t *ahead = weight + (int64_t)(c + PREFETCH_ROWS < n ? c + PREFETCH_ROWS : c) * row_bytes;
        for (int i = 0; i < m; i += TILE_ROWS) {
            const int rows = m - i < TILE_ROWS ? m - i : TILE_ROWS;
            float out[TILE_ROWS];
            row_tile_of(type, rows, x + i * x_stride, x_stride, x_sums + i * num_groups, num_groups, weight_row,
                        ahead, out);
            for (int r = 0; r < rows; r++) y[(i + r) * y_stride + c] = out[r] + (bias ? bias[c] : 0.0f);
        }
    }
    free(x_sums);
    return 0;
}

/* One block's values, d * q + offset per group, into out. */
static inline __attribute__((always_inline)) void dequantize_block(const int type, const uint8_t *block,
                                                                   float *out) {
    float d[SUPER_GROUPS], offset[SUPER_GROUPS];
    block_scales(type, block, d, offset);
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

/* Steps of more rows: the strips kernel. STRIP weight rows at a time are decoded once into fp32 (a strip, in a
 * thread's buffer), and every row of x takes its dot products with them, the rows of x across the vector lanes
 * (x transposed once per call, so a k's values of VEC rows are one load) and each weight value broadcast:
 * ROW_VECS x STRIP sums in registers, nothing unpacked twice. Each output is one chain of FMAs over k in order,
 * as in row_tile(): a row's result does not depend on the other rows of the step. The kernel decodes every
 * weight once per call, which the dense panels (small_gemm.c) never do: it serves steps where no dense copy is
 * kept (--load-format mmap), from 9 rows up (the rows kernel's cost grows with the rows; this one's is flat up
 * to a vector of rows); ggml.py states the measured crossovers. */
#if defined(__AVX512F__)
#define STRIP 12 /* 2 x 12 sums + 2 vectors of x of the 32 registers; each broadcast folds into its FMA */
#else
#define STRIP 4 /* 2 x 4 sums + 2 vectors of x + 1 broadcast of the 16 registers */
#endif
#define ROW_VECS 2

/* y[rows, cols] for ROW_VECS * VEC rows (of which num_rows are real) of xt [k, m_pad] against a decoded strip
 * [STRIP, k] (rows past num_cols are zeros). */
static inline __attribute__((always_inline)) void strip_tile(const int vecs, const float *xt, int m_pad,
                                                             const float *strip, int k, float *y, int64_t y_stride,
                                                             int num_rows, int num_cols, const float *bias) {
    vec sum[ROW_VECS][STRIP];
#pragma GCC unroll 2
    for (int i = 0; i < vecs; i++)
#pragma GCC unroll 12
        for (int j = 0; j < STRIP; j++) sum[i][j] = (vec){0};
    for (int kk = 0; kk < k; kk++) {
        vec xv[ROW_VECS];
#pragma GCC unroll 2
        for (int i = 0; i < vecs; i++) xv[i] = load(xt + (int64_t)kk * m_pad + i * VEC);
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

/* kvserve_ggml_gemm_f32()'s product by the strips kernel, for steps of more rows (the rows of a strip past n,
 * the last strip's, hold earlier weights: their sums are computed and never stored). */
int kvserve_ggml_gemm_strips_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride,
                                 const uint8_t *weight, int64_t row_bytes, int type, const float *bias, int m, int n,
                                 int k, int num_threads) {
    if (row_bytes_of(type, k) == 0 || row_bytes < row_bytes_of(type, k)) return -1;
    const int m_pad = (m + VEC - 1) / VEC * VEC, tile = ROW_VECS * VEC;
    float *xt = aligned_alloc(64, ((size_t)k * m_pad * sizeof(float) + 63) / 64 * 64);
    if (!xt) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int kk = 0; kk < k; kk++)
            for (int r = 0; r < m_pad; r++) xt[(int64_t)kk * m_pad + r] = r < m ? x[(int64_t)r * x_stride + kk] : 0.0f;
        float *strip = calloc((size_t)STRIP * k, sizeof(float));
        if (!strip) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int c = 0; c < n; c += STRIP) {
            const int num_cols = n - c < STRIP ? n - c : STRIP;
            if (!strip) continue;
            for (int j = 0; j < num_cols; j++) decode_row(type, weight + (int64_t)(c + j) * row_bytes, k, strip + (int64_t)j * k);
            for (int r = 0; r < m; r += tile) {
                float *out = y + (int64_t)r * y_stride + c;
                const float *b = bias ? bias + c : NULL;
                if (m - r > VEC)
                    strip_tile(2, xt + r, m_pad, strip, k, out, y_stride, m - r, num_cols, b);
                else
                    strip_tile(1, xt + r, m_pad, strip, k, out, y_stride, m - r, num_cols, b);
            }
        }
        free(strip);
    }
    free(xt);
    return failed ? -1 : 0;
}
