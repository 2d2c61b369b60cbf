/* Each row's argmax over fp32 values: the index of the first of equal maxima, a NaN counting as larger than
 * any number (the first NaN wins), as torch.argmax gives it.
 *
 * Why: greedy decoding and the exponential race of random sampling take one argmax a row of logits each step.
 * torch's CPU reductions that return indices walk a row one element at a time: a 262,144-token row (Gemma 3)
 * took 0.3 ms (max(dim)) to 0.5 ms (argmax), 1.5% of a one-stream decode step, and 16 rows 2.8 ms. Here a row is
 * two vector passes: the maximum (and whether a NaN is there), then the first position that holds it, which
 * finds the row still in cache. A row long enough is split among the threads, each part's answer then merged in
 * order.
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16 /* one register */
#else
#define LANES 8 /* one AVX2 register: a wider GNU vector is split and spilled */
#endif
#define CHAINS 4
#define MIN_PART 32768 /* values: a smaller part costs more in the threads' start than it saves */

typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t flags __attribute__((vector_size(LANES * sizeof(int32_t))));

/* Whether any lane is set: one test instruction (a loop over the lanes costs the vector pass its speed). */
static inline int any_lane(flags f) {
#if defined(__AVX512F__)
    __m512i v;
    __builtin_memcpy(&v, &f, sizeof v);
    return _mm512_test_epi32_mask(v, v) != 0;
#elif defined(__AVX2__)
    __m256i v;
    __builtin_memcpy(&v, &f, sizeof v);
    return !_mm256_testz_si256(v, v);
#else
    int any = 0;
    for (int j = 0; j < LANES; j++) any |= f[j] != 0;
    return any;
#endif
}

/* A part of a row: its largest value's first index, or its first NaN's (nan set); -1 for an empty part. */
struct part_max {
    int64_t index;
    float value;
    int nan;
};

static struct part_max scan(const float *x, int64_t begin, int64_t end) {
    struct part_max best = {-1, -INFINITY, 0};
    if (begin >= end) return best;
    /* pass 1: the maximum, and whether any value is NaN (x != x); CHAINS running maxima, so that a compare and
     * blend's latency is not paid a vector at a time */
    lanes top[CHAINS];
    flags any_nan = {0};
    for (int c = 0; c < CHAINS; c++)
        for (int j = 0; j < LANES; j++) top[c][j] = -INFINITY;
    int64_t i = begin;
    for (; i + CHAINS * LANES <= end; i += CHAINS * LANES)
        for (int c = 0; c < CHAINS; c++) {
            lanes v;
            __builtin_memcpy(&v, x + i + c * LANES, sizeof v);
            const flags larger = v > top[c]; /* all ones where v is larger (never where either is NaN) */
            top[c] = (lanes)(((flags)v & larger) | ((flags)top[c] & ~larger));
            any_nan |= v != v;
        }
    float value = -INFINITY;
    int nan = 0;
    for (int c = 0; c < CHAINS; c++)
        for (int j = 0; j < LANES; j++) value = top[c][j] > value ? top[c][j] : value;
    nan = any_lane(any_nan);
    for (; i < end; i++) {
        value = x[i] > value ? x[i] : value;
        nan |= x[i] != x[i];
    }
    /* pass 2: the first position holding it (a row of -inf only: its first value), a vector of lanes at a time
     * (a loop that may exit early is never vectorized by the compiler: one value a cycle or less) */
    for (i = begin; i + LANES <= end; i += LANES) {
        lanes v;
        __builtin_memcpy(&v, x + i, sizeof v);
        const flags hit = nan ? v != v : v == value;
        if (any_lane(hit)) break;
    }
    for (; i < end; i++)
        if (nan ? x[i] != x[i] : x[i] == value) break;
    best.index = i, best.value = nan ? NAN : value, best.nan = nan;
    return best;
}

/* out[r] = the first argmax of row r of x [rows, n] (rows `stride` values apart), n >= 1. */
void kvserve_first_max(int64_t *out, const float *x, int64_t stride, int rows, int64_t n, int num_threads) {
    int parts = 1;
    if (rows < num_threads) {
        parts = (num_threads + rows - 1) / rows;
        const int64_t most = n / MIN_PART > 1 ? n / MIN_PART : 1;
        parts = parts < most ? parts : (int)most;
    }
    struct part_max *found = malloc((size_t)rows * parts * sizeof *found);
    if (!found) parts = 1;
    const int threads = (int)((int64_t)rows * parts < num_threads ? (int64_t)rows * parts : num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (int64_t)rows * n >= MIN_PART)
    for (int64_t item = 0; item < (int64_t)rows * parts; item++) {
        const int64_t r = item / parts, p = item % parts;
        const struct part_max m = scan(x + r * stride, n * p / parts, n * (p + 1) / parts);
        if (found) found[item] = m;
        else out[r] = m.index;
    }
    if (!found) return;
    for (int r = 0; r < rows; r++) { /* parts in order: a later one wins only with a larger value or a first NaN */
        struct part_max best = found[(int64_t)r * parts];
        for (int p = 1; p < parts; p++) {
            const struct part_max m = found[(int64_t)r * parts + p];
            if (m.index < 0 || best.nan) continue;
            if (m.nan || m.value > best.value || best.index < 0) best = m;
        }
        out[r] = best.index;
    }
    free(found);
}
