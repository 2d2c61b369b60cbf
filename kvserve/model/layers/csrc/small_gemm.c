/* y = x W^T (+ bias) for the few rows of a decode step (fp32), over a weight laid out once in column panels.
 *
 * Panel layout: W [N, K] becomes ceil(N / PANEL) panels of PANEL output columns; panel p holds, for each k in
 * 0 .. K-1, the PANEL weights W[p * PANEL + j, k] side by side (the last panel padded with zeros), so a panel is
 * one contiguous run that a tile of rows streams once, k after k, as vector loads.
 *
 * Why not oneDNN here: at 1-32 rows a step's GEMMs are bound by reading the weights from memory, and on the
 * machines we measured (2 vCPUs, each core alone reaches ~10 GB/s) a core does not overlap those reads with
 * its FMAs unless told: the time was the sum of the two. Each tile therefore prefetches the next panel while it
 * computes on this one (measured at SmolLM2-135M's shapes, one step's GEMMs: 16 rows 39 ms against oneDNN's
 * 47, one row 26 against 32; from ~40 rows up oneDNN's blocked kernels win, and the caller switches).
 *
 * Each output element is one chain of FMAs over k in order, whatever the number of rows: a row's result does
 * not depend on what else is in the step.
 *
 * No torch headers: called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <string.h>

#define VEC 16                    /* floats per vector (one AVX-512 register) */
#define PANEL (2 * VEC)           /* output columns per panel: two vectors */
#if defined(__AVX512F__)
#define TILE_ROWS 8               /* 8 rows x 2 vectors = 16 of the 32 vector registers hold the sums */
#else
#define TILE_ROWS 4               /* 16 vector registers (AVX2): a 64-byte vector is two of them */
#endif

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* rows x PANEL outputs of one panel; prefetch: also pull the next panel (of as many floats) toward the cache. */
static inline __attribute__((always_inline)) void tile(const int rows, const int prefetch, const float *x,
                                                       int64_t x_stride, const float *panel, int k_dim,
                                                       float *y, int64_t y_stride, int num_cols,
                                                       const float *bias) {
    vec sum[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) sum[r][0] = sum[r][1] = (vec){0};
    const float *next_panel = panel + (int64_t)k_dim * PANEL;
    for (int k = 0; k < k_dim; k++) {
        const float *w = panel + (int64_t)k * PANEL;
        if (prefetch) {
            __builtin_prefetch(next_panel + (int64_t)k * PANEL, 0, 2);
            __builtin_prefetch(next_panel + (int64_t)k * PANEL + VEC, 0, 2);
        }
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
static void tile_of(int rows, int prefetch, const float *x, int64_t x_stride, const float *panel, int k_dim,
                    float *y, int64_t y_stride, int num_cols, const float *bias) {
#define ROWS(n)                                                                                                   \
    case n:                                                                                                       \
        if (prefetch) tile(n, 1, x, x_stride, panel, k_dim, y, y_stride, num_cols, bias);                         \
        else tile(n, 0, x, x_stride, panel, k_dim, y, y_stride, num_cols, bias);                                  \
        return;
    switch (rows) {
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if TILE_ROWS > 4
        ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#endif
    }
#undef ROWS
}

/* Floats per panel column group and whether the build has AVX-512 (where the kernel was measured to win). */
int kvserve_small_gemm_panel(void) { return PANEL; }
int kvserve_small_gemm_tuned(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart) times the panels of W [n, k], plus bias
 * (NULL: none). Threads split the panels; the last row tile of each panel prefetches the next one. */
void kvserve_small_gemm_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, const float *panels,
                            const float *bias, int m, int n, int k, int num_threads) {
    const int num_panels = (n + PANEL - 1) / PANEL, last_tile = (m - 1) / TILE_ROWS * TILE_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int p = 0; p < num_panels; p++) {
        const float *panel = panels + (int64_t)p * k * PANEL;
        const int num_cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int r = 0; r < m; r += TILE_ROWS)
            tile_of(m - r < TILE_ROWS ? m - r : TILE_ROWS, r == last_tile && p + 1 < num_panels,
                    x + r * x_stride, x_stride, panel, k, y + r * y_stride + p * PANEL, y_stride, num_cols,
                    bias ? bias + p * PANEL : NULL);
    }
}
