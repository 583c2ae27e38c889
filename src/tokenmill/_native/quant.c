/* Quantized-weight matmul kernels of tokenmill (y = x @ W^T with W stored in 4 or 8 bits).
 *
 * Two weight layouts cover every served format (GGUF Q8_0/Q4_0/Q4_1/Q4_K and tokenmill's own
 * int8/int4 quantization); the Python side repacks each format into one of them losslessly.
 * A row of W has K values, padded with zeros to Kp = K rounded up to 32 (one "block").
 *
 *   u4: qs    uint8 [N, Kp/2]   block b of a row = 16 bytes; byte i holds value i of the block
 *                               in its low nibble and value i+16 in its high nibble (GGML order)
 *       scale [N, G], min [N, G] fp16 or fp32;  w = scale * q + min,  q in 0..15
 *   s8: qs    int8  [N, Kp]
 *       scale [N, G] fp16 or fp32;              w = scale * q,        q in -128..127
 *
 * G = ceil(K / group) scale groups per row; group is a multiple of 32 (group = Kp: one scale per
 * row, i.e. per output channel).
 *
 * Few rows (decode): activations are quantized to int16 in blocks of 32 (scale amax/32639, round
 * to nearest even) and each block is an integer dot product (weights widened to 16 bits, madd on
 * AVX2, dpwssd with AVX-VNNI). The result equals dequant(W) @ dequant(xq)^T up to float summation
 * order; xq keeps 16 bits where llama.cpp's Q8 activations keep 8, so the int16 path's logits stay
 * within ~1e-3 of fp32 activations (int8 activations flipped 3% of top-1 tokens on this model).
 * Many rows (prefill): either the tiled integer GEMM of qgemm.c on the same int16 activations
 * (gemm_tiled), or the Python side dequantizes W into fp32 with dequant_* and runs torch's GEMM,
 * which keeps activations in fp32 (layers/quant/packed.py, prefill_gemm, chooses).
 *
 * Vector code is compiled through function target attributes and chosen at run time from
 * __builtin_cpu_supports (sets: avx2, avxvnni, avx512vnni, amx; each checked on its own; the best
 * one is used, except on Zen 4, see default_isa); a portable scalar path does the same arithmetic
 * everywhere else. The amx set runs 2 or more x rows through the AMX tile unit (see the AMX
 * section; u4 from 4 rows) and is avx512vnni otherwise. With 2 to 4 x rows (amx: 2 and 3) the u4
 * matmuls of both sets run the one-row kernels' quad order / block stream for several rows at once
 * (u4_rows_quad512). Above that the avx512vnni set
 * runs 512-bit kernels over tiles of up to 6 rows that share each widened weight block (u4: two
 * blocks per 32-byte load against "pair order" activations; see the AVX-512 section). With one x
 * row the u4 kernels (every vector set) and the avx512vnni s8 kernel widen nothing: they split
 * each 16-bit word of the weights with and/shift against activations reordered once per matmul
 * to match ("quad" / "word" order, see dot_u4_quad_one and dot_s8_word_one). Where a row's
 * blocks do not fill whole loads (K = 576: 18 blocks) and each block has its own scale, one row
 * runs as a stream of blocks across row ends instead (block_stream256_avx2, stream512).
 * Work is split over output rows with OpenMP, the thread count given by the caller (torch's).
 * tmq_matmul() is the entry point of decoder.c's fused decode path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "quant.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define TM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define TM_X86 0
#endif
#if TM_X86 && defined(__GNUC__) && __GNUC__ >= 11 && defined(__linux__)
#define TM_AMX 1   /* the amx kernel set can be compiled (gcc 11+) and asked for (Linux's arch_prctl) */
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TM_AMX 0
#endif

#define QK 32
/* the block whose sum lane q of dot_s8_word_one's reduced vector holds (of 16) */
#define WORD_BLOCK(q) (8 * ((q) / 8) + 2 * ((q) % 4) + ((q) / 4) % 2)
#define PREFETCH_ROWS 0
#ifndef ROWS_PREFETCH
#define ROWS_PREFETCH 2048  /* the multi-row AVX-512 kernels' prefetch distance: bytes ahead of the weight
                             * row they read (the rows after it, as the matmul streams its rows); the AVX2
                             * multi-row kernels are bound by their arithmetic and gained nothing from it */
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512 = 3, ISA_AMX = 4, ISA_COUNT = 5 };
/* x rows from which the amx set runs the tile kernels (one row: its avx512vnni kernel). Whole
 * verify-shaped steps of the default model took 0.92x-0.93x the pair kernel's time at 2 rows, and
 * 0.79x / 0.74x / 0.63x the avx512vnni set's at 3 / 4 / 8 (docs/benchmarks.md, "AMX tiles"). */
#define AMX_MIN_ROWS 2
static int g_isa = -1;      /* default_isa() at first use; set_isa() may pick another supported set */
static int g_best = -1;     /* best this CPU supports */
static int g_supported = 0; /* bit i: kernel set i runs on this CPU */

#if TM_AMX
static int amx_permitted(void) {
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18), once per process: without it the
     * first tile instruction faults; a kernel without AMX support refuses it */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
#endif

/* avxvnni: AVX2 + the VEX AVX-VNNI dot products (Alder Lake, Zen 5). avx512vnni: AVX-512 F/BW/VL
 * + VNNI (Ice Lake, Sapphire Rapids, Zen 4/5), which does not imply AVX-VNNI, so the sets are
 * checked one by one rather than as a ladder. amx: avx512vnni plus AMX-TILE and AMX-INT8
 * (Sapphire Rapids and later) with the OS's permission to use the tiles. */
static int best_isa(void) {
    if (g_best < 0) {
        g_supported = 1 << ISA_SCALAR;
#if TM_X86 && defined(__GNUC__)
        __builtin_cpu_init();
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        if (avx2) g_supported |= 1 << ISA_AVX2;
#if __GNUC__ >= 11
        if (avx2 && __builtin_cpu_supports("avxvnni")) g_supported |= 1 << ISA_AVXVNNI;
#endif
#if __GNUC__ >= 9
        if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            g_supported |= 1 << ISA_AVX512;
#endif
#if TM_AMX
        if ((g_supported & (1 << ISA_AVX512)) && __builtin_cpu_supports("amx-tile") &&
            __builtin_cpu_supports("amx-int8") && amx_permitted())
            g_supported |= 1 << ISA_AMX;
#endif
#endif
        g_best = ISA_SCALAR;
        for (int i = 0; i < ISA_COUNT; i++)
            if (g_supported & (1 << i)) g_best = i;
    }
    return g_best;
}

/* AMD family 19h with AVX-512: Zen 4, whose AVX-512 runs on 256-bit units (a 512-bit operation
 * takes two passes), so the 512-bit kernels gain no width there and their multi-row tiles lose to
 * the 256-bit ones (docs/benchmarks.md: the default model decodes 1.06x-1.19x faster on avx2 for
 * 1 to 8 rows). Zen 3 is family 19h too but has no AVX-512; Zen 5 (family 1Ah) has full-width units. */
static int amd_family_19h(void) {
#if TM_X86 && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541u || d != 0x69746e65u || c != 0x444d4163u)
        return 0;   /* not "AuthenticAMD" */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    unsigned family = (a >> 8) & 0xF;
    if (family == 0xF) family += (a >> 20) & 0xFF;
    return family == 0x19;
#else
    return 0;
#endif
}

/* the set used unless set_isa() picks another: the best one, except the best 256-bit set where
 * the 512-bit units are double-pumped (amd_family_19h) */
static int g_default = -1;
static int default_isa(void) {
    if (g_default < 0) {
        g_default = best_isa();
        if (g_default == ISA_AVX512 && amd_family_19h())
            g_default = (g_supported & (1 << ISA_AVXVNNI)) ? ISA_AVXVNNI : ISA_AVX2;
    }
    return g_default;
}

static int isa(void) {
    if (g_isa < 0) g_isa = default_isa();
    return g_isa;
}

/* ---- fp16 <-> fp32 (portable) ----------------------------------------------------------- */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float load_scale(const void *p, int64_t i, int f16) {
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---- activation quantization: x [M, K] fp32 -> xq [M, Kp] int16, xd/xs [M, Kp/32] -------- */
/* xd = block scale (amax / 32639), xs = xd * sum(xq) (what a weight block's min multiplies).
 * 32639 = 127 * 256 + 127: every value then splits into two signed bytes (the amx kernels). */
#define QMAX 32639.f
static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs) {
    int64_t nb = (K + QK - 1) / QK, Kp = nb * QK;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        for (int64_t b = 0; b < nb; b++) {
            int64_t k0 = b * QK, n = K - k0 < QK ? K - k0 : QK;
            float amax = 0.f;
            for (int64_t i = 0; i < n; i++) { float a = fabsf(xr[k0 + i]); if (a > amax) amax = a; }
            float d = amax / QMAX, id = d != 0.f ? 1.f / d : 0.f;
            int sum = 0;
            int16_t *q = xq + m * Kp + k0;
            for (int64_t i = 0; i < QK; i++) {
                int v = i < n ? (int)nearbyintf(xr[k0 + i] * id) : 0;
                q[i] = (int16_t)v;
                sum += v;
            }
            xd[m * nb + b] = d;
            xs[m * nb + b] = d * (float)sum;
        }
    }
}

/* ---- scalar dot products (portable path) -------------------------------------------------- */
/* One weight row against one activation row; returns the row's output value (no bias). */
static float dot_u4_scalar(const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0,
                           int64_t nb, int64_t bpg, const int16_t *xq, const float *xd, const float *xs) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = qs + b * 16;
        const int16_t *q = xq + b * QK;
        int s = 0;
        for (int i = 0; i < 16; i++) s += (p[i] & 0x0F) * q[i] + (p[i] >> 4) * q[i + 16];
        int64_t g = row_g0 + b / bpg;
        acc += load_scale(sc, g, f16) * xd[b] * (float)s + load_scale(mn, g, f16) * xs[b];
    }
    return acc;
}

static float dot_s8_scalar(const int8_t *qs, const void *sc, int f16, int64_t row_g0, int64_t nb,
                           int64_t bpg, const int16_t *xq, const float *xd) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *p = qs + b * QK;
        const int16_t *q = xq + b * QK;
        int s = 0;
        for (int i = 0; i < QK; i++) s += p[i] * q[i];
        acc += load_scale(sc, row_g0 + b / bpg, f16) * xd[b] * (float)s;
    }
    return acc;
}

#define STREAM_BUF 2048   /* block values on the stack (block_stream256_avx2); more allocate */
#define QSTREAM_BUF 1024  /* block values of a group of rows (u4_stream512), on the stack */

/* the x rows of tile t of `tiles` over rows m0.. of M: tiles as even as possible (5 = 3 + 2,
 * 7 = 4 + 3) */
static inline int64_t tile_rows(int64_t M, int64_t m0, int64_t t, int64_t tiles) {
    return (M - m0) / (tiles - t) + ((M - m0) % (tiles - t) != 0);
}

/* rows of nb blocks that make a whole number of 8-block loads (the AVX2 block streams) */
static int64_t stream_rows(int64_t nb) {
    const int64_t g = nb & -nb;   /* the largest power of two dividing nb */
    return g >= 8 ? 1 : 8 / g;
}

/* rows of nb blocks that make a whole number of 16-block chunks (the AVX-512 u4 stream) */
static int64_t stream_rows16(int64_t nb) {
    const int64_t g = nb & -nb;
    return g >= 16 ? 1 : 16 / g;
}

#if TM_X86 && defined(__GNUC__)
/* ---- AVX2 ----------------------------------------------------------------------------------- */
#define TGT_AVX2 __attribute__((target("avx2,fma,f16c")))

TGT_AVX2 static inline __m256i nibbles32(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

TGT_AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TGT_AVX2 static inline float scale_avx2(const void *p, int64_t i, int f16) {
    return f16 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* 8 consecutive scales as fp32 */
TGT_AVX2 static inline __m256 scales8(const void *p, int64_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}

/* Block dot products against int16 activations: 32 weights widened to 16 bits, two madd's. */
#define DEFINE_BLOCK_DOTS(SUFFIX, TGT, MADD2)                                                              \
TGT static inline __m256i u4dot_##SUFFIX(const uint8_t *p, const int16_t *x) {                            \
    __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0F);                             \
    __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, m));                                               \
    __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m));                            \
    return MADD2(lo, _mm256_loadu_si256((const __m256i *)x), hi, _mm256_loadu_si256((const __m256i *)(x + 16))); \
}                                                                                                         \
TGT static inline __m256i s8dot_##SUFFIX(const int8_t *p, const int16_t *x) {                             \
    __m256i w = _mm256_loadu_si256((const __m256i *)p);                                                   \
    __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));                                         \
    __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));                                    \
    return MADD2(lo, _mm256_loadu_si256((const __m256i *)x), hi, _mm256_loadu_si256((const __m256i *)(x + 16))); \
}

TGT_AVX2 static inline __m256i madd2_avx2(__m256i a, __m256i x, __m256i b, __m256i y) {
    return _mm256_add_epi32(_mm256_madd_epi16(a, x), _mm256_madd_epi16(b, y));
}
DEFINE_BLOCK_DOTS(avx2, TGT_AVX2, madd2_avx2)

/* Several x rows against one weight row (u4 or s8), natural activation order, in tiles of up to 4
 * rows. Each block's weights are widened once per tile (WIDEN: 32 int16 lanes, values 0-15 and
 * 16-31) and met by every row of the tile (MADD2). With a scale per block or one per row, a row's
 * 8 consecutive blocks reduce in hadds to one vector of 8 block sums (as the one-row path does),
 * so the int32 -> float conversion and the scale multiply-add come once per 8 blocks and row, not
 * once per block; a row's last 1-7 blocks and larger groups take them block by block. The
 * previous form (the block dot recomputed, widening included, for every row, and a conversion per
 * block) made the matrices of a 2-row step cost 2.7 one-row steps (quant_kernel_rows.py, avx2 set);
 * now 1.65. */
TGT_AVX2 static inline __attribute__((always_inline)) void u4widen(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0F);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, m));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m));
}
TGT_AVX2 static inline __attribute__((always_inline)) void s8widen(const int8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
    *hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
}
#define LD16(p) _mm256_loadu_si256((const __m256i *)(p))
#define DEFINE_ROWS_DOT(NAME, TGT, WIDEN, MADD2, WT, WSTRIDE, HAS_MIN)                                      \
TGT static inline __attribute__((always_inline)) void NAME##_tile(                                        \
    const WT *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb, int64_t bpg,        \
    const int16_t *xq, const float *xd, const float *xs, int64_t x_stride, int64_t xb_stride, float *out,  \
    int64_t out_stride, const int MR) {                                                                   \
    __m256 acc[4];                                                                                        \
    float tail[4];                                                                                        \
    for (int j = 0; j < MR; j++) { acc[j] = _mm256_setzero_ps(); tail[j] = 0.f; }                         \
    int64_t b = 0;                                                                                        \
    if (bpg == 1 || bpg >= nb) {  /* a scale per block, or one per row */                                 \
        const int one = bpg >= nb;                                                                        \
        const __m256 sc1 = _mm256_set1_ps(scale_avx2(sc, row_g0, f16));                                  \
        const __m256 mn1 = HAS_MIN ? _mm256_set1_ps(scale_avx2(mn, row_g0, f16)) : _mm256_setzero_ps();   \
        for (; b + 8 <= nb; b += 8) {                                                                     \
            __m256i h[4], s0[4];                                                                          \
            for (int j = 0; j < MR; j++) h[j] = s0[j] = _mm256_setzero_si256();                            \
            const __m256 sv = one ? sc1 : scales8(sc, row_g0 + b, f16);                                    \
            const __m256 mv = !HAS_MIN ? mn1 : one ? mn1 : scales8(mn, row_g0 + b, f16);                   \
            for (int q = 0; q < 4; q++) {  /* blocks b + 2q and b + 2q + 1 */                             \
                __m256i lo0, hi0, lo1, hi1;                                                               \
                WIDEN(qs + (b + 2 * q) * WSTRIDE, &lo0, &hi0);                                            \
                WIDEN(qs + (b + 2 * q + 1) * WSTRIDE, &lo1, &hi1);                                        \
                for (int j = 0; j < MR; j++) {                                                            \
                    const int16_t *x = xq + j * x_stride + (b + 2 * q) * QK;                              \
                    const __m256i d = _mm256_hadd_epi32(MADD2(lo0, LD16(x), hi0, LD16(x + 16)),           \
                                                        MADD2(lo1, LD16(x + 32), hi1, LD16(x + 48)));     \
                    if (q == 0 || q == 2) { h[j] = d; continue; }                                         \
                    if (q == 1) { s0[j] = _mm256_hadd_epi32(h[j], d); continue; }                         \
                    const __m256i s1 = _mm256_hadd_epi32(h[j], d);                                        \
                    const __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(s0[j], s1, 0x20),        \
                                                       _mm256_permute2x128_si256(s0[j], s1, 0x31));      \
                    acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_loadu_ps(xd + j * xb_stride + b)),   \
                                             _mm256_cvtepi32_ps(t), acc[j]);                              \
                    if (HAS_MIN) acc[j] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + j * xb_stride + b), acc[j]); \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    for (; b < nb; b++) {  /* the row's last blocks, or groups of several blocks: block by block */      \
        const int64_t g = row_g0 + b / bpg;                                                               \
        const float s = scale_avx2(sc, g, f16), mm = HAS_MIN ? scale_avx2(mn, g, f16) : 0.f;              \
        __m256i lo, hi;                                                                                   \
        WIDEN(qs + b * WSTRIDE, &lo, &hi);                                                                \
        for (int j = 0; j < MR; j++) {                                                                    \
            const int16_t *x = xq + j * x_stride + b * QK;                                                \
            const __m256 p = _mm256_cvtepi32_ps(MADD2(lo, LD16(x), hi, LD16(x + 16)));                    \
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(s * xd[j * xb_stride + b]), p, acc[j]);               \
            if (HAS_MIN) tail[j] += mm * xs[j * xb_stride + b];                                           \
        }                                                                                                 \
    }                                                                                                     \
    for (int j = 0; j < MR; j++) out[j * out_stride] = hsum8(acc[j]) + tail[j];                           \
}                                                                                                         \
TGT static void NAME(const WT *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb,   \
                     int64_t bpg, const int16_t *xq, const float *xd, const float *xs, int64_t nrows_x,    \
                     int64_t x_stride, int64_t xb_stride, float *out, int64_t out_stride) {                \
    const int64_t tiles = (nrows_x + 3) / 4;  /* as even as possible: 5 = 3 + 2, 7 = 4 + 3 */            \
    for (int64_t t = 0, m0 = 0, mr; t < tiles; t++, m0 += mr) {                                           \
        mr = tile_rows(nrows_x, m0, t, tiles);                                                            \
        const int16_t *x = xq + m0 * x_stride;                                                            \
        const float *d = xd + m0 * xb_stride, *m = xs ? xs + m0 * xb_stride : NULL;                        \
        float *o = out + m0 * out_stride;                                                                 \
        switch (mr) {                                                                                     \
        case 1: NAME##_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 1); break; \
        case 2: NAME##_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 2); break; \
        case 3: NAME##_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 3); break; \
        default: NAME##_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 4); \
        }                                                                                                 \
    }                                                                                                     \
}

/* One weight row (u4 or s8) against nrows_x activation rows. For one row, two accumulator chains
 * over even and odd blocks; several go to ROWS (DEFINE_ROWS_DOT). */
