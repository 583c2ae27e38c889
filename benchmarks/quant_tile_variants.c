/* Forms of the AVX2 Q4 multi-row tile, stand-alone and in cache: where its cycles go.
 *
 * The served tile (src/tokenmill/_native/quant.c: u4_chunk_dots, u4_quad256_tile) reads Q4
 * weights in their GGUF order, two blocks per 32-byte load, splits each load into four nibble
 * planes once and meets them with MR activation rows (int16, quad order); each row's 8-block
 * chunk reduces to 8 block sums, which are scaled and accumulated in fp32. This file times
 * variants of that tile on 64 weight rows of 48 blocks (L2-resident) and prints cycles per block
 * and activation row, the clock measured with dependent adds:
 *
 *   hadd tree    the reduction as shipped before the seventeenth landing (vphaddd)
 *   unpack tree  the same sums with unpack + add (vphaddd issues one per two cycles here,
 *                benchmarks/avx2_op_throughput.c; measured in the served kernels, not kept)
 *   tree, no fp  the unpack tree without the fp32 scale part (its cost)
 *   int only     the multiply-adds and their sums alone, no reduction (a floor for this form)
 *   block lanes  the chunk's four loads transposed by dword first, so that every 32-bit lane
 *                holds one block: 16 multiply-adds summed straight, no reduction tree (it needs
 *                its own activation order; served for 2-4 rows in f5c2b5a, no faster there,
 *                reverted: docs/benchmarks.md)
 *   int15 bytes  activations of 15 bits split into two bytes, the nibbles as bytes, vpmaddubsw
 *                (fewer instructions to split a load; not served: one bit less of activation)
 *
 * Each variant computes the sums of its own activation layout, so the outputs are not compared.
 *
 *     for m in 1 2 4; do gcc -O3 -fschedule-insns -fsched-pressure -mavx2 -mfma -mf16c -DMR=$m \
 *         benchmarks/quant_tile_variants.c -o /tmp/tile && /tmp/tile; done
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef MR
#define MR 4
#endif
#define QK 32
#define NB 48     /* blocks per weight row (K = 1536, the MLP's down projection) */
#define NROWS 64  /* weight rows: 64 x 48 x 20 bytes fit L2 */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* keeps v in a register here, so GCC cannot hoist later loads above it (without this, and without
 * -fsched-pressure, GCC hoisted a whole chunk's multiply-adds above their sums and spilled them) */
#define PIN(v) __asm__ volatile("" : "+x"(v)::"memory")
#define LD(p) _mm256_loadu_si256((const __m256i *)(p))

/* the four nibble planes of one load against one activation row (64 values) */
static inline __attribute__((always_inline)) __m256i dot4(const __m256i *q, const int16_t *x) {
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(q[0], LD(x)), _mm256_madd_epi16(q[1], LD(x + 16))),
                            _mm256_add_epi32(_mm256_madd_epi16(q[2], LD(x + 32)), _mm256_madd_epi16(q[3], LD(x + 48))));
}

static inline __attribute__((always_inline)) void planes(__m256i w, __m256i *q) {
    const __m256i m4 = _mm256_set1_epi16(15);
    q[0] = _mm256_and_si256(w, m4);
    q[1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    q[2] = _mm256_and_si256(_mm256_srli_epi16(w, 8), m4);
    q[3] = _mm256_srli_epi16(w, 12);
}

static inline __attribute__((always_inline)) __m256i l1(__m256i a, __m256i b, int unpack) {
    return unpack ? _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b)) : _mm256_hadd_epi32(a, b);
}
static inline __attribute__((always_inline)) __m256i l2(__m256i a, __m256i b, int unpack) {
    return unpack ? _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b)) : _mm256_hadd_epi32(a, b);
}

/* one chunk (8 blocks, 4 loads): t[j] lane q = block 2(q%4) + q/4 of row j */
static inline __attribute__((always_inline)) void chunk_tree(const uint8_t *w, const int16_t *x, __m256i *t, int unpack) {
    __m256i u[MR];
    for (int j = 0; j < MR; j++) u[j] = t[j] = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {
        __m256i q[4], d[MR];
        planes(LD(w + 32 * p), q);
        for (int j = 0; j < MR; j++) {
            d[j] = dot4(q, x + j * NB * QK + 64 * p);
            PIN(d[j]);
        }
        for (int j = 0; j < MR; j++) {
            if (p == 0 || p == 2) u[j] = d[j];
            else if (p == 1) t[j] = l1(u[j], d[j], unpack);
            else t[j] = l2(t[j], l1(u[j], d[j], unpack), unpack);
        }
    }
}

