/* y = x W^T (+ bias) in fp32 over a weight kept in llama.cpp's (ggml's) quantized blocks: Q4_0, Q4_1, Q8_0 and
 * the K-quants Q4_K, Q5_K, Q6_K.
 *
 * Each weight row (one output column) is a run of blocks of 32 consecutive k; a block is an fp16 scale d (and,
 * for Q4_1, an fp16 minimum m) followed by its 32 quants:
 *
 *     Q4_0  | d | 16 bytes: q[j] low nibble = k j, high nibble = k j + 16 |   w = d * (q - 8)     18 bytes
 *     Q4_1  | d | m | 16 bytes, nibbles as Q4_0                            |   w = d * q + m       20 bytes
 *     Q8_0  | d | 32 int8                                                  |   w = d * q           34 bytes
 *
 * or of K-quant blocks of 256 k, each 8 groups of 32 (Q6_K: 16 of 16) with a scale of their own:
 *
 *     Q4_K  | d | dmin | 12 bytes: 6-bit sc, m per group | 128 bytes of nibbles |  w = d sc q - dmin m   144 bytes
 *     Q5_K  | d | dmin | 12 bytes as Q4_K | 32 bytes of fifth bits | 128 nibbles |  as Q4_K, q 5 bits    176 bytes
 *     Q6_K  | 128 bytes low nibbles | 64 bytes 2-bit high parts | 16 int8 sc | d |  w = d sc (q - 32)   210 bytes
 *
 * (bit positions in block_scales and group_bytes). The kernel sees every type as groups of GROUP = 32 k with a
 * scale d and an offset: a K-quant block's scales are decoded once, then each group is one like Q4_1's.
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

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__F16C__)
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#else
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        f = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -f : f;
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}
#endif

#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8 /* one AVX2 register: a wider GNU vector is split and spilled */
#endif
#define GROUP 32        /* values that share one scale and one offset in the kernel's sums */
#define SUPER_GROUPS 8  /* groups in a K-quant block of 256 */
#define TILE_ROWS 4 /* rows of x per pass over a weight row: 4 sums + 4 weight vectors + x in 16 registers */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef uint8_t bytes16 __attribute__((vector_size(16)));

/* ggml's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int kvserve_ggml_block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Groups of GROUP values in a block of `type`. */
static inline int block_groups(int type) {
    return type == Q4_K || type == Q5_K || type == Q6_K ? SUPER_GROUPS : 1;
}

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline bytes16 load16(const uint8_t *p) {
    bytes16 v;
    memcpy(&v, p, 16);
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

/* The scale d and the offset every weight carries, of each group of a block: Q4_0 -8 d (its quants stored
 * + 8), Q4_1 m, Q8_0 none; Q4_K and Q5_K d * sc and -dmin * m of 6-bit sc and m packed into 12 bytes; Q6_K the
 * block's d and no offset (its int8 scales of 16 values ride on the quants: see group_quants). */
static inline __attribute__((always_inline)) void block_scales(const int type, const uint8_t *block,
                                                               float d[SUPER_GROUPS], float offset[SUPER_GROUPS]) {
    if (type == Q4_K || type == Q5_K) {
        const float super_d = half_to_float(block), super_min = half_to_float(block + 2);
        const uint8_t *s = block + 4; /* bytes 0-3: sc 0-3, 4-7: m 0-3, 8-11: sc and m 4-7's low 4 bits; the
                                       * top 2 bits of bytes 0-7 are those of sc and m 4-7 */
        for (int g = 0; g < SUPER_GROUPS; g++) {
            const int sc = g < 4 ? s[g] & 63 : (s[g + 4] & 15) | (s[g - 4] >> 6) << 4;
            const int m = g < 4 ? s[g + 4] & 63 : (s[g + 4] >> 4) | (s[g] >> 6) << 4;
            d[g] = super_d * (float)sc;
            offset[g] = -(super_min * (float)m);
        }
        return;
    }
    if (type == Q6_K) {
        for (int g = 0; g < SUPER_GROUPS; g++) d[g] = half_to_float(block + 208), offset[g] = 0.0f;
        return;
    }
    d[0] = half_to_float(block);
    offset[0] = type == Q4_1 ? half_to_float(block + 2) : type == Q4_0 ? -8.0f * d[0] : 0.0f;
}

/* Group g of a block as its 32 quants in k order, two runs of 16 bytes; returns whether they are signed. */
static inline __attribute__((always_inline)) int group_bytes(const int type, const uint8_t *block, int g,
                                                             bytes16 half[2]) {
    switch (type) {
    case Q8_0:
        half[0] = load16(block + 2), half[1] = load16(block + 18);
        return 1;
    case Q4_0:
    case Q4_1: {
        const bytes16 raw = load16(block + (type == Q4_1 ? 4 : 2));
        half[0] = raw & 15, half[1] = raw >> 4;
        return 0;
    }
    case Q4_K:
    case Q5_K: { /* groups 2i and 2i+1: the low and high nibbles of the same 32 bytes; Q5_K's fifth bit of
                  * group g is bit g of 32 bytes shared by all groups */
        const uint8_t *nibbles = block + (type == Q5_K ? 48 : 16) + 32 * (g / 2);
        for (int h = 0; h < 2; h++) {
            const bytes16 raw = load16(nibbles + 16 * h);
            half[h] = g % 2 ? raw >> 4 : raw & 15;
            if (type == Q5_K) half[h] |= ((load16(block + 16 + 16 * h) >> g) & 1) << 4;
        }
        return 0;
    }
    default: { /* Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, each half of the block in 64 and 32:
                * group 4i + j takes the low (j < 2) or high nibbles of bytes 32 (j % 2) on, and bits 2j. */
        const uint8_t *low = block + 64 * (g / 4) + 32 * (g % 2), *high = block + 128 + 32 * (g / 4);
        for (int h = 0; h < 2; h++) {
            const bytes16 raw = load16(low + 16 * h);
            half[h] = ((g % 4 < 2 ? raw & 15 : raw >> 4) | ((load16(high + 16 * h) >> (2 * (g % 4))) & 3) << 4) - 32;
        }
        return 1;
    }
    }
}

/* Group g of a block as GROUP / VEC float vectors (k order): its quants, and for Q6_K times their int8 scale
 * (an exact product), so that every type's group is d * q + offset. */
static inline __attribute__((always_inline)) void group_quants(const int type, const uint8_t *block, int g,
                                                               vec q[GROUP / VEC]) {
    bytes16 half[2];
    const int is_signed = group_bytes(type, block, g, half);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 16 / VEC; j++) q[h * (16 / VEC) + j] = widen(half[h], j * VEC, is_signed);
    if (type == Q6_K) {
        const int8_t *scales = (const int8_t *)(block + 192) + 2 * g;
        for (int j = 0; j < GROUP / VEC; j++) q[j] *= (float)scales[j * VEC / 16];
    }
}