#define DEFINE_ROW_DOT(NAME, TGT, BLOCKDOT, WT, WSTRIDE, HAS_MIN, ROWS)                                    \
TGT static void NAME(const WT *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb,   \
                     int64_t bpg, const int16_t *xq, const float *xd, const float *xs, int64_t nrows_x,    \
                     int64_t x_stride, int64_t xb_stride, float *out, int64_t out_stride) {                \
    if (nrows_x == 1) {                                                                                   \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                       \
        float m0s = 0.f, m1s = 0.f;                                                                       \
        int64_t b = 0;                                                                                    \
        if (bpg == 1 || bpg >= nb) { /* a scale per block, or one per row: 8 blocks reduced together */ \
            const int one = bpg >= nb;                                                                    \
            const __m256 sc1 = _mm256_set1_ps(scale_avx2(sc, row_g0, f16));                              \
            const __m256 mn1 = HAS_MIN ? _mm256_set1_ps(scale_avx2(mn, row_g0, f16)) : _mm256_setzero_ps(); \
            __m256 vm = _mm256_setzero_ps();                                                              \
            for (; b + 8 <= nb; b += 8) {                                                                 \
                __m256i p0 = BLOCKDOT(qs + b * WSTRIDE, xq + b * QK);                                      \
                __m256i p1 = BLOCKDOT(qs + (b + 1) * WSTRIDE, xq + (b + 1) * QK);                          \
                __m256i p2 = BLOCKDOT(qs + (b + 2) * WSTRIDE, xq + (b + 2) * QK);                          \
                __m256i p3 = BLOCKDOT(qs + (b + 3) * WSTRIDE, xq + (b + 3) * QK);                          \
                __m256i p4 = BLOCKDOT(qs + (b + 4) * WSTRIDE, xq + (b + 4) * QK);                          \
                __m256i p5 = BLOCKDOT(qs + (b + 5) * WSTRIDE, xq + (b + 5) * QK);                          \
                __m256i p6 = BLOCKDOT(qs + (b + 6) * WSTRIDE, xq + (b + 6) * QK);                          \
                __m256i p7 = BLOCKDOT(qs + (b + 7) * WSTRIDE, xq + (b + 7) * QK);                          \
                __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));     \
                __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p4, p5), _mm256_hadd_epi32(p6, p7));     \
                __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20),                     \
                                             _mm256_permute2x128_si256(s0, s1, 0x31));                   \
                __m256 sv = one ? sc1 : scales8(sc, row_g0 + b, f16);                                      \
                a0 = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_loadu_ps(xd + b)), _mm256_cvtepi32_ps(t), a0); \
                if (HAS_MIN) vm = _mm256_fmadd_ps(one ? mn1 : scales8(mn, row_g0 + b, f16), _mm256_loadu_ps(xs + b), vm); \
            }                                                                                             \
            a1 = _mm256_add_ps(a1, vm);                                                                   \
        }                                                                                                 \
        for (; b + 1 < nb; b += 2) {                                                                      \
            int64_t g0 = row_g0 + b / bpg, g1 = row_g0 + (b + 1) / bpg;                                   \
            __m256 p0 = _mm256_cvtepi32_ps(BLOCKDOT(qs + b * WSTRIDE, xq + b * QK));                      \
            __m256 p1 = _mm256_cvtepi32_ps(BLOCKDOT(qs + (b + 1) * WSTRIDE, xq + (b + 1) * QK));          \
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(scale_avx2(sc, g0, f16) * xd[b]), p0, a0);                \
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(scale_avx2(sc, g1, f16) * xd[b + 1]), p1, a1);            \
            if (HAS_MIN) {                                                                                \
                m0s += scale_avx2(mn, g0, f16) * xs[b];                                                   \
                m1s += scale_avx2(mn, g1, f16) * xs[b + 1];                                               \
            }                                                                                             \
        }                                                                                                 \
        if (b < nb) {                                                                                     \
            int64_t g0 = row_g0 + b / bpg;                                                                \
            __m256 p0 = _mm256_cvtepi32_ps(BLOCKDOT(qs + b * WSTRIDE, xq + b * QK));                      \
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(scale_avx2(sc, g0, f16) * xd[b]), p0, a0);                \
            if (HAS_MIN) m0s += scale_avx2(mn, g0, f16) * xs[b];                                          \
        }                                                                                                 \
        out[0] = hsum8(_mm256_add_ps(a0, a1)) + (m0s + m1s);                                              \
        return;                                                                                           \
    }                                                                                                     \
    ROWS(qs, sc, mn, f16, row_g0, nb, bpg, xq, xd, xs, nrows_x, x_stride, xb_stride, out, out_stride);     \
}

DEFINE_ROWS_DOT(rows_u4_avx2, TGT_AVX2, u4widen, madd2_avx2, uint8_t, 16, 1)
DEFINE_ROWS_DOT(rows_s8_avx2, TGT_AVX2, s8widen, madd2_avx2, int8_t, QK, 0)
DEFINE_ROW_DOT(dot_u4_avx2, TGT_AVX2, u4dot_avx2, uint8_t, 16, 1, rows_u4_avx2)
DEFINE_ROW_DOT(dot_s8_avx2, TGT_AVX2, s8dot_avx2, int8_t, QK, 0, rows_s8_avx2)

/* One s8 block against activations in 256-bit word order (the block's even values, then its odd
 * ones: to_word256_order): each 16-bit word of the weights gives its low byte (shift left 8,
 * arithmetic shift right 8) and its high byte (arithmetic shift right 8) with no shuffle. The
 * one-row s8 kernel of avx2 and avxvnni runs the 8-block row dot on it (dot_s8_word_avx2). */
TGT_AVX2 static inline __m256i s8dot_word_avx2(const int8_t *p, const int16_t *x) {
    __m256i w = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8),
                                              _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(_mm256_srai_epi16(w, 8), _mm256_loadu_si256((const __m256i *)(x + 16))));
}
/* word-order activations exist for one x row only (gemm_s8_rows), so ROWS is never reached here */
DEFINE_ROW_DOT(dot_s8_word_avx2, TGT_AVX2, s8dot_word_avx2, int8_t, QK, 0, rows_s8_avx2)

#if __GNUC__ >= 11
#define TGT_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
TGT_VNNI static inline __m256i madd2_vnni(__m256i a, __m256i x, __m256i b, __m256i y) {
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(a, x), b, y);
}
DEFINE_BLOCK_DOTS(vnni, TGT_VNNI, madd2_vnni)
DEFINE_ROWS_DOT(rows_u4_vnni, TGT_VNNI, u4widen, madd2_vnni, uint8_t, 16, 1)
DEFINE_ROWS_DOT(rows_s8_vnni, TGT_VNNI, s8widen, madd2_vnni, int8_t, QK, 0)
DEFINE_ROW_DOT(dot_u4_vnni, TGT_VNNI, u4dot_vnni, uint8_t, 16, 1, rows_u4_vnni)
DEFINE_ROW_DOT(dot_s8_vnni, TGT_VNNI, s8dot_vnni, int8_t, QK, 0, rows_s8_vnni)
#endif

/* One x row against u4 weights on avx2 and avxvnni: the quad order of the avx512vnni kernel
 * (dot_u4_quad_one) at 256 bits. One 32-byte load holds 2 blocks; its 16-bit word j carries
 * values i, i+16, i+1 and i+17 of block j/8 (i = 2(j%8)), split by `and 15` and shifts into four
 * vectors of 16 int16 lanes against activations stored to match (to_quad_order, G = 2); int32 lanes
 * 0-3 / 4-7 of the sum hold block 2p's / 2p+1's partial sums. Four such sums (8 blocks) reduce in
 * three hadds to one vector whose lane q is block 2(q%4) + q/4, the order the activation block
 * scales are stored in. A row's last 1-7 blocks load with dword masks (a block is 4 dwords), the
 * activations being zero-padded to 8 blocks. */
TGT_AVX2 static inline __m256 scales8_tail(const void *p, int f16, int64_t row_g0, int64_t b, int64_t r,
                                           int64_t bpg, int one) {
    if (one) return _mm256_set1_ps(scale_avx2(p, row_g0, f16));
    if (bpg == 1 && r >= 8) return scales8(p, row_g0 + b, f16);
    if (bpg == 1) {
        /* a row's last r < 8 blocks, a scale each: masked loads that read nothing past the r
         * scales (an odd r's last fp16 is put in its lane apart), lanes >= r zeroed */
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)r),
                                                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        __m256 v;
        if (f16) {
            const uint16_t *h = (const uint16_t *)p + row_g0 + b;
            const __m128i dw = _mm_cmpgt_epi32(_mm_set1_epi32((int)(r / 2)), _mm_setr_epi32(0, 1, 2, 3));
            __m128i hv = _mm_maskload_epi32((const int *)h, dw);
            if (r & 1) {
                const __m128i at = _mm_cmpeq_epi16(_mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7), _mm_set1_epi16((short)(r - 1)));
                hv = _mm_blendv_epi8(hv, _mm_set1_epi16((short)h[r - 1]), at);
            }
            v = _mm256_cvtph_ps(hv);
        } else {
            v = _mm256_maskload_ps((const float *)p + row_g0 + b, _mm256_castps_si256(keep));
        }
        return _mm256_and_ps(v, keep);
    }
    /* the (at most 8) groups the lanes below r fall in, each converted once, then spread to the
     * lanes with a permute: lane i takes group (k0 + i) / bpg of them. Built in registers (a
     * vector load of stores just made would wait for them). */
    const int64_t k0 = b % bpg, g0 = row_g0 + b / bpg, n = r < 8 ? r : 8, cnt = (k0 + n - 1) / bpg + 1;
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = i < cnt ? scale_avx2(p, g0 + i, f16) : 0.f;
    const __m256 v = _mm256_setr_ps(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]);
    if (bpg == 1) return v;  /* the tail of a row with a scale per block: lanes >= r are 0 */
    const __m256 lane = _mm256_add_ps(_mm256_setr_ps(0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f, 7.5f),
                                      _mm256_set1_ps((float)k0));
    const __m256i idx = _mm256_cvttps_epi32(_mm256_mul_ps(lane, _mm256_set1_ps(1.f / (float)bpg)));
    return _mm256_permutevar8x32_ps(v, idx);
}

TGT_AVX2 static inline __m256i quad256_dot_avx2(__m256i w, const int16_t *x) {
    const __m256i m4 = _mm256_set1_epi16(0x000F);
    __m256i a = _mm256_madd_epi16(_mm256_and_si256(w, m4), _mm256_loadu_si256((const __m256i *)x));
    __m256i b = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), _mm256_loadu_si256((const __m256i *)(x + 16)));
    __m256i c = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 8), m4), _mm256_loadu_si256((const __m256i *)(x + 32)));
    __m256i d = _mm256_madd_epi16(_mm256_srli_epi16(w, 12), _mm256_loadu_si256((const __m256i *)(x + 48)));
    return _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
}

#define DEFINE_U4_QUAD256(NAME, TGT, DOT)                                                                  \
TGT static void NAME(const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb, \
                     int64_t bpg, const int16_t *xq, const float *xdq, const float *xs, float *out) {      \
    __m256 acc = _mm256_setzero_ps(), am = _mm256_setzero_ps();                                          \
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);                                       \
    const __m256i half = _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0);                                   \
    const int one = bpg >= nb;                                                                            \
    for (int64_t o = 0; o < nb * 16; o += 64) _mm_prefetch((const char *)qs + QUAD_PREFETCH + o, _MM_HINT_T0); \
    for (int64_t c = 0; c < nb; c += 8) {                                                                 \
        const int64_t n = nb - c < 8 ? nb - c : 8;                                                        \
        const uint8_t *w = qs + c * 16;                                                                   \
        const int16_t *x = xq + c * QK;                                                                   \
        __m256i d[4];                                                                                     \
        for (int p = 0; p < 4; p++) {                                                                     \
            const int64_t left = n - 2 * p;                                                               \
            if (left <= 0) { d[p] = _mm256_setzero_si256(); continue; }                                   \
            __m256i wv = left >= 2 ? _mm256_loadu_si256((const __m256i *)(w + 32 * p))                    \
                                   : _mm256_maskload_epi32((const int *)(w + 32 * p), half);              \
            d[p] = DOT(wv, x + 64 * p);                                                                   \
        }                                                                                                 \
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));      \
        __m256 sv = _mm256_permutevar8x32_ps(scales8_tail(sc, f16, row_g0, c, n, bpg, one), perm);        \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sv, _mm256_loadu_ps(xdq + c)), acc);   \
        am = _mm256_fmadd_ps(scales8_tail(mn, f16, row_g0, c, n, bpg, one), _mm256_loadu_ps(xs + c), am); \
    }                                                                                                     \
    *out = hsum8(_mm256_add_ps(acc, am));                                                                 \
}
#ifndef QUAD_PREFETCH
#define QUAD_PREFETCH 2048
#endif
DEFINE_U4_QUAD256(dot_u4_quad256_avx2, TGT_AVX2, quad256_dot_avx2)

/* The integer dots of one 8-block load of u4 weights w (its first n <= 8 blocks) against MR x
 * rows of quad-order activations x (row j at x + j * x_stride): t[j] lane q holds block
 * 2(q%4) + q/4's dot, as quad256_dot_avx2 and the one-row kernel's hadds give it. Each 32-byte
 * load is split into its four nibble planes once for all MR rows. */
TGT_AVX2 static inline __attribute__((always_inline)) void u4_chunk_dots(const uint8_t *w, int64_t n, const int16_t *x,
                                                                       int64_t x_stride, __m256i *t, const int MR) {
    const __m256i half = _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0), m4 = _mm256_set1_epi16(0x000F);
    __m256i u[4];
    for (int j = 0; j < MR; j++) t[j] = u[j] = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {   /* per x row: hadd(hadd(d0, d1), hadd(d2, d3)) */
        const int64_t l = n - 2 * p;
        __m256i d[4];
        if (l <= 0) {
            for (int j = 0; j < MR; j++) d[j] = _mm256_setzero_si256();
        } else {
            const __m256i wv = l >= 2 ? _mm256_loadu_si256((const __m256i *)(w + 32 * p))
                                      : _mm256_maskload_epi32((const int *)(w + 32 * p), half);
            const __m256i q0 = _mm256_and_si256(wv, m4), q1 = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
            const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(wv, 8), m4), q3 = _mm256_srli_epi16(wv, 12);
            for (int j = 0; j < MR; j++) {
                const int16_t *xj = x + j * x_stride + 64 * p;
                d[j] = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256((const __m256i *)xj)),
                                     _mm256_madd_epi16(q1, _mm256_loadu_si256((const __m256i *)(xj + 16)))),
                    _mm256_add_epi32(_mm256_madd_epi16(q2, _mm256_loadu_si256((const __m256i *)(xj + 32))),
                                     _mm256_madd_epi16(q3, _mm256_loadu_si256((const __m256i *)(xj + 48)))));
            }
        }
        for (int j = 0; j < MR; j++) {
            if (p == 0 || p == 2) u[j] = d[j];
            else if (p == 1) t[j] = _mm256_hadd_epi32(u[j], d[j]);
            else t[j] = _mm256_hadd_epi32(t[j], _mm256_hadd_epi32(u[j], d[j]));
        }
    }
}

/* x rows against rows [n0, n1) of a u4 matrix with a scale per block (GGUF Q4_0 / Q4_1), as one
 * stream of blocks (the rows are contiguous, and so are their scales). A row of nb blocks need
 * not fill 8-block loads (nb = 18 for K = 576): the one-row kernel above pays a masked tail
 * load, its reduction and a row's setup for every row. Here R = 8 / gcd(nb, 8) rows make a whole
 * number of 8-block loads, and each x row's activations hold x repeated R times (stream_blocks;
 * quad order, as above), so the loads run across row ends. Each 8-block load is split into its
 * nibble planes once and meets a tile of up to 4 x rows; each x row gets 8 block values
 * (integer dot x activation scale x weight scale + min x activation sum) in block order, kept in
 * buf, and a row's output is the sum of its nb values in a fixed order. A group starts at a
 * row's first block, so its activations start at x's first block. Every block's value is
 * computed lane by lane the same way wherever a load starts (a short last group masks its last
 * load), so a row's bits do not depend on which rows share its group, how threads split the
 * rows, or how many x rows come with it (a decode row and its speculative verify rows). */
TGT_AVX2 static inline __attribute__((always_inline)) void u4_stream_group(
    const uint8_t *w0, const void *sc, const void *mn, int f16, int64_t b0, int64_t nblk, const int16_t *xq,
    const float *xdq, const float *xs, int64_t x_stride, int64_t xb_stride, float *buf, int64_t bs, const int MR) {
    const __m256i inv = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   /* lane order -> block order */
    for (int64_t c = 0; c < nblk; c += 8) {
        const int64_t left = nblk - c;
        const uint8_t *w = w0 + c * 16;
        _mm_prefetch((const char *)w + QUAD_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)w + QUAD_PREFETCH + 64, _MM_HINT_T0);
        __m256i t[4];
        u4_chunk_dots(w, left, xq + c * QK, x_stride, t, MR);
        const __m256 sv = scales8_tail(sc, f16, 0, b0 + c, left, 1, 0), mv = scales8_tail(mn, f16, 0, b0 + c, left, 1, 0);
        for (int j = 0; j < MR; j++) {
            const __m256 v = _mm256_permutevar8x32_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(t[j]), _mm256_loadu_ps(xdq + j * xb_stride + c)), inv);
            _mm256_storeu_ps(buf + j * bs + c, _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + j * xb_stride + c), _mm256_mul_ps(v, sv)));
        }
    }
}

TGT_AVX2 static inline float stream_row_sum(const float *v, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= nb; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(v + i));
    float t = hsum8(acc);
    for (; i < nb; i++) t += v[i];
    return t;
}

/* The same block stream for s8 (GGUF Q8_0, the default model's output head: 49152 rows of 18
 * blocks), against word-order activations (s8dot_word_avx2) with x repeated as for u4: each
 * 32-byte block load is split into its even and odd bytes once for a tile of up to 4 x rows;
 * a block's value is its integer dot x activation scale x weight scale. */
TGT_AVX2 static inline __attribute__((always_inline)) void s8_stream_group(
    const int8_t *w0, const void *sc, int f16, int64_t b0, int64_t nblk, const int16_t *xq, const float *xd,
    int64_t x_stride, int64_t xb_stride, float *buf, int64_t bs, const int MR) {
    for (int64_t c = 0; c < nblk; c += 8) {
        const int64_t left = nblk - c;
        const int8_t *w = w0 + c * QK;
        for (int o = 0; o < 8 * QK; o += 64) _mm_prefetch((const char *)w + QUAD_PREFETCH + o, _MM_HINT_T0);
        __m256i s0[4], e[4], h[4];   /* per x row: 4 blocks' sums, the last even block, a pair's sums */
        for (int j = 0; j < MR; j++) s0[j] = e[j] = h[j] = _mm256_setzero_si256();
        for (int b = 0; b < 8; b++) {   /* per x row: as dot_s8_word_avx2's 8-block reduction */
            __m256i d[4];
            if (b >= left) {
                for (int j = 0; j < MR; j++) d[j] = _mm256_setzero_si256();
            } else {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * QK));
                const __m256i lo = _mm256_srai_epi16(_mm256_slli_epi16(wv, 8), 8), hi = _mm256_srai_epi16(wv, 8);
                for (int j = 0; j < MR; j++) {
                    const int16_t *x = xq + j * x_stride + (c + b) * QK;
                    d[j] = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
                }
            }
            for (int j = 0; j < MR; j++) {
                if (b % 2 == 0) { e[j] = d[j]; continue; }
                const __m256i hp = _mm256_hadd_epi32(e[j], d[j]);   /* blocks b-1, b */
                if (b % 4 == 1) { h[j] = hp; continue; }
                const __m256i q = _mm256_hadd_epi32(h[j], hp);      /* blocks b-3 .. b */
                if (b == 3) { s0[j] = q; continue; }
                s0[j] = _mm256_add_epi32(_mm256_permute2x128_si256(s0[j], q, 0x20), _mm256_permute2x128_si256(s0[j], q, 0x31));
            }
        }
        const __m256 sv = scales8_tail(sc, f16, 0, b0 + c, left, 1, 0);
        for (int j = 0; j < MR; j++)
            _mm256_storeu_ps(buf + j * bs + c, _mm256_mul_ps(_mm256_cvtepi32_ps(s0[j]),
                                                             _mm256_mul_ps(sv, _mm256_loadu_ps(xd + j * xb_stride + c))));
    }
}

/* Several x rows (quad order, each row padded to 8 blocks) against one u4 weight row, for rows of
 * 8k blocks and scale groups (elsewhere the block stream runs): each 32-byte load is split into
 * its nibble planes once and meets a tile of up to 4 x rows, and each row's arithmetic is
 * dot_u4_quad256_avx2's, lane by lane, so a row gives the same bits alone or with others. */
