/* Paged attention over tokenmill's KV pool, reading pages in place.
 *
 * KV layout of one layer (the torch reference backend's layout):
 *     k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim], contiguous, float32,
 *     bfloat16, float16 (F16C's vcvtph2ps), float8_e4m3fn bytes with float32 scales (see
 *     "fp8 pages" below) or int8 codes with a float32 scale per vector; narrow elements are
 *     widened to float32 as they are read and the arithmetic is float32, except in the int8
 *     decode body on AVX-512 VNNI (see "int8 pages on AVX-512 VNNI")
 * Token at context position p of sequence i lives in page block_tables[i][p / page_size] at
 * offset p % page_size.
 *
 * A step's queries arrive concatenated: sequence i owns rows [qsl[i], qsl[i+1]) of q, which are
 * the LAST (qsl[i+1] - qsl[i]) tokens of its context of seq_lens[i] tokens. Query row r of that
 * chunk sits at position seq_lens[i] - n + r and attends to keys at positions <= its own.
 *
 * Work is cut into tasks (sequence, kv head, block of query rows, range of keys). A task runs
 * the online-softmax recurrence over its keys page by page and either writes normalised output
 * (it covers all keys its rows can see) or a partial (running max, sum, unnormalised
 * accumulator) that a merge pass combines. Long single-sequence decodes are split over keys so
 * that every thread has work (split-K, as in flash-decoding), and so are chunks of a few rows
 * (a verify step) after a long context. Decode rows (a sequence with one query row) and chunks
 * of a few rows that tiles_for keeps off the tiles take the decode bodies ("decode rows" below:
 * each K/V row read and widened once for up to 4 (AVX2: 3) query vectors of its kv head);
 * prefill chunks take the tiled path ("tiled prefill path"), which scores groups of query
 * vectors against blocks of keys as small matrix products. CPUs without the vector paths take
 * the per-row bodies, which also serve A/B checks (TOKENMILL_NO_DECODE_BODY=1,
 * TOKENMILL_NO_FEW_ROW_DECODE=1, TOKENMILL_NO_FEW_ROW_SPLIT=1, TOKENMILL_NO_PREFILL_TILES=1,
 * TOKENMILL_TILES_FOR_FEW_ROWS=1). Each query row's result depends
 * only on its own sequence, so a request gives the same bits whatever else is in the batch.
 *
 * Vector code is compiled for AVX-512 and for AVX2+FMA through function target attributes and
 * chosen at run time (TOKENMILL_NO_AVX512=1 forces the AVX2 path); a portable scalar path does
 * the same arithmetic otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attention.h"

#include <float.h>
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

#define KEY_BLOCK 32      /* keys scored at once before the softmax update */
#define MAX_QVEC TM_ATTENTION_MAX_GROUP   /* query vectors (rows x heads of one group) in one task */
#define MAX_HEAD_DIM TM_ATTENTION_MAX_HEAD_DIM
#define SPLIT_KEYS 1024  /* keys per split-K chunk of a long decode */
#ifndef DEC_MAX_ROWS
#define DEC_MAX_ROWS 16    /* chunks of up to this many rows not on tiles take the decode bodies */
#endif
#ifndef SPLIT_MAX_ROWS
#define SPLIT_MAX_ROWS 16  /* chunks of up to this many rows are split over keys too (plan_tasks) */
#endif
/* How K/V lines are asked for ahead of use: prefetcht1 (into L2). On Zen 4 a decode reading its
 * KV from DRAM took 46 ns per key and kv head with prefetcht0 and 23 ns with t1 (t2 the same;
 * docs/benchmarks.md, "A Zen 4 host"), likely because a prefetcht0 holds one of the few L1 miss
 * buffers until its line arrives. TOKENMILL_KV_PREFETCH_T0=1 asks with prefetcht0 as before (an A/B switch, read at
 * each call like the kernel switches below). */
static int g_kv_pf_t0;
static inline void kv_prefetch(const char *p) {
    if (g_kv_pf_t0) __builtin_prefetch(p, 0, 3);
    else __builtin_prefetch(p, 0, 2);
}
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4 /* key blocks requested ahead of use (see prefetch_keys) */
#endif

typedef struct {
    int seq;        /* sequence index */
    int kvh;        /* kv head */
    int r0, r1;     /* query rows of the sequence's chunk, [r0, r1) */
    int k0, k1;     /* keys [k0, k1) */
    int part;       /* -1: writes output directly; else index of its partial slot */
    int joins;      /* 1: runs in the previous task's job (see make_plan) */
} Task;

typedef struct {
    const float *q;  int64_t q_stride;   /* q[t, h, d] = q[t*q_stride + h*D + d] */
    float *out;                          /* out[t, h*D + d] */
    const void *kc, *vc;                 /* caches, of kind (TM_KV_*) */
    int kind;
    const float *ks, *vs;                /* fp8 scales (see attention.h) */
    const int64_t *bt; int64_t bt_stride;
    const int64_t *qsl, *seq_lens;
    int page_size, hq, hkv, d, group;
    float scale;
} Problem;

/* fp8 pages (TM_KV_FP8, TM_KV_FP8_TOKEN): a byte b holds a float8_e4m3fn value e (1 sign, 4
 * exponent bits of bias 7, 3 mantissa bits; no infinities, 0x7F / 0xFF are NaN and never
 * stored), and the element is e * scale. The vector paths widen 8 or 16 bytes at once without a
 * table: ((b & 0x80) << 8) | ((b & 0x7F) << 7) is the float16 whose value is exactly e * 2^-8
 * (computed as (sign-extended b << 7) & 0xBFFF: the shift puts the sign in bits 15 and 14)
 * (float16 has the same 3 leading mantissa bits and an exponent bias of 15 = 7 + 8, normals and
 * subnormals alike), and F16C's vcvtph2ps turns it into float32. The 2^8 is folded into the
 * scales. In the decode bodies the scales stay out of the inner loops: K's goes into the query
 * (a static scale: once per task) or onto each key's score (a scale per token), V's into the
 * softmax weight of each key (per token) or onto the output (static); the per-row bodies and the
 * tiled path widen a block's rows times their scales into a float32 copy. The AVX-512 decode
 * body widens 64 bytes at once by table instead (fp8x64). */
static float g_e4m3[256];   /* e4m3 byte -> value, for the scalar paths (filled at module load) */
/* bytes 3 and 2 of the float32 of the e4m3 value of (b & 0x7F) (bytes 1 and 0 are zero for every
 * e4m3 value): the tables the AVX-512 decode widening looks up (see "decode rows") */
static uint8_t g_e4m3_b3[128], g_e4m3_b2[128];

static void init_e4m3_table(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 0xF, m = b & 7;
        float v = (b & 0x7F) == 0x7F ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
        g_e4m3[b] = (b & 0x80) ? -v : v;
    }
    for (int b = 0; b < 128; b++) {
        uint32_t u;
        memcpy(&u, &g_e4m3[b], 4);
        g_e4m3_b3[b] = (uint8_t)(u >> 24);
        g_e4m3_b2[b] = (uint8_t)(u >> 16);
    }
}

static inline size_t kv_esz(int kind) { return kind == TM_KV_F32 ? 4 : kind == TM_KV_BF16 || kind == TM_KV_F16 ? 2 : 1; }

/* the fp8 / int8 scale of the K (which = 0) or V (1) row at element offset off (kv head kvh); else 1 */
static inline float row_scale(const Problem *P, int which, int64_t off, int kvh) {
    const float *sc = which ? P->vs : P->ks;
    if (P->kind == TM_KV_FP8) return sc[kvh];
    if (TM_KV_TOKEN_SCALES(P->kind)) return sc[off / P->d];
    return 1.f;
}

/* Ask for the K and V rows of keys [j0, j1) of one kv head ahead of use. Pages are scattered
 * and one head's row is a short piece of each page row, so the hardware prefetchers miss them:
 * without this a long decode reading its context from DRAM waits on memory latency key by key
 * (measured: 3 GB/s at a 2,048-token context over 30 layers, against 34 GB/s from cache). */
/* Element offsets of keys [j0, j1) of kv head kvh (the same for K and V): walked page by page,
 * so the page size's division is paid once per call, not once per key (two integer divisions
 * per key cost more than the key's arithmetic: the decode path ran at 170 cycles per key). */
static inline void key_offsets(const Problem *P, const int64_t *table, int kvh, int j0, int j1, int64_t *off) {
    const int ps = P->page_size;
    const int64_t row = (int64_t)P->hkv * P->d, head = (int64_t)kvh * P->d;
    int64_t page = j0 / ps;
    int slot = j0 % ps;
    const int n = j1 - j0;
    for (int j = 0; j < n; slot = 0) {   /* a page's run of keys at a time (the inner loop vectorises) */
        const int64_t base = table[page++] * ps * row + head;
        const int cnt = ps - slot < n - j ? ps - slot : n - j;
        for (int s = 0; s < cnt; s++) off[j + s] = base + (int64_t)(slot + s) * row;
        j += cnt;
    }
}

