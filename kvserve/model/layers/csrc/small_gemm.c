/* y = x W^T (+ bias) for the few rows of a decode step (fp32), over a weight laid out once in column panels.
 *
 * Panel layout: W [N, K] becomes ceil(N / PANEL) panels of PANEL output columns; panel p holds, for each k in
 * 0 .. K-1, the PANEL weights W[p * PANEL + j, k] side by side (the last panel padded with zeros), so a panel is
 * one contiguous run that a tile of rows streams once, k after k, as vector loads.
 *
 * Why not oneDNN here: up to about a hundred rows a step's GEMMs are bound by reading the weights from memory,
 * and on the machines we measured (2 vCPUs, each core alone reaches ~10 GB/s) a core does not overlap those
 * reads with its FMAs unless told: the time was the sum of the two. Each panel's row tiles therefore prefetch
 * the next panel between them, a line every few k, while they compute on this one (bursts of prefetches are
 * dropped). Measured at SmolLM2-135M's shapes, one step's GEMMs: 16 rows 37 ms against oneDNN's 47, 64 rows 94
 * against 124, one row 25 against 33 (2-vCPU Xeon, AVX-512); from ~112 rows up oneDNN's blocked kernels are as
 * fast, and the caller switches. On AVX2 (2-core AMD EPYC Zen 2, other jobs on the cores, same run): one row
 * 32.8 ms against oneDNN's 41.8, 16 rows 78 against 117, 64 rows 265 against 321, 96 rows 386 against 437.
 *
 * Each output element is one chain of FMAs over k in order, whatever the number of rows: a row's result does
 * not depend on what else is in the step.
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16                    /* floats per vector: one AVX-512 register */
#define TILE_ROWS 8               /* 8 rows x 2 vectors = 16 of the 32 vector registers hold the sums */
#else
#define VEC 8                     /* one AVX2 register: a wider GNU vector is split and spilled (50x slower) */
#define TILE_ROWS 6               /* 6 rows x 2 vectors = 12 of the 16 registers, 2 for weights, 1 for x */
#endif
#define PANEL (2 * VEC)           /* output columns per panel: two vectors */
#define FLOATS_PER_LINE 16

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* rows x PANEL outputs of one panel, pulling num_lines cache lines from `ahead` toward the cache on the way
 * (spread evenly over the k loop: prefetches issued in a burst are dropped). */
static inline __attribute__((always_inline)) void tile(const int rows, const float *x, int64_t x_stride,
                                                       const float *panel, int k_dim, const float *ahead,
                                                       int num_lines, float *y, int64_t y_stride, int num_cols,
                                                       const float *bias) {
    vec sum[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) sum[r][0] = sum[r][1] = (vec){0};
    int owed = 0; /* in units of 1 / k_dim lines */
    for (int k = 0; k < k_dim; k++) {
        const float *w = panel + (int64_t)k * PANEL;
        for (owed += num_lines; owed >= k_dim; owed -= k_dim, ahead += FLOATS_PER_LINE)
            __builtin_prefetch(ahead, 0, 2);
        const vec w0 = load(w), w1 = load(w + VEC);
        for (int r = 0; r < rows; r++) {
            const float x_rk = x[r * x_stride + k];
            sum[r][0] += x_rk * w0;
            sum[r][1] += x_rk * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        float out[PANEL];
        memcpy(out, sum[r], sizeof out);
        if (bias)
            for (int j = 0; j < num_cols; j++) out[j] += bias[j];
        memcpy(y + r * y_stride, out, num_cols * sizeof(float));
    }
}

/* tile() with the row count a compile-time constant, so its loops unroll into registers. */
static void tile_of(int rows, const float *x, int64_t x_stride, const float *panel, int k_dim, const float *ahead,
                    int num_lines, float *y, int64_t y_stride, int num_cols, const float *bias) {
#define ROWS(n)                                                                                                   \
    case n:                                                                                                       \
        tile(n, x, x_stride, panel, k_dim, ahead, num_lines, y, y_stride, num_cols, bias);                        \
        return;
    switch (rows) {
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if TILE_ROWS > 6
        ROWS(7) ROWS(8)
#endif
    }
#undef ROWS
}

/* Floats per panel column group (32 on AVX-512, 16 on AVX2), and the vector ISA of the build where the kernel
 * was measured (2: AVX-512, 1: AVX2 with FMA, 0: neither: not tuned). */
int kvserve_small_gemm_panel(void) { return PANEL; }
int kvserve_small_gemm_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart) times the panels of W [n, k], plus bias
 * (NULL: none). Threads split the panels; the row tiles of a panel share the prefetching of the next one. */
void kvserve_small_gemm_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, const float *panels,
                            const float *bias, int m, int n, int k, int num_threads) {
    const int num_panels = (n + PANEL - 1) / PANEL, num_tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    const int panel_lines = k * PANEL / FLOATS_PER_LINE;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int p = 0; p < num_panels; p++) {
        const float *panel = panels + (int64_t)p * k * PANEL;
        const int num_cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        const int next_lines = p + 1 < num_panels ? panel_lines : 0;
        for (int t = 0; t < num_tiles; t++) {
            const int first = (int)((int64_t)next_lines * t / num_tiles);
            const int last = (int)((int64_t)next_lines * (t + 1) / num_tiles);
            const int r = t * TILE_ROWS;
            tile_of(m - r < TILE_ROWS ? m - r : TILE_ROWS, x + r * x_stride, x_stride, panel, k,
                    panel + (int64_t)k * PANEL + (int64_t)first * FLOATS_PER_LINE, last - first,
                    y + r * y_stride + p * PANEL, y_stride, num_cols, bias ? bias + p * PANEL : NULL);
        }
    }
}
