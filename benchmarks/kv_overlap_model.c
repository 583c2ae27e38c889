/* How much of a decode kernel's arithmetic can hide under its KV reads on this machine: a model,
 * not the kernel. The 30 layers of a 16k context's int8 KV (3 kv heads, 64-byte rows) lie
 * contiguous per layer, as if every page of the sequence were in order and nothing else were in
 * the pool, and are read in the native kernel's order (1,024-key chunks as OpenMP jobs, a chunk's
 * heads one after another, a key's K row then its V row), with prefetcht1 a fixed number of keys
 * ahead. For each key and head the loop widens 32 bytes of K and of V to int16 and runs W
 * vpdpwssd on eight rotating accumulators: arithmetic with no chain from key to key, which the
 * core can overlap with the reads as far as it is able. "cold" is ms per layer over the 30
 * layers (far beyond the caches); "hot" runs the same loop over 2,048 keys of one layer, which
 * stay in L2: the arithmetic alone. With W = 0, cold is the floor of the reads themselves.
 * docs/benchmarks.md ("16k / 512: what the reads and the arithmetic would give at best") has
 * the figures and how they compare with the kernel.
 *
 *     gcc -O2 -mavx512f -mavx512bw -mavx512vnni -fopenmp -o /tmp/kv_overlap benchmarks/kv_overlap_model.c
 *     OMP_NUM_THREADS=2 /tmp/kv_overlap 16384
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define H 3        /* kv heads */
#define RB 64      /* bytes of one head's row (int8, head_dim 64) */
#define L 30       /* layers */
#define CHUNK 1024 /* keys of one job */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int reads(const char *K, const char *V, int j0, int j1, int pf, int W) {
    __m512i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(i);
    const size_t R = (size_t)H * RB;
    int c = 0;
    for (int h = 0; h < H; h++)
        for (int j = j0; j < j1; j++) {
            const size_t o = (size_t)j * R + (size_t)h * RB;
            if (pf && j + pf < j1) {
                _mm_prefetch(K + o + (size_t)pf * R, _MM_HINT_T1);
                _mm_prefetch(V + o + (size_t)pf * R, _MM_HINT_T1);
            }
            const __m512i k = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i *)(K + o)));
            const __m512i v = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i *)(V + o + 32)));
            for (int w = 0; w < W; w++, c++) a[c & 7] = _mm512_dpwssd_epi32(a[c & 7], k, v);
        }
    __m512i s = a[0];
    for (int i = 1; i < 8; i++) s = _mm512_add_epi32(s, a[i]);
    return _mm512_reduce_add_epi32(s);
}

int main(int argc, char **argv) {
    const int ctx = argc > 1 ? atoi(argv[1]) : 16384, jobs = ctx / CHUNK;
    const size_t per = (size_t)ctx * H * RB;
    char *K[L], *V[L];
    for (int l = 0; l < L; l++) {
        K[l] = aligned_alloc(4096, per);
        V[l] = aligned_alloc(4096, per);
        memset(K[l], 1, per);
        memset(V[l], 2, per);
    }
    volatile int sink = 0;
    const int ws[] = {0, 6, 12, 24};
    printf("context %d, %d layers contiguous, ms per layer (all threads)\n", ctx, L);
    for (int rep = 0; rep < 3; rep++) {
        for (int wi = 0; wi < 4; wi++)
            for (int pf = 0; pf <= 64; pf += 64) {
                const int W = ws[wi];
                int z = 0;
                double t0 = now();
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : z)
                for (int t = 0; t < L * jobs; t++) z += reads(K[t / jobs], V[t / jobs], t % jobs * CHUNK, t % jobs * CHUNK + CHUNK, pf, W) & 1;
                const double cold = now() - t0;
                t0 = now();
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : z)
                for (int t = 0; t < L * jobs; t++) z += reads(K[0], V[0], t % 2 * CHUNK, t % 2 * CHUNK + CHUNK, pf, W) & 1;
                const double hot = now() - t0;
                sink += z;
                printf("W %2d, prefetch %2d keys ahead: cold %.3f, hot %.3f\n", W, pf, cold / L * 1e3, hot / L * 1e3);
            }
        printf("\n");
    }
    return sink == 1;
}
