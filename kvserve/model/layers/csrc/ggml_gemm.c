/* y = x W^T (+ bias) in fp32 over a weight kept in llama.cpp's (ggml's) quantized blocks: Q4_0, Q4_1, Q8_0.
 *
 * Each weight row (one output column) is a run of blocks of 32 consecutive k; a block is an fp16 scale d (and,
 * for Q4_1, an fp16 minimum m) followed by its 32 quants:
 *
 *     Q4_0  | d | 16 bytes: q[j] low nibble = k j, high nibble = k j + 16 |   w = d * (q - 8)     18 bytes
 *     Q4_1  | d | m | 16 bytes, nibbles as Q4_0                            |   w = d * q + m       20 bytes
 *     Q8_0  | d | 32 int8                                                  |   w = d * q           34 bytes
 *
 * Why: a decode step is bound by reading the weights, and these read 4.5 to 8.5 bits a weight where fp32 reads
 * 32. Each block is unpacked once into VEC-wide float vectors of its quants (bytes widened through 32-bit
 * integers: straight to floats gcc converts byte by byte, 3x slower), then every row of a tile of up to
 * TILE_ROWS rows of x takes d * (x . q) from it; the offset term m * (sum of x over the block) uses sums of x
 * computed once per call. A row's result does not depend on the other rows of the step.
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
#define BLOCK 32
#define TILE_ROWS 4 /* rows of x per pass over a weight row: 4 sums + 4 weight vectors + x in 16 registers */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef uint8_t bytes16 __attribute__((vector_size(16)));

/* ggml's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

int kvserve_ggml_block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;
    }
}

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

/* VEC of the 16 bytes (unsigned, or signed for Q8_0) from byte `first`, as floats: through 32-bit integers,
 * which compilers do in two instructions (straight to floats, gcc converts byte by byte). */
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

/* A block's 32 quants as BLOCK / VEC float vectors (k order), its scale d, and the offset every weight of it
 * carries (Q4_1: m; Q4_0: -8 d, its quants being stored + 8; Q8_0: none). */
static inline __attribute__((always_inline)) float unpack(const int type, const uint8_t *block,
                                                          vec q[BLOCK / VEC], float *offset) {
    const float d = half_to_float(block);
    if (type == Q8_0) {
        for (int half = 0; half < 2; half++) {
            bytes16 raw;
            memcpy(&raw, block + 2 + 16 * half, 16);
            for (int j = 0; j < 16 / VEC; j++) q[half * (16 / VEC) + j] = widen(raw, j * VEC, 1);
        }
        *offset = 0.0f;
        return d;
    }
    bytes16 raw;
    memcpy(&raw, block + (type == Q4_1 ? 4 : 2), 16);
    const bytes16 low = raw & 15, high = raw >> 4; /* k 0..15, then k 16..31 */
    for (int j = 0; j < 16 / VEC; j++) {
        q[j] = widen(low, j * VEC, 0);
        q[16 / VEC + j] = widen(high, j * VEC, 0);
    }
    *offset = type == Q4_1 ? half_to_float(block + 2) : -8.0f * d;
    return d;
}

/* y[r] = sum over blocks of d * (x_r . q) + offset * (sum of x_r over the block), for ROWS rows of x against
 * one weight row: the block is unpacked once for all the rows; the offsets' sums come from x_sums. */
