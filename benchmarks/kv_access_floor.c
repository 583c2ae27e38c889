/* How fast can this machine read a decode step's KV pages in the orders a decode kernel could
 * use? No arithmetic beyond one integer add per 16 values, so each figure is a floor for the
 * memory side of the native decode-attention kernel (benchmarks/decode_attention_kernel.py
 * times the kernel itself).
 *
 * The pools have the default model's shape with 2-byte elements (fp16 / bf16; -DD below for the
 * 1-byte pools): per layer a K and a V pool [pages][16 tokens][3 kv heads][64], 30 layers, the
 * pages of each layer in a random order (a page table), as in the engine. Four orders, ns per key and KV head (both K and V):
 *
 *   sequential      every byte of K then V, front to back (the bandwidth floor);
 *   per head        one kv head at a time over all keys in page-table order, a key's K row and
 *                   then its V row (128 bytes each): the order of the kernel's decode tasks;
 *   per key         each key's whole token row, all kv heads (384 contiguous bytes of K, then of
 *                   V), keys in page-table order;
 *   heads per block blocks of BLK keys (compile with -DBLK=n, default 64), within a block one head
 *                   at a time (the order a kernel gets by interleaving its head tasks per block).
 *
 * Build and run (one thread; arguments: context length, a software prefetch distance in keys
 * for the per-head and heads-per-block orders, 0 = none, and the prefetch instruction: t0, t1,
 * t2 or nta, default t0):
 *
 *     gcc -O2 -mavx2 -o /tmp/kv_access_floor benchmarks/kv_access_floor.c
 *     /tmp/kv_access_floor 2048 0
 *     for h in t0 t1 t2 nta; do /tmp/kv_access_floor 16384 64 $h; done
 *
 * (The last line is how the attention kernel's prefetcht1 was chosen in the nineteenth landing:
 * docs/benchmarks.md, "A Zen 4 host".)
 *
 * -DD=32 gives rows of 64 bytes, the K or V row of one head in an int8 or fp8 pool (D counts
 * 2-byte elements; the default 64 is an fp16 pool's 128-byte row). With -fopenmp the layers of
 * each order are shared by OMP_NUM_THREADS threads (two layers at a time on two threads, as the
 * decode step's two threads read two tasks at once), and the figures are wall time per key and
 * head of all of them. The kernel's own order is "heads per block" with -DBLK=1024 (SPLIT_KEYS:
 * a long decode's chunks run their heads back to back):
 *
 *     gcc -O2 -mavx2 -fopenmp -DD=32 -DBLK=1024 -o /tmp/kv_floor_i8 benchmarks/kv_access_floor.c
 *     OMP_NUM_THREADS=2 /tmp/kv_floor_i8 16384 64 t1
 */
#pragma GCC diagnostic ignored "-Wunknown-pragmas"   /* the omp pragmas, in a build without -fopenmp */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PS 16
#define H 3
#ifndef D
#define D 64
#endif
#define L 30
#ifndef BLK
#define BLK 64
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx2"))) static inline __m256i ld(const uint16_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}

/* element offset of key j's row of kv head h (h = 0 and all heads: the row's start) */
static inline size_t row(const int *tab, int j, int h) {
    return ((size_t)tab[j / PS] * PS + j % PS) * H * D + (size_t)h * D;
}

__attribute__((target("avx2"))) static __m256i add_row(__m256i acc, const uint16_t *k, const uint16_t *v, int n) {
    for (int x = 0; x < n; x += 16) {
        acc = _mm256_add_epi16(acc, ld(k + x));
        acc = _mm256_add_epi16(acc, ld(v + x));
    }
    return acc;
}

/* the K and V lines of key j's row of head h, requested with hint hi (0 t0, 1 t1, 2 t2, 3 nta) */
static inline void prefetch_key(const uint16_t *k, const uint16_t *v, const int *tab, int j, int h, int hi) {
    const size_t o = row(tab, j, h);
    for (int c = 0; c < D * 2; c += 64) {
        const char *kp = (const char *)(k + o) + c, *vp = (const char *)(v + o) + c;
        switch (hi) {
        case 0: _mm_prefetch(kp, _MM_HINT_T0); _mm_prefetch(vp, _MM_HINT_T0); break;
        case 1: _mm_prefetch(kp, _MM_HINT_T1); _mm_prefetch(vp, _MM_HINT_T1); break;
        case 2: _mm_prefetch(kp, _MM_HINT_T2); _mm_prefetch(vp, _MM_HINT_T2); break;
        default: _mm_prefetch(kp, _MM_HINT_NTA); _mm_prefetch(vp, _MM_HINT_NTA); break;
        }
    }
}

