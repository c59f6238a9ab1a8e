/* Matrix products for decode rows (and, with AVX512-BF16, a prompt's many rows),
 * y = (x @ w^T) * scale, with int8 or bf16 weights w.
 *
 * A decode step multiplies 1-8 activation rows by each weight matrix, so its time should be the
 * time to stream the weights from memory once. On CPUs without AVX-512 (AMD EPYC before Zen 4,
 * many desktop parts) torch's kernels for these products run far above that floor: ATen's
 * _weight_int8pack_mm vectorizes only with AVX-512, and a bf16 product without AVX512-BF16 is
 * emulated. This kernel streams each weight row once for all rows of x: 16 weights (AVX-512) or
 * 8 (AVX2) widened to float32 per instruction (an int8 by conversion, a bf16 by a 16-bit shift),
 * fused multiply-add into float32 register accumulators, two per row of x over even and odd
 * blocks of weights (four, over blocks in turn, on AVX2 without group scales). With several rows
 * of x the widening and the multiply-adds, not the memory, bound the time, which is why the wider
 * registers pay where the CPU has them. A bf16 (or int8) weight times a bf16 activation is exact
 * in float32, so only the summation order differs from torch's, and each row is summed in the
 * same order whatever its batch neighbours and the thread count, so batching never changes a row's
 * result (the order differs between the AVX2, AVX-512 and AVX512-BF16 paths, which one CPU always
 * takes the same way). Where the CPU has AVX512-BF16, bf16 activations skip the widening: see the
 * AVX512-BF16 path below.
 *
 *   gemv(x, x_bf16, rows, k, w, w_kind, ldw, n, scale, scale_bf16, y, y_bf16, threads, isa
 *        [, group[, side_x, side_w, side_c[, prefetch]]])
 *
 * Pointers arrive as integers from cpu_gemv.py, which checks dtypes, shapes and contiguity. x is
 * [rows, k] (bf16 or float32); w is [n, k] with row stride ldw, int8 (w_kind 0) or bf16 (1);
 * scale is [n] (bf16 or float32), or 0 for none; with group > 0 it is instead bf16 [n, k / group],
 * one scale per `group` consecutive weights of a row (k and group multiples of 64): each group's
 * dot product stays in vector registers and is multiplied by its scale there (on the AVX512-BF16
 * path the weights are instead rounded to bf16 with their scales first, as dequantize() rounds
 * them: see bf16dot_i8g); side_x and side_w [n, side_c], both float32, are the few input columns
 * a layer keeps in float (its outlier channels) and their weights, side_x transposed to
 * [side_c, rows rounded up to a multiple of 4] (zeros beyond rows): their products are added in
 * float32 to each sum, after its scale and before it is rounded, in one order for every row;
 * y is [rows, n] (bf16, rounded to nearest even, or float32); isa is the widest instruction set
 * to use: 0 none, 1 AVX2, 2 AVX-512, 3 AVX-512 and, for bf16 x, AVX512-BF16 (simd() says which
 * this CPU has). Blocks of output channels go to `threads` OpenMP threads (torch's own runtime
 * once torch is loaded) in guided chunks: long runs of consecutive weight rows, which the
 * hardware prefetcher streams (runs of one small block each, handed out one at a time, left half
 * the bandwidth unused), shrinking towards the end so that a thread that lost its core for a
 * while holds up the others by a small chunk only. With prefetch > 0, before each output channel
 * the weights `prefetch` bytes ahead of it are asked into L2 (prefetcht1): one weight row is a
 * few KB, too short a run for the hardware prefetcher to cover a slow memory's latency alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK_N 64 /* output channels per scheduling unit */
#define GROUP 4    /* rows of x per call of a channel function (at most): their floats stay in L1 */

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
    static void scalar_##KIND(const void *x, int rows, Py_ssize_t k, const void *w, const uint16_t *gs, \
                              Py_ssize_t group, float *acc) {                                        \
        if (!gs) group = k;                                                                          \
        for (int m = 0; m < rows; m++) {                                                             \
            const float *xm = (const float *)x + (Py_ssize_t)m * k;                                  \
            float t = 0.0f;                                                                          \
            for (Py_ssize_t g0 = 0; g0 < k; g0 += group) {                                           \
                float s = 0.0f;                                                                      \
                for (Py_ssize_t i = g0; i < g0 + group; i++) s += load_##KIND(w, i) * xm[i];         \
                t = gs ? t + s * bf16_to_float(gs[g0 / group]) : s;                                  \
            }                                                                                        \
            acc[m] = t;                                                                              \
        }                                                                                            \
    }
DEFINE_SCALAR(i8)
DEFINE_SCALAR(bf16)

#define AVX512 "avx512f"

__attribute__((target(AVX512))) static inline __m512 widen16_i8(const void *w, Py_ssize_t i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i))));
}

__attribute__((target(AVX512))) static inline __m512 widen16_bf16(const void *w, Py_ssize_t i) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The vector operations of each path: AVX2 widens 8 weights per instruction, AVX-512 16. */
#define AVX2_OPS "avx2,fma", __m256, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps, _mm256_fmadd_ps, \
                 _mm256_add_ps, hsum256, widen8
#define AVX512_OPS AVX512, __m512, 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps, _mm512_fmadd_ps, \
                   _mm512_add_ps, _mm512_reduce_add_ps, widen16

