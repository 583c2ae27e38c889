/* The paged-attention kernel as a C function, exported by tokenmill._native._attention in the
 * capsule TM_ATTENTION_CAPSULE so that other extensions (the fused decode path in _quant) call it
 * without a Python round trip. Arguments as the paged_attention binding (see attention.c). */
#ifndef TOKENMILL_ATTENTION_H
#define TOKENMILL_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define TM_ATTENTION_CAPSULE "tokenmill._native._attention._C_API"
/* the same kernel as a task list (a tm_attention_tasks), for a caller that runs its own threads */
#define TM_ATTENTION_TASKS_CAPSULE "tokenmill._native._attention._C_API_TASKS"
#define TM_ATTENTION_MAX_HEAD_DIM 512   /* the kernel refuses larger heads ... */
#define TM_ATTENTION_MAX_GROUP 256      /* ... and more query heads per kv head */

/* kv_kind: the element type of the K/V pages. fp8 pages hold float8_e4m3fn bytes whose value is
 * fp8(byte) * scale; k_scale / v_scale (ignored otherwise) point at one float32 per kv head
 * (TM_KV_FP8: a static scale per layer and head) or one per stored vector, indexed
 * slot * num_kv_heads + kv_head (TM_KV_FP8_TOKEN). fp16 pages (TM_KV_F16) hold IEEE half floats,
 * written saturated at +-65504 (tm_to_f16). */
enum { TM_KV_F32 = 0, TM_KV_BF16 = 1, TM_KV_FP8 = 2, TM_KV_FP8_TOKEN = 3, TM_KV_F16 = 4, TM_KV_INT8 = 5, TM_KV_INT8T = 6 };
/* int8 pages (TM_KV_INT8) hold signed bytes q, the element being q * scale with one scale per
 * stored vector (amax / 127), indexed as TM_KV_FP8_TOKEN's (tm_i8_write_vec).
 *
 * Tiled int8 pages (TM_KV_INT8T) hold the same codes and scales as TM_KV_INT8, laid out for the
 * int8 decode body on AVX-512 VNNI (attention.c, "tiled int8 pages"): each (page, kv head) owns
 * one tile of page_size x D bytes, at byte (page * hkv + head) * page_size * D of its K or V
 * half (a page's bytes are the same region as in TM_KV_INT8, so page copies do not care):
 *   - K: [D / 4 dim quads][page_size slots][4 bytes], each byte the code + 128 (unsigned), so
 *     that one 64-byte line holds 4 dims of 16 keys (tm_i8t_k_at);
 *   - V: [page_size / 4 slot quads][D dims][4 bytes], the codes, so that one 32-bit lane holds
 *     4 keys' values of one dim (tm_i8t_v_at);
 *   - scales: [page_size] floats per (page, kv head), at (page * hkv + head) * page_size + slot.
 * Needs page_size % 4 == 0 and D % 4 == 0. */
#define TM_KV_SCALED(kind) ((kind) == TM_KV_FP8 || (kind) == TM_KV_FP8_TOKEN || (kind) == TM_KV_INT8 || (kind) == TM_KV_INT8T)
#define TM_KV_TOKEN_SCALES(kind) ((kind) == TM_KV_FP8_TOKEN || (kind) == TM_KV_INT8)

#define TM_F16_MAX 65504.f

/* float32 -> IEEE half bits, saturated at +-65504 (a larger value or an infinity stores the
 * largest finite half, as torch's x.clamp(-65504, 65504).to(float16) does; NaN stays NaN),
 * rounding to nearest even as torch's .to(float16) does. Normal results round on the float32
 * bits (the carry moving into the exponent); a subnormal one is |f| * 2^24 rounded to an integer
 * (exact scaling; 1024 is the smallest normal's code). */
static inline uint16_t tm_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));   /* NaN, quiet */
    if (a > 0x477FE000u) return (uint16_t)(sign | 0x7BFFu);                          /* > 65504 */
    if (a >= 0x38800000u)                                                              /* >= 2^-14 */
        return (uint16_t)(sign | ((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13));
    float v;
    memcpy(&v, &a, 4);
    return (uint16_t)(sign | (uint16_t)rintf(v * 16777216.f));
}