TGT_AVX2 static inline __attribute__((always_inline)) void u4_quad256_tile(
    const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb, int64_t bpg,
    const int16_t *xq, const float *xdq, const float *xs, int64_t x_stride, int64_t xb_stride, float *out,
    int64_t out_stride, const int MR) {
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const int one = bpg >= nb;
    __m256 acc[4], am[4];
    for (int j = 0; j < MR; j++) acc[j] = am[j] = _mm256_setzero_ps();
    for (int64_t o = 0; o < nb * 16; o += 64) _mm_prefetch((const char *)qs + QUAD_PREFETCH + o, _MM_HINT_T0);
    for (int64_t c = 0; c < nb; c += 8) {
        const int64_t n = nb - c < 8 ? nb - c : 8;
        const uint8_t *w = qs + c * 16;
        __m256i t[4];
        u4_chunk_dots(w, n, xq + c * QK, x_stride, t, MR);
        const __m256 sv = _mm256_permutevar8x32_ps(scales8_tail(sc, f16, row_g0, c, n, bpg, one), perm);
        const __m256 mv = scales8_tail(mn, f16, row_g0, c, n, bpg, one);
        for (int j = 0; j < MR; j++) {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[j]), _mm256_mul_ps(sv, _mm256_loadu_ps(xdq + j * xb_stride + c)), acc[j]);
            am[j] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + j * xb_stride + c), am[j]);
        }
    }
    for (int j = 0; j < MR; j++) out[j * out_stride] = hsum8(_mm256_add_ps(acc[j], am[j]));
}

TGT_AVX2 static void dot_u4_quad256_rows(const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0,
                                         int64_t nb, int64_t bpg, const int16_t *xq, const float *xd, const float *xs,
                                         int64_t nrows_x, int64_t x_stride, int64_t xb_stride, float *out,
                                         int64_t out_stride) {
    const int64_t tiles = (nrows_x + 3) / 4;  /* as even as possible: 5 = 3 + 2, 7 = 4 + 3 */
    for (int64_t t = 0, m0 = 0, mr; t < tiles; t++, m0 += mr) {
        mr = tile_rows(nrows_x, m0, t, tiles);
        const int16_t *x = xq + m0 * x_stride;
        const float *d = xd + m0 * xb_stride, *m = xs + m0 * xb_stride;
        float *o = out + m0 * out_stride;
        switch (mr) {
        case 1: u4_quad256_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 1); break;
        case 2: u4_quad256_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 2); break;
        case 3: u4_quad256_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 3); break;
        default: u4_quad256_tile(qs, sc, mn, f16, row_g0, nb, bpg, x, d, m, x_stride, xb_stride, o, out_stride, 4);
        }
    }
}

/* The block streams' driver: rows [n0, n1) of a u4 (s8 = 0: weights, scales, mins) or s8
 * (s8 = 1: weights, scales) matrix in groups of R rows, each group's loads met by tiles of up to
 * 4 of the M x rows (the group's weights stay in L1 between tiles). Returns -1 (nothing
 * computed) if the block values do not fit on the stack and cannot be allocated. */
#define STREAM_TILE(MR) do { \
    if (s8) s8_stream_group((const int8_t *)qs + b0 * QK, sc, f16, b0, nblk, x, d, x_stride, xb_stride, buf, bs, MR); \
    else u4_stream_group((const uint8_t *)qs + b0 * 16, sc, mn, f16, b0, nblk, x, d, xs + m0 * xb_stride, x_stride, \
                         xb_stride, buf, bs, MR); \
} while (0)
TGT_AVX2 static int block_stream256_avx2(int s8, const void *qs, const void *sc, const void *mn, int f16, int64_t nb,
                                         const int16_t *xq, const float *xd, const float *xs, int64_t M,
                                         int64_t x_stride, int64_t xb_stride, float *y, int64_t N, int64_t n0,
                                         int64_t n1) {
    const int64_t R = stream_rows(nb), bs = R * nb + 8;
    float stack[STREAM_BUF];
    float *buf = 4 * bs <= STREAM_BUF ? stack : malloc(sizeof(float) * 4 * (size_t)bs);
    if (!buf) return -1;
    const int64_t tiles = (M + 3) / 4;
    for (int64_t gs = n0; gs < n1; gs += R) {
        const int64_t ge = gs + R < n1 ? gs + R : n1, nblk = (ge - gs) * nb, b0 = gs * nb;
        for (int64_t t = 0, m0 = 0, mr; t < tiles; t++, m0 += mr) {
            mr = tile_rows(M, m0, t, tiles);
            const int16_t *x = xq + m0 * x_stride;
            const float *d = xd + m0 * xb_stride;
            switch (mr) {
            case 1: STREAM_TILE(1); break;
            case 2: STREAM_TILE(2); break;
            case 3: STREAM_TILE(3); break;
            default: STREAM_TILE(4);
            }
            for (int64_t j = 0; j < mr; j++)
                for (int64_t n = gs; n < ge; n++) y[(m0 + j) * N + n] = stream_row_sum(buf + j * bs + (n - gs) * nb, nb);
        }
    }
    if (buf != stack) free(buf);
    return 0;
}
#undef STREAM_TILE

#if __GNUC__ >= 9
/* ---- AVX-512 (F/BW/VL + VNNI) -------------------------------------------------------------- */
#define TGT_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Activations for the u4 kernels are stored in "pair" order: blocks 2p and 2p+1 (64 values) as
 * [2p: 0..15 | 2p+1: 0..15 | 2p: 16..31 | 2p+1: 16..31], padded with a zero block to an even
 * count. Then one 32-byte load of the weights of both blocks, widened to 32 int16 lanes, gives the
 * low nibbles (and 0x0F) and the high nibbles (>> 4) of both blocks in the order of the two 64-byte
 * activation halves: two dpwssd per 64 weights and no shuffle of the weights beyond the widening.
 * The int32 lanes 0-7 then hold block 2p's partial sums and lanes 8-15 block 2p+1's, so one fp32
 * multiply-add with [s(2p) xd(2p) x8 | s(2p+1) xd(2p+1) x8] applies both block scales: that vector
 * is one permute of the 16 products s(b) xd(b) formed per 16 blocks. The multi-row kernels (u4 and
 * s8) prefetch ROWS_PREFETCH bytes ahead of the row they read, as the one-row kernels do: without
 * it the hardware prefetchers left them waiting on memory (quant_kernel_rows.py on an Intel Xeon
 * host, one thread: the matrices of a 2-row step took 17.1 ms without it and 13.5 ms with it, 4
 * rows 23.8 and 19.5, against 9.5 for one row). */

/* the scales of blocks b0 .. b0+n-1 (n <= 16) of a row whose first group is row_g0; lanes >= n are
 * 0 or (one scale per row) that scale: they always meet zero weights or activations */
TGT_512 static inline __m512 scales16_512(const void *p, int f16, int64_t row_g0, int64_t b0, int64_t n,
                                          int64_t nb, int64_t bpg) {
    if (bpg == 1) {
        __mmask16 k = (__mmask16)((1u << n) - 1);
        return f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + row_g0 + b0))
                   : _mm512_maskz_loadu_ps(k, (const float *)p + row_g0 + b0);
    }
    if (bpg >= nb) return _mm512_set1_ps(scale_avx2(p, row_g0, f16));
    /* the groups the lanes below n fall in (at most 16, all in this row), one masked load, then
     * spread with a permute: lane i takes group (k0 + i) / bpg of them (exact in fp32 for these
     * small integers). Lanes >= n take a neighbour's scale or 0: they meet zero weights. */
    const int64_t k0 = b0 % bpg, cnt = (k0 + n - 1) / bpg + 1;
    const __mmask16 k = (__mmask16)((1u << cnt) - 1);
    const __m512 v = f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + row_g0 + b0 / bpg))
                         : _mm512_maskz_loadu_ps(k, (const float *)p + row_g0 + b0 / bpg);
    const __m512 lane = _mm512_add_ps(_mm512_setr_ps(0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f, 7.5f, 8.5f, 9.5f,
                                                     10.5f, 11.5f, 12.5f, 13.5f, 14.5f, 15.5f),
                                      _mm512_set1_ps((float)k0));
    const __m512i idx = _mm512_cvttps_epi32(_mm512_mul_ps(lane, _mm512_set1_ps(1.f / (float)bpg)));
    return _mm512_permutexvar_ps(idx, v);
}

/* one pair of u4 blocks against MR activation rows, into accumulators A: RAW is the pair's 32
 * weight bytes (the second 16 zero past the end of a row), X the pair's offset in an activation
 * row, idx selects the two blocks' lanes of the 16-block scale products cs[j] */
#define U4_PAIR_512(A, RAW, X)                                                                             \
    do {                                                                                                  \
        __m512i w_ = _mm512_cvtepu8_epi16(RAW);                                                           \
        __m512i lo_ = _mm512_and_si512(w_, low4), hi_ = _mm512_srli_epi16(w_, 4);                         \
        for (int j = 0; j < MR; j++) {                                                                    \
            const int16_t *xp_ = xq + j * xq_stride + (X);                                                \
            __m512i d_ = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo_, _mm512_loadu_si512(xp_)), hi_,        \
                                             _mm512_loadu_si512(xp_ + 32));                               \
            A[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_), _mm512_permutexvar_ps(idx, cs[j]), A[j]);      \
        }                                                                                                 \
        idx = _mm512_add_epi32(idx, two);                                                                 \
    } while (0)

/* one u4 weight row against MR (1..6) activation rows in pair order; below 3 rows, two accumulator
 * chains per row (even and odd pairs), from 3 on one (the rows are independent chains) */
TGT_512 static inline __attribute__((always_inline)) void u4_rows_512(
    const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb, int64_t bpg,
    const int16_t *xq, const float *xd, const float *xs, int64_t xq_stride, int64_t xb_stride,
    float *out, int64_t out_stride, const int MR) {
    __m512 a0[6], a1s[2], am[6], cs[6];
    __m512 *a1 = MR < 3 ? a1s : a0;
    for (int j = 0; j < MR; j++) a0[j] = am[j] = _mm512_setzero_ps();
    a1s[0] = a1s[1] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi16(0x0F), two = _mm512_set1_epi32(2);
    const __m512i idx0 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    if (ROWS_PREFETCH)
        for (int64_t o = 0; o < nb * 16; o += 64) _mm_prefetch((const char *)qs + ROWS_PREFETCH + o, _MM_HINT_T0);
    for (int64_t c = 0; c < nb; c += 16) {
        const int64_t n = nb - c < 16 ? nb - c : 16;
        const __mmask16 km = (__mmask16)((1u << n) - 1);
        const __m512 sw = scales16_512(sc, f16, row_g0, c, n, nb, bpg);
        const __m512 mw = scales16_512(mn, f16, row_g0, c, n, nb, bpg);
        for (int j = 0; j < MR; j++) {
            am[j] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(km, xs + j * xb_stride + c), am[j]);
            cs[j] = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(km, xd + j * xb_stride + c));
        }
        __m512i idx = idx0;
        const uint8_t *w = qs + c * 16;
        const int16_t *xq0 = xq;
        xq += c * QK;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4, w += 64, xq += 128) {
            U4_PAIR_512(a0, _mm256_loadu_si256((const __m256i *)w), 0);
            U4_PAIR_512(a1, _mm256_loadu_si256((const __m256i *)(w + 32)), 64);
        }
        if (i + 2 <= n) { U4_PAIR_512(a0, _mm256_loadu_si256((const __m256i *)w), 0); i += 2; w += 32; xq += 64; }
        if (i < n) U4_PAIR_512(a1, _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)w)), 0);
        xq = xq0;
    }
    for (int j = 0; j < MR; j++)
        out[j * out_stride] = _mm512_reduce_add_ps(MR < 3 ? _mm512_add_ps(_mm512_add_ps(a0[j], a1s[j]), am[j])
                                                          : _mm512_add_ps(a0[j], am[j]));
}

/* one s8 block b against MR activation rows (natural order), scale products in cb[j][i] */
#define S8_BLOCK_512(A, B, I)                                                                              \
    do {                                                                                                  \
        __m512i w_ = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + (B) * QK)));          \
        for (int j = 0; j < MR; j++) {                                                                    \
            __m512i d_ = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w_,                                  \
                                             _mm512_loadu_si512(xq + j * xq_stride + (B) * QK));          \
            A[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_), _mm512_set1_ps(cb[j][I]), A[j]);               \
        }                                                                                                 \
    } while (0)

/* one s8 weight row against MR (1..6) activation rows: a block is 32 int16 lanes, one dpwssd;
 * accumulator chains as u4_rows_512 */
TGT_512 static inline __attribute__((always_inline)) void s8_rows_512(
    const int8_t *qs, const void *sc, int f16, int64_t row_g0, int64_t nb, int64_t bpg, const int16_t *xq,
    const float *xd, int64_t xq_stride, int64_t xb_stride, float *out, int64_t out_stride, const int MR) {
    __m512 a0[6], a1s[2];
    __m512 *a1 = MR < 3 ? a1s : a0;
    float cb[6][16] __attribute__((aligned(64)));
    for (int j = 0; j < MR; j++) a0[j] = _mm512_setzero_ps();
    a1s[0] = a1s[1] = _mm512_setzero_ps();
    if (ROWS_PREFETCH)
        for (int64_t o = 0; o < nb * QK; o += 64) _mm_prefetch((const char *)qs + ROWS_PREFETCH + o, _MM_HINT_T0);
    for (int64_t c = 0; c < nb; c += 16) {
        const int64_t n = nb - c < 16 ? nb - c : 16;
        const __mmask16 km = (__mmask16)((1u << n) - 1);
        const __m512 sw = scales16_512(sc, f16, row_g0, c, n, nb, bpg);
        for (int j = 0; j < MR; j++)
            _mm512_store_ps(cb[j], _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(km, xd + j * xb_stride + c)));
        int64_t i = 0;
        for (; i + 2 <= n; i += 2) {
            S8_BLOCK_512(a0, c + i, i);
            S8_BLOCK_512(a1, c + i + 1, i + 1);
        }
        if (i < n) S8_BLOCK_512(a0, c + i, i);
    }
    for (int j = 0; j < MR; j++) out[j * out_stride] = _mm512_reduce_add_ps(MR < 3 ? _mm512_add_ps(a0[j], a1s[j]) : a0[j]);
}

/* x rows in tiles of at most 6 (as even as possible: 7 = 4 + 3), each tile sharing every widened
 * weight block */
#define TILE_SIZES(M, CALL)                                                                                \
    do {                                                                                                  \
        int64_t tiles_ = ((M) + 5) / 6, m0_ = 0;                                                          \
        for (int64_t t_ = 0; t_ < tiles_; t_++) {                                                         \
            int64_t mr_ = ((M) - m0_) / (tiles_ - t_) + (((M) - m0_) % (tiles_ - t_) != 0);                \
            switch (mr_) {                                                                                \
                case 1: CALL(m0_, 1); break;                                                              \
                case 2: CALL(m0_, 2); break;                                                              \
                case 3: CALL(m0_, 3); break;                                                              \
                case 4: CALL(m0_, 4); break;                                                              \
                case 5: CALL(m0_, 5); break;                                                              \
                default: CALL(m0_, 6); break;                                                             \
            }                                                                                             \
            m0_ += mr_;                                                                                   \
        }                                                                                                 \
    } while (0)

#define U4_ROWS_FN(MR)                                                                                     \
TGT_512 static __attribute__((noinline)) void u4_rows_512_##MR(                                           \
    const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb, int64_t bpg,  \
    const int16_t *xq, const float *xd, const float *xs, int64_t xq_stride, int64_t xb_stride,             \
    float *out, int64_t out_stride) {                                                                     \
    u4_rows_512(qs, sc, mn, f16, row_g0, nb, bpg, xq, xd, xs, xq_stride, xb_stride, out, out_stride, MR); \
}
U4_ROWS_FN(1)
U4_ROWS_FN(2)
U4_ROWS_FN(3)
U4_ROWS_FN(4)
U4_ROWS_FN(5)
U4_ROWS_FN(6)

TGT_512 static void dot_u4_512(const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0, int64_t nb,
                               int64_t bpg, const int16_t *xq, const float *xd, const float *xs, int64_t M,
                               int64_t xq_stride, int64_t xb_stride, float *out, int64_t out_stride) {
#define U4_CALL(m0, mr)                                                                                    \
    u4_rows_512_##mr(qs, sc, mn, f16, row_g0, nb, bpg, xq + (m0) * xq_stride, xd + (m0) * xb_stride,     \
                     xs + (m0) * xb_stride, xq_stride, xb_stride, out + (m0) * out_stride, out_stride)
    TILE_SIZES(M, U4_CALL);
#undef U4_CALL
}

TGT_512 static void dot_s8_512(const int8_t *qs, const void *sc, int f16, int64_t row_g0, int64_t nb, int64_t bpg,
                               const int16_t *xq, const float *xd, int64_t M, int64_t xq_stride, int64_t xb_stride,
                               float *out, int64_t out_stride) {
#define S8_CALL(m0, mr)                                                                                    \
    s8_rows_512(qs, sc, f16, row_g0, nb, bpg, xq + (m0) * xq_stride, xd + (m0) * xb_stride, xq_stride,   \
                xb_stride, out + (m0) * out_stride, out_stride, mr)
    TILE_SIZES(M, S8_CALL);
#undef S8_CALL
}

/* One x row against u4 weights (avx512vnni): "quad order". A 64-byte load holds 4 blocks; its
 * 16-bit word j (block j/8, bytes i = 2(j%8) and i+1 of that block) carries 4 nibbles: values i,
 * i+16, i+1 and i+17 of the block, in bits 0-3, 4-7, 8-11 and 12-15. `and 15` and shifts by 4, 8
 * and 12 split them into 4 vectors of 32 int16 lanes with no shuffle, and the activations are
 * stored to match (to_quad_order: 128 values per 4 blocks, nibble k's lanes at 32k..32k+31). Each
 * vector meets its activations in one vpmaddwd/vpdpwssd, and the int32 lanes 4i..4i+3 then hold
 * block i's partial sums. Four such sums (16 blocks) are reduced by two unpack-and-add levels into
 * one vector whose lane 4L+g is block 4g+L, so the activation block scales are stored in that
 * order too and the weight scales take one permute. A row's last 1-15 blocks are read with byte
 * masks (the activations are zero-padded to 16 blocks). Streaming the weights from DRAM, it
 * prefetches QUAD_PREFETCH bytes ahead of the row it reads. */
#define QUAD_GROUP(D, W, X)                                                                                \
    do {                                                                                                  \
        __m512i w_ = (W);                                                                                 \
        __m512i t_ = _mm512_madd_epi16(_mm512_and_si512(w_, m4), _mm512_loadu_si512(X));                  \
        t_ = _mm512_dpwssd_epi32(t_, _mm512_and_si512(_mm512_srli_epi16(w_, 4), m4), _mm512_loadu_si512((X) + 32)); \
        t_ = _mm512_dpwssd_epi32(t_, _mm512_and_si512(_mm512_srli_epi16(w_, 8), m4), _mm512_loadu_si512((X) + 64)); \
        D = _mm512_dpwssd_epi32(t_, _mm512_srli_epi16(w_, 12), _mm512_loadu_si512((X) + 96));             \
    } while (0)

/* the integer sums of the n <= 16 blocks of one 16-block chunk of u4 weights w against quad-order
 * activations x: lane 4L + g holds block 4g + L (blocks past n give 0) */
TGT_512 static inline __attribute__((always_inline)) __m512i u4_chunk_sums(const uint8_t *w, int64_t n,
                                                                         const int16_t *x) {
    const __m512i m4 = _mm512_set1_epi16(0x000F);
    __m512i d[4];
    if (n == 16) {
        for (int g = 0; g < 4; g++) QUAD_GROUP(d[g], _mm512_loadu_si512(w + 64 * g), x + 128 * g);
    } else {
        for (int g = 0; g < 4; g++) {
            const int64_t left = n - 4 * g;
            if (left <= 0) { d[g] = _mm512_setzero_si512(); continue; }
            const __mmask64 k = left >= 4 ? ~(__mmask64)0 : (((__mmask64)1 << (left * 16)) - 1);
            QUAD_GROUP(d[g], _mm512_maskz_loadu_epi8(k, w + 64 * g), x + 128 * g);
        }
    }
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
    const __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(u, v), _mm512_unpackhi_epi64(u, v));
}

