/* exp(x) on a whole vector of floats, for the kernels whose elementwise work needs it: the attention kernels'
 * softmax (through attention/csrc/kv_vectors.h) and fused_ops.c's SiLU and GELU. 2^n * p(r) with r = x - n ln2,
 * |r| <= ln2 / 2, and Cephes' polynomial p: relative error about 2e-7. Written in GNU vector arithmetic because
 * GCC 12 leaves libm's expf (and floorf) scalar without -ffast-math. The includer defines vec (VEC floats) and
 * ivec (VEC int32) first. Part of each includer's build key (kvserve.native hashes what a source includes). */
#ifndef KVSERVE_VEC_EXP_H
#define KVSERVE_VEC_EXP_H

/* a where mask is set, else b: comparisons give all-ones lanes, which select by bitwise and/or. */
static inline vec select_lanes(ivec mask, vec a, vec b) { return (vec)((mask & (ivec)a) | (~mask & (ivec)b)); }

/* 2^n * exp(x - n ln2), for n the integer nearest x / ln2 and x where 2^n is a normal float: ln2 is taken in two
 * parts, the first exact in few bits, so that x - n ln2 loses nothing. Always inlined: left to GCC's inliner,
 * paged_decode.c compiled to other code than when each kernel wrote its exponential out in full. */
static inline __attribute__((always_inline)) vec exp_reduced(vec x, ivec n) {
    const vec nf = __builtin_convertvector(n, vec);
    const vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vec p = (vec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vec)((n + 127) << 23);
}

/* exp(x) for any x, clamped to [-87.3, 88.3] so that 2^n stays a normal float: exp(-100) comes out 1e-38 rather
 * than 4e-44, and exp(100) 2e38 rather than inf (a caller whose result that changes takes those lanes apart:
 * fused_ops.c's activate). */
static inline vec exp_vec(vec x) {
    const vec lo = (vec){0} - 87.3f, hi = (vec){0} + 88.3f;
    x = select_lanes(x < lo, lo, select_lanes(x > hi, hi, x));
    const vec z = x * 1.44269504088896341f + 0.5f;
    ivec n = __builtin_convertvector(z, ivec); /* truncates toward zero; floor below */
    n += (ivec)(__builtin_convertvector(n, vec) > z);
    return exp_reduced(x, n);
}

/* exp(x) for x <= 0 (a softmax's scores less their max): exactly 0 below -87 (and for -inf), where the float
 * result would be denormal. x / ln2 - 1/2 is negative here, so truncating it rounds x / ln2 to an integer
 * without exp_vec's floor step. */
static inline vec exp_nonpositive_vec(vec x) {
    const vec lowest = (vec){0} - 87.0f;
    const ivec keep = x >= lowest; /* all ones where the result is not flushed to 0 (-inf included) */
    x = select_lanes(keep, x, lowest);
    const ivec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec);
    return (vec)((ivec)exp_reduced(x, n) & keep);
}

#endif
