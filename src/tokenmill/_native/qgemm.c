/* Prefill matmuls over the packed 4- and 8-bit weights (quant.c's u4 and s8 layouts): a
 * register-tiled integer GEMM on the decode kernels' own int16 activations.
 *
 * The decode kernels walk one weight row at a time, so every block of 32 products they sum ends in
 * a float conversion and a scale multiply of its own; with many x rows that epilogue costs as much
 * as the products, and dequantize + fp32 GEMM wins from ~28 rows. Here the vector lanes are x rows
 * instead (16 per AVX-512 vector, 8 per AVX2 one), in tiles of TR rows x GC weight rows: each
 * product step multiplies one pair of int16 activations of TR rows (a vector load) with one
 * broadcast pair of one weight row's values, and a block's epilogue is shared by the vector's
 * lanes. The numbers are the decode kernels' (x quantized to int16 in blocks of 32 with
 * the same quantizer, exact integer block sums, then scale * sum + min * xsum per block), so the
 * result equals dequant(W) @ dequant(xq)^T up to float summation order, as theirs does.
 *
 * Per call:
 *   1. x is quantized (tmq_quantize_natural) and transposed into row tiles of TR rows, the tiles
 *      shared out over the threads:
 *      xp [tile][block][pair 0..15][TR] int32 (two int16 values, element 2p low), xd / xs
 *      [tile][block][TR] (rows past M are zeros);
 *   2. the weight rows are cut into panels of GC; a thread widens one panel's values to int16
 *      pairs ([block][GC][16] int32, plus the GC scales and mins of every block as float; with
 *      AVX2 two zero- or sign-extensions per block) and runs every row tile against it (a last
 *      tile of at most TR/2 rows through a half-width kernel), then takes the next run of panels.
 * A result does not depend on the thread count, on which thread computes it, or on the width of
 * the tile it ran in.
 *
 * Kernels: AVX-512 VNNI (vpdpwssd: 32 int16 products per instruction, TR = 32) and AVX2 (vpmaddwd
 * + vpaddd, TR = 8). The Python side (layers/quant/packed.py) decides when this runs instead of
 * the decode kernels or dequantize + fp32 GEMM. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#define QG_X86 1
#else
#define QG_X86 0
#endif

#define QK 32
#define PAIRS 16            /* int16 pairs of one block of 32 */
#define GC 6                /* weight rows (output columns) of a tile */

typedef struct {
    int64_t M, tiles, nb, tr;   /* x rows, row tiles, blocks per row, rows per tile */
    int32_t *xp;                /* [tiles][nb][PAIRS][tr] */
    float *xd, *xs;             /* [tiles][nb][tr] */
} XPack;

/* the panel of weight rows n0 .. n0+GC-1 (rows past N: zeros) widened: wp [nb][GC][PAIRS] int32,
 * wd / wm [nb][GC] scale and min (0 for s8) */
static void widen_panel(const TmqMat *w, int64_t n0, int64_t nb, int32_t *wp, float *wd, float *wm) {
    int64_t Kp = nb * QK, G = (w->K + w->group - 1) / w->group, bpg = w->group / QK;
    for (int c = 0; c < GC; c++) {
        int64_t n = n0 + c;
        for (int64_t b = 0; b < nb; b++) {
            int32_t *o = wp + (b * GC + c) * PAIRS;
            if (n >= w->N) {
                memset(o, 0, PAIRS * sizeof(int32_t));
                wd[b * GC + c] = 0.f;
                wm[b * GC + c] = 0.f;
                continue;
            }
            int64_t g = n * G + b / bpg;
            wd[b * GC + c] = tmq_load_scale(w->sc, g, (int)w->f16);
            if (w->kind == TMQ_U4) {
                const uint8_t *p = (const uint8_t *)w->qs + n * (Kp / 2) + b * 16;
                for (int i = 0; i < 8; i++) {
                    o[i] = (int32_t)((uint32_t)(p[2 * i] & 0x0F) | ((uint32_t)(p[2 * i + 1] & 0x0F) << 16));
                    o[8 + i] = (int32_t)((uint32_t)(p[2 * i] >> 4) | ((uint32_t)(p[2 * i + 1] >> 4) << 16));
                }
                wm[b * GC + c] = tmq_load_scale(w->mn, g, (int)w->f16);
            } else {
                const int8_t *p = (const int8_t *)w->qs + n * Kp + b * QK;
                for (int i = 0; i < PAIRS; i++)
                    o[i] = (int32_t)((uint32_t)(uint16_t)(int16_t)p[2 * i] | ((uint32_t)(uint16_t)(int16_t)p[2 * i + 1] << 16));
                wm[b * GC + c] = 0.f;
            }
        }
    }
}

