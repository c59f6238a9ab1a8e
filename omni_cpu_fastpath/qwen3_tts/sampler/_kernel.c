/* CpuSampler's native kernel: the talker's sampling step in one pass per row (sample_rows), and
 * vLLM's seeded exponential-noise draw from torch generator states (exponential_race, below).
 *
 * At batch 1 a [1, 3072] sampling step is little arithmetic and many library calls of
 * Python/ATen/numpy dispatch; this kernel does the arithmetic in one call, with vLLM 0.30's
 * Sampler semantics (omni_cpu_fastpath/qwen3_tts/sampler/ states them; its kernel.py calls this):
 *
 *   1. penalties, in place: repetition once on each token seen in the prompt or the output
 *      (logit * (1 / p) when the logit is > 0, else logit * p), then, when a row has them,
 *      frequency (logit -= f * count) and presence (logit -= r * in_output) over the row;
 *   2. greedy rows (no temperatures given, or temperature < 1e-5): the first index of the max;
 *   3. other rows: logits /= temperature in place, then the k-th largest value (top-k, counted
 *      with multiplicity as torch.topk counts it) is the threshold: every entry >= it is kept;
 *   4a. with uniforms: one token drawn with probability exp(x - max) over the kept entries, by
 *       inverse CDF: taken iff cdf[i-1] < (1 - u) * total <= cdf[i], so an -inf logit never is;
 *   4b. without (mask mode, for rows drawn from per-request generators by the caller): entries
 *       below the threshold are set to -inf, as vLLM's top-k masking does, and the token is -1.
 *
 * Every float32 operation of 1-3 is the one vLLM performs on the same values (IEEE division and
 * products, no fused multiply-add: built with -ffp-contract=off), so 1-3 are bit-equal to it.
 * Pointers arrive as integers from the Python wrapper, which checks dtypes, shapes and
 * contiguity; output_token_ids is read straight from vLLM's Python lists.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SAMPLING_EPS 1e-5f

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Restore the min-heap property below position i (heap[0] is the smallest). */
static void sift_down(float *heap, Py_ssize_t n, Py_ssize_t i) {
    float v = heap[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap[c + 1] < heap[c]) c++;
        if (!(heap[c] < v)) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = v;
}

