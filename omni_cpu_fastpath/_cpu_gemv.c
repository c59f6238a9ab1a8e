/* Matrix products for a few rows, y = (x @ w^T) * scale, with int8 or bf16 weights w.
 *
 * A decode step multiplies 1-8 activation rows by each weight matrix, so its time should be the
 * time to stream the weights from memory once. On CPUs without AVX-512 (AMD EPYC before Zen 4,
 * many desktop parts) torch's kernels for these products run far above that floor: ATen's
 * _weight_int8pack_mm vectorizes only with AVX-512, and a bf16 product without AVX512-BF16 is
 * emulated. This kernel streams each weight row once for all rows of x: 8 weights widened to
 * float32 per AVX2 instruction (an int8 by conversion, a bf16 by a 16-bit shift), fused
 * multiply-add into float32 register accumulators, two per row of x over even and odd blocks of
 * 8 weights. A bf16 (or int8) weight times a bf16 activation is exact in float32, so only the
 * summation order differs from torch's, and each row is summed in the same order whatever its
 * batch neighbours and the thread count, so batching never changes a row's result.
 *
 *   gemv(x, x_bf16, rows, k, w, w_kind, ldw, n, scale, scale_bf16, y, y_bf16, threads)
 *
 * Pointers arrive as integers from cpu_gemv.py, which checks dtypes, shapes and contiguity. x is
 * [rows, k] (bf16 or float32); w is [n, k] with row stride ldw, int8 (w_kind 0) or bf16 (1);
 * scale is [n] (bf16 or float32), or 0 for none; y is [rows, n] (bf16, rounded to nearest even,
 * or float32). Blocks of output channels go to `threads` OpenMP threads (torch's own runtime once
 * torch is loaded) as each thread becomes free, so a thread that loses its core to another
 * process holds up only the block it is on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 8
#define BLOCK_N 16 /* output channels per scheduling unit */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load_i8(const void *w, Py_ssize_t i) { return (float)((const int8_t *)w)[i]; }
static inline float load_bf16(const void *w, Py_ssize_t i) { return bf16_to_float(((const uint16_t *)w)[i]); }

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) static inline __m256 widen8_i8(const void *w, Py_ssize_t i) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + i))));
}

__attribute__((target("avx2,fma"))) static inline __m256 widen8_bf16(const void *w, Py_ssize_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Portable path (no AVX2): one output channel for `rows` rows of x, a plain loop. */
#define DEFINE_SCALAR(KIND)                                                                          \
    static void scalar_##KIND(const float *x, int rows, Py_ssize_t k, const void *w, float *acc) {   \
        for (int m = 0; m < rows; m++) {                                                             \
            const float *xm = x + (Py_ssize_t)m * k;                                                 \
            float s = 0.0f;                                                                          \
            for (Py_ssize_t i = 0; i < k; i++) s += load_##KIND(w, i) * xm[i];                       \
            acc[m] = s;                                                                              \
        }                                                                                            \
    }
DEFINE_SCALAR(i8)
DEFINE_SCALAR(bf16)

/* AVX2 path: one output channel for R = 1..4 rows of x, every accumulator in a register. */
#define DEFINE_GROUP(KIND, R)                                                                        \
    __attribute__((target("avx2,fma"))) static void group##R##_##KIND(const float *x, Py_ssize_t k,   \
                                                                      const void *w, float *acc) {   \
        __m256 a[R], b[R];                                                                           \
        for (int m = 0; m < R; m++) a[m] = b[m] = _mm256_setzero_ps();                               \
        Py_ssize_t k8 = k & ~(Py_ssize_t)7, i = 0;                                                   \
        for (; i + 16 <= k8; i += 16) {                                                              \
            __m256 w0 = widen8_##KIND(w, i), w1 = widen8_##KIND(w, i + 8);                           \
            for (int m = 0; m < R; m++) {                                                            \
                const float *xm = x + (Py_ssize_t)m * k + i;                                         \
                a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a[m]);                               \
                b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), b[m]);                           \
            }                                                                                        \
        }                                                                                            \
        for (; i < k8; i += 8) {                                                                     \
            __m256 w0 = widen8_##KIND(w, i);                                                         \
            for (int m = 0; m < R; m++)                                                              \
                a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (Py_ssize_t)m * k + i), a[m]);        \
        }                                                                                            \
        for (int m = 0; m < R; m++) {                                                                \
            float s = hsum256(_mm256_add_ps(a[m], b[m]));                                            \
            for (Py_ssize_t j = k8; j < k; j++) s += load_##KIND(w, j) * x[(Py_ssize_t)m * k + j];   \
            acc[m] = s;                                                                              \
        }                                                                                            \
    }
