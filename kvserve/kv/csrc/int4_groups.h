/* int4 KV's groups (kvserve/kv/quant.py's KVCacheDtype.group_size), and the normalized Walsh-Hadamard
 * transform applied to each group of a key before it is quantized (quant.py's hadamard says why): the KV store
 * rotates keys with it, and the attention kernels rotate their queries alike, so that a query's dot product with
 * a stored key is the one with the key itself. Part of the build key of every kernel that includes it
 * (kvserve.native hashes what a source includes). */
#ifndef KVSERVE_INT4_GROUPS_H
#define KVSERVE_INT4_GROUPS_H

#include <math.h>

#define INT4_MAX_GROUP 64 /* quant.py's INT4_MAX_GROUP */

/* Values per int4 group in a row of head_dim: the largest power of two dividing head_dim, at most
 * INT4_MAX_GROUP (a constant in each of the attention kernels' compiled head_dim copies). */
static inline int int4_group(const int head_dim) {
    const int lowest_bit = head_dim & -head_dim;
    return lowest_bit < INT4_MAX_GROUP ? lowest_bit : INT4_MAX_GROUP;
}

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
