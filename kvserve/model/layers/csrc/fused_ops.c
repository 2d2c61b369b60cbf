/* The elementwise work between a decoder layer's GEMMs, one pass per op (fp32):
 *
 *   add_rms_norm     residual += x (or += norm_x(x), Gemma's sandwich norm); out = norm(residual)
 *   rotary           q and k rotated in place inside the packed qkv rows (the half-split convention)
 *   act_and_mul      out = act(gate) * up from the packed gate_up rows (SiLU, or GELU's tanh form)
 *
 * A norm is x / rms(x) * (weight + offset): offset 0 for Llama's weights, 1 for Gemma's (1 + weight).
 *
 * Vectors are GNU vector types of the build's width (8 floats on AVX2, 16 on AVX-512), a row's last partial
 * vector zero-padded, so any size works; the exponential is the vector one of kvserve/csrc/vec_exp.h (libm's
 * expf stays scalar under GCC 12 without -ffast-math). Rows are split across OpenMP threads only when each thread
 * gets enough floats to pay for waking it.
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8
#endif
/* Waking a second thread costs microseconds, and much more when another process holds that core: a decode step
 * (up to 16 rows of 1,536 floats) runs on one, a prefill chunk on all. */
#define MIN_FLOATS_PER_THREAD 32768

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VEC * sizeof(int32_t))));

#include "../../../csrc/vec_exp.h" /* exp_vec, for the activations */

/* The first n (<= VEC) floats at p, the rest of the vector zero. */
static inline vec load(const float *p, int n) {
    vec v = {0};
    if (n == VEC)
        memcpy(&v, p, sizeof v);
    else
        memcpy(&v, p, n * sizeof(float));
    return v;
}

static inline void store(float *p, vec v, int n) {
    if (n == VEC)
        memcpy(p, &v, sizeof v);
    else
        memcpy(p, &v, n * sizeof(float));
}

/* Runs the block (the last argument) for i = 0, VEC, 2 VEC .. below n, w the width of the vector at i: the
 * constant VEC (so that the block's loads and stores compile to plain vector moves), then n - i for a partial
 * last one. */
#define FOR_EACH_VEC(i, w, n, ...)                                                                                \
    do {                                                                                                          \
        int i = 0;                                                                                                \
        for (const int w = VEC; i + VEC <= (n); i += VEC) __VA_ARGS__                                             \
        if (i < (n)) {                                                                                            \
            const int w = (n) - i;                                                                                \
            __VA_ARGS__                                                                                           \
        }                                                                                                         \
    } while (0)

static inline float horizontal_sum(vec v) {
    float lanes[VEC], total = 0.0f;
    memcpy(lanes, &v, sizeof lanes);
    for (int i = 0; i < VEC; i++) total += lanes[i];
    return total;
}

/* 1 / rms(x) of n floats. */
static inline float inv_rms(const float *x, int n, float eps) {
    vec sum = {0};
    FOR_EACH_VEC(i, w, n, {
        const vec v = load(x + i, w);
        sum += v * v;
    });
    return 1.0f / __builtin_sqrtf(horizontal_sum(sum) / n + eps);
}

static int num_threads_for(int64_t num_floats, int num_threads) {
    const int64_t useful = num_floats / MIN_FLOATS_PER_THREAD;
    return useful < 1 ? 1 : useful < num_threads ? (int)useful : num_threads;
}

/* One row of add_rms_norm: out = norm(x) without a residual; else residual += x (or norm_x(x) when x_weight is
 * given), out = norm(residual). */
static void add_rms_norm_row(float *out, float *residual, const float *x, const float *x_weight, const float *weight,
                             float offset, float eps, int n) {
    if (!residual) {
        const float scale = inv_rms(x, n, eps);
        FOR_EACH_VEC(i, w, n, { store(out + i, load(x + i, w) * scale * (load(weight + i, w) + offset), w); });
        return;
    }
    const float x_scale = x_weight ? inv_rms(x, n, eps) : 1.0f;
    vec sum = {0};
    FOR_EACH_VEC(i, w, n, {
        vec v = load(x + i, w);
        if (x_weight) v = v * x_scale * (load(x_weight + i, w) + offset);
        const vec r = load(residual + i, w) + v;
        store(residual + i, r, w);
        sum += r * r;
    });
    const float scale = 1.0f / __builtin_sqrtf(horizontal_sum(sum) / n + eps);
    FOR_EACH_VEC(i, w, n, { store(out + i, load(residual + i, w) * scale * (load(weight + i, w) + offset), w); });
}