TGT_512 static void dot_u4_quad_one(const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t row_g0,
                                    int64_t nb, int64_t bpg, const int16_t *xq, const float *xdq, const float *xs,
                                    float *out) {
    __m512 acc = _mm512_setzero_ps(), am = _mm512_setzero_ps();
    const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (int64_t o = 0; o < nb * 16; o += 64) _mm_prefetch((const char *)qs + QUAD_PREFETCH + o, _MM_HINT_T0);
    for (int64_t c = 0; c < nb; c += 16) {
        const int64_t n = nb - c < 16 ? nb - c : 16;
        const __m512i sums = u4_chunk_sums(qs + c * 16, n, xq + c * QK);
        __m512 sw = _mm512_permutexvar_ps(perm, scales16_512(sc, f16, row_g0, c, n, nb, bpg));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sw, _mm512_loadu_ps(xdq + c)), acc);
        am = _mm512_fmadd_ps(scales16_512(mn, f16, row_g0, c, n, nb, bpg), _mm512_loadu_ps(xs + c), am);
    }
    *out = _mm512_reduce_add_ps(_mm512_add_ps(acc, am));
}

/* One x row against s8 weights (avx512vnni): "word order". A 64-byte load holds 2 blocks; its
 * 16-bit word j (block j/16, bytes i = 2(j%16) and i+1) splits into value i (shift left 8, then
 * arithmetic right 8) and value i+1 (arithmetic right 8), with no shuffle; the activations are
 * stored to match (to_word_order: per 2 blocks, value i of block b at 32(i%2) + 16b + i/2), and
 * the int32 lanes 0-7 / 8-15 of the product hold block 2p's / 2p+1's partial sums. Eight of them
 * (16 blocks) reduce in three unpack/shuffle-and-add levels into one vector whose lane q is block
 * WORD_BLOCK(q); the activation block scales are stored in that order. Tails and prefetch as
 * dot_u4_quad_one. */
#define WORD_PAIR(D, W, X)                                                                                 \
    do {                                                                                                  \
        __m512i w_ = (W);                                                                                 \
        D = _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_srai_epi16(_mm512_slli_epi16(w_, 8), 8),         \
                                                  _mm512_loadu_si512(X)),                                 \
                                _mm512_srai_epi16(w_, 8), _mm512_loadu_si512((X) + 32));                  \
    } while (0)
#define SUM4_128(A, B) _mm512_add_epi32(_mm512_unpacklo_epi32(A, B), _mm512_unpackhi_epi32(A, B))

/* the integer sums of the n <= 16 blocks of one 16-block chunk of s8 weights w against word-order
 * activations x: lane q holds block WORD_BLOCK(q) (blocks past n give 0) */
TGT_512 static inline __attribute__((always_inline)) __m512i s8_chunk_sums(const int8_t *w, int64_t n,
                                                                         const int16_t *x) {
    __m512i d[8];
    if (n == 16) {
        for (int p = 0; p < 8; p++) WORD_PAIR(d[p], _mm512_loadu_si512(w + 64 * p), x + 64 * p);
    } else {
        for (int p = 0; p < 8; p++) {
            const int64_t left = n - 2 * p;
            if (left <= 0) { d[p] = _mm512_setzero_si512(); continue; }
            const __mmask64 k = left >= 2 ? ~(__mmask64)0 : (((__mmask64)1 << 32) - 1);
            WORD_PAIR(d[p], _mm512_maskz_loadu_epi8(k, w + 64 * p), x + 64 * p);
        }
    }
    const __m512i a01 = SUM4_128(d[0], d[1]), a23 = SUM4_128(d[2], d[3]), a45 = SUM4_128(d[4], d[5]),
                  a67 = SUM4_128(d[6], d[7]);
    const __m512i b0 = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23), _mm512_unpackhi_epi64(a01, a23));
    const __m512i b1 = _mm512_add_epi32(_mm512_unpacklo_epi64(a45, a67), _mm512_unpackhi_epi64(a45, a67));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
}

TGT_512 static void dot_s8_word_one(const int8_t *qs, const void *sc, int f16, int64_t row_g0, int64_t nb,
                                    int64_t bpg, const int16_t *xq, const float *xdw, float *out) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i perm = _mm512_set_epi32(WORD_BLOCK(15), WORD_BLOCK(14), WORD_BLOCK(13), WORD_BLOCK(12),
                                          WORD_BLOCK(11), WORD_BLOCK(10), WORD_BLOCK(9), WORD_BLOCK(8),
                                          WORD_BLOCK(7), WORD_BLOCK(6), WORD_BLOCK(5), WORD_BLOCK(4),
                                          WORD_BLOCK(3), WORD_BLOCK(2), WORD_BLOCK(1), WORD_BLOCK(0));
    for (int64_t o = 0; o < nb * QK; o += 64) _mm_prefetch((const char *)qs + QUAD_PREFETCH + o, _MM_HINT_T0);
    for (int64_t c = 0; c < nb; c += 16) {
        const int64_t n = nb - c < 16 ? nb - c : 16;
        const __m512i sums = s8_chunk_sums(qs + c * QK, n, xq + c * QK);
        __m512 sw = _mm512_permutexvar_ps(perm, scales16_512(sc, f16, row_g0, c, n, nb, bpg));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sw, _mm512_loadu_ps(xdw + c)), acc);
    }
    *out = _mm512_reduce_add_ps(acc);
}

/* The lane of word order's reduced vector that holds block j (the inverse of WORD_BLOCK) */
#define WORD_LANE(j) (8 * ((j) / 8) + 4 * ((j) % 2) + ((j) % 8) / 2)

/* One x row against rows [n0, n1) of a matrix with a scale per block whose rows are not whole
 * 16-block chunks (nb = 18 for K = 576: the default model's Q4_1 qkv, o and gate_up, and its
 * Q8_0 output head), as one stream of blocks: the avx512vnni form of the AVX2 block stream
 * (block_stream256_avx2). The row kernels (dot_u4_quad_one, dot_s8_word_one) pay, for each such
 * row, a masked tail chunk (2 blocks) with a whole chunk's reduction and scale work, and the
 * row's own setup and final reduction: about a fifth to a third more vector work per block than
 * rows of whole chunks. Here R = stream_rows16(nb) rows (8 for nb = 18) make a whole number of
 * chunks, and the activations hold x repeated R times (ACT_QSTREAM, quad order, for u4;
 * ACT_WSTREAM, word order, for s8), so the chunks run across row ends. Each chunk gives 16 block
 * values (integer dot x activation scale x weight scale, + min x activation sum for u4), put
 * back in block order into buf; a row's output is the sum of its nb values in a fixed order.
 * A group starts at a row's first block, so its activations start at x's first block; every
 * block's value is computed lane by lane the same way wherever a chunk starts (a short last
 * group masks its last chunk), so a row's bits do not depend on which rows share its group or
 * how threads split the rows. */
TGT_512 static inline __attribute__((always_inline)) __m512 u4_chunk512(const uint8_t *w, const void *sc,
                                                                      const void *mn, int f16, int64_t b, int64_t n,
                                                                      const int16_t *x, const float *xdq,
                                                                      const float *xs) {
    /* lane 4L + g <-> block 4g + L (the reduced order; its own inverse) */
    const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512 sw = _mm512_permutexvar_ps(perm, scales16_512(sc, f16, 0, b, n, 0, 1));
    const __m512 val = _mm512_mul_ps(_mm512_cvtepi32_ps(u4_chunk_sums(w, n, x)), _mm512_mul_ps(sw, _mm512_loadu_ps(xdq)));
    return _mm512_fmadd_ps(scales16_512(mn, f16, 0, b, n, 0, 1), _mm512_loadu_ps(xs), _mm512_permutexvar_ps(perm, val));
}

TGT_512 static inline __attribute__((always_inline)) __m512 s8_chunk512(const int8_t *w, const void *sc, int f16,
                                                                      int64_t b, int64_t n, const int16_t *x,
                                                                      const float *xdw) {
    const __m512i perm = _mm512_set_epi32(WORD_BLOCK(15), WORD_BLOCK(14), WORD_BLOCK(13), WORD_BLOCK(12),
                                          WORD_BLOCK(11), WORD_BLOCK(10), WORD_BLOCK(9), WORD_BLOCK(8),
                                          WORD_BLOCK(7), WORD_BLOCK(6), WORD_BLOCK(5), WORD_BLOCK(4),
                                          WORD_BLOCK(3), WORD_BLOCK(2), WORD_BLOCK(1), WORD_BLOCK(0));
    const __m512i inv = _mm512_set_epi32(WORD_LANE(15), WORD_LANE(14), WORD_LANE(13), WORD_LANE(12),
                                         WORD_LANE(11), WORD_LANE(10), WORD_LANE(9), WORD_LANE(8),
                                         WORD_LANE(7), WORD_LANE(6), WORD_LANE(5), WORD_LANE(4),
                                         WORD_LANE(3), WORD_LANE(2), WORD_LANE(1), WORD_LANE(0));
    const __m512 sw = _mm512_permutexvar_ps(perm, scales16_512(sc, f16, 0, b, n, 0, 1));
    return _mm512_permutexvar_ps(inv, _mm512_mul_ps(_mm512_cvtepi32_ps(s8_chunk_sums(w, n, x)),
                                                    _mm512_mul_ps(sw, _mm512_loadu_ps(xdw))));
}

TGT_512 static void stream512(int s8, const void *qs, const void *sc, const void *mn, int f16, int64_t nb,
                              const int16_t *xq, const float *xd, const float *xs, float *y, int64_t n0, int64_t n1) {
    const int64_t R = stream_rows16(nb), bpb = s8 ? QK : QK / 2;   /* weight bytes per block */
    float buf[QSTREAM_BUF];   /* R * nb + 16 <= QSTREAM_BUF (stream512_fits) */
    for (int64_t gs = n0; gs < n1; gs += R) {
        const int64_t ge = gs + R < n1 ? gs + R : n1, nblk = (ge - gs) * nb, b0 = gs * nb;
        const char *w0 = (const char *)qs + b0 * bpb;
        for (int64_t c = 0; c < nblk; c += 16) {
            const int64_t n = nblk - c < 16 ? nblk - c : 16;
            const char *w = w0 + c * bpb;
            for (int64_t o = 0; o < 16 * bpb; o += 64) _mm_prefetch(w + QUAD_PREFETCH + o, _MM_HINT_T0);
            _mm512_storeu_ps(buf + c, s8 ? s8_chunk512((const int8_t *)w, sc, f16, b0 + c, n, xq + c * QK, xd + c)
                                         : u4_chunk512((const uint8_t *)w, sc, mn, f16, b0 + c, n, xq + c * QK, xd + c,
                                                       xs + c));
        }
        for (int64_t r = gs; r < ge; r++) {   /* a row's nb values, 16 at a time, then across lanes */
            const float *v = buf + (r - gs) * nb;
            __m512 acc = _mm512_setzero_ps();
            int64_t i = 0;
            for (; i + 16 <= nb; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(v + i));
            if (i < nb) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps((__mmask16)((1u << (nb - i)) - 1), v + i));
            y[r] = _mm512_reduce_add_ps(acc);
        }
    }
}

/* Several x rows (2..QS_ROWS_MAX) against u4 weights on the avx512vnni set, in the one-row
 * kernels' orders (quad order; the block stream for rows that are not whole 16-block chunks).
 * Each 64-byte load of weights is split into its 4 nibble vectors once and meets every x row's
 * activations: per x row the same madd / dpwssd chain, reduction and scale arithmetic as the
 * one-row kernels, lane for lane, so every row's output has the bits it has alone (a request gives
 * the same logits alone and beside others). Against the AMX tiles, whose products are free but
 * whose unpacking, tile stores and per-pair scaling cost the same per weight at 2 x rows as at 4,
 * this keeps a decode step of a few sequences near the weights' read time. */
#ifndef QS_ROWS_MAX
#define QS_ROWS_MAX 4       /* the most x rows the kernels below take in one pass */
#endif
_Static_assert(QS_ROWS_MAX >= 2 && QS_ROWS_MAX <= 4, "u4_rows_quad512 has kernels for 2 to 4 rows");
#ifndef QS_ROWS_AMX
#define QS_ROWS_AMX 3       /* x rows up to which the amx set uses them (qs_rows_max); from 4 the tiles */
#endif

/* the 16-block chunk sums of MR x rows (x + j * xs_stride) against u4 weights w (n <= 16 blocks),
 * each as u4_chunk_sums gives them */
TGT_512 static inline __attribute__((always_inline)) void u4_chunk_sums_rows(const uint8_t *w, int64_t n,
                                                                           const int16_t *x, int64_t x_stride,
                                                                           const int MR, __m512i *out) {
    const __m512i m4 = _mm512_set1_epi16(0x000F);
    __m512i half[2][QS_ROWS_MAX];   /* per x row: loads 0-1 and 2-3 summed pairwise (u4_chunk_sums' u, v) */
    for (int h = 0; h < 2; h++) {   /* two loads at a time, so that a row keeps 2 sums live, not 4 */
        __m512i nib[2][4];
        for (int e = 0; e < 2; e++) {
            const int64_t g = 2 * h + e, left = n - 4 * g;
            const __mmask64 k = left >= 4 ? ~(__mmask64)0 : left <= 0 ? 0 : (((__mmask64)1 << (left * 16)) - 1);
            const __m512i w_ = n == 16 ? _mm512_loadu_si512(w + 64 * g) : _mm512_maskz_loadu_epi8(k, w + 64 * g);
            nib[e][0] = _mm512_and_si512(w_, m4);
            nib[e][1] = _mm512_and_si512(_mm512_srli_epi16(w_, 4), m4);
            nib[e][2] = _mm512_and_si512(_mm512_srli_epi16(w_, 8), m4);
            nib[e][3] = _mm512_srli_epi16(w_, 12);
        }
        for (int j = 0; j < MR; j++) {
            __m512i d[2];
            for (int e = 0; e < 2; e++) {
                const int16_t *X = x + j * x_stride + 128 * (2 * h + e);
                __m512i t = _mm512_madd_epi16(nib[e][0], _mm512_loadu_si512(X));
                t = _mm512_dpwssd_epi32(t, nib[e][1], _mm512_loadu_si512(X + 32));
                t = _mm512_dpwssd_epi32(t, nib[e][2], _mm512_loadu_si512(X + 64));
                d[e] = _mm512_dpwssd_epi32(t, nib[e][3], _mm512_loadu_si512(X + 96));
            }
            half[h][j] = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
        }
    }
    for (int j = 0; j < MR; j++)
        out[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(half[0][j], half[1][j]),
                                  _mm512_unpackhi_epi64(half[0][j], half[1][j]));
}

/* stream512 (u4) for MR x rows: activations row j at xq + j * qstride, scales at + j * bstride */
TGT_512 static inline __attribute__((always_inline)) void u4_stream512_rows(
        const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t nb, const int16_t *xq, const float *xd,
        const float *xs, int64_t qstride, int64_t bstride, float *y, int64_t N, int64_t n0, int64_t n1, const int MR) {
    const int64_t R = stream_rows16(nb);
    const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    float buf[QS_ROWS_MAX][QSTREAM_BUF] __attribute__((aligned(64)));   /* R * nb + 16 <= QSTREAM_BUF */
    for (int64_t gs = n0; gs < n1; gs += R) {
        const int64_t ge = gs + R < n1 ? gs + R : n1, nblk = (ge - gs) * nb, b0 = gs * nb;
        const uint8_t *w0 = qs + b0 * (QK / 2);
        for (int64_t c = 0; c < nblk; c += 16) {
            const int64_t n = nblk - c < 16 ? nblk - c : 16;
            const uint8_t *w = w0 + c * (QK / 2);
            for (int64_t o = 0; o < 16 * (QK / 2); o += 64) _mm_prefetch((const char *)w + QUAD_PREFETCH + o, _MM_HINT_T0);
            __m512i sums[QS_ROWS_MAX];
            u4_chunk_sums_rows(w, n, xq + c * QK, qstride, MR, sums);
            const __m512 sw = _mm512_permutexvar_ps(perm, scales16_512(sc, f16, 0, b0 + c, n, 0, 1));
            const __m512 mw = scales16_512(mn, f16, 0, b0 + c, n, 0, 1);
            for (int j = 0; j < MR; j++) {   /* u4_chunk512's arithmetic */
                const __m512 val = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[j]),
                                                 _mm512_mul_ps(sw, _mm512_loadu_ps(xd + j * bstride + c)));
                _mm512_storeu_ps(buf[j] + c, _mm512_fmadd_ps(mw, _mm512_loadu_ps(xs + j * bstride + c),
                                                             _mm512_permutexvar_ps(perm, val)));
            }
        }
        for (int j = 0; j < MR; j++)
            for (int64_t r = gs; r < ge; r++) {   /* as stream512 */
                const float *v = buf[j] + (r - gs) * nb;
                __m512 acc = _mm512_setzero_ps();
                int64_t i = 0;
                for (; i + 16 <= nb; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(v + i));
                if (i < nb) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps((__mmask16)((1u << (nb - i)) - 1), v + i));
                y[j * N + r] = _mm512_reduce_add_ps(acc);
            }
    }
}

/* dot_u4_quad_one for MR x rows, over weight rows [n0, n1) (out: y[j * N + n]) */
TGT_512 static inline __attribute__((always_inline)) void u4_quad_rows(
        const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t nb, int64_t bpg, int64_t G,
        const int16_t *xq, const float *xdq, const float *xs, int64_t qstride, int64_t bstride, float *y, int64_t N,
        int64_t n0, int64_t n1, const int MR) {
    const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const int64_t rb = nb * (QK / 2);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = qs + n * rb;
        __m512 acc[QS_ROWS_MAX], am[QS_ROWS_MAX];
        for (int j = 0; j < MR; j++) acc[j] = am[j] = _mm512_setzero_ps();
        for (int64_t o = 0; o < rb; o += 64) _mm_prefetch((const char *)row + QUAD_PREFETCH + o, _MM_HINT_T0);
        for (int64_t c = 0; c < nb; c += 16) {
            const int64_t cn = nb - c < 16 ? nb - c : 16;
            __m512i sums[QS_ROWS_MAX];
            u4_chunk_sums_rows(row + c * 16, cn, xq + c * QK, qstride, MR, sums);
            const __m512 sw = _mm512_permutexvar_ps(perm, scales16_512(sc, f16, n * G, c, cn, nb, bpg));
            const __m512 mw = scales16_512(mn, f16, n * G, c, cn, nb, bpg);
            for (int j = 0; j < MR; j++) {
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[j]), _mm512_mul_ps(sw, _mm512_loadu_ps(xdq + j * bstride + c)),
                                         acc[j]);
                am[j] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(xs + j * bstride + c), am[j]);
            }
        }
        for (int j = 0; j < MR; j++) y[j * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j], am[j]));
    }
}

#define U4_QS_FN(MR)                                                                                       \
TGT_512 static __attribute__((noinline)) void u4_stream512_rows_##MR(                                     \
        const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t nb, const int16_t *xq,        \
        const float *xd, const float *xs, int64_t qstride, int64_t bstride, float *y, int64_t N,          \
        int64_t n0, int64_t n1) {                                                                         \
    u4_stream512_rows(qs, sc, mn, f16, nb, xq, xd, xs, qstride, bstride, y, N, n0, n1, MR);              \
}                                                                                                         \
TGT_512 static __attribute__((noinline)) void u4_quad_rows_##MR(                                          \
        const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t nb, int64_t bpg, int64_t G,   \
        const int16_t *xq, const float *xd, const float *xs, int64_t qstride, int64_t bstride, float *y,  \
        int64_t N, int64_t n0, int64_t n1) {                                                              \
    u4_quad_rows(qs, sc, mn, f16, nb, bpg, G, xq, xd, xs, qstride, bstride, y, N, n0, n1, MR);           \
}
U4_QS_FN(2)
U4_QS_FN(3)
U4_QS_FN(4)

/* M (2 to QS_ROWS_MAX; one row has its own kernels) x rows of quad-order (stream: with `stream`)
 * activations against u4 rows [n0, n1) */