/* One output channel for R rows of x, every accumulator in a register: NACC (2 or 4) per row,
 * over blocks of W weights taken in turn (block b into accumulator b % NACC), then one block of W
 * at a time into the first, then the last k % W one by one; the accumulators are added pairwise,
 * (a0 + a1) + (a2 + a3). With group scales gs, each group of weights is summed so and its sum
 * multiplied by its scale into one more register per row (groups are multiples of 64, so of
 * NACC * W, and no weights are left over). */
#define DEFINE_GROUP(ISA, R, KIND, NACC, ...) DEFINE_GROUP_(ISA, R, KIND, NACC, __VA_ARGS__)
#define DEFINE_GROUP_(ISA, R, KIND, NACC, TARGET, VEC, W, ZERO, SET1, LOADU, FMADD, ADD, HSUM, WIDEN) \
    __attribute__((target(TARGET))) static void ISA##_group##R##_##KIND(                             \
        const float *x, Py_ssize_t k, const void *w, const uint16_t *gs, Py_ssize_t group, float *acc) { \
        VEC a[NACC][R], t[R];                                                                        \
        for (int m = 0; m < R; m++) t[m] = ZERO();                                                   \
        Py_ssize_t kw = k - k % W, i = 0;                                                            \
        if (!gs) group = kw > 0 ? kw : 1;                                                            \
        for (Py_ssize_t g0 = 0; g0 < kw; g0 += group) {                                              \
            Py_ssize_t end = g0 + group;                                                             \
            for (int q = 0; q < NACC; q++)                                                           \
                for (int m = 0; m < R; m++) a[q][m] = ZERO();                                        \
            for (i = g0; i + NACC * W <= end; i += NACC * W) {                                       \
                VEC wq[NACC];                                                                        \
                for (int q = 0; q < NACC; q++) wq[q] = WIDEN##_##KIND(w, i + q * W);                 \
                for (int m = 0; m < R; m++)                                                          \
                    for (int q = 0; q < NACC; q++)                                                   \
                        a[q][m] = FMADD(wq[q], LOADU(x + (Py_ssize_t)m * k + i + q * W), a[q][m]);   \
            }                                                                                        \
            for (; i < end; i += W) {                                                                \
                VEC w0 = WIDEN##_##KIND(w, i);                                                       \
                for (int m = 0; m < R; m++) a[0][m] = FMADD(w0, LOADU(x + (Py_ssize_t)m * k + i), a[0][m]); \
            }                                                                                        \
            VEC sc = gs ? SET1(bf16_to_float(gs[g0 / group])) : ZERO();                              \
            for (int m = 0; m < R; m++) {                                                            \
                VEC s = NACC == 4 ? ADD(ADD(a[0][m], a[1][m]), ADD(a[2 % NACC][m], a[3 % NACC][m]))  \
                                  : ADD(a[0][m], a[1][m]);                                           \
                t[m] = gs ? FMADD(s, sc, t[m]) : s;                                                  \
            }                                                                                        \
        }                                                                                            \
        for (int m = 0; m < R; m++) {                                                                \
            float s = HSUM(t[m]);                                                                    \
            for (Py_ssize_t j = kw; j < k; j++) s += load_##KIND(w, j) * x[(Py_ssize_t)m * k + j];   \
            acc[m] = s;                                                                              \
        }                                                                                            \
    }
/* A path's channel function: its variant for `rows` rows of x (at most the caller's row group,
 * four, or three where the registers hold no more: see row_group in gemv). */
#define DEFINE_CHANNEL(ISA, KIND, R4)                                                                \
    static void ISA##_##KIND(const void *x, int rows, Py_ssize_t k, const void *w, const uint16_t *gs, \
                             Py_ssize_t group, float *acc) {                                         \
        switch (rows) {                                                                              \
            case 1: ISA##_group1_##KIND(x, k, w, gs, group, acc); break;                             \
            case 2: ISA##_group2_##KIND(x, k, w, gs, group, acc); break;                             \
            case 3: ISA##_group3_##KIND(x, k, w, gs, group, acc); break;                             \
            default: R4; break;                                                                      \
        }                                                                                            \
    }
#define DEFINE_CHANNEL4(ISA, KIND) DEFINE_CHANNEL(ISA, KIND, ISA##_group4_##KIND(x, k, w, gs, group, acc))
/* Every path with two accumulators per row, one to four rows at once. */
#define DEFINE_KIND(ISA, KIND, OPS)                                                                  \
    DEFINE_GROUP(ISA, 1, KIND, 2, OPS)                                                               \
    DEFINE_GROUP(ISA, 2, KIND, 2, OPS)                                                               \
    DEFINE_GROUP(ISA, 3, KIND, 2, OPS)                                                               \
    DEFINE_GROUP(ISA, 4, KIND, 2, OPS)                                                               \
    DEFINE_CHANNEL4(ISA, KIND)
/* AVX2 without group scales: four accumulators per row. A row's multiply-adds into one accumulator
 * wait on each other, so with one row two accumulators leave the core idle for the adder's latency
 * (AVX2's 8-wide widening is cheap enough to expose it). Its 16 registers then hold three rows'
 * accumulators and four widened weights, so the caller hands it three rows at a time. With group
 * scales a group's sums are added up every few blocks, where two accumulators cost less. */