#if QG_X86
/* widen_panel with AVX2: a u4 block's 16 bytes zero-extended to 16-bit words are its pairs in
 * order (low nibbles: values 0-15, high: 16-31), an s8 block's 32 bytes sign-extended likewise;
 * fp16 scales through F16C. The same values as widen_panel. */
__attribute__((target("avx2,f16c"))) static void widen_panel_avx2(const TmqMat *w, int64_t n0, int64_t nb, int32_t *wp,
                                                                 float *wd, float *wm) {
    int64_t Kp = nb * QK, G = (w->K + w->group - 1) / w->group, bpg = w->group / QK;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int c = 0; c < GC; c++) {
        int64_t n = n0 + c;
        if (n >= w->N) {
            for (int64_t b = 0; b < nb; b++) {
                memset(wp + (b * GC + c) * PAIRS, 0, PAIRS * sizeof(int32_t));
                wd[b * GC + c] = wm[b * GC + c] = 0.f;
            }
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            int32_t *o = wp + (b * GC + c) * PAIRS;
            int64_t g = n * G + b / bpg;
            if (w->kind == TMQ_U4) {
                __m128i q = _mm_loadu_si128((const __m128i *)((const uint8_t *)w->qs + n * (Kp / 2) + b * 16));
                _mm256_storeu_si256((__m256i *)o, _mm256_cvtepu8_epi16(_mm_and_si128(q, low)));
                _mm256_storeu_si256((__m256i *)(o + 8), _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
            } else {
                const int8_t *q = (const int8_t *)w->qs + n * Kp + b * QK;
                _mm256_storeu_si256((__m256i *)o, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q)));
                _mm256_storeu_si256((__m256i *)(o + 8), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16))));
            }
            if (w->f16) {
                wd[b * GC + c] = _cvtsh_ss(((const uint16_t *)w->sc)[g]);
                wm[b * GC + c] = w->kind == TMQ_U4 ? _cvtsh_ss(((const uint16_t *)w->mn)[g]) : 0.f;
            } else {
                wd[b * GC + c] = ((const float *)w->sc)[g];
                wm[b * GC + c] = w->kind == TMQ_U4 ? ((const float *)w->mn)[g] : 0.f;
            }
        }
    }
}
#endif

/* portable tile: out[c][r] for c < GC, r < tr */
static void tile_scalar(const XPack *X, int64_t t, const int32_t *wp, const float *wd, const float *wm, float *out) {
    int64_t tr = X->tr, nb = X->nb;
    for (int64_t i = 0; i < GC * tr; i++) out[i] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const int32_t *xb = X->xp + (t * nb + b) * PAIRS * tr;
        const float *xd = X->xd + (t * nb + b) * tr, *xs = X->xs + (t * nb + b) * tr;
        for (int c = 0; c < GC; c++) {
            const int32_t *wc = wp + (b * GC + c) * PAIRS;
            for (int64_t r = 0; r < tr; r++) {
                int32_t s = 0;
                for (int p = 0; p < PAIRS; p++) {
                    int32_t xv = xb[p * tr + r], wv = wc[p];
                    s += (int32_t)(int16_t)(xv & 0xFFFF) * (int32_t)(int16_t)(wv & 0xFFFF) +
                         (int32_t)(int16_t)((uint32_t)xv >> 16) * (int32_t)(int16_t)((uint32_t)wv >> 16);
                }
                out[c * tr + r] += wd[b * GC + c] * xd[r] * (float)s + wm[b * GC + c] * xs[r];
            }
        }
    }
}

