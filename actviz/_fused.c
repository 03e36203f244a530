/* One pass over a float32 array for actviz's tensor summaries.
 *
 * summarize(array, stride, count_zeros, out) writes the summary vector that
 * actviz.summaries lays out. It reads each element once for the sum, sum of squares,
 * min, max and zero count; NumPy and torch need one pass per number, and on a
 * training step the data is no longer in cache, so each extra pass costs a trip to
 * memory. It then counts the strided sample into histogram buckets exactly as
 * summaries._summarize_finite_cpu does in NumPy.
 *
 * The loop uses AVX2 and FMA and is picked at run time; VECTORIZED is False on CPUs
 * without them (and off x86-64, or when built with -DACTVIZ_NO_SIMD), and actviz then
 * keeps to its NumPy code.
 *
 * The sum is taken in float64, as NumPy's float64 sum would give it. Sums of squares,
 * which cannot cancel, are taken in float32 over blocks of 4,096 elements (256 per
 * lane) and added up in float64. NaN and Inf make the sum non-finite; the caller then
 * uses its masked path, so min and max need no NaN handling here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(ACTVIZ_NO_SIMD)
#define ACTVIZ_X86 1
#include <immintrin.h>
#endif

#define BLOCK 4096

typedef struct {
    double sum, sum_squares;
    float low, high;
    int64_t zeros;
} moments_t;

#ifdef ACTVIZ_X86
__attribute__((target("avx2,fma"))) static void moments_avx2(const float *x, int64_t n, int count_zeros, moments_t *m) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 low = _mm256_set1_ps(INFINITY), high = _mm256_set1_ps(-INFINITY);
    __m256d sum0 = _mm256_setzero_pd(), sum1 = sum0, sum2 = sum0, sum3 = sum0, squares = sum0;
    int64_t zeros = 0, i = 0;
    const int64_t vector_end = n & ~(int64_t)15;
    while (i < vector_end) {
        const int64_t block_end = i + BLOCK < vector_end ? i + BLOCK : vector_end;
        __m256 q0 = zero, q1 = zero;
        __m256i z = _mm256_setzero_si256();
        for (; i < block_end; i += 16) {
            const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
            sum0 = _mm256_add_pd(sum0, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
            sum1 = _mm256_add_pd(sum1, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
            sum2 = _mm256_add_pd(sum2, _mm256_cvtps_pd(_mm256_castps256_ps128(b)));
            sum3 = _mm256_add_pd(sum3, _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)));
            q0 = _mm256_fmadd_ps(a, a, q0);
            q1 = _mm256_fmadd_ps(b, b, q1);
            low = _mm256_min_ps(low, _mm256_min_ps(a, b));
            high = _mm256_max_ps(high, _mm256_max_ps(a, b));
            if (count_zeros) { /* a true comparison is all ones, -1 as an integer */
                z = _mm256_sub_epi32(z, _mm256_castps_si256(_mm256_cmp_ps(a, zero, _CMP_EQ_OQ)));
                z = _mm256_sub_epi32(z, _mm256_castps_si256(_mm256_cmp_ps(b, zero, _CMP_EQ_OQ)));
            }
        }
        const __m256 q = _mm256_add_ps(q0, q1);
        squares = _mm256_add_pd(squares, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(q)),
                                                       _mm256_cvtps_pd(_mm256_extractf128_ps(q, 1))));
        int32_t lane_zeros[8];
        _mm256_storeu_si256((__m256i *)lane_zeros, z);
        for (int k = 0; k < 8; k++) zeros += lane_zeros[k];
    }
    double sums[4], squares_out[4];
    float lows[8], highs[8];
    _mm256_storeu_pd(sums, _mm256_add_pd(_mm256_add_pd(sum0, sum1), _mm256_add_pd(sum2, sum3)));
    _mm256_storeu_pd(squares_out, squares);
    _mm256_storeu_ps(lows, low);
    _mm256_storeu_ps(highs, high);
    m->sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    m->sum_squares = (squares_out[0] + squares_out[1]) + (squares_out[2] + squares_out[3]);
    m->low = lows[0];
    m->high = highs[0];
    for (int k = 1; k < 8; k++) {
        m->low = lows[k] < m->low ? lows[k] : m->low;
        m->high = highs[k] > m->high ? highs[k] : m->high;
    }
    for (; i < n; i++) {
        const float v = x[i];
        m->sum += v;
        m->sum_squares += (double)v * v;
        m->low = v < m->low ? v : m->low;
        m->high = v > m->high ? v : m->high;
        zeros += v == 0.0f;
    }
    m->zeros = count_zeros ? zeros : -1;
}