#define DEFINE_KIND_FOUR_SUMS(ISA, KIND, OPS)                                                        \
    DEFINE_GROUP(ISA, 1, KIND, 4, OPS)                                                               \
    DEFINE_GROUP(ISA, 2, KIND, 4, OPS)                                                               \
    DEFINE_GROUP(ISA, 3, KIND, 4, OPS)                                                               \
    DEFINE_CHANNEL(ISA, KIND, ISA##_group3_##KIND(x, k, w, gs, group, acc))
DEFINE_KIND(avx2, i8, AVX2_OPS)
DEFINE_KIND(avx2, bf16, AVX2_OPS)
DEFINE_KIND_FOUR_SUMS(avx2x4, i8, AVX2_OPS)
DEFINE_KIND_FOUR_SUMS(avx2x4, bf16, AVX2_OPS)
DEFINE_KIND(avx512, i8, AVX512_OPS)
DEFINE_KIND(avx512, bf16, AVX512_OPS)


/* AVX512-BF16 path, for bf16 activations only (a float32 x would first be rounded): vdpbf16ps
 * multiplies 32 bf16 pairs and adds each pair's two products to a float32 lane: one instruction
 * for 32 weights, where the AVX-512 path spends three on 16. A bf16 weight goes in as it is. An int8
 * weight is exact in bf16 (|v| <= 128 needs 8 significant bits); its bf16 bytes come from two
 * 128-entry byte tables indexed by |v| (AVX512-VBMI vpermi2b), 64 weights per lookup, then
 * interleaved into words lane by lane (vpunpck[lh]bw). That interleave puts the weights of each
 * 16-byte lane in two halves, so x is handed over permuted the same way (permute64). The
 * instruction rounds each sum to float32 and treats bf16 subnormals as zero. */
#define AVX512BF16 "avx512f,avx512bw,avx512vbmi,avx512bf16"

/* Bytes of bf16(a) for a = 0..127. hi[0] is 128's (0x43): |-128| reads index 0, and a zero
 * weight is masked to 0 instead. */
static uint8_t BF16_LO[128] __attribute__((aligned(64))), BF16_HI[128] __attribute__((aligned(64)));

static void init_bf16_tables(void) {
    for (int a = 0; a < 128; a++) {
        uint16_t h = float_to_bf16((float)(a ? a : 128));
        BF16_LO[a] = a ? (uint8_t)(h & 0xff) : 0;
        BF16_HI[a] = (uint8_t)(h >> 8);
    }
}

/* 64 int8 weights as bf16: weights 16L+0..7 of each 16-byte lane L in *a, 16L+8..15 in *b. */
__attribute__((target(AVX512BF16))) static inline void widen64_i8(const __m512i t[4], const void *w, __m512i *a,
                                                                   __m512i *b) {
    __m512i v = _mm512_loadu_si512(w);
    __mmask64 nonzero = _mm512_test_epi8_mask(v, v);
    __m512i mag = _mm512_abs_epi8(v);
    __m512i lo = _mm512_permutex2var_epi8(t[0], mag, t[1]);
    __m512i hi = _mm512_maskz_permutex2var_epi8(nonzero, t[2], mag, t[3]);
    hi = _mm512_ternarylogic_epi32(hi, v, _mm512_set1_epi8((char)0x80), 0xf8); /* hi | (v & sign) */
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}

/* x in widen64_i8's order: per block of 64, its first then its second halves of each lane. */
__attribute__((target(AVX512BF16))) static void permute64(const uint16_t *x, Py_ssize_t k, uint16_t *out) {
    /* Word p of each half as an index into the block's 64 words: lane p / 8, word p % 8 (+ 8). */
    uint16_t first[32], second[32];
    for (int p = 0; p < 32; p++) {
        first[p] = (uint16_t)(16 * (p / 8) + p % 8);
        second[p] = (uint16_t)(first[p] + 8);
    }
    const __m512i i0 = _mm512_loadu_si512(first), i1 = _mm512_loadu_si512(second);
    Py_ssize_t kb = k - k % 64;
    for (Py_ssize_t i = 0; i < kb; i += 64) {
        __m512i lo = _mm512_loadu_si512(x + i), hi = _mm512_loadu_si512(x + i + 32);
        _mm512_storeu_si512(out + i, _mm512_permutex2var_epi16(lo, i0, hi));
        _mm512_storeu_si512(out + i + 32, _mm512_permutex2var_epi16(lo, i1, hi));
    }
    for (Py_ssize_t i = kb; i < k; i++) out[i] = x[i];
}

#define DP(acc, w, x) _mm512_dpbf16_ps(acc, (__m512bh)(w), (__m512bh)_mm512_loadu_si512(x))

/* 64 weights (w0: the first 32 as x reads them, w1: the next 32) into R rows of x from column i:
 * each row's two sums. */
__attribute__((target(AVX512BF16), always_inline)) static inline void dp_rows(int R, __m512 *a, __m512 *b,
                                                                              __m512i w0, __m512i w1,
                                                                              const uint16_t *x, Py_ssize_t k,
                                                                              Py_ssize_t i) {
    for (int m = 0; m < R; m++) {
        const uint16_t *xm = x + (Py_ssize_t)m * k + i;
        a[m] = DP(a[m], w0, xm);
        b[m] = DP(b[m], w1, xm + 32);
    }
}

/* 64 bf16 weights as they are: the first 32 in *a, the next 32 in *b, so x is read in its own
 * order (no permuted copy). The tables are unused: one signature for both kinds of weight. */
__attribute__((target(AVX512BF16))) static inline void widen64_bf16(const __m512i t[4], const void *w, __m512i *a,
                                                                     __m512i *b) {
    (void)t;
    *a = _mm512_loadu_si512(w);
    *b = _mm512_loadu_si512((const uint16_t *)w + 32);
}

/* The sum of a vector's 16 floats in one fixed tree: upper 8 + lower 8, then upper 4 + lower 4,
 * then lanes {0, 1} + {2, 3}, then lane 0 + lane 1 (the tree of GCC's and clang's
 * _mm512_reduce_add_ps), written out so that hsum16x8 can give the same bits for eight at once. */
__attribute__((target(AVX512))) static inline float hsum16(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 t8 = _mm256_add_ps(hi, _mm512_castps512_ps256(v));
    __m128 t4 = _mm_add_ps(_mm256_extractf128_ps(t8, 1), _mm256_castps256_ps128(t8));
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

/* hsum16 of v[0..7] into out[0..7], each step of the tree done for several vectors in one
 * instruction (the pairings are hsum16's, so are the bits): about a third of the instructions of
 * eight separate trees, which were a sizeable share of a short dot product's work. */
__attribute__((target(AVX512))) static inline void hsum16x8(const __m512 v[8], float out[8]) {
    __m512 t8[4], t4[2];
    for (int p = 0; p < 4; p++) /* [v(2p) 8 sums | v(2p+1) 8 sums] */
        t8[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int q = 0; q < 2; q++) /* 128-bit lane j: v(4q+j)'s 4 sums */
        t4[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t8[2 * q], t8[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(t8[2 * q], t8[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane j: v(j)'s 2 sums, then v(4+j)'s */
    __m512 t2 = _mm512_add_ps(_mm512_shuffle_ps(t4[0], t4[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(t4[0], t4[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 t1 = _mm512_add_ps(t2, _mm512_permute_ps(t2, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, t1)));
}

/* One output channel for R rows of bf16 x: blocks of 64 weights into two accumulators per row,
 * the last k % 64 one by one; with group scales gs, each group's sum times its scale into a third. */
#define DEFINE_BF16DOT(R, KIND, WSIZE)                                                               \
    __attribute__((target(AVX512BF16))) static void bf16dot_group##R##_##KIND(                         \
        const uint16_t *x, Py_ssize_t k, const void *w, const uint16_t *gs, Py_ssize_t group, float *acc) { \
        const __m512i t[4] = {_mm512_load_si512(BF16_LO), _mm512_load_si512(BF16_LO + 64),           \
                              _mm512_load_si512(BF16_HI), _mm512_load_si512(BF16_HI + 64)};          \
        __m512 a[R], b[R], c[R];                                                                     \
        for (int m = 0; m < R; m++) c[m] = _mm512_setzero_ps();                                      \
        Py_ssize_t kb = k - k % 64;                                                                  \
        if (!gs) group = kb > 0 ? kb : 1;                                                            \
        for (Py_ssize_t g0 = 0; g0 < kb; g0 += group) {                                              \
            for (int m = 0; m < R; m++) a[m] = b[m] = _mm512_setzero_ps();                           \
            for (Py_ssize_t i = g0; i < g0 + group; i += 64) {                                       \
                __m512i w0, w1;                                                                      \
                widen64_##KIND(t, (const char *)w + i * WSIZE, &w0, &w1);                            \
                dp_rows(R, a, b, w0, w1, x, k, i);                                                   \
            }                                                                                        \
            if (gs) {                                                                                \
                __m512 sc = _mm512_set1_ps(bf16_to_float(gs[g0 / group]));                           \
                for (int m = 0; m < R; m++) c[m] = _mm512_fmadd_ps(_mm512_add_ps(a[m], b[m]), sc, c[m]); \
            } else {                                                                                 \
                for (int m = 0; m < R; m++) c[m] = _mm512_add_ps(a[m], b[m]);                        \
            }                                                                                        \
        }                                                                                            \
        for (int m = 0; m < R; m++) {                                                                \
            float s = hsum16(c[m]);                                                                  \
            for (Py_ssize_t j = kb; j < k; j++) s += load_##KIND(w, j) * bf16_to_float(x[m * k + j]); \
            acc[m] = s;                                                                              \
        }                                                                                            \
    }
#define DEFINE_BF16DOT_ROWS(R) DEFINE_BF16DOT(R, i8, 1) DEFINE_BF16DOT(R, bf16, 2)
DEFINE_BF16DOT_ROWS(1)
DEFINE_BF16DOT_ROWS(2)
DEFINE_BF16DOT_ROWS(3)
DEFINE_BF16DOT_ROWS(4)

DEFINE_CHANNEL4(bf16dot, i8)
DEFINE_CHANNEL4(bf16dot, bf16)

/* int8 weights with bf16 group scales: each weight is first dequantized to bf16 as dequantize()
 * does (the int8 times its group's scale, exact in float32, rounded to nearest even), then
 * multiplied as a bf16 weight is: no scale per group in the dot product, so a long prefill runs at
 * the bf16 product's speed over weights dequantized once (see gemv), and a decode row, which
 * dequantizes on the fly, is summed exactly as such a prefill row. x is read in its own order. */
__attribute__((target(AVX512BF16))) static inline void dequantize64(const int8_t *w, __m512 sc, __m512i *a,
                                                                    __m512i *b) {
    __m512 f[4];
    for (int q = 0; q < 4; q++)
        f[q] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * q)))),
                             sc);
    *a = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]); /* weights 0-15 in the low half, 16-31 above */
    *b = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
}

/* One output channel for R rows: bf16dot_group<R>_bf16's arithmetic without scales (two sums over
 * alternate 32-weight halves, added, then reduced) on the weights dequantized block by block. */
#define DEFINE_BF16DOT_DEQUANT(R)                                                                    \
    __attribute__((target(AVX512BF16))) static void bf16dot_group##R##_i8g(                            \
        const uint16_t *x, Py_ssize_t k, const void *w, const uint16_t *gs, Py_ssize_t group, float *acc) { \
        __m512 a[R], b[R];                                                                           \
        for (int m = 0; m < R; m++) a[m] = b[m] = _mm512_setzero_ps();                               \
        for (Py_ssize_t i = 0; i < k; i += 64) { /* k is a multiple of group, a multiple of 64 */    \
            __m512i w0, w1;                                                                          \
            dequantize64((const int8_t *)w + i, _mm512_set1_ps(bf16_to_float(gs[i / group])), &w0, &w1); \
            dp_rows(R, a, b, w0, w1, x, k, i);                                                       \
        }                                                                                            \
        for (int m = 0; m < R; m++) acc[m] = hsum16(_mm512_add_ps(a[m], b[m]));                      \
    }
DEFINE_BF16DOT_DEQUANT(1)
DEFINE_BF16DOT_DEQUANT(2)
DEFINE_BF16DOT_DEQUANT(3)
DEFINE_BF16DOT_DEQUANT(4)
DEFINE_CHANNEL4(bf16dot, i8g)

typedef void (*channel_fn)(const void *x, int rows, Py_ssize_t k, const void *w, const uint16_t *gs,
                           Py_ssize_t group, float *acc);

/* The widest instruction set this CPU runs: 0 none, 1 AVX2 with FMA, 2 AVX-512F as well, 3 also
 * AVX512-BW, -VBMI and -BF16. Read once, at import (PyInit), not on every product. */
static int cpu_isa = 0;

static int detect_isa(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
    if (!__builtin_cpu_supports("avx512f")) return 1;
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
                   __builtin_cpu_supports("avx512bf16")
               ? 3
               : 2;
}

static const char *const ISA_NAMES[] = {"scalar", "avx2", "avx512", "avx512bf16"};

/* Many rows of bf16 x on AVX512-BF16 with int8 weights (a prompt's prefill): widening 64 weights
 * costs about what their products with four rows cost, and the few-row road widens each weight
 * again for every four rows. There each block of PACK_N output channels is widened once into a
 * thread's scratch, as the few-row road hands the weights to vdpbf16ps (widen64_i8's order, or
 * dequantized with their group scales), and every group of rows runs over it as bf16 weights
 * (bf16dot_bf16's arithmetic): the same instructions on the same operands, so each row's result
 * is the few-row road's bit for bit, at any number of rows. */
#define PACK_N 32 /* channels widened at once: their bf16 stays in L2 while every row passes */

/* bf16dot_group<R>_i8g's weights for `count` channels, dequantized once (group scales gs, one
 * row of k / group per channel), as bf16 weights for the bf16 road. */
__attribute__((target(AVX512BF16))) static void dequantize_channels(const int8_t *w, Py_ssize_t ldw, Py_ssize_t k,
                                                                     const uint16_t *gs, Py_ssize_t group,
                                                                     Py_ssize_t count, uint16_t *out) {
    for (Py_ssize_t j = 0; j < count; j++)
        for (Py_ssize_t i = 0; i < k; i += 64) {
            __m512i a, b;
            dequantize64(w + j * ldw + i, _mm512_set1_ps(bf16_to_float(gs[j * (k / group) + i / group])), &a, &b);
            _mm512_storeu_si512(out + j * k + i, a);
            _mm512_storeu_si512(out + j * k + i + 32, b);
        }
}

__attribute__((target(AVX512BF16))) static void widen_channels_i8(const int8_t *w, Py_ssize_t ldw, Py_ssize_t k,
                                                                   Py_ssize_t count, uint16_t *out) {
    const __m512i t[4] = {_mm512_load_si512(BF16_LO), _mm512_load_si512(BF16_LO + 64), _mm512_load_si512(BF16_HI),
                          _mm512_load_si512(BF16_HI + 64)};
    const Py_ssize_t kb = k - k % 64;
    for (Py_ssize_t j = 0; j < count; j++) {
        const int8_t *wj = w + j * ldw;
        uint16_t *oj = out + j * k;
        for (Py_ssize_t i = 0; i < kb; i += 64) {
            __m512i a, b;
            widen64_i8(t, wj + i, &a, &b);
            _mm512_storeu_si512(oj + i, a);
            _mm512_storeu_si512(oj + i + 32, b);
        }
        for (Py_ssize_t i = kb; i < k; i++) oj[i] = float_to_bf16((float)wj[i]); /* exact */
    }
}

/* PACK_CH channels of the scratch for GROUP (four) rows of x: for each channel and row, exactly
 * bf16dot_group4_bf16's operations without scales (accumulators, order, final sum), with each
 * vector of weights and of x loaded once for all of them, since here the loads would bound it. */
#define PACK_CH 2
_Static_assert(PACK_CH * GROUP == 8, "bf16dot_channels reduces its sums with hsum16x8");

__attribute__((target(AVX512BF16))) static void bf16dot_channels(const uint16_t *x, Py_ssize_t k,
                                                                  const uint16_t *w, float acc[PACK_CH][GROUP]) {
    __m512 a[PACK_CH][GROUP], b[PACK_CH][GROUP];
    for (int h = 0; h < PACK_CH; h++)
        for (int m = 0; m < GROUP; m++) a[h][m] = b[h][m] = _mm512_setzero_ps();
    const Py_ssize_t kb = k - k % 64;
    for (Py_ssize_t i = 0; i < kb; i += 64) {
        __m512i w0[PACK_CH], w1[PACK_CH];
        for (int h = 0; h < PACK_CH; h++) {
            w0[h] = _mm512_loadu_si512(w + h * k + i);
            w1[h] = _mm512_loadu_si512(w + h * k + i + 32);
        }
        for (int m = 0; m < GROUP; m++) {
            __m512i x0 = _mm512_loadu_si512(x + m * k + i), x1 = _mm512_loadu_si512(x + m * k + i + 32);
            for (int h = 0; h < PACK_CH; h++) {
                a[h][m] = _mm512_dpbf16_ps(a[h][m], (__m512bh)w0[h], (__m512bh)x0);
                b[h][m] = _mm512_dpbf16_ps(b[h][m], (__m512bh)w1[h], (__m512bh)x1);
            }
        }
    }
    __m512 sums[PACK_CH * GROUP];
    for (int h = 0; h < PACK_CH; h++)
        for (int m = 0; m < GROUP; m++) sums[h * GROUP + m] = _mm512_add_ps(a[h][m], b[h][m]);
    hsum16x8(sums, &acc[0][0]);
    for (int h = 0; h < PACK_CH; h++)
        for (int m = 0; m < GROUP; m++)
            for (Py_ssize_t j = kb; j < k; j++) acc[h][m] += load_bf16(w + h * k, j) * bf16_to_float(x[m * k + j]);
}

/* Where a channel's float32 sums go: times the per-row scale (not group scales, applied before),
 * plus the float columns' share, then into y, rounded or not. */
typedef struct {
    const void *scale; /* [n] per-row scales, or NULL */
    int scale_bf16;
    const float *side_x; /* [side_c, side_ld]: the float columns of x, transposed, rows padded with zeros */
    const float *side_w; /* [n, side_c]: their float32 weights */
    Py_ssize_t side_c;   /* 0: none */
    Py_ssize_t side_ld;  /* rows rounded up to a multiple of GROUP */
    void *y;
    int y_bf16;
    Py_ssize_t n;
} output_t;

/* Channel j's results for rows r..r+g-1 of y. The float columns' share of a group's rows is summed
 * column by column across the rows at once (vectorizable), each row's in the same order. */
static inline void store_channel(const output_t *o, const float *acc, int g, int r, Py_ssize_t j) {
    float s = 1.0f;
    if (o->scale) s = o->scale_bf16 ? bf16_to_float(((const uint16_t *)o->scale)[j]) : ((const float *)o->scale)[j];
    float side[GROUP] = {0.0f};
    for (Py_ssize_t i = 0; i < o->side_c; i++) {
        const float *xs = o->side_x + i * o->side_ld + r;
        const float w = o->side_w[j * o->side_c + i];
        for (int m = 0; m < g; m++) side[m] += xs[m] * w;
    }
    for (int m = 0; m < g; m++) {
        float v = o->scale ? acc[m] * s : acc[m];
        if (o->side_c) v += side[m]; /* not for none: -0 + 0 would turn a -0 into +0 */
        Py_ssize_t at = (Py_ssize_t)(r + m) * o->n + j;
        if (o->y_bf16)
            ((uint16_t *)o->y)[at] = float_to_bf16(v);
        else
            ((float *)o->y)[at] = v;
    }
}

/* Ask for bytes [from, from + len) of w's `size` into L2. */
static inline void prefetch_ahead(const char *w, size_t from, size_t len, size_t size) {
    const size_t stop = from + len < size ? from + len : size;
    for (size_t i = from; i < stop; i += 64) __builtin_prefetch(w + i, 0, 2);
}

static PyObject *gemv(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, scale_addr, y_addr;
    int x_bf16, rows, w_kind, scale_bf16, y_bf16, threads, isa;
    unsigned long long side_x_addr = 0, side_w_addr = 0;
    Py_ssize_t k, ldw, n, group = 0, side_c = 0, prefetch = 0;
    if (!PyArg_ParseTuple(args, "KpinKinnKpKpii|nKKnn", &x_addr, &x_bf16, &rows, &k, &w_addr, &w_kind, &ldw, &n,
                          &scale_addr, &scale_bf16, &y_addr, &y_bf16, &threads, &isa, &group, &side_x_addr,
                          &side_w_addr, &side_c, &prefetch))
        return NULL;
    if (rows < 1 || k < 1 || n < 1 || ldw < k || threads < 1 || w_kind < 0 || w_kind > 1 || isa < 0 ||
        isa > cpu_isa) {
        PyErr_Format(PyExc_ValueError,
                     "gemv: rows, k and n must be positive, ldw >= k, threads >= 1, w_kind 0 (int8) or 1 "
                     "(bf16), isa 0..%d (this CPU's widest)",
                     cpu_isa);
        return NULL;
    }
    if (group != 0 && (group < 0 || group % 64 || k % group || !scale_addr || !scale_bf16)) {
        PyErr_SetString(PyExc_ValueError,
                        "gemv: group must be 0 (one scale per row) or a positive multiple of 64 dividing k, "
                        "with bf16 group scales");
        return NULL;
    }
    if (prefetch < 0) {
        PyErr_SetString(PyExc_ValueError, "gemv: prefetch must be 0 (none) or a positive distance in bytes");
        return NULL;
    }
    if (side_c < 0 || (side_c > 0 && (!side_x_addr || !side_w_addr))) {
        PyErr_SetString(PyExc_ValueError, "gemv: side_c must be 0, or positive with float32 side_x and side_w");
        return NULL;
    }
    const output_t out = {group ? NULL : (const void *)(uintptr_t)scale_addr,
                          scale_bf16,
                          (const float *)(uintptr_t)side_x_addr,
                          (const float *)(uintptr_t)side_w_addr,
                          side_c,
                          (rows + GROUP - 1) / GROUP * GROUP,
                          (void *)(uintptr_t)y_addr,
                          y_bf16,
                          n};
    static const channel_fn CHANNELS[4][2] = {{scalar_i8, scalar_bf16},
                                              {avx2_i8, avx2_bf16},
                                              {avx512_i8, avx512_bf16},
                                              {bf16dot_i8, bf16dot_bf16}};
    if (isa == 3 && !x_bf16) isa = 2; /* vdpbf16ps would round a float32 x */
    /* int8 with group scales on AVX512-BF16: dequantized to bf16 first (bf16dot_i8g). */
    const int dequant = isa == 3 && w_kind == 0 && group;
    /* AVX2 without group scales: four sums per row, three rows at a time (DEFINE_KIND_FOUR_SUMS). */
    static const channel_fn AVX2_FOUR_SUMS[2] = {avx2x4_i8, avx2x4_bf16};
    const int four_sums = isa == 1 && !group;
    const channel_fn channel = dequant     ? bf16dot_i8g
                               : four_sums ? AVX2_FOUR_SUMS[w_kind]
                                           : CHANNELS[isa][w_kind];
    const int widen_once = isa == 3 && w_kind == 0 && rows > GROUP;
    const int row_group = four_sums ? 3 : GROUP; /* rows of x summed together */
    const size_t wsize = w_kind == 0 ? 1 : 2;
    const char *w = (const char *)(uintptr_t)w_addr;
    void *copy = NULL; /* x as the channel function reads it, where that is not x itself */
    const void *x = (const void *)(uintptr_t)x_addr;
    const uint16_t *xb = (const uint16_t *)(uintptr_t)x_addr;
    /* 64-byte aligned: a 512-bit load that straddles two cache lines costs two. */
    const size_t xsize = isa == 3 ? sizeof(uint16_t) : sizeof(float);
    if (x_bf16 && !(isa == 3 && (w_kind == 1 || dequant))) {
        copy = aligned_alloc(64, (xsize * (size_t)rows * (size_t)k + 63) & ~(size_t)63);
        if (!copy) return PyErr_NoMemory();
        x = copy;
    }
    const Py_ssize_t blocks = (n + BLOCK_N - 1) / BLOCK_N;
    const size_t wsize_all = ((size_t)(n - 1) * (size_t)ldw + (size_t)k) * wsize;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        /* This thread's widened weights; where it could not be had, the few-row road (same bits). */
        uint16_t *scratch =
            widen_once ? aligned_alloc(64, (PACK_N * (size_t)k * sizeof(uint16_t) + 63) & ~(size_t)63) : NULL;
        if (copy) {
#pragma omp for schedule(static)
            for (int m = 0; m < rows; m++) {
                const uint16_t *xm = xb + (Py_ssize_t)m * k;
                if (isa == 3)
                    permute64(xm, k, (uint16_t *)copy + (Py_ssize_t)m * k);
                else
                    for (Py_ssize_t i = 0; i < k; i++) ((float *)copy)[(Py_ssize_t)m * k + i] = bf16_to_float(xm[i]);
            }
        } /* the loop's barrier: every row of x is ready before any product */
#pragma omp for schedule(guided)
        for (Py_ssize_t b = 0; b < blocks; b++) {
            float acc[GROUP];
            Py_ssize_t end = (b + 1) * BLOCK_N < n ? (b + 1) * BLOCK_N : n;
            /* Channels in spans, rows in groups each over the whole span: a group's rows of x stay
             * in L1, and the span's weights, read from memory by the first group (or widened once
             * into the scratch), come from cache for the next. */
            const Py_ssize_t span = scratch ? PACK_N : BLOCK_N;
            for (Py_ssize_t j0 = b * BLOCK_N; j0 < end; j0 += span) {
                Py_ssize_t j1 = j0 + span < end ? j0 + span : end;
                if (scratch && dequant)
                    dequantize_channels((const int8_t *)w + j0 * ldw, ldw, k,
                                        (const uint16_t *)(uintptr_t)scale_addr + j0 * (k / group), group, j1 - j0,
                                        scratch);
                else if (scratch)
                    widen_channels_i8((const int8_t *)w + j0 * ldw, ldw, k, j1 - j0, scratch);
                for (int r = 0; r < rows; r += row_group) {
                    int g = rows - r < row_group ? rows - r : row_group;
                    const char *xr = (const char *)x + (size_t)r * (size_t)k * xsize;
                    for (Py_ssize_t j = j0; j < j1;) {
                        /* The scratch holds bf16 weights, any group scales applied: no scales there. */
                        if (scratch && g == GROUP && j + PACK_CH <= j1) {
                            float many[PACK_CH][GROUP];
                            bf16dot_channels((const uint16_t *)xr, k, scratch + (j - j0) * k, many);
                            for (int h = 0; h < PACK_CH; h++, j++)
                                store_channel(&out, many[h], g, r, j);
                            continue;
                        }
                        if (scratch)
                            bf16dot_bf16(xr, g, k, scratch + (j - j0) * k, NULL, 0, acc);
                        else {
                            const size_t at = (size_t)j * (size_t)ldw * wsize;
                            if (prefetch && r == 0) /* later row groups find the span in cache */
                                prefetch_ahead(w, at + (size_t)prefetch, (size_t)k * wsize, wsize_all);
                            channel(xr, g, k, w + at,
                                    group ? (const uint16_t *)(uintptr_t)scale_addr + j * (k / group) : NULL, group,
                                    acc);
                        }
                        store_channel(&out, acc, g, r, j);
                        j++;
                    }
                }
            }
        }
        free(scratch);
    }
    Py_END_ALLOW_THREADS
    free(copy);
    Py_RETURN_NONE;
}

