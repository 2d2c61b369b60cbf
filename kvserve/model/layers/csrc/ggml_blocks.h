/* What both block kernels (ggml_gemm.c: fp32 activations, ggml_qdot.c: int8 activations) share: llama.cpp's
 * (ggml's) quantized block layouts and their decoding into groups of 32 quants with a scale and an offset.
 * Part of each kernel's build key (kvserve.native hashes the headers beside a source).
 *
 * Each weight row (one output column) is a run of blocks of 32 consecutive k; a block is an fp16 scale d (and,
 * for Q4_1 and Q5_1, an fp16 minimum m) followed by its 32 quants:
 *
 *     Q4_0  | d | 16 bytes: q[j] low nibble = k j, high nibble = k j + 16 |   w = d * (q - 8)     18 bytes
 *     Q4_1  | d | m | 16 bytes, nibbles as Q4_0                            |   w = d * q + m       20 bytes
 *     Q5_0  | d | qh: 4 bytes, bit j = k j's 5th bit | 16 bytes as Q4_0    |   w = d * (q - 16)    22 bytes
 *     Q5_1  | d | m | qh as Q5_0 | 16 bytes as Q4_0                        |   w = d * q + m       24 bytes
 *     Q8_0  | d | 32 int8                                                  |   w = d * q           34 bytes
 *
 * or of K-quant blocks of 256 k, each 8 groups of 32 (Q6_K: 16 of 16) with a scale of their own:
 *
 *     Q4_K  | d | dmin | 12 bytes: 6-bit sc, m per group | 128 bytes of nibbles |  w = d sc q - dmin m   144 bytes
 *     Q5_K  | d | dmin | 12 bytes as Q4_K | 32 bytes of fifth bits | 128 nibbles |  as Q4_K, q 5 bits    176 bytes
 *     Q6_K  | 128 bytes low nibbles | 64 bytes 2-bit high parts | 16 int8 sc | d |  w = d sc (q - 32)   210 bytes
 *
 * (bit positions in block_scales and group_bytes; qh is little-endian: bit j is bit j % 8 of its byte j / 8).
 * The kernels see every type as groups of GROUP = 32 k with a scale d and an offset: a K-quant block's scales
 * are decoded once, then each group is one like Q4_1's (Q6_K's also carries an int8 scale per 16 quants).
 */
#ifndef KVSERVE_GGML_BLOCKS_H
#define KVSERVE_GGML_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define GROUP 32        /* values that share one scale and one offset in the kernels' sums */
#define SUPER_GROUPS 8  /* groups in a K-quant block of 256 */

typedef uint8_t bytes16 __attribute__((vector_size(16)));

/* ggml's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline int block_bytes_of(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
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

/* Bytes a row of a k-wide weight takes in blocks of `type` (0: not a type the kernels read, or k not a whole
 * number of its blocks). */
static inline int64_t row_bytes_of(int type, int k) {
    const int block_values = GROUP * block_groups(type);
    return block_bytes_of(type) == 0 || k % block_values ? 0 : (int64_t)block_bytes_of(type) * (k / block_values);
}

static inline bytes16 load16(const uint8_t *p) {
    bytes16 v;
    memcpy(&v, p, 16);
    return v;
}

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

/* The scale d and the offset every weight carries, of each group of a block: Q4_0 -8 d and Q5_0 -16 d (their
 * quants stored + 8 and + 16), Q4_1 and Q5_1 m, Q8_0 none; Q4_K and Q5_K d * sc and -dmin * m of 6-bit sc and m
 * packed into 12 bytes; Q6_K the block's d and no offset (its int8 scales of 16 values are the includer's: see
 * group_scales16). */
static inline __attribute__((always_inline)) void block_scales(const int type, const uint8_t *block,
                                                               float d[SUPER_GROUPS], float offset[SUPER_GROUPS]) {
    if (type == Q4_K || type == Q5_K) {
        const float super_d = half_to_float(block), super_min = half_to_float(block + 2);
        /* bytes 0-3: sc 0-3, 4-7: m 0-3, 8-11: sc and m 4-7's low 4 bits; the top 2 bits of bytes 0-7 are
         * those of sc and m 4-7. Unpacked four bytes at a time in 32-bit words (a byte at a time, it was a
         * tenth of a Q4_K group's time in the rows kernel), then widened together, which gcc vectorises. */
        uint32_t s[3], sc[2], m[2];
        memcpy(s, block + 4, sizeof s);
        sc[0] = s[0] & 0x3f3f3f3f, m[0] = s[1] & 0x3f3f3f3f;
        sc[1] = (s[2] & 0x0f0f0f0f) | (s[0] >> 2 & 0x30303030);
        m[1] = (s[2] >> 4 & 0x0f0f0f0f) | (s[1] >> 2 & 0x30303030);
#if defined(__AVX2__)
        int64_t sc_bytes, m_bytes;
        memcpy(&sc_bytes, sc, 8), memcpy(&m_bytes, m, 8);
        const __m256 sc_f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc_bytes)));
        const __m256 m_f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m_bytes)));
        _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_set1_ps(super_d), sc_f));
        _mm256_storeu_ps(offset, _mm256_mul_ps(_mm256_set1_ps(-super_min), m_f)); /* = -(min * m), exactly */