static inline void prefetch_keys(const Problem *P, const int64_t *table, int kvh, int j0, int j1, size_t esz) {
    const size_t bytes = (size_t)P->d * esz;
    int64_t offs[KEY_BLOCK];
    for (int b0 = j0; b0 < j1; b0 += KEY_BLOCK) {
      const int b1 = b0 + KEY_BLOCK < j1 ? b0 + KEY_BLOCK : j1;
      key_offsets(P, table, kvh, b0, b1, offs);
      for (int j = b0; j < b1; j++) {
        const int64_t off = offs[j - b0];
        const char *k = (const char *)P->kc + off * esz, *v = (const char *)P->vc + off * esz;
        for (size_t c = 0; c < bytes; c += 64) {
            kv_prefetch(k + c);
            kv_prefetch(v + c);
        }
      }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* scalar path                                                                              */

static inline float kv_at(const void *base, int64_t i, int kind) {
    if (kind == TM_KV_F32) return ((const float *)base)[i];
    if (kind == TM_KV_F16) return tm_f16_to_float(((const uint16_t *)base)[i]);
    if (kind == TM_KV_INT8) return (float)((const int8_t *)base)[i];
    if (kind != TM_KV_BF16) return g_e4m3[((const uint8_t *)base)[i]];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void task_scalar(const Problem *P, const Task *T, float *part_m, float *part_l, float *part_acc) {
    const int D = P->d, G = P->group, ps = P->page_size;
    const int64_t q0 = P->qsl[T->seq], n = P->qsl[T->seq + 1] - q0, L = P->seq_lens[T->seq];
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const int nrow = T->r1 - T->r0, nq = nrow * G;
    float qv[MAX_QVEC * 8];   /* only used when D*nq is small; else heap */
    float *qs = (nq * D <= (int)(sizeof(qv) / sizeof(float))) ? qv : malloc(sizeof(float) * nq * D);
    float *acc = calloc((size_t)nq * D, sizeof(float));
    float m[MAX_QVEC], l[MAX_QVEC], s[KEY_BLOCK];
    for (int r = 0; r < nrow; r++)
        for (int g = 0; g < G; g++) {
            const float *src = P->q + (q0 + T->r0 + r) * P->q_stride + (int64_t)(T->kvh * G + g) * D;
            for (int x = 0; x < D; x++) qs[(r * G + g) * D + x] = src[x] * P->scale;
            m[r * G + g] = -INFINITY; l[r * G + g] = 0.f;
        }
    for (int j0 = T->k0; j0 < T->k1; j0 += KEY_BLOCK) {
        int j1 = j0 + KEY_BLOCK < T->k1 ? j0 + KEY_BLOCK : T->k1;
        for (int r = 0; r < nrow; r++) {
            int64_t pos = L - n + T->r0 + r;      /* keys <= pos are visible */
            int jend = (int)(pos + 1 < j1 ? pos + 1 : j1);
            if (jend <= j0) continue;
            for (int g = 0; g < G; g++) {
                int v = r * G + g;
                const float *qq = qs + v * D;
                float bm = -INFINITY;
                for (int j = j0; j < jend; j++) {
                    int64_t ko = ((table[j / ps] * ps + j % ps) * P->hkv + T->kvh) * D;
                    float dot = 0.f;
                    for (int x = 0; x < D; x++) dot += qq[x] * kv_at(P->kc, ko + x, P->kind);
                    dot *= row_scale(P, 0, ko, T->kvh);
                    s[j - j0] = dot;
                    if (dot > bm) bm = dot;
                }
                float mn = m[v] > bm ? m[v] : bm;
                float alpha = expf(m[v] - mn);
                float *a = acc + v * D;
                for (int x = 0; x < D; x++) a[x] *= alpha;
                float sum = 0.f;
                for (int j = j0; j < jend; j++) {
                    float p = expf(s[j - j0] - mn);
                    sum += p;
                    int64_t vo = ((table[j / ps] * ps + j % ps) * P->hkv + T->kvh) * D;
                    const float pv = p * row_scale(P, 1, vo, T->kvh);
                    for (int x = 0; x < D; x++) a[x] += pv * kv_at(P->vc, vo + x, P->kind);
                }
                l[v] = l[v] * alpha + sum;
                m[v] = mn;
            }
        }
    }
    for (int r = 0; r < nrow; r++)
        for (int g = 0; g < G; g++) {
            int v = r * G + g;
            if (T->part < 0) {
                float *dst = P->out + (q0 + T->r0 + r) * (int64_t)P->hq * D + (int64_t)(T->kvh * G + g) * D;
                float inv = l[v] > 0.f ? 1.f / l[v] : 0.f;
                for (int x = 0; x < D; x++) dst[x] = acc[v * D + x] * inv;
            } else {
                part_m[v] = m[v]; part_l[v] = l[v];
                memcpy(part_acc + (size_t)v * D, acc + (size_t)v * D, sizeof(float) * D);
            }
        }
    free(acc);
    if (qs != qv) free(qs);
}

/* ---------------------------------------------------------------------------------------- */
/* tiled prefill path                                                                       */
/*
 * A task of a prefill chunk holds nq = rows x G query vectors (its block of rows times the G
 * query heads that share its kv head), and all of them read the same keys. The per-row path
 * above scores one query vector at a time and so loads each K/V row once per query vector;
 * here the vectors are cut into groups of QW and each group meets a block of TILE_KEYS keys at
 * once, like a small GEMM:
 *   - the group's queries are kept transposed, qt[x][i] = dim x of query vector i, so that one
 *     broadcast of k_j[x] (read from the page in place) feeds an FMA over a register of queries:
 *     s[j][i] = sum_x k_j[x] qt[x][i], each K element loaded once per group instead of once
 *     per query vector, with no horizontal sums;
 *   - the online softmax is then lane-wise: a lane is one query vector with its own running max
 *     and sum, and the causal mask is a lane compare that only blocks crossing the diagonal pay;
 *   - the output stays transposed too, acc[x][i] += v_j[x] * p[j][i], one broadcast of v_j[x]
 *     per register of queries.
 * Blocks that lie wholly after a group's last query are skipped. bf16 and fp8 pages are
 * widened into a float32 copy of the block (fp8: times its scale, so the copy holds exactly the
 * dequantized values) (TILE_KEYS rows, reused by every group); float32 pages are read
 * where they are. A row's result depends only on its own sequence's rows and keys.
 */
#define TILE_KEYS 32        /* keys of one block (a multiple of every kernel's key step) */
#ifndef TILE_TASK_FLOATS
#define TILE_TASK_FLOATS 49152  /* query floats (rows x group x head_dim) of one prefill task */
#endif
#ifndef TILE_PREFETCH
#define TILE_PREFETCH 1     /* blocks of K/V rows requested ahead of use */
#endif

typedef struct {
    const float *qt;                    /* [D][qw] the group's scaled queries, transposed */
    float *acc;                         /* [D][qw] unnormalised output, transposed */
    float *m, *l;                       /* [qw] running max and sum */
    const float *qpos;                  /* [qw] each query's context position */
    const float *const *kp, *const *vp; /* [TILE_KEYS] float32 K and V rows of the block */
    float *s;                           /* [TILE_KEYS][qw] scratch: scores, then probabilities */
    int nk;                             /* keys to score: a multiple of the kernel's key step */
    int nvalid;                         /* keys [nvalid, nk) are padding (zero rows), masked */
    int j0;                             /* context position of the block's first key */
    int d;
    int masked;                         /* some key of [0, nk) is invisible to some query */
} TileArgs;

typedef void (*tile_fn)(const TileArgs *A);
typedef void (*widen_fn)(float *dst, const uint16_t *src, int n);
typedef void (*widen8_fn)(float *dst, const uint8_t *src, int n, float scale);  /* fp8 (int8) bytes * scale */

typedef struct {
    tile_fn tile;
    widen_fn widen;      /* bf16 */
    widen_fn widenh;     /* fp16 */
    widen8_fn widen8;
    widen8_fn widen8i;   /* int8 */
    int qw;      /* query vectors per group */
    int kstep;   /* the kernel scores keys in steps of this many */
} TileKernel;

static void widen_scalar(float *dst, const uint16_t *src, int n) {
    for (int x = 0; x < n; x++) {
        uint32_t u = (uint32_t)src[x] << 16;
        memcpy(dst + x, &u, sizeof u);
    }
}

static void widenh_scalar(float *dst, const uint16_t *src, int n) {
    for (int x = 0; x < n; x++) dst[x] = tm_f16_to_float(src[x]);
}

static void widen8_scalar(float *dst, const uint8_t *src, int n, float scale) {
    for (int x = 0; x < n; x++) dst[x] = g_e4m3[src[x]] * scale;
}

static void widen8i_scalar(float *dst, const uint8_t *src, int n, float scale) {
    for (int x = 0; x < n; x++) dst[x] = (float)(int8_t)src[x] * scale;
}

#define SCALAR_QW 8

/* The portable tile (the compiler vectorises the inner loops over the group's lanes). */
static void tile_scalar(const TileArgs *A) {
    enum { QW = SCALAR_QW };
    const int D = A->d, nk = A->nk;
    float *s = A->s;
    for (int j = 0; j < nk; j++) {
        const float *k = A->kp[j];
        float a[QW] = {0};
        for (int x = 0; x < D; x++)
            for (int i = 0; i < QW; i++) a[i] += k[x] * A->qt[x * QW + i];
        for (int i = 0; i < QW; i++)
            s[j * QW + i] = j >= A->nvalid || (A->masked && (float)(A->j0 + j) > A->qpos[i]) ? -INFINITY : a[i];
    }
    float alpha[QW];
    for (int i = 0; i < QW; i++) {
        float bm = -INFINITY;
        for (int j = 0; j < nk; j++) bm = s[j * QW + i] > bm ? s[j * QW + i] : bm;
        float mn = A->m[i] > bm ? A->m[i] : bm;
        float safe = mn == -INFINITY ? 0.f : mn;   /* no visible key yet: everything stays 0 */
        alpha[i] = expf(A->m[i] - safe);
        float sum = 0.f;
        for (int j = 0; j < nk; j++) { float p = expf(s[j * QW + i] - safe); s[j * QW + i] = p; sum += p; }
        A->l[i] = A->l[i] * alpha[i] + sum;
        A->m[i] = mn;
    }
    for (int x = 0; x < D; x++) {
        float *o = A->acc + x * QW;
        for (int i = 0; i < QW; i++) o[i] *= alpha[i];
        for (int j = 0; j < nk; j++) {
            float vx = A->vp[j][x];
            for (int i = 0; i < QW; i++) o[i] += vx * s[j * QW + i];
        }
    }
}

static void *alloc64(size_t floats) {
    size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* The codes of one K (which = 0) or V row of kv head h at (page, slot) of tiled int8 pages, in
 * dim order (K's bias taken off), and the row's scale. */
static float i8t_row(const Problem *P, int which, int64_t page, int64_t slot, int h, int8_t *out) {
    const int64_t D = P->d, ps = P->page_size, tile = (page * P->hkv + h) * ps * D;
    if (which) {
        const int8_t *base = (const int8_t *)P->vc;
        for (int64_t d = 0; d < D; d++) out[d] = base[tm_i8t_v_at(tile, D, slot, d)];
        return P->vs[(page * P->hkv + h) * ps + slot];
    }
    const uint8_t *base = (const uint8_t *)P->kc;
    for (int64_t d = 0; d < D; d++) out[d] = (int8_t)((int)base[tm_i8t_k_at(tile, ps, slot, d)] - 128);
    return P->ks[(page * P->hkv + h) * ps + slot];
}

static void task_tiled(const Problem *P, const Task *T, float *part_m, float *part_l, float *part_acc,
                       const TileKernel *K) {
    const int D = P->d, G = P->group, qw = K->qw;
    const int64_t q0 = P->qsl[T->seq], n = P->qsl[T->seq + 1] - q0, L = P->seq_lens[T->seq];
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const int nq = (T->r1 - T->r0) * G, ngrp = (nq + qw - 1) / qw, nqp = ngrp * qw;
    const size_t esz = kv_esz(P->kind);
    const int narrow = P->kind != TM_KV_F32;
    float *qt = alloc64((size_t)nqp * D), *acc = alloc64((size_t)nqp * D);
    float *m = alloc64(nqp), *l = alloc64(nqp), *qpos = alloc64(nqp);
    float *s = alloc64((size_t)TILE_KEYS * qw);
    /* a zero row for padding keys, then (bf16, fp8) the widened K and V rows of the block */
    float *kv = alloc64((size_t)D * (1 + (narrow ? 2 * TILE_KEYS : 0)));
    const float *kp[TILE_KEYS], *vp[TILE_KEYS];
    memset(acc, 0, sizeof(float) * (size_t)nqp * D);
    memset(kv, 0, sizeof(float) * D);
    /* pad vectors (nq .. nqp) have zero queries and the last row's position: their lanes are
     * computed and dropped, and they never widen a group's key range */
    for (int v = 0; v < nqp; v++) {
        int vv = v < nq ? v : nq - 1, r = vv / G, g = vv % G;
        float *dst = qt + (size_t)(v / qw) * D * qw + v % qw;
        const float *src = P->q + (q0 + T->r0 + r) * P->q_stride + (int64_t)(T->kvh * G + g) * D;
        for (int x = 0; x < D; x++) dst[(size_t)x * qw] = v < nq ? src[x] * P->scale : 0.f;
        qpos[v] = (float)(L - n + T->r0 + r);
        m[v] = -INFINITY;
        l[v] = 0.f;
    }
    for (int j0 = T->k0; j0 < T->k1; j0 += TILE_KEYS) {
        const int nk = T->k1 - j0 < TILE_KEYS ? T->k1 - j0 : TILE_KEYS;
        int64_t offs[TILE_KEYS];
        key_offsets(P, table, T->kvh, j0, j0 + nk, offs);
        for (int j = 0; j < nk; j++) {
            const int64_t off = offs[j];
            if (narrow) {
                float *kr = kv + (size_t)(1 + j) * D, *vr = kv + (size_t)(1 + TILE_KEYS + j) * D;
                if (P->kind == TM_KV_BF16) {
                    K->widen(kr, (const uint16_t *)P->kc + off, D);
                    K->widen(vr, (const uint16_t *)P->vc + off, D);
                } else if (P->kind == TM_KV_F16) {
                    K->widenh(kr, (const uint16_t *)P->kc + off, D);
                    K->widenh(vr, (const uint16_t *)P->vc + off, D);
                } else if (P->kind == TM_KV_INT8T) {   /* a tiled row, gathered (a prefill reads it once per task) */
                    int8_t rk[MAX_HEAD_DIM], rv[MAX_HEAD_DIM];
                    const int64_t a = j0 + j, page = table[a / P->page_size], slot = a % P->page_size;
                    const float sk = i8t_row(P, 0, page, slot, T->kvh, rk), sv = i8t_row(P, 1, page, slot, T->kvh, rv);
                    K->widen8i(kr, (const uint8_t *)rk, D, sk);
                    K->widen8i(vr, (const uint8_t *)rv, D, sv);
                } else {
                    const widen8_fn w8 = P->kind == TM_KV_INT8 ? K->widen8i : K->widen8;
                    w8(kr, (const uint8_t *)P->kc + off, D, row_scale(P, 0, off, T->kvh));
                    w8(vr, (const uint8_t *)P->vc + off, D, row_scale(P, 1, off, T->kvh));
                }
                kp[j] = kr; vp[j] = vr;
            } else {
                kp[j] = (const float *)P->kc + off;
                vp[j] = (const float *)P->vc + off;
            }
        }
        for (int j = nk; j < TILE_KEYS; j++) kp[j] = vp[j] = kv;
        {   /* the block TILE_PREFETCH ahead, while this one is computed (the first call asks
             * for all the blocks up to it) */
            int64_t pa = j0 == T->k0 ? j0 + TILE_KEYS : j0 + (int64_t)TILE_PREFETCH * TILE_KEYS;
            int64_t pb = j0 + (int64_t)(TILE_PREFETCH + 1) * TILE_KEYS;
            if (pb > T->k1) pb = T->k1;
            if (pa < pb && P->kind != TM_KV_INT8T) prefetch_keys(P, table, T->kvh, (int)pa, (int)pb, esz);
        }
        for (int g = 0; g < ngrp; g++) {
            const float pmin = qpos[g * qw], pmax = qpos[g * qw + qw - 1];
            if (pmax < (float)j0) continue;   /* the whole block lies after the group's queries */
            int vis = pmax + 1.f - (float)j0 < (float)nk ? (int)(pmax + 1.f - (float)j0) : nk;
            int nks = (vis + K->kstep - 1) / K->kstep * K->kstep;
            TileArgs A = {qt + (size_t)g * D * qw, acc + (size_t)g * D * qw, m + g * qw, l + g * qw, qpos + g * qw,
                          kp, vp, s, nks, vis, j0, D, pmin < (float)(j0 + nks - 1)};
            K->tile(&A);
        }
    }
    for (int v = 0; v < nq; v++) {
        const int r = v / G, g = v % G;
        const float *a = acc + (size_t)(v / qw) * D * qw + v % qw;
        if (T->part < 0) {
            float *dst = P->out + (q0 + T->r0 + r) * (int64_t)P->hq * D + (int64_t)(T->kvh * G + g) * D;
            float inv = l[v] > 0.f ? 1.f / l[v] : 0.f;
            for (int x = 0; x < D; x++) dst[x] = a[(size_t)x * qw] * inv;
        } else {
            part_m[v] = m[v]; part_l[v] = l[v];
            for (int x = 0; x < D; x++) part_acc[(size_t)v * D + x] = a[(size_t)x * qw];
        }
    }
    free(qt); free(acc); free(m); free(l); free(qpos); free(s); free(kv);
}

static const TileKernel tile_kernel_scalar = {tile_scalar, widen_scalar, widenh_scalar, widen8_scalar, widen8i_scalar,
                                              SCALAR_QW, 1};

/* ---------------------------------------------------------------------------------------- */
/* AVX2 + FMA path                                                                          */

#if TM_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* exp(x) for x <= 0 (and -inf -> 0): range reduction by ln 2 and a degree-6 polynomial. */
AVX2 static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 neg_inf_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, ln2_hi, x);
    x = _mm256_fnmadd_ps(fx, ln2_lo, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    __m256 x2 = _mm256_mul_ps(x, x);
    y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(neg_inf_mask, y);
}

AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Four horizontal sums at once -> [a, b, c, d]. */
AVX2 static inline __m128 hsum4x256(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* Eight fp8 bytes as float32 values times 2^-8 (see "fp8 pages"). */
AVX2 static inline __attribute__((always_inline)) __m256 fp8x8(const void *p) {
    /* b sign-extended to 16 bits and shifted left by 7 has the sign in bits 15 and 14 and the 7
     * other bits in 13..7: clearing bit 14 leaves the float16 */
    __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xBFFF)));
}

/* Eight int8 bytes as float32 values */
AVX2 static inline __attribute__((always_inline)) __m256 i8x8(const void *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Eight cache elements at p (an element pointer of the cache's kind) as float32 (fp8: times 2^-8). */
AVX2 static inline __attribute__((always_inline)) __m256 ld8(const void *p, int kind) {
    if (kind == TM_KV_F32) return _mm256_loadu_ps((const float *)p);
    if (kind == TM_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (kind == TM_KV_INT8) return i8x8(p);
    if (kind != TM_KV_BF16) return fp8x8(p);
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* o[g] = o[g] * alpha[g] + sum_u p[g][u] * v_u for GC query vectors, XC vectors of D at a time:
 * each V row is loaded once for the group, and GC x XC independent accumulators hide the
 * multiply-add latency (one vector's chain of nk dependent steps bound the decode path). Per
 * vector and lane these are the operations of one vector alone, in the same order. */
#define VACC_AVX2(GC, XC) do { \
    for (int x0 = 0; x0 < DW; x0 += (XC)) { \
        __m256 o[GC][XC]; \
        for (int g = 0; g < (GC); g++) { \
            __m256 va = _mm256_set1_ps(alpha[g]); \
            for (int x = 0; x < (XC); x++) o[g][x] = _mm256_mul_ps(_mm256_load_ps(acc + g * D + (x0 + x) * 8), va); \
        } \
        for (int u = 0; u < nk; u++) { \
            __m256 pu[GC]; \
            for (int g = 0; g < (GC); g++) pu[g] = _mm256_set1_ps(p[g * pst + u]); \
            const char *vv = vp[u] + (size_t)x0 * 8 * esz; \
            for (int x = 0; x < (XC); x++) { \
                __m256 vx = ld8(vv + (size_t)x * 8 * esz, kind); \
                for (int g = 0; g < (GC); g++) o[g][x] = _mm256_fmadd_ps(pu[g], vx, o[g][x]); \
            } \
        } \
        for (int g = 0; g < (GC); g++) \
            for (int x = 0; x < (XC); x++) _mm256_store_ps(acc + g * D + (x0 + x) * 8, o[g][x]); \
    } \
} while (0)

AVX2 static inline __attribute__((always_inline)) void vaccum_avx2(float *acc, const float *p, const float *alpha,
                                                                const char *const *vp, int nk, int G, int D, const int kind,
                                                                const int pst) {
    const size_t esz = kv_esz(kind);   /* p: a row of pst weights per query vector */
    const int DW = D / 8;
    const int xc = DW % 4 == 0 ? 4 : DW % 2 == 0 ? 2 : 1;
    for (int g0 = 0; g0 < G; g0 += 2, acc += (size_t)2 * D, p += 2 * pst, alpha += 2) {
        const int gc = G - g0 < 2 ? G - g0 : 2;
        switch (gc * 8 + xc) {
        case 9: VACC_AVX2(1, 1); break;
        case 10: VACC_AVX2(1, 2); break;
        case 12: VACC_AVX2(1, 4); break;
        case 17: VACC_AVX2(2, 1); break;
        case 18: VACC_AVX2(2, 2); break;
        case 20: VACC_AVX2(2, 4); break;
        }
    }
}
#undef VACC_AVX2

/* D is a multiple of 8 on this path. kind is a compile-time constant in each caller below, so
 * the compiler makes one specialised copy per cache kind. */
AVX2 static inline __attribute__((always_inline)) void task_avx2_body(const Problem *P, const Task *T, float *part_m,
                                                                      float *part_l, float *part_acc, const int kind) {
    const size_t esz = kv_esz(kind);
    const int D = P->d, G = P->group;
    const int64_t q0 = P->qsl[T->seq], n = P->qsl[T->seq + 1] - q0, L = P->seq_lens[T->seq];
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const int nrow = T->r1 - T->r0, nq = nrow * G;
    float *qs = aligned_alloc(32, sizeof(float) * ((size_t)nq * D + 8));
    float *acc = aligned_alloc(32, sizeof(float) * ((size_t)nq * D + 8));
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    float m[MAX_QVEC], l[MAX_QVEC];
    /* the block's scores, then weights: a row of KEY_BLOCK per query vector of the row */
    float *sb = aligned_alloc(64, sizeof(float) * (size_t)G * KEY_BLOCK);
    float alph[MAX_QVEC];
    const char *kp[KEY_BLOCK], *vp[KEY_BLOCK];   /* element pointers (byte addressed) */
    /* fp8 / int8 pages: each block's K and V rows are widened once (times their scales) into wbuf
     * and read from there as float32 by every query vector of the task */
    const int wide = TM_KV_SCALED(kind);
    const float wf = kind == TM_KV_INT8 ? 1.f : 256.f;   /* fp8x8 / fp8x16 give e * 2^-8 */
    const int lk = wide ? TM_KV_F32 : kind;           /* the kind the inner loops read */
    const size_t lesz = wide ? 4 : esz;
    float *wbuf = wide ? aligned_alloc(64, sizeof(float) * 2 * KEY_BLOCK * (size_t)D) : NULL;
    const __m256 vscale = _mm256_set1_ps(P->scale);
    for (int r = 0; r < nrow; r++)
        for (int g = 0; g < G; g++) {
            const float *src = P->q + (q0 + T->r0 + r) * P->q_stride + (int64_t)(T->kvh * G + g) * D;
            float *dst = qs + (r * G + g) * D;
            for (int x = 0; x < D; x += 8) _mm256_store_ps(dst + x, _mm256_mul_ps(_mm256_loadu_ps(src + x), vscale));
            m[r * G + g] = -INFINITY; l[r * G + g] = 0.f;
        }
    for (int j0 = T->k0; j0 < T->k1; j0 += KEY_BLOCK) {
        int j1 = j0 + KEY_BLOCK < T->k1 ? j0 + KEY_BLOCK : T->k1;
        {
            int64_t offs[KEY_BLOCK];
            key_offsets(P, table, T->kvh, j0, j1, offs);
            for (int j = j0; j < j1; j++) {
                kp[j - j0] = (const char *)P->kc + offs[j - j0] * esz;
                vp[j - j0] = (const char *)P->vc + offs[j - j0] * esz;
            }
            if (wide)   /* a per-token scale sits at slot * hkv + head = offset / D */
                for (int j = 0; j < j1 - j0; j++) {
                    float *kr = wbuf + (size_t)j * D, *vr = wbuf + (size_t)(KEY_BLOCK + j) * D;
                    const int64_t si = kind == TM_KV_FP8 ? T->kvh : offs[j] / D;
                    const __m256 mk = _mm256_set1_ps(wf * P->ks[si]), mv = _mm256_set1_ps(wf * P->vs[si]);
                    for (int x = 0; x < D; x += 8) {
                        _mm256_store_ps(kr + x, _mm256_mul_ps(kind == TM_KV_INT8 ? i8x8(kp[j] + x) : fp8x8(kp[j] + x), mk));
                        _mm256_store_ps(vr + x, _mm256_mul_ps(kind == TM_KV_INT8 ? i8x8(vp[j] + x) : fp8x8(vp[j] + x), mv));
                    }
                    kp[j] = (const char *)kr;
                    vp[j] = (const char *)vr;
                }
        }
        if (j0 == T->k0)  /* the blocks PREFETCH_BLOCKS ahead are requested as each block starts */
            prefetch_keys(P, table, T->kvh, j1, j1 + (PREFETCH_BLOCKS - 1) * KEY_BLOCK < T->k1 ? j1 + (PREFETCH_BLOCKS - 1) * KEY_BLOCK : T->k1, esz);
        {
            int64_t pa = (int64_t)j0 + PREFETCH_BLOCKS * KEY_BLOCK, pb = pa + KEY_BLOCK;
            if (pa < T->k1) prefetch_keys(P, table, T->kvh, (int)pa, (int)(pb < T->k1 ? pb : T->k1), esz);
        }
        for (int r = 0; r < nrow; r++) {
            int64_t pos = L - n + T->r0 + r;
            int nk = (int)((pos + 1 < j1 ? pos + 1 : j1) - j0);
            if (nk <= 0) continue;
            for (int g = 0; g < G; g++) {
                int v = r * G + g;
                float *s = sb + g * KEY_BLOCK;
                const float *qq = qs + v * D;
                /* scores, four keys at a time */
                int j = 0;
                for (; j + 4 <= nk; j += 4) {
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int x = 0; x < D; x += 8) {
                        __m256 qx = _mm256_load_ps(qq + x);
                        a0 = _mm256_fmadd_ps(qx, ld8(kp[j] + x * lesz, lk), a0);
                        a1 = _mm256_fmadd_ps(qx, ld8(kp[j + 1] + x * lesz, lk), a1);
                        a2 = _mm256_fmadd_ps(qx, ld8(kp[j + 2] + x * lesz, lk), a2);
                        a3 = _mm256_fmadd_ps(qx, ld8(kp[j + 3] + x * lesz, lk), a3);
                    }
                    _mm_storeu_ps(s + j, hsum4x256(a0, a1, a2, a3));
                }
                for (; j < nk; j++) {
                    __m256 a0 = _mm256_setzero_ps();
                    for (int x = 0; x < D; x += 8)
                        a0 = _mm256_fmadd_ps(_mm256_load_ps(qq + x), ld8(kp[j] + x * lesz, lk), a0);
                    s[j] = hsum256(a0);
                }
                float bm;
                {   /* the block's max, a vector at a time (a scalar chain of dependent max ops
                     * cost about 4 cycles per key and query vector) */
                    __m256 mx = _mm256_set1_ps(-INFINITY);
                    int t = 0;
                    for (; t + 8 <= nk; t += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(s + t));
                    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
                    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                    h = _mm_max_ss(h, _mm_movehdup_ps(h));
                    bm = _mm_cvtss_f32(h);
                    for (; t < nk; t++) bm = s[t] > bm ? s[t] : bm;
                }
                float mn = m[v] > bm ? m[v] : bm;
                float alpha = expf(m[v] - mn);
                /* p = exp(s - mn), eight at a time */
                __m256 vmn = _mm256_set1_ps(mn), vsum = _mm256_setzero_ps();
                int t = 0;
                for (; t + 8 <= nk; t += 8) {
                    __m256 p = exp256(_mm256_sub_ps(_mm256_load_ps(s + t), vmn));
                    _mm256_store_ps(s + t, p);
                    vsum = _mm256_add_ps(vsum, p);
                }
                float sum = hsum256(vsum);
                for (; t < nk; t++) { s[t] = expf(s[t] - mn); sum += s[t]; }
                l[v] = l[v] * alpha + sum;
                m[v] = mn;
                alph[g] = alpha;
            }
            vaccum_avx2(acc + (size_t)r * G * D, sb, alph, vp, nk, G, D, lk, KEY_BLOCK);
        }
    }
    for (int r = 0; r < nrow; r++)
        for (int g = 0; g < G; g++) {
            int v = r * G + g;
            if (T->part < 0) {
                float *dst = P->out + (q0 + T->r0 + r) * (int64_t)P->hq * D + (int64_t)(T->kvh * G + g) * D;
                __m256 inv = _mm256_set1_ps(l[v] > 0.f ? 1.f / l[v] : 0.f);
                for (int x = 0; x < D; x += 8) _mm256_storeu_ps(dst + x, _mm256_mul_ps(_mm256_load_ps(acc + v * D + x), inv));
            } else {
                part_m[v] = m[v]; part_l[v] = l[v];
                memcpy(part_acc + (size_t)v * D, acc + (size_t)v * D, sizeof(float) * D);
            }
        }
    free(sb);
    free(acc);
    free(qs);
    free(wbuf);
}

AVX2 static void task_avx2_f32(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx2_body(P, T, m, l, a, 0);
}

AVX2 static void task_avx2_bf16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx2_body(P, T, m, l, a, TM_KV_BF16);
}

AVX2 static void task_avx2_f16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx2_body(P, T, m, l, a, TM_KV_F16);
}

AVX2 static void task_avx2_fp8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx2_body(P, T, m, l, a, TM_KV_FP8);
}

AVX2 static void task_avx2_fp8_token(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx2_body(P, T, m, l, a, TM_KV_FP8_TOKEN);
}

AVX2 static void task_avx2_int8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx2_body(P, T, m, l, a, TM_KV_INT8);
}

/* The tile with 8-wide vectors: groups of 16 query vectors (two registers), keys scored four
 * at a time (8 accumulators), the output updated four dims at a time (8 accumulators). */
#define AVX2_QW 16

AVX2 static void tile_avx2(const TileArgs *A) {
    const int D = A->d, nk = A->nk;
    const float *qt = A->qt;
    float *s = A->s;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256 qp0 = _mm256_loadu_ps(A->qpos), qp1 = _mm256_loadu_ps(A->qpos + 8);
    for (int jb = 0; jb < nk; jb += 4) {
        const float *k0 = A->kp[jb], *k1 = A->kp[jb + 1], *k2 = A->kp[jb + 2], *k3 = A->kp[jb + 3];
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        for (int x = 0; x < D; x++) {
            __m256 q0 = _mm256_load_ps(qt + x * 16), q1 = _mm256_load_ps(qt + x * 16 + 8), b;
            b = _mm256_broadcast_ss(k0 + x); a00 = _mm256_fmadd_ps(b, q0, a00); a01 = _mm256_fmadd_ps(b, q1, a01);
            b = _mm256_broadcast_ss(k1 + x); a10 = _mm256_fmadd_ps(b, q0, a10); a11 = _mm256_fmadd_ps(b, q1, a11);
            b = _mm256_broadcast_ss(k2 + x); a20 = _mm256_fmadd_ps(b, q0, a20); a21 = _mm256_fmadd_ps(b, q1, a21);
            b = _mm256_broadcast_ss(k3 + x); a30 = _mm256_fmadd_ps(b, q0, a30); a31 = _mm256_fmadd_ps(b, q1, a31);
        }
        __m256 a[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
        for (int k = 0; k < 4; k++) {
            int j = jb + k;
            if (j >= A->nvalid) { a[k][0] = ninf; a[k][1] = ninf; }
            else if (A->masked) {   /* lanes whose query lies before key j */
                __m256 kpos = _mm256_set1_ps((float)(A->j0 + j));
                a[k][0] = _mm256_blendv_ps(a[k][0], ninf, _mm256_cmp_ps(qp0, kpos, _CMP_LT_OQ));
                a[k][1] = _mm256_blendv_ps(a[k][1], ninf, _mm256_cmp_ps(qp1, kpos, _CMP_LT_OQ));
            }
            _mm256_store_ps(s + j * 16, a[k][0]);
            _mm256_store_ps(s + j * 16 + 8, a[k][1]);
        }
    }
    __m256 alpha[2];
    for (int h = 0; h < 2; h++) {
        __m256 mv = _mm256_loadu_ps(A->m + 8 * h), bm = ninf;
        for (int j = 0; j < nk; j++) bm = _mm256_max_ps(bm, _mm256_load_ps(s + j * 16 + 8 * h));
        __m256 mn = _mm256_max_ps(mv, bm);
        __m256 safe = _mm256_blendv_ps(mn, _mm256_setzero_ps(), _mm256_cmp_ps(mn, ninf, _CMP_EQ_OQ));
        alpha[h] = exp256(_mm256_sub_ps(mv, safe));
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < nk; j++) {
            __m256 p = exp256(_mm256_sub_ps(_mm256_load_ps(s + j * 16 + 8 * h), safe));
            _mm256_store_ps(s + j * 16 + 8 * h, p);
            sum = _mm256_add_ps(sum, p);
        }
        _mm256_storeu_ps(A->l + 8 * h, _mm256_fmadd_ps(_mm256_loadu_ps(A->l + 8 * h), alpha[h], sum));
        _mm256_storeu_ps(A->m + 8 * h, mn);
    }
    for (int d0 = 0; d0 < D; d0 += 4) {
        float *o = A->acc + d0 * 16;
        __m256 o00 = _mm256_mul_ps(_mm256_load_ps(o), alpha[0]), o01 = _mm256_mul_ps(_mm256_load_ps(o + 8), alpha[1]);
        __m256 o10 = _mm256_mul_ps(_mm256_load_ps(o + 16), alpha[0]), o11 = _mm256_mul_ps(_mm256_load_ps(o + 24), alpha[1]);
        __m256 o20 = _mm256_mul_ps(_mm256_load_ps(o + 32), alpha[0]), o21 = _mm256_mul_ps(_mm256_load_ps(o + 40), alpha[1]);
        __m256 o30 = _mm256_mul_ps(_mm256_load_ps(o + 48), alpha[0]), o31 = _mm256_mul_ps(_mm256_load_ps(o + 56), alpha[1]);
        for (int j = 0; j < nk; j++) {
            const float *vv = A->vp[j] + d0;
            __m256 p0 = _mm256_load_ps(s + j * 16), p1 = _mm256_load_ps(s + j * 16 + 8), b;
            b = _mm256_broadcast_ss(vv);     o00 = _mm256_fmadd_ps(b, p0, o00); o01 = _mm256_fmadd_ps(b, p1, o01);
            b = _mm256_broadcast_ss(vv + 1); o10 = _mm256_fmadd_ps(b, p0, o10); o11 = _mm256_fmadd_ps(b, p1, o11);
            b = _mm256_broadcast_ss(vv + 2); o20 = _mm256_fmadd_ps(b, p0, o20); o21 = _mm256_fmadd_ps(b, p1, o21);
            b = _mm256_broadcast_ss(vv + 3); o30 = _mm256_fmadd_ps(b, p0, o30); o31 = _mm256_fmadd_ps(b, p1, o31);
        }
        _mm256_store_ps(o, o00); _mm256_store_ps(o + 8, o01);
        _mm256_store_ps(o + 16, o10); _mm256_store_ps(o + 24, o11);
        _mm256_store_ps(o + 32, o20); _mm256_store_ps(o + 40, o21);
        _mm256_store_ps(o + 48, o30); _mm256_store_ps(o + 56, o31);
    }
}

AVX2 static void widen_avx2(float *dst, const uint16_t *src, int n) {
    int x = 0;
    for (; x + 8 <= n; x += 8) _mm256_storeu_ps(dst + x, ld8(src + x, TM_KV_BF16));
    widen_scalar(dst + x, src + x, n - x);
}

AVX2 static void widenh_avx2(float *dst, const uint16_t *src, int n) {
    int x = 0;
    for (; x + 8 <= n; x += 8) _mm256_storeu_ps(dst + x, ld8(src + x, TM_KV_F16));
    widenh_scalar(dst + x, src + x, n - x);
}

AVX2 static void widen8_avx2(float *dst, const uint8_t *src, int n, float scale) {
    const __m256 mul = _mm256_set1_ps(scale * 256.f);
    int x = 0;
    for (; x + 8 <= n; x += 8) _mm256_storeu_ps(dst + x, _mm256_mul_ps(fp8x8(src + x), mul));
    widen8_scalar(dst + x, src + x, n - x, scale);
}

AVX2 static void widen8i_avx2(float *dst, const uint8_t *src, int n, float scale) {
    const __m256 mul = _mm256_set1_ps(scale);
    int x = 0;
    for (; x + 8 <= n; x += 8) _mm256_storeu_ps(dst + x, _mm256_mul_ps(i8x8(src + x), mul));
    widen8i_scalar(dst + x, src + x, n - x, scale);
}

static const TileKernel tile_kernel_avx2 = {tile_avx2, widen_avx2, widenh_avx2, widen8_avx2, widen8i_avx2, AVX2_QW, 4};

#define AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma,f16c")))

/* Sixteen fp8 bytes as float32 values times 2^-8 (see "fp8 pages"). */
AVX512 static inline __attribute__((always_inline)) __m512 fp8x16(const void *p) {
    __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16((short)0xBFFF)));  /* as fp8x8 */
}