/* Dequantization of int8 weights with bf16 group scales, for a prefill long enough that one bf16
 * (or float32) GEMM beats repeated passes of the few-row product over the weights:
 *
 *   dequantize(w, n, k, scale, group, out, out_bf16, threads, isa)
 *
 * out[j, i] = w[j, i] * scale[j, i / group] as [n, k], rounded to bf16 (nearest even) or kept in
 * float32. An int8 times a bf16 is exact in float32, so the bf16 result is torch's
 * `w.to(bfloat16) * scale` bit for bit, in one pass over the weights instead of torch's two. */
static inline void round_store_scalar(float v, void *out, Py_ssize_t i, int out_bf16) {
    if (out_bf16)
        ((uint16_t *)out)[i] = float_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

static void dequant_row_scalar(const int8_t *w, const uint16_t *s, Py_ssize_t k, Py_ssize_t group, void *out,
                               int out_bf16) {
    for (Py_ssize_t i = 0; i < k; i++) round_store_scalar((float)w[i] * bf16_to_float(s[i / group]), out, i, out_bf16);
}

/* Round float32 lanes to bf16, nearest even (finite values: int8 times a finite scale). */
__attribute__((target("avx2,fma"))) static inline __m256i round_bf16_avx2(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
}

__attribute__((target("avx2,fma"))) static void dequant_row_avx2(const int8_t *w, const uint16_t *s, Py_ssize_t k,
                                                                  Py_ssize_t group, void *out, int out_bf16) {
    for (Py_ssize_t g0 = 0; g0 < k; g0 += group) {
        const __m256 scale = _mm256_set1_ps(bf16_to_float(s[g0 / group]));
        for (Py_ssize_t i = g0; i < g0 + group; i += 16) {
            __m256 lo = _mm256_mul_ps(widen8_i8(w, i), scale), hi = _mm256_mul_ps(widen8_i8(w, i + 8), scale);
            if (out_bf16) {
                /* packus interleaves 128-bit lanes; the permute puts them back in order */
                __m256i packed = _mm256_packus_epi32(round_bf16_avx2(lo), round_bf16_avx2(hi));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm256_permute4x64_epi64(packed, 0xD8));
            } else {
                _mm256_storeu_ps((float *)out + i, lo);
                _mm256_storeu_ps((float *)out + i + 8, hi);
            }
        }
    }
}

