/* Fused decode of a Llama-style decoder stack over packed (4-bit / 8-bit) weights.
 *
 * A decode step of a small model on a CPU spends a large share of its time outside the weight
 * matmuls: per layer, a dozen small torch ops (two RMSNorms, rotary on q and k, the KV write,
 * SiLU*up, two residual adds) and the Python around them. decode_layers() runs whole layers in
 * one call, for a few token rows (decode steps, at most a handful of sequences):
 *
 *   x = rmsnorm(h) * w1;  qkv = x @ Wqkv^T (+ b);  rotate q and k heads ("rotate half");
 *   write k, v into the paged KV pool at the step's slots;  o = paged_attention(q, pool);
 *   h += o @ Wo^T;  x = rmsnorm(h) * w2;  g, u = x @ Wgu^T;  h += (silu(g) * u) @ Wdown^T
 *
 * The matmuls are the integer kernels of quant.c (int16 activations, the same results as the
 * per-matrix gemm_u4/gemm_s8 calls); attention is the paged-attention kernel of attention.c,
 * reached through its capsule. The small ops use the same formulas as the torch path (fp32,
 * rotary as x*cos + rotate_half(x)*sin, silu as x / (1 + exp(-x))); only summation order differs.
 *
 * Each layer is described by a row of LAYER_FIELDS int64 values (pointers and sizes), built once
 * by tokenmill.layers.quant.fused_decode from the model's modules and the KV pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <cpuid.h>
#endif

#include "attention.h"
#include "quant.h"

/* one layer row: these fields, then 4 matrices of MAT_FIELDS each (qkv, o, gate_up, down) */
enum { F_NORM1 = 0, F_NORM2, F_QKV_BIAS, F_K_CACHE, F_V_CACHE, F_K_SCALE, F_V_SCALE, F_MATS };
enum { MAT_KIND = 0, MAT_QS, MAT_SC, MAT_MN, MAT_F16, MAT_N, MAT_K, MAT_GROUP, MAT_FIELDS };
enum { W_QKV = 0, W_O, W_GATE_UP, W_DOWN, W_COUNT };
#define LAYER_FIELDS (F_MATS + W_COUNT * MAT_FIELDS)

static const tm_attention_tasks *g_attn = NULL;

/* Optional per-phase timers (decode_profile(True) turns them on; benchmarks read them). */
enum { P_NORM = 0, P_QKV, P_ROPE_KV, P_ATTN, P_O, P_GATE_UP, P_SILU, P_DOWN, P_RESID, P_HEAD, P_COUNT };
static const char *prof_names[P_COUNT] = {"rmsnorm", "matmul qkv", "rotary + kv write", "attention", "matmul o",
                                          "matmul gate_up", "silu*up", "matmul down", "residual adds", "matmul head"};
static int g_prof = 0;
static double g_prof_s[P_COUNT];

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static TmqMat mat_at(const int64_t *f) {
    TmqMat m = {f[MAT_KIND], (const void *)(uintptr_t)f[MAT_QS], (const void *)(uintptr_t)f[MAT_SC],
                (const void *)(uintptr_t)f[MAT_MN], f[MAT_F16], f[MAT_N], f[MAT_K], f[MAT_GROUP]};
    return m;
}

static TmqMat layer_mat(const int64_t *row, int w) { return mat_at(row + F_MATS + w * MAT_FIELDS); }

static void rmsnorm(const float *h, const float *w, float *out, int64_t M, int64_t H, float eps) {
    for (int64_t t = 0; t < M; t++) {
        const float *x = h + t * H;
        float *o = out + t * H;
        float s[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
            for (int j = 0; j < 8; j++) s[j] += x[i + j] * x[i + j];
        for (; i < H; i++) s[0] += x[i] * x[i];
        float ss = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        float r = 1.f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; i++) o[i] = (x[i] * r) * w[i];
    }
}

/* rotate-half RoPE on `heads` heads of `d` values of each row (in place); row t's angles are row
 * pos[t] of cos / sin (pos NULL: row t) */