/* Sixteen int8 bytes as float32 values */
AVX512 static inline __attribute__((always_inline)) __m512 i8x16(const void *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

AVX512 static inline __attribute__((always_inline)) __m512 ld16(const void *p, int kind) {
    if (kind == TM_KV_F32) return _mm512_loadu_ps((const float *)p);
    if (kind == TM_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (kind == TM_KV_INT8) return i8x16(p);
    if (kind != TM_KV_BF16) return fp8x16(p);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* the 16 lanes folded to 8 (lane i + lane i+8) */
AVX512 static inline __attribute__((always_inline)) __m256 half_sum(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

/* The same task with 16-wide vectors (D a multiple of 16), for CPUs with AVX-512. */
/* o[g] = o[g] * alpha[g] + sum_u p[g][u] * v_u for GC query vectors, XC vectors of D at a time:
 * each V row is loaded once for the group, and GC x XC independent accumulators hide the
 * multiply-add latency (one vector's chain of nk dependent steps bound the decode path). Per
 * vector and lane these are the operations of one vector alone, in the same order. */
#define VACC_AVX512(GC, XC) do { \
    for (int x0 = 0; x0 < DW; x0 += (XC)) { \
        __m512 o[GC][XC]; \
        for (int g = 0; g < (GC); g++) { \
            __m512 va = _mm512_set1_ps(alpha[g]); \
            for (int x = 0; x < (XC); x++) o[g][x] = _mm512_mul_ps(_mm512_load_ps(acc + g * D + (x0 + x) * 16), va); \
        } \
        for (int u = 0; u < nk; u++) { \
            __m512 pu[GC]; \
            for (int g = 0; g < (GC); g++) pu[g] = _mm512_set1_ps(p[g * KEY_BLOCK + u]); \
            const char *vv = vp[u] + (size_t)x0 * 16 * esz; \
            for (int x = 0; x < (XC); x++) { \
                __m512 vx = ld16(vv + (size_t)x * 16 * esz, kind); \
                for (int g = 0; g < (GC); g++) o[g][x] = _mm512_fmadd_ps(pu[g], vx, o[g][x]); \
            } \
        } \
        for (int g = 0; g < (GC); g++) \
            for (int x = 0; x < (XC); x++) _mm512_store_ps(acc + g * D + (x0 + x) * 16, o[g][x]); \
    } \
} while (0)

AVX512 static inline __attribute__((always_inline)) void vaccum_avx512(float *acc, const float *p, const float *alpha,
                                                                const char *const *vp, int nk, int G, int D, const int kind) {
    const size_t esz = kv_esz(kind);
    const int DW = D / 16;
    const int xc = DW % 4 == 0 ? 4 : DW % 2 == 0 ? 2 : 1;
    for (int g0 = 0; g0 < G; g0 += 4, acc += (size_t)4 * D, p += 4 * KEY_BLOCK, alpha += 4) {
        const int gc = G - g0 < 4 ? G - g0 : 4;
        switch (gc * 8 + xc) {
        case 9: VACC_AVX512(1, 1); break;
        case 10: VACC_AVX512(1, 2); break;
        case 12: VACC_AVX512(1, 4); break;
        case 17: VACC_AVX512(2, 1); break;
        case 18: VACC_AVX512(2, 2); break;
        case 20: VACC_AVX512(2, 4); break;
        case 25: VACC_AVX512(3, 1); break;
        case 26: VACC_AVX512(3, 2); break;
        case 28: VACC_AVX512(3, 4); break;
        case 33: VACC_AVX512(4, 1); break;
        case 34: VACC_AVX512(4, 2); break;
        case 36: VACC_AVX512(4, 4); break;
        }
    }
}
#undef VACC_AVX512

AVX512 static inline __attribute__((always_inline)) void task_avx512_body(const Problem *P, const Task *T, float *part_m,
                                                                      float *part_l, float *part_acc, const int kind) {
    const size_t esz = kv_esz(kind);
    const int D = P->d, G = P->group;
    const int64_t q0 = P->qsl[T->seq], n = P->qsl[T->seq + 1] - q0, L = P->seq_lens[T->seq];
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const int nrow = T->r1 - T->r0, nq = nrow * G;
    float *qs = aligned_alloc(64, sizeof(float) * ((size_t)nq * D + 16));
    float *acc = aligned_alloc(64, sizeof(float) * ((size_t)nq * D + 16));
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    float m[MAX_QVEC], l[MAX_QVEC];
    /* the block's scores, then weights: a row of KEY_BLOCK per query vector of the row */
    float *sb = aligned_alloc(64, sizeof(float) * (size_t)G * KEY_BLOCK);
    float alph[MAX_QVEC];
    const char *kp[KEY_BLOCK], *vp[KEY_BLOCK];   /* element pointers (byte addressed) */
    /* fp8 / int8 pages: each block's K and V rows are widened once (times their scales) into wbuf
     * and read from there as float32 by every query vector of the task */
    const int wide = TM_KV_SCALED(kind);
    const float wf = kind == TM_KV_INT8 ? 1.f : 256.f;   /* fp8x8 / fp8x16 give e * 2^-8 */
    const int lk = wide ? TM_KV_F32 : kind;           /* the kind the inner loops read */
    const size_t lesz = wide ? 4 : esz;
    float *wbuf = wide ? aligned_alloc(64, sizeof(float) * 2 * KEY_BLOCK * (size_t)D) : NULL;
    const __m512 vscale = _mm512_set1_ps(P->scale);
    for (int r = 0; r < nrow; r++)
        for (int g = 0; g < G; g++) {
            const float *src = P->q + (q0 + T->r0 + r) * P->q_stride + (int64_t)(T->kvh * G + g) * D;
            float *dst = qs + (r * G + g) * D;
            for (int x = 0; x < D; x += 16) _mm512_store_ps(dst + x, _mm512_mul_ps(_mm512_loadu_ps(src + x), vscale));
            m[r * G + g] = -INFINITY; l[r * G + g] = 0.f;
        }
    for (int j0 = T->k0; j0 < T->k1; j0 += KEY_BLOCK) {
        int j1 = j0 + KEY_BLOCK < T->k1 ? j0 + KEY_BLOCK : T->k1;
        {
            int64_t offs[KEY_BLOCK];
            key_offsets(P, table, T->kvh, j0, j1, offs);
            for (int j = j0; j < j1; j++) {
                kp[j - j0] = (const char *)P->kc + offs[j - j0] * esz;
                vp[j - j0] = (const char *)P->vc + offs[j - j0] * esz;
            }
            if (wide)   /* a per-token scale sits at slot * hkv + head = offset / D */
                for (int j = 0; j < j1 - j0; j++) {
                    float *kr = wbuf + (size_t)j * D, *vr = wbuf + (size_t)(KEY_BLOCK + j) * D;
                    const int64_t si = kind == TM_KV_FP8 ? T->kvh : offs[j] / D;
                    const __m512 mk = _mm512_set1_ps(wf * P->ks[si]), mv = _mm512_set1_ps(wf * P->vs[si]);
                    for (int x = 0; x < D; x += 16) {
                        _mm512_store_ps(kr + x, _mm512_mul_ps(kind == TM_KV_INT8 ? i8x16(kp[j] + x) : fp8x16(kp[j] + x), mk));
                        _mm512_store_ps(vr + x, _mm512_mul_ps(kind == TM_KV_INT8 ? i8x16(vp[j] + x) : fp8x16(vp[j] + x), mv));
                    }
                    kp[j] = (const char *)kr;
                    vp[j] = (const char *)vr;
                }
        }
        if (j0 == T->k0)  /* the blocks PREFETCH_BLOCKS ahead are requested as each block starts */
            prefetch_keys(P, table, T->kvh, j1, j1 + (PREFETCH_BLOCKS - 1) * KEY_BLOCK < T->k1 ? j1 + (PREFETCH_BLOCKS - 1) * KEY_BLOCK : T->k1, esz);
        /* the block PREFETCH_BLOCKS ahead is requested key by key as the scores go (a burst of
         * every line of a block at once overflowed the miss queue) */
        int64_t pfo[KEY_BLOCK];
        int pfn = 0;
        {
            int64_t pa = (int64_t)j0 + PREFETCH_BLOCKS * KEY_BLOCK, pb = pa + KEY_BLOCK;
            if (pa < T->k1) {
                pfn = (int)((pb < T->k1 ? pb : T->k1) - pa);
                key_offsets(P, table, T->kvh, (int)pa, (int)pa + pfn, pfo);
            }
        }
        for (int r = 0; r < nrow; r++) {
            int64_t pos = L - n + T->r0 + r;
            int nk = (int)((pos + 1 < j1 ? pos + 1 : j1) - j0);
            if (nk <= 0) continue;
            for (int g = 0; g < G; g++) {
                int v = r * G + g;
                float *s = sb + g * KEY_BLOCK;
                const float *qq = qs + v * D;
                /* scores, four keys at a time */
                int j = 0;
                for (; j + 4 <= nk; j += 4) {
                    if (g == 0)
                        for (int e = j; e < j + 4 && e < pfn; e++) {
                            const char *kk = (const char *)P->kc + pfo[e] * esz, *vv = (const char *)P->vc + pfo[e] * esz;
                            for (size_t c = 0; c < (size_t)D * esz; c += 64) {
                                kv_prefetch(kk + c);
                                kv_prefetch(vv + c);
                            }
                        }
                    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int x = 0; x < D; x += 16) {
                        __m512 qx = _mm512_load_ps(qq + x);
                        a0 = _mm512_fmadd_ps(qx, ld16(kp[j] + x * lesz, lk), a0);
                        a1 = _mm512_fmadd_ps(qx, ld16(kp[j + 1] + x * lesz, lk), a1);
                        a2 = _mm512_fmadd_ps(qx, ld16(kp[j + 2] + x * lesz, lk), a2);
                        a3 = _mm512_fmadd_ps(qx, ld16(kp[j + 3] + x * lesz, lk), a3);
                    }
                    _mm_storeu_ps(s + j, hsum4x256(half_sum(a0), half_sum(a1), half_sum(a2), half_sum(a3)));
                }
                for (; j < nk; j++) {
                    __m512 a0 = _mm512_setzero_ps();
                    for (int x = 0; x < D; x += 16)
                        a0 = _mm512_fmadd_ps(_mm512_load_ps(qq + x), ld16(kp[j] + x * lesz, lk), a0);
                    s[j] = _mm512_reduce_add_ps(a0);
                }
                float bm;
                {   /* the block's max, a vector at a time (as in the AVX2 body) */
                    __m512 mx = _mm512_set1_ps(-INFINITY);
                    int t = 0;
                    for (; t + 16 <= nk; t += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(s + t));
                    if (t < nk)
                        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                                    (__mmask16)((1u << (nk - t)) - 1), s + t));
                    bm = _mm512_reduce_max_ps(mx);
                }
                float mn = m[v] > bm ? m[v] : bm;
                float alpha = expf(m[v] - mn);
                /* p = exp(s - mn), eight at a time */
                __m256 vmn = _mm256_set1_ps(mn), vsum = _mm256_setzero_ps();
                int t = 0;
                for (; t + 8 <= nk; t += 8) {
                    __m256 p = exp256(_mm256_sub_ps(_mm256_load_ps(s + t), vmn));
                    _mm256_store_ps(s + t, p);
                    vsum = _mm256_add_ps(vsum, p);
                }
                float sum = hsum256(vsum);
                for (; t < nk; t++) { s[t] = expf(s[t] - mn); sum += s[t]; }
                l[v] = l[v] * alpha + sum;
                m[v] = mn;
                alph[g] = alpha;
            }
            vaccum_avx512(acc + (size_t)r * G * D, sb, alph, vp, nk, G, D, lk);
        }
    }
    for (int r = 0; r < nrow; r++)
        for (int g = 0; g < G; g++) {
            int v = r * G + g;
            if (T->part < 0) {
                float *dst = P->out + (q0 + T->r0 + r) * (int64_t)P->hq * D + (int64_t)(T->kvh * G + g) * D;
                __m512 inv = _mm512_set1_ps(l[v] > 0.f ? 1.f / l[v] : 0.f);
                for (int x = 0; x < D; x += 16) _mm512_storeu_ps(dst + x, _mm512_mul_ps(_mm512_load_ps(acc + v * D + x), inv));
            } else {
                part_m[v] = m[v]; part_l[v] = l[v];
                memcpy(part_acc + (size_t)v * D, acc + (size_t)v * D, sizeof(float) * D);
            }
        }
    free(sb);
    free(acc);
    free(qs);
    free(wbuf);
}

AVX512 static void task_avx512_f32(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx512_body(P, T, m, l, a, 0);
}

AVX512 static void task_avx512_bf16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx512_body(P, T, m, l, a, TM_KV_BF16);
}

AVX512 static void task_avx512_f16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx512_body(P, T, m, l, a, TM_KV_F16);
}

AVX512 static void task_avx512_fp8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx512_body(P, T, m, l, a, TM_KV_FP8);
}

AVX512 static void task_avx512_fp8_token(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx512_body(P, T, m, l, a, TM_KV_FP8_TOKEN);
}

AVX512 static void task_avx512_int8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    task_avx512_body(P, T, m, l, a, TM_KV_INT8);
}

/* exp(x) for x <= 0 (and -inf -> 0), 16 lanes: exp256's range reduction and polynomial. */
AVX512 static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, ln2_hi, x);
    x = _mm512_fnmadd_ps(fx, ln2_lo, x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    __m512 x2 = _mm512_mul_ps(x, x);
    y = _mm512_fmadd_ps(y, x2, _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps((__mmask16)~under, y);
}

/* The tile with 16-wide vectors: groups of 32 query vectors (two registers), keys scored eight
 * at a time (16 accumulators), the output updated eight dims at a time (16 accumulators). */
#define AVX512_QW 32
#define AVX512_KS 8

AVX512 static void tile_avx512(const TileArgs *A) {
    const int D = A->d, nk = A->nk;
    const float *qt = A->qt;
    float *s = A->s;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 qp0 = _mm512_loadu_ps(A->qpos), qp1 = _mm512_loadu_ps(A->qpos + 16);
    for (int jb = 0; jb < nk; jb += AVX512_KS) {
        const float *kr[AVX512_KS];
        __m512 a[AVX512_KS][2];
        for (int k = 0; k < AVX512_KS; k++) { kr[k] = A->kp[jb + k]; a[k][0] = a[k][1] = _mm512_setzero_ps(); }
        for (int x = 0; x < D; x++) {
            __m512 q0 = _mm512_load_ps(qt + x * 32), q1 = _mm512_load_ps(qt + x * 32 + 16);
            for (int k = 0; k < AVX512_KS; k++) {
                __m512 b = _mm512_set1_ps(kr[k][x]);
                a[k][0] = _mm512_fmadd_ps(b, q0, a[k][0]);
                a[k][1] = _mm512_fmadd_ps(b, q1, a[k][1]);
            }
        }
        for (int k = 0; k < AVX512_KS; k++) {
            int j = jb + k;
            if (j >= A->nvalid) { a[k][0] = ninf; a[k][1] = ninf; }
            else if (A->masked) {   /* lanes whose query lies before key j */
                __m512 kpos = _mm512_set1_ps((float)(A->j0 + j));
                a[k][0] = _mm512_mask_mov_ps(a[k][0], _mm512_cmp_ps_mask(qp0, kpos, _CMP_LT_OQ), ninf);
                a[k][1] = _mm512_mask_mov_ps(a[k][1], _mm512_cmp_ps_mask(qp1, kpos, _CMP_LT_OQ), ninf);
            }
            _mm512_store_ps(s + j * 32, a[k][0]);
            _mm512_store_ps(s + j * 32 + 16, a[k][1]);
        }
    }
    __m512 alpha[2];
    for (int h = 0; h < 2; h++) {
        __m512 mv = _mm512_loadu_ps(A->m + 16 * h), bm = ninf;
        for (int j = 0; j < nk; j++) bm = _mm512_max_ps(bm, _mm512_load_ps(s + j * 32 + 16 * h));
        __m512 mn = _mm512_max_ps(mv, bm);
        __m512 safe = _mm512_mask_mov_ps(mn, _mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
        alpha[h] = exp512(_mm512_sub_ps(mv, safe));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < nk; j++) {
            __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(s + j * 32 + 16 * h), safe));
            _mm512_store_ps(s + j * 32 + 16 * h, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_storeu_ps(A->l + 16 * h, _mm512_fmadd_ps(_mm512_loadu_ps(A->l + 16 * h), alpha[h], sum));
        _mm512_storeu_ps(A->m + 16 * h, mn);
    }
    for (int d0 = 0; d0 < D; d0 += 8) {
        float *o = A->acc + d0 * 32;
        __m512 acc[8][2];
        for (int t = 0; t < 8; t++) {
            acc[t][0] = _mm512_mul_ps(_mm512_load_ps(o + t * 32), alpha[0]);
            acc[t][1] = _mm512_mul_ps(_mm512_load_ps(o + t * 32 + 16), alpha[1]);
        }
        for (int j = 0; j < nk; j++) {
            const float *vv = A->vp[j] + d0;
            __m512 p0 = _mm512_load_ps(s + j * 32), p1 = _mm512_load_ps(s + j * 32 + 16);
            for (int t = 0; t < 8; t++) {
                __m512 b = _mm512_set1_ps(vv[t]);
                acc[t][0] = _mm512_fmadd_ps(b, p0, acc[t][0]);
                acc[t][1] = _mm512_fmadd_ps(b, p1, acc[t][1]);
            }
        }
        for (int t = 0; t < 8; t++) {
            _mm512_store_ps(o + t * 32, acc[t][0]);
            _mm512_store_ps(o + t * 32 + 16, acc[t][1]);
        }
    }
}

AVX512 static void widen_avx512(float *dst, const uint16_t *src, int n) {
    int x = 0;
    for (; x + 16 <= n; x += 16) _mm512_storeu_ps(dst + x, ld16(src + x, TM_KV_BF16));
    widen_scalar(dst + x, src + x, n - x);
}

AVX512 static void widenh_avx512(float *dst, const uint16_t *src, int n) {
    int x = 0;
    for (; x + 16 <= n; x += 16) _mm512_storeu_ps(dst + x, ld16(src + x, TM_KV_F16));
    widenh_scalar(dst + x, src + x, n - x);
}

AVX512 static void widen8_avx512(float *dst, const uint8_t *src, int n, float scale) {
    const __m512 mul = _mm512_set1_ps(scale * 256.f);
    int x = 0;
    for (; x + 16 <= n; x += 16) _mm512_storeu_ps(dst + x, _mm512_mul_ps(fp8x16(src + x), mul));
    widen8_scalar(dst + x, src + x, n - x, scale);
}

AVX512 static void widen8i_avx512(float *dst, const uint8_t *src, int n, float scale) {
    const __m512 mul = _mm512_set1_ps(scale);
    int x = 0;
    for (; x + 16 <= n; x += 16) _mm512_storeu_ps(dst + x, _mm512_mul_ps(i8x16(src + x), mul));
    widen8i_scalar(dst + x, src + x, n - x, scale);
}

static const TileKernel tile_kernel_avx512 = {tile_avx512, widen_avx512, widenh_avx512, widen8_avx512, widen8i_avx512,
                                              AVX512_QW, AVX512_KS};

/* ---------------------------------------------------------------------------------------- */
/* decode rows                                                                              */
/*
 * A decode row (a sequence's one query row: every key of its task is visible) has G query
 * vectors per kv head, all reading the same K/V rows. The decode task bodies below read each
 * K and V row once for all G (the per-row bodies above read a K row once per query vector and
 * fp8 rows went through a float32 copy). A task of a few rows (a verify step's k + 1 rows) runs
 * the same bodies over all its rows' vectors (v = r * G + g), each vector's scores masked past
 * the last key its row sees (dec_queries); a block a vector sees none of leaves it as it was:
 *   - scores: a key row is widened once, chunk by chunk, and multiplied into G accumulators
 *     (the queries come from L1); 4 keys' accumulators are folded into one vector by an
 *     in-register transpose-reduce, 16 keys (8 on AVX2) into one vector of scores per query;
 *   - the softmax update runs on those vectors (padding keys of a short block masked out);
 *   - V: each row is widened once per chunk of up to 4 query vectors (vaccum).
 * fp8 scales never touch the elements: a static K scale sits in the query, a static V scale on
 * the output, a per-token K scale multiplies that key's score, a per-token V scale its weight
 * in the V sum (the softmax sum takes the unscaled weight).
 * AVX-512 (with VBMI) widens 64 fp8 bytes at once by table: vpermi2b looks up bytes 3 and 2 of
 * the float32 of the byte's low 7 bits (a 128-entry table in two registers each; bytes 1 and 0
 * of every e4m3 float32 are zero), one ternary-logic op adds the sign bit, and byte/word
 * unpacks interleave them with zeros into 64 float32 values, exactly, subnormals included. The
 * unpacks work within 128-bit lanes, so the 64 values come out in a fixed order (dec_perm):
 * the task stores its queries in that order and puts the output back in dim order at the end.
 * Order of summation (documented, not bit-compatible with the per-row bodies): a score's
 * products are summed per lane over the row's chunks, then the 16 lanes by the transpose tree;
 * the AVX2 body sums a block's V rows for even and odd keys apart and adds the two at the end.
 */

/* Vectors per pass when the decode bodies walk Q query vectors at most maxv at a time: as many
 * passes as needed, of sizes as equal as they can be (9 vectors as 3 + 3 + 3, not 4 + 4 + 1: a
 * pass of one vector re-reads every K/V row for that vector alone, and its few accumulator chains
 * leave the multiply-add units waiting on latency). Every vector's arithmetic is its own, so the
 * grouping never changes a result. */
static inline int dec_pass(int Q, int maxv) {
    const int passes = (Q + maxv - 1) / maxv;
    return (Q + passes - 1) / passes;
}

/* the dim order of fp8x64's output within each 64-dim chunk: position 16c + 4L + i holds dim
 * 16L + 4c + i (and the map is its own inverse) */
static inline int dec_perm(int x) {
    return (x & ~63) | (((x >> 2) & 3) << 4) | (((x >> 4) & 3) << 2) | (x & 3);
}

#ifndef DEC_BLOCK
#define DEC_BLOCK 64   /* keys of one softmax update in the decode bodies */
#endif
#ifndef DEC_PF
#define DEC_PF 64      /* keys the decode bodies request ahead of use (64 read 30 layers from DRAM faster than 128 to 512) */
#endif
#define AVX512V __attribute__((target("avx512f,avx512dq,avx512bw,avx512vbmi,avx2,fma,f16c")))

typedef struct {
    __m512i b2a, b2b, b3a, b3b, sign;
} E4m3Tab;

AVX512V static inline __attribute__((always_inline)) E4m3Tab e4m3_tab(void) {
    E4m3Tab t;
    t.b2a = _mm512_loadu_si512(g_e4m3_b2);
    t.b2b = _mm512_loadu_si512(g_e4m3_b2 + 64);
    t.b3a = _mm512_loadu_si512(g_e4m3_b3);
    t.b3b = _mm512_loadu_si512(g_e4m3_b3 + 64);
    t.sign = _mm512_set1_epi8((char)0x80);
    return t;
}

/* 64 fp8 bytes at p as their exact float32 values (no 2^-8 factor), in dec_perm order */
AVX512V static inline __attribute__((always_inline)) void fp8x64(const void *p, const E4m3Tab *t, __m512 *o) {
    const __m512i b = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_permutex2var_epi8(t->b2a, b, t->b2b);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->b3a, b, t->b3b), b, t->sign, 0xF8);
    const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi), z = _mm512_setzero_si512();
    o[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w0));
    o[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w0));
    o[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w1));
    o[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w1));
}