#if QG_X86
/* The vector tiles: RV vectors of x rows (RV = RVFULL: a whole row tile; RV = 1: its first
 * vector, for a last tile of at most half a tile of rows) x GC weight rows. Every lane (x row) runs the same
 * instructions either way, so a row's result does not depend on the tile size it ran in. */
#define DEFINE_TILE(NAME, TGT, TR, RVFULL, REGS, W, VF, VI, LOADI, LOADF, SET1I, SET1F, ZEROF, ZEROI, DOT, CVT, MULF, FMAF, STOREF) \
    TGT static inline __attribute__((always_inline)) void NAME##_body(const XPack *X, int64_t t, const int32_t *wp,   \
                                                                   const float *wd, const float *wm, float *out,    \
                                                                   const int RV) {                                 \
        int64_t nb = X->nb;                                                                                       \
        /* the float sums: in registers (REGS), or in `out`, touched once per block, where the */                \
        /* registers would not hold them beside the integer sums (AVX2's 16) */                                  \
        VF acc[2][GC];                                                                                            \
        for (int c = 0; c < GC; c++)                                                                              \
            for (int v = 0; v < RV; v++) {                                                                        \
                if (REGS) acc[v][c] = ZEROF();                                                                    \
                else STOREF(out + c * TR + v * W, ZEROF());                                                       \
            }                                                                                                     \
        for (int64_t b = 0; b < nb; b++) {                                                                        \
            const int32_t *xb = X->xp + (t * nb + b) * PAIRS * TR;                                                \
            const int32_t *wb = wp + b * GC * PAIRS;                                                              \
            VI s[2][GC];                                                                                          \
            for (int c = 0; c < GC; c++) s[0][c] = s[1][c] = ZEROI();                                             \
            _Pragma("GCC unroll 4")                                                                               \
            for (int p = 0; p < PAIRS; p++) {                                                                     \
                VI x[2];                                                                                          \
                for (int v = 0; v < RV; v++) x[v] = LOADI(xb + p * TR + v * W);                                   \
                _Pragma("GCC unroll 6")                                                                           \
                for (int c = 0; c < GC; c++) {                                                                    \
                    VI wv = SET1I(wb[c * PAIRS + p]);                                                             \
                    for (int v = 0; v < RV; v++) s[v][c] = DOT(s[v][c], x[v], wv);                                \
                }                                                                                                 \
            }                                                                                                     \
            const float *xd = X->xd + (t * nb + b) * TR, *xs = X->xs + (t * nb + b) * TR;                         \
            _Pragma("GCC unroll 6")                                                                               \
            for (int c = 0; c < GC; c++) {                                                                        \
                VF sc = SET1F(wd[b * GC + c]), mn = SET1F(wm[b * GC + c]);                                        \
                for (int v = 0; v < RV; v++) {                                                                    \
                    VF a = REGS ? acc[v][c] : LOADF(out + c * TR + v * W);                                        \
                    a = FMAF(CVT(s[v][c]), MULF(LOADF(xd + v * W), sc), a);                                       \
                    a = FMAF(LOADF(xs + v * W), mn, a);                                                           \
                    if (REGS) acc[v][c] = a;                                                                      \
                    else STOREF(out + c * TR + v * W, a);                                                         \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        if (REGS)                                                                                                 \
            for (int c = 0; c < GC; c++)                                                                          \
                for (int v = 0; v < RV; v++) STOREF(out + c * TR + v * W, acc[v][c]);                            \
    }                                                                                                             \
    TGT static void NAME(const XPack *X, int64_t t, const int32_t *wp, const float *wd, const float *wm, float *out) { \
        NAME##_body(X, t, wp, wd, wm, out, RVFULL);                                                               \
    }                                                                                                             \
    TGT static void NAME##_half(const XPack *X, int64_t t, const int32_t *wp, const float *wd, const float *wm,    \
                                float *out) {                                                                     \
        NAME##_body(X, t, wp, wd, wm, out, 1);                                                                    \
    }

/* AVX2: 8 rows (one 8-lane vector) x GC weight rows; vpmaddwd + vpaddd per pair. Two vectors'
 * integer sums, their x pairs and the broadcast weight pairs need more than AVX2's 16 registers
 * (GCC spilled them inside the product loop); one vector's fit. */
#define TGT_QG2 __attribute__((target("avx2,fma")))
#define TR2 8
#define LD2I(p) _mm256_loadu_si256((const __m256i *)(p))
#define DOT2(acc, x, w) _mm256_add_epi32(acc, _mm256_madd_epi16(x, w))
DEFINE_TILE(tile_avx2, TGT_QG2, TR2, 1, 0, 8, __m256, __m256i, LD2I, _mm256_loadu_ps, _mm256_set1_epi32, _mm256_set1_ps,
            _mm256_setzero_ps, _mm256_setzero_si256, DOT2, _mm256_cvtepi32_ps, _mm256_mul_ps, _mm256_fmadd_ps,
            _mm256_storeu_ps)

#if __GNUC__ >= 9
/* AVX-512 VNNI: 32 rows (two 16-lane vectors) x GC weight rows; one vpdpwssd per pair and vector */
#define TGT_QG512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define TR5 32
#define LD5I(p) _mm512_loadu_si512((const void *)(p))
DEFINE_TILE(tile_512, TGT_QG512, TR5, 2, 1, 16, __m512, __m512i, LD5I, _mm512_loadu_ps, _mm512_set1_epi32, _mm512_set1_ps,
            _mm512_setzero_ps, _mm512_setzero_si512, _mm512_dpwssd_epi32, _mm512_cvtepi32_ps, _mm512_mul_ps,
            _mm512_fmadd_ps, _mm512_storeu_ps)
#endif
#endif

typedef void (*TileFn)(const XPack *, int64_t, const int32_t *, const float *, const float *, float *);

/* the tile kernels (whole tile, first half) and the rows per tile for kernel set `set` (TMQ_GEMM_*) */
static TileFn tile_for(int set, int64_t *tr, TileFn *half) {
#if QG_X86
#if __GNUC__ >= 9
    if (set == TMQ_GEMM_AVX512) { *tr = TR5; *half = tile_512_half; return tile_512; }
#endif
    if (set == TMQ_GEMM_AVX2) { *tr = TR2; *half = tile_avx2_half; return tile_avx2; }   /* one vector: the same */
#endif
    *tr = 8;
    *half = tile_scalar;
    return tile_scalar;
}

/* x rows of row tile t quantized and laid out in X (rows past M: zeros); q / d / s: scratch of
 * tr * Kp int16 and tr * nb floats each */
static void pack_tile(const float *x, int64_t K, const XPack *X, int64_t t, int16_t *q, float *d, float *s) {
    int64_t tr = X->tr, nb = X->nb, Kp = nb * QK, m0 = t * tr, mr = X->M - m0 < tr ? X->M - m0 : tr;
    tmq_quantize_natural(x + m0 * K, mr, K, q, d, s);
    for (int64_t b = 0; b < nb; b++) {
        int32_t *o = X->xp + (t * nb + b) * PAIRS * tr;
        float *od = X->xd + (t * nb + b) * tr, *os = X->xs + (t * nb + b) * tr;
        for (int64_t r = 0; r < tr; r++) {
            if (r < mr) {
                const uint16_t *qr = (const uint16_t *)q + r * Kp + b * QK;
                for (int p = 0; p < PAIRS; p++)
                    o[p * tr + r] = (int32_t)((uint32_t)qr[2 * p] | ((uint32_t)qr[2 * p + 1] << 16));
                od[r] = d[r * nb + b];
                os[r] = s[r * nb + b];
            } else {
                for (int p = 0; p < PAIRS; p++) o[p * tr + r] = 0;
                od[r] = os[r] = 0.f;
            }
        }
    }
}

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

int tmq_gemm_tiled(const TmqMat *w, const float *x, int64_t M, const float *bias, float *y, int nt, int set) {
    if (M <= 0 || w->N <= 0) return 0;
    int64_t tr;
    TileFn half, tile = tile_for(set, &tr, &half);
    int64_t nb = (w->K + QK - 1) / QK, Kp = nb * QK, N = w->N, panels = (N + GC - 1) / GC;
    XPack X = {M, (M + tr - 1) / tr, nb, tr, NULL, NULL, NULL};
    size_t cells = (size_t)X.tiles * nb * tr;
    X.xp = alloc64(cells * PAIRS * sizeof(int32_t));
    X.xd = alloc64(cells * sizeof(float));
    X.xs = alloc64(cells * sizeof(float));
    int err = !X.xp || !X.xd || !X.xs;
    /* panels are claimed in runs of `run` (at least 8: neighbouring panels share the cache lines
     * of every output row they write, and one thread per line avoids trading them back and forth) */
    int64_t run = panels / (4 * (nt < 1 ? 1 : nt));
    if (run < 8) run = 8;
    if (!err) {
        #pragma omp parallel num_threads(nt < 1 ? 1 : nt)
        {
            int16_t *q = malloc((size_t)tr * Kp * sizeof(int16_t));
            float *qd = malloc((size_t)tr * nb * sizeof(float)), *qs = malloc((size_t)tr * nb * sizeof(float));
            int32_t *wp = alloc64((size_t)nb * GC * PAIRS * sizeof(int32_t));
            float *wd = malloc((size_t)nb * GC * sizeof(float)), *wm = malloc((size_t)nb * GC * sizeof(float));
            float *out = alloc64((size_t)GC * tr * sizeof(float));
            int ok = q && qd && qs && wp && wd && wm && out;
            if (!ok) {   /* every thread still takes part in both loops; this one computes nothing */
                #pragma omp atomic write
                err = 1;
            }
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < X.tiles; t++)
                if (ok) pack_tile(x, w->K, &X, t, q, qd, qs);
            #pragma omp for schedule(dynamic, run)
            for (int64_t pn = 0; pn < panels; pn++) {
                if (!ok) continue;
                int64_t n0 = pn * GC, nc = N - n0 < GC ? N - n0 : GC;
#if QG_X86
                if (set != TMQ_GEMM_SCALAR) widen_panel_avx2(w, n0, nb, wp, wd, wm);
                else
#endif
                widen_panel(w, n0, nb, wp, wd, wm);
                for (int64_t t = 0; t < X.tiles; t++) {
                    int64_t m0 = t * tr, mr = M - m0 < tr ? M - m0 : tr;
                    (2 * mr <= tr ? half : tile)(&X, t, wp, wd, wm, out);
                    for (int64_t r = 0; r < mr; r++) {
                        float *yr = y + (m0 + r) * N + n0;
                        for (int64_t c = 0; c < nc; c++) yr[c] = out[c * tr + r] + (bias ? bias[n0 + c] : 0.f);
                    }
                }
            }
            free(q); free(qd); free(qs); free(wp); free(wd); free(wm); free(out);
        }
    }
    free(X.xp); free(X.xd); free(X.xs);
    return err ? -1 : 0;
}