/* The k-th largest of x[0..n) (0 < k < n), duplicates counted: a min-heap of the k largest. */
static float kth_largest(const float *x, Py_ssize_t n, Py_ssize_t k, float *heap) {
    memcpy(heap, x, (size_t)k * sizeof(float));
    for (Py_ssize_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    for (Py_ssize_t j = k; j < n; j++) {
        if (x[j] > heap[0]) {
            heap[0] = x[j];
            sift_down(heap, k, 0);
        }
    }
    return heap[0];
}

/* torch.argmax: the first maximum, or the first NaN when there is one. */
static int32_t argmax(const float *x, Py_ssize_t n) {
    Py_ssize_t best = 0;
    float top = x[0];
    if (isnan(top)) return 0;
    for (Py_ssize_t j = 1; j < n; j++) {
        if (isnan(x[j])) return (int32_t)j;
        if (x[j] > top) {
            top = x[j];
            best = j;
        }
    }
    return (int32_t)best;
}

/* Marks token t of a row as seen (once) and counts it when it comes from the output. */
static inline void note_token(long t, Py_ssize_t vocab, uint8_t *seen, int32_t *counts,
                              int32_t *distinct, Py_ssize_t *n_distinct, int from_output) {
    if (t < 0 || t >= vocab) return; /* prompt padding (= vocab) and -1 placeholders */
    if (!seen[t]) {
        seen[t] = 1;
        distinct[(*n_distinct)++] = (int32_t)t;
    }
    if (from_output && counts) counts[t]++;
}

static int apply_penalties(float *row, Py_ssize_t vocab, const int64_t *prompt, Py_ssize_t prompt_len,
                           PyObject *output, float rep, float freq, float pres, uint8_t *seen,
                           int32_t *counts, int32_t *distinct) {
    Py_ssize_t n_distinct = 0;
    memset(seen, 0, (size_t)vocab);
    if (counts) memset(counts, 0, (size_t)vocab * sizeof(int32_t));
    for (Py_ssize_t j = 0; j < prompt_len; j++) note_token((long)prompt[j], vocab, seen, NULL, distinct, &n_distinct, 0);
    if (!PyList_Check(output)) {
        PyErr_Format(PyExc_TypeError, "output_token_ids rows must be lists, got %.100s", Py_TYPE(output)->tp_name);
        return -1;
    }
    Py_ssize_t n_out = PyList_GET_SIZE(output);
    for (Py_ssize_t j = 0; j < n_out; j++) {
        long t = PyLong_AsLong(PyList_GET_ITEM(output, j));
        if (t == -1 && PyErr_Occurred()) return -1;
        note_token(t, vocab, seen, counts, distinct, &n_distinct, 1);
    }
    if (rep != 1.0f) {
        const float inv_rep = 1.0f / rep;
        for (Py_ssize_t i = 0; i < n_distinct; i++) {
            const float x = row[distinct[i]];
            row[distinct[i]] = x > 0.0f ? x * inv_rep : x * rep;
        }
    }
    /* vLLM subtracts over the whole row (logits -= f * counts; logits -= r * mask): the same
     * pass, so even the sign of a zero logit matches (x - (-0.0) turns -0.0 into +0.0). */
    if (counts) {
        for (Py_ssize_t j = 0; j < vocab; j++) {
            float x = row[j] - freq * (float)counts[j];
            row[j] = x - pres * (float)(counts[j] > 0);
        }
    }
    return 0;
}

/* Inverse-CDF draw over the entries >= threshold; exp and sums in double. */
static int32_t draw(const float *row, Py_ssize_t vocab, float threshold, double u, int32_t *index,
                    double *weight) {
    Py_ssize_t n = 0;
    float top = -INFINITY;
    for (Py_ssize_t j = 0; j < vocab; j++) {
        if (row[j] >= threshold) {
            index[n++] = (int32_t)j;
            if (row[j] > top) top = row[j];
        }
    }
    if (n == 0 || top == -INFINITY) return n ? index[0] : 0; /* nothing finite to draw from */
    double total = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        weight[i] = exp((double)row[index[i]] - (double)top);
        total += weight[i];
    }
    const double target = (1.0 - u) * total; /* in (0, total]: u in [0, 1), total >= 1 */
    double cdf = 0.0;
    int32_t last = index[0];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (weight[i] > 0.0) {
            cdf += weight[i];
            last = index[i];
            if (cdf >= target) return index[i];
        }
    }
    return last; /* unreachable in exact arithmetic: the last cdf equals total */
}

static void *as_pointer(PyObject *obj, int *failed) {
    if (obj == Py_None) return NULL;
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL && PyErr_Occurred()) *failed = 1;
    return p;
}

PyDoc_STRVAR(sample_rows_doc,
             "sample_rows(logits, rows, vocab, prompt, prompt_stride, prompt_len, output_token_ids,\n"
             "            repetition, frequency, presence, temperature, top_k, uniforms, tokens,\n"
             "            phase_ns) -> None\n\n"
             "Pointers as integers (None for an absent array): logits float32 [rows, vocab] (modified\n"
             "in place), prompt int64 [rows, prompt_stride], repetition/frequency/presence/temperature\n"
             "float32 [rows], top_k int32 [rows], uniforms float64 [rows] in [0, 1) (None: mask mode),\n"
             "tokens int32 [rows] (written), phase_ns int64 [3] (penalties, top-k, draw; added to).\n"
             "output_token_ids: a list of rows lists of ints, or None without penalties.");