/* four vectors -> one: in each 128-bit lane, element i = the sum of a_i's four elements there */
AVX512V static inline __attribute__((always_inline)) __m512 red4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 b23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b01), _mm512_castps_pd(b23))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b01), _mm512_castps_pd(b23))));
}

/* two red4 results (keys 0-3, 4-7) -> lanes 0, 1 hold them half summed, lanes 2, 3 likewise */
AVX512V static inline __attribute__((always_inline)) __m512 red8_512(__m512 c0, __m512 c1) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x44), _mm512_shuffle_f32x4(c0, c1, 0xEE));
}

/* two red8 results -> the 16 keys' sums in key order */
AVX512V static inline __attribute__((always_inline)) __m512 red16_512(__m512 d01, __m512 d23) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

/* scores of the 16 keys kp[jb .. jb+15] for GC query vectors at qg (rows of D floats) into
 * s[g * DEC_BLOCK + jb + k]. The 4 keys' loop is unrolled, and 64-dim rows of the fp16 / bf16 /
 * fp32 pools are read whole, so that the GC x 4 accumulators stay in registers: with the dims in
 * a loop of runtime length, gcc kept them on the stack and every multiply-add went through a
 * store and a load (1.35x slower in cache; docs/benchmarks.md, "Decode scores in registers"). */
#define DEC_SCORE512(GC) do { \
    __m512 d01[GC], c2[GC]; \
    for (int g = 0; g < (GC); g++) d01[g] = c2[g] = _mm512_setzero_ps(); \
    for (int kq = 0; kq < 4; kq++) { \
        __m512 a[GC][4]; \
        for (int g = 0; g < (GC); g++) \
            for (int k = 0; k < 4; k++) a[g][k] = _mm512_setzero_ps(); \
        _Pragma("GCC unroll 4") \
        for (int k = 0; k < 4; k++) { \
            const char *kk = kp[jb + 4 * kq + k]; \
            if (pf_on) {   /* the K and V rows DEC_PF keys ahead, one key at a time */ \
                const int64_t pj = pf0 + jb + 4 * kq + k; \
                if (pj < nkeys) prefetch_row_pair(P, offs[pj], esz, rowb); \
            } \
            if (perm) { \
                for (int x = 0; x < D; x += 64) { \
                    __m512 w[4]; \
                    fp8x64(kk + x, &tab, w); \
                    for (int t = 0; t < 4; t++) \
                        for (int g = 0; g < (GC); g++) \
                            a[g][k] = _mm512_fmadd_ps(w[t], _mm512_load_ps(qg + g * D + x + 16 * t), a[g][k]); \
                } \
            } else if (D == 64) { \
                __m512 w[4]; \
                for (int t = 0; t < 4; t++) w[t] = ld16(kk + (size_t)t * 16 * esz, kind); \
                for (int t = 0; t < 4; t++) \
                    for (int g = 0; g < (GC); g++) \
                        a[g][k] = _mm512_fmadd_ps(w[t], _mm512_load_ps(qg + g * 64 + 16 * t), a[g][k]); \
            } else { \
                for (int x = 0; x < D; x += 16) { \
                    const __m512 w = ld16(kk + (size_t)x * esz, kind); \
                    for (int g = 0; g < (GC); g++) a[g][k] = _mm512_fmadd_ps(w, _mm512_load_ps(qg + g * D + x), a[g][k]); \
                } \
            } \
        } \
        for (int g = 0; g < (GC); g++) { \
            const __m512 c = red4_512(a[g][0], a[g][1], a[g][2], a[g][3]); \
            if (kq == 0 || kq == 2) c2[g] = c; \
            else if (kq == 1) d01[g] = red8_512(c2[g], c); \
            else _mm512_store_ps(s + g * DEC_BLOCK + jb, red16_512(d01[g], red8_512(c2[g], c))); \
        } \
    } \
} while (0)

/* acc[g] = acc[g] * alpha[g] + sum_u p[g][u] v_u (as VACC_AVX512), fp8 rows widened 64 at a
 * time when perm (then XC is 4) */
#define DEC_VACC512(GC, XC) do { \
    for (int x0 = 0; x0 < DW; x0 += (XC)) { \
        __m512 o[GC][XC]; \
        for (int g = 0; g < (GC); g++) { \
            const __m512 va = _mm512_set1_ps(alpha[g]); \
            for (int x = 0; x < (XC); x++) o[g][x] = _mm512_mul_ps(_mm512_load_ps(acc + g * D + (x0 + x) * 16), va); \
        } \
        for (int u = 0; u < nk; u++) { \
            __m512 vx[4]; \
            const char *vv = vp[u] + (size_t)x0 * 16 * esz; \
            if (perm) fp8x64(vv, tab, vx); \
            else for (int x = 0; x < (XC); x++) vx[x] = ld16(vv + (size_t)x * 16 * esz, kind); \
            for (int g = 0; g < (GC); g++) { \
                const __m512 pu = _mm512_set1_ps(p[g * DEC_BLOCK + u]); \
                for (int x = 0; x < (XC); x++) o[g][x] = _mm512_fmadd_ps(pu, vx[x], o[g][x]); \
            } \
        } \
        for (int g = 0; g < (GC); g++) \
            for (int x = 0; x < (XC); x++) _mm512_store_ps(acc + g * D + (x0 + x) * 16, o[g][x]); \
    } \
} while (0)

AVX512V static inline __attribute__((always_inline)) void dec_vacc512(float *acc, const float *p, const float *alpha,
                                                                   const char *const *vp, int nk, int G, int D,
                                                                   const int kind, const int perm, const E4m3Tab *tab) {
    const size_t esz = kv_esz(kind);
    const int DW = D / 16;
    const int xc = DW % 4 == 0 ? 4 : DW % 2 == 0 ? 2 : 1;   /* perm: D % 64 == 0, so 4 */
    const int per = dec_pass(G, 4);
    for (int g0 = 0; g0 < G; g0 += per, acc += (size_t)per * D, p += per * DEC_BLOCK, alpha += per) {
        const int gc = G - g0 < per ? G - g0 : per;
        switch (gc * 8 + xc) {
        case 9: DEC_VACC512(1, 1); break;
        case 10: DEC_VACC512(1, 2); break;
        case 12: DEC_VACC512(1, 4); break;
        case 17: DEC_VACC512(2, 1); break;
        case 18: DEC_VACC512(2, 2); break;
        case 20: DEC_VACC512(2, 4); break;
        case 25: DEC_VACC512(3, 1); break;
        case 26: DEC_VACC512(3, 2); break;
        case 28: DEC_VACC512(3, 4); break;
        case 33: DEC_VACC512(4, 1); break;
        case 34: DEC_VACC512(4, 2); break;
        case 36: DEC_VACC512(4, 4); break;
        }
    }
}

/* Request the K and V lines of the key at element offset off, rows of rowb bytes (the decode
 * bodies pass it from a local: read from P->d in their unrolled score loops, it ran the int8
 * body 2x slower and the fp8 one 1.06x) */
static inline void prefetch_row_pair(const Problem *P, int64_t off, size_t esz, size_t rowb) {
    const char *k = (const char *)P->kc + off * esz, *v = (const char *)P->vc + off * esz;
    for (size_t c = 0; c < rowb; c += 64) {
        kv_prefetch(k + c);
        kv_prefetch(v + c);
    }
}

/* Request the K and V lines of the keys at element offsets off[0 .. n) */
static inline void prefetch_rows(const Problem *P, const int64_t *off, int n, size_t esz) {
    for (int j = 0; j < n; j++) prefetch_row_pair(P, off[j], esz, (size_t)P->d * esz);
}

/* The index of the per-vector scale of the row at element offset off: slot * hkv + head = off / D
 * (dsh: log2 D where D is a power of 2, else -1; an integer division per key cost as much as the
 * key's arithmetic) */
static inline int64_t scale_index(const Problem *P, int64_t off, int dsh) {
    return dsh >= 0 ? off >> dsh : off / P->d;
}

/* Request the lines of the per-vector K and V scales of the keys at element offsets off[0 .. n) */
static inline void prefetch_scales(const Problem *P, const int64_t *off, int n, int dsh) {
    for (int j = 0; j < n; j++) {
        const int64_t si = scale_index(P, off[j], dsh);
        kv_prefetch((const char *)(P->ks + si));
        kv_prefetch((const char *)(P->vs + si));
    }
}

/* What both decode bodies set up: the scale of the queries and of the output, and the fp8
 * factor of the widening used (fp8x8 / fp8x16 give e * 2^-8; fp8x64 gives e). */
typedef struct {
    float qmul, vmul;
} DecScales;

static inline DecScales dec_scales(const Problem *P, const Task *T, int kind, int exact) {
    const float f8 = (kind == TM_KV_FP8 || kind == TM_KV_FP8_TOKEN) && !exact ? 256.f : 1.f;
    DecScales s = {P->scale * f8, f8};
    if (kind == TM_KV_FP8) { s.qmul *= P->ks[T->kvh]; s.vmul *= P->vs[T->kvh]; }
    return s;
}

/* the task's output (normalised) or its partial, from acc in the order the body kept it */
static inline void dec_store(const Problem *P, const Task *T, const float *acc, const float *m, const float *l,
                             float vmul, int perm, float *part_m, float *part_l, float *part_acc) {
    const int D = P->d, G = P->group, Q = (T->r1 - T->r0) * G;
    const int64_t row = P->qsl[T->seq] + T->r0;
    for (int v = 0; v < Q; v++) {
        const int r = v / G, g = v % G;
        const float *a = acc + (size_t)v * D;
        float *dst;
        float mul = vmul;
        if (T->part < 0) {
            dst = P->out + (row + r) * (int64_t)P->hq * D + (int64_t)(T->kvh * G + g) * D;
            mul = l[v] > 0.f ? vmul / l[v] : 0.f;
        } else {
            dst = part_acc + (size_t)v * D;
            part_m[v] = m[v];
            part_l[v] = l[v];
        }
        if (perm)
            for (int x = 0; x < D; x++) dst[dec_perm(x)] = a[x] * mul;
        else
            for (int x = 0; x < D; x++) dst[x] = a[x] * mul;
    }
}

/* The decode bodies' queries for the task's rows (Q = rows x G vectors, vector v = r * G + g, in
 * dim order or dec_perm's), scaled by qmul, and each vector's count of visible keys from the
 * task's first key: row r of a chunk of n rows at the end of a sequence of L tokens sees the keys
 * before L - n + r + 1. A decode row (n = 1) sees every key of its task. */
static inline void dec_queries(const Problem *P, const Task *T, float qmul, int perm, float *qs, int64_t *vis) {
    const int D = P->d, G = P->group, Q = (T->r1 - T->r0) * G;
    const int64_t row = P->qsl[T->seq] + T->r0;
    const int64_t n = P->qsl[T->seq + 1] - P->qsl[T->seq], L = P->seq_lens[T->seq];
    for (int v = 0; v < Q; v++) {
        const int r = v / G, g = v % G;
        const float *src = P->q + (row + r) * P->q_stride + (int64_t)(T->kvh * G + g) * D;
        for (int x = 0; x < D; x++) qs[(size_t)v * D + x] = src[perm ? dec_perm(x) : x] * qmul;
        vis[v] = L - n + T->r0 + r + 1 - T->k0;
    }
}

AVX512V static inline __attribute__((always_inline)) void dec512_body(const Problem *P, const Task *T, float *part_m,
                                                                   float *part_l, float *part_acc, const int kind) {
    const int D = P->d, G = P->group, Q = (T->r1 - T->r0) * G;
    const int perm = (kind == TM_KV_FP8 || kind == TM_KV_FP8_TOKEN) && D % 64 == 0;
    const size_t esz = kv_esz(kind), rowb = (size_t)D * esz;   /* bytes of a K or V row */
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const DecScales sc = dec_scales(P, T, kind, perm);
    float *qs = alloc64((size_t)Q * D), *acc = alloc64((size_t)Q * D), *sb = alloc64((size_t)Q * DEC_BLOCK);
    float ksb[DEC_BLOCK] __attribute__((aligned(64))), vsb[DEC_BLOCK] __attribute__((aligned(64)));
    float m[MAX_QVEC], l[MAX_QVEC], alph[MAX_QVEC];
    int64_t vis[MAX_QVEC];
    const char *kp[DEC_BLOCK], *vp[DEC_BLOCK];
    /* the element offsets of the task's keys, computed once (per block, and again for the
     * prefetch, they cost as much as a fifth of the decode) */
    const int nkeys = T->k1 - T->k0;
    int64_t *offs = malloc(sizeof(int64_t) * ((size_t)nkeys + DEC_BLOCK));
    key_offsets(P, table, T->kvh, T->k0, T->k1, offs);
    const E4m3Tab tab = e4m3_tab();
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    memset(acc, 0, sizeof(float) * (size_t)Q * D);
    dec_queries(P, T, sc.qmul, perm, qs, vis);
    for (int v = 0; v < Q; v++) {
        m[v] = -INFINITY;
        l[v] = 0.f;
    }
    {   /* the first PREFETCH_BLOCKS blocks (later ones are asked for a block at a time below) */
        prefetch_rows(P, offs, nkeys < DEC_PF ? nkeys : DEC_PF, esz);
    }
    for (int j0 = 0; j0 < nkeys; j0 += DEC_BLOCK) {
        const int64_t *o = offs + j0;
        const int nk = nkeys - j0 < DEC_BLOCK ? nkeys - j0 : DEC_BLOCK, nks = (nk + 15) & ~15;
        for (int j = 0; j < nk; j++) {
            kp[j] = (const char *)P->kc + o[j] * esz;
            vp[j] = (const char *)P->vc + o[j] * esz;
        }
        for (int j = nk; j < nks; j++) kp[j] = kp[nk - 1];   /* padding: a real row, its score masked */
        if (TM_KV_TOKEN_SCALES(kind)) {   /* a per-token scale sits at slot * hkv + head = offset / D */
            for (int j = 0; j < nk; j++) { ksb[j] = P->ks[o[j] / D]; vsb[j] = P->vs[o[j] / D]; }
            for (int j = nk; j < nks; j++) ksb[j] = vsb[j] = 0.f;
        }
        /* the keys DEC_PF ahead are asked for one at a time as the scores go: asked for 16 at a
         * time, the requests queued up behind each other and the scores waited on them (an int8
         * or fp8 layer at 16k read from DRAM 1.4x-1.7x slower) */
        const int64_t pf0 = j0 + DEC_PF;
        for (int jb = 0; jb < nks; jb += 16) {
            for (int g0 = 0, per = dec_pass(Q, 4), pf_on = 1; g0 < Q; g0 += per, pf_on = 0) {
                const float *qg = qs + (size_t)g0 * D;
                float *s = sb + (size_t)g0 * DEC_BLOCK;
                switch (Q - g0 < per ? Q - g0 : per) {
                case 1: DEC_SCORE512(1); break;
                case 2: DEC_SCORE512(2); break;
                case 3: DEC_SCORE512(3); break;
                default: DEC_SCORE512(4); break;
                }
            }
        }
        for (int g = 0; g < Q; g++) {
            float *s = sb + (size_t)g * DEC_BLOCK;
            /* the keys of the block this vector sees (a row of a verify step sees fewer) */
            const int seen = vis[g] - j0 < nk ? (int)(vis[g] - j0) : nk;
            if (seen <= 0) {   /* none: no weight, the running max and sum stay */
                memset(s, 0, sizeof(float) * (size_t)nks);
                alph[g] = 1.f;
                continue;
            }
            __m512 sv[DEC_BLOCK / 16], mx = ninf;
            for (int h = 0; h < nks / 16; h++) {
                __m512 v = _mm512_load_ps(s + 16 * h);
                if (TM_KV_TOKEN_SCALES(kind)) v = _mm512_mul_ps(v, _mm512_load_ps(ksb + 16 * h));
                const int cnt = seen - 16 * h;
                if (cnt < 16) v = cnt > 0 ? _mm512_mask_mov_ps(ninf, (__mmask16)((1u << cnt) - 1), v) : ninf;
                sv[h] = v;
                mx = _mm512_max_ps(mx, v);
            }
            const float bm = _mm512_reduce_max_ps(mx);
            const float mn = m[g] > bm ? m[g] : bm;
            const float alpha = expf(m[g] - mn);
            const __m512 vmn = _mm512_set1_ps(mn);
            __m512 vsum = _mm512_setzero_ps();
            for (int h = 0; h < nks / 16; h++) {
                const __m512 p = exp512(_mm512_sub_ps(sv[h], vmn));
                vsum = _mm512_add_ps(vsum, p);
                _mm512_store_ps(s + 16 * h, TM_KV_TOKEN_SCALES(kind) ? _mm512_mul_ps(p, _mm512_load_ps(vsb + 16 * h)) : p);
            }
            l[g] = l[g] * alpha + _mm512_reduce_add_ps(vsum);
            m[g] = mn;
            alph[g] = alpha;
        }
        dec_vacc512(acc, sb, alph, vp, nk, Q, D, kind, perm, &tab);
    }
    dec_store(P, T, acc, m, l, sc.vmul, perm, part_m, part_l, part_acc);
    free(qs); free(acc); free(sb); free(offs);
}

AVX512V static void dec512_f32(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec512_body(P, T, m, l, a, TM_KV_F32);
}
AVX512V static void dec512_bf16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec512_body(P, T, m, l, a, TM_KV_BF16);
}
AVX512V static void dec512_f16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec512_body(P, T, m, l, a, TM_KV_F16);
}
AVX512V static void dec512_fp8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec512_body(P, T, m, l, a, TM_KV_FP8);
}
AVX512V static void dec512_fp8_token(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec512_body(P, T, m, l, a, TM_KV_FP8_TOKEN);
}
AVX512V static void dec512_int8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec512_body(P, T, m, l, a, TM_KV_INT8);
}