/* one layer, one kv head at a time over every key (pf keys of look-ahead) */
__attribute__((target("avx2"))) static __m256i per_head(const uint16_t *k, const uint16_t *v, const int *tab, int ctx,
                                                     int pf, int hi) {
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < H; h++)
        for (int j = 0; j < ctx; j++) {
            if (pf && j + pf < ctx) prefetch_key(k, v, tab, j + pf, h, hi);
            const size_t o = row(tab, j, h);
            acc = add_row(acc, k + o, v + o, D);
        }
    return acc;
}

/* one layer in blocks of BLK keys, one kv head at a time within a block (look-ahead as above,
 * within the block) */
__attribute__((target("avx2"))) static __m256i heads_per_block(const uint16_t *k, const uint16_t *v, const int *tab,
                                                            int ctx, int pf, int hi) {
    __m256i acc = _mm256_setzero_si256();
    for (int j0 = 0; j0 < ctx; j0 += BLK) {
        const int j1 = j0 + BLK < ctx ? j0 + BLK : ctx;
        for (int h = 0; h < H; h++)
            for (int j = j0; j < j1; j++) {
                if (pf && j + pf < j1) prefetch_key(k, v, tab, j + pf, h, hi);
                const size_t o = row(tab, j, h);
                acc = add_row(acc, k + o, v + o, D);
            }
    }
    return acc;
}

__attribute__((target("avx2"))) int main(int argc, char **argv) {
    const int ctx = argc > 1 ? atoi(argv[1]) : 2048, pf = argc > 2 ? atoi(argv[2]) : 0, pages = ctx / PS;
    const char *hint = argc > 3 ? argv[3] : "t0";
    if (ctx < PS || ctx % PS) {
        fprintf(stderr, "the context must be a positive multiple of %d\n", PS);
        return 2;
    }
    const int hi = !strcmp(hint, "t0") ? 0 : !strcmp(hint, "t1") ? 1 : !strcmp(hint, "t2") ? 2 : !strcmp(hint, "nta") ? 3 : -1;
    if (hi < 0) {
        fprintf(stderr, "the prefetch instruction must be t0, t1, t2 or nta, not %s\n", hint);
        return 2;
    }
    const size_t per = (size_t)(pages + 8) * PS * H * D;
    uint16_t *K[L], *V[L];
    int *tab[L];
    srand(1);
    for (int l = 0; l < L; l++) {
        K[l] = aligned_alloc(64, per * 2);
        V[l] = aligned_alloc(64, per * 2);
        tab[l] = malloc(pages * sizeof(int));
        if (!K[l] || !V[l] || !tab[l]) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < per; i++) {
            K[l][i] = (uint16_t)rand();
            V[l][i] = (uint16_t)rand();
        }
        for (int p = 0; p < pages; p++) tab[l][p] = p;
        for (int p = pages - 1; p > 0; p--) {   /* a random page order */
            int j = rand() % (p + 1), t = tab[l][p];
            tab[l][p] = tab[l][j];
            tab[l][j] = t;
        }
    }
    const double n = (double)L * ctx * H;
    printf("context %d, %d layers, rows of %d bytes, prefetch%s %d keys ahead; ns per key and kv head\n",
           ctx, L, D * 2, hint, pf);
    for (int rep = 0; rep < 3; rep++) {
        __m256i acc = _mm256_setzero_si256(), part[L];
        double t0 = now();
        for (int l = 0; l < L; l++) acc = add_row(acc, K[l], V[l], pages * PS * H * D);
        double t1 = now();
#pragma omp parallel for schedule(static, 1)
        for (int l = 0; l < L; l++) part[l] = per_head(K[l], V[l], tab[l], ctx, pf, hi);
        for (int l = 0; l < L; l++) acc = _mm256_add_epi16(acc, part[l]);
        double t2 = now();
#pragma omp parallel for schedule(static, 1)
        for (int l = 0; l < L; l++) {
            __m256i a = _mm256_setzero_si256();
            for (int j = 0; j < ctx; j++) {
                const size_t o = row(tab[l], j, 0);
                a = add_row(a, K[l] + o, V[l] + o, H * D);
            }
            part[l] = a;
        }
        for (int l = 0; l < L; l++) acc = _mm256_add_epi16(acc, part[l]);
        double t3 = now();
#pragma omp parallel for schedule(static, 1)
        for (int l = 0; l < L; l++) part[l] = heads_per_block(K[l], V[l], tab[l], ctx, pf, hi);
        for (int l = 0; l < L; l++) acc = _mm256_add_epi16(acc, part[l]);
        double t4 = now();
        uint16_t out[16];
        _mm256_storeu_si256((__m256i *)out, acc);
        printf("sequential %.1f | per head %.1f | per key %.1f | heads per %d-key block %.1f   (checksum %u)\n",
               (t1 - t0) / n * 1e9, (t2 - t1) / n * 1e9, (t3 - t2) / n * 1e9, BLK, (t4 - t3) / n * 1e9, out[0]);
    }
    return 0;
}
