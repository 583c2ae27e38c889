/* The paged-attention kernel as a C function, exported by tokenmill._native._attention in the
 * capsule TM_ATTENTION_CAPSULE so that other extensions (the fused decode path in _quant) call it
 * without a Python round trip. Arguments as the paged_attention binding (see attention.c). */
#ifndef TOKENMILL_ATTENTION_H
#define TOKENMILL_ATTENTION_H

#include <stdint.h>

#define TM_ATTENTION_CAPSULE "tokenmill._native._attention._C_API"
/* the same kernel for a caller inside its own `omp parallel` region: every thread of the team
 * calls it with the same arguments (nthreads is ignored: the team's size is used); it ends in a
 * barrier, and returns the same value on every thread */
#define TM_ATTENTION_TEAM_CAPSULE "tokenmill._native._attention._C_API_TEAM"
#define TM_ATTENTION_MAX_HEAD_DIM 512   /* the kernel refuses larger heads ... */
#define TM_ATTENTION_MAX_GROUP 256      /* ... and more query heads per kv head */

typedef int (*tm_paged_attention_fn)(const float *q, int64_t q_stride, float *out, const void *k_cache,
                                     const void *v_cache, int kv_bf16, const int64_t *block_tables,
                                     int64_t bt_stride, const int64_t *qsl, const int64_t *seq_lens, int num_seqs,
                                     int page_size, int hq, int hkv, int head_dim, float scale, int nthreads);

#endif