/* int8 pages on AVX-512 VNNI (vpdpwssd: 32 int16 products summed 2 by 2 into 16 int32 lanes):
 *   - scores: each query vector is rounded once per task to int16 with its own scale (amax /
 *     32767); a K row, widened to int16, takes two vpdpwssd per 64 dims and query vector, and
 *     the 16 keys' lanes fold by the transpose tree in int32 (exact), then times q's scale and
 *     each key's K scale (an earlier form, vpdpbusd over K's bytes flipped to unsigned and the
 *     query as two bytes, cost 3% more in cache);
 *   - the softmax update is dec512_body's, in float32 (the block's rescale factors and weight
 *     bounds by one vector exp for 8 vectors, no libm call);
 *   - V: a block's weights times their keys' V scales are rounded to int16 against a bound of
 *     their largest (the block's largest weight times its largest V scale, so nothing
 *     saturates), and two keys' V rows, widened to int16 and interleaved, take one vpdpwssd per
 *     16 dims and query vector: the int32 sums over the block (at most 128 x 32767 x 128) are
 *     exact, and go into the float32 output times the bound / 32767 at the block's end. (8-bit
 *     weights, four keys a vpdpbusd, ran the body 1.18x faster in cache, but a block holding an
 *     attention sink rounded its other weights to nothing: SmolLM2's top-1 agreement with an
 *     fp32 pool fell from 99.0% to 94.3%.)
 * So two roundings more than the widening bodies, both far finer than the int8 elements: on
 * SmolLM2's decode rows the logits stay about as close to an fp32 pool's as the widening body's
 * (mean |diff| 0.065 against 0.060, top-1 agreement 98.4% against 99.0% over 192 rows;
 * tests/models/test_kv_fp8_accuracy.py).
 * The row prefetches go one key at a time as the scores go, as in dec512_body. Needs
 * head_dim % 64 == 0 (else dec512_int8 runs). */
#ifndef I8_BLOCK
#define I8_BLOCK 128   /* keys of one softmax update in the int8 VNNI body (its per-block work is a larger share than in the float bodies) */
#endif
#define AVX512VNNI __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

AVX512VNNI static inline __attribute__((always_inline)) __m512i red4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i b01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i b23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(b01, b23), _mm512_unpackhi_epi64(b01, b23));
}

/* as red8_512 / red16_512, on int32 lanes */
AVX512VNNI static inline __attribute__((always_inline)) __m512i red8_epi32(__m512i c0, __m512i c1) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, 0x44), _mm512_shuffle_i32x4(c0, c1, 0xEE));
}
AVX512VNNI static inline __attribute__((always_inline)) __m512i red16_epi32(__m512i d01, __m512i d23) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(d01, d23, 0x88), _mm512_shuffle_i32x4(d01, d23, 0xDD));
}

/* integer scores of 16 keys (offsets o[jb ..]) for GC query vectors (rows of D int16 at qg), as
 * floats (times q's scale) into s[g * I8_BLOCK + jb + k]. DX is D,
 * as the constant 64 where it is (a loop of runtime length kept the accumulators on the stack,
 * as DEC_SCORE512 notes). */
#define DEC_SCORE_I8(GC, DX) do { \
    __m512i d01[GC], c2[GC]; \
    for (int g = 0; g < (GC); g++) d01[g] = c2[g] = _mm512_setzero_si512(); \
    for (int kq = 0; kq < 4; kq++) { \
        __m512i a[GC][4]; \
        for (int g = 0; g < (GC); g++) \
            for (int k = 0; k < 4; k++) a[g][k] = _mm512_setzero_si512(); \
        for (int x = 0; x < (DX); x += 64) { \
            _Pragma("GCC unroll 4") \
            for (int k = 0; k < 4; k++) { \
                if (x == 0 && pf_on) {   /* the K and V rows DEC_PF keys ahead, one key at a time */ \
                    const int64_t pj = pf0 + jb + 4 * kq + k; \
                    if (pj < nkeys) prefetch_row_pair(P, offs[pj], 1, (DX)); \
                } \
                const char *kr = kc + o[jb + 4 * kq + k] + x; \
                const __m512i k0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)kr)); \
                const __m512i k1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kr + 32))); \
                for (int g = 0; g < (GC); g++) \
                    a[g][k] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(a[g][k], k0, _mm512_load_si512(qg + (size_t)g * (DX) + x)), \
                                                  k1, _mm512_load_si512(qg + (size_t)g * (DX) + x + 32)); \
            } \
        } \
        for (int g = 0; g < (GC); g++) { \
            const __m512i c = red4_epi32(a[g][0], a[g][1], a[g][2], a[g][3]); \
            if (kq == 0 || kq == 2) c2[g] = c; \
            else if (kq == 1) d01[g] = red8_epi32(c2[g], c); \
            else { \
                const __m512i t = red16_epi32(d01[g], red8_epi32(c2[g], c)); \
                _mm512_store_ps(s + g * I8_BLOCK + jb, _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(qsc[g]))); \
            } \
        } \
    } \
} while (0)

/* acc[g][64 dims of chunk x0] = acc * alpha + the block's V sums (16-bit weights times int8
 * rows, two keys a vpdpwssd) * wsc, for GC vectors; the 64 dims come out in i8_perm's order */
#define DEC_VACC_I8(GC) do { \
    for (int x0 = 0; x0 < D; x0 += 64) { \
        __m512i oa[GC][4]; \
        for (int g = 0; g < (GC); g++) \
            for (int x = 0; x < 4; x++) oa[g][x] = _mm512_setzero_si512(); \
        for (int u = 0; u < nk2; u += 2) { \
            const char *r0 = vc + o[u] + x0, *r1 = vc + o[u + 1] + x0; \
            const __m512i a0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)r0)); \
            const __m512i a1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r0 + 32))); \
            const __m512i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)r1)); \
            const __m512i b1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r1 + 32))); \
            const __m512i w[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0), \
                                  _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)}; \
            for (int g = 0; g < (GC); g++) { \
                int32_t pw; \
                memcpy(&pw, pg + (size_t)g * I8_BLOCK + u, 4); \
                const __m512i pp = _mm512_set1_epi32(pw); \
                for (int x = 0; x < 4; x++) oa[g][x] = _mm512_dpwssd_epi32(oa[g][x], pp, w[x]); \
            } \
        } \
        for (int g = 0; g < (GC); g++) { \
            const __m512 va = _mm512_set1_ps(ag[g]), vw = _mm512_set1_ps(wg[g]); \
            for (int x = 0; x < 4; x++) { \
                float *dst = accg + (size_t)g * D + x0 + 16 * x; \
                _mm512_store_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(oa[g][x]), vw, _mm512_mul_ps(_mm512_load_ps(dst), va))); \
            } \
        } \
    } \
} while (0)

/* the dim that position p of DEC_VACC_I8's output holds within its 64-dim chunk: p = 16x + 4L + i
 * (accumulator x, 128-bit lane L, int32 i) holds dim 32 (x >> 1) + 8L + 4 (x & 1) + i */
static inline int i8_perm(int p) {
    const int x = (p >> 4) & 3, L = (p >> 2) & 3, i = p & 3;
    return (p & ~63) | (32 * (x >> 1) + 8 * L + 4 * (x & 1) + i);
}

AVX512VNNI static void dec512_i8vnni(const Problem *P, const Task *T, float *part_m, float *part_l, float *part_acc) {
    const int D = P->d, G = P->group, Q = (T->r1 - T->r0) * G;
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const DecScales sc = dec_scales(P, T, TM_KV_INT8, 1);
    float *qs = alloc64((size_t)Q * D), *acc = alloc64((size_t)Q * D), *sb = alloc64((size_t)Q * I8_BLOCK);
    int16_t *qi = aligned_alloc(64, sizeof(int16_t) * (size_t)Q * D);
    int16_t *pb = aligned_alloc(64, sizeof(int16_t) * (size_t)Q * I8_BLOCK);
    float ksb[I8_BLOCK] __attribute__((aligned(64))), vsb[I8_BLOCK] __attribute__((aligned(64)));
    float m[MAX_QVEC], l[MAX_QVEC], alph[MAX_QVEC], wsc[MAX_QVEC], qscale[MAX_QVEC], bmax[MAX_QVEC];
    int seen_v[MAX_QVEC];
    int64_t vis[MAX_QVEC];
    const char *kc = (const char *)P->kc, *vc = (const char *)P->vc;
    const int nkeys = T->k1 - T->k0;
    int64_t *offs = malloc(sizeof(int64_t) * ((size_t)nkeys + I8_BLOCK));
    key_offsets(P, table, T->kvh, T->k0, T->k1, offs);
    /* past the last key: its row again (a padding key's score is masked and its weight 0) */
    for (int j = nkeys; j < nkeys + I8_BLOCK; j++) offs[j] = offs[nkeys - 1];
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    /* log2 D for scale_index where D is a power of 2 */
    const int dsh = (D & (D - 1)) == 0 ? __builtin_ctz((unsigned)D) : -1;
    memset(acc, 0, sizeof(float) * (size_t)Q * D);
    dec_queries(P, T, sc.qmul, 0, qs, vis);
    for (int v = 0; v < Q; v++) {   /* each query vector to int16 with its own scale (D % 64 == 0) */
        const float *src = qs + (size_t)v * D;
        __m512 mx = _mm512_setzero_ps();
        for (int x = 0; x < D; x += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_load_ps(src + x)));
        const float amax = _mm512_reduce_max_ps(mx);
        const float qsv = amax > 0.f ? amax / 32767.f : 1.f;
        const __m512 inv = _mm512_set1_ps(1.f / qsv);
        for (int x = 0; x < D; x += 16)   /* rounded to nearest even (the default rounding mode), saturated */
            _mm256_store_si256((__m256i *)(qi + (size_t)v * D + x),
                               _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(src + x), inv))));
        qscale[v] = qsv;
        m[v] = -INFINITY;
        l[v] = 0.f;
    }
    prefetch_rows(P, offs, nkeys < DEC_PF ? nkeys : DEC_PF, 1);
    prefetch_scales(P, offs, nkeys < DEC_PF ? nkeys : DEC_PF, dsh);
    for (int j0 = 0; j0 < nkeys; j0 += I8_BLOCK) {
        const int64_t *o = offs + j0;
        const int nk = nkeys - j0 < I8_BLOCK ? nkeys - j0 : I8_BLOCK, nks = (nk + 15) & ~15, nk2 = (nk + 1) & ~1;
        /* each key's K and V scale, at slot * hkv + head = offset / D (gathered 8 at a time) */
        if (dsh >= 0) {
            for (int j = 0; j < nks; j += 8) {
                const __m512i si = _mm512_srli_epi64(_mm512_loadu_si512(o + j), (unsigned)dsh);
                _mm256_store_ps(ksb + j, _mm512_i64gather_ps(si, P->ks, 4));
                _mm256_store_ps(vsb + j, _mm512_i64gather_ps(si, P->vs, 4));
            }
        } else {
            for (int j = 0; j < nks; j++) {
                ksb[j] = P->ks[scale_index(P, o[j], dsh)];
                vsb[j] = P->vs[scale_index(P, o[j], dsh)];
            }
        }
        __m512 vmx = _mm512_setzero_ps();
        for (int h = 0; h < nks / 16; h++) {   /* padding keys: scales 0 */
            const int cnt = nk - 16 * h;
            const __mmask16 live = cnt >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cnt) - 1);
            _mm512_store_ps(ksb + 16 * h, _mm512_maskz_mov_ps(live, _mm512_load_ps(ksb + 16 * h)));
            const __m512 vv = _mm512_maskz_mov_ps(live, _mm512_load_ps(vsb + 16 * h));
            _mm512_store_ps(vsb + 16 * h, vv);
            vmx = _mm512_max_ps(vmx, vv);
        }
        const float vmax = _mm512_reduce_max_ps(vmx);
        const int pfn = j0 + DEC_PF >= nkeys ? 0 : nkeys - j0 - DEC_PF < I8_BLOCK ? nkeys - j0 - DEC_PF : I8_BLOCK;
        const int64_t *pfo = pfn ? o + DEC_PF : o;
        const int64_t pf0 = j0 + DEC_PF;
        for (int jb = 0; jb < nks; jb += 16) {
            if (jb < pfn)   /* the scales' lines DEC_PF keys ahead (the rows go one key at a time, below) */
                prefetch_scales(P, pfo + jb, pfn - jb < 16 ? pfn - jb : 16, dsh);
            for (int g0 = 0, per = dec_pass(Q, 4), pf_on = 1; g0 < Q; g0 += per, pf_on = 0) {
                const int16_t *qg = qi + (size_t)g0 * D;
                const float *qsc = qscale + g0;
                float *s = sb + (size_t)g0 * I8_BLOCK;
                const int gc = Q - g0 < per ? Q - g0 : per;
                if (D == 64) {
                    switch (gc) {
                    case 1: DEC_SCORE_I8(1, 64); break;
                    case 2: DEC_SCORE_I8(2, 64); break;
                    case 3: DEC_SCORE_I8(3, 64); break;
                    default: DEC_SCORE_I8(4, 64); break;
                    }
                } else {
                    switch (gc) {
                    case 1: DEC_SCORE_I8(1, D); break;
                    case 2: DEC_SCORE_I8(2, D); break;
                    case 3: DEC_SCORE_I8(3, D); break;
                    default: DEC_SCORE_I8(4, D); break;
                    }
                }
            }
        }
        /* the block's softmax update, in three passes over the vectors: every vector's masked
         * scores and block maximum; then the rescale factor and the weight bound of 8 vectors
         * at a time by one vector exp (no libm call per vector: 3% of the body in cache); then
         * the weights */
        for (int g = 0; g < Q; g++) {
            float *s = sb + (size_t)g * I8_BLOCK;
            const int seen = vis[g] - j0 < nk ? (int)(vis[g] - j0) : nk;   /* as in dec512_body */
            seen_v[g] = seen;
            if (seen <= 0) continue;
            __m512 mx = ninf;
            for (int h = 0; h < nks / 16; h++) {
                __m512 v = _mm512_mul_ps(_mm512_load_ps(s + 16 * h), _mm512_load_ps(ksb + 16 * h));
                const int cnt = seen - 16 * h;
                if (cnt < 16) v = cnt > 0 ? _mm512_mask_mov_ps(ninf, (__mmask16)((1u << cnt) - 1), v) : ninf;
                _mm512_store_ps(s + 16 * h, v);
                mx = _mm512_max_ps(mx, v);
            }
            bmax[g] = _mm512_reduce_max_ps(mx);
        }
        for (int g0 = 0; g0 < Q; g0 += 8) {
            float arg[16] __attribute__((aligned(64))), ex[16] __attribute__((aligned(64)));
            for (int i = 0; i < 8; i++) {
                const int g = g0 + i;
                arg[i] = arg[8 + i] = -INFINITY;   /* exp: 0 */
                if (g >= Q || seen_v[g] <= 0) continue;
                const float mn = m[g] > bmax[g] ? m[g] : bmax[g];
                arg[i] = m[g] - mn;          /* the old sums' rescale factor (m = -inf at first: 0) */
                arg[8 + i] = bmax[g] - mn;   /* the block's largest weight */
                m[g] = mn;
            }
            _mm512_store_ps(ex, exp512(_mm512_load_ps(arg)));
            for (int i = 0; i < 8 && g0 + i < Q; i++) {
                alph[g0 + i] = ex[i];
                /* the bound of the block's weights times their V scales (with a margin for
                 * exp512's error): no weight saturates its byte */
                wsc[g0 + i] = ex[8 + i] * 1.0001f * vmax;
            }
        }
        for (int g = 0; g < Q; g++) {
            const float *s = sb + (size_t)g * I8_BLOCK;
            int16_t *pq = pb + (size_t)g * I8_BLOCK;
            if (seen_v[g] <= 0) {   /* no key of the block: no weight, the running max and sum stay */
                memset(pq, 0, sizeof(int16_t) * (size_t)nks);
                alph[g] = 1.f;
                wsc[g] = 0.f;
                continue;
            }
            const __m512 vmn = _mm512_set1_ps(m[g]), qmax = _mm512_set1_ps(wsc[g] > 0.f ? 32767.f / wsc[g] : 0.f);
            __m512 vsum = _mm512_setzero_ps();
            for (int h = 0; h < nks / 16; h++) {
                const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(s + 16 * h), vmn));
                vsum = _mm512_add_ps(vsum, p);
                const __m512 w = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_load_ps(vsb + 16 * h)), qmax);
                _mm256_store_si256((__m256i *)(pq + 16 * h), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(w)));
            }
            l[g] = l[g] * alph[g] + _mm512_reduce_add_ps(vsum);
            wsc[g] /= 32767.f;
        }
        for (int g0 = 0, per = dec_pass(Q, 4); g0 < Q; g0 += per) {
            const int16_t *pg = pb + (size_t)g0 * I8_BLOCK;
            const float *ag = alph + g0, *wg = wsc + g0;
            float *accg = acc + (size_t)g0 * D;
            switch (Q - g0 < per ? Q - g0 : per) {
            case 1: DEC_VACC_I8(1); break;
            case 2: DEC_VACC_I8(2); break;
            case 3: DEC_VACC_I8(3); break;
            default: DEC_VACC_I8(4); break;
            }
        }
    }
    for (int v = 0; v < Q; v++) {   /* the output's dims back in order (qs is free by now) */
        float *a = acc + (size_t)v * D;
        for (int x = 0; x < D; x++) qs[i8_perm(x)] = a[x];
        memcpy(a, qs, sizeof(float) * (size_t)D);
    }
    dec_store(P, T, acc, m, l, sc.vmul, 0, part_m, part_l, part_acc);
    free(qs); free(acc); free(sb); free(qi); free(pb); free(offs);
}

/* ---- tiled int8 pages (TM_KV_INT8T) on AVX-512 VNNI ----
 * The layout (attention.h) puts 4 dims of 16 keys in one K line and 4 keys of one dim in one V
 * lane, so both products are vpdpbusd (64 byte products summed 4 by 4 into 16 int32 lanes) with
 * no widening, no shuffles and no transpose tree. The int8 body above issues 12 512-bit
 * multiply-adds per key and kv head for the default model's shape (3 query vectors), and on this
 * project's Intel guest those held it: a 512-bit VNNI instruction issued about 0.6 per cycle, and
 * a scratch body with half of them ran 1.7x faster in cache and 1.3x from DRAM
 * (docs/benchmarks.md, thirty-eighth landing). Here 9:
 *   - scores: each query vector is rounded once per task to 16 bits (amax / 32512) and split
 *     into two signed bytes, q = 256 hi + lo; a 64-byte K line (4 dims of 16 keys, each byte the
 *     code + 128) times the broadcast 4 bytes of those dims, once for hi and once for lo, gives 16
 *     keys' partial sums in their own lanes, exact in int32; the + 128 comes off as 128 * sum(q)
 *     per vector. Times q's scale and each key's K scale. (TOKENMILL_I8T_Q8=1: the query rounded
 *     to int8, one vpdpbusd per line, 6 a key-head in all; 1.06x faster from DRAM, level in the
 *     served rate, and the default model's logits further from an fp32 pool: mean |diff| 0.080
 *     against 0.061 on its decode rows.)
 *   - the softmax update is dec512_body's (a block of I8T_BLOCK keys, float32), the vectors of a
 *     pass in step so that their reductions overlap, e^x by i8t_exp; meanwhile the block's V
 *     lines move from L2 to L1;
 *   - V: in each block and query vector, the key with the largest weight (its softmax weight times
 *     its V scale) is added exactly, in float32; the others' weights are rounded to 8 bits
 *     against the largest of them (so a block holding an attention sink keeps its small weights:
 *     an 8-bit rounding against the sink's weight zeroed them, which cost an earlier 8-bit body 5
 *     points of top-1 agreement), and 4 keys' weights, broadcast, times a V lane of 4 keys gives
 *     16 dims' sums per vpdpbusd. The int32 sums of a block (at most 128 x 255 x 127) are exact
 *     and go into the float32 output times the bound / 255. (TOKENMILL_I8T_W16=1: 16-bit weights
 *     against the block's largest, two vpdpbusd a lane, for A/B checks; no closer to exact.)
 * Needs D of 64 or 128 and page_size % 16 == 0 (pick_kernels); other tasks on tiled pages take the
 * tiled prefill path (task_tiled), which reads the same codes. */
#ifndef I8T_BLOCK
#define I8T_BLOCK 128   /* keys of one softmax update (8 groups of 16) */
#endif
#ifndef I8T_PF
#define I8T_PF 8        /* groups of 16 keys requested ahead of use, into L2 (4 to 16 measured level within 3%) */
#endif
static int g_i8t_q16, g_i8t_w16;

/* e^x for x <= 0 (softmax weights), to a relative error under 3e-6: 2^f by a degree-4 polynomial
 * on f = t - round(t), t = x log2(e), scaled by 2^round(t) with vscalefps (which gives 0 far
 * below; -inf gives 0). Half the instructions of exp512; the weights it feeds are rounded to
 * 8 bits and their sum is taken from the same values. */
AVX512VNNI static inline __attribute__((always_inline)) __m512 i8t_exp(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, r);
    __m512 p = _mm512_set1_ps(9.5605105e-3f);   /* fitted to 2^f, relative error 2.7e-6 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917040e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024981e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312197e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999917e-1f));
    return _mm512_scalef_ps(p, r);
}

/* the lanes x .. x + 15 of a block that lie in [lo, hi) */
static inline __mmask16 i8t_lanes(int x, int lo, int hi) {
    const unsigned a = lo - x <= 0 ? 0xFFFFu : lo - x >= 16 ? 0u : (0xFFFFu << (lo - x)) & 0xFFFFu;
    const unsigned b = hi - x >= 16 ? 0xFFFFu : hi - x <= 0 ? 0u : (1u << (hi - x)) - 1u;
    return (__mmask16)(a & b);
}

/* the int8 / split int16 query of one vector: qb[0 .. D) (int8, or the high bytes) and
 * qb[D .. 2D) (the low bytes, as signed bytes: q = 256 hi + lo), its scale and 128 * sum(q) */
AVX512VNNI static inline void i8t_query(const float *src, int D, int q16, int8_t *qb, float *qscale, int32_t *corr) {
    __m512 mx = _mm512_setzero_ps();
    for (int x = 0; x < D; x += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(src + x)));
    const float amax = _mm512_reduce_max_ps(mx);
    const float qmax = q16 ? 32512.f : 127.f;   /* 32512 = 127 * 256: the high byte stays within +-127 */
    const float qs = amax > 0.f ? amax / qmax : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / qs), lim = _mm512_set1_ps(qmax);
    __m512i sum = _mm512_setzero_si512();
    for (int x = 0; x < D; x += 16) {   /* rounded to nearest even, within +-qmax */
        const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(src + x), inv), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
        const __m512i q = _mm512_cvtps_epi32(y);
        sum = _mm512_add_epi32(sum, q);
        if (q16) {   /* q = 256 hi + lo, lo in [-128, 127] */
            const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, _mm512_set1_epi32(128)), _mm512_set1_epi32(255)),
                                                _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i *)(qb + x), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(q, lo), 8)));
            _mm_storeu_si128((__m128i *)(qb + D + x), _mm512_cvtepi32_epi8(lo));
        } else {
            _mm_storeu_si128((__m128i *)(qb + x), _mm512_cvtepi32_epi8(q));
        }
    }
    *qscale = qs;
    *corr = 128 * _mm512_reduce_add_epi32(sum);
}