static void rotary(float *x, int64_t M, int64_t stride, int heads, int d, const float *cos, const float *sin,
                   const int64_t *pos) {
    int half = d / 2;
    for (int64_t t = 0; t < M; t++) {
        const int64_t r = pos ? pos[t] : t;
        const float *c = cos + r * d, *s = sin + r * d;
        for (int h = 0; h < heads; h++) {
            float *v = x + t * stride + (int64_t)h * d;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Store M token rows of hkv heads x d values at their slots. fp16 (TM_KV_F16): saturated at
 * +-65504, as tokenmill.layers.attention.base.to_kv_dtype stores them. fp8 (kind TM_KV_FP8*): the same
 * bytes (and per-vector scales) as tokenmill.layers.attention.fp8.write_fp8 writes
 * (tm_fp8_write_vec in attention.h), int8 (TM_KV_INT8) likewise (tm_i8_write_vec); a per-vector
 * scale is stored at slot * hkv + head. Tiled int8 (TM_KV_INT8T): tm_i8t_write_vec, with the page
 * size ps and is_k (the K half). */
static void kv_write(void *cache, float *scales, const float *src, int64_t src_stride, const int64_t *slots,
                     int64_t M, int64_t hkv, int64_t d, int kind, int64_t ps, int is_k) {
    const int64_t width = hkv * d;
    for (int64_t t = 0; t < M; t++) {
        const float *s = src + t * src_stride;
        if (kind == TM_KV_BF16) {
            uint16_t *o = (uint16_t *)cache + slots[t] * width;
            for (int64_t i = 0; i < width; i++) o[i] = to_bf16(s[i]);
        } else if (kind == TM_KV_F16) {
            uint16_t *o = (uint16_t *)cache + slots[t] * width;
            for (int64_t i = 0; i < width; i++) o[i] = tm_to_f16(s[i]);
        } else if (kind == TM_KV_FP8 || kind == TM_KV_FP8_TOKEN) {
            uint8_t *o = (uint8_t *)cache + slots[t] * width;
            for (int64_t h = 0; h < hkv; h++)
                tm_fp8_write_vec(o + h * d, kind == TM_KV_FP8 ? scales + h : scales + slots[t] * hkv + h, s + h * d, d,
                                 kind == TM_KV_FP8_TOKEN);
        } else if (kind == TM_KV_INT8T) {   /* tiled int8 pages (attention.h) */
            for (int64_t h = 0; h < hkv; h++) tm_i8t_write_vec((int8_t *)cache, scales, is_k, slots[t], h, hkv, ps, s + h * d, d);
        } else if (kind == TM_KV_INT8) {
            int8_t *o = (int8_t *)cache + slots[t] * width;
            for (int64_t h = 0; h < hkv; h++) tm_i8_write_vec(o + h * d, scales + slots[t] * hkv + h, s + h * d, d);
        } else {
            memcpy((float *)cache + slots[t] * width, s, (size_t)width * sizeof(float));
        }
    }
}

/* a[i] = silu(g[i]) * u[i], silu(x) = x / (1 + exp(-x)) */
static void silu_mul_scalar(const float *g, const float *u, float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TGT_AVX2 __attribute__((target("avx2,fma")))
/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2/2, then 2^n times a degree-7 Taylor
 * polynomial of e^r (relative error below 2e-7, about two float ulps); x below -87 gives 0. */
TGT_AVX2 static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);        /* ln2 split in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* silu through e = exp(-|x|), which never overflows: sigmoid(x) = 1/(1+e) for x >= 0, e/(1+e) below */
TGT_AVX2 static void silu_mul_avx2(const float *g, const float *u, float *a, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = exp_nonpos(_mm256_or_ps(x, sign));                 /* exp(-|x|) */
        __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        __m256 num = _mm256_blendv_ps(one, e, neg);
        __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
    silu_mul_scalar(g + i, u + i, a + i, n - i);
}

static int have_avx2_fma(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cached;
}
#endif

static void silu_mul(const float *g, const float *u, float *a, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_avx2_fma()) { silu_mul_avx2(g, u, a, n); return; }
#endif
    silu_mul_scalar(g, u, a, n);
}

typedef struct {
    int64_t M, H, hq, hkv, d, inter;
    float eps, scale;
    const float *cos, *sin;
    const int64_t *pos;                     /* rows of cos / sin by token (NULL: token t's is row t) */
    const int64_t *slots, *bt, *qsl, *seq_lens;
    int64_t bt_stride;
    int num_seqs, page_size, kv_kind, nt;   /* kv_kind: TM_KV_* (attention.h) */
    int kv_prefetch;                        /* prefetch each layer's KV during the matmuls before it */
    int static_rows;                        /* split each matmul's rows evenly up front (no claiming) */
    int shared_claims;                      /* 2 threads: claims from one counter (not halves first) */
    int kv_pf_t0;                           /* that prefetch with prefetcht0 (else t1: into L2) */
} Step;

/* shared scratch: qkv [M,qn], att [M,hq*d], tmp [M,H], gu [M,2I]; h [M,H] is the caller's */
typedef struct {
    float *h, *qkv, *att, *tmp, *gu;
} Bufs;

/* A row's argmax, found where the head's logits are still in the cache of the thread that wrote
 * them: each thread takes the best entry of its own share of the row (tmq_row_range, the split a
 * one-row head matmul writes), and the caller combines the shares in thread order. The rule is
 * numpy's / torch's: the first index of the largest value, a NaN counting as larger than any
 * number (the first NaN wins). Reading the row back from Python instead cost 60-70 us per
 * one-row decode step on a 2-thread host, most of it moving the other thread's half of the
 * 192 KB row between the cores' caches. */
typedef struct {
    float val;     /* NaN where the share holds one */
    int64_t idx;   /* -1: an empty share */
} ArgPart;

/* the largest value of x[i0..n1) and whether any is NaN, from the start m, nan */
static void max_scan(const float *x, int64_t i0, int64_t n1, float *m, int *nan) {
    for (int64_t i = i0; i < n1; i++) {
        const float v = x[i];
        *nan |= v != v;
        *m = v > *m ? v : *m;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* max_scan 8 lanes at a time (max_ps skips a NaN in its first operand; cmp_unord flags it) */
TGT_AVX2 static int64_t max_scan_avx2(const float *x, int64_t n0, int64_t n1, float *m, int *nan) {
    __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    int64_t i = n0;
    for (; i + 8 <= n1; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mv = _mm256_max_ps(v, mv);
    }
    float t[8];
    _mm256_storeu_ps(t, mv);
    for (int j = 0; j < 8; j++) *m = t[j] > *m ? t[j] : *m;
    *nan |= _mm256_movemask_ps(un) != 0;
    return i;
}

/* the first i in [i0, n1) with x[i] == m (m NaN: the first NaN); n1 if none */
TGT_AVX2 static int64_t find_first_avx2(const float *x, int64_t i0, int64_t n1, float m, int nan) {
    const __m256 mv = _mm256_set1_ps(m);
    int64_t i = i0;
    for (; i + 8 <= n1; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const int k = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, mv, _CMP_EQ_OQ));
        if (k) return i + __builtin_ctz((unsigned)k);
    }
    for (; i < n1; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return n1;
}
#endif

static ArgPart argmax_part(const float *x, int64_t n0, int64_t n1) {
    ArgPart p = {-INFINITY, -1};
    if (n0 >= n1) return p;
    float m = -INFINITY;
    int nan = 0;
    int64_t i = n0;
#if defined(__x86_64__) && defined(__GNUC__)
    const int vec = have_avx2_fma();
    if (vec) i = max_scan_avx2(x, n0, n1, &m, &nan);
#endif
    max_scan(x, i, n1, &m, &nan);
#if defined(__x86_64__) && defined(__GNUC__)
    if (vec) {
        i = find_first_avx2(x, n0, n1, m, nan);
    } else
#endif
    {
        i = n0;   /* found: m is one of x[n0..n1) (all -inf: the first) */
        while (nan ? x[i] == x[i] : x[i] != m) i++;
    }
    p.val = nan ? NAN : m;
    p.idx = i;
    return p;
}

/* the row's argmax from T shares in ascending order, share t at parts[t * stride] */
static int64_t argmax_join(const ArgPart *parts, int64_t stride, int T) {
    ArgPart best = {-INFINITY, -1};
    for (int t = 0; t < T; t++) {
        const ArgPart *p = &parts[t * stride];
        if (p->idx < 0 || isnan(best.val)) continue;
        if (best.idx < 0 || isnan(p->val) || p->val > best.val) best = *p;
    }
    return best.idx;
}

/* The optional epilogue after the last layer: logits[r] = head(rmsnorm(h[idx[r]]) * norm), for
 * the n rows whose logits the step needs, in the same parallel region (no second fork, and no
 * torch ops from Python in between). */
typedef struct {
    const int64_t *mat;   /* the head's MAT_FIELDS; NULL: no epilogue */
    const float *norm;    /* the final RMSNorm's weight [H] */
    const int64_t *idx;   /* rows of h */
    int64_t n;
    float *logits;        /* [n, head N] */
    int64_t *argmax;      /* [n] each logits row's first largest index (NULL: not asked for) */
    ArgPart *part;        /* [threads * n]: each thread's best over its share of a row (argmax_part) */
} Head;

/* A spinning barrier for the threads of one step. libgomp's barrier spins GOMP_SPINCOUNT times
 * (the CLI sets 1000, so that idle threads between steps leave the cores to other processes)
 * and then sleeps in the kernel; inside a step the waits are microseconds, and a thread put to
 * sleep there costs a wake-up, and on a busy machine a wait for a core, at every barrier. This
 * one spins (with pause) for SPIN_PAUSES rounds, about 10 us, then yields the core between
 * checks (TOKENMILL_SPIN_PAUSES overrides the count, for A/B runs). The short spin matters where
 * the team has every core, as `tokenmill serve --threads 2` on 2 cores: the server's event loop
 * (or the HTTP client) then takes a core from a team thread now and then, and a teammate that
 * spins at the barrier keeps the other core from it until its spin ends. With 20,000 rounds
 * (about 1 ms on an Intel host, where a pause takes ~140 cycles) served single-stream decode
 * read 180-188 tok/s; with 50 / 200 / 1,000 rounds 208 / 204 / 200 (16 alternating streams
 * each, one run). Offline decode (nothing else on the cores) and 16-row steps were level. */
#define SPIN_PAUSES 64
enum { C_HEAD = W_COUNT, C_COUNT };   /* claim counters: one per layer matrix, and the head's */
typedef struct {
    atomic_int arrived, gen, next;  /* next: attention's task counter */
    atomic_llong rows[C_COUNT];     /* per matmul: its next unclaimed output row */
    int n;
} SpinBar;

static inline void cpu_relax(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_ia32_pause();
#endif
}

static int g_spin = SPIN_PAUSES;   /* set per call (decode_layers) */
static void bar_wait(SpinBar *b) {
    if (b->n <= 1) return;
    int g = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->gen, 1, memory_order_release);
        return;
    }
    for (int i = 0; atomic_load_explicit(&b->gen, memory_order_acquire) == g; i++) {
        if (i < g_spin) cpu_relax();
        else sched_yield();
    }
}

/* an environment switch: set, non-empty and not "0" */
static int env_flag(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

/* KV prefetch. A decode step's attention reads every running sequence's K and V pages of the
 * layer, which the previous layers' weight stream (about 3 MB per layer) has pushed out of the
 * caches; the kernel then waits on memory with its arithmetic idle (in cache it costs about half
 * as much per key). The previous layer's gate_up and down matmuls are compute-bound at batch 1
 * and leave read bandwidth unused, so each thread prefetches its share of the next layer's KV
 * lines while it runs them, spread evenly over its slices of PF_SLICE output rows (layer 0's
 * over its qkv matmul). Spreading them over the next layer's qkv as well measured no better.
 * A prefetch changes no result. The lines are asked for with prefetcht1 (into L2), as in the
 * attention kernel (TOKENMILL_KV_PREFETCH_T0=1: prefetcht0, for both).
 *
 * It is on by default except on Intel CPUs (kv_prefetch_default). It was measured on an AVX2 Zen 3
 * host, where it made a decode step 1.04x-1.08x faster from 2k to 8k tokens of context. On the
 * Intel Xeon hosts (Sapphire Rapids class, 2 MB of L2 per core) it gained nothing at 512 tokens
 * and cost more the longer the context: one sequence on int4 weights and an fp16 pool was 1.08x
 * slower at 2k, 1.18x at 4k and 1.36x at 16k, and 4 or 8 sequences of 1,500 tokens 1.2x-1.3x
 * (docs/benchmarks.md, "Long contexts on an Intel host"). There the lines it
 * brings compete with the weight stream and are gone from L2 before attention reads them.
 * TOKENMILL_KV_PREFETCH=1 turns it on and TOKENMILL_NO_KV_PREFETCH=1 off, on any CPU (A/B runs). */
#define PF_SLICE 16

/* the prefetch's default: off on Intel CPUs ("GenuineIntel"), on elsewhere. Read once: every
 * decode_layers call asks, and in a virtual machine each CPUID traps to the hypervisor. */
static int kv_prefetch_default(void) {
    static int cached = -1;
    if (cached < 0) {
        int on = 1;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
        unsigned a, b, c, d;
        if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu)
            on = 0;   /* "GenuineIntel" */
#endif
        cached = on;
    }
    return cached;
}

/* on or off for this call: the switches above, else the CPU's default */
static int kv_prefetch_on(void) {
    if (env_flag("TOKENMILL_NO_KV_PREFETCH")) return 0;
    if (env_flag("TOKENMILL_KV_PREFETCH")) return 1;
    return kv_prefetch_default();
}

typedef struct {
    const char *pool[2];      /* the layer's K and V pages */
    int64_t bpt;              /* bytes per token row (hkv * d * element size) */
    int s, kv;                /* cursor: sequence, K (0) or V (1) */
    int64_t j, off;           /* page of that sequence, byte offset in it */
    int64_t left, per_slice;  /* lines still to prefetch, lines per matmul slice */
} KvPf;

static int64_t kv_elem_size(int kind) {
    return kind == TM_KV_F32 ? 4 : TM_KV_SCALED(kind) ? 1 : 2;
}

/* bytes of page j of sequence s (the tokens it holds) */
static inline int64_t kvpf_page_bytes(const Step *S, int64_t bpt, int s, int64_t j) {
    int64_t n = S->seq_lens[s] - j * S->page_size;
    return (n < S->page_size ? n : S->page_size) * bpt;
}

/* advance the cursor by n lines (to the end: p->s == num_seqs), prefetching them if `issue`
 * (without, a page at a time: the start of a thread's share) */
static void kvpf_walk(KvPf *p, const Step *S, int64_t n, int issue) {
    while (n > 0 && p->s < S->num_seqs) {
        const int64_t pages = (S->seq_lens[p->s] + S->page_size - 1) / S->page_size;
        if (p->j >= pages) { p->s++; p->j = 0; p->kv = 0; p->off = 0; continue; }
        const int64_t bytes = kvpf_page_bytes(S, p->bpt, p->s, p->j);
        const int64_t left = (bytes - p->off + 63) / 64, k = n < left ? n : left;
        if (issue) {
            const char *base = p->pool[p->kv] + S->bt[p->s * S->bt_stride + p->j] * S->page_size * p->bpt + p->off;
            if (S->kv_pf_t0) for (int64_t i = 0; i < k; i++) __builtin_prefetch(base + 64 * i, 0, 3);
            else for (int64_t i = 0; i < k; i++) __builtin_prefetch(base + 64 * i, 0, 2);
        }
        p->off += 64 * k;
        n -= k;
        if (p->off >= bytes) {
            p->off = 0;
            if (++p->kv == 2) { p->kv = 0; p->j++; }
        }
    }
}

/* thread t's share of layer `row`'s KV lines, to be prefetched over `slices` matmul slices */
static void kvpf_start(KvPf *p, const int64_t *row, const Step *S, int t, int T, int64_t slices) {
    p->left = 0;
    if (!S->kv_prefetch || slices <= 0) return;
    p->pool[0] = (const char *)(uintptr_t)row[F_K_CACHE];
    p->pool[1] = (const char *)(uintptr_t)row[F_V_CACHE];
    p->bpt = S->hkv * S->d * kv_elem_size(S->kv_kind);
    int64_t total = 0;
    for (int s = 0; s < S->num_seqs; s++)
        for (int64_t j = 0; j * S->page_size < S->seq_lens[s]; j++) total += 2 * ((kvpf_page_bytes(S, p->bpt, s, j) + 63) / 64);
    const int64_t a = total * t / T, b = total * (t + 1) / T;
    p->s = 0; p->kv = 0; p->j = 0; p->off = 0;
    kvpf_walk(p, S, a, 0);
    p->left = b - a;
    p->per_slice = (p->left + slices - 1) / slices;
}

/* thread t's slices of PF_SLICE rows of w */
static int64_t pf_slices(const TmqMat *w, int t, int T) {
    int64_t n0, n1;
    tmq_row_range(w->N, t, T, &n0, &n1);
    return (n1 - n0 + PF_SLICE - 1) / PF_SLICE;
}

/* rows [n0, n1) of y = act @ w^T (+ bias), with p's KV lines (if any are left) prefetched between
 * slices of PF_SLICE rows */
static void rows_prefetching(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y, int64_t n0,
                             int64_t n1, KvPf *p, const Step *S) {
    for (int64_t a = n0; a < n1; a += PF_SLICE) {
        if (!p || p->left <= 0) { tmq_matmul_range(w, act, M, bias, y, a, n1); return; }
        const int64_t n = p->per_slice < p->left ? p->per_slice : p->left;
        kvpf_walk(p, S, n, 1);
        p->left -= n;
        tmq_matmul_range(w, act, M, bias, y, a, a + PF_SLICE < n1 ? a + PF_SLICE : n1);
    }
}

/* Rows of y = act @ w^T (+ bias) claimed from the team's counter (reset to 0 by thread 0 before
 * the barrier that starts the matmul), in guided sizes: a claim takes 1/(CLAIM_SHARE T) of the
 * rows still unclaimed (a multiple of 16 rows, the amx kernels' tile, at least CLAIM_MIN; with
 * 1/(2T) a thread that lost its core mid-claim held more back), so a matmul is a few dozen claims, large
 * first and small at the end. p's KV lines (if any) are prefetched between slices of PF_SLICE
 * rows (rows_prefetching). A thread that loses its core for a while (the server's
 * event loop, the HTTP client, another process) then leaves its rows to the others instead of
 * holding every thread at the next barrier. A row's result never depends on which thread
 * computes it (the kernels' row ranges are exact for any split). */
#define CLAIM_MIN 32
#define CLAIM_SHARE 4
/* the size of the next claim when `left` rows of a range are unclaimed and `share` is the claim's
 * fraction of them (see matmul_claiming): a multiple of 16, at least CLAIM_MIN, at most left */
static inline int64_t claim_size(int64_t left, int64_t share) {
    int64_t n = left / share / 16 * 16;
    if (n < CLAIM_MIN) n = CLAIM_MIN;
    return n < left ? n : left;
}
static void matmul_claiming(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y,
                            atomic_llong *ctr, int T, KvPf *p, const Step *S) {
    const int64_t N = w->N;
    long long a = atomic_load_explicit(ctr, memory_order_relaxed);
    for (;;) {
        if (a >= N) return;
        const int64_t n = claim_size(N - a, (int64_t)CLAIM_SHARE * T);
        if (!atomic_compare_exchange_weak_explicit(ctr, &a, a + n, memory_order_relaxed, memory_order_relaxed))
            continue;   /* a now holds the counter's value */
        rows_prefetching(w, act, M, bias, y, a, a + n, p, S);
        a = atomic_load_explicit(ctr, memory_order_relaxed);
    }
}

/* Two threads: each claims from its own half of the rows first (thread 0 from row 0, thread 1
 * from the middle, each half in guided sizes of 1/CLAIM_SHARE of what is left of it), then from
 * the other half. One atomic word holds both halves' counts (low and high 32 bits), so the
 * counter's reset to 0 serves as before. On a quiet machine each thread then reads its half of
 * the weights as one stream, as with the even split; a thread that loses its core leaves the
 * rest of its half to the other one, as with claims. Against claims from one counter, on an Intel
 * host with AMX (benchmarks/decode_batch_rows.py --env-ab TOKENMILL_SHARED_CLAIMS=1): int4 steps
 * of 2 / 3 / 4 sequences 1.05x / 1.13x / 1.05x faster quiet, and 0.94x / 1.12x / 1.13x beside a
 * busy-loop process; fp32 steps of 2 / 4 sequences 1.08x / 1.05x (docs/benchmarks.md, "Decode
 * steps of 2 to 4 sequences on Q4 weights"). TOKENMILL_SHARED_CLAIMS=1: one counter (A/B). */
static void matmul_halves(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y, atomic_llong *ctr,
                          int t, KvPf *p, const Step *S) {
    const int64_t N = w->N, h = N / 2 / 16 * 16;
    const int64_t start[2] = {0, h}, len[2] = {h, N - h};
    long long v = atomic_load_explicit(ctr, memory_order_relaxed);
    for (;;) {
        const int64_t c[2] = {(int64_t)(v & 0xFFFFFFFFLL), (int64_t)((unsigned long long)v >> 32)};
        int s = t & 1;
        if (c[s] >= len[s]) s ^= 1;
        if (c[s] >= len[s]) return;
        const int64_t n = claim_size(len[s] - c[s], CLAIM_SHARE);
        const long long nv = s == 0 ? v + n : v + (long long)((unsigned long long)n << 32);
        if (!atomic_compare_exchange_weak_explicit(ctr, &v, nv, memory_order_relaxed, memory_order_relaxed))
            continue;   /* v now holds the counter's value */
        rows_prefetching(w, act, M, bias, y, start[s] + c[s], start[s] + c[s] + n, p, S);
        v = atomic_load_explicit(ctr, memory_order_relaxed);
    }
}

/* one matmul of the team over M activation rows: with 2 or more, rows claimed (two threads:
 * matmul_halves; more: matmul_claiming);
 * with one, or with TOKENMILL_STATIC_ROWS=1 (an A/B switch), split evenly up front, with p's
 * prefetch between slices when p is given. Claims paid for several rows (decode batches, verify
 * steps); for one row they measured 0.94x-1.03x, inside this host's noise, so a lone decode keeps
 * the even split (benchmarks/claim_rows_ab.py, docs/benchmarks.md). */
static inline void matmul_phase(const TmqMat *w, const void *act, int64_t M, const float *bias, float *y, int t, int T,
                                atomic_llong *ctr, KvPf *p, const Step *S) {
    if (!S->static_rows && M > 1 && T == 2 && !S->shared_claims) {
        matmul_halves(w, act, M, bias, y, ctr, t, p, S);
    } else if (!S->static_rows && M > 1) {
        matmul_claiming(w, act, M, bias, y, ctr, T, p, S);
    } else {
        int64_t n0, n1;
        tmq_row_range(w->N, t, T, &n0, &n1);
        rows_prefetching(w, act, M, bias, y, n0, n1, p, S);
    }
}

/* Thread t's own copies: the residual stream h (thread 0: the caller's h itself), the normalized
 * rows x and the SiLU output act, and its quantized activations aq (a tmq_act_buffer, sized by
 * tmq_py_decode_layers for the largest matmul of the step). */
typedef struct {
    float *h, *x, *act;
    void *aq;
} Own;

/* The whole step is one `omp parallel` region (a fork/join per matmul cost more than a second
 * thread gained). Every thread runs this loop. Each matmul's output rows go to the threads as
 * they claim them (matmul_phase: steps of 2+ rows) or in even shares (one row), attention's tasks
 * to whichever thread takes the next one; a barrier ends each of them. The small ops between
 * (residual adds, RMSNorm, SiLU*up, and quantizing the next matmul's activations) run on every
 * thread at once, each on its own copy of the residual stream (Own): the same operations in the
 * same order, so the copies stay bit for bit equal, and the next matmul starts without another
 * barrier. Done once on thread 0 and shared, the quantized activations were written to cache
 * lines the other threads had just read and were read back from the writer's cache: with two
 * threads of a 4-row step, the quantize calls cost 10x their single-thread time (docs/
 * benchmarks.md, "Small ops on every thread"). Rotary, the KV write and attention's plan and
 * merge stay on thread 0. Shared state (the attention call, the error) is written by thread 0
 * and read only after a barrier, so every thread takes the same branch; a quantize into a buffer
 * too small (which tmq_py_decode_layers' sizing rules out) skips the matmul and flags `bad`,
 * without a branch that could leave a thread behind at a barrier. The phase timers count on
 * thread 0: a matmul phase includes its barrier, a small-op phase only thread 0's own work. */
static void run_layers_team(const int64_t *tab, int64_t L, const Step *S, const Bufs *B, const Head *hd, Own *own,
                            void **call, int *err, atomic_int *bad, SpinBar *bar) {
    const int64_t M = S->M, H = S->H, qsz = S->hq * S->d, kvsz = S->hkv * S->d, qn = qsz + 2 * kvsz, I = S->inter;
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    if (t == 0) {
        bar->n = T;
        for (int c = 0; c < C_COUNT; c++) atomic_store_explicit(&bar->rows[c], 0, memory_order_relaxed);
    }
    #pragma omp barrier
    const int prof = g_prof && t == 0;
    double t_last = prof ? now_s() : 0.0;
#define TTICK(phase) do { if (prof) { double t_ = now_s(); g_prof_s[phase] += t_ - t_last; t_last = t_; } } while (0)
    /* quantize this thread's activations x (MR rows) for W; a matmul of MR rows on them, rows
     * claimed from counter C (reset by thread 0 in a serial part between its uses) or split evenly */
#define QUANT(W, X, MR) do { if (tmq_act_quantize_into(me->aq, W, X, MR)) atomic_store(bad, 1); } while (0)
#define MATMUL(W, MR, BIAS, Y, C, PF) do { if (!atomic_load_explicit(bad, memory_order_relaxed)) \
        matmul_phase(W, me->aq, MR, BIAS, Y, t, T, &bar->rows[C], PF, S); } while (0)
    Own *me = &own[t];
    float *h = me->h, *x = me->x;
    if (t > 0) memcpy(h, B->h, (size_t)(M * H) * sizeof(float));
    if (L > 0) {
        TmqMat w = layer_mat(tab, W_QKV);
        rmsnorm(h, (const float *)(uintptr_t)tab[F_NORM1], x, M, H, S->eps);
        QUANT(&w, x, M);
    }
    TTICK(P_NORM);
    KvPf pf;   /* this thread's prefetch of the next attention's KV (see KvPf) */
    if (L > 0) {
        const TmqMat w0 = layer_mat(tab, W_QKV);
        kvpf_start(&pf, tab, S, t, T, pf_slices(&w0, t, T));
    }
    for (int64_t l = 0; l < L && !*err; l++) {
        const int64_t *row = tab + l * LAYER_FIELDS;
        TmqMat w = layer_mat(row, W_QKV);
        MATMUL(&w, M, (const float *)(uintptr_t)row[F_QKV_BIAS], B->qkv, W_QKV, &pf);
        bar_wait(bar);
        TTICK(P_QKV);
        if (t == 0) {
            void *kc = (void *)(uintptr_t)row[F_K_CACHE], *vc = (void *)(uintptr_t)row[F_V_CACHE];
            float *ks = (float *)(uintptr_t)row[F_K_SCALE], *vs = (float *)(uintptr_t)row[F_V_SCALE];
            /* every claim counter is between uses here: this layer's qkv matmul is done, its other
             * matmuls (and the head, after the last layer) have not begun */
            for (int c = 0; c < C_COUNT; c++) atomic_store_explicit(&bar->rows[c], 0, memory_order_relaxed);
            rotary(B->qkv, M, qn, (int)(S->hq + S->hkv), (int)S->d, S->cos, S->sin, S->pos);
            kv_write(kc, ks, B->qkv + qsz, qn, S->slots, M, S->hkv, S->d, S->kv_kind, S->page_size, 1);
            kv_write(vc, vs, B->qkv + qsz + kvsz, qn, S->slots, M, S->hkv, S->d, S->kv_kind, S->page_size, 0);
            *call = g_attn->plan(B->qkv, qn, B->att, kc, vc, S->kv_kind, ks, vs, S->bt, S->bt_stride, S->qsl, S->seq_lens,
                                 S->num_seqs, S->page_size, (int)S->hq, (int)S->hkv, (int)S->d, S->scale, T);
            if (!*call) *err = -2;
            atomic_store_explicit(&bar->next, 0, memory_order_relaxed);
        }
        bar_wait(bar);
        TTICK(P_ROPE_KV);
        if (*err) break;
        for (int n = g_attn->tasks(*call), i; (i = atomic_fetch_add_explicit(&bar->next, 1, memory_order_relaxed)) < n;)
            g_attn->run(*call, i);
        bar_wait(bar);
        if (t == 0) {
            g_attn->finish(*call);
            *call = NULL;
        }
        bar_wait(bar);
        TTICK(P_ATTN);
        w = layer_mat(row, W_O);
        QUANT(&w, B->att, M);
        MATMUL(&w, M, NULL, B->tmp, W_O, (KvPf *)NULL);
        bar_wait(bar);
        TTICK(P_O);
        w = layer_mat(row, W_GATE_UP);
        for (int64_t i = 0; i < M * H; i++) h[i] += B->tmp[i];
        rmsnorm(h, (const float *)(uintptr_t)row[F_NORM2], x, M, H, S->eps);
        QUANT(&w, x, M);
        TTICK(P_NORM);
        if (l + 1 < L) {   /* the next layer's KV, over this layer's gate_up and down */
            const TmqMat wd = layer_mat(row, W_DOWN);
            kvpf_start(&pf, row + LAYER_FIELDS, S, t, T, pf_slices(&w, t, T) + pf_slices(&wd, t, T));
        }
        MATMUL(&w, M, NULL, B->gu, W_GATE_UP, &pf);
        bar_wait(bar);
        TTICK(P_GATE_UP);
        w = layer_mat(row, W_DOWN);
        for (int64_t r = 0; r < M; r++) silu_mul(B->gu + r * 2 * I, B->gu + r * 2 * I + I, me->act + r * I, I);
        QUANT(&w, me->act, M);
        TTICK(P_SILU);
        MATMUL(&w, M, NULL, B->tmp, W_DOWN, &pf);
        bar_wait(bar);
        TTICK(P_DOWN);
        for (int64_t i = 0; i < M * H; i++) h[i] += B->tmp[i];
        if (l + 1 < L) {  /* the next layer's first norm and its qkv activations */
            const int64_t *next = row + LAYER_FIELDS;
            rmsnorm(h, (const float *)(uintptr_t)next[F_NORM1], x, M, H, S->eps);
            TmqMat wn = layer_mat(next, W_QKV);
            QUANT(&wn, x, M);
        }
        TTICK(P_RESID);
    }
    if (hd->mat && !*err) {   /* the final norm and the output head (see Head) */
        const TmqMat w = mat_at(hd->mat);
        for (int64_t r = 0; r < hd->n; r++) rmsnorm(h + hd->idx[r] * H, hd->norm, x + r * H, 1, H, S->eps);
        QUANT(&w, x, hd->n);
        TTICK(P_NORM);
        MATMUL(&w, hd->n, NULL, hd->logits, C_HEAD, (KvPf *)NULL);
        bar_wait(bar);
        if (hd->argmax) {   /* this thread's share of each row (joined after the region) */
            int64_t n0, n1;
            tmq_row_range(w.N, t, T, &n0, &n1);
            for (int64_t r = 0; r < hd->n; r++) hd->part[(int64_t)t * hd->n + r] = argmax_part(hd->logits + r * w.N, n0, n1);
        }
        TTICK(P_HEAD);
    }
#undef TTICK
#undef QUANT
#undef MATMUL
}