TGT_512 static void u4_rows_quad512(int stream, const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t nb,
                                    int64_t bpg, int64_t G, const int16_t *xq, const float *xd, const float *xs,
                                    int64_t M, int64_t qstride, int64_t bstride, float *y, int64_t N, int64_t n0,
                                    int64_t n1) {
#define QS_CALL(K)                                                                                          \
    if (stream) u4_stream512_rows_##K(qs, sc, mn, f16, nb, xq, xd, xs, qstride, bstride, y, N, n0, n1);    \
    else u4_quad_rows_##K(qs, sc, mn, f16, nb, bpg, G, xq, xd, xs, qstride, bstride, y, N, n0, n1)
    switch (M) {
    case 2: QS_CALL(2); break;
    case 3: QS_CALL(3); break;
    default: QS_CALL(4); break;   /* M <= QS_ROWS_MAX (u4_act_order) */
    }
#undef QS_CALL
}
#endif /* __GNUC__ >= 9 */

/* AVX2 activation quantization, same arithmetic as quantize_rows */
TGT_AVX2 static void quantize_rows_avx2(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs) {
    int64_t nb = (K + QK - 1) / QK, Kp = nb * QK, full = K / QK;
    const __m256 signmask = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        for (int64_t b = 0; b < full; b++) {
            const float *p = xr + b * QK;
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8), v2 = _mm256_loadu_ps(p + 16),
                   v3 = _mm256_loadu_ps(p + 24);
            __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signmask, v0), _mm256_andnot_ps(signmask, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(signmask, v2), _mm256_andnot_ps(signmask, v3)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float amax = _mm_cvtss_f32(h);
            float d = amax / QMAX, id = d != 0.f ? 1.f / d : 0.f;
            __m256 vid = _mm256_set1_ps(id);
            const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, vid), r));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, vid), r));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, vid), r));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, vid), r));
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            /* pack 32 int32 -> 32 int16 in order (packs interleaves 128-bit lanes; permute undoes it) */
            __m256i p16a = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
            __m256i p16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
            _mm256_storeu_si256((__m256i *)(xq + m * Kp + b * QK), p16a);
            _mm256_storeu_si256((__m256i *)(xq + m * Kp + b * QK + 16), p16b);
            xd[m * nb + b] = d;
            xs[m * nb + b] = d * (float)_mm_cvtsi128_si32(s4);
        }
        if (full < nb) {  /* ragged last block: the scalar code on a copy of the tail */
            float tail[QK];
            int64_t n = K - full * QK;
            memcpy(tail, xr + full * QK, (size_t)n * sizeof(float));
            quantize_rows(tail, 1, n, xq + m * Kp + full * QK, xd + m * nb + full, xs + m * nb + full);
        }
    }
}

/* dequantize 32 u4 values of one block (scale s, min mm) into out (n <= 32 values written) */
TGT_AVX2 static void deq_u4_block_avx2(const uint8_t *p, float s, float mm, float *out, int64_t n) {
    __m256i w = nibbles32(p);
    __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(mm);
    float tmp[QK];
    float *dst = n == QK ? out : tmp;
    __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    _mm256_storeu_ps(dst + 0, _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vm));
    _mm256_storeu_ps(dst + 8, _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vm));
    _mm256_storeu_ps(dst + 16, _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vm));
    _mm256_storeu_ps(dst + 24, _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vm));
    if (n != QK) memcpy(out, tmp, (size_t)n * sizeof(float));
}

TGT_AVX2 static void deq_s8_block_avx2(const int8_t *p, float s, float *out, int64_t n) {
    __m256 vs = _mm256_set1_ps(s);
    float tmp[QK];
    float *dst = n == QK ? out : tmp;
    for (int i = 0; i < QK; i += 8) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(p + i));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
    }
    if (n != QK) memcpy(out, tmp, (size_t)n * sizeof(float));
}

/* ---- AMX (Sapphire Rapids and later): 2+ x rows through the tile unit ----------------------
 * The "amx" kernel set is avx512vnni plus Intel AMX's int8 tile multiply, used for matmuls of
 * AMX_MIN_ROWS (2) or more x rows (one row keeps the avx512vnni kernel, which reads its weights at
 * the memory's pace; u4 matrices keep its quad-order kernels up to QS_ROWS_AMX rows).
 * Every int16 activation splits exactly into two signed bytes, x = 256 hi + lo with lo and hi in
 * -128..127 (the reason QMAX is 32639 rather than 32767), so the int16 dot products of the other
 * kernels come out of int8 tile products (TDPBSSD) exactly: the results equal theirs up to float
 * summation order.
 * One tile product C[16 x 16] += A[16 x 64] . B[64 x 16] covers 16 weight rows and a pair of blocks
 * (64 values) for 16 columns. The B tile of a pair puts 4 x rows' digits of the first block in
 * columns 0-7 (hi digits of x rows 0-3, then lo digits) with zeros in 8-15, and the second block's
 * in columns 8-15 with zeros in 0-7; so row r of C holds, for weight row r, the hi and lo sums of
 * both blocks for the 4 x rows, kept apart. One fp32 multiply with xdv = [256 xd | xd | 256 xd' |
 * xd'] (xd, xd' the two blocks' activation scales) and a multiply-add with the weight row's two
 * block scales s(r, b), s(r, b') then apply all the scales, and, for u4, one more multiply-add
 * with the mins and xsv = [xs | 0 | xs' | 0]; the four 4-lane parts are added at the end.
 * That layout (a unit of 2 blocks per product, groups of 4 x rows) serves up to 4 x rows. From 5
 * rows the unit is 1 block (A[16 x 32] . B[32 x 16]) and a group 8 x rows: columns 0-7 the hi
 * digits of x rows 0-7, 8-15 their lo digits, one broadcast block scale per weight row, and the
 * two 8-lane halves added at the end. From AMX_WIDE_ROWS (9) rows the wide layout puts 16 x rows
 * across the columns, with the hi and lo sums in two C tiles (amx_rows_u with W). Each step up covers
 * more x rows with the same vector work per weight row and block, but needs more tile loads,
 * products and stores per block; on the host measured, a tile load or store cost about as much as
 * a product's scaling, so each layout is the fastest only for its own range of rows
 * (docs/benchmarks.md, "Tile layouts by rows").
 * u4 weights are unpacked to one byte per value into a buffer, 16 rows x AMX_CHUNK blocks at a time,
 * that the A tiles load from; every group of x rows then runs on the unpacked values (their
 * running sums kept in memory between chunks). s8 weights load straight from the matrix (a
 * buffered copy when fewer than 16 rows are left).
 * The CPU needs the OS's permission to use the tiles (arch_prctl, asked for once in best_isa). */
#if TM_AMX
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))
#define AMX_CHUNK 32           /* blocks of the 16 weight rows unpacked at a time */
#define AMX_GROUPS 8           /* groups of x rows per pass over the weights */

/* The layouts: blocks per tile product (the unit: 2 up to 4 x rows, 1 from 5), x rows per group
 * (4 or 8: 16 columns = unit blocks x 2 digits x rows), the bytes per group and unit (B tile |
 * xdv 64 | xsv 64) and the units of a row of nb blocks */
#define AMX_GROUP_ROWS(U) (8 / (U))
#define AMX_UNIT_BYTES(U) (512 * (U) + 128)
static inline int64_t amx_units(int64_t nb, int U) { return (nb + U - 1) / U; }
/* From AMX_WIDE_ROWS x rows the wide layout (amx_rows_u with W): 16 x rows per group, one block per
 * unit, per group and block the hi and lo B tiles (512 bytes each) | xd 64 | xs 64 */
#define AMX_WIDE_ROWS 9
#define AMX_WIDE_BYTES 1152
#define AMX_WIDE_GROUPS 4      /* groups of 16 x rows per pass over the weights */

/* The layout of M x rows (the one place that picks it): returns whether it is the wide one, and
 * its unit in *U (2: pairs, up to 4 rows; 1: one block, 5-8 rows, and wide) */
static inline int amx_layout(int64_t M, int *U) {
    const int wide = M >= AMX_WIDE_ROWS;
    *U = wide || M > 4 ? 1 : 2;
    return wide;
}

/* the act buffer's shape for M x rows of nb blocks: the unit, rows per group, bytes per group and
 * unit, units per row; returns whether the layout is the wide one */
static inline int amx_shape(int64_t M, int64_t nb, int *U, int64_t *R, int64_t *UB, int64_t *np) {
    const int wide = amx_layout(M, U);
    *R = wide ? 16 : AMX_GROUP_ROWS(*U);
    *UB = wide ? AMX_WIDE_BYTES : AMX_UNIT_BYTES(*U);
    *np = amx_units(nb, *U);
    return wide;
}

/* M rows of K activations -> per group of x rows and unit: the B tile ([8U][16 x 4] bytes: row k/4
 * of the unit's 32U values, column c, byte k%4), xdv and xsv (see above); zero where no x row or
 * block is */
TGT_AMX static void amx_quantize(const float *x, int64_t M, int64_t K, uint8_t *buf) {
    const int64_t nb = (K + QK - 1) / QK;
    int U;
    int64_t R, UB, np;
    const int wide = amx_shape(M, nb, &U, &R, &UB, &np);
    const int64_t ng = (M + R - 1) / R;
    if (!wide)
        memset(buf, 0, (size_t)(ng * np * UB));
    else if (M % 16)   /* the wide layout: the last group's missing rows only need zero scales */
        for (int64_t b = 0; b < nb; b++) memset(buf + ((ng - 1) * nb + b) * UB + 1024, 0, 128);
    const __m256i rows8 = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
    const __m512i c128 = _mm512_set1_epi32(128), cff = _mm512_set1_epi32(0xFF);
    for (int64_t m = 0; m < M; m++) {
        const int64_t g = m / R, j = m % R;
        const float *xr = x + m * K;
        /* quantized as every other kernel's activations are (bit for bit), 32 blocks at a time,
         * then split */
        int16_t qc[32 * QK];
        float dc[32], sc32[32];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t h = b % U;   /* the block's place in its unit: its K rows and columns */
            uint8_t *blk = buf + (g * np + b / U) * UB;
            if (b % 32 == 0) {
                const int64_t k0 = b * QK;
                quantize_rows_avx2(xr + k0, 1, K - k0 < 32 * QK ? K - k0 : 32 * QK, qc, dc, sc32);
            }
            const int16_t *q = qc + (b % 32) * QK;
            const float d = dc[b % 32], xs = sc32[b % 32];
            const __m512i i0 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)q));
            const __m512i i1 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 16)));
            /* lo = ((x + 128) & 255) - 128, hi = (x - lo) / 256: both in -128..127 for |x| <= 32639 */
            const __m512i lo0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i0, c128), cff), c128);
            const __m512i lo1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i1, c128), cff), c128);
            const __m512i hi0 = _mm512_srai_epi32(_mm512_sub_epi32(i0, lo0), 8), hi1 = _mm512_srai_epi32(_mm512_sub_epi32(i1, lo1), 8);
            const __m256i hib = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(hi0)), _mm512_cvtepi32_epi8(hi1), 1);
            const __m256i lob = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(lo0)), _mm512_cvtepi32_epi8(lo1), 1);
            if (wide) {   /* x row j's 4 values 4q..4q+3 are dword j of row q of the hi and lo tiles */
                _mm256_i32scatter_epi32(blk + j * 4, rows8, hib, 1);
                _mm256_i32scatter_epi32(blk + 512 + j * 4, rows8, lob, 1);
                ((float *)(blk + 1024))[j] = d;
                ((float *)(blk + 1088))[j] = xs;
                continue;
            }
            uint8_t *t = blk + h * 512;   /* this block's 8 tile rows */
            _mm256_i32scatter_epi32(t + (h * 2 * R + j) * 4, rows8, hib, 1);
            _mm256_i32scatter_epi32(t + (h * 2 * R + R + j) * 4, rows8, lob, 1);
            float *xdv = (float *)(blk + 512 * U), *xsv = (float *)(blk + 512 * U + 64);
            xdv[h * 2 * R + j] = 256.f * d;
            xdv[h * 2 * R + R + j] = d;
            xsv[h * 2 * R + j] = xs;
        }
    }
}

/* The tile shapes: C (0-3) 16 weight rows x 16 int32, A (4, 5) 16 weight rows x a block pair of
 * bytes, B (6, 7) a block pair x 16 digit columns, all 16 x 64 bytes. Loaded when the thread's
 * configuration differs (another library may have used the tiles since; reading it back costs a
 * few ns, loading it ~50); the tiles then stay configured on the thread. */
typedef struct { uint8_t palette, start, res[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) AmxCfg;
TGT_AMX static void amx_config(int U) {
    AmxCfg c, now;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t >= 6 ? 8 * U : 16;
        c.colsb[t] = t == 4 || t == 5 ? 32 * U : 64;
    }
    _tile_storeconfig(&now);
    if (memcmp(&c, &now, sizeof c)) _tile_loadconfig(&c);
}

/* The weight rows of the tile at t0 of rows [n0, n1) (a last tile of fewer than 16 rows moves back
 * over rows already done: same values), and the prefetch of the tiles after it: the next tile's
 * weights (its rows are contiguous) are prefetched while this one computes, `per` lines per step
 * of `steps` steps, so that the loads stay spread out, and the tile after it into L2; past n1 too
 * (up to N): the fused decode step calls the kernel for claims and slices of a few tiles, and its
 * next call usually goes on from n1 */
typedef struct { const char *pf, *pf_end, *pf2, *pf2_end; int64_t per; } AmxPf;
static inline AmxPf amx_tile(int64_t t0, int64_t n0, int64_t n1, int64_t N, const void *qs, int64_t wstride,
                             int64_t steps, int64_t *r0, int64_t *rows) {
    *r0 = t0 + 16 <= n1 ? t0 : (n1 - 16 > n0 ? n1 - 16 : n0);
    *rows = n1 - *r0 < 16 ? n1 - *r0 : 16;
    const char *w = (const char *)qs;
    AmxPf p = {w + (*r0 + 16) * wstride, w + (*r0 + 32 < N ? *r0 + 32 : N) * wstride, NULL,
               w + (*r0 + 48 < N ? *r0 + 48 : N) * wstride, (16 * wstride / 64 + steps - 1) / steps};
    p.pf2 = p.pf_end;
    return p;
}

TGT_AMX static inline void amx_prefetch(AmxPf *p) {
    for (int64_t q = 0; q < p->per && p->pf < p->pf_end; q++, p->pf += 64) _mm_prefetch(p->pf, _MM_HINT_T0);
    for (int64_t q = 0; q < p->per && p->pf2 < p->pf2_end; q++, p->pf2 += 64) _mm_prefetch(p->pf2, _MM_HINT_T1);
}

/* Weight rows [r0, r0 + rows) of blocks [c0, c0 + n) for the A tiles: u4 rows unpacked to one
 * byte per value into scratch (16 rows x AMX_CHUNK blocks), s8 rows copied there where `copy`
 * (too few rows left to load 16 straight from W, or a unit's second block past the row's end);
 * their block scales (and u4 mins) into sw and mw */
TGT_AMX static inline void amx_chunk(int s8, int copy, const void *qs, const void *sc, const void *mn, int f16,
                                     int64_t G, int64_t bpg, int64_t nb, int64_t wstride, int64_t r0, int64_t rows,
                                     int64_t c0, int64_t n, uint8_t *scratch, float sw[16][AMX_CHUNK],
                                     float mw[16][AMX_CHUNK]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i lane0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), lane1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = (const uint8_t *)qs + (r0 + r) * wstride;
        uint8_t *dst = scratch + r * AMX_CHUNK * QK;
        if (!s8) {   /* 4 blocks per 64-byte load: [b lo nibbles | b hi nibbles] per block */
            src += c0 * 16;
            for (int64_t i = 0; i < n; i += 4) {
                const int64_t cnt = n - i < 4 ? (n - i) * 16 : 64;
                const __mmask64 km = cnt == 64 ? ~(__mmask64)0 : (((__mmask64)1 << cnt) - 1);
                const __m512i w = _mm512_maskz_loadu_epi8(km, src + i * 16);
                const __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
                _mm512_store_si512((__m512i *)(dst + i * 32), _mm512_permutex2var_epi64(lo, lane0, hi));
                if (i + 2 < n) _mm512_store_si512((__m512i *)(dst + i * 32 + 64), _mm512_permutex2var_epi64(lo, lane1, hi));
            }
        } else if (copy) {
            memcpy(dst, src + c0 * QK, (size_t)n * QK);
        }
        for (int64_t h = 0; h < n; h += 16) {
            const int64_t k = n - h < 16 ? n - h : 16;
            _mm512_store_ps(sw[r] + h, scales16_512(sc, f16, (r0 + r) * G, c0 + h, k, nb, bpg));
            if (!s8) _mm512_store_ps(mw[r] + h, scales16_512(mn, f16, (r0 + r) * G, c0 + h, k, nb, bpg));
        }
    }
}

/* The wide layout, from AMX_WIDE_ROWS x rows: the x rows go across the tile columns, 16 at a time.
 * Per block, one A tile holds 16 weight rows' values (16 x 32 bytes), two B tiles the block's hi and
 * lo digits of 16 x rows (8 x 64 bytes: row k/4, column = x row, byte k%4), and two tile products
 * give, for each weight row, the block's hi and lo sums of all 16 x rows, one x row per lane. The
 * scaling is then (hi << 8) + lo, a convert, a multiply by the rows' activation scales, a
 * multiply-add with the weight row's block scale and, for u4, one with its min and the rows'
 * scaled sums: per weight row and block, for 16 x rows. */
/* weight rows [n0, n1) (u4: s8 = 0, with mins; s8: s8 = 1) against the M x rows of act
 * (amx_quantize), y[m * N + n]: units of U blocks, or with W the wide layout (amx_layout picks them;
 * the wide one is described above) */