static PyObject *sample_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 15) {
        PyErr_Format(PyExc_TypeError, "sample_rows takes 15 arguments, got %zd", nargs);
        return NULL;
    }
    int failed = 0;
    float *logits = as_pointer(args[0], &failed);
    Py_ssize_t rows = PyLong_AsSsize_t(args[1]);
    Py_ssize_t vocab = PyLong_AsSsize_t(args[2]);
    const int64_t *prompt = as_pointer(args[3], &failed);
    Py_ssize_t prompt_stride = PyLong_AsSsize_t(args[4]);
    Py_ssize_t prompt_len = PyLong_AsSsize_t(args[5]);
    PyObject *outputs = args[6];
    const float *rep = as_pointer(args[7], &failed);
    const float *freq = as_pointer(args[8], &failed);
    const float *pres = as_pointer(args[9], &failed);
    const float *temp = as_pointer(args[10], &failed);
    const int32_t *top_k = as_pointer(args[11], &failed);
    const double *uniforms = as_pointer(args[12], &failed);
    int32_t *tokens = as_pointer(args[13], &failed);
    int64_t *phase_ns = as_pointer(args[14], &failed);
    if (failed || PyErr_Occurred()) return NULL;
    if (!logits || !tokens || rows < 1 || vocab < 1) {
        PyErr_SetString(PyExc_ValueError, "sample_rows needs logits, tokens, rows >= 1 and vocab >= 1");
        return NULL;
    }
    const int penalties = rep || freq || pres;
    if (penalties) {
        if (!prompt || prompt_len < 0 || prompt_stride < prompt_len) {
            PyErr_SetString(PyExc_ValueError, "sample_rows: penalties need the prompt token ids");
            return NULL;
        }
        if (!PyList_Check(outputs) || PyList_GET_SIZE(outputs) < rows) {
            PyErr_SetString(PyExc_ValueError, "sample_rows: penalties need a list of rows output_token_ids");
            return NULL;
        }
    }

    /* Output counts only when some row has a frequency or presence penalty. */
    int counted = 0;
    for (Py_ssize_t r = 0; r < rows && !counted; r++)
        counted = (freq && freq[r] != 0.0f) || (pres && pres[r] != 0.0f);
    /* One allocation for the scratch: draw weights and indices, distinct tokens, heap, counts, seen. */
    const size_t v = (size_t)vocab;
    char *scratch = malloc(v * (sizeof(double) + 2 * sizeof(int32_t) + sizeof(float)) +
                           (counted ? v * sizeof(int32_t) : 0) + v);
    if (!scratch) return PyErr_NoMemory();
    double *weight = (double *)scratch;          /* draw: exp of the kept entries */
    int32_t *index = (int32_t *)(weight + v);    /* draw: the kept entries */
    int32_t *distinct = index + v;               /* penalties: distinct seen tokens */
    float *heap = (float *)(distinct + v);       /* top-k: the k largest */
    int32_t *counts = counted ? (int32_t *)(heap + v) : NULL; /* penalties: output counts */
    uint8_t *seen = counted ? (uint8_t *)(counts + v) : (uint8_t *)(heap + v);

    int64_t t_pen = 0, t_topk = 0, t_draw = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        float *row = logits + r * vocab;
        int64_t t0 = phase_ns ? now_ns() : 0;
        const float f = freq ? freq[r] : 0.0f, p = pres ? pres[r] : 0.0f;
        if (penalties && apply_penalties(row, vocab, prompt + r * prompt_stride, prompt_len,
                                         PyList_GET_ITEM(outputs, r), rep ? rep[r] : 1.0f, f, p, seen,
                                         (f != 0.0f || p != 0.0f) ? counts : NULL, distinct) < 0) {
            free(scratch);
            return NULL;
        }
        int64_t t1 = phase_ns ? now_ns() : 0;
        if (!temp || temp[r] < SAMPLING_EPS) {
            tokens[r] = argmax(row, vocab);
            if (phase_ns) {
                int64_t t2 = now_ns();
                t_pen += t1 - t0;
                t_topk += t2 - t1;
            }
            continue;
        }
        const float t = temp[r];
        for (Py_ssize_t j = 0; j < vocab; j++) row[j] = row[j] / t;
        const Py_ssize_t k = top_k ? top_k[r] : vocab;
        const float threshold = (k > 0 && k < vocab) ? kth_largest(row, vocab, k, heap) : -INFINITY;
        int64_t t2 = phase_ns ? now_ns() : 0;
        if (uniforms) {
            tokens[r] = draw(row, vocab, threshold, uniforms[r], index, weight);
        } else {
            for (Py_ssize_t j = 0; j < vocab; j++)
                if (row[j] < threshold) row[j] = -INFINITY;
            tokens[r] = -1;
        }
        if (phase_ns) {
            int64_t t3 = now_ns();
            t_pen += t1 - t0;
            t_topk += t2 - t1;
            t_draw += t3 - t2;
        }
    }
    free(scratch);
    if (phase_ns) {
        phase_ns[0] += t_pen;
        phase_ns[1] += t_topk;
        phase_ns[2] += t_draw;
    }
    Py_RETURN_NONE;
}