/* Continuous decode steps (decode_layers' `steps` > 1): the call runs `steps` one-row-per-sequence
 * steps back to back, each step's input the previous one's argmax (greedy decoding without a trip
 * through Python). Between steps thread 0 joins the argmax shares into tokens[s], writes each row's
 * embedding (row `token` of emb, dequantized as the Python embedding does) into h, and moves the
 * step's own copies of the positions, sequence lengths and KV slots one token on (slot = the
 * page of the new position in the sequence's block table; the caller has allocated those pages).
 * The other threads wait at a barrier and then copy h as at the start of any step. */
typedef struct {
    int64_t steps;
    int64_t *tokens;       /* [steps, M]: each step's token per row */
    TmqMat emb;            /* the embedding (U4, S8 or F32 rows of H) */
    int64_t *pos, *slots, *seq_lens;   /* the step's own copies (Step points at them) */
    const int32_t *stop;   /* NULL, or a flag another thread may set: end after the current step */
    int64_t done;          /* steps run */
    int more;              /* thread 0's word to the team after a step: go on */
} Chain;

/* thread 0, after step s's head: record its tokens; unless it was the last (or the stop flag
 * is set), make step s + 1's inputs. A token outside the embedding, or a position past the block
 * table, sets *err. */
static void chain_advance(Chain *c, int64_t s, const Step *S, const Bufs *B, const Head *hd, int T, int *err) {
    const int64_t M = S->M, ps = S->page_size;
    const int last = s + 1 == c->steps || (c->stop && __atomic_load_n(c->stop, __ATOMIC_RELAXED));
    c->done = s + 1;
    c->more = !last;
    for (int64_t r = 0; r < M; r++) {
        const int64_t tok = argmax_join(hd->part + r, hd->n, T);
        c->tokens[s * M + r] = tok;
        hd->argmax[r] = tok;
        if (last) continue;
        const int64_t p = c->pos[r] + 1;
        if (tok < 0 || tmq_dequant_row(&c->emb, tok, B->h + r * S->H)) { *err = -3; return; }
        if (p / ps >= S->bt_stride) { *err = -4; return; }
        c->pos[r] = p;
        c->seq_lens[r] += 1;
        c->slots[r] = S->bt[r * S->bt_stride + p / ps] * ps + p % ps;
    }
}