#define DEFINE_KIND(KIND)                                                                            \
    DEFINE_GROUP(KIND, 1)                                                                            \
    DEFINE_GROUP(KIND, 2)                                                                            \
    DEFINE_GROUP(KIND, 3)                                                                            \
    DEFINE_GROUP(KIND, 4)                                                                            \
    __attribute__((target("avx2,fma"))) static void avx2_##KIND(const float *x, int rows, Py_ssize_t k, \
                                                                const void *w, float *acc) {         \
        switch (rows) {                                                                              \
            case 1: group1_##KIND(x, k, w, acc); break;                                              \
            case 2: group2_##KIND(x, k, w, acc); break;                                              \
            case 3: group3_##KIND(x, k, w, acc); break;                                              \
            default: group4_##KIND(x, k, w, acc); break;                                             \
        }                                                                                            \
    }
DEFINE_KIND(i8)
DEFINE_KIND(bf16)

typedef void (*channel_fn)(const float *x, int rows, Py_ssize_t k, const void *w, float *acc);

static int have_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static PyObject *gemv(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, scale_addr, y_addr;
    int x_bf16, rows, w_kind, scale_bf16, y_bf16, threads;
    Py_ssize_t k, ldw, n;
    if (!PyArg_ParseTuple(args, "KpinKinnKpKpi", &x_addr, &x_bf16, &rows, &k, &w_addr, &w_kind, &ldw, &n,
                          &scale_addr, &scale_bf16, &y_addr, &y_bf16, &threads))
        return NULL;
    if (rows < 1 || rows > MAX_ROWS || k < 1 || n < 1 || ldw < k || threads < 1 || w_kind < 0 || w_kind > 1) {
        PyErr_Format(PyExc_ValueError,
                     "gemv: rows must be 1..%d, k and n positive, ldw >= k, threads >= 1, w_kind 0 (int8) "
                     "or 1 (bf16)",
                     MAX_ROWS);
        return NULL;
    }
    const int avx2 = have_avx2_fma();
    channel_fn channel = w_kind == 0 ? (avx2 ? avx2_i8 : scalar_i8) : (avx2 ? avx2_bf16 : scalar_bf16);
    const size_t wsize = w_kind == 0 ? 1 : 2;
    const char *w = (const char *)(uintptr_t)w_addr;
    float *xf = NULL;
    const float *x = (const float *)(uintptr_t)x_addr;
    if (x_bf16) {
        xf = malloc(sizeof(float) * (size_t)rows * (size_t)k);
        if (!xf) return PyErr_NoMemory();
        const uint16_t *xb = (const uint16_t *)(uintptr_t)x_addr;
        for (Py_ssize_t i = 0; i < (Py_ssize_t)rows * k; i++) xf[i] = bf16_to_float(xb[i]);
        x = xf;
    }
    const Py_ssize_t blocks = (n + BLOCK_N - 1) / BLOCK_N;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (Py_ssize_t b = 0; b < blocks; b++) {
        float acc[4];
        Py_ssize_t end = (b + 1) * BLOCK_N < n ? (b + 1) * BLOCK_N : n;
        /* Rows in groups of 4, each over the whole block: a group's rows of x stay in L1, and
         * the block's weights, read from memory by the first group, come from cache for the next. */
        for (int r = 0; r < rows; r += 4) {
            int g = rows - r < 4 ? rows - r : 4;
            const float *xr = x + (Py_ssize_t)r * k;
            for (Py_ssize_t j = b * BLOCK_N; j < end; j++) {
                channel(xr, g, k, w + (size_t)j * (size_t)ldw * wsize, acc);
                float s = 1.0f;
                if (scale_addr)
                    s = scale_bf16 ? bf16_to_float(((const uint16_t *)(uintptr_t)scale_addr)[j])
                                   : ((const float *)(uintptr_t)scale_addr)[j];
                for (int m = 0; m < g; m++) {
                    float v = scale_addr ? acc[m] * s : acc[m];
                    Py_ssize_t at = (Py_ssize_t)(r + m) * n + j;
                    if (y_bf16)
                        ((uint16_t *)(uintptr_t)y_addr)[at] = float_to_bf16(v);
                    else
                        ((float *)(uintptr_t)y_addr)[at] = v;
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    free(xf);
    Py_RETURN_NONE;
}

static PyObject *simd(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(have_avx2_fma() ? "avx2" : "scalar");
}

static PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS, "y = (x @ w^T) * scale for 1-8 rows of x (see the file's comment)"},
    {"simd", simd, METH_NOARGS, "the instruction set the kernel uses on this CPU"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_gemv(void) { return PyModule_Create(&module); }