#else
        uint8_t sc_bytes[SUPER_GROUPS], m_bytes[SUPER_GROUPS];
        memcpy(sc_bytes, sc, sizeof sc_bytes), memcpy(m_bytes, m, sizeof m_bytes);
        for (int g = 0; g < SUPER_GROUPS; g++) {
            d[g] = super_d * (float)sc_bytes[g];
            offset[g] = -(super_min * (float)m_bytes[g]);
        }
#endif
        return;
    }
    if (type == Q6_K) {
        for (int g = 0; g < SUPER_GROUPS; g++) d[g] = half_to_float(block + 208), offset[g] = 0.0f;
        return;
    }
    d[0] = half_to_float(block);
    switch (type) {
    case Q4_1:
    case Q5_1: offset[0] = half_to_float(block + 2); break;
    case Q4_0: offset[0] = -8.0f * d[0]; break;
    case Q5_0: offset[0] = -16.0f * d[0]; break;
    default: offset[0] = 0.0f;
    }
}

/* Q5_0 / Q5_1: the fifth bits of k 16h .. 16h + 15 as 0 or 16 a byte, from qh's bytes 2h and 2h + 1: each
 * byte copied into 8 lanes (one byte shuffle), and each lane keeps its own bit (x86 has no per-byte variable
 * shift). Its cost, measured (Zen 4, one thread, one row of x, a 4096 x 640 weight in cache): Q5_0 0.31 ms
 * against Q4_0's 0.24 in ggml_gemm.c, 0.19 against 0.12 in ggml_qdot.c (AVX2 builds: 0.33 / 0.24, 0.21 / 0.13);
 * from memory a Q5 weight also reads 5.5 bits against 4.5. */
static inline __attribute__((always_inline)) bytes16 fifth_bits(const uint8_t *qh, int h) {
    const bytes16 lane_bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const bytes16 byte_of_lane = (bytes16){0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1} + (uint8_t)(2 * h);
    bytes16 bytes = {0};
    memcpy(&bytes, qh, 4);
    const bytes16 spread = __builtin_shuffle(bytes, byte_of_lane);
    return (bytes16)((spread & lane_bit) == lane_bit) & 16;
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
    case Q5_0:
    case Q5_1: { /* Q4_0's nibbles, each with its fifth bit from qh */
        const uint8_t *qh = block + (type == Q5_1 ? 4 : 2);
        const bytes16 raw = load16(qh + 4);
#if defined(__AVX2__)
        /* both runs' fifth bits in one 256-bit pass (each byte of qh copied into 8 lanes, each lane keeping its
         * own bit), then split */
        uint32_t bits;
        memcpy(&bits, qh, 4);
        const __m256i byte_of_lane = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
        const __m256i lane_bit = _mm256_set1_epi64x((long long)0x8040201008040201);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), byte_of_lane);
        const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, lane_bit), lane_bit),
                                               _mm256_set1_epi8(16));
        bytes16 low_run, high_run;
        const __m128i low_bits = _mm256_castsi256_si128(fifth), high_bits = _mm256_extracti128_si256(fifth, 1);
        memcpy(&low_run, &low_bits, 16), memcpy(&high_run, &high_bits, 16);
        half[0] = (raw & 15) | low_run, half[1] = (raw >> 4) | high_run;
#else
        half[0] = (raw & 15) | fifth_bits(qh, 0), half[1] = (raw >> 4) | fifth_bits(qh, 1);
#endif
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


/* Q6_K's int8 scales of group g's two runs of 16 quants. */
static inline const int8_t *group_scales16(const uint8_t *block, int g) {
    return (const int8_t *)(block + 192) + 2 * g;
}

#endif
