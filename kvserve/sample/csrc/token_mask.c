// Grammar masks applied to fp32 logits on CPU: every token whose bit is 0 gets -inf.
//
// The mask is xgrammar's layout: row r, token t -> bit t % 32 of 32-bit word t / 32. Grammar masks are made of
// long runs (inside a string nearly every token is allowed; between JSON tokens nearly none), so whole words
// are 0 or all ones and cost one test each: 64 rows of a 49,152-token vocabulary take well under a
// millisecond, where a per-token pass takes tens.

#include <math.h>
#include <stdint.h>

void kvserve_apply_token_mask(float *logits, int64_t logits_stride, const uint32_t *mask, int64_t mask_stride,
                              const int64_t *rows, int num_rows, int vocab_size)
{
    const int num_words = (vocab_size + 31) / 32;
    for (int i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * logits_stride;
        const uint32_t *words = mask + rows[i] * mask_stride;
        for (int w = 0; w < num_words; w++) {
            const uint32_t word = words[w];
            if (word == UINT32_MAX)
                continue;
            const int base = w * 32;
            const int n = vocab_size - base < 32 ? vocab_size - base : 32;
            for (int j = 0; j < n; j++)  // branch-free, so that it vectorizes
                row[base + j] = ((word >> j) & 1u) ? row[base + j] : -INFINITY;
        }
    }
}
