/* Issue rate of the AVX2 instructions the quantized kernels are built from, on this CPU.
 *
 * The guest has no performance counters, so a kernel's cost per block is compared with what its
 * instruction mix could reach: each instruction below runs 8 independent times per loop
 * iteration (registers only, no memory), and the rate is reported per clock cycle, the clock
 * itself measured with a chain of dependent scalar adds (one per cycle). Read beside
 * benchmarks/quant_tile_variants.c (docs/benchmarks.md, seventeenth landing).
 *
 *     gcc -O2 -mavx2 -mfma benchmarks/avx2_op_throughput.c -o /tmp/avx2_ops && /tmp/avx2_ops
 */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ITERS 100000000L
#define EIGHT(OP) OP("%%ymm0") OP("%%ymm1") OP("%%ymm2") OP("%%ymm3") OP("%%ymm4") OP("%%ymm5") OP("%%ymm6") OP("%%ymm7")
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9"
#define RATE(NAME, OP)                                                                          \
    do {                                                                                        \
        double t0 = now();                                                                      \
        for (long i = 0; i < ITERS; i++) __asm__ volatile(EIGHT(OP) ::: CLOBBER);               \
        printf("%-12s %.2f per cycle\n", NAME, 8.0 * ITERS / ((now() - t0) * ghz * 1e9));      \
    } while (0)

#define VPMADDWD(r) "vpmaddwd %%ymm8, %%ymm9, " r "\n\t"
#define VPHADDD(r) "vphaddd %%ymm8, %%ymm9, " r "\n\t"
#define VPUNPCKLDQ(r) "vpunpckldq %%ymm8, %%ymm9, " r "\n\t"
#define VPUNPCKLQDQ(r) "vpunpcklqdq %%ymm8, %%ymm9, " r "\n\t"
#define VPADDD(r) "vpaddd %%ymm8, %%ymm9, " r "\n\t"
#define VPAND(r) "vpand %%ymm8, %%ymm9, " r "\n\t"
#define VPSRLW(r) "vpsrlw $4, %%ymm8, " r "\n\t"
#define VCVTDQ2PS(r) "vcvtdq2ps %%ymm8, " r "\n\t"
#define VFMADD(r) "vfmadd231ps %%ymm8, %%ymm9, " r "\n\t"
#define VPERMPS(r) "vpermps %%ymm8, %%ymm9, " r "\n\t"
#define VPERM2I128(r) "vperm2i128 $0x20, %%ymm8, %%ymm9, " r "\n\t"

int main(void) {
    long x = 0;
    const long n = 500000000L;
    double t0 = now();
    for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    const double ghz = 4.0 * n / (now() - t0) / 1e9;
    printf("clock ~%.2f GHz (dependent adds)\n", ghz);
    RATE("vpmaddwd", VPMADDWD);
    RATE("vphaddd", VPHADDD);
    RATE("vpunpckldq", VPUNPCKLDQ);
    RATE("vpunpcklqdq", VPUNPCKLQDQ);
    RATE("vpaddd", VPADDD);
    RATE("vpand", VPAND);
    RATE("vpsrlw", VPSRLW);
    RATE("vcvtdq2ps", VCVTDQ2PS);
    RATE("vfmadd231ps", VFMADD);
    RATE("vpermps", VPERMPS);
    RATE("vperm2i128", VPERM2I128);
    return x == 42;
}