/* the served chunk's fp32 part: block sums x (weight scale x activation scale) + min x activation sum */
static inline __attribute__((always_inline)) void scale_chunk(const __m256i *t, const uint16_t *sc, const uint16_t *mn,
                                                              const float *xd, const float *xs, int64_t c, __m256 *acc) {
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256 sv = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + c))), perm);
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + c)));
    for (int j = 0; j < MR; j++) {
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[j]), _mm256_mul_ps(sv, _mm256_loadu_ps(xd + j * NB + c)), acc[j]);
        acc[j] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + j * NB + c), acc[j]);
    }
}

/* int15 activations split into bytes, x = 128 xh + xl (xh in [-128, 127], xl in [0, 127]), met by
 * the weights' low and high nibbles as bytes (and, shift + and: 3 instructions per load instead of
 * 7) in vpmaddubsw, whose 16-bit pair sums stay below 7,680 for two planes; two vpmaddwd (by 128
 * and by 1) widen them into the same lanes as the served tile's sums (block 2p in lanes 0-3, 2p+1 in
 * 4-7), so the same tree and scaling follow. Activations: per load, xh for the low nibbles, xh for
 * the high, xl for the low, xl for the high (32 bytes each). */
static inline __attribute__((always_inline)) __m256i dot4_bytes(__m256i w, const int8_t *x) {
    const __m256i m4 = _mm256_set1_epi8(15), lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    const __m256i hs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, LD(x)), _mm256_maddubs_epi16(hi, LD(x + 32)));
    const __m256i ls = _mm256_add_epi16(_mm256_maddubs_epi16(lo, LD(x + 64)), _mm256_maddubs_epi16(hi, LD(x + 96)));
    return _mm256_add_epi32(_mm256_madd_epi16(hs, _mm256_set1_epi16(128)), _mm256_madd_epi16(ls, _mm256_set1_epi16(1)));
}

static __attribute__((noinline)) void tile_bytes(const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                                                 const int16_t *xq, const float *xd, const float *xs, float *out) {
    const int8_t *xb = (const int8_t *)xq;   /* the same 64 bytes per 32 values, read as split bytes */
    __m256 acc[MR];
    for (int j = 0; j < MR; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < NB; c += 8) {
        __m256i t[MR], u[MR];
        for (int j = 0; j < MR; j++) u[j] = t[j] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i w = LD(qs + c * 16 + 32 * p);
            for (int j = 0; j < MR; j++) {
                __m256i d = dot4_bytes(w, xb + (j * NB * QK + c * QK + 64 * p) * 2);
                PIN(d);
                if (p == 0 || p == 2) u[j] = d;
                else if (p == 1) t[j] = _mm256_hadd_epi32(u[j], d);
                else t[j] = _mm256_hadd_epi32(t[j], _mm256_hadd_epi32(u[j], d));
            }
        }
        scale_chunk(t, sc, mn, xd, xs, c, acc);
    }
    for (int j = 0; j < MR; j++) out[j] = hsum8(acc[j]);
}

typedef void (*tile_fn)(const uint8_t *, const uint16_t *, const uint16_t *, const int16_t *, const float *,
                        const float *, float *);

#define TILE_TREE(NAME, UNPACK)                                                                                 \
    static __attribute__((noinline)) void NAME(const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,       \
                                               const int16_t *xq, const float *xd, const float *xs, float *out) { \
        __m256 acc[MR];                                                                                         \
        for (int j = 0; j < MR; j++) acc[j] = _mm256_setzero_ps();                                              \
        for (int64_t c = 0; c < NB; c += 8) {                                                                   \
            __m256i t[MR];                                                                                      \
            chunk_tree(qs + c * 16, xq + c * QK, t, UNPACK);                                                    \
            scale_chunk(t, sc, mn, xd, xs, c, acc);                                                             \
        }                                                                                                       \
        for (int j = 0; j < MR; j++) out[j] = hsum8(acc[j]);                                                    \
    }
TILE_TREE(tile_hadd, 0)
TILE_TREE(tile_unpack, 1)

static __attribute__((noinline)) void tile_tree_no_fp(const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                                                      const int16_t *xq, const float *xd, const float *xs, float *out) {
    __m256i acc[MR];
    for (int j = 0; j < MR; j++) acc[j] = _mm256_setzero_si256();
    for (int64_t c = 0; c < NB; c += 8) {
        __m256i t[MR];
        chunk_tree(qs + c * 16, xq + c * QK, t, 1);
        for (int j = 0; j < MR; j++) acc[j] = _mm256_add_epi32(acc[j], t[j]);
    }
    for (int j = 0; j < MR; j++) out[j] = hsum8(_mm256_cvtepi32_ps(acc[j]));
}