__attribute__((target(AVX512))) static void dequant_row_avx512(const int8_t *w, const uint16_t *s, Py_ssize_t k,
                                                                Py_ssize_t group, void *out, int out_bf16) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    for (Py_ssize_t g0 = 0; g0 < k; g0 += group) {
        const __m512 scale = _mm512_set1_ps(bf16_to_float(s[g0 / group]));
        for (Py_ssize_t i = g0; i < g0 + group; i += 16) {
            __m512 v = _mm512_mul_ps(widen16_i8(w, i), scale);
            if (out_bf16) {
                __m512i u = _mm512_castps_si512(v);
                __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), one), half);
                __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), h);
            } else {
                _mm512_storeu_ps((float *)out + i, v);
            }
        }
    }
}

typedef void (*dequant_fn)(const int8_t *w, const uint16_t *s, Py_ssize_t k, Py_ssize_t group, void *out,
                           int out_bf16);

static PyObject *dequantize(PyObject *self, PyObject *args) {
    unsigned long long w_addr, scale_addr, out_addr;
    Py_ssize_t n, k, group;
    int out_bf16, threads, isa;
    if (!PyArg_ParseTuple(args, "KnnKnKpii", &w_addr, &n, &k, &scale_addr, &group, &out_addr, &out_bf16, &threads,
                          &isa))
        return NULL;
    if (n < 1 || k < 1 || group < 64 || group % 64 || k % group || threads < 1 || isa < 0 || isa > cpu_isa) {
        PyErr_Format(PyExc_ValueError,
                     "dequantize: n and k must be positive, group a positive multiple of 64 dividing k, "
                     "threads >= 1, isa 0..%d (this CPU's widest)",
                     cpu_isa);
        return NULL;
    }
    static const dequant_fn ROWS[4] = {dequant_row_scalar, dequant_row_avx2, dequant_row_avx512, dequant_row_avx512};
    const dequant_fn row = ROWS[isa];
    const int8_t *w = (const int8_t *)(uintptr_t)w_addr;
    const uint16_t *s = (const uint16_t *)(uintptr_t)scale_addr;
    char *out = (char *)(uintptr_t)out_addr;
    const size_t out_size = out_bf16 ? sizeof(uint16_t) : sizeof(float);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads)
    for (Py_ssize_t j = 0; j < n; j++)
        row(w + j * k, s + j * (k / group), k, group, out + (size_t)j * (size_t)k * out_size, out_bf16);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *simd(PyObject *self, PyObject *args) {
    return Py_BuildValue("(is)", cpu_isa, ISA_NAMES[cpu_isa]);
}

static PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS, "y = (x @ w^T) * scale (see the file's comment)"},
    {"dequantize", dequantize, METH_VARARGS, "out = w * scale by groups, in bf16 or float32 (see its comment)"},
    {"simd", simd, METH_NOARGS, "(isa, name): the widest instruction set this CPU runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_gemv(void) {
    cpu_isa = detect_isa();
    init_bf16_tables();
    return PyModule_Create(&module);
}
