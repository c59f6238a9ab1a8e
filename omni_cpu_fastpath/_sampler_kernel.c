/* The talker's sampling step in one pass per row: CpuSampler's native kernel.
 *
 * At batch 1 a [1, 3072] sampling step is microseconds of arithmetic and ~20 library calls of
 * Python/ATen/numpy dispatch; this kernel does the arithmetic in one call, with vLLM 0.30's
 * Sampler semantics (omni_cpu_fastpath/sampler.py states them and calls this):
 *
 *   1. penalties, in place: repetition on tokens seen in the prompt or the output
 *      (logit * (1 / p) when the logit is > 0, else logit * p), then frequency (logit -= f * count)
 *      and presence (logit -= r for tokens in the output); each distinct token once;
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

static PyMethodDef methods[] = {
    {"sample_rows", (PyCFunction)(void (*)(void))sample_rows, METH_FASTCALL, sample_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sampler_kernel", "CpuSampler's native kernel for the talker's step.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sampler_kernel(void) { return PyModule_Create(&module); }