/* One block's scores for GC vectors (queries qb + v * 2D, vectors v0 ..): group i's K lines at
 * kt[i] (line of dim quad c at kt[i] + c * ps * 4), into s[v * I8T_BLOCK + 16 i + lane] as
 * floats (unmasked). DX: D as a constant where it is one. */
#define I8T_SCORES(GC, DX) do { \
    __m512 bmx[GC]; \
    _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) bmx[g] = _mm512_set1_ps(-INFINITY); \
    for (int i = 0; i < ngr; i++) { \
        const char *pk_ = NULL, *pv_ = NULL;   /* the group I8T_PF ahead: its scale lines now, K and V lines below */ \
        if (v0 == 0 && b0 / 16 + i + I8T_PF < g_end) { \
            int64_t sp_; \
            I8T_GROUP(b0 / 16 + i + I8T_PF, pk_, pv_, sp_); \
            kv_prefetch((const char *)(P->ks + sp_)); \
            kv_prefetch((const char *)(P->vs + sp_)); \
        } \
        __m512i ah[GC], al[GC]; \
        _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) ah[g] = al[g] = _mm512_setzero_si512(); \
        _Pragma("GCC unroll 16") \
        for (int c = 0; c < (DX) / 4; c++) { \
            const __m512i kz = _mm512_load_si512(kt[i] + (size_t)c * ps4); \
            if (pk_) {   /* one K line and one V line of it with each K line used (D / 4 of each) */ \
                kv_prefetch(pk_ + (size_t)c * ps4); \
                kv_prefetch(pv_ + 64 * c); \
            } \
            _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
                const int8_t *qv = qb + (size_t)(v0 + g) * 2 * (DX); \
                int32_t qh; \
                memcpy(&qh, qv + 4 * c, 4); \
                if (q16) { \
                    int32_t ql; \
                    memcpy(&ql, qv + (DX) + 4 * c, 4); \
                    ah[g] = _mm512_dpbusd_epi32(ah[g], kz, _mm512_set1_epi32(qh)); \
                    al[g] = _mm512_dpbusd_epi32(al[g], kz, _mm512_set1_epi32(ql)); \
                } else if (c & 1) {   /* int8: odd and even quads in two chains */ \
                    al[g] = _mm512_dpbusd_epi32(al[g], kz, _mm512_set1_epi32(qh)); \
                } else { \
                    ah[g] = _mm512_dpbusd_epi32(ah[g], kz, _mm512_set1_epi32(qh)); \
                } \
            } \
        } \
        const __m512 ks_ = _mm512_load_ps(ksb + 16 * i); \
        _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) {   /* times q's and the keys' scales, masked */ \
            const int v = v0 + g; \
            __m512i t = _mm512_add_epi32(q16 ? _mm512_slli_epi32(ah[g], 8) : ah[g], al[g]); \
            t = _mm512_sub_epi32(t, _mm512_set1_epi32(corr[v])); \
            const __m512 f = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), i8t_lanes(16 * i, blo[v], bhi[v]), \
                                                _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(qscale[v])), ks_); \
            _mm512_store_ps(sb + (size_t)v * I8T_BLOCK + 16 * i, f); \
            bmx[g] = _mm512_max_ps(bmx[g], f); \
        } \
    } \
    _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) bmax[v0 + g] = _mm512_reduce_max_ps(bmx[g]); \
} while (0)

/* One block's V sums for GC vectors: group i's slot quad u at vt[i] + u * D * 4 (D / 16 lines of
 * 16 dims x 4 keys), each vector's byte weights at wb + v * 2 * I8T_BLOCK (high bytes after the
 * low ones with W16), into acc[v] times wsc[v] */
#define I8T_VSUMS(GC, DX) do { \
    __m512i oh[GC][8], ol[GC][8];   /* fixed sizes (a size of DX / 16 made them arrays in memory) */ \
    _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) \
        _Pragma("GCC unroll 8") for (int c = 0; c < (DX) / 16; c++) oh[g][c] = ol[g][c] = _mm512_setzero_si512(); \
    for (int i = 0; i < ngr; i++) \
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) { \
            __m512i vz[8]; \
            _Pragma("GCC unroll 8") for (int c = 0; c < (DX) / 16; c++) vz[c] = _mm512_load_si512(vt[i] + (size_t)u * (DX) * 4 + 64 * c); \
            _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
                const uint8_t *w = wb + (size_t)(v0 + g) * 2 * I8T_BLOCK + 16 * i + 4 * u; \
                int32_t x; \
                memcpy(&x, w, 4); \
                const __m512i bw = _mm512_set1_epi32(x); \
                _Pragma("GCC unroll 8") for (int c = 0; c < (DX) / 16; c++) oh[g][c] = _mm512_dpbusd_epi32(oh[g][c], bw, vz[c]); \
                if (w16) { \
                    memcpy(&x, w + I8T_BLOCK, 4); \
                    const __m512i bh = _mm512_set1_epi32(x); \
                    _Pragma("GCC unroll 8") for (int c = 0; c < (DX) / 16; c++) ol[g][c] = _mm512_dpbusd_epi32(ol[g][c], bh, vz[c]); \
                } \
            } \
        } \
    _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
        const __m512 ws = _mm512_set1_ps(wsc[v0 + g]); \
        float *a = acc + (size_t)(v0 + g) * (DX); \
        _Pragma("GCC unroll 8") for (int c = 0; c < (DX) / 16; c++) { \
            const __m512i t = w16 ? _mm512_add_epi32(oh[g][c], _mm512_slli_epi32(ol[g][c], 8)) : oh[g][c]; \
            _mm512_store_ps(a + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), ws, _mm512_load_ps(a + 16 * c))); \
        } \
    } \
} while (0)

/* One block's softmax update for GC vectors from v0, in step (their reductions overlap): each
 * vector's keys [lo, hi) of the block (the task's that its row sees) masked, the block maximum,
 * the rescale factors (one vector exp), then the weights p times the V scale with per lane the
 * largest (and its key) and the second largest, and the byte weights (I8T_BLOCK low bytes, then
 * with W16 the high ones) with wsc[v] their unit; without W16 the top key's V row goes into acc
 * exactly. A vector with no key in the block keeps its state and gets zero weights. */
#define I8T_SOFTMAX(GC, DX) do { \
    int on_[GC]; \
    float arg_[16] __attribute__((aligned(64))); \
    for (int i = 0; i < 16; i++) arg_[i] = -INFINITY; \
    _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
        const int v = v0 + g; \
        on_[g] = bhi[v] > blo[v]; \
        if (!on_[g]) continue; \
        const float bm = bmax[v], mn = m[v] > bm ? m[v] : bm; \
        arg_[g] = m[v] - mn;   /* -inf at first: exp 0 */ \
        m[v] = mn; \
    } \
    _mm512_store_ps(arg_, exp512(_mm512_load_ps(arg_))); \
    __m512 sum_[GC], m1_[GC], m2_[GC], vm_[GC]; \
    __m512i i1_[GC]; \
    _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
        sum_[g] = m1_[g] = m2_[g] = _mm512_setzero_ps(); \
        i1_[g] = _mm512_setzero_si512(); \
        vm_[g] = _mm512_set1_ps(m[v0 + g]); \
    } \
    for (int x = 0; x < nk; x += 16) { \
        if (v0 == 0)   /* the block's V lines from L2 into L1 while its weights are worked out, for I8T_VSUMS \
                        * (0.30 against 0.33 ms per 16k layer from DRAM; the K lines likewise gained nothing) */ \
            for (int c_ = 0; c_ < (DX) / 4; c_++) _mm_prefetch(vt[x / 16] + 64 * c_, _MM_HINT_T0); \
        const __m512 vs_ = _mm512_load_ps(vsb + x); \
        _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
            float *s = sb + (size_t)(v0 + g) * I8T_BLOCK + x; \
            const __m512 p = i8t_exp(_mm512_sub_ps(_mm512_load_ps(s), vm_[g])); \
            sum_[g] = _mm512_add_ps(sum_[g], p); \
            const __m512 w = _mm512_mul_ps(p, vs_); \
            _mm512_store_ps(s, w); \
            if (!w16) { \
                i1_[g] = _mm512_mask_mov_epi32(i1_[g], _mm512_cmp_ps_mask(w, m1_[g], _CMP_GT_OQ), _mm512_set1_epi32(x)); \
                m2_[g] = _mm512_max_ps(m2_[g], _mm512_min_ps(m1_[g], w)); \
            } \
            m1_[g] = _mm512_max_ps(m1_[g], w); \
        } \
    } \
    float top_w[GC], qm_[GC]; \
    int top_[GC]; \
    _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
        const int v = v0 + g; \
        top_[g] = -1; \
        qm_[g] = 0.f; \
        top_w[g] = 0.f; \
        if (!on_[g]) { wsc[v] = 0.f; continue; } \
        l[v] = l[v] * arg_[g] + _mm512_reduce_add_ps(sum_[g]); \
        float *a = acc + (size_t)v * (DX); \
        const __m512 va = _mm512_set1_ps(arg_[g]); \
        _Pragma("GCC unroll 8") for (int c = 0; c < (DX) / 16; c++) _mm512_store_ps(a + 16 * c, _mm512_mul_ps(_mm512_load_ps(a + 16 * c), va)); \
        const float wtop = _mm512_reduce_max_ps(m1_[g]); \
        if (w16) { \
            qm_[g] = wtop > 0.f ? 32767.f / wtop : 0.f; \
            wsc[v] = wtop / 32767.f; \
            continue; \
        } \
        const unsigned ln = (unsigned)__builtin_ctz((unsigned)_mm512_cmp_ps_mask(m1_[g], _mm512_set1_ps(wtop), _CMP_EQ_OQ) | 0x10000u) & 15u; \
        int32_t o16[16] __attribute__((aligned(64))); \
        _mm512_store_si512(o16, i1_[g]); \
        top_[g] = o16[ln] + (int)ln; \
        top_w[g] = wtop; \
        const float rest = _mm512_reduce_max_ps(_mm512_max_ps(m2_[g], _mm512_maskz_mov_ps((__mmask16)~(1u << ln), m1_[g]))); \
        qm_[g] = rest > 0.f ? 255.f / rest : 0.f; \
        wsc[v] = rest / 255.f; \
    } \
    for (int x = 0; x < nk; x += 16) { \
        _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
            const float *s = sb + (size_t)(v0 + g) * I8T_BLOCK + x; \
            uint8_t *w8 = wb + (size_t)(v0 + g) * 2 * I8T_BLOCK + x; \
            const __m512 y = _mm512_mul_ps(_mm512_load_ps(s), _mm512_set1_ps(qm_[g])); \
            if (w16) { \
                const __m512i q = _mm512_cvtps_epi32(y); \
                _mm_store_si128((__m128i *)w8, _mm512_cvtepi32_epi8(q)); \
                _mm_store_si128((__m128i *)(w8 + I8T_BLOCK), _mm512_cvtepi32_epi8(_mm512_srli_epi32(q, 8))); \
            } else { \
                const __mmask16 keep = (top_[g] & ~15) == x ? (__mmask16)~(1u << (top_[g] & 15)) : (__mmask16)0xFFFF; \
                _mm_store_si128((__m128i *)w8, _mm512_cvtepi32_epi8(_mm512_maskz_cvtps_epi32(keep, y))); \
            } \
        } \
    } \
    if (!w16) \
        _Pragma("GCC unroll 4") for (int g = 0; g < (GC); g++) { \
            if (top_[g] < 0 || !(top_w[g] > 0.f)) continue; \
            const int t = top_[g] % 16; \
            const char *row = vt[top_[g] / 16] + (size_t)(t / 4) * (DX) * 4; \
            float *a = acc + (size_t)(v0 + g) * (DX); \
            const __m512 wt = _mm512_set1_ps(top_w[g]); \
            _Pragma("GCC unroll 8") for (int c = 0; c < (DX) / 16; c++) { \
                const __m512i e = _mm512_srai_epi32(_mm512_slli_epi32(_mm512_load_si512(row + 64 * c), 24 - 8 * (t % 4)), 24); \
                _mm512_store_ps(a + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), wt, _mm512_load_ps(a + 16 * c))); \
            } \
        } \
} while (0)

AVX512VNNI static inline __attribute__((always_inline)) void i8t_body(const Problem *P, const Task *T, float *part_m,
                                                                    float *part_l, float *part_acc, const int DX,
                                                                    const int q16, const int w16) {
    const int D = DX, G = P->group, Q = (T->r1 - T->r0) * G, ps = P->page_size, hkv = P->hkv, h = T->kvh;
    const size_t ps4 = (size_t)ps * 4;
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const char *kc = (const char *)P->kc, *vc = (const char *)P->vc;
    /* a decode row's buffers on the stack (six allocations per task were 1,440 pairs of malloc and
     * free in a 16k step of the default model); a chunk of many rows allocates */
    enum { SQ = 12 };
    float qs_s[SQ * 128] __attribute__((aligned(64))), acc_s[SQ * 128] __attribute__((aligned(64)));
    float sb_s[SQ * I8T_BLOCK] __attribute__((aligned(64)));
    int8_t qb_s[SQ * 2 * 128] __attribute__((aligned(64)));
    uint8_t wb_s[SQ * 2 * I8T_BLOCK] __attribute__((aligned(64)));
    const int on_stack = Q <= SQ;
    float *qs = on_stack ? qs_s : alloc64((size_t)Q * D), *acc = on_stack ? acc_s : alloc64((size_t)Q * D);
    float *sb = on_stack ? sb_s : alloc64((size_t)Q * I8T_BLOCK);
    int8_t *qb = on_stack ? qb_s : aligned_alloc(64, (size_t)Q * 2 * D);
    uint8_t *wb = on_stack ? wb_s : aligned_alloc(64, (size_t)Q * 2 * I8T_BLOCK);
    float ksb[I8T_BLOCK] __attribute__((aligned(64))), vsb[I8T_BLOCK] __attribute__((aligned(64)));
    float m[MAX_QVEC], l[MAX_QVEC], qscale[MAX_QVEC], wsc[MAX_QVEC], bmax[MAX_QVEC];
    int32_t corr[MAX_QVEC];
    int blo[MAX_QVEC], bhi[MAX_QVEC];
    int64_t vis[MAX_QVEC];
    dec_queries(P, T, P->scale, 0, qs, vis);
    for (int v = 0; v < Q; v++) {
        i8t_query(qs + (size_t)v * D, D, q16, qb + (size_t)v * 2 * D, &qscale[v], &corr[v]);
        m[v] = -INFINITY;
        l[v] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)Q * D);
    const int64_t k0 = T->k0, k1 = T->k1;
    const int64_t first = k0 & ~(int64_t)15;   /* groups of 16 keys, aligned (page_size % 16 == 0) */
    /* each group's (page * hkv + head) * page_size + first slot, walked page by page (a division
     * per group cost more than its arithmetic) */
    const int64_t g_first = first / 16, g_end = (k1 + 15) / 16, ngroups = g_end - g_first;
    int64_t gpos_s[2 * 160];
    int64_t *gpos = ngroups <= 160 ? gpos_s : malloc(sizeof(int64_t) * 2 * (size_t)ngroups);
    {
        int64_t page = first / ps, slot = first % ps;
        for (int64_t g = 0; g < ngroups; g++) {
            gpos[2 * g] = (table[page] * hkv + h) * ps;
            gpos[2 * g + 1] = slot;
            if ((slot += 16) == ps) { slot = 0; page++; }
        }
    }
    /* the K / V lines and scale index of group gi (absolute key gi * 16): the tile at
     * (page * hkv + head) * page_size * D, K lines from + slot * 4, V from + slot * D */
#define I8T_GROUP(gi, ktp, vtp, scp) do { \
        const int64_t ph_ = gpos[2 * ((gi) - g_first)], s_ = gpos[2 * ((gi) - g_first) + 1]; \
        ktp = kc + ph_ * D + s_ * 4; \
        vtp = vc + ph_ * D + s_ * D; \
        scp = ph_ + s_; \
    } while (0)
    /* request group gi's K lines (D / 4, page_size * 4 bytes apart), V lines (16 D bytes in a row)
     * and its two lines of scales, at once: for the task's first I8T_PF groups. The later ones are
     * requested line by line as the scores go (I8T_SCORES). Asked for as one burst of 2 + D / 2
     * prefetches at the start of each group, they held the body back: 0.37 against 0.33 ms per
     * 16k layer from DRAM, 0.21 against 0.19 from L3 (docs/benchmarks.md, thirty-ninth landing) */
#define I8T_PREFETCH(gi) do { \
        const char *kp_, *vp_; \
        int64_t sp_; \
        I8T_GROUP(gi, kp_, vp_, sp_); \
        for (int c_ = 0; c_ < D / 4; c_++) kv_prefetch(kp_ + (size_t)c_ * ps4); \
        for (int c_ = 0; c_ < D * 16; c_ += 64) kv_prefetch(vp_ + c_); \
        kv_prefetch((const char *)(P->ks + sp_)); \
        kv_prefetch((const char *)(P->vs + sp_)); \
    } while (0)
    for (int64_t gi = first / 16; gi < first / 16 + I8T_PF && gi < g_end; gi++) I8T_PREFETCH(gi);
    for (int64_t b0 = first; b0 < k1; b0 += I8T_BLOCK) {
        const int ngr = (int)((k1 - b0 + 15) / 16 < I8T_BLOCK / 16 ? (k1 - b0 + 15) / 16 : I8T_BLOCK / 16);
        const char *kt[I8T_BLOCK / 16], *vt[I8T_BLOCK / 16];
        for (int i = 0; i < ngr; i++) {
            const int64_t gi = b0 / 16 + i;
            int64_t sp;
            I8T_GROUP(gi, kt[i], vt[i], sp);
            _mm512_store_ps(ksb + 16 * i, _mm512_loadu_ps(P->ks + sp));
            _mm512_store_ps(vsb + 16 * i, _mm512_loadu_ps(P->vs + sp));
        }
        const int nk = ngr * 16;
        for (int v = 0; v < Q; v++) {   /* keys [blo, bhi) of the block are the vector's: the task's and the ones its row sees */
            const int64_t kvis = k0 + vis[v] < k1 ? k0 + vis[v] : k1;
            blo[v] = (int)(k0 > b0 ? k0 - b0 : 0);
            bhi[v] = (int)(kvis - b0 < nk ? (kvis - b0 > 0 ? kvis - b0 : 0) : nk);
        }
        for (int v0 = 0, per = dec_pass(Q, 4); v0 < Q; v0 += per) {   /* scores: 2 accumulators a vector */
            switch (Q - v0 < per ? Q - v0 : per) {
            case 1: I8T_SCORES(1, DX); break;
            case 2: I8T_SCORES(2, DX); break;
            case 3: I8T_SCORES(3, DX); break;
            default: I8T_SCORES(4, DX); break;
            }
        }
        /* the softmax update and the weights, GC vectors in step (I8T_SOFTMAX) */
        for (int v0 = 0, per = dec_pass(Q, 4); v0 < Q; v0 += per) {
            switch (Q - v0 < per ? Q - v0 : per) {
            case 1: I8T_SOFTMAX(1, DX); break;
            case 2: I8T_SOFTMAX(2, DX); break;
            case 3: I8T_SOFTMAX(3, DX); break;
            default: I8T_SOFTMAX(4, DX); break;
            }
        }
        /* V: D / 16 accumulators a vector (twice that with 16-bit weights), so 4 vectors a pass at
         * D = 64, 2 at D = 128 */
        for (int v0 = 0, per = dec_pass(Q, DX == 64 && !w16 ? 4 : 2); v0 < Q; v0 += per) {
            switch (Q - v0 < per ? Q - v0 : per) {
            case 1: I8T_VSUMS(1, DX); break;
            case 2: I8T_VSUMS(2, DX); break;
            case 3: I8T_VSUMS(3, DX); break;
            default: I8T_VSUMS(4, DX); break;
            }
        }
    }
#undef I8T_GROUP
#undef I8T_PREFETCH
    dec_store(P, T, acc, m, l, 1.f, 0, part_m, part_l, part_acc);
    if (!on_stack) {
        free(qs); free(acc); free(sb); free(qb); free(wb);
    }
    if (gpos != gpos_s) free(gpos);
}

/* the body for the task's head size and the A/B switches (each a specialised copy) */
AVX512VNNI static void dec512_i8t_64(const Problem *P, const Task *T, float *m, float *l, float *a) {
    i8t_body(P, T, m, l, a, 64, 1, 0);
}
AVX512VNNI static void dec512_i8t_128(const Problem *P, const Task *T, float *m, float *l, float *a) {
    i8t_body(P, T, m, l, a, 128, 1, 0);
}
AVX512VNNI static void dec512_i8t_ab(const Problem *P, const Task *T, float *m, float *l, float *a) {
    if (P->d == 64) {
        if (g_i8t_q16 && g_i8t_w16) i8t_body(P, T, m, l, a, 64, 1, 1);
        else if (g_i8t_w16) i8t_body(P, T, m, l, a, 64, 0, 1);
        else i8t_body(P, T, m, l, a, 64, 0, 0);
    } else {
        i8t_body(P, T, m, l, a, 128, g_i8t_q16, g_i8t_w16);
    }
}
AVX512VNNI static void dec512_i8t(const Problem *P, const Task *T, float *m, float *l, float *a) {
    if (!g_i8t_q16 || g_i8t_w16) dec512_i8t_ab(P, T, m, l, a);
    else if (P->d == 64) dec512_i8t_64(P, T, m, l, a);
    else dec512_i8t_128(P, T, m, l, a);
}

/* e4m3_to_float's path 3: fp8x64 (64 bytes at a time, dims back in order; tail by the table) */
AVX512V static void widen8_avx512_table(float *dst, const uint8_t *src, int n, float scale) {
    const E4m3Tab tab = e4m3_tab();
    const __m512 mul = _mm512_set1_ps(scale);
    int x = 0;
    for (; x + 64 <= n; x += 64) {
        __m512 w[4];
        float tmp[64];
        fp8x64(src + x, &tab, w);
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(tmp + 16 * t, _mm512_mul_ps(w[t], mul));
        for (int i = 0; i < 64; i++) dst[x + dec_perm(i)] = tmp[i];
    }
    widen8_scalar(dst + x, src + x, n - x, scale);
}