static int has_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return known;
}
#else
static int has_avx2(void) { return 0; }
#endif

/* Add the strided sample x[0], x[stride], ... to counts; return how many were sampled. */
static int64_t count_buckets(const float *x, int64_t n, int64_t stride, float low, float width, double *counts, int64_t bins) {
    int64_t sampled = 0;
    for (int64_t i = 0; i < n; i += stride, sampled++) {
        /* Every value is >= low, so truncation is floor; max goes into the last bucket. */
        int64_t index = (int64_t)((x[i] - low) / width);
        index = index < 0 ? 0 : (index >= bins ? bins - 1 : index);
        counts[index] += 1.0;
    }
    return sampled;
}

/* A writable float64 buffer of at least `size` elements, or -1 with a Python error set. */
static int get_vector_buffer(PyObject *object, Py_buffer *view, Py_ssize_t size) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return -1;
    if (view->itemsize != 8 || view->len < 8 * size || strchr(view->format ? view->format : "B", 'd') == NULL) {
        PyErr_Format(PyExc_TypeError, "out must be a writable float64 buffer of at least %zd elements", size);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A C-contiguous, non-empty float32 buffer, or NULL with a Python error set. */
static int get_float_buffer(PyObject *object, Py_buffer *view) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *format = view->format ? view->format : "B";
    if (view->itemsize != 4 || (strcmp(format, "f") != 0 && strcmp(format, "=f") != 0 && strcmp(format, "<f") != 0)) {
        PyErr_Format(PyExc_TypeError, "expected a float32 buffer, got format %s", format);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len == 0) {
        PyErr_SetString(PyExc_ValueError, "expected a non-empty buffer");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The header layout of actviz.summaries: num, nonfinite, zeros, min, max, sum, sum_squares. */
#define HEADER_SIZE 7

static PyObject *summarize(PyObject *self, PyObject *args) {
    PyObject *object, *out_object;
    Py_ssize_t stride;
    int count_zeros;
    if (!PyArg_ParseTuple(args, "OnpO:summarize", &object, &stride, &count_zeros, &out_object)) return NULL;
    if (stride < 1) {
        PyErr_Format(PyExc_ValueError, "stride must be >= 1, got %zd", stride);
        return NULL;
    }
    if (!has_avx2()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no AVX2/FMA; use the NumPy path");
        return NULL;
    }
    Py_buffer view, out;
    if (get_float_buffer(object, &view) < 0) return NULL;
    if (get_vector_buffer(out_object, &out, HEADER_SIZE + 1) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const float *x = (const float *)view.buf;
    const int64_t n = view.len / 4, bins = out.len / 8 - HEADER_SIZE;
    double *vector = (double *)out.buf, *counts = vector + HEADER_SIZE;
    moments_t m = {0};
    int finite = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef ACTVIZ_X86
    moments_avx2(x, n, count_zeros, &m);
#endif
    finite = isfinite(m.sum + m.sum_squares);
    if (finite) {
        for (int64_t i = 0; i < bins; i++) counts[i] = 0.0;
        const float span = m.high - m.low; /* in float32, as NumPy computes it on float32 scalars */
        int64_t sampled;
        if (span > 0) {
            sampled = count_buckets(x, n, stride, m.low, (float)((double)span / bins), counts, bins);
        } else {
            sampled = (n + stride - 1) / stride;
            counts[0] = (double)sampled;
        }
        if (stride > 1) {
            const double scale = (double)n / (double)sampled;
            for (int64_t i = 0; i < bins; i++) counts[i] *= scale;
        }
        vector[0] = (double)n;
        vector[1] = 0.0;
        vector[2] = m.zeros < 0 ? NAN : (double)m.zeros;
        vector[3] = m.low;
        vector[4] = m.high;
        vector[5] = m.sum;
        vector[6] = m.sum_squares;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyBuffer_Release(&out);
    return PyBool_FromLong(finite);
}

static PyMethodDef methods[] = {
    {"summarize", summarize, METH_VARARGS,
     "summarize(array, stride, count_zeros, out) -> finite\n\n"
     "Fill out (float64, HEADER_SIZE + bins long) with the summary vector of a non-empty C-contiguous\n"
     "float32 buffer, as actviz.summaries lays it out: moments in one pass, then the buckets of every\n"
     "stride-th element scaled to the full count. Returns False, leaving out unspecified, when the array\n"
     "holds NaN or Inf or its sum of squares overflows float32; the caller then uses its masked path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", "One-pass float32 reductions for actviz.summaries.", -1, methods};

PyMODINIT_FUNC PyInit__fused(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObject(m, "VECTORIZED", PyBool_FromLong(has_avx2())) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