/* every thread: the call's steps (one, or a chain) */
static void run_steps_team(Chain *c, const int64_t *tab, int64_t L, const Step *S, const Bufs *B,
                           const Head *hd, Own *own, void **call, int *err, atomic_int *bad, SpinBar *bar) {
    for (int64_t s = 0;; s++) {
        run_layers_team(tab, L, S, B, hd, own, call, err, bad, bar);
        if (!c) return;
        bar_wait(bar);   /* every share of the argmax is written */
        if (omp_get_thread_num() == 0 && !*err && !atomic_load(bad)) chain_advance(c, s, S, B, hd, bar->n, err);
        bar_wait(bar);
        if (*err || atomic_load(bad) || !c->more) return;
    }
}

/* a matrix description the kernels take, with the pointers its kind reads */
static int mat_ok(const TmqMat *m) {
    return tmq_check_mat(m) && m->qs && (m->kind == TMQ_F32 || m->sc) && (m->kind != TMQ_U4 || m->mn);
}

/* check every layer row against the model's sizes (with the GIL, before any work); *act_bytes
 * becomes the room the largest of their quantized activations needs (tmq_act_bytes, M rows) */
static int check_layers(const int64_t *table, int64_t L, const Step *S, size_t *act_bytes) {
    const int64_t H = S->H, qsz = S->hq * S->d, qn = qsz + 2 * S->hkv * S->d, I = S->inter;
    const int64_t want[W_COUNT][2] = {{qn, H}, {H, qsz}, {2 * I, H}, {H, I}};
    static const char *names[W_COUNT] = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
    for (int64_t l = 0; l < L; l++) {
        const int64_t *row = table + l * LAYER_FIELDS;
        if (!row[F_NORM1] || !row[F_NORM2] || !row[F_K_CACHE] || !row[F_V_CACHE]) {
            PyErr_Format(PyExc_ValueError, "decode_layers: layer %lld has a null norm or KV pointer", (long long)l);
            return -1;
        }
        if (TM_KV_SCALED(S->kv_kind) && (!row[F_K_SCALE] || !row[F_V_SCALE])) {
            PyErr_Format(PyExc_ValueError, "decode_layers: layer %lld has fp8 / int8 KV pages without scales", (long long)l);
            return -1;
        }
        for (int w = 0; w < W_COUNT; w++) {
            TmqMat m = layer_mat(row, w);
            if (!mat_ok(&m) || m.N != want[w][0] || m.K != want[w][1]) {
                PyErr_Format(PyExc_ValueError, "decode_layers: layer %lld %s is not a packed [%lld, %lld] matrix "
                             "(kind %lld, [%lld, %lld], group %lld)", (long long)l, names[w], (long long)want[w][0],
                             (long long)want[w][1], (long long)m.kind, (long long)m.N, (long long)m.K,
                             (long long)m.group);
                return -1;
            }
            const size_t b = tmq_act_bytes(&m, S->M);
            if (b > *act_bytes) *act_bytes = b;
        }
    }
    return 0;
}

