/* Shared between the files of tokenmill._native._quant: a packed weight matrix and the integer
 * matmul over it (quant.c), used by the fused decode path (decoder.c). */
#ifndef TOKENMILL_QUANT_H
#define TOKENMILL_QUANT_H

#include <stddef.h>
#include <stdint.h>

enum { TMQ_U4 = 0, TMQ_S8 = 1, TMQ_F32 = 2 };

typedef struct {
    int64_t kind;        /* TMQ_U4: qs uint8 [N, Kp/2], scale + min; TMQ_S8: qs int8 [N, Kp], scale;
                          * TMQ_F32: qs float [N, K] row-major (no scales, group unused) */
    const void *qs;
    const void *sc, *mn; /* [N, G] fp16 (f16 = 1) or fp32; mn unused for TMQ_S8 */
    int64_t f16;
    int64_t N, K, group;
} TmqMat;

/* y[M, N] = x[M, K] @ W^T (+ bias): int16 activations, as the gemm_u4/gemm_s8 bindings. 0 or -1 (no memory). */
int tmq_matmul(const TmqMat *w, const float *x, int64_t M, const float *bias, float *y, int nt);
/* The same in pieces, for a caller that runs its own threads (decoder.c): one thread quantizes
 * x for w (NULL: out of memory; for TMQ_F32 it only records x, which must stay put until the
 * rows are done) and shares the result; then thread t of T computes its part of
 * the output rows (tmq_row_range: contiguous, the first N % T threads one row more); after all
 * have finished, one thread frees the activations. Results are those of tmq_matmul, row for row. */
void *tmq_act_quantize(const TmqMat *w, const float *x, int64_t M);
void tmq_matmul_rows(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y, int t, int T);
void tmq_row_range(int64_t N, int t, int T, int64_t *n0, int64_t *n1);
/* output rows [n0, n1) only (tmq_matmul_rows is this over thread t's range): a row's result does
 * not depend on the range it is computed in, so a caller may cut its range into pieces */
void tmq_matmul_range(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y, int64_t n0, int64_t n1);
void tmq_act_free(void *act);
/* A reusable activation buffer, for a caller whose every thread quantizes its own copy of x
 * (decoder.c): tmq_act_bytes is what quantizing M rows for w needs (0 for TMQ_F32),
 * tmq_act_buffer(bytes) a buffer of that room (NULL: no memory; freed by tmq_act_free), and
 * tmq_act_quantize_into fills it as tmq_act_quantize would (0, or -1 when it is too small). */
size_t tmq_act_bytes(const TmqMat *w, int64_t M);
void *tmq_act_buffer(size_t bytes);
int tmq_act_quantize_into(void *buf, const TmqMat *w, const float *x, int64_t M);
/* row n of w dequantized into out [K] fp32, with the dequant_u4 / dequant_s8 bindings' values
 * (the embedding rows of tokenmill's packed embeddings); TMQ_F32 copies the row. 0, or -1 for a row
 * outside w. */
int tmq_dequant_row(const TmqMat *w, int64_t n, float *out);
/* 1 when the matrix description is one the kernels take. */
int tmq_check_mat(const TmqMat *w);

/* The prefill GEMM (qgemm.c): y[M, N] = x[M, K] @ W^T (+ bias) for TMQ_U4 / TMQ_S8 with the int16
 * activations of tmq_matmul, register-tiled over x rows; `set` is one of TMQ_GEMM_*. 0 or -1 (no memory). */
enum { TMQ_GEMM_SCALAR = 0, TMQ_GEMM_AVX2 = 1, TMQ_GEMM_AVX512 = 2 };
int tmq_gemm_tiled(const TmqMat *w, const float *x, int64_t M, const float *bias, float *y, int nt, int set);
/* quant.c's helpers for qgemm.c: the activation quantizer of the kernel set in use (x [M, K] ->
 * xq [M, Kp] int16, block scales xd [M, Kp/32], xs = xd * sum(xq)), and a weight scale */
void tmq_quantize_natural(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs);
float tmq_load_scale(const void *p, int64_t i, int f16);

/* decoder.c's Python bindings, listed in quant.c's method table */
#include <Python.h>
PyObject *tmq_py_decode_layers(PyObject *self, PyObject *args);
PyObject *tmq_py_layer_fields(PyObject *self, PyObject *args);
PyObject *tmq_py_fp8_quantize(PyObject *self, PyObject *args);
PyObject *tmq_py_f16_quantize(PyObject *self, PyObject *args);
PyObject *tmq_py_decode_profile(PyObject *self, PyObject *args);
PyObject *tmq_py_decode_kv_prefetch(PyObject *self, PyObject *args);

#endif
