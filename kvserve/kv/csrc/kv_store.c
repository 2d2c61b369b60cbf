/* A step's new keys and values into their slots of a CPU paged KV cache, quantized on the way where the cache is
 * (kvserve/kv/quant.py's encodings, bit for bit: that module is the twin the tests compare against).
 *
 * Why: storing through torch costs a dispatch per op, and quantizing a row takes a dozen ops (abs, amax, the
 * fp16 rounding of the scale, a reciprocal, the rounding, a clamp, casts, then an index_copy_ per tensor). A
 * one-stream decode step of SmolLM2 with an int8 cache spent 20 ms of its 34 ms in those 1,300 calls, and an
 * unquantized cache's two index_copy_ calls a layer were 0.9 ms of a 12.6 ms step. Here one call stores a layer.
 *
 * Cache layout (kv/storage.py): data [slots, num_kv_heads, head_dim / values per element], parameters [slots,
 * num_kv_heads, params per row] in fp16, each group's in order. int8 and fp8 take one token's row of one KV head
 * as their group; int4 takes groups of the largest power of two dividing head_dim, at most 64, and rotates
 * each group of a key by the normalized Walsh-Hadamard transform first (quant.py says why):
 *
 *     int8  s = fp16 not below max|x| / 127,  q = round_half_even(x * (1 / s)) clamped to [-127, 127]
 *     fp8   s = fp16 not below max|x| / 448,  f = e4m3(x * (1 / s) clamped to [-448, 448]), rounded to nearest even
 *     int4  z = fp16(min x), s = fp16((max x - z) / 15),  q = round_half_even((x - z) * (1 / s)) in [0, 15],
 *           value i of a group in the low nibble of its byte i, value i + group / 2 in that byte's high nibble
 *
 * (1 / s is 0 where s is 0: an all-zero row.) Every step is the reference's own fp32 operation in its order, so
 * finite inputs give the same bits (a NaN gives a NaN scale, its codes unspecified); this file is built without
 * contracting a multiply and an add into one FMA, which would round once where torch rounds twice.
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "encodings.h"
#include "int4_groups.h"

#define FP16_MAX 65504.0f
#define ROUNDING 12582912.0f /* 1.5 * 2^23: x + C - C rounds x to an integer, half to even, for |x| < 2^22 */

static inline uint16_t half_bits(float x) { /* round to nearest even */
    const _Float16 h = (_Float16)x;
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
}