#define PTR(T, v) ((T)(uintptr_t)(v))

/* decode_layers(h, M, table, L, H, hq, hkv, d, inter, eps, scale, cos, sin, slots, bt, bt_stride,
 *               qsl, seq_lens, num_seqs, page_size, kv_kind, threads, head, norm, idx, n, logits, argmax, pos,
 *               steps, tokens, embed, stop)
 * kv_kind: TM_KV_* of the pool (attention.h); fp8 pools give each layer row its scale pointers
 * h [M, H] fp32 is updated in place through layers table[0..L). head (0: none) points at the
 * output head's MAT_FIELDS: then logits [n, head N] = head(rmsnorm(h[idx[r]]) * norm) (Head),
 * and argmax (0: not wanted) [n] int64 gets each logits row's first largest index. cos / sin are
 * the rotary rows of the M tokens [M, d], or (pos given: int64 [M]) whole tables whose row pos[t]
 * is token t's: the caller then need not gather them. steps (default 1) > 1 chains that many
 * greedy steps (Chain): then tokens [steps, M] int64 receives each step's tokens and embed points
 * at the embedding's MAT_FIELDS; it needs one row per sequence, all of them to the head, and
 * the pages of the chain's positions in the block tables; stop (optional) points at an int32 that
 * another thread may set to end the chain after its current step. Returns the steps run. */
