/* The paged-attention kernel as a C function, exported by tokenmill._native._attention in the
 * capsule TM_ATTENTION_CAPSULE so that other extensions (the fused decode path in _quant) call it
 * without a Python round trip. Arguments as the paged_attention binding (see attention.c). */
#ifndef TOKENMILL_ATTENTION_H
#define TOKENMILL_ATTENTION_H

#include <stdint.h>

#define TM_ATTENTION_CAPSULE "tokenmill._native._attention._C_API"
/* the same kernel as a task list (a tm_attention_tasks), for a caller that runs its own threads */
#define TM_ATTENTION_TASKS_CAPSULE "tokenmill._native._attention._C_API_TASKS"
#define TM_ATTENTION_MAX_HEAD_DIM 512   /* the kernel refuses larger heads ... */
#define TM_ATTENTION_MAX_GROUP 256      /* ... and more query heads per kv head */

/* kv_kind: the element type of the K/V pages. fp8 pages hold float8_e4m3fn bytes whose value is
 * fp8(byte) * scale; k_scale / v_scale (ignored otherwise) point at one float32 per kv head
 * (TM_KV_FP8: a static scale per layer and head) or one per stored vector, indexed
 * slot * num_kv_heads + kv_head (TM_KV_FP8_TOKEN). */
enum { TM_KV_F32 = 0, TM_KV_BF16 = 1, TM_KV_FP8 = 2, TM_KV_FP8_TOKEN = 3 };

typedef int (*tm_paged_attention_fn)(const float *q, int64_t q_stride, float *out, const void *k_cache,
                                     const void *v_cache, int kv_kind, const float *k_scale,
                                     const float *v_scale, const int64_t *block_tables,
                                     int64_t bt_stride, const int64_t *qsl, const int64_t *seq_lens, int num_seqs,
                                     int page_size, int hq, int hkv, int head_dim, float scale, int nthreads);

/* plan(): the paged_attention arguments (nthreads only shapes the cut of tiled prefill rows,
 * never a result); NULL on an unsupported shape or no memory. Then run(call, i) for every
 * i < tasks(call), each exactly once, on any threads; once all have returned, finish(call)
 * merges split-K parts into the output and frees the call. */
typedef struct {
    void *(*plan)(const float *q, int64_t q_stride, float *out, const void *k_cache, const void *v_cache,
                  int kv_kind, const float *k_scale, const float *v_scale, const int64_t *block_tables,
                  int64_t bt_stride, const int64_t *qsl,
                  const int64_t *seq_lens, int num_seqs, int page_size, int hq, int hkv, int head_dim, float scale,
                  int nthreads);
    int (*tasks)(const void *call);
    void (*run)(const void *call, int i);
    void (*finish)(void *call);
} tm_attention_tasks;

#endif