/* ---- vLLM's seeded draw: argmax(probs / q), q exponential noise from a torch CPU generator ----
 *
 * ATen's CPU exponential_ (the serial default kernel, no MKL) takes one 64-bit word per entry from
 * the generator's mt19937 (two 32-bit outputs, first one high), makes a uniform double
 * u = (word & (2^53 - 1)) * 2^-53 and returns (float)(-log(1 - u)). Here the same words are taken
 * from a copy of the generator's state (Generator.get_state(): a THGeneratorState), so the state
 * written back is the one exponential_ leaves; the log is only computed where probs > 0, since
 * elsewhere probs / q is 0 (or NaN when q is -0.0, u = 0). omni_cpu_fastpath.qwen3_tts.sampler.kernel
 * checks the whole once per process against torch and falls back to torch's own draw if they ever
 * differ. */

#define MT_N 624
#define MT_M 397
#define STATE_BYTES 5056   /* sizeof(CPUGeneratorImplState) in torch 2.x */
#define STATE_LEFT 8       /* int left */
#define STATE_NEXT 16      /* uint64 next */
#define STATE_WORDS 24     /* uint64 state[624] */
#define RACE_CHUNK 1024    /* entries whose random words are made at once */

typedef struct {
    uint32_t state[MT_N];
    int left;
    uint32_t next;
} mt19937;

static inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

static void mt_next_state(mt19937 *mt) {
    uint32_t *p = mt->state;
    mt->left = MT_N;
    mt->next = 0;
    for (int j = MT_N - MT_M + 1; --j; p++) *p = p[MT_M] ^ mt_twist(p[0], p[1]);
    for (int j = MT_M; --j; p++) *p = p[MT_M - MT_N] ^ mt_twist(p[0], p[1]);
    *p = p[MT_M - MT_N] ^ mt_twist(p[0], mt->state[0]);
}