static __attribute__((noinline)) void tile_int_only(const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                                                    const int16_t *xq, const float *xd, const float *xs, float *out) {
    __m256i acc[MR];
    for (int j = 0; j < MR; j++) acc[j] = _mm256_setzero_si256();
    for (int64_t c = 0; c < NB; c += 8)
        for (int p = 0; p < 4; p++) {
            __m256i q[4];
            planes(LD(qs + c * 16 + 32 * p), q);
            for (int j = 0; j < MR; j++) {
                __m256i d = dot4(q, xq + j * NB * QK + c * QK + 64 * p);
                PIN(d);
                acc[j] = _mm256_add_epi32(acc[j], d);
            }
        }
    for (int j = 0; j < MR; j++) out[j] = hsum8(_mm256_cvtepi32_ps(acc[j]));
}

static __attribute__((noinline)) void tile_block_lanes(const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                                                       const int16_t *xq, const float *xd, const float *xs, float *out) {
    __m256 acc[MR];
    for (int j = 0; j < MR; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < NB; c += 8) {
        const uint8_t *w = qs + c * 16;
        /* dword m of blocks 0, 2, 4, 6 | 1, 3, 5, 7: the lane order of the tree's result */
        const __m256i a = _mm256_unpacklo_epi32(LD(w), LD(w + 32)), b = _mm256_unpackhi_epi32(LD(w), LD(w + 32));
        const __m256i e = _mm256_unpacklo_epi32(LD(w + 64), LD(w + 96)), f = _mm256_unpackhi_epi32(LD(w + 64), LD(w + 96));
        const __m256i T[4] = {_mm256_unpacklo_epi64(a, e), _mm256_unpackhi_epi64(a, e), _mm256_unpacklo_epi64(b, f),
                              _mm256_unpackhi_epi64(b, f)};
        __m256i t[MR];
        for (int j = 0; j < MR; j++) t[j] = _mm256_setzero_si256();
        for (int m = 0; m < 4; m++) {
            __m256i q[4];
            planes(T[m], q);
            for (int j = 0; j < MR; j++) {
                __m256i d = dot4(q, xq + j * NB * QK + c * QK + 64 * m);
                PIN(d);
                t[j] = _mm256_add_epi32(t[j], d);
            }
        }
        scale_chunk(t, sc, mn, xd, xs, c, acc);
    }
    for (int j = 0; j < MR; j++) out[j] = hsum8(acc[j]);
}

int main(void) {
    uint8_t *qs = aligned_alloc(64, NROWS * NB * 16);
    uint16_t *sc = aligned_alloc(64, NROWS * NB * 2), *mn = aligned_alloc(64, NROWS * NB * 2);
    int16_t *xq = aligned_alloc(64, MR * NB * QK * 2);
    float *xd = aligned_alloc(64, MR * NB * 4), *xs = aligned_alloc(64, MR * NB * 4), out[MR];
    srand(1);
    for (int i = 0; i < NROWS * NB * 16; i++) qs[i] = (uint8_t)rand();
    for (int i = 0; i < NROWS * NB; i++) { sc[i] = 0x2000 + (rand() & 0xff); mn[i] = 0xa000 + (rand() & 0xff); }
    for (int i = 0; i < MR * NB * QK; i++) xq[i] = (int16_t)(rand() % 65535 - 32767);
    for (int i = 0; i < MR * NB; i++) { xd[i] = 1e-4f; xs[i] = 1e-2f; }

    long x = 0;
    double t0 = now();
    for (long i = 0; i < 300000000L; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    const double hz = 4.0 * 300000000L / (now() - t0);

    const tile_fn fns[] = {tile_hadd, tile_unpack, tile_tree_no_fp, tile_int_only, tile_block_lanes, tile_bytes};
    const char *names[] = {"hadd tree", "unpack tree", "tree, no fp", "int only", "block lanes", "int15 bytes"};
    const int nf = sizeof fns / sizeof fns[0], iters = 2000;
    double best[8];   /* >= the number of forms */
    for (int f = 0; f < nf; f++) best[f] = 1e30;
    float sink = 0.f;
    for (int r = 0; r < 15; r++)   /* interleaved rounds, the fastest kept: load only adds time */
        for (int f = 0; f < nf; f++) {
            t0 = now();
            for (int it = 0; it < iters; it++)
                for (int n = 0; n < NROWS; n++) {
                    fns[f](qs + n * NB * 16, sc + n * NB, mn + n * NB, xq, xd, xs, out);
                    sink += out[MR - 1];
                }
            const double c = (now() - t0) * hz / ((double)iters * NROWS * NB * MR);
            if (c < best[f]) best[f] = c;
        }
    printf("MR = %d activation rows, clock %.2f GHz\n", MR, hz / 1e9);
    for (int f = 0; f < nf; f++) printf("%-12s %.2f cycles per block and row\n", names[f], best[f]);
    return sink == 12345.f;
}