/* IEEE half bits -> float32 (exact) */
static inline float tm_f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t u;
    if (e == 0) {
        const float f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> float8_e4m3fn byte, rounding to nearest even as torch's .to(float8_e4m3fn) does,
 * for |f| <= 448 (the callers saturate first) or NaN. Rounded on the float32 bits directly (one
 * rounding, so no double-rounding case): a normal result (|f| >= 2^-6) keeps 3 of the 23
 * mantissa bits, the carry of the rounding moving into the exponent; a subnormal one is
 * m * 2^-9 with m = |f| * 2^9 rounded to an integer (exact scaling; m = 8 is 2^-6's code). */
static inline uint8_t tm_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7F;                        /* NaN */
    if (a >= 0x3C800000u) {                                         /* 2^-6 and up */
        a += 0x7FFFFu + ((a >> 20) & 1u);
        return sign | (uint8_t)((a >> 20) - (120u << 3));           /* exponent bias 127 -> 7 */
    }
    float m = nearbyintf(fabsf(f) * 512.f);                          /* round half to even */
    return sign | (uint8_t)m;
}

/* x / scale saturated at +-448 (NaN passes, as torch's clamp lets it) */
static inline float tm_fp8_sat(float x, float scale) {
    float y = x / scale;
    return y > 448.f ? 448.f : y < -448.f ? -448.f : y;
}

/* One vector of d values into e4m3 bytes o, as tokenmill.layers.attention.fp8.write_fp8: with
 * the static scale *sc (x / scale), or (per_token) with its own scale max(amax / 448, 1e-12),
 * written to *sc. */
static inline void tm_fp8_write_vec(uint8_t *o, float *sc, const float *x, int64_t d, int per_token) {
    float s = *sc;
    if (per_token) {
        float amax = 0.f;
        for (int64_t i = 0; i < d; i++) amax = fabsf(x[i]) > amax || x[i] != x[i] ? fabsf(x[i]) : amax;
        s = amax / 448.f;
        s = s < 1e-12f ? 1e-12f : s;
        *sc = s;
    }
    for (int64_t i = 0; i < d; i++) o[i] = tm_to_e4m3(tm_fp8_sat(x[i], s));
}

/* One vector of d values into int8 bytes o, as tokenmill.layers.attention.fp8.write_fp8 does
 * for int8 pages: scale max(amax / 127, 1e-12) (written to *sc), each byte x / scale rounded
 * to nearest even and clamped to +-127 (a NaN stores 0). */
static inline void tm_i8_write_vec(int8_t *o, float *sc, const float *x, int64_t d) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float s = amax / 127.f;
    s = s < 1e-12f ? 1e-12f : s;
    *sc = s;
    for (int64_t i = 0; i < d; i++) {
        const float y = nearbyintf(x[i] / s);
        o[i] = (int8_t)(y > 127.f ? 127.f : y < -127.f ? -127.f : y == y ? y : 0.f);
    }
}

/* Byte offsets in a TM_KV_INT8T half of dim d of the key at slot (of its page), in the tile at
 * byte tile: K's (biased) byte and V's byte. */
static inline int64_t tm_i8t_k_at(int64_t tile, int64_t ps, int64_t slot, int64_t d) {
    return tile + ((d >> 2) * ps + slot) * 4 + (d & 3);
}
static inline int64_t tm_i8t_v_at(int64_t tile, int64_t D, int64_t slot, int64_t d) {
    return tile + ((slot >> 2) * D + d) * 4 + (slot & 3);
}

/* One K (is_k) or V vector of head h at pool slot `slot` into a TM_KV_INT8T half: the codes and
 * scale tm_i8_write_vec gives, at their tiled places. */
static inline void tm_i8t_write_vec(int8_t *half, float *scales, int is_k, int64_t slot, int64_t h, int64_t hkv,
                                    int64_t ps, const float *x, int64_t d) {
    int8_t codes[TM_ATTENTION_MAX_HEAD_DIM];
    float s;
    tm_i8_write_vec(codes, &s, x, d);
    const int64_t page = slot / ps, sl = slot % ps, tile = (page * hkv + h) * ps * d;
    scales[(page * hkv + h) * ps + sl] = s;
    if (is_k)
        for (int64_t i = 0; i < d; i++) half[tm_i8t_k_at(tile, ps, sl, i)] = (int8_t)(uint8_t)((int)codes[i] + 128);
    else
        for (int64_t i = 0; i < d; i++) half[tm_i8t_v_at(tile, d, sl, i)] = codes[i];
}

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