static inline __attribute__((always_inline)) void row_tile(const int type, const int rows, const float *x,
                                                           int64_t x_stride, const float *x_sums, int num_blocks,
                                                           const uint8_t *weight_row, float out[TILE_ROWS]) {
    const int block_bytes = kvserve_ggml_block_bytes(type);
    vec sum[TILE_ROWS];
    float offsets[TILE_ROWS];
    for (int r = 0; r < rows; r++) sum[r] = (vec){0}, offsets[r] = 0.0f;
    for (int b = 0; b < num_blocks; b++) {
        vec q[BLOCK / VEC];
        float offset;
        const float d = unpack(type, weight_row + (int64_t)b * block_bytes, q, &offset);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * x_stride + b * BLOCK;
            vec dot = load(xb) * q[0];
            for (int j = 1; j < BLOCK / VEC; j++) dot += load(xb + j * VEC) * q[j];
            sum[r] += d * dot;
            offsets[r] += offset * x_sums[r * num_blocks + b];
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(sum[r]) + offsets[r];
}

/* row_tile() with the type and the row count compile-time constants. */
static void row_tile_of(int type, int rows, const float *x, int64_t x_stride, const float *x_sums, int num_blocks,
                        const uint8_t *weight_row, float out[TILE_ROWS]) {
#define CASE(t, n)                                                                                                \
    if (type == t && rows == n) {                                                                                 \
        row_tile(t, n, x, x_stride, x_sums, num_blocks, weight_row, out);                                         \
        return;                                                                                                   \
    }
#define TYPE(t) CASE(t, 1) CASE(t, 2) CASE(t, 3) CASE(t, 4)
    TYPE(Q4_0) TYPE(Q4_1) TYPE(Q8_0)
#undef TYPE
#undef CASE
}

/* Bytes a row of a k-wide weight takes in blocks of `type` (0: not a type this kernel reads). */
int64_t kvserve_ggml_row_bytes(int type, int k) {
    return k % BLOCK ? 0 : (int64_t)kvserve_ggml_block_bytes(type) * (k / BLOCK);
}

/* y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart) times W [n, k] in blocks of `type` (rows
 * row_bytes apart), plus bias (NULL: none). k must be a multiple of 32. Returns 0, or -1 for a type it does
 * not read or a failed allocation (nothing written then). */
int kvserve_ggml_gemm_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, const uint8_t *weight,
                          int64_t row_bytes, int type, const float *bias, int m, int n, int k, int num_threads) {
    if (kvserve_ggml_row_bytes(type, k) == 0 || row_bytes < kvserve_ggml_row_bytes(type, k)) return -1;
    const int num_blocks = k / BLOCK;
    float *x_sums = malloc((size_t)m * num_blocks * sizeof(float) + 1);
    if (!x_sums) return -1;
    for (int i = 0; i < m; i++)
        for (int b = 0; b < num_blocks; b++) {
            float s = 0.0f;
            for (int j = 0; j < BLOCK; j++) s += x[i * x_stride + b * BLOCK + j];
            x_sums[i * num_blocks + b] = s;
        }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < n; c++) {
        const uint8_t *weight_row = weight + (int64_t)c * row_bytes;
        for (int i = 0; i < m; i += TILE_ROWS) {
            const int rows = m - i < TILE_ROWS ? m - i : TILE_ROWS;
            float out[TILE_ROWS];
            row_tile_of(type, rows, x + i * x_stride, x_stride, x_sums + i * num_blocks, num_blocks, weight_row, out);
            for (int r = 0; r < rows; r++) y[(i + r) * y_stride + c] = out[r] + (bias ? bias[c] : 0.0f);
        }
    }
    free(x_sums);
    return 0;
}

/* out [n, k] = the fp32 values of W [n, k] in blocks of `type` (rows row_bytes apart): d * q + offset, in
 * fp32 as gguf's reference computes them (up to the rounding of a fused multiply-add). For the dense layouts
 * of larger steps, at load. Returns 0, or -1 for a type it does not read. */
int kvserve_ggml_dequantize(float *out, const uint8_t *weight, int64_t row_bytes, int type, int n, int k,
                            int num_threads) {
    if (kvserve_ggml_row_bytes(type, k) == 0 || row_bytes < kvserve_ggml_row_bytes(type, k)) return -1;
    const int block_bytes = kvserve_ggml_block_bytes(type), num_blocks = k / BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < n; c++) {
        for (int b = 0; b < num_blocks; b++) {
            vec q[BLOCK / VEC];
            float offset, *w = out + (int64_t)c * k + b * BLOCK;
            const uint8_t *block = weight + (int64_t)c * row_bytes + (int64_t)b * block_bytes;
            float d;
            switch (type) {
            case Q4_0: d = unpack(Q4_0, block, q, &offset); break;
            case Q4_1: d = unpack(Q4_1, block, q, &offset); break;
            default: d = unpack(Q8_0, block, q, &offset); break;
            }
            for (int j = 0; j < BLOCK / VEC; j++) {
                const vec values = d * q[j] + offset;
                memcpy(w + j * VEC, &values, sizeof values);
            }
        }
    }
    return 0;
}