PyObject *tmq_py_decode_layers(PyObject *self, PyObject *args) {
    unsigned long long h, table, cos, sin, slots, bt, qsl, sl, head = 0, norm = 0, idx = 0, logits = 0, argmax = 0,
                       pos = 0, tokens = 0, embed = 0, stop = 0;
    long long M, L, H, hq, hkv, d, inter, bt_stride, n_out = 0, steps = 1;
    float eps, scale;
    int num_seqs, page_size, kv_kind, nt;
    if (!PyArg_ParseTuple(args, "KLKLLLLLLffKKKKLKKiiii|KKKLKKKLKKK", &h, &M, &table, &L, &H, &hq, &hkv, &d, &inter,
                          &eps, &scale, &cos, &sin, &slots, &bt, &bt_stride, &qsl, &sl, &num_seqs, &page_size,
                          &kv_kind, &nt, &head, &norm, &idx, &n_out, &logits, &argmax, &pos, &steps, &tokens, &embed,
                          &stop))
        return NULL;
    if (M <= 0 || L < 0 || H <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 || d % 2 || inter <= 0 ||
        num_seqs <= 0 || page_size <= 0 || d > TM_ATTENTION_MAX_HEAD_DIM || hq / hkv > TM_ATTENTION_MAX_GROUP ||
        kv_kind < TM_KV_F32 || kv_kind > TM_KV_INT8T) {
        PyErr_Format(PyExc_ValueError, "decode_layers: bad sizes (M=%lld H=%lld heads %lld/%lld d=%lld inter=%lld "
                     "seqs=%d page=%d kv kind %d)", M, H, hq, hkv, d, inter, num_seqs, page_size, kv_kind);
        return NULL;
    }
    if (!g_attn) {
        g_attn = (const tm_attention_tasks *)PyCapsule_Import(TM_ATTENTION_TASKS_CAPSULE, 0);
        if (!g_attn) return NULL;
    }
    {
        const char *e = getenv("TOKENMILL_SPIN_PAUSES");   /* an A/B switch */
        g_spin = e && *e ? atoi(e) : SPIN_PAUSES;
    }
    Step S = {M, H, hq, hkv, d, inter, eps, scale, PTR(const float *, cos), PTR(const float *, sin),
              PTR(const int64_t *, pos), PTR(const int64_t *, slots), PTR(const int64_t *, bt), PTR(const int64_t *, qsl),
              PTR(const int64_t *, sl), bt_stride, num_seqs, page_size, kv_kind, nt < 1 ? 1 : nt,
              kv_prefetch_on(), env_flag("TOKENMILL_STATIC_ROWS"), env_flag("TOKENMILL_SHARED_CLAIMS"),
              env_flag("TOKENMILL_KV_PREFETCH_T0")};
    const int64_t *tab = PTR(const int64_t *, table);
    size_t act_bytes = 0;   /* room for the largest activations any matmul of the step quantizes */
    if (check_layers(tab, L, &S, &act_bytes)) return NULL;
    Head hd = {PTR(const int64_t *, head), PTR(const float *, norm), PTR(const int64_t *, idx), n_out,
               PTR(float *, logits), head ? PTR(int64_t *, argmax) : NULL, NULL};
    if (head) {
        const TmqMat w = mat_at(hd.mat);
        int bad_row = 0;
        for (int64_t r = 0; r < n_out && idx; r++) bad_row |= hd.idx[r] < 0 || hd.idx[r] >= M;
        if (!mat_ok(&w) || w.K != H || !norm || !idx || !logits || n_out <= 0 || n_out > M || bad_row) {
            PyErr_Format(PyExc_ValueError, "decode_layers: bad output head (kind %lld, [%lld, %lld]) or %lld logits "
                         "rows of %lld", (long long)w.kind, (long long)w.N, (long long)w.K, n_out, M);
            return NULL;
        }
    }
    Chain chain = {steps, PTR(int64_t *, tokens), {0}, NULL, NULL, NULL, PTR(const int32_t *, stop), 1, 1};
    if (steps != 1) {   /* a chain: one row per sequence, every row to the head, the embedding given */
        int ok = steps > 1 && head && argmax && pos && tokens && embed && n_out == M && num_seqs == M;
        for (int64_t r = 0; ok && r < M; r++) ok = hd.idx[r] == r && PTR(const int64_t *, qsl)[r] == r;
        if (ok) {
            chain.emb = mat_at(PTR(const int64_t *, embed));
            ok = chain.emb.K == H && (chain.emb.kind == TMQ_F32 ? chain.emb.qs != NULL : mat_ok(&chain.emb));
        }
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "decode_layers: %lld chained steps need one row per sequence, the head "
                         "with every row, argmax, positions, a tokens buffer and an embedding of width %lld",
                         steps, H);
            return NULL;
        }
        int64_t *own_ints = malloc(sizeof(int64_t) * (size_t)(3 * M));
        if (!own_ints) return PyErr_NoMemory();
        memcpy(own_ints, PTR(const int64_t *, pos), sizeof(int64_t) * (size_t)M);
        memcpy(own_ints + M, PTR(const int64_t *, slots), sizeof(int64_t) * (size_t)M);
        memcpy(own_ints + 2 * M, PTR(const int64_t *, sl), sizeof(int64_t) * (size_t)M);
        chain.pos = own_ints;
        chain.slots = own_ints + M;
        chain.seq_lens = own_ints + 2 * M;
        S.pos = chain.pos;
        S.slots = chain.slots;
        S.seq_lens = chain.seq_lens;
    }
    const int64_t qsz = hq * d, qn = qsz + 2 * hkv * d;
    /* shared scratch, then each thread's own (Own: h for threads 1.., x, act), cache-line aligned */
    const size_t shared = ((size_t)M * (H + qn + qsz + 2 * inter) + 15) / 16 * 16,
                 per_thread = ((size_t)M * (2 * H + inter) + 15) / 16 * 16;
    float *mem = aligned_alloc(64, (shared + (size_t)S.nt * per_thread) * sizeof(float));
    Own *own = calloc((size_t)S.nt, sizeof(Own));
    int err = 0;
    if (hd.argmax && !(hd.part = malloc((size_t)S.nt * (size_t)n_out * sizeof(ArgPart)))) err = -1;
    if (head) {
        const TmqMat w = mat_at(hd.mat);
        const size_t b = tmq_act_bytes(&w, n_out);
        if (b > act_bytes) act_bytes = b;
    }
    for (int i = 0; i < S.nt && mem && own && !err; i++) {
        float *p = mem + shared + (size_t)i * per_thread;
        own[i] = (Own){i == 0 ? PTR(float *, h) : p, p + M * H, p + 2 * M * H, tmq_act_buffer(act_bytes)};
        if (!own[i].aq) err = -1;
    }
    if (!mem || !own || err) {
        for (int i = 0; own && i < S.nt; i++) tmq_act_free(own[i].aq);
        free(own);
        free(mem);
        free(hd.part);
        free(chain.pos);
        return PyErr_NoMemory();
    }
    float *tmp = mem, *qkv = tmp + M * H, *att = qkv + M * qn, *gu = att + M * qsz;
    void *call = NULL;
    atomic_int bad;
    atomic_init(&bad, 0);
    Bufs B = {PTR(float *, h), qkv, att, tmp, gu};
    SpinBar bar;
    atomic_init(&bar.arrived, 0);
    atomic_init(&bar.gen, 0);
    atomic_init(&bar.next, 0);
    for (int c = 0; c < C_COUNT; c++) atomic_init(&bar.rows[c], 0);
    bar.n = 1;
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel num_threads(S.nt)
    run_steps_team(steps > 1 ? &chain : NULL, tab, L, &S, &B, &hd, own, &call, &err, &bad, &bar);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < S.nt; i++) tmq_act_free(own[i].aq);
    free(own);
    if (call) g_attn->finish(call);
    free(chain.pos);
    if (hd.argmax && steps == 1 && !err && !atomic_load(&bad))   /* the team's shares of each row, in thread order */
        for (int64_t r = 0; r < n_out; r++) hd.argmax[r] = argmax_join(hd.part + r, n_out, bar.n);
    free(hd.part);
    free(mem);
    if (atomic_load(&bad)) {
        PyErr_SetString(PyExc_RuntimeError, "decode_layers: an activation buffer was sized too small (a bug)");
        return NULL;
    }
    if (err == -1) return PyErr_NoMemory();
    if (err == -2) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: the attention kernel refused the head shape "
                        "(or ran out of memory)");
        return NULL;
    }
    if (err == -3 || err == -4) {
        PyErr_SetString(PyExc_ValueError, err == -3 ? "decode_layers: a chained step's token is outside the embedding"
                                                    : "decode_layers: a chained step's position is past its block table");
        return NULL;
    }
    return PyLong_FromLongLong(steps > 1 ? chain.done : 1);
}