static inline uint32_t mt_next(mt19937 *mt) {
    if (--mt->left == 0) mt_next_state(mt);
    uint32_t y = mt->state[mt->next++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

/* n outputs into out, as n calls of mt_next would give them; the tempering loop over the words
 * available before the next refill vectorizes. */
static void mt_fill(mt19937 *mt, uint32_t *out, Py_ssize_t n) {
    while (n > 0) {
        Py_ssize_t avail = mt->left - 1; /* outputs before the one that refills */
        if (avail == 0) {
            out[0] = mt_next(mt);
            out++;
            n--;
            continue;
        }
        const Py_ssize_t m = avail < n ? avail : n;
        const uint32_t *src = mt->state + mt->next;
        for (Py_ssize_t i = 0; i < m; i++) {
            uint32_t y = src[i];
            y ^= y >> 11;
            y ^= (y << 7) & 0x9d2c5680u;
            y ^= (y << 15) & 0xefc60000u;
            y ^= y >> 18;
            out[i] = y;
        }
        mt->left -= (int)m;
        mt->next += (uint32_t)m;
        out += m;
        n -= m;
    }
}

/* Advances past n outputs without tempering them: the state exponential_ leaves after n / 2
 * entries it does not need to see. A refill happens on the output that finds left == 1. */
static void mt_skip(mt19937 *mt, uint64_t n) {
    while (n > 0) {
        if ((uint64_t)(mt->left - 1) >= n) {
            mt->left -= (int)n;
            mt->next += (uint32_t)n;
            return;
        }
        n -= (uint64_t)(mt->left - 1);
        mt_next_state(mt); /* left = N, next = 0; this output takes state[0] */
        mt->next = 1;
        n -= 1;
    }
}

static int mt_load(mt19937 *mt, const uint8_t *bytes) {
    int32_t left;
    uint64_t next, word;
    memcpy(&left, bytes + STATE_LEFT, sizeof left);
    memcpy(&next, bytes + STATE_NEXT, sizeof next);
    /* left - 1 words remain before the next refill, from next on: all inside the state. */
    if (left < 1 || left > MT_N || next > MT_N || next + (uint64_t)left - 1 > MT_N) return -1;
    mt->left = left;
    mt->next = (uint32_t)next;
    for (int i = 0; i < MT_N; i++) {
        memcpy(&word, bytes + STATE_WORDS + 8 * i, sizeof word);
        mt->state[i] = (uint32_t)word;
    }
    return 0;
}

static void mt_store(const mt19937 *mt, uint8_t *bytes) {
    const int32_t left = mt->left;
    const uint64_t next = mt->next;
    memcpy(bytes + STATE_LEFT, &left, sizeof left);
    memcpy(bytes + STATE_NEXT, &next, sizeof next);
    for (int i = 0; i < MT_N; i++) {
        const uint64_t word = mt->state[i];
        memcpy(bytes + STATE_WORDS + 8 * i, &word, sizeof word);
    }
}

PyDoc_STRVAR(exponential_race_doc,
             "exponential_race(probs, rows, vocab, state, state_bytes, score_rows, tokens) -> None\n\n"
             "Draws rows x vocab exponentials as exponential_ would from the generator whose\n"
             "get_state() bytes are at state (updated in place); for the rows flagged in score_rows\n"
             "(uint8 [rows]; None: all) writes tokens[r] = argmax(probs[r] / q[r]) (int32), as vLLM's\n"
             "sample_with_exponential_noise. probs: float32 [rows, vocab]. Pointers as integers.");

static PyObject *exponential_race(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "exponential_race takes 7 arguments, got %zd", nargs);
        return NULL;
    }
    int failed = 0;
    const float *probs = as_pointer(args[0], &failed);
    Py_ssize_t rows = PyLong_AsSsize_t(args[1]);
    Py_ssize_t vocab = PyLong_AsSsize_t(args[2]);
    uint8_t *state = as_pointer(args[3], &failed);
    Py_ssize_t state_bytes = PyLong_AsSsize_t(args[4]);
    const uint8_t *score_rows = as_pointer(args[5], &failed);
    int32_t *tokens = as_pointer(args[6], &failed);
    if (failed || PyErr_Occurred()) return NULL;
    if (!probs || !state || !tokens || rows < 1 || vocab < 1) {
        PyErr_SetString(PyExc_ValueError, "exponential_race needs probs, state, tokens, rows >= 1, vocab >= 1");
        return NULL;
    }
    mt19937 mt;
    if (state_bytes != STATE_BYTES || mt_load(&mt, state) < 0) {
        PyErr_Format(PyExc_ValueError, "exponential_race: not a torch CPU generator state (%zd bytes)", state_bytes);
        return NULL;
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (score_rows && !score_rows[r]) {
            mt_skip(&mt, 2 * (uint64_t)vocab);
            continue;
        }
        const float *p = probs + r * vocab;
        Py_ssize_t best = 0;
        float top = 0.0f;
        int have = 0;
        uint32_t words[2 * RACE_CHUNK];
        for (Py_ssize_t j0 = 0; j0 < vocab; j0 += RACE_CHUNK) {
            const Py_ssize_t m = vocab - j0 < RACE_CHUNK ? vocab - j0 : RACE_CHUNK;
            mt_fill(&mt, words, 2 * m);
            for (Py_ssize_t i = 0; i < m; i++) {
                /* One 64-bit word per entry, the first output high; u uses its low 53 bits. */
                const uint64_t bits = (((uint64_t)words[2 * i] << 32) | words[2 * i + 1]) & ((UINT64_C(1) << 53) - 1);
                const float pj = p[j0 + i];
                float score;
                if (pj == 0.0f) {
                    score = bits == 0 ? NAN : 0.0f; /* 0 / q, and 0 / -0.0 (u = 0) is NaN */
                } else {
                    const double u = (double)bits * (1.0 / (double)(UINT64_C(1) << 53));
                    score = pj / (float)(-log(1.0 - u));
                }
                /* torch.argmax: the first maximum, or the first NaN. */
                if (isnan(score)) {
                    if (!have || !isnan(top)) {
                        top = score;
                        best = j0 + i;
                        have = 1;
                    }
                } else if (!have || (!isnan(top) && score > top)) {
                    top = score;
                    best = j0 + i;
                    have = 1;
                }
            }
        }
        tokens[r] = (int32_t)best;
    }
    mt_store(&mt, state);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sample_rows", (PyCFunction)(void (*)(void))sample_rows, METH_FASTCALL, sample_rows_doc},
    {"exponential_race", (PyCFunction)(void (*)(void))exponential_race, METH_FASTCALL, exponential_race_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernel", "CpuSampler's native kernel for the talker's step.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
