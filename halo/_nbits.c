/* halo._nbits: x @ W.T for a compact (4- or 8-bit, per-block scaled) weight held in halo's rows-last layout,
 * read straight from the codes. What a memory-bounded agent computes HALO's re-mapped groups with
 * (halo.linear.DequantKernel): numpy has to expand the codes to float32 first, 8x their bytes through memory
 * (0.6 ms for a TinyLlama-sized group against ~0.2 ms here). Plain C the compiler vectorizes on every target
 * (SSE2 on x86-64, NEON on aarch64); the GIL is released while it runs, so the agent's loader thread reads the
 * next groups meanwhile.
 *
 * Layout (MatMulNBits' arrays with their row axis moved last): codes [blocks, block * bits / 8, n] (4-bit: byte i
 * holds input 2i's weight in its low nibble, 2i + 1's in its high one), scales and bias [blocks, n], x [T, blocks *
 * block], out [T, n]:
 *     out[t, r] = sum_b scales[b, r] * dot(codes[b, :, r], x[t, block b]) + bias[b, r] * sum(x[t, block b])
 * where bias = offset - 2^(bits-1) x scale (Q4_1's minimums), or -2^(bits-1) x scale when no bias is given. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* dots[t, r] = sum_i codes[i, r] x[t, i] over one block: byte i of every row is contiguous, so each step is one
 * multiply-add across rows (vectorized across r, no per-row reduction), and a byte row is read once for every token
 * while it is in L1. 4-bit: low nibbles against the even inputs, high ones against the odd. */
static void block_dots(const uint8_t *restrict codes, const float *restrict x, Py_ssize_t x_stride, Py_ssize_t tokens,
                       float *restrict dots, Py_ssize_t n, int bits, Py_ssize_t block)
{
    memset(dots, 0, (size_t)(tokens * n) * sizeof(float));
    for (Py_ssize_t i = 0; i < block * bits / 8; i++) {
        const uint8_t *c = codes + i * n;
        for (Py_ssize_t t = 0; t < tokens; t++) {
            float *restrict d = dots + t * n;
            if (bits == 8) {
                const float xi = x[t * x_stride + i];
                for (Py_ssize_t r = 0; r < n; r++)
                    d[r] += (float)c[r] * xi;
            } else {
                const float even = x[t * x_stride + 2 * i], odd = x[t * x_stride + 2 * i + 1];
                for (Py_ssize_t r = 0; r < n; r++)
                    d[r] += (float)(c[r] & 15) * even + (float)(c[r] >> 4) * odd;
            }
        }
    }
}

static int matmul(const uint8_t *codes, const float *scales, const float *bias, const float *x, float *out,
                  Py_ssize_t tokens, Py_ssize_t blocks, Py_ssize_t n, int bits, Py_ssize_t block)
{
    const Py_ssize_t block_bytes = block * bits / 8 * n, k = blocks * block;
    const float zero_point = (float)(1 << (bits - 1));
    float *dots = PyMem_RawMalloc((size_t)(tokens * n) * sizeof(float));
    if (!dots)
        return -1;
    memset(out, 0, (size_t)(tokens * n) * sizeof(float));
    for (Py_ssize_t b = 0; b < blocks; b++) {
        block_dots(codes + b * block_bytes, x + b * block, k, tokens, dots, n, bits, block);
        const float *sb = scales + b * n, *bb = bias ? bias + b * n : NULL;
        for (Py_ssize_t t = 0; t < tokens; t++) {
            const float *xb = x + t * k + b * block, *d = dots + t * n;
            float *y = out + t * n, x_sum = 0.f;
            for (Py_ssize_t i = 0; i < block; i++)
                x_sum += xb[i];
            if (bb) {
                for (Py_ssize_t r = 0; r < n; r++)
                    y[r] += sb[r] * d[r] + bb[r] * x_sum;
            } else {
                for (Py_ssize_t r = 0; r < n; r++)
                    y[r] += sb[r] * (d[r] - zero_point * x_sum);
            }
        }
    }
    PyMem_RawFree(dots);
    return 0;
}