/* Over `rows` rows of n floats (each tensor's rows its own stride apart): residual += x, or residual +=
 * norm_x(x) with norm_x's weight x_weight (NULL: none); then out = norm(residual). Without a residual (NULL),
 * out = norm(x). Both norms share `offset` and `eps`. residual may not overlap out or x. */
void kvserve_add_rms_norm_f32(float *out, int64_t out_stride, float *residual, int64_t residual_stride,
                              const float *x, int64_t x_stride, const float *x_weight, const float *weight,
                              float offset, float eps, int rows, int n, int num_threads) {
    const int threads = num_threads_for((int64_t)rows * n, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++)
        add_rms_norm_row(out + r * out_stride, residual ? residual + r * residual_stride : NULL, x + r * x_stride,
                         x_weight, weight, offset, eps, n);
}

/* In place, each of num_heads heads of head_dim floats at the start of each of `rows` rows (row_stride apart):
 * head = norm(head), weight [head_dim] (+ offset): the per-head q / k norms of Qwen3 and Gemma 3. */
void kvserve_head_rms_norm_f32(float *x, int64_t row_stride, const float *weight, float offset, float eps, int rows,
                               int num_heads, int head_dim, int num_threads) {
    const int threads = num_threads_for((int64_t)rows * num_heads * head_dim, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < num_heads; h++) {
            float *head = x + r * row_stride + (int64_t)h * head_dim;
            add_rms_norm_row(head, NULL, head, NULL, weight, offset, eps, head_dim);  /* reads it all, then writes */
        }
}

/* Rotates, in place, num_heads heads of head_dim floats at the start of each of `rows` rows (row_stride apart):
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves, cos and sin [rows, head_dim / 2]. */
void kvserve_rotary_f32(float *x, int64_t row_stride, const float *cos, const float *sin, int rows, int num_heads,
                        int head_dim, int num_threads) {
    const int half = head_dim / 2;
    const int threads = num_threads_for((int64_t)rows * num_heads * head_dim, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (int64_t)r * half, *s = sin + (int64_t)r * half;
        for (int h = 0; h < num_heads; h++) {
            float *x1 = x + r * row_stride + h * head_dim, *x2 = x1 + half;
            FOR_EACH_VEC(i, w, half, {
                const vec a = load(x1 + i, w), b = load(x2 + i, w), cv = load(c + i, w), sv = load(s + i, w);
                store(x1 + i, a * cv - b * sv, w);
                store(x2 + i, b * cv + a * sv, w);
            });
        }
    }
}

enum { SILU = 0, GELU_TANH = 1 };

/* x * sigmoid(a(x)): a(x) = x is SiLU; a(x) = 2 sqrt(2 / pi) (x + 0.044715 x^3) is GELU's tanh form, since
 * (1 + tanh(y)) / 2 = sigmoid(2y). */
static inline __attribute__((always_inline)) vec activate(vec x, int activation) {
    vec a = x;
    if (activation == GELU_TANH) a = 1.5957691216057308f * (x + 0.044715f * x * x * x);
    /* x * sigmoid(a); where exp_vec's clamp holds exp(-a) below its value the sigmoid is 0 in fp32, so x times 0
     * (x / (1 + 2e38) gave -0.45 at x = -1e38; x = -inf gives NaN, as the twin's x * sigmoid) */
    return select_lanes(a < (vec){0} - 88.3f, x * 0.0f, x / (1.0f + exp_vec(-a)));
}

/* out [rows, n] = act(gate) * up, gate and up the two halves of each gate_up row [2n] (in_stride apart). */
void kvserve_act_and_mul_f32(float *out, int64_t out_stride, const float *gate_up, int64_t in_stride, int rows,
                             int n, int activation, int num_threads) {
    const int threads = num_threads_for((int64_t)rows * n, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + r * in_stride, *up = gate + n;
        float *y = out + r * out_stride;
        if (activation == GELU_TANH)
            FOR_EACH_VEC(i, w, n, { store(y + i, activate(load(gate + i, w), GELU_TANH) * load(up + i, w), w); });
        else
            FOR_EACH_VEC(i, w, n, { store(y + i, activate(load(gate + i, w), SILU) * load(up + i, w), w); });
    }
}
