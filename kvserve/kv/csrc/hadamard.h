/* The normalized Walsh-Hadamard transform that int4 KV applies to each group of a key before quantizing it
 * (kvserve/kv/quant.py's hadamard says why): the KV store rotates keys with it, and the attention kernels rotate
 * their queries alike, so that a query's dot product with a stored key is the one with the key itself. Part of
 * the build key of every kernel that includes it (kvserve.native hashes what a source includes). */
#ifndef KVSERVE_HADAMARD_H
#define KVSERVE_HADAMARD_H

#include <math.h>

/* x (n values, a power of two) times the normalized Walsh-Hadamard matrix, in place: log2(n) stages of
 * butterflies (a + b, a - b), then a multiply by 1 / sqrt(n), the fp32 operations of quant.py's hadamard in
 * the same order, so a key rotated here has the bits of one rotated there. */
static inline void hadamard(float *x, int n) {
    for (int span = 1; span < n; span *= 2)
        for (int i = 0; i < n; i += 2 * span)
            for (int j = i; j < i + span; j++) {
                const float a = x[j], b = x[j + span];
                x[j] = a + b, x[j + span] = a - b;
            }
    const float scale = (float)(1.0 / sqrt((double)n));
    for (int i = 0; i < n; i++) x[i] *= scale;
}

#endif
