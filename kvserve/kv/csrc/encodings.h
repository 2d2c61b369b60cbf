/* The codes the C kernels (the K/V store, both attention kernels) know the cache's encodings by: kv/quant.py's
 * C_ENCODING_CODES. RAW: values stored as they are (fp32 for the attention kernels, the cache's own dtype for the
 * store). Part of the build key of every kernel that includes it (kvserve.native hashes what a source includes). */
#ifndef KVSERVE_ENCODINGS_H
#define KVSERVE_ENCODINGS_H

enum { RAW = 0, INT8 = 1, FP8 = 2, INT4 = 3 };

#endif