PyObject *tmq_py_layer_fields(PyObject *self, PyObject *args) { return PyLong_FromLong(LAYER_FIELDS); }

/* fp8_quantize(src_ptr, dst_ptr, n, scale_ptr, per_token): decode_layers' fp8 KV write of one
 * vector of n float32 values into n e4m3 bytes: with the static scale *scale_ptr, or
 * (per_token) computing the vector's scale into *scale_ptr. For tests against torch. */
PyObject *tmq_py_fp8_quantize(PyObject *self, PyObject *args) {
    unsigned long long src, dst, sc;
    long long n;
    int per_token;
    if (!PyArg_ParseTuple(args, "KKLKp", &src, &dst, &n, &sc, &per_token)) return NULL;
    if (n <= 0 || !src || !dst || !sc) {
        PyErr_SetString(PyExc_ValueError, "fp8_quantize: needs n > 0 and non-null pointers");
        return NULL;
    }
    const int64_t slot = 0;
    kv_write((void *)(uintptr_t)dst, (float *)(uintptr_t)sc, (const float *)(uintptr_t)src, n, &slot, 1, 1, n,
             per_token ? TM_KV_FP8_TOKEN : TM_KV_FP8, 1, 0);
    Py_RETURN_NONE;
}

/* f16_quantize(src, dst, n): decode_layers' fp16 KV write of n floats into n halves (for tests) */
PyObject *tmq_py_f16_quantize(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    long long n;
    if (!PyArg_ParseTuple(args, "KKL", &src, &dst, &n)) return NULL;
    if (n <= 0 || !src || !dst) {
        PyErr_SetString(PyExc_ValueError, "f16_quantize: needs n > 0 and non-null pointers");
        return NULL;
    }
    const int64_t slot = 0;
    kv_write((void *)(uintptr_t)dst, NULL, (const float *)(uintptr_t)src, n, &slot, 1, 1, n, TM_KV_F16, 1, 0);
    Py_RETURN_NONE;
}

/* decode_kv_prefetch(): (this CPU's default, on for a call made now) of the fused step's KV prefetch */
PyObject *tmq_py_decode_kv_prefetch(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return Py_BuildValue("(OO)", kv_prefetch_default() ? Py_True : Py_False, kv_prefetch_on() ? Py_True : Py_False);
}

/* decode_profile(on): turn the phase timers on or off (and zero them); returns the seconds spent
 * so far per phase as a dict. */
PyObject *tmq_py_decode_profile(PyObject *self, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|i", &on)) return NULL;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int i = 0; i < P_COUNT; i++) {
        PyObject *v = PyFloat_FromDouble(g_prof_s[i]);
        if (!v || PyDict_SetItemString(d, prof_names[i], v) < 0) { Py_XDECREF(v); Py_DECREF(d); return NULL; }
        Py_DECREF(v);
    }
    if (on >= 0) {
        g_prof = on != 0;
        memset(g_prof_s, 0, sizeof g_prof_s);
    }
    return d;
}
