/* What both attention kernels (paged_decode.c, paged_prefill.c) share: the cache's encodings and whole-vector
 * helpers. The includer defines VEC and the vector types first: vec (VEC floats), ivec (VEC int32), byte_vec /
 * signed_byte_vec (VEC bytes). Part of each kernel's build key (kvserve.native hashes what a source includes). */
#ifndef KVSERVE_KV_VECTORS_H
#define KVSERVE_KV_VECTORS_H

/* How the cache stores values (kvserve/kv/quant.py, the reference; their codes in encodings.h): fp32 itself (RAW),
 * or codes with fp16 parameters per group: int8 and fp8 (e4m3) codes times a scale, a token's row of one KV head a group; int4
 * codes times a scale plus a zero point, in groups of int4_group(head_dim) values, two a byte (byte i of a
 * group: value i in the low nibble, value i + group / 2 in the high one), and keys stored rotated group by
 * group (each kernel rotates its queries alike as it starts, rotated_queries, so scores need nothing more). */
#include "../../kv/csrc/encodings.h"
#include "../../kv/csrc/int4_groups.h" /* int4_group, hadamard */
#include "../../csrc/vec_exp.h" /* exp_nonpositive_vec, the softmax's exponential */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned */
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline vec max_vec(vec a, vec b) {
    const ivec a_greater = a > b;
    return (vec)((a_greater & (ivec)a) | (~a_greater & (ivec)b));
}

/* VEC bytes widened to int32 lanes, sign- or zero-extended. GCC 12 scalarises __builtin_convertvector from a
 * byte vector (a byte extracted, extended and inserted per lane, on AVX2 and AVX-512 alike), which made every
 * quantized cache slower to read than fp32; one vpmovsxbd / vpmovzxbd does it. */
static inline ivec widen_signed(signed_byte_vec b) {
#if VEC == 16 && defined(__AVX512F__)
    __m128i x;
    memcpy(&x, &b, sizeof x);
    return (ivec)_mm512_cvtepi8_epi32(x);
#elif VEC == 8 && defined(__AVX2__)
    int64_t bits;
    memcpy(&bits, &b, sizeof bits);
    return (ivec)_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits));
#else
    return __builtin_convertvector(b, ivec);
#endif
}

static inline ivec widen_unsigned(byte_vec b) {
#if VEC == 16 && defined(__AVX512F__)
    __m128i x;
    memcpy(&x, &b, sizeof x);
    return (ivec)_mm512_cvtepu8_epi32(x);
#elif VEC == 8 && defined(__AVX2__)
    int64_t bits;
    memcpy(&bits, &b, sizeof bits);
    return (ivec)_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bits));
#else
    return __builtin_convertvector(b, ivec);
#endif
}

/* VEC int8 or fp8 codes as floats. An e4m3 code is built from its bits, exactly: (8 + mantissa) * 2^(e - 10)
 * for exponent e > 0, mantissa * 2^-9 for e == 0 (no fp32 denormals, so no flush-to-zero can change it). */
static inline vec codes_to_vec(const uint8_t *p, const int enc) {
    if (enc == INT8) {
        signed_byte_vec b;
        memcpy(&b, p, sizeof b);
        return __builtin_convertvector(widen_signed(b), vec);
    }
    byte_vec b;
    memcpy(&b, p, sizeof b);
    const ivec x = widen_unsigned(b), e = (x >> 3) & 15, normal = e != 0; /* all ones */
    const vec magnitude = __builtin_convertvector((x & 7) | (normal & 8), vec) * (vec)((e + normal + 118) << 23);
    return (vec)((ivec)magnitude | ((x & 0x80) << 24));
}


static inline float code_value(const uint8_t *p, int i, const int enc) {
    if (enc == INT8) return (float)(int8_t)p[i];
    const int x = p[i], e = (x >> 3) & 15;
    const float magnitude = e ? ldexpf((float)(8 + (x & 7)), e - 10) : ldexpf((float)(x & 7), -9);
    return x & 0x80 ? -magnitude : magnitude;
}

/* A group of int4 codes (n / 2 bytes at p) times scale plus zero, into out (n values). */
static inline __attribute__((always_inline)) void dequantize_int4_group(const uint8_t *p, const _Float16 *scale_zero,
                                                                        float *out, const int n) {
    const float scale = (float)scale_zero[0], zero = (float)scale_zero[1];
    const int half = n / 2;
    int j = 0;
    for (; j + VEC <= half; j += VEC) {
        byte_vec b;
        memcpy(&b, p + j, sizeof b);
        /* widened once, the nibbles split by int32 shifts: x86 has no byte shift, which GCC emulated */
        const ivec x = widen_unsigned(b);
        store(out + j, __builtin_convertvector(x & 15, vec) * scale + zero);
        store(out + half + j, __builtin_convertvector(x >> 4, vec) * scale + zero);
    }
    for (; j < half; j++) {
        out[j] = (float)(p[j] & 15) * scale + zero;
        out[half + j] = (float)(p[j] >> 4) * scale + zero;
    }
}

/* Query rows [0, num_rows) of q (num_heads * d values each, rows q_row_stride apart) rotated as int4 keys are
 * stored, group by group, into a new array of rows num_heads * d apart (the caller frees it): scores against
 * the stored keys are then those against the keys themselves. NULL if it cannot be allocated. */
static float *rotated_queries(const float *q, int64_t q_row_stride, int64_t num_rows, int num_heads, int d) {
    const int64_t row = (int64_t)num_heads * d;
    float *rotated = malloc(sizeof(float) * (size_t)(num_rows > 0 ? num_rows * row : 1));
    if (!rotated) return NULL;
    const int group = int4_group(d);
    for (int64_t r = 0; r < num_rows; r++) {
        memcpy(rotated + r * row, q + r * q_row_stride, sizeof(float) * (size_t)row);
        for (int64_t i = 0; i < row; i += group) hadamard(rotated + r * row + i, group);
    }
    return rotated;
}

/* The row of d values at value index row (a multiple of d), dequantized into out (int4 keys: as stored,
 * rotated). */
static inline __attribute__((always_inline)) void dequantize_row(const void *cache, const void *params,
                                                                 int64_t row, float *out, const int d,
                                                                 const int enc) {
    if (enc == INT4) {
        const int group = int4_group(d);
        const uint8_t *p = (const uint8_t *)cache + row / 2;
        const _Float16 *scale_zero = (const _Float16 *)params + row / group * 2;
        for (int g = 0; g < d; g += group) dequantize_int4_group(p + g / 2, scale_zero + g / group * 2, out + g, group);
        return;
    }
    const uint8_t *p = (const uint8_t *)cache + row;
    const float scale = (float)((const _Float16 *)params)[row / d];
    int i = 0;
    for (; i + VEC <= d; i += VEC) store(out + i, codes_to_vec(p + i, enc) * scale);
    for (; i < d; i++) out[i] = code_value(p, i, enc) * scale;
}

#endif