TGT_AMX static inline __attribute__((always_inline)) void amx_rows_u(
        const int U, const int W, int s8, const void *qs, const void *sc, const void *mn, int f16, int64_t K, int64_t group,
        const uint8_t *act, int64_t M, float *y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t R = W ? 16 : AMX_GROUP_ROWS(U), UB = W ? AMX_WIDE_BYTES : AMX_UNIT_BYTES(U);
    const int64_t GP = W ? AMX_WIDE_GROUPS : AMX_GROUPS;   /* groups per pass over the weights */
    const int64_t nb = (K + QK - 1) / QK, Kp = nb * QK, G = (K + group - 1) / group, bpg = group / QK;
    const int64_t np = amx_units(nb, U), ng = (M + R - 1) / R, wstride = s8 ? Kp : Kp / 2;
    /* rows of these past the weight rows of a short last tile hold whatever was there: they only
     * reach output rows that are not written */
    uint8_t scratch[16 * AMX_CHUNK * QK] __attribute__((aligned(64)));
    int32_t cb[6][16 * 16] __attribute__((aligned(64)));   /* stored C tiles (wide: [slot][hi, lo]) */
    float sw[16][AMX_CHUNK] __attribute__((aligned(64))), mw[16][AMX_CHUNK] __attribute__((aligned(64)));
    float sums[AMX_GROUPS][16][16] __attribute__((aligned(64)));   /* running sums between chunks */
    amx_config(U);
    for (int64_t g0 = 0; g0 < ng; g0 += GP) {
        const int64_t g1 = ng - g0 < GP ? ng : g0 + GP;
        for (int64_t t0 = n0; t0 < n1; t0 += 16) {
            int64_t r0, rows;
            AmxPf pf = amx_tile(t0, n0, n1, N, qs, wstride, np, &r0, &rows);   /* a step per unit or block */
            for (int64_t c0 = 0; c0 < nb; c0 += AMX_CHUNK) {
                const int64_t n = nb - c0 < AMX_CHUNK ? nb - c0 : AMX_CHUNK, last = c0 + AMX_CHUNK >= nb;
                const uint8_t *abase = scratch;
                int64_t astride = AMX_CHUNK * QK;
                amx_chunk(s8, rows < 16 || nb % U, qs, sc, mn, f16, G, bpg, nb, wstride, r0, rows, c0, n, scratch, sw, mw);
                if (s8 && rows == 16 && nb % U == 0) { abase = (const uint8_t *)qs + r0 * Kp + c0 * QK; astride = Kp; }
                for (int64_t g = g0; g < g1; g++) {
                    const uint8_t *ga = act + (g * np + c0 / U) * UB;
                    __m512 acc[16];
                    /* (sums is written at the end of every chunk but the last; gcc cannot tell) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
                    for (int r = 0; r < 16; r++) acc[r] = c0 ? _mm512_load_ps(sums[g - g0][r]) : _mm512_setzero_ps();
#pragma GCC diagnostic pop
                    if (W) {
#define AMXW_DP(CH, CL, A, I)                                                                             \
    do {                                                                                                  \
        _tile_zero(CH);                                                                                   \
        _tile_zero(CL);                                                                                   \
        _tile_loadd(A, abase + (I) * QK, astride);                                                        \
        _tile_loadd(6, ga + (I) * UB, 64);                                                                \
        _tile_loadd(7, ga + (I) * UB + 512, 64);                                                          \
        _tile_dpbssd(CH, A, 6);                                                                           \
        _tile_dpbssd(CL, A, 7);                                                                           \
    } while (0)
#define AMXW_POST(I)                                                                                      \
    do {                                                                                                  \
        const int32_t *hi_ = cb[2 * ((I) % 3)], *lo_ = cb[2 * ((I) % 3) + 1];                             \
        const __m512 xd_ = _mm512_loadu_ps((const float *)(ga + (I) * UB + 1024));                        \
        const __m512 xs_ = _mm512_loadu_ps((const float *)(ga + (I) * UB + 1088));                        \
        for (int r = 0; r < 16; r++) {                                                                    \
            const __m512i s_ = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi_ + r * 16), 8),    \
                                                _mm512_load_si512(lo_ + r * 16));                         \
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s_), xd_), _mm512_set1_ps(sw[r][I]), acc[r]); \
            if (!s8) acc[r] = _mm512_fmadd_ps(xs_, _mm512_set1_ps(mw[r][I]), acc[r]);                     \
        }                                                                                                 \
    } while (0)
/* step I: the tile products of block I into C tiles CH, CL (pairs alternate), the products of
 * block I - 1 (in PH, PL) stored, and those of block I - 2, stored a step ago, scaled: the tile
 * unit works on the next products while the vector units scale earlier ones */
#define AMXW_STEP(I, CH, CL, A, PH, PL)                                                                   \
    do {                                                                                                  \
        if ((I) < n) AMXW_DP(CH, CL, A, I);                                                               \
        amx_prefetch(&pf);                                                                                \
        if ((I) >= 1 && (I) - 1 < n) {                                                                    \
            _tile_stored(PH, cb[2 * (((I) - 1) % 3)], 64);                                                \
            _tile_stored(PL, cb[2 * (((I) - 1) % 3) + 1], 64);                                            \
        }                                                                                                 \
        if ((I) >= 2 && (I) - 2 < n) AMXW_POST((I) - 2);                                                  \
    } while (0)
                        for (int64_t i = 0; i < n + 2; i += 2) {
                            AMXW_STEP(i, 0, 1, 4, 2, 3);
                            AMXW_STEP(i + 1, 2, 3, 5, 0, 1);
                        }
#undef AMXW_DP
#undef AMXW_POST
#undef AMXW_STEP
                    } else {
#define AMX_DP(C, A, B, P)                                                                                \
    do {                                                                                                  \
        _tile_zero(C);                                                                                    \
        _tile_loadd(A, abase + (P) * U * QK, astride);                                                    \
        _tile_loadd(B, ga + (P) * UB, 64);                                                                \
        _tile_dpbssd(C, A, B);                                                                            \
    } while (0)
#define AMX_POST(P, CB)                                                                                   \
    do {                                                                                                  \
        const uint8_t *blk_ = ga + (P) * UB;                                                              \
        const __m512 xdv_ = _mm512_loadu_ps((const float *)(blk_ + 512 * U));                             \
        const __m512 xsv_ = _mm512_loadu_ps((const float *)(blk_ + 512 * U + 64));                        \
        for (int r = 0; r < 16; r++) {                                                                    \
            const __m512 v_ = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((CB) + r * 16)), xdv_);  \
            acc[r] = _mm512_fmadd_ps(v_, U == 1 ? _mm512_set1_ps(sw[r][P])                                \
                                                : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sw[r][2 * (P)]), \
                                                                       _mm512_set1_ps(sw[r][2 * (P) + 1])), acc[r]); \
            if (!s8)                                                                                      \
                acc[r] = _mm512_fmadd_ps(U == 1 ? _mm512_set1_ps(mw[r][P])                                \
                                                : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(mw[r][2 * (P)]), \
                                                                       _mm512_set1_ps(mw[r][2 * (P) + 1])), xsv_, acc[r]); \
        }                                                                                                 \
    } while (0)
/* step P: the tile product of pair P into C tile P % 4 (A and B tiles alternate), then the tile
 * product of pair P - 2, issued two steps ago, stored and scaled: the tile unit works on the next
 * products while the vector units scale the earlier ones */
#define AMX_STEP(P, C, A, B, CPREV)                                                                       \
    do {                                                                                                  \
        if ((P) < npc) AMX_DP(C, A, B, P);                                                                \
        amx_prefetch(&pf);                                                                                \
        if ((P) >= 2 && (P) - 2 < npc) {                                                                  \
            _tile_stored(CPREV, cb[CPREV], 64);                                                           \
            AMX_POST((P) - 2, cb[CPREV]);                                                                 \
        }                                                                                                 \
    } while (0)
                        const int64_t npc = (n + U - 1) / U;
                        for (int64_t p = 0; p < npc + 2; p += 4) {
                            AMX_STEP(p, 0, 4, 6, 2);
                            AMX_STEP(p + 1, 1, 5, 7, 3);
                            AMX_STEP(p + 2, 2, 4, 6, 0);
                            AMX_STEP(p + 3, 3, 5, 7, 1);
                        }
#undef AMX_DP
#undef AMX_POST
#undef AMX_STEP
                    }
                    if (!last) {
                        for (int r = 0; r < 16; r++) _mm512_store_ps(sums[g - g0][r], acc[r]);
                        continue;
                    }
                    if (W) {   /* lane j of acc[r]: x row g * R + j (R = 16), weight row r0 + r */
                        float tr[16][16] __attribute__((aligned(64)));
                        for (int r = 0; r < 16; r++) _mm512_store_ps(tr[r], acc[r]);
                        const int64_t mj = M - g * R < R ? M - g * R : R;
                        const __mmask16 km = (__mmask16)((1u << rows) - 1);
                        const __m512i col16 = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                                                                208, 224, 240);
                        for (int64_t j = 0; j < mj; j++)
                            _mm512_mask_storeu_ps(y + (g * R + j) * N + r0, km,
                                                  _mm512_i32gather_ps(_mm512_add_epi32(col16, _mm512_set1_epi32((int)j)),
                                                                      &tr[0][0], 4));
                        continue;
                    }
                    /* x row j's sum: lanes j, R + j (and with U = 2, 2R + j and 3R + j) */
                    const int64_t mj = M - g * R < R ? M - g * R : R;
                    for (int64_t r = 0; r < rows; r++) {
                        const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
                        float o[8];
                        if (U == 2) _mm_storeu_ps(o, _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1)));
                        else _mm256_storeu_ps(o, h8);
                        for (int64_t j = 0; j < mj; j++) y[(g * R + j) * N + r0 + r] = o[j];
                    }
                }
            }
        }
    }
}
TGT_AMX static void amx_rows(int s8, const void *qs, const void *sc, const void *mn, int f16, int64_t K, int64_t group,
                             const uint8_t *act, int64_t M, float *y, int64_t N, int64_t n0, int64_t n1) {
    int U;
    if (amx_layout(M, &U)) amx_rows_u(1, 1, s8, qs, sc, mn, f16, K, group, act, M, y, N, n0, n1);
    else if (U == 2) amx_rows_u(2, 0, s8, qs, sc, mn, f16, K, group, act, M, y, N, n0, n1);
    else amx_rows_u(1, 0, s8, qs, sc, mn, f16, K, group, act, M, y, N, n0, n1);
}
#endif /* TM_AMX */
#endif /* TM_X86 */

/* Note on the dequantized values: u4 is computed as fma(s, q, m) on AVX2 and s*q + m (two
 * roundings) in scalar code; both are within one float rounding of the exact value. The tests
 * compare against a float64 reference with a bound of a few ulps. */
static void deq_u4_block_scalar(const uint8_t *p, float s, float mm, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int q = i < 16 ? (p[i] & 0x0F) : (p[i - 16] >> 4);
        out[i] = fmaf(s, (float)q, mm);
    }
}

static void deq_s8_block_scalar(const int8_t *p, float s, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = s * (float)p[i];
}

/* ---- drivers ------------------------------------------------------------------------------- */
/* Quantized activations of M rows: xq [M, qstride] int16, xd / xs [M, bstride]; with pairs (the
 * avx512vnni u4 kernels) in pair order and padded with a zero block to an even block count. */
typedef struct {
    int16_t *xq;
    float *xd, *xs;
    int64_t qstride, bstride;
    int order;         /* one of ACT_* below: the order the kernels for this matmul read */
    void *mem;
    size_t cap;        /* bytes at mem when the buffer is reused (tmq_act_buffer); 0: sized per call */
    const float *xf;   /* TMQ_F32: the fp32 activations themselves, [M, K] */
} ActBuf;

enum { ACT_NATURAL = 0, ACT_PAIRS = 1, ACT_QUAD = 2, ACT_WORDS = 3, ACT_QUAD256 = 4, ACT_WORDS256 = 5,
       ACT_STREAM256 = 6, ACT_SSTREAM256 = 7, ACT_AMX = 8, ACT_QSTREAM = 9, ACT_WSTREAM = 10 };


/* natural order -> 256-bit word order (s8dot_word_avx2), in place: within each block, value i
 * goes to 16(i%2) + i/2; the block scales stay in block order */
static void to_word256_order(int16_t *q, int64_t nb) {
    int16_t t[QK];
    for (int64_t b = 0; b < nb; b++) {
        int16_t *v = q + b * QK;
        memcpy(t, v, sizeof t);
        for (int i = 0; i < QK; i++) v[16 * (i % 2) + i / 2] = t[i];
    }
}

/* natural block order -> word order (dot_s8_word_one), in place: within 2 blocks, value i of
 * block b goes to 32(i%2) + 16b + i/2; within 16 blocks, the scale of block WORD_BLOCK(q) goes to
 * lane q. nbp is a multiple of 16. */
static void word_values(int16_t *q, int64_t nbp) {   /* to_word_order's value moves (nbp even) */
    int16_t t[2 * QK];
    for (int64_t p0 = 0; p0 < nbp; p0 += 2) {
        int16_t *v = q + p0 * QK;
        memcpy(t, v, sizeof t);
        for (int b = 0; b < 2; b++)
            for (int i = 0; i < QK; i++) v[32 * (i % 2) + 16 * b + i / 2] = t[b * QK + i];
    }
}

static void to_word_order(int16_t *q, float *xd, int64_t nbp) {
    float f[16];
    if (q) word_values(q, nbp);
    for (int64_t c = 0; c < nbp; c += 16) {
        memcpy(f, xd + c, sizeof f);
        for (int j = 0; j < 16; j++) xd[c + j] = f[WORD_BLOCK(j)];
    }
}

/* a scale per block and rows that do not fill whole 8-block loads: the block stream
 * (block_stream256_avx2); with rows of 8k blocks the one-row kernel is faster (no values kept per
 * block). TOKENMILL_NO_BLOCK_STREAM=1: never (an A/B switch). */
static int block_stream(int64_t K, int64_t group) {
    const int64_t nb = (K + QK - 1) / QK;
    return group == QK && nb % 8 && !getenv("TOKENMILL_NO_BLOCK_STREAM");
}

/* one x row on the avx512vnni set: the block stream (stream512) for a scale per block and rows
 * that do not fill whole 16-block chunks; rows of 16k blocks keep the row kernels (no tail to
 * save). TOKENMILL_NO_BLOCK_STREAM=1: never (an A/B switch). */
static int stream512_fits(int64_t K, int64_t group) {
    const int64_t nb = (K + QK - 1) / QK;
    return group == QK && nb % 16 && stream_rows16(nb) * nb + 16 <= QSTREAM_BUF && !getenv("TOKENMILL_NO_BLOCK_STREAM");
}

/* the activation order the u4 kernels of the set in use read for M rows of a [N, K] matrix with
 * the given group size: the block stream (or, for rows of 8k blocks and scale groups, 256-bit
 * quad order) for one row on AVX2 / AVX-VNNI and for 2 to QUAD256_ROWS_MAX rows on AVX2
 * (u4_quad256_tile; AVX-VNNI keeps its dpwssd row kernels) */
#define QUAD256_ROWS_MAX 64
/* x rows up to which the avx512vnni and amx sets keep the quad-order kernels (u4_rows_quad512)
 * rather than the pair-order kernels (avx512vnni, 5+ rows) or the AMX tiles (amx, 4+ rows). One
 * thread, in cache, ns per weight of Q4_1 [1536, 576] and [576, 1536] matrices on an Intel host
 * with AMX: 2 rows 0.055-0.070 (quad) / 0.075-0.087 (tiles) / 0.068-0.097 (pairs), 3 rows
 * 0.065-0.097 / 0.076-0.086 / 0.106-0.124 (level in the model's step), 4 rows 0.093-0.136 /
 * 0.078-0.089 / 0.106-0.143 (docs/quantization.md, "Quad order for a few rows").
 * TOKENMILL_QUAD_ROWS_MAX=N (1-4) sets it for A/B checks (read at each call). */
static int qs_rows_max(void) {
#if TM_X86 && defined(__GNUC__) && __GNUC__ >= 9
    const char *e = getenv("TOKENMILL_QUAD_ROWS_MAX");
    if (e && *e) {
        const int v = atoi(e);
        return v < 1 ? 1 : v > QS_ROWS_MAX ? QS_ROWS_MAX : v;
    }
    return isa() == ISA_AMX ? QS_ROWS_AMX : QS_ROWS_MAX;
#else
    return 1;
#endif
}
static int u4_act_order(int64_t M, int64_t K, int64_t group) {
    if (isa() >= ISA_AVX512 && (M == 1 || M <= qs_rows_max()))   /* (one row: no getenv) */
        return stream512_fits(K, group) ? ACT_QSTREAM : ACT_QUAD;
    if (isa() >= ISA_AVX512) return isa() == ISA_AMX && M >= AMX_MIN_ROWS ? ACT_AMX : ACT_PAIRS;
    if (isa() < ISA_AVX2 || M > QUAD256_ROWS_MAX || (M > 1 && isa() != ISA_AVX2)) return ACT_NATURAL;
    return block_stream(K, group) ? ACT_STREAM256 : ACT_QUAD256;
}

/* the activation order the s8 kernels of the set in use read for M rows of a [N, K] matrix with the
 * given group size (the block stream as for u4: block_stream) */
static int s8_act_order(int64_t M, int64_t K, int64_t group) {
    if (isa() == ISA_AMX && M >= AMX_MIN_ROWS) return ACT_AMX;
    if (isa() < ISA_AVX2 || M > QUAD256_ROWS_MAX || (M > 1 && isa() != ISA_AVX2)) return ACT_NATURAL;
    if (isa() >= ISA_AVX512) return M == 1 && stream512_fits(K, group) ? ACT_WSTREAM : ACT_WORDS;
    if (block_stream(K, group)) return ACT_SSTREAM256;   /* the block stream (s8_stream_group) */
    return M == 1 ? ACT_WORDS256 : ACT_NATURAL;
}

/* the blocks of the activation stream for rows of nb blocks (block_stream256_avx2) */
static int64_t stream_blocks(int64_t nb) { return stream_rows(nb) * nb; }

/* natural block order -> quad order, in place, for kernels that load G blocks at a time (G = 4:
 * dot_u4_quad_one, 64-byte loads; G = 2: dot_u4_quad256_avx2, 32-byte loads): within G blocks,
 * value i of block b goes to 8G k + 8b + (i%16)/2 with k = 2(i%2) + i/16 (the nibble of a 16-bit
 * word it sits in); within 4G blocks (four loads, one reduced vector), the block scale of block
 * Gg + L goes to lane 4L + g. nbp is a multiple of 4G. */
#if TM_X86 && defined(__GNUC__)
/* to_quad_order's value moves for G = 2, 32 bytes at a time: within each 128-bit lane, the even
 * values of 8 go to its low half and the odd ones to its high half (pshufb), a 64-bit permute
 * gathers [evens of 16 | odds of 16], and 128-bit permutes pair block b0's halves with b1's. */
TGT_AVX2 static void quad256_values_avx2(int16_t *q, int64_t nbp) {
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t g0 = 0; g0 < nbp; g0 += 2) {
        __m256i *v = (__m256i *)(q + g0 * QK);
        __m256i a[4];   /* b0 values 0..15, b0 16..31, b1 0..15, b1 16..31 -> [evens | odds] */
        for (int i = 0; i < 4; i++)
            a[i] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256(v + i), split), 0xD8);
        _mm256_storeu_si256(v + 0, _mm256_permute2x128_si256(a[0], a[2], 0x20));   /* k = 0: even, < 16 */
        _mm256_storeu_si256(v + 1, _mm256_permute2x128_si256(a[1], a[3], 0x20));   /* k = 1: even, >= 16 */
        _mm256_storeu_si256(v + 2, _mm256_permute2x128_si256(a[0], a[2], 0x31));   /* k = 2: odd, < 16 */
        _mm256_storeu_si256(v + 3, _mm256_permute2x128_si256(a[1], a[3], 0x31));   /* k = 3: odd, >= 16 */
    }
}
#endif

/* q NULL: the scales' moves alone (xd NULL: the values' alone, nbp then a multiple of G) */
static void to_quad_order(int16_t *q, float *xd, int64_t nbp, int G) {
    int16_t t[4 * QK];
    float f[16];
#if TM_X86 && defined(__GNUC__)
    const int vec = G == 2 && isa() >= ISA_AVX2;
    if (vec && q) quad256_values_avx2(q, nbp);
#else
    const int vec = 0;
#endif
    for (int64_t g0 = 0; q && !vec && g0 < nbp; g0 += G) {
        int16_t *v = q + g0 * QK;
        memcpy(t, v, (size_t)G * QK * sizeof(int16_t));
        for (int b = 0; b < G; b++)
            for (int i = 0; i < QK; i++) v[8 * G * (2 * (i % 2) + i / 16) + 8 * b + (i % 16) / 2] = t[b * QK + i];
    }
    for (int64_t c = 0; xd && c < nbp; c += 4 * G) {
        memcpy(f, xd + c, (size_t)(4 * G) * sizeof(float));
        for (int L = 0; L < G; L++)
            for (int g = 0; g < 4; g++) xd[c + 4 * L + g] = f[G * g + L];
    }
}

/* natural block order -> pair order (see the AVX-512 section), in place */
static void to_pair_order(int16_t *q, float *xd, float *xs, int64_t nb) {
    if (nb & 1) {  /* the padding block */
        memset(q + nb * QK, 0, QK * sizeof(int16_t));
        xd[nb] = 0.f;
        xs[nb] = 0.f;
    }
    for (int64_t p = 0; p < (nb + 1) / 2; p++) {
        int16_t t[16], *v = q + p * 2 * QK;
        memcpy(t, v + 16, sizeof t);
        memcpy(v + 16, v + 32, sizeof t);
        memcpy(v + 32, t, sizeof t);
    }
}

/* The layout of M rows of K activations in `order` (a->order, a->bstride, a->qstride); returns the
 * bytes of a->mem it needs, and the int16 part's share of them in *qbytes. */
static size_t act_layout(int64_t M, int64_t K, int order, ActBuf *a, size_t *qbytes) {
    int64_t nb = (K + QK - 1) / QK;
    a->order = order;
    /* blocks a row is padded to a multiple of, per order: the kernels' loads and reductions */
    static const int64_t pad[] = {[ACT_NATURAL] = 1, [ACT_PAIRS] = 2, [ACT_QUAD] = 16, [ACT_WORDS] = 16,
                                  [ACT_QUAD256] = 8, [ACT_WORDS256] = 1, [ACT_STREAM256] = 1, [ACT_SSTREAM256] = 1,
                                  [ACT_AMX] = 1, [ACT_QSTREAM] = 16, [ACT_WSTREAM] = 16};
    a->bstride = (nb + pad[order] - 1) / pad[order] * pad[order];
    if (order == ACT_STREAM256 || order == ACT_SSTREAM256) a->bstride = stream_blocks(nb);   /* x repeated */
    if (order == ACT_QSTREAM || order == ACT_WSTREAM) a->bstride = stream_rows16(nb) * nb;      /* x repeated */
    a->qstride = a->bstride * QK;
#if TM_AMX
    if (order == ACT_AMX) {   /* amx_quantize's tiles and scales, per group of x rows and unit of blocks */
        int U;
        int64_t R, UB, np;
        amx_shape(M, nb, &U, &R, &UB, &np);
        *qbytes = (size_t)((M + R - 1) / R * np * UB);
        return *qbytes + 64;
    }
#endif
    *qbytes = ((size_t)(M * a->qstride) * sizeof(int16_t) + 63) & ~(size_t)63;
    return *qbytes + 2 * (size_t)(M * a->bstride) * sizeof(float) + 64;
}