/* Sixteen cache elements at p as two vectors of float32 (fp8: times 2^-8): fp8 bytes widened 16
 * at a time (one sign extension, shift and mask for both halves, as fp8x8) */
AVX2 static inline __attribute__((always_inline)) void ld8x2(const void *p, int kind, __m256 *lo, __m256 *hi) {
    if (kind == TM_KV_FP8 || kind == TM_KV_FP8_TOKEN) {
        const __m256i w = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                           _mm256_set1_epi16((short)0xBFFF));
        *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
        *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
        return;
    }
    *lo = ld8(p, kind);
    *hi = ld8((const char *)p + 8 * kv_esz(kind), kind);
}

/* acc[g] = acc[g] * alpha[g] + sum_u p[g][u] v_u for GC <= 3 query vectors and 16 dims at a time
 * (each V row widened once for up to 3 query vectors). Even and odd keys go to two sets of
 * accumulators, added at the end: with one set, each key's FMAs waited on the previous key's. */
#define DEC_VKEY256(GC, A, U) do {   /* key U's V row (16 dims at x0) into accumulators A */ \
    __m256 v0, v1; \
    ld8x2(vp[U] + (size_t)x0 * esz, kind, &v0, &v1); \
    for (int g = 0; g < (GC); g++) { \
        const __m256 pu = _mm256_set1_ps(p[g * DEC_BLOCK + (U)]); \
        A[g][0] = _mm256_fmadd_ps(pu, v0, A[g][0]); \
        A[g][1] = _mm256_fmadd_ps(pu, v1, A[g][1]); \
    } \
} while (0)
#define DEC_VACC256(GC) do { \
    for (int x0 = 0; x0 < D; x0 += 16) { \
        __m256 o[GC][2], e[GC][2]; \
        for (int g = 0; g < (GC); g++) { \
            const __m256 va = _mm256_set1_ps(alpha[g]); \
            o[g][0] = _mm256_mul_ps(_mm256_load_ps(acc + g * D + x0), va); \
            o[g][1] = _mm256_mul_ps(_mm256_load_ps(acc + g * D + x0 + 8), va); \
            e[g][0] = e[g][1] = _mm256_setzero_ps(); \
        } \
        int u = 0; \
        for (; u + 2 <= nk; u += 2) { \
            DEC_VKEY256(GC, o, u); \
            DEC_VKEY256(GC, e, u + 1); \
        } \
        if (u < nk) DEC_VKEY256(GC, o, u); \
        for (int g = 0; g < (GC); g++) { \
            _mm256_store_ps(acc + g * D + x0, _mm256_add_ps(o[g][0], e[g][0])); \
            _mm256_store_ps(acc + g * D + x0 + 8, _mm256_add_ps(o[g][1], e[g][1])); \
        } \
    } \
} while (0)

AVX2 static inline __attribute__((always_inline)) void dec_vacc256(float *acc, const float *p, const float *alpha,
                                                                 const char *const *vp, int nk, int G, int D, const int kind) {
    const size_t esz = kv_esz(kind);
    if (D % 16) {   /* head dims of 8 + 16k: the per-row bodies' accumulation */
        vaccum_avx2(acc, p, alpha, vp, nk, G, D, kind, DEC_BLOCK);
        return;
    }
    const int per = dec_pass(G, 3);
    for (int g0 = 0; g0 < G; g0 += per, acc += (size_t)per * D, p += per * DEC_BLOCK, alpha += per) {
        switch (G - g0 < per ? G - g0 : per) {
        case 1: DEC_VACC256(1); break;
        case 2: DEC_VACC256(2); break;
        default: DEC_VACC256(3); break;
        }
    }
}

/* The AVX2 decode body: 8 keys' scores per vector (two red4 results, lanes 0-3 and 4-7). */
AVX2 static inline __attribute__((always_inline)) __m256 red4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 b01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 b23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(b01), _mm256_castps_pd(b23))),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(b01), _mm256_castps_pd(b23))));
}

/* Scores of 8 keys for GC <= 3 query vectors. The 4 keys of a half are walked together, 16 dims
 * at a time, so that the GC x 4 accumulators form independent chains of two FMAs per step: with
 * the keys one after another, each step's FMAs waited on the one before (latency-bound). */
#define DEC_SCORE256(GC) do { \
    __m256 c0[GC]; \
    for (int g = 0; g < (GC); g++) c0[g] = _mm256_setzero_ps(); \
    for (int kq = 0; kq < 2; kq++) { \
        __m256 a[GC][4]; \
        const char *k4[4]; \
        for (int k = 0; k < 4; k++) { \
            k4[k] = kp[jb + 4 * kq + k]; \
            if (pf_on && pf0 + jb + 4 * kq + k < nkeys) /* as in DEC_SCORE512 */ \
                prefetch_row_pair(P, offs[pf0 + jb + 4 * kq + k], esz, rowb); \
        } \
        for (int g = 0; g < (GC); g++) \
            for (int k = 0; k < 4; k++) a[g][k] = _mm256_setzero_ps(); \
        int x = 0; \
        /* 16 dims a step while the queries' vectors and 4 x GC accumulators fit the 16 ymm \
         * registers; with 3 queries 8 a step (3 query vectors, 12 accumulators, one key vector): \
         * 16 a step, gcc kept four accumulators on the stack */ \
        for (; (GC) < 3 && x + 16 <= D; x += 16) { \
            for (int k = 0; k < 4; k++) { \
                __m256 w0, w1; \
                ld8x2(k4[k] + (size_t)x * esz, kind, &w0, &w1); \
                for (int g = 0; g < (GC); g++) { \
                    a[g][k] = _mm256_fmadd_ps(w0, _mm256_load_ps(qg + g * D + x), a[g][k]); \
                    a[g][k] = _mm256_fmadd_ps(w1, _mm256_load_ps(qg + g * D + x + 8), a[g][k]); \
                } \
            } \
        } \
        for (; (GC) >= 3 && x + 8 <= D; x += 8) { \
            for (int k = 0; k < 4; k++) { \
                const __m256 w = ld8(k4[k] + (size_t)x * esz, kind); \
                for (int g = 0; g < (GC); g++) a[g][k] = _mm256_fmadd_ps(w, _mm256_load_ps(qg + g * D + x), a[g][k]); \
            } \
        } \
        if (x < D) { \
            for (int k = 0; k < 4; k++) { \
                const __m256 w = ld8(k4[k] + (size_t)x * esz, kind); \
                for (int g = 0; g < (GC); g++) a[g][k] = _mm256_fmadd_ps(w, _mm256_load_ps(qg + g * D + x), a[g][k]); \
            } \
        } \
        for (int g = 0; g < (GC); g++) { \
            const __m256 c = red4_256(a[g][0], a[g][1], a[g][2], a[g][3]); \
            if (kq == 0) c0[g] = c; \
            else _mm256_store_ps(s + g * DEC_BLOCK + jb, _mm256_add_ps(_mm256_permute2f128_ps(c0[g], c, 0x20), \
                                                                       _mm256_permute2f128_ps(c0[g], c, 0x31))); \
        } \
    } \
} while (0)

AVX2 static inline __attribute__((always_inline)) void dec256_body(const Problem *P, const Task *T, float *part_m,
                                                                 float *part_l, float *part_acc, const int kind) {
    const int D = P->d, G = P->group, Q = (T->r1 - T->r0) * G;
    const size_t esz = kv_esz(kind), rowb = (size_t)D * esz;   /* bytes of a K or V row */
    const int64_t *table = P->bt + (int64_t)T->seq * P->bt_stride;
    const DecScales sc = dec_scales(P, T, kind, 0);
    float *qs = alloc64((size_t)Q * D), *acc = alloc64((size_t)Q * D), *sb = alloc64((size_t)Q * DEC_BLOCK);
    float ksb[DEC_BLOCK] __attribute__((aligned(64))), vsb[DEC_BLOCK] __attribute__((aligned(64)));
    float m[MAX_QVEC], l[MAX_QVEC], alph[MAX_QVEC];
    int64_t vis[MAX_QVEC];
    const char *kp[DEC_BLOCK], *vp[DEC_BLOCK];
    /* the element offsets of the task's keys, computed once (per block, and again for the
     * prefetch, they cost as much as a fifth of the decode) */
    const int nkeys = T->k1 - T->k0;
    int64_t *offs = malloc(sizeof(int64_t) * ((size_t)nkeys + DEC_BLOCK));
    key_offsets(P, table, T->kvh, T->k0, T->k1, offs);
    const __m256 ninf = _mm256_set1_ps(-INFINITY), lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    memset(acc, 0, sizeof(float) * (size_t)Q * D);
    dec_queries(P, T, sc.qmul, 0, qs, vis);
    for (int v = 0; v < Q; v++) {
        m[v] = -INFINITY;
        l[v] = 0.f;
    }
    {
        prefetch_rows(P, offs, nkeys < DEC_PF ? nkeys : DEC_PF, esz);
    }
    for (int j0 = 0; j0 < nkeys; j0 += DEC_BLOCK) {
        const int64_t *o = offs + j0;
        const int nk = nkeys - j0 < DEC_BLOCK ? nkeys - j0 : DEC_BLOCK, nks = (nk + 7) & ~7;
        for (int j = 0; j < nk; j++) {
            kp[j] = (const char *)P->kc + o[j] * esz;
            vp[j] = (const char *)P->vc + o[j] * esz;
        }
        for (int j = nk; j < nks; j++) kp[j] = kp[nk - 1];   /* padding: a real row, its score masked */
        if (TM_KV_TOKEN_SCALES(kind)) {
            for (int j = 0; j < nk; j++) { ksb[j] = P->ks[o[j] / D]; vsb[j] = P->vs[o[j] / D]; }
            for (int j = nk; j < nks; j++) ksb[j] = vsb[j] = 0.f;
        }
        const int64_t pf0 = j0 + DEC_PF;   /* the keys DEC_PF ahead, one at a time (as dec512_body) */
        for (int jb = 0; jb < nks; jb += 8) {
            for (int g0 = 0, per = dec_pass(Q, 3), pf_on = 1; g0 < Q; g0 += per, pf_on = 0) {
                const float *qg = qs + (size_t)g0 * D;
                float *s = sb + (size_t)g0 * DEC_BLOCK;
                switch (Q - g0 < per ? Q - g0 : per) {
                case 1: DEC_SCORE256(1); break;
                case 2: DEC_SCORE256(2); break;
                default: DEC_SCORE256(3); break;
                }
            }
        }
        for (int g = 0; g < Q; g++) {
            float *s = sb + (size_t)g * DEC_BLOCK;
            const int seen = vis[g] - j0 < nk ? (int)(vis[g] - j0) : nk;   /* as in dec512_body */
            if (seen <= 0) {
                memset(s, 0, sizeof(float) * (size_t)nks);
                alph[g] = 1.f;
                continue;
            }
            __m256 sv[DEC_BLOCK / 8], mx = ninf;
            for (int h = 0; h < nks / 8; h++) {
                __m256 v = _mm256_load_ps(s + 8 * h);
                if (TM_KV_TOKEN_SCALES(kind)) v = _mm256_mul_ps(v, _mm256_load_ps(ksb + 8 * h));
                const int cnt = seen - 8 * h;
                if (cnt < 8) v = _mm256_blendv_ps(ninf, v, _mm256_cmp_ps(lane, _mm256_set1_ps((float)cnt), _CMP_LT_OQ));
                sv[h] = v;
                mx = _mm256_max_ps(mx, v);
            }
            __m128 hm = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            hm = _mm_max_ps(hm, _mm_movehl_ps(hm, hm));
            hm = _mm_max_ss(hm, _mm_movehdup_ps(hm));
            const float bm = _mm_cvtss_f32(hm);
            const float mn = m[g] > bm ? m[g] : bm;
            const float alpha = expf(m[g] - mn);
            const __m256 vmn = _mm256_set1_ps(mn);
            __m256 vsum = _mm256_setzero_ps();
            for (int h = 0; h < nks / 8; h++) {
                const __m256 p = exp256(_mm256_sub_ps(sv[h], vmn));
                vsum = _mm256_add_ps(vsum, p);
                _mm256_store_ps(s + 8 * h, TM_KV_TOKEN_SCALES(kind) ? _mm256_mul_ps(p, _mm256_load_ps(vsb + 8 * h)) : p);
            }
            l[g] = l[g] * alpha + hsum256(vsum);
            m[g] = mn;
            alph[g] = alpha;
        }
        dec_vacc256(acc, sb, alph, vp, nk, Q, D, kind);
    }
    dec_store(P, T, acc, m, l, sc.vmul, 0, part_m, part_l, part_acc);
    free(qs); free(acc); free(sb); free(offs);
}

AVX2 static void dec256_f32(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec256_body(P, T, m, l, a, TM_KV_F32);
}
AVX2 static void dec256_bf16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec256_body(P, T, m, l, a, TM_KV_BF16);
}
AVX2 static void dec256_f16(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec256_body(P, T, m, l, a, TM_KV_F16);
}
AVX2 static void dec256_fp8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec256_body(P, T, m, l, a, TM_KV_FP8);
}
AVX2 static void dec256_fp8_token(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec256_body(P, T, m, l, a, TM_KV_FP8_TOKEN);
}
AVX2 static void dec256_int8(const Problem *P, const Task *T, float *m, float *l, float *a) {
    dec256_body(P, T, m, l, a, TM_KV_INT8);
}


static int have_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        unsigned a = 0, b = 0, c = 0, d = 0;   /* F16C (CPUID.1:ECX bit 29) widens fp8 pages */
        int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }
    return cached;
}

static int have_avx512(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = have_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    }
    return cached;
}

static int have_vbmi(void) {   /* the AVX-512 decode body's byte tables (vpermi2b) */
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = have_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
    }
    return cached;
}

static int have_vnni(void) {   /* the int8 decode body's vpdpbusd */
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = have_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                 __builtin_cpu_supports("avx512vnni");
    }
    return cached;
}
#else
static int have_avx2(void) { return 0; }
static int have_avx512(void) { return 0; }
static int have_vbmi(void) { return 0; }
static int have_vnni(void) { return 0; }
#endif

/* ---------------------------------------------------------------------------------------- */
/* task planning and the parallel driver                                                    */

/* The kernels run_problem picks for P on this CPU. */
typedef struct {
    const TileKernel *tk;   /* the tiles of chunks of many rows (NULL: none) */
    int tile_min_q;         /* query vectors from which a chunk takes tk; -1 without tk */
    const TileKernel *tk_narrow;   /* AVX-512 hosts: the AVX2 tiles for chunks that fit one of their groups */
    int narrow_min_q;       /* query vectors from which a chunk takes tk_narrow */
    int vec, vec512;
    int dec;   /* decode rows: 2 the AVX-512 (VBMI) decode body, 1 the AVX2 one, 0 the per-row bodies */
    int dec_i8;   /* int8 decode rows take the VNNI body (dec512_i8vnni) */
    int dec_i8t;  /* tiled int8 decode rows take the tiled VNNI body (dec512_i8t) */
    int split_rows;   /* chunks of up to this many rows are split over keys after a long context */
    int dec_rows;     /* chunks of up to this many rows not on tiles take the decode bodies */
    int head_jobs;    /* the kv heads of a split chunk, or of a short decode row among many, run as
                       * one job: on one thread, back to back. Claimed one task at a time, two
                       * threads took the heads of one chunk or row side by side, and each core
                       * fetched the lines around its head's rows (a token's rows of all heads share
                       * lines) that the other one then read again. One thread per chunk read 30
                       * layers of a 16k context 1.06x (fp8) and 1.17x (fp16) faster, and the decode
                       * step was 1.07x-1.13x faster at 16k; a step of 4 or 8 sequences of 1,500
                       * tokens 1.12x-1.13x faster (docs/benchmarks.md, "Long contexts on an Intel
                       * host"). TOKENMILL_KV_HEADS_APART=1: one job per task, as before (A/B checks). */
} Kernels;

/* The tiles a sequence's n query rows take, or NULL for the decode (or per-row) bodies. A tile group costs
 * about the same for any number of its qw lanes in use, while the per-row path's cost grows with
 * the query vectors, so a chunk of a few rows (a verify step, the last rows of a prompt) is
 * cheaper there: with head groups of 3, 2 rows over 1,024 keys took 2.2 against 6.1 ms per step
 * with AVX-512 tiles (qw 32) and 2.7 against 4.0 ms with AVX2 ones (qw 16); the two met at about
 * 18 query vectors in 32 lanes and 12 in 16, so the tiles start at 5/8 of a group. On an AVX-512
 * CPU a chunk of 10-16 query vectors takes the AVX2 tiles, one group of 16 (5 rows over 1,024
 * keys: 1.11x the AVX-512 per-row body in the whole step). (docs/benchmarks.md, "Few-row
 * chunks off the tiles".) The choice depends only on the sequence's own rows, so a request's
 * result is the same in any batch. */
static inline const TileKernel *tiles_for(const Kernels *k, int64_t n, int G) {
    if (n <= 1 || k->tile_min_q < 0) return NULL;
    const int64_t q = n * G;
    if (k->tk_narrow && q >= k->narrow_min_q && q <= k->tk_narrow->qw) return k->tk_narrow;
    return q >= k->tile_min_q ? k->tk : NULL;
}

static int plan_tasks(const Problem *P, int num_seqs, int nthreads, const Kernels *k, Task **out_tasks,
                      int *num_parts) {
    const int G = P->group;
    int rows_per_task = MAX_QVEC / G;
    if (rows_per_task > 64) rows_per_task = 64;
    if (rows_per_task < 1) rows_per_task = 1;
    /* Decode rows over long contexts are split over keys (chunks of SPLIT_KEYS), so that a
     * long single-sequence decode keeps every thread busy. The split depends only on the
     * sequence's own length, never on the batch or the thread count: a request's result is the
     * same bits alone or in any batch. (The cut of tiled prefill rows may follow the thread
     * count, since their results do not depend on it.) */
    int cap = 16, count = 0, parts = 0;
    Task *tasks = malloc(sizeof(Task) * cap);
    /* Decode rows too short to split run their kv heads as one job (Kernels.head_jobs) where there
     * are at least two such rows per thread; with fewer, a row's heads are what keeps the threads
     * busy (one row: 3 tasks for the default model). */
    int short_decodes = 0;
    for (int i = 0; i < num_seqs; i++)
        short_decodes += P->qsl[i + 1] - P->qsl[i] == 1 && P->seq_lens[i] < 2 * SPLIT_KEYS;
    const int group_decodes = k->head_jobs && short_decodes >= 2 * nthreads;
    for (int i = 0; i < num_seqs; i++) {
        int64_t n = P->qsl[i + 1] - P->qsl[i], L = P->seq_lens[i];
        if (n <= 0) continue;
        int rows = rows_per_task;
        if (tiles_for(k, n, G)) {
            /* The rows of a tiled prefill task share every K/V block it loads, so tasks are
             * large (TILE_TASK_FLOATS of queries, as many again of output), but cut smaller
             * when one sequence would give fewer than two tasks per thread. A tiled row's
             * result does not depend on how the rows are cut (each lane is its own query). */
            int vecs = TILE_TASK_FLOATS / P->d;
            rows = vecs / G > 0 ? vecs / G : 1;
            int64_t per_head = (2 * (int64_t)nthreads + P->hkv - 1) / P->hkv;
            if ((n + rows - 1) / rows < per_head) {
                int64_t r = (n + per_head - 1) / per_head;
                rows = (int)(r > 16 ? r : 16);
                if (rows > n) rows = (int)n;
            }
        }
        if (n <= k->split_rows && n <= rows && L >= 2 * SPLIT_KEYS) {
            /* A long decode row, or the few rows of a verify step (or of a prompt's tail) after a
             * long context: its key chunks with the kv heads inside, so the heads of one chunk
             * run back to back (on one thread). A head's K/V rows are pieces of each token's
             * row, and the lines around them, which the hardware fetches anyway, are the next
             * heads' rows: still in L2 when those run right after, but long gone when every
             * head walked the whole context in turn (the decode read DRAM at about 12 GB/s that
             * way). Unsplit, a few-row chunk was one task per kv head: 3 tasks on 2 threads for
             * the default model, one thread idle a third of the time. A part holds n rows of G
             * query vectors (n slots); a row's chunks past its last visible key leave it empty.
             * The merge finds a chunk's parts by (sequence, kv head). */
            int splits = (int)(L / SPLIT_KEYS);
            int64_t chunk = (L + splits - 1) / splits;
            /* A chunk's heads as one job (see Kernels.head_jobs), where there are at least two
             * jobs per thread and they share out evenly: 3 jobs on 2 threads left one idle a third
             * of the time, and with one job per thread (2 chunks) a thread that came late to the
             * call held the other back (an fp8 step at 2,048 keys 0.91x). Which thread runs a
             * task never changes its result, so this may follow the thread count. */
            const int one_job = k->head_jobs && splits >= 2 * nthreads &&
                                (splits % nthreads == 0 || splits >= 4 * nthreads);
            for (int sidx = 0; sidx < splits; sidx++)
                for (int h = 0; h < P->hkv; h++) {
                    if (count == cap) { cap *= 2; tasks = realloc(tasks, sizeof(Task) * cap); }
                    Task *t = &tasks[count++];
                    t->seq = i; t->kvh = h; t->r0 = 0; t->r1 = (int)n;
                    t->k0 = (int)(sidx * chunk);
                    t->k1 = (int)((sidx + 1) * chunk < L ? (sidx + 1) * chunk : L);
                    t->part = parts;
                    t->joins = h > 0 && one_job;
                    parts += (int)n;
                }
            continue;
        }
        for (int h = 0; h < P->hkv; h++)
            for (int64_t r0 = 0; r0 < n; r0 += rows) {
                int64_t r1 = r0 + rows < n ? r0 + rows : n;
                int64_t kend = L - n + r1;   /* the last row sees keys [0, kend) */
                int splits = n == 1 && kend >= 2 * SPLIT_KEYS ? (int)(kend / SPLIT_KEYS) : 1;
                int64_t chunk = (kend + splits - 1) / splits;
                for (int sidx = 0; sidx < splits; sidx++) {
                    if (count == cap) { cap *= 2; tasks = realloc(tasks, sizeof(Task) * cap); }
                    Task *t = &tasks[count++];
                    t->seq = i; t->kvh = h; t->r0 = (int)r0; t->r1 = (int)r1;
                    t->k0 = (int)(sidx * chunk);
                    t->k1 = (int)((sidx + 1) * chunk < kend ? (sidx + 1) * chunk : kend);
                    t->part = splits > 1 ? parts++ : -1;
                    t->joins = n == 1 && splits == 1 && h > 0 && group_decodes;
                }
            }
    }
    *out_tasks = tasks;
    *num_parts = parts;
    return count;
}

