/* The sampler's race noise: uniforms of a keyed splitmix64 stream, one row per key.
 *
 * race_uniforms(keys_ptr, n_keys, vocab, out_ptr) writes, for row r and entry i,
 *     x = splitmix64_mix(keys[r] + i * 0x9E3779B97F4A7C15)     (wrapping uint64 arithmetic)
 *     out[r * vocab + i] = ((x >> 11) + 0.5) * 2^-53            (float64, never 0 or 1)
 * the same values, bit for bit, as the numpy expression in tokenmill/layers/sampling.py (exp1),
 * which takes -log of them. numpy makes them in eleven passes over the row; this is one pass,
 * compiled for AVX-512 (DQ: 64-bit multiplies in one instruction) and AVX2 through function
 * target attributes and chosen at run time, with a portable loop otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MIX1 0xBF58476D1CE4E5B9ULL
#define MIX2 0x94D049BB133111EBULL

#define RACE_BODY                                                                                 \
    for (int64_t r = 0; r < n_keys; r++) {                                                        \
        const uint64_t key = keys[r];                                                             \
        double *o = out + r * vocab;                                                              \
        for (int64_t i = 0; i < vocab; i++) {                                                     \
            uint64_t x = key + (uint64_t)i * GOLDEN;                                              \
            x = (x ^ (x >> 30)) * MIX1;                                                           \
            x = (x ^ (x >> 27)) * MIX2;                                                           \
            x ^= x >> 31;                                                                         \
            o[i] = ((double)(x >> 11) + 0.5) * 0x1.0p-53;                                         \
        }                                                                                         \
    }

static void race_portable(const uint64_t *keys, int64_t n_keys, int64_t vocab, double *out) { RACE_BODY }

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512dq,avx2")))
static void race_avx512(const uint64_t *keys, int64_t n_keys, int64_t vocab, double *out) { RACE_BODY }

__attribute__((target("avx2")))
static void race_avx2(const uint64_t *keys, int64_t n_keys, int64_t vocab, double *out) { RACE_BODY }
#endif

typedef void (*race_fn)(const uint64_t *, int64_t, int64_t, double *);

static race_fn pick(const char **name) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
        *name = "avx512";
        return race_avx512;
    }
    if (__builtin_cpu_supports("avx2")) {
        *name = "avx2";
        return race_avx2;
    }
#endif
    *name = "portable";
    return race_portable;
}

static race_fn g_race = NULL;
static const char *g_name = "portable";

/* the path for a request: 0 the one picked at load, 1 the portable loop, 2 AVX2, 3 AVX-512 (for
 * tests of each; NULL when this CPU or build lacks it) */
static race_fn path_fn(int path) {
    if (path == 0) return g_race;
    if (path == 1) return race_portable;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (path == 2 && __builtin_cpu_supports("avx2")) return race_avx2;
    if (path == 3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return race_avx512;
#endif
    return NULL;
}

static PyObject *py_race_uniforms(PyObject *self, PyObject *args) {
    unsigned long long keys, out;
    long long n_keys, vocab;
    int path = 0;
    if (!PyArg_ParseTuple(args, "KLLK|i", &keys, &n_keys, &vocab, &out, &path)) return NULL;
    if (n_keys < 0 || vocab < 0) {
        PyErr_SetString(PyExc_ValueError, "race_uniforms: negative size");
        return NULL;
    }
    race_fn fn = path_fn(path);
    if (!fn) {
        PyErr_Format(PyExc_ValueError, "race_uniforms: path %d does not run on this CPU", path);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fn((const uint64_t *)(uintptr_t)keys, n_keys, vocab, (double *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_simd(PyObject *self, PyObject *args) { return PyUnicode_FromString(g_name); }

static PyMethodDef methods[] = {
    {"race_uniforms", py_race_uniforms, METH_VARARGS,
     "race_uniforms(keys_ptr, n_keys, vocab, out_ptr[, path]): splitmix64 uniforms, float64"},
    {"simd", py_simd, METH_NOARGS, "the code path in use"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sampling", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sampling(void) {
    g_race = pick(&g_name);
    return PyModule_Create(&module);
}