static inline float half_value(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

/* The fp16 nearest to `scale` (>= 0) that is not below it, up to fp16's largest (quant.py's _half_at_least). */
static inline uint16_t half_at_least(float scale) {
    const uint16_t bits = half_bits(scale > FP16_MAX ? FP16_MAX : scale); /* a NaN stays NaN, as in clamp */
    /* positive: the next fp16 up is bits + 1; fp16's largest (0x7BFF) is never stepped past, to inf */
    return half_value(bits) < scale && bits < 0x7BFF ? (uint16_t)(bits + 1) : bits;
}

static inline float reciprocal(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

static inline float round_even(float x) { return x + ROUNDING - ROUNDING; } /* the reference's add_, then sub_ */

static inline float clamp(float x, float low, float high) { return x < low ? low : x > high ? high : x; }

/* A rounded value's integer code, clamped; a NaN's is 0: its group's parameters are NaN, so any code reads back
 * as NaN, and a NaN cast to an integer is undefined in C (UBSan). */
static inline int code_of(float x, float low, float high) { return x == x ? (int)clamp(x, low, high) : 0; }

/* float -> float8 e4m3fn bits, rounded to nearest even (|x| <= 448 here: no overflow to NaN). */
static inline uint8_t e4m3_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t code;
    if (bits >= 0x43F00000u) { /* 480 and up (and NaN): e4m3fn's NaN */
        code = 0x7F;
    } else if (bits < (121u << 23)) {
        /* under 2^-6: a subnormal, a multiple of 2^-9. Added to 2^14, whose fp32 grid step is 2^-9, the value
         * is rounded to that grid (half to even) and lands in the sum's low mantissa bits: the code itself */
        const uint32_t two_to_14 = 141u << 23;
        float magnitude, base;
        memcpy(&magnitude, &bits, sizeof magnitude);
        memcpy(&base, &two_to_14, sizeof base);
        const float sum = magnitude + base;
        uint32_t sum_bits;
        memcpy(&sum_bits, &sum, sizeof sum_bits);
        code = (uint8_t)(sum_bits - two_to_14);
    } else { /* normal: rebias the exponent (127 -> 7), round the 23-bit mantissa to 3 bits, half to even */
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        code = (uint8_t)(bits >> 20);
    }
    return code | (uint8_t)(sign >> 24);
}

/* One group of n values into int8 codes and its fp16 scale. */
static void quantize_int8(const float *x, int n, int8_t *codes, uint16_t *params) {
    float top = 0.0f;
    for (int i = 0; i < n; i++) top = fabsf(x[i]) > top || isnan(x[i]) ? fabsf(x[i]) : top;
    params[0] = half_at_least(top / 127.0f);
    const float inverse = reciprocal(half_value(params[0]));
    for (int i = 0; i < n; i++) codes[i] = (int8_t)code_of(round_even(x[i] * inverse), -127.0f, 127.0f);
}

static void quantize_fp8(const float *x, int n, uint8_t *codes, uint16_t *params) {
    float top = 0.0f;
    for (int i = 0; i < n; i++) top = fabsf(x[i]) > top || isnan(x[i]) ? fabsf(x[i]) : top;
    params[0] = half_at_least(top / 448.0f);
    const float inverse = reciprocal(half_value(params[0]));
    for (int i = 0; i < n; i++) codes[i] = e4m3_bits(clamp(x[i] * inverse, -448.0f, 448.0f));
}

/* A group of n values (even) into n / 2 bytes and (scale, zero point). */
static void quantize_int4(const float *x, int n, uint8_t *packed, uint16_t *params) {
    float low = x[0] + 0.0f, high = low; /* -0 as 0, as the reference; a NaN wins both, as in amin / amax */
    for (int i = 1; i < n; i++) {
        low = x[i] < low || isnan(x[i]) ? x[i] + 0.0f : low;
        high = x[i] > high || isnan(x[i]) ? x[i] + 0.0f : high;
    }
    const float zero = half_value(half_bits(clamp(low, -FP16_MAX, FP16_MAX)));
    const float range = (high - zero) / 15.0f;
    const uint16_t scale = half_bits(range > FP16_MAX ? FP16_MAX : range);
    const float inverse = reciprocal(half_value(scale));
    const int half = n / 2;
    for (int i = 0; i < half; i++) {
        const int first = code_of(round_even((x[i] - zero) * inverse), 0.0f, 15.0f);
        const int second = code_of(round_even((x[i + half] - zero) * inverse), 0.0f, 15.0f);
        packed[i] = (uint8_t)(first | second << 4);
    }
    params[0] = scale, params[1] = half_bits(zero);
}

/* One row of head_dim values into int4 groups of `group` values, each group rotated first where `rotate`. */
static void quantize_int4_row(const float *x, int head_dim, int group, int rotate, uint8_t *packed,
                              uint16_t *params) {
    float rotated[head_dim];
    if (rotate) {
        memcpy(rotated, x, sizeof rotated);
        for (int g = 0; g < head_dim; g += group) hadamard(rotated + g, group);
        x = rotated;
    }
    for (int g = 0; g < head_dim; g += group) quantize_int4(x + g, group, packed + g / 2, params + g / group * 2);
}

/* One tensor (K or V: `keys`) of num_tokens tokens, rows `stride` elements apart in src, into slots of data and
 * params. RAW copies elem_size-byte values as they are. */
static void store(void *data, uint16_t *params, const void *src, int64_t stride, const int64_t *slots,
                  int num_tokens, int num_heads, int head_dim, int elem_size, int encoding, int keys) {
    const int64_t row = (int64_t)num_heads * head_dim; /* values of one token */
    const int group = encoding == INT4 ? int4_group(head_dim) : head_dim;
    const int param_count = encoding == INT4 ? 2 * (head_dim / group) : 1; /* per row */
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (encoding == RAW) {
            memcpy((char *)data + slot * row * elem_size, (const char *)src + t * stride * elem_size,
                   (size_t)(row * elem_size));
            continue;
        }
        for (int h = 0; h < num_heads; h++) {
            const float *x = (const float *)src + t * stride + (int64_t)h * head_dim;
            uint16_t *group_params = params + (slot * num_heads + h) * param_count;
            if (encoding == INT8)
                quantize_int8(x, head_dim, (int8_t *)data + slot * row + (int64_t)h * head_dim, group_params);
            else if (encoding == FP8)
                quantize_fp8(x, head_dim, (uint8_t *)data + slot * row + (int64_t)h * head_dim, group_params);
            else
                quantize_int4_row(x, head_dim, group, keys, (uint8_t *)data + (slot * row + (int64_t)h * head_dim) / 2,
                                  group_params);
        }
    }
}

/* k [num_tokens, num_heads, head_dim] (token rows k_stride elements apart, heads and values contiguous) and v
 * likewise into slot slots[t] of the cache's K and V (params NULL for RAW). RAW takes values of elem_size bytes;
 * the quantized encodings take fp32. Returns 0, or -1 if a slot is outside [0, num_slots): nothing is written. */
int kvserve_store_kv(void *k_data, void *v_data, uint16_t *k_params, uint16_t *v_params, const void *k,
                     int64_t k_stride, const void *v, int64_t v_stride, const int64_t *slots, int num_tokens,
                     int num_heads, int head_dim, int elem_size, int encoding, int64_t num_slots) {
    for (int t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    store(k_data, k_params, k, k_stride, slots, num_tokens, num_heads, head_dim, elem_size, encoding, 1);
    store(v_data, v_params, v, v_stride, slots, num_tokens, num_heads, head_dim, elem_size, encoding, 0);
    return 0;
}