/* quantize x into a->mem (a reused buffer of a->cap bytes, or a fresh allocation when a->cap is 0) */
static int act_quantize(const float *x, int64_t M, int64_t K, int order, ActBuf *a) {
    const int64_t nb = (K + QK - 1) / QK;
    size_t qbytes, bytes = act_layout(M, K, order, a, &qbytes);
    if (a->cap) {
        if (bytes > a->cap) return -1;
    } else if (!(a->mem = malloc(bytes))) {
        return -1;
    }
    a->xq = (int16_t *)a->mem;
    a->xd = (float *)((char *)a->mem + qbytes);
    a->xs = a->xd + M * a->bstride;
#if TM_AMX
    if (order == ACT_AMX) {
        amx_quantize(x, M, K, (uint8_t *)a->mem);
        return 0;
    }
#endif
    for (int64_t m = 0; m < M; m++) {
        int16_t *q = a->xq + m * a->qstride;
        float *d = a->xd + m * a->bstride, *s = a->xs + m * a->bstride;
#if TM_X86 && defined(__GNUC__)
        if (isa() >= ISA_AVX2) quantize_rows_avx2(x + m * K, 1, K, q, d, s);
        else
#endif
        quantize_rows(x + m * K, 1, K, q, d, s);
        if (order == ACT_QSTREAM || order == ACT_WSTREAM) {
            /* x's blocks again up to the stream's period. The values' moves stay within G blocks
             * (4: quad order, 2: word order), so they repeat every lcm(nb, G) blocks: reordered
             * once over that many, then copied; the scales' moves (within 16 blocks) run over all. */
            const int64_t G = order == ACT_QSTREAM ? 4 : 2, P = nb % G == 0 ? nb : nb % 2 == 0 ? 2 * nb : G * nb;
            for (int64_t b = nb; b < a->bstride; b += nb) {
                if (b < P) memcpy(q + b * QK, q, (size_t)nb * QK * sizeof(int16_t));
                memcpy(d + b, d, (size_t)nb * sizeof(float));
                memcpy(s + b, s, (size_t)nb * sizeof(float));
            }
            if (G == 4) to_quad_order(q, NULL, P, 4);
            else word_values(q, P);
            for (int64_t b = P; b < a->bstride; b += P) memcpy(q + b * QK, q, (size_t)P * QK * sizeof(int16_t));
            if (G == 4) to_quad_order(NULL, d, a->bstride, 4);
            else to_word_order(NULL, d, a->bstride);
            continue;
        }
        if (order == ACT_STREAM256 || order == ACT_SSTREAM256) {   /* x's blocks again up to the stream's period */
            for (int64_t b = nb; b < a->bstride; b += nb) {
                memcpy(q + b * QK, q, (size_t)nb * QK * sizeof(int16_t));
                memcpy(d + b, d, (size_t)nb * sizeof(float));
                memcpy(s + b, s, (size_t)nb * sizeof(float));
            }
            if (order == ACT_STREAM256) to_quad_order(q, d, a->bstride, 2);
            else to_word256_order(q, a->bstride);
            continue;
        }
        /* zero padding blocks: they meet zero or masked-off weights */
        memset(q + nb * QK, 0, (size_t)(a->bstride - nb) * QK * sizeof(int16_t));
        memset(d + nb, 0, (size_t)(a->bstride - nb) * sizeof(float));
        memset(s + nb, 0, (size_t)(a->bstride - nb) * sizeof(float));
        if (order == ACT_PAIRS) to_pair_order(q, d, s, nb);
        else if (order == ACT_QUAD) to_quad_order(q, d, a->bstride, 4);
        else if (order == ACT_QUAD256) to_quad_order(q, d, a->bstride, 2);
        else if (order == ACT_WORDS) to_word_order(q, d, a->bstride);
        else if (order == ACT_WORDS256) to_word256_order(q, nb);
    }
    return 0;
}

static int check_group(int64_t K, int64_t group) {
    int64_t Kp = (K + QK - 1) / QK * QK;
    return group > 0 && group % QK == 0 && group <= (Kp > QK ? Kp : QK);
}

/* ---- fp32 weights (TMQ_F32): the fused decode path of an unquantized model -------------------
 * y[m, n] = x[m] . W[n] over W [N, K] row-major, for a few x rows. A weight row is read once for
 * up to F32_TILE x rows. Each row's dot product runs over chunks of 2 x VL floats split between
 * two accumulators (then a VL chunk, then a scalar tail), so a row's sum order is the same for
 * any number of x rows, any tile and any thread split. */
#define F32_TILE 4
/* Weight rows prefetched ahead into L2. With several x rows the compute between a row's loads
 * left the hardware prefetchers behind the stream: at 2 threads on an Intel host with AMX, fp32
 * verify steps of 5 and 9 rows ran 1.09x and 1.07x faster with it, one row 1.01x
 * (benchmarks/decode_step_context.py --quantization none, docs/benchmarks.md). */
#define F32_PREFETCH_ROWS 16

static void f32_rows_scalar(const float *w, const float *x, int64_t K, int64_t M, float *out, int64_t os) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float a0 = 0.f, a1 = 0.f;
        int64_t k = 0;
        for (; k + 1 < K; k += 2) { a0 += w[k] * xm[k]; a1 += w[k + 1] * xm[k + 1]; }
        if (k < K) a0 += w[k] * xm[k];
        out[m * os] = a0 + a1;
    }
}

#if TM_X86 && defined(__GNUC__)
TGT_AVX2 static inline __attribute__((always_inline)) void f32_tile_avx2(const float *w, const float *x, int64_t K,
                                                                         float *out, int64_t os, const int MR) {
    __m256 a0[F32_TILE], a1[F32_TILE];
    for (int j = 0; j < MR; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (int j = 0; j < MR; j++) {
            a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * K + k), a0[j]);
            a1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * K + k + 8), a1[j]);
        }
    }
    if (k + 8 <= K) {
        const __m256 w0 = _mm256_loadu_ps(w + k);
        for (int j = 0; j < MR; j++) a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * K + k), a0[j]);
        k += 8;
    }
    for (int j = 0; j < MR; j++) {
        float s = hsum8(_mm256_add_ps(a0[j], a1[j]));
        for (int64_t t = k; t < K; t++) s += w[t] * x[j * K + t];
        out[j * os] = s;
    }
}

TGT_AVX2 static void f32_rows_avx2(const float *w, const float *x, int64_t K, int64_t M, float *out, int64_t os) {
    for (int64_t m0 = 0; m0 < M; m0 += F32_TILE) {
        const int64_t mr = M - m0 < F32_TILE ? M - m0 : F32_TILE;
        const float *xm = x + m0 * K;
        float *om = out + m0 * os;
        switch (mr) {
            case 1: f32_tile_avx2(w, xm, K, om, os, 1); break;
            case 2: f32_tile_avx2(w, xm, K, om, os, 2); break;
            case 3: f32_tile_avx2(w, xm, K, om, os, 3); break;
            default: f32_tile_avx2(w, xm, K, om, os, 4); break;
        }
    }
}

#if __GNUC__ >= 9
#define TGT_512F __attribute__((target("avx512f,avx2,fma")))
TGT_512F static inline __attribute__((always_inline)) void f32_tile_512(const float *w, const float *x, int64_t K,
                                                                        float *out, int64_t os, const int MR) {
    __m512 a0[F32_TILE], a1[F32_TILE];
    for (int j = 0; j < MR; j++) a0[j] = a1[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
        for (int j = 0; j < MR; j++) {
            a0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * K + k), a0[j]);
            a1[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + j * K + k + 16), a1[j]);
        }
    }
    if (k + 16 <= K) {
        const __m512 w0 = _mm512_loadu_ps(w + k);
        for (int j = 0; j < MR; j++) a0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * K + k), a0[j]);
        k += 16;
    }
    for (int j = 0; j < MR; j++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
        for (int64_t t = k; t < K; t++) s += w[t] * x[j * K + t];
        out[j * os] = s;
    }
}

TGT_512F static void f32_rows_512(const float *w, const float *x, int64_t K, int64_t M, float *out, int64_t os) {
    for (int64_t m0 = 0; m0 < M; m0 += F32_TILE) {
        const int64_t mr = M - m0 < F32_TILE ? M - m0 : F32_TILE;
        const float *xm = x + m0 * K;
        float *om = out + m0 * os;
        switch (mr) {
            case 1: f32_tile_512(w, xm, K, om, os, 1); break;
            case 2: f32_tile_512(w, xm, K, om, os, 2); break;
            case 3: f32_tile_512(w, xm, K, om, os, 3); break;
            default: f32_tile_512(w, xm, K, om, os, 4); break;
        }
    }
}
#endif
#endif

static void gemm_f32_rows(int64_t M, int64_t K, const float *w, int64_t N, const float *bias, float *y,
                          const float *x, int64_t n0, int64_t n1) {
    const int use = isa();
    (void)use;
    for (int64_t n = n0; n < n1; n++) {
        const float *row = w + n * K;
#if TM_X86 && defined(__GNUC__)
        if (n + F32_PREFETCH_ROWS < N)   /* into L2 (see F32_PREFETCH_ROWS) */
            for (int64_t o = 0; o < K * 4; o += 64) _mm_prefetch((const char *)(row + F32_PREFETCH_ROWS * K) + o, _MM_HINT_T1);
#if __GNUC__ >= 9
        if (use >= ISA_AVX512) f32_rows_512(row, x, K, M, y + n, N);
        else
#endif
        if (use >= ISA_AVX2) f32_rows_avx2(row, x, K, M, y + n, N);
        else
#endif
        f32_rows_scalar(row, x, K, M, y + n, N);
        if (bias) for (int64_t m = 0; m < M; m++) y[m * N + n] += bias[n];
    }
}

/* The row loops below compute output rows [n0, n1); the callers split the rows over threads in
 * contiguous ranges (tmq_row_range). A row's sum never depends on the split. */
#if TM_X86 && defined(__GNUC__) && __GNUC__ >= 9
/* Rows [n0, n1) of a u4 (s8 = 0) or s8 (s8 = 1) matrix through the block stream
 * (block_stream256_avx2), plus the bias: 1 when done, 0 when the stream could not run (its
 * block values did not fit on the stack and could not be allocated; the row kernels then do). */
static int block_stream_rows(int s8, const void *qs, const void *sc, const void *mn, int f16, int64_t nb, const ActBuf *a,
                             int64_t M, const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    if (block_stream256_avx2(s8, qs, sc, mn, f16, nb, a->xq, a->xd, a->xs, M, a->qstride, a->bstride, y, N, n0, n1))
        return 0;
    if (bias) for (int64_t m = 0; m < M; m++) for (int64_t n = n0; n < n1; n++) y[m * N + n] += bias[n];
    return 1;
}
#endif

#if TM_AMX
/* Rows [n0, n1) of a u4 (s8 = 0) or s8 (s8 = 1) matrix through the AMX tiles (amx_rows), plus the bias */
static void amx_rows_bias(int s8, const void *qs, const void *sc, const void *mn, int f16, int64_t K, int64_t group,
                          const ActBuf *a, int64_t M, const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    amx_rows(s8, qs, sc, mn, f16, K, group, (const uint8_t *)a->mem, M, y, N, n0, n1);
    if (bias) for (int64_t m = 0; m < M; m++) for (int64_t n = n0; n < n1; n++) y[m * N + n] += bias[n];
}
#endif

static void gemm_u4_rows(int64_t M, int64_t K, const uint8_t *qs, const void *sc, const void *mn,
                         int f16, int64_t N, int64_t group, const float *bias, float *y, const ActBuf *a,
                         int64_t n0, int64_t n1) {
    int64_t nb = (K + QK - 1) / QK, Kp = nb * QK, G = (K + group - 1) / group, bpg = group / QK;
    /* the avx512vnni u4 kernels read pair-order (2+ rows) or quad-order (1 row) activations, the
     * avx2 / avxvnni one-row kernels 256-bit quad order, made with the set in use; natural order
     * with the avx512 set in use runs the avx2 kernels */
    int use = a->order == ACT_PAIRS || a->order == ACT_QUAD ? ISA_AVX512 : isa() >= ISA_AVX512 ? ISA_AVX2 : isa();
    (void)use;
#if TM_AMX
    if (a->order == ACT_AMX) {
        amx_rows_bias(0, qs, sc, mn, f16, K, group, a, M, bias, y, N, n0, n1);
        return;
    }
#endif
#if TM_X86 && defined(__GNUC__) && __GNUC__ >= 9
    if (a->order == ACT_QSTREAM && M == 1) {   /* one x row, a scale per block (u4_act_order) */
        stream512(0, qs, sc, mn, f16, nb, a->xq, a->xd, a->xs, y, n0, n1);
        if (bias) for (int64_t n = n0; n < n1; n++) y[n] += bias[n];
        return;
    }
    if ((a->order == ACT_QSTREAM || a->order == ACT_QUAD) && M > 1) {   /* 2 to QS_ROWS_MAX x rows */
        u4_rows_quad512(a->order == ACT_QSTREAM, qs, sc, mn, f16, nb, bpg, G, a->xq, a->xd, a->xs, M, a->qstride,
                        a->bstride, y, N, n0, n1);
        if (bias) for (int64_t m = 0; m < M; m++) for (int64_t n = n0; n < n1; n++) y[m * N + n] += bias[n];
        return;
    }
    if (a->order == ACT_STREAM256   /* a scale per block (u4_act_order) */
        && block_stream_rows(0, qs, sc, mn, f16, nb, a, M, bias, y, N, n0, n1))
        return;
#endif
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = qs + n * (Kp / 2);
        if (PREFETCH_ROWS && n + PREFETCH_ROWS < N)  /* software prefetch a few rows ahead: decode streams W once */
            for (int64_t o = 0; o < Kp / 2; o += 64) __builtin_prefetch(row + PREFETCH_ROWS * (Kp / 2) + o, 0, 0);
#if TM_X86 && defined(__GNUC__)
#if __GNUC__ >= 9
        if (use == ISA_AVX512 && a->order == ACT_PAIRS)
            dot_u4_512(row, sc, mn, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, M, a->qstride, a->bstride, y + n, N);
        else if (use == ISA_AVX512)
            dot_u4_quad_one(row, sc, mn, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, y + n);
        else
#endif
        /* avx2 and avxvnni: the AVX2 body (4 madds, no dpwssd chain); a stream's activations
         * (quad order, x repeated past its blocks) also serve when its block values found no memory */
        if ((a->order == ACT_QUAD256 || a->order == ACT_STREAM256) && M == 1)
            dot_u4_quad256_avx2(row, sc, mn, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, y + n);
        else if (a->order == ACT_QUAD256 || a->order == ACT_STREAM256)
            dot_u4_quad256_rows(row, sc, mn, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, M, a->qstride, a->bstride,
                                y + n, N);
        else
#if __GNUC__ >= 11
        if (use == ISA_AVXVNNI) dot_u4_vnni(row, sc, mn, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, M, a->qstride, a->bstride, y + n, N);
        else
#endif
        if (use == ISA_AVX2) dot_u4_avx2(row, sc, mn, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, M, a->qstride, a->bstride, y + n, N);
        else
#endif
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = dot_u4_scalar(row, sc, mn, f16, n * G, nb, bpg, a->xq + m * a->qstride, a->xd + m * a->bstride,
                                         a->xs + m * a->bstride);
        if (bias) for (int64_t m = 0; m < M; m++) y[m * N + n] += bias[n];
    }
}

static void gemm_s8_rows(int64_t M, int64_t K, const int8_t *qs, const void *sc, int f16, int64_t N, int64_t group,
                         const float *bias, float *y, const ActBuf *a, int64_t n0, int64_t n1) {
    int64_t nb = (K + QK - 1) / QK, Kp = nb * QK, G = (K + group - 1) / group, bpg = group / QK;
    int use = isa() == ISA_AMX ? ISA_AVX512 : isa();
    (void)use;
#if TM_AMX
    if (a->order == ACT_AMX) {
        amx_rows_bias(1, qs, sc, NULL, f16, K, group, a, M, bias, y, N, n0, n1);
        return;
    }
#endif
#if TM_X86 && defined(__GNUC__) && __GNUC__ >= 9
    if (a->order == ACT_WSTREAM) {   /* one x row, a scale per block (s8_act_order) */
        stream512(1, qs, sc, NULL, f16, nb, a->xq, a->xd, NULL, y, n0, n1);
        if (bias) for (int64_t n = n0; n < n1; n++) y[n] += bias[n];
        return;
    }
    if (a->order == ACT_SSTREAM256   /* a scale per block (s8_act_order) */
        && block_stream_rows(1, qs, sc, NULL, f16, nb, a, M, bias, y, N, n0, n1))
        return;
#endif
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = qs + n * Kp;
        if (PREFETCH_ROWS && n + PREFETCH_ROWS < N)
            for (int64_t o = 0; o < Kp; o += 64) __builtin_prefetch(row + PREFETCH_ROWS * Kp + o, 0, 0);
#if TM_X86 && defined(__GNUC__)
#if __GNUC__ >= 9
        if (use == ISA_AVX512 && a->order == ACT_WORDS)
            dot_s8_word_one(row, sc, f16, n * G, nb, bpg, a->xq, a->xd, y + n);
        else if (use == ISA_AVX512) dot_s8_512(row, sc, f16, n * G, nb, bpg, a->xq, a->xd, M, a->qstride, a->bstride, y + n, N);
        else
#endif
        if (a->order == ACT_WORDS256 || a->order == ACT_SSTREAM256)  /* avx2 and avxvnni, word order: x row by
                                                                       * x row (a stream's when its block values
                                                                       * found no memory) */
            for (int64_t m = 0; m < M; m++)
                dot_s8_word_avx2(row, sc, NULL, f16, n * G, nb, bpg, a->xq + m * a->qstride, a->xd + m * a->bstride,
                                 a->xs, 1, a->qstride, a->bstride, y + m * N + n, N);
        else
#if __GNUC__ >= 11
        if (use == ISA_AVXVNNI) dot_s8_vnni(row, sc, NULL, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, M, a->qstride, a->bstride, y + n, N);
        else
#endif
        if (use == ISA_AVX2) dot_s8_avx2(row, sc, NULL, f16, n * G, nb, bpg, a->xq, a->xd, a->xs, M, a->qstride, a->bstride, y + n, N);
        else
#endif
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = dot_s8_scalar(row, sc, f16, n * G, nb, bpg, a->xq + m * a->qstride, a->xd + m * a->bstride);
        if (bias) for (int64_t m = 0; m < M; m++) y[m * N + n] += bias[n];
    }
}

void tmq_row_range(int64_t N, int t, int T, int64_t *n0, int64_t *n1) {
    int64_t per = N / T, extra = N % T;  /* the first `extra` threads take one row more */
    *n0 = t * per + (t < extra ? t : extra);
    *n1 = *n0 + per + (t < extra);
}