static Kernels pick_kernels(const Problem *P) {
    const int D = P->d;
    const int no512 = getenv("TOKENMILL_NO_AVX512") != NULL;
    const char *pf_t0 = getenv("TOKENMILL_KV_PREFETCH_T0");   /* set, non-empty and not "0", as decoder.c reads it */
    g_kv_pf_t0 = pf_t0 && *pf_t0 && strcmp(pf_t0, "0") != 0;
    Kernels k;
    k.vec = have_avx2() && D % 8 == 0 && D <= MAX_HEAD_DIM;
    k.vec512 = k.vec && have_avx512() && D % 16 == 0 && !no512;
    /* TOKENMILL_NO_DECODE_BODY=1 sends decode rows through the per-row bodies (for A/B checks) */
    k.dec = getenv("TOKENMILL_NO_DECODE_BODY") ? 0 : k.vec512 && have_vbmi() ? 2 : k.vec ? 1 : 0;
    /* TOKENMILL_NO_INT8_VNNI=1: int8 decode rows widen to float32 in the other bodies (A/B checks, tests) */
    k.dec_i8 = k.dec && k.vec512 && have_vnni() && D % 64 == 0 && !getenv("TOKENMILL_NO_INT8_VNNI");
    k.dec_i8t = k.dec_i8 && (D == 64 || D == 128) && P->page_size % 16 == 0;
#if TM_X86
    g_i8t_q16 = getenv("TOKENMILL_I8T_Q8") == NULL;   /* 16-bit queries unless TOKENMILL_I8T_Q8=1 */
    g_i8t_w16 = getenv("TOKENMILL_I8T_W16") != NULL;
#endif
    /* TOKENMILL_NO_FEW_ROW_SPLIT=1 splits decode rows only, as before (for A/B checks) */
    k.split_rows = getenv("TOKENMILL_NO_FEW_ROW_SPLIT") ? 1 : SPLIT_MAX_ROWS;
    /* TOKENMILL_NO_FEW_ROW_DECODE=1: the decode bodies take decode rows only, as before (for A/B
     * checks); a few rows then run the per-row bodies */
    k.dec_rows = getenv("TOKENMILL_NO_FEW_ROW_DECODE") ? 1 : DEC_MAX_ROWS;
    k.head_jobs = getenv("TOKENMILL_KV_HEADS_APART") == NULL;
    /* prefill chunks (sequences with more than a few query rows: tiles_for) take the tiled path;
     * TOKENMILL_NO_PREFILL_TILES=1 sends them through the per-row path (for A/B checks) */
    k.tk = getenv("TOKENMILL_NO_PREFILL_TILES") ? NULL : &tile_kernel_scalar;
#if TM_X86
    if (k.tk && have_avx512() && D % 8 == 0 && !no512) k.tk = &tile_kernel_avx512;
    else if (k.tk && have_avx2() && D % 4 == 0) k.tk = &tile_kernel_avx2;
#endif
    /* TOKENMILL_TILES_FOR_FEW_ROWS=1: every chunk of 2+ rows on k.tk, as before tiles_for (for A/B
     * checks) */
    const int few = getenv("TOKENMILL_TILES_FOR_FEW_ROWS") != NULL;
    k.tile_min_q = !k.tk ? -1 : few ? 0 : (5 * k.tk->qw + 7) / 8;
    k.tk_narrow = NULL;
    k.narrow_min_q = 0;
#if TM_X86
    if (k.tk == &tile_kernel_avx512 && !few && D % 4 == 0) {
        k.tk_narrow = &tile_kernel_avx2;
        k.narrow_min_q = (5 * tile_kernel_avx2.qw + 7) / 8;
    }
#endif
    return k;
}

/* A planned problem: its tasks and the split-K partial slots (a slot holds one decode row's G
 * query vectors). */
typedef struct {
    Task *tasks;
    int count, parts;
    int *job, jobs;   /* job j runs tasks [job[j], job[j + 1]) */
    float *pm, *pl, *pa;
} Plan;


static void make_plan(const Problem *P, int num_seqs, int nthreads, const Kernels *k, Plan *pl) {
    const int G = P->group, D = P->d;
    pl->count = plan_tasks(P, num_seqs, nthreads, k, &pl->tasks, &pl->parts);
    pl->job = malloc(sizeof(int) * ((size_t)pl->count + 1));
    pl->jobs = 0;
    for (int i = 0; i < pl->count; i++)
        if (!pl->tasks[i].joins || i == 0) pl->job[pl->jobs++] = i;
    pl->job[pl->jobs] = pl->count;
    pl->pm = pl->parts ? malloc(sizeof(float) * pl->parts * G) : NULL;
    pl->pl = pl->parts ? malloc(sizeof(float) * pl->parts * G) : NULL;
    pl->pa = pl->parts ? malloc(sizeof(float) * (size_t)pl->parts * G * D) : NULL;
}

static void run_task(const Problem *P, const Plan *pl, int i, const Kernels *k) {
    const int G = P->group, D = P->d;
    const Task *t = &pl->tasks[i];
    float *m = t->part >= 0 ? pl->pm + (size_t)t->part * G : NULL;
    float *l = t->part >= 0 ? pl->pl + (size_t)t->part * G : NULL;
    float *a = t->part >= 0 ? pl->pa + (size_t)t->part * G * D : NULL;
    const TileKernel *tk = tiles_for(k, P->qsl[t->seq + 1] - P->qsl[t->seq], G);
    if (tk) {
        task_tiled(P, t, m, l, a, tk);
        return;
    }
    const int64_t nrows = P->qsl[t->seq + 1] - P->qsl[t->seq];
    const int dec_rows = nrows <= k->dec_rows;   /* a decode row, or a few (tiles_for said no tiles) */
    if (P->kind == TM_KV_INT8T) {   /* tiled int8 pages: the tiled VNNI body, else the tiled prefill path */
#if TM_X86
        if (k->dec_i8t && dec_rows) {
            dec512_i8t(P, t, m, l, a);
            return;
        }
#endif
        task_tiled(P, t, m, l, a, k->tk ? k->tk : &tile_kernel_scalar);
        return;
    }
#if TM_X86
    if (k->dec_i8 && dec_rows && P->kind == TM_KV_INT8) {
        dec512_i8vnni(P, t, m, l, a);
        return;
    }
    if (k->dec == 2 && dec_rows) {
        switch (P->kind) {
        case TM_KV_BF16: dec512_bf16(P, t, m, l, a); break;
        case TM_KV_F16: dec512_f16(P, t, m, l, a); break;
        case TM_KV_FP8: dec512_fp8(P, t, m, l, a); break;
        case TM_KV_FP8_TOKEN: dec512_fp8_token(P, t, m, l, a); break;
        case TM_KV_INT8: dec512_int8(P, t, m, l, a); break;
        default: dec512_f32(P, t, m, l, a);
        }
        return;
    }
    if (k->dec == 1 && dec_rows) {
        switch (P->kind) {
        case TM_KV_BF16: dec256_bf16(P, t, m, l, a); break;
        case TM_KV_F16: dec256_f16(P, t, m, l, a); break;
        case TM_KV_FP8: dec256_fp8(P, t, m, l, a); break;
        case TM_KV_FP8_TOKEN: dec256_fp8_token(P, t, m, l, a); break;
        case TM_KV_INT8: dec256_int8(P, t, m, l, a); break;
        default: dec256_f32(P, t, m, l, a);
        }
        return;
    }
    if (k->vec512) {
        switch (P->kind) {
        case TM_KV_BF16: task_avx512_bf16(P, t, m, l, a); break;
        case TM_KV_F16: task_avx512_f16(P, t, m, l, a); break;
        case TM_KV_FP8: task_avx512_fp8(P, t, m, l, a); break;
        case TM_KV_FP8_TOKEN: task_avx512_fp8_token(P, t, m, l, a); break;
        case TM_KV_INT8: task_avx512_int8(P, t, m, l, a); break;
        default: task_avx512_f32(P, t, m, l, a);
        }
        return;
    }
    if (k->vec) {
        switch (P->kind) {
        case TM_KV_BF16: task_avx2_bf16(P, t, m, l, a); break;
        case TM_KV_F16: task_avx2_f16(P, t, m, l, a); break;
        case TM_KV_FP8: task_avx2_fp8(P, t, m, l, a); break;
        case TM_KV_FP8_TOKEN: task_avx2_fp8_token(P, t, m, l, a); break;
        case TM_KV_INT8: task_avx2_int8(P, t, m, l, a); break;
        default: task_avx2_f32(P, t, m, l, a);
        }
        return;
    }
#endif
    task_scalar(P, t, m, l, a);
}

/* merge split-K partials (consecutive tasks of one (seq, head) hold consecutive parts), then free the plan */
static void finish_plan(const Problem *P, Plan *p) {
    const int G = P->group, D = P->d;
    const Task *tasks = p->tasks;
    const int count = p->count;
    const float *pm = p->pm, *pl = p->pl, *pa = p->pa;
    int *mem = count ? malloc(sizeof(int) * count) : NULL;   /* the tasks holding one row's parts */
    for (int i = 0; i < count; i++) {
        if (tasks[i].part < 0 || tasks[i].k0 != 0) continue;   /* a row's merge starts at its first part */
        int nm = 0;
        for (int u = i; u < count && tasks[u].seq == tasks[i].seq; u++)
            if (tasks[u].part >= 0 && tasks[u].kvh == tasks[i].kvh && tasks[u].r0 == tasks[i].r0) mem[nm++] = u;
        const Task *t0 = &tasks[i];
        for (int r = 0; r < t0->r1 - t0->r0; r++) {   /* a part holds its rows' slots in turn */
            int64_t row = P->qsl[t0->seq] + t0->r0 + r;
            for (int g = 0; g < G; g++) {
                float mx = -INFINITY;
                for (int e = 0; e < nm; e++) {
                    float mu = pm[(size_t)(tasks[mem[e]].part + r) * G + g];
                    mx = mu > mx ? mu : mx;
                }
                float *dst = P->out + row * (int64_t)P->hq * D + (int64_t)(t0->kvh * G + g) * D;
                float den = 0.f;
                for (int x = 0; x < D; x++) dst[x] = 0.f;
                for (int e = 0; e < nm; e++) {
                    size_t slot = (size_t)(tasks[mem[e]].part + r) * G + g;
                    if (pl[slot] == 0.f) continue;
                    float w = expf(pm[slot] - mx);
                    den += w * pl[slot];
                    const float *src = pa + slot * D;
                    for (int x = 0; x < D; x++) dst[x] += w * src[x];
                }
                float inv = den > 0.f ? 1.f / den : 0.f;
                for (int x = 0; x < D; x++) dst[x] *= inv;
            }
        }
    }
    free(mem);
    free(p->pm); free(p->pl); free(p->pa); free(p->tasks); free(p->job);
}

static void run_problem(const Problem *P, int num_seqs, int nthreads) {
    Kernels k = pick_kernels(P);
    Plan pl;
    make_plan(P, num_seqs, nthreads, &k, &pl);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (pl.jobs > 1 && nthreads > 1)
    for (int j = 0; j < pl.jobs; j++)
        for (int i = pl.job[j]; i < pl.job[j + 1]; i++) run_task(P, &pl, i, &k);
    finish_plan(P, &pl);
}

/* One call as a task list, for a caller that runs its own threads (the capsule
 * TM_ATTENTION_TASKS_CAPSULE): plan, run every task once on any thread, then finish. Each
 * task's result is the same whichever thread runs it. */
typedef struct {
    Problem P;
    Kernels k;
    Plan pl;
} TaskCall;

/* the arguments every entry point checks: 0 when the kernel takes them */
static int bad_args(int hq, int hkv, int d, int ps, int kind, const float *ks, const float *vs) {
    if (hkv <= 0 || hq % hkv || d <= 0 || ps <= 0 || d > MAX_HEAD_DIM || hq / hkv > MAX_QVEC) return 1;
    if (kind < TM_KV_F32 || kind > TM_KV_INT8T) return 2;
    if (kind == TM_KV_INT8T && (ps % 4 || d % 4)) return 1;
    if (TM_KV_SCALED(kind) && (!ks || !vs)) return 3;
    return 0;
}

static void *tasks_plan(const float *q, int64_t q_stride, float *out, const void *kc, const void *vc, int kind,
                        const float *ks, const float *vs, const int64_t *bt, int64_t bt_stride, const int64_t *qsl,
                        const int64_t *sl, int num_seqs, int ps, int hq, int hkv, int d, float scale, int nthreads) {
    if (bad_args(hq, hkv, d, ps, kind, ks, vs)) return NULL;
    TaskCall *c = malloc(sizeof *c);
    if (!c) return NULL;
    Problem P = {q, q_stride, out, kc, vc, kind, ks, vs, bt, bt_stride, qsl, sl, ps, hq, hkv, d, hq / hkv, scale};
    c->P = P;
    c->k = pick_kernels(&c->P);
    make_plan(&c->P, num_seqs, nthreads < 1 ? 1 : nthreads, &c->k, &c->pl);
    return c;
}

static int tasks_count(const void *call) { return ((const TaskCall *)call)->pl.jobs; }

static void tasks_run(const void *call, int j) {
    const TaskCall *c = call;
    for (int i = c->pl.job[j]; i < c->pl.job[j + 1]; i++) run_task(&c->P, &c->pl, i, &c->k);
}

static void tasks_finish(void *call) {
    TaskCall *c = call;
    finish_plan(&c->P, &c->pl);
    free(c);
}

static const tm_attention_tasks g_tasks_api = {tasks_plan, tasks_count, tasks_run, tasks_finish};

/* The C entry point (exported in a capsule, see attention.h): 0, or -1 on unsupported arguments.
 * Called without the GIL. */
static int c_paged_attention(const float *q, int64_t q_stride, float *out, const void *kc, const void *vc,
                             int kind, const float *ks, const float *vs, const int64_t *bt, int64_t bt_stride,
                             const int64_t *qsl, const int64_t *sl, int num_seqs, int ps, int hq, int hkv, int d,
                             float scale, int nthreads) {
    if (bad_args(hq, hkv, d, ps, kind, ks, vs)) return -1;
    Problem P = {q, q_stride, out, kc, vc, kind, ks, vs, bt, bt_stride, qsl, sl, ps, hq, hkv, d, hq / hkv, scale};
    run_problem(&P, num_seqs, nthreads < 1 ? 1 : nthreads);
    return 0;
}

/* paged_attention(q_ptr, q_stride, out_ptr, k_ptr, v_ptr, bt_ptr, bt_stride, qsl_ptr,
 *                 seq_lens_ptr, num_seqs, page_size, num_q_heads, num_kv_heads, head_dim,
 *                 scale, num_threads, kv_kind[, k_scale_ptr, v_scale_ptr])
 * kv_kind: TM_KV_* (0 float32, 1 bfloat16, 2 fp8 with static scales, 3 fp8 with a scale per
 * vector); the scale pointers are needed for the fp8 kinds (see attention.h). */
static PyObject *py_paged_attention(PyObject *self, PyObject *args) {
    unsigned long long q, out, kc, vc, bt, qsl, sl, ks = 0, vs = 0;
    long long q_stride, bt_stride;
    int num_seqs, ps, hq, hkv, d, nthreads, kind;
    float scale;
    if (!PyArg_ParseTuple(args, "KLKKKKLKKiiiiifii|KK", &q, &q_stride, &out, &kc, &vc, &bt, &bt_stride,
                          &qsl, &sl, &num_seqs, &ps, &hq, &hkv, &d, &scale, &nthreads, &kind, &ks, &vs))
        return NULL;
    switch (bad_args(hq, hkv, d, ps, kind, (const float *)ks, (const float *)vs)) {
    case 0: break;
    case 1:
        PyErr_Format(PyExc_ValueError, "paged_attention: unsupported shape (heads %d/%d, head_dim %d, page %d)",
                     hq, hkv, d, ps);
        return NULL;
    case 2:
        PyErr_Format(PyExc_ValueError, "paged_attention: unknown kv kind %d", kind);
        return NULL;
    default:
        PyErr_SetString(PyExc_ValueError, "paged_attention: fp8 pages need K and V scale pointers");
        return NULL;
    }
    Problem P = {(const float *)q, q_stride, (float *)out, (const void *)kc, (const void *)vc, kind,
                 (const float *)ks, (const float *)vs, (const int64_t *)bt, bt_stride, (const int64_t *)qsl,
                 (const int64_t *)sl, ps, hq, hkv, d, hq / hkv, scale};
    if (nthreads < 1) nthreads = 1;
    Py_BEGIN_ALLOW_THREADS
    run_problem(&P, num_seqs, nthreads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* fp8_write(src_ptr, row_stride, slots_ptr, n, hkv, d, dst_ptr, scale_ptr, per_token[, int8[, tiled_page_size,
 * is_k]]): store
 * n token rows of hkv x d float32 values (head h of row t at src + t * row_stride + h * d) as
 * e4m3 bytes at their slots of one K or V half [num_pages * page_size, hkv, d], exactly as
 * tokenmill.layers.attention.fp8.write_fp8 does (tm_fp8_write_vec): with the static [hkv]
 * scales at scale_ptr, or (per_token) computing each vector's scale into
 * scale_ptr[slot * hkv + h]. int8: as int8 bytes with per-vector scales (tm_i8_write_vec); with
 * tiled_page_size > 0, into tiled int8 pages of that page size (TM_KV_INT8T; is_k: the K half). */
static PyObject *py_fp8_write(PyObject *self, PyObject *args) {
    unsigned long long src, slots, dst, sc;
    long long row_stride, n, hkv, d, tiled_ps = 0;
    int per_token, int8 = 0, is_k = 0;
    if (!PyArg_ParseTuple(args, "KLKLLLKKp|pLp", &src, &row_stride, &slots, &n, &hkv, &d, &dst, &sc, &per_token, &int8,
                          &tiled_ps, &is_k))
        return NULL;
    if (n < 0 || hkv <= 0 || d <= 0 || row_stride < hkv * d || !src || !slots || !dst || !sc || (int8 && !per_token) ||
        tiled_ps < 0 || (tiled_ps && (!int8 || tiled_ps % 4 || d % 4))) {
        PyErr_SetString(PyExc_ValueError, "fp8_write: bad sizes or null pointers (int8 pages take per-token scales; "
                                          "tiled int8 pages need page_size and head_dim divisible by 4)");
        return NULL;
    }
    const float *x = (const float *)src;
    const int64_t *sl = (const int64_t *)slots;
    uint8_t *o = (uint8_t *)dst;
    float *scales = (float *)sc;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < hkv; h++) {
            if (tiled_ps)
                tm_i8t_write_vec((int8_t *)o, scales, is_k, sl[t], h, hkv, tiled_ps, x + t * row_stride + h * d, d);
            else if (int8)
                tm_i8_write_vec((int8_t *)o + (sl[t] * hkv + h) * d, scales + sl[t] * hkv + h, x + t * row_stride + h * d, d);
            else
                tm_fp8_write_vec(o + (sl[t] * hkv + h) * d, per_token ? scales + sl[t] * hkv + h : scales + h,
                                 x + t * row_stride + h * d, d, per_token);
        }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* e4m3_to_float(src_ptr, dst_ptr, n, path): widen n fp8 bytes to float32 through one of the
 * kernel's own widening routines (0 scalar table, 1 AVX2+F16C, 2 AVX-512, 3 the AVX-512 decode
 * body's 64-byte table widening), scale 1; for tests. */
static PyObject *py_e4m3_to_float(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    int n, path;
    if (!PyArg_ParseTuple(args, "KKii", &src, &dst, &n, &path)) return NULL;
    widen8_fn f = widen8_scalar;
#if TM_X86
    if (path == 1 && have_avx2()) f = widen8_avx2;
    else if (path == 2 && have_avx512()) f = widen8_avx512;
    else if (path == 3 && have_vbmi()) f = widen8_avx512_table;
    else
#endif
    if (path != 0) {
        PyErr_Format(PyExc_ValueError, "e4m3_to_float: path %d is not available on this CPU", path);
        return NULL;
    }
    f((float *)dst, (const uint8_t *)src, n, 1.f);
    Py_RETURN_NONE;
}

/* int8_tiled_decode(): whether tiled int8 decode rows take the VNNI body on this CPU (AVX-512
 * with VNNI, TOKENMILL_NO_AVX512 / TOKENMILL_NO_INT8_VNNI / TOKENMILL_NO_DECODE_BODY unset) */
static PyObject *py_int8_tiled_decode(PyObject *self, PyObject *args) {
    const int on = have_avx2() && have_avx512() && have_vnni() && !getenv("TOKENMILL_NO_AVX512") &&
                   !getenv("TOKENMILL_NO_INT8_VNNI") && !getenv("TOKENMILL_NO_DECODE_BODY");
    return PyBool_FromLong(on);
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    if (have_avx512() && !getenv("TOKENMILL_NO_AVX512")) return PyUnicode_FromString("avx512");
    return PyUnicode_FromString(have_avx2() ? "avx2+fma" : "scalar");
}

static PyMethodDef methods[] = {
    {"paged_attention", py_paged_attention, METH_VARARGS, "Paged attention over the KV pool, pages read in place."},
    {"simd", py_simd, METH_NOARGS, "The vector instruction set the kernels use on this CPU."},
    {"int8_tiled_decode", py_int8_tiled_decode, METH_NOARGS, "Whether tiled int8 decode rows take the VNNI body here."},
    {"fp8_write", py_fp8_write, METH_VARARGS, "Quantize K or V rows into fp8 (or int8) pages at their slots."},
    {"e4m3_to_float", py_e4m3_to_float, METH_VARARGS, "Widen fp8 (e4m3) bytes with one of the kernel's paths."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__attention(void) {
    init_e4m3_table();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    tm_paged_attention_fn fn = c_paged_attention;
    PyObject *cap = PyCapsule_New((void *)fn, TM_ATTENTION_CAPSULE, NULL);
    if (!cap || PyModule_AddObject(m, "_C_API", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    cap = PyCapsule_New((void *)&g_tasks_api, TM_ATTENTION_TASKS_CAPSULE, NULL);
    if (!cap || PyModule_AddObject(m, "_C_API_TASKS", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