/* A C-contiguous buffer of `items` values of type `format` ("B": uint8, "f": float32; any count when items < 0). */
static int contiguous(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t items, const char *format,
                      int writable)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const Py_ssize_t itemsize = format[0] == 'f' ? 4 : 1;
    const char *found = view->format ? view->format : "B";
    if (strcmp(found, format) || view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s holds values of type '%s'; it must be %s", name, found,
                     itemsize == 4 ? "float32 ('f')" : "uint8 ('B')");
        PyBuffer_Release(view);
        return -1;
    }
    if (items >= 0 && view->len != items * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd values; the shapes given need %zd", name, view->len / itemsize,
                     items);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *names[] = {"codes", "scales", "bias", "x", "out", "bits", "block", NULL};
    PyObject *codes_obj, *scales_obj, *bias_obj, *x_obj, *out_obj;
    int bits;
    Py_ssize_t block;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOin", names, &codes_obj, &scales_obj, &bias_obj, &x_obj,
                                     &out_obj, &bits, &block))
        return NULL;
    if ((bits != 4 && bits != 8) || block <= 0 || block % 2) {
        PyErr_Format(PyExc_ValueError, "bits must be 4 or 8 and the block even and positive (got %d, %zd)", bits, block);
        return NULL;
    }
    Py_buffer codes, scales, bias = {0}, x, out;
    if (contiguous(scales_obj, &scales, "scales", -1, "f", 0) < 0)
        return NULL;
    if (scales.ndim != 2) {
        PyBuffer_Release(&scales);
        PyErr_SetString(PyExc_ValueError, "scales must be a [blocks, n] float32 array");
        return NULL;
    }
    const Py_ssize_t blocks = scales.shape[0], n = scales.shape[1], row_bytes = block * bits / 8;
    if (blocks == 0 || block > (1 << 20)) {  /* real blocks are 32 (4-bit) or up to a row (int8) */
        PyBuffer_Release(&scales);
        PyErr_Format(PyExc_ValueError, "scales hold %zd blocks of %zd inputs: nothing to compute with", blocks, block);
        return NULL;
    }
    /* shapes compared, never multiplied: the products of a real buffer's dimensions cannot overflow */
    if (contiguous(codes_obj, &codes, "codes", -1, "B", 0) < 0) {
        PyBuffer_Release(&scales);
        return NULL;
    }
    if (codes.ndim != 3 || codes.shape[0] != blocks || codes.shape[1] != row_bytes || codes.shape[2] != n) {
        PyErr_Format(PyExc_ValueError, "codes must be [blocks %zd, bytes %zd, n %zd] (rows last)", blocks, row_bytes, n);
        PyBuffer_Release(&scales), PyBuffer_Release(&codes);
        return NULL;
    }
    int have_bias = bias_obj != Py_None;
    if (have_bias && contiguous(bias_obj, &bias, "bias", scales.len / 4, "f", 0) < 0) {
        PyBuffer_Release(&scales), PyBuffer_Release(&codes);
        return NULL;
    }
    if (contiguous(x_obj, &x, "x", -1, "f", 0) < 0) {
        PyBuffer_Release(&scales), PyBuffer_Release(&codes);
        if (have_bias) PyBuffer_Release(&bias);
        return NULL;
    }
    if (x.ndim != 2 || x.shape[1] != blocks * block) {
        PyErr_Format(PyExc_ValueError, "x must be [tokens, %zd] float32 inputs", blocks * block);
        goto fail_x;
    }
    const Py_ssize_t tokens = x.shape[0];
    if (contiguous(out_obj, &out, "out", tokens * n, "f", 1) < 0)
        goto fail_x;
    if ((char *)out.buf < (char *)x.buf + x.len && (char *)x.buf < (char *)out.buf + out.len) {
        PyErr_SetString(PyExc_ValueError, "out overlaps x: give it a buffer of its own");
        PyBuffer_Release(&out);
        goto fail_x;
    }
    int failed = 0;
    if (tokens > 0 && n > 0) {
        Py_BEGIN_ALLOW_THREADS
        failed = matmul(codes.buf, scales.buf, have_bias ? bias.buf : NULL, x.buf, out.buf, tokens, blocks, n, bits, block);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    if (failed) {
        PyErr_NoMemory();
        goto fail_x;
    }
    PyBuffer_Release(&x), PyBuffer_Release(&scales), PyBuffer_Release(&codes);
    if (have_bias) PyBuffer_Release(&bias);
    Py_RETURN_NONE;
fail_x:
    PyBuffer_Release(&x), PyBuffer_Release(&scales), PyBuffer_Release(&codes);
    if (have_bias) PyBuffer_Release(&bias);
    return NULL;
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS,
     "matmul(codes, scales, bias, x, out, bits, block): out[T, n] = x[T, k] @ W.T for W held as rows-last codes "
     "[blocks, block*bits/8, n] (uint8), scales and bias [blocks, n] (float32; bias None: -2^(bits-1) x scales)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nbits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nbits(void) { return PyModule_Create(&module); }