/* one fork/join per matmul: the entry points of the bindings below */
static void gemm_u4(int64_t M, int64_t K, const uint8_t *qs, const void *sc, const void *mn, int f16, int64_t N,
                    int64_t group, const float *bias, float *y, int nt, const ActBuf *a) {
    #pragma omp parallel num_threads(nt)
    {
        int64_t n0, n1;
        tmq_row_range(N, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        gemm_u4_rows(M, K, qs, sc, mn, f16, N, group, bias, y, a, n0, n1);
    }
}

static void gemm_s8(int64_t M, int64_t K, const int8_t *qs, const void *sc, int f16, int64_t N, int64_t group,
                    const float *bias, float *y, int nt, const ActBuf *a) {
    #pragma omp parallel num_threads(nt)
    {
        int64_t n0, n1;
        tmq_row_range(N, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        gemm_s8_rows(M, K, qs, sc, f16, N, group, bias, y, a, n0, n1);
    }
}

/* The entry points other C files use (decoder.c): y[M, N] = x[M, K] @ W^T (+ bias) with the
 * integer kernels, as a quantize step (one thread) and a row loop (the whole team). */
static int act_order(const TmqMat *w, int64_t M) {
    return w->kind == TMQ_U4 ? u4_act_order(M, w->K, w->group) : s8_act_order(M, w->K, w->group);
}

void *tmq_act_quantize(const TmqMat *w, const float *x, int64_t M) {
    ActBuf *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    if (w->kind == TMQ_F32) { a->xf = x; return a; }
    if (act_quantize(x, M, w->K, act_order(w, M), a)) { free(a); return NULL; }
    return a;
}

size_t tmq_act_bytes(const TmqMat *w, int64_t M) {
    if (w->kind == TMQ_F32) return 0;
    ActBuf a = {0};
    size_t qbytes;
    return act_layout(M, w->K, act_order(w, M), &a, &qbytes);
}

void *tmq_act_buffer(size_t bytes) {
    ActBuf *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->cap = bytes < 64 ? 64 : bytes;
    if (!(a->mem = malloc(a->cap))) { free(a); return NULL; }
    return a;
}

int tmq_act_quantize_into(void *buf, const TmqMat *w, const float *x, int64_t M) {
    ActBuf *a = buf;
    a->xf = NULL;
    if (w->kind == TMQ_F32) { a->xf = x; return 0; }
    return act_quantize(x, M, w->K, act_order(w, M), a);
}

void tmq_act_free(void *act) {
    if (!act) return;
    free(((ActBuf *)act)->mem);
    free(act);
}

void tmq_matmul_rows(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y, int t, int T) {
    int64_t n0, n1;
    tmq_row_range(w->N, t, T, &n0, &n1);
    tmq_matmul_range(w, act, M, bias, y, n0, n1);
}

void tmq_matmul_range(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y, int64_t n0, int64_t n1) {
    const ActBuf *a = act;
    if (n0 >= n1) return;
    if (w->kind == TMQ_F32)
        gemm_f32_rows(M, w->K, (const float *)w->qs, w->N, bias, y, a->xf, n0, n1);
    else if (w->kind == TMQ_U4)
        gemm_u4_rows(M, w->K, (const uint8_t *)w->qs, w->sc, w->mn, w->f16, w->N, w->group, bias, y, a, n0, n1);
    else
        gemm_s8_rows(M, w->K, (const int8_t *)w->qs, w->sc, w->f16, w->N, w->group, bias, y, a, n0, n1);
}

int tmq_matmul(const TmqMat *w, const float *x, int64_t M, const float *bias, float *y, int nt) {
    void *a = tmq_act_quantize(w, x, M);
    if (!a) return -1;
    if (w->kind == TMQ_F32) {
        #pragma omp parallel num_threads(nt < 1 ? 1 : nt)
        tmq_matmul_rows(w, a, M, bias, y, omp_get_thread_num(), omp_get_num_threads());
    } else if (w->kind == TMQ_U4)
        gemm_u4(M, w->K, (const uint8_t *)w->qs, w->sc, w->mn, w->f16, w->N, w->group, bias, y, nt < 1 ? 1 : nt, a);
    else
        gemm_s8(M, w->K, (const int8_t *)w->qs, w->sc, w->f16, w->N, w->group, bias, y, nt < 1 ? 1 : nt, a);
    tmq_act_free(a);
    return 0;
}

int tmq_check_mat(const TmqMat *w) {
    if (w->kind == TMQ_F32) return w->N > 0 && w->K > 0 && w->qs != NULL;
    return (w->kind == TMQ_U4 || w->kind == TMQ_S8) && w->N > 0 && w->K > 0 && check_group(w->K, w->group);
}

/* ---- Python bindings ------------------------------------------------------------------------ */
#define PTR(T, v) ((T)(uintptr_t)(v))

static PyObject *py_gemm_u4(PyObject *self, PyObject *args) {
    unsigned long long x, qs, sc, mn, bias, y;
    long long M, K, N, group;
    int f16, nt;
    if (!PyArg_ParseTuple(args, "KLLKKKiLLKKi", &x, &M, &K, &qs, &sc, &mn, &f16, &N, &group, &bias, &y, &nt))
        return NULL;
    if (M < 0 || K <= 0 || N < 0 || !check_group(K, group)) {
        PyErr_Format(PyExc_ValueError, "gemm_u4: bad sizes M=%lld K=%lld N=%lld group=%lld", M, K, N, group);
        return NULL;
    }
    if (M == 0 || N == 0) Py_RETURN_NONE;  /* nothing to compute (the one-row kernels would read row 0) */
    ActBuf a = {0};
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    err = act_quantize(PTR(const float *, x), M, K, u4_act_order(M, K, group), &a);
    if (!err) {
        gemm_u4(M, K, PTR(const uint8_t *, qs), PTR(const void *, sc), PTR(const void *, mn),
                f16, N, group, PTR(const float *, bias), PTR(float *, y), nt < 1 ? 1 : nt, &a);
        free(a.mem);
    }
    Py_END_ALLOW_THREADS
    if (err) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_gemm_s8(PyObject *self, PyObject *args) {
    unsigned long long x, qs, sc, bias, y;
    long long M, K, N, group;
    int f16, nt;
    if (!PyArg_ParseTuple(args, "KLLKKiLLKKi", &x, &M, &K, &qs, &sc, &f16, &N, &group, &bias, &y, &nt))
        return NULL;
    if (M < 0 || K <= 0 || N < 0 || !check_group(K, group)) {
        PyErr_Format(PyExc_ValueError, "gemm_s8: bad sizes M=%lld K=%lld N=%lld group=%lld", M, K, N, group);
        return NULL;
    }
    if (M == 0 || N == 0) Py_RETURN_NONE;  /* nothing to compute (the one-row kernels would read row 0) */
    ActBuf a = {0};
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    err = act_quantize(PTR(const float *, x), M, K, s8_act_order(M, K, group), &a);
    if (!err) {
        gemm_s8(M, K, PTR(const int8_t *, qs), PTR(const void *, sc), f16, N, group, PTR(const float *, bias),
                PTR(float *, y), nt < 1 ? 1 : nt, &a);
        free(a.mem);
    }
    Py_END_ALLOW_THREADS
    if (err) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Row n of a packed matrix dequantized into o[K] (the dequant_* bindings and tmq_dequant_row):
 * rows [n] of qs, scale (and min) groups from g0 = n * G on */
static void deq_u4_row(const uint8_t *row, const void *sc, const void *mn, int64_t g0, int f16, int64_t K,
                       int64_t group, float *o, int use) {
    const int64_t nb = (K + QK - 1) / QK, bpg = group / QK;
    (void)use;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t g = g0 + b / bpg, cnt = K - b * QK < QK ? K - b * QK : QK;
        const float s = load_scale(sc, g, f16), m = load_scale(mn, g, f16);
#if TM_X86 && defined(__GNUC__)
        if (use >= ISA_AVX2) { deq_u4_block_avx2(row + b * 16, s, m, o + b * QK, cnt); continue; }
#endif
        deq_u4_block_scalar(row + b * 16, s, m, o + b * QK, cnt);
    }
}

static void deq_s8_row(const int8_t *row, const void *sc, int64_t g0, int f16, int64_t K, int64_t group, float *o,
                       int use) {
    const int64_t nb = (K + QK - 1) / QK, bpg = group / QK;
    (void)use;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t cnt = K - b * QK < QK ? K - b * QK : QK;
        const float s = load_scale(sc, g0 + b / bpg, f16);
#if TM_X86 && defined(__GNUC__)
        if (use >= ISA_AVX2) { deq_s8_block_avx2(row + b * QK, s, o + b * QK, cnt); continue; }
#endif
        deq_s8_block_scalar(row + b * QK, s, o + b * QK, cnt);
    }
}

int tmq_dequant_row(const TmqMat *w, int64_t n, float *out) {
    if (n < 0 || n >= w->N) return -1;
    const int64_t K = w->K, Kp = (K + QK - 1) / QK * QK, G = (K + w->group - 1) / w->group;
    switch (w->kind) {
    case TMQ_U4:
        deq_u4_row((const uint8_t *)w->qs + n * (Kp / 2), w->sc, w->mn, n * G, (int)w->f16, K, w->group, out, isa());
        return 0;
    case TMQ_S8:
        deq_s8_row((const int8_t *)w->qs + n * Kp, w->sc, n * G, (int)w->f16, K, w->group, out, isa());
        return 0;
    case TMQ_F32:
        memcpy(out, (const float *)w->qs + n * K, (size_t)K * sizeof(float));
        return 0;
    }
    return -1;
}

/* dequant_u4(qs, sc, mn, f16, N, K, group, out, threads): out fp32 [N, K] */
static PyObject *py_dequant_u4(PyObject *self, PyObject *args) {
    unsigned long long qs, sc, mn, out;
    long long N, K, group;
    int f16, nt;
    if (!PyArg_ParseTuple(args, "KKKiLLLKi", &qs, &sc, &mn, &f16, &N, &K, &group, &out, &nt)) return NULL;
    if (N < 0 || K <= 0 || !check_group(K, group)) {
        PyErr_Format(PyExc_ValueError, "dequant_u4: bad sizes N=%lld K=%lld group=%lld", N, K, group);
        return NULL;
    }
    const int use = isa();
    Py_BEGIN_ALLOW_THREADS
    const int64_t Kp = (K + QK - 1) / QK * QK, G = (K + group - 1) / group;
    #pragma omp parallel for num_threads(nt < 1 ? 1 : nt) schedule(static)
    for (int64_t n = 0; n < N; n++)
        deq_u4_row(PTR(const uint8_t *, qs) + n * (Kp / 2), PTR(const void *, sc), PTR(const void *, mn), n * G, f16,
                   K, group, PTR(float *, out) + n * K, use);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_dequant_s8(PyObject *self, PyObject *args) {
    unsigned long long qs, sc, out;
    long long N, K, group;
    int f16, nt;
    if (!PyArg_ParseTuple(args, "KKiLLLKi", &qs, &sc, &f16, &N, &K, &group, &out, &nt)) return NULL;
    if (N < 0 || K <= 0 || !check_group(K, group)) {
        PyErr_Format(PyExc_ValueError, "dequant_s8: bad sizes N=%lld K=%lld group=%lld", N, K, group);
        return NULL;
    }
    const int use = isa();
    Py_BEGIN_ALLOW_THREADS
    const int64_t Kp = (K + QK - 1) / QK * QK, G = (K + group - 1) / group;
    #pragma omp parallel for num_threads(nt < 1 ? 1 : nt) schedule(static)
    for (int64_t n = 0; n < N; n++)
        deq_s8_row(PTR(const int8_t *, qs) + n * Kp, PTR(const void *, sc), n * G, f16, K, group,
                   PTR(float *, out) + n * K, use);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

void tmq_quantize_natural(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs) {
#if TM_X86 && defined(__GNUC__)
    if (isa() >= ISA_AVX2) { quantize_rows_avx2(x, M, K, xq, xd, xs); return; }
#endif
    quantize_rows(x, M, K, xq, xd, xs);
}

float tmq_load_scale(const void *p, int64_t i, int f16) { return load_scale(p, i, f16); }

/* the prefill GEMM's kernels: the AVX-512 VNNI ones wherever the CPU has them (on Zen 4 too, where
 * the decode kernels default to the 256-bit set: a GEMM tile keeps both halves of every 512-bit
 * operation busy, and measured 1.4x the AVX2 tile there), else AVX2 (avx2 / avxvnni: no VEX-VNNI
 * variant); portable when the kernel set in use is scalar */
static int g_gemm_set = -1;   /* set_gemm_isa(): kernels picked for the GEMM alone; -1: as below */
static int gemm_set(void) {
    if (g_gemm_set >= 0) return g_gemm_set;
    int s = isa();
    if (s == ISA_SCALAR) return TMQ_GEMM_SCALAR;
    return (best_isa(), g_supported & (1 << ISA_AVX512)) ? TMQ_GEMM_AVX512 : TMQ_GEMM_AVX2;
}

/* the ISA a TMQ_GEMM_* kernel set needs */
static int gemm_needs(int set) { return set == TMQ_GEMM_AVX512 ? ISA_AVX512 : set == TMQ_GEMM_AVX2 ? ISA_AVX2 : ISA_SCALAR; }

/* gemm_tiled(kind, x, M, K, qs, sc, mn, f16, N, group, bias, y, threads, set): the prefill GEMM
 * (qgemm.c) for a u4 (kind 0) or s8 (kind 1) weight; set -1: the kernel set in use's, else a
 * TMQ_GEMM_* value this CPU supports */
static PyObject *py_gemm_tiled(PyObject *self, PyObject *args) {
    unsigned long long x, qs, sc, mn, bias, y;
    long long M, K, N, group;
    int kind, f16, nt, set;
    if (!PyArg_ParseTuple(args, "iKLLKKKiLLKKii", &kind, &x, &M, &K, &qs, &sc, &mn, &f16, &N, &group, &bias, &y, &nt, &set))
        return NULL;
    if ((kind != TMQ_U4 && kind != TMQ_S8) || M < 0 || K <= 0 || N < 0 || !check_group(K, group)) {
        PyErr_Format(PyExc_ValueError, "gemm_tiled: bad arguments kind=%d M=%lld K=%lld N=%lld group=%lld", kind, M, K, N, group);
        return NULL;
    }
    if (set < 0) set = gemm_set();
    if (set > TMQ_GEMM_AVX512 || !(best_isa(), g_supported & (1 << gemm_needs(set)))) {
        PyErr_Format(PyExc_ValueError, "gemm_tiled: kernel %d does not run on this CPU", set);
        return NULL;
    }
    TmqMat w = {kind, PTR(const void *, qs), PTR(const void *, sc), PTR(const void *, mn), f16, N, K, group};
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = tmq_gemm_tiled(&w, PTR(const float *, x), M, PTR(const float *, bias), PTR(float *, y), nt, set);
    Py_END_ALLOW_THREADS
    if (err) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* quantize_act(x, M, K, xq, xd, xs): the activation quantizer alone (for tests) */
static PyObject *py_quantize_act(PyObject *self, PyObject *args) {
    unsigned long long x, xq, xd, xs;
    long long M, K;
    if (!PyArg_ParseTuple(args, "KLLKKK", &x, &M, &K, &xq, &xd, &xs)) return NULL;
    if (M < 0 || K <= 0) { PyErr_SetString(PyExc_ValueError, "quantize_act: bad sizes"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
#if TM_X86 && defined(__GNUC__)
    if (isa() >= ISA_AVX2) quantize_rows_avx2(PTR(const float *, x), M, K, PTR(int16_t *, xq), PTR(float *, xd), PTR(float *, xs));
    else
#endif
    quantize_rows(PTR(const float *, x), M, K, PTR(int16_t *, xq), PTR(float *, xd), PTR(float *, xs));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static const char *isa_names[ISA_COUNT] = {"scalar", "avx2", "avxvnni", "avx512vnni", "amx"};

static const char *gemm_names[] = {"scalar", "avx2", "avx512vnni"};

static PyObject *py_gemm_isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(gemm_names[gemm_set()]); }

/* set_gemm_isa(name or None): the prefill GEMM's kernels, apart from the decode kernel set (None:
 * back to gemm_set's rule) */
static PyObject *py_set_gemm_isa(PyObject *self, PyObject *args) {
    PyObject *arg;
    if (!PyArg_ParseTuple(args, "O", &arg)) return NULL;
    if (arg == Py_None) { g_gemm_set = -1; Py_RETURN_NONE; }
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    best_isa();
    for (int i = 0; i <= TMQ_GEMM_AVX512; i++) {
        if (strcmp(name, gemm_names[i]) == 0) {
            if (!(g_supported & (1 << gemm_needs(i)))) {
                PyErr_Format(PyExc_ValueError, "this CPU does not support the %s GEMM kernels", name);
                return NULL;
            }
            g_gemm_set = i;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown GEMM kernels %s (scalar, avx2, avx512vnni)", name);
    return NULL;
}

static PyObject *py_isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(isa_names[isa()]); }

static PyObject *py_best_isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(isa_names[best_isa()]); }

static PyObject *py_default_isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(isa_names[default_isa()]); }

/* whether this CPU's AVX-512 runs on 256-bit units (Zen 4): then an AVX-512 GEMM is no wider than an
 * AVX2 one, and the integer kernels' row limit is that of an AVX2 machine (packed.gemv_max_rows) */
static PyObject *py_avx512_half_width(PyObject *self, PyObject *args) {
    best_isa();
#if TM_X86 && defined(__GNUC__)
    return PyBool_FromLong(__builtin_cpu_supports("avx512f") && amd_family_19h());
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *py_supported_isas(PyObject *self, PyObject *args) {
    best_isa();
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < ISA_COUNT; i++) {
        if (!(g_supported & (1 << i))) continue;
        PyObject *name = PyUnicode_FromString(isa_names[i]);
        if (!name || PyList_Append(out, name) < 0) { Py_XDECREF(name); Py_DECREF(out); return NULL; }
        Py_DECREF(name);
    }
    return out;
}

/* set_isa(name): use one of the kernel sets this CPU supports (for tests and comparisons) */
static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    best_isa();
    for (int i = 0; i < ISA_COUNT; i++) {
        if (strcmp(name, isa_names[i]) == 0) {
            if (!(g_supported & (1 << i))) {
                PyErr_Format(PyExc_ValueError, "this CPU does not support the %s kernels (best: %s)", name,
                             isa_names[best_isa()]);
                return NULL;
            }
            g_isa = i;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown kernel set %s (scalar, avx2, avxvnni, avx512vnni, amx)", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"gemm_u4", py_gemm_u4, METH_VARARGS, "y[M,N] = x[M,K] @ W_u4^T (+bias), int16 activations"},
    {"gemm_s8", py_gemm_s8, METH_VARARGS, "y[M,N] = x[M,K] @ W_s8^T (+bias), int16 activations"},
    {"gemm_tiled", py_gemm_tiled, METH_VARARGS, "y[M,N] = x[M,K] @ W^T (+bias): the prefill GEMM, int16 activations"},
    {"dequant_u4", py_dequant_u4, METH_VARARGS, "fp32 [N,K] of a u4 weight"},
    {"dequant_s8", py_dequant_s8, METH_VARARGS, "fp32 [N,K] of an s8 weight"},
    {"quantize_act", py_quantize_act, METH_VARARGS, "int16 block quantization of activations"},
    {"decode_layers", tmq_py_decode_layers, METH_VARARGS, "fused decode through packed Llama layers (decoder.c)"},
    {"layer_fields", tmq_py_layer_fields, METH_NOARGS, "int64 fields per layer row of decode_layers"},
    {"fp8_quantize", tmq_py_fp8_quantize, METH_VARARGS, "decode_layers' fp8 KV write of one vector (for tests)"},
    {"f16_quantize", tmq_py_f16_quantize, METH_VARARGS, "decode_layers' fp16 KV write of n floats (for tests)"},
    {"decode_profile", tmq_py_decode_profile, METH_VARARGS, "phase timers of decode_layers: (on) -> seconds so far"},
    {"decode_kv_prefetch", tmq_py_decode_kv_prefetch, METH_NOARGS,
     "decode_layers' KV prefetch: (this CPU's default, on for a call now)"},
    {"isa", py_isa, METH_NOARGS, "kernel set in use"},
    {"gemm_isa", py_gemm_isa, METH_NOARGS, "kernels of the prefill GEMM (gemm_tiled) by default"},
    {"set_gemm_isa", py_set_gemm_isa, METH_VARARGS, "choose the prefill GEMM's kernels (None: the default rule)"},
    {"best_isa", py_best_isa, METH_NOARGS, "best kernel set this CPU supports"},
    {"default_isa", py_default_isa, METH_NOARGS, "kernel set chosen for this CPU at start-up"},
    {"avx512_half_width", py_avx512_half_width, METH_NOARGS, "AVX-512 on 256-bit units (Zen 4)"},
    {"supported_isas", py_supported_isas, METH_NOARGS, "kernel sets this CPU supports"},
    {"set_isa", py_set_isa, METH_VARARGS, "choose the kernel set (any this CPU supports)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_quant", NULL, -1, methods};

PyMODINIT_FUNC PyInit__quant(void) { return PyModule_Create(&module); }