/* y[r] = sum over groups of d * (x_r . q) + offset * (sum of x_r over the group), for ROWS rows of x against
 * one weight row: each block's scales and each group are unpacked once for all the rows; the offsets' sums
 * come from x_sums. */
static inline __attribute__((always_inline)) void row_tile(const int type, const int rows, const float *x,
                                                           int64_t x_stride, const float *x_sums, int num_groups,
                                                           const uint8_t *weight_row, float out[TILE_ROWS]) {
    const int block_bytes = kvserve_ggml_block_bytes(type), groups = block_groups(type);
    vec sum[TILE_ROWS];
    float offsets[TILE_ROWS];
    for (int r = 0; r < rows; r++) sum[r] = (vec){0}, offsets[r] = 0.0f;
    for (int b = 0; b < num_groups / groups; b++) {
        const uint8_t *block = weight_row + (int64_t)b * block_bytes;
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
                        const uint8_t *weight_row, float out[TILE_ROWS]) {
#define CASE(t, n)                                                                                                \
    if (type == t && rows == n) {                                                                                 \
        row_tile(t, n, x, x_stride, x_sums, num_groups, weight_row, out);                                         \
        return;                                                                                                   \
    }
#define TYPE(t) CASE(t, 1) CASE(t, 2) CASE(t, 3) CASE(t, 4)
    TYPE(Q4_0) TYPE(Q4_1) TYPE(Q8_0) TYPE(Q4_K) TYPE(Q5_K) TYPE(Q6_K)
#undef TYPE
#undef CASE
}

/* Bytes a row of a k-wide weight takes in blocks of `type` (0: not a type this kernel reads, or k not a
 * whole number of its blocks). */
int64_t kvserve_ggml_row_bytes(int type, int k) {
    const int block_values = GROUP * block_groups(type);
    return k % block_values ? 0 : (int64_t)kvserve_ggml_block_bytes(type) * (k / block_values);
}

/* y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart) times W [n, k] in blocks of `type` (rows
 * row_bytes apart), plus bias (NULL: none). k must be a multiple of the type's block (32 or 256 values).
 * Returns 0, or -1 for a type it does not read or a failed allocation (nothing written then). */
int kvserve_ggml_gemm_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, const uint8_t *weight,
                          int64_t row_bytes, int type, const float *bias, int m, int n, int k, int num_threads) {
    if (kvserve_ggml_row_bytes(type, k) == 0 || row_bytes < kvserve_ggml_row_bytes(type, k)) return -1;
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
        for (int i = 0; i < m; i += TILE_ROWS) {
            const int rows = m - i < TILE_ROWS ? m - i : TILE_ROWS;
            float out[TILE_ROWS];
            row_tile_of(type, rows, x + i * x_stride, x_stride, x_sums + i * num_groups, num_groups, weight_row, out);
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

/* out [n, k] = the fp32 values of W [n, k] in blocks of `type` (rows row_bytes apart): d * q + offset, in
 * fp32 as gguf's reference computes them (up to the rounding of a fused multiply-add). For the dense layouts
 * of larger steps, at load. Returns 0, or -1 for a type it does not read. */
int kvserve_ggml_dequantize(float *out, const uint8_t *weight, int64_t row_bytes, int type, int n, int k,
                            int num_threads) {
    if (kvserve_ggml_row_bytes(type, k) == 0 || row_bytes < kvserve_ggml_row_bytes(type, k)) return -1;
    const int block_bytes = kvserve_ggml_block_bytes(type), block_values = GROUP * block_groups(type);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < n; c++) {
        for (int b = 0; b < k / block_values; b++) {
            float *values = out + (int64_t)c * k + b * block_values;
            const uint8_t *block = weight + (int64_t)c * row_bytes + (int64_t)b * block_bytes;
            switch (type) {
            case Q4_0: dequantize_block(Q4_0, block, values); break;
            case Q4_1: dequantize_block(Q4_1, block, values); break;
            case Q8_0: dequantize_block(Q8_0, block, values); break;
            case Q4_K: dequantize_block(Q4_K, block, values); break;
            case Q5_K: dequantize_block(Q5_K, block, values); break;
            default: dequantize_block(Q6_K, block, values); break;
            }
        }
    }
    return 0;
}
