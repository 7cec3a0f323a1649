/* halo._nbits: x @ W.T for a compact (4- or 8-bit, per-block scaled) weight held in halo's rows-last layout,
 * read straight from the codes. What computes a narrow GGUF model's compact projections wherever the package was
 * built with a C compiler (halo.linear.CompactProjection: SmolLM2's 576 x 576 Q4_1 matrix in 0.011 ms here; wider
 * models run on onnxruntime's int8 kernels), and HALO's re-mapped groups on a memory-bounded agent
 * (halo.linear.DequantKernel; numpy would expand the codes to float32 first, 8x their bytes through memory).
 * Activations stay float32, so a result is within rounding of the dequantized float32 weights. Plain C the compiler
 * vectorizes (AVX-512 / AVX2 / SSE2 clones on x86-64, NEON on aarch64); the GIL is released while it runs.
 *
 * Layout (MatMulNBits' arrays with their row axis moved last): codes [blocks, block * bits / 8, n] (4-bit: byte i
 * holds input 2i's weight in its low nibble, 2i + 1's in its high one), scales and offsets [blocks, n], x [T, blocks *
 * block], out [T, n]; weight = (code - 2^(bits-1)) x scale + offset (Q4_1's minimums; no offsets: none), so
 *     out[t, r] = sum_b scales[b, r] * (dot(codes[b, :, r], x[t, block b]) - 2^(bits-1) x_sum) + offsets[b, r] x_sum
 * with x_sum = sum(x[t, block b]). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Rows per tile on wide matrices: a tile's dots and sums (8 KB each per token) stay in L1 while every block of the
 * tile's rows goes by (SmolLM2's LM head, 49,152 rows, streamed from memory: 1.4 ms, 3.0 ms whole). Up to
 * WHOLE_ROWS rows are one tile: the codes then stream in file order (tiles of 512 rows cost SmolLM2's 30 layers
 * 10.3 vs 7.3 ms per token). PREFETCH: byte rows ahead asked of the memory while this one is computed (7.2 ->
 * 5.9 ms per token for the layers, 3.4 -> 1.9 for the LM head). */
#define TILE 2048
#define WHOLE_ROWS 4096
#define PREFETCH 8

/* dots[t, r] = sum_i codes[i, r] x[t, i] over one block, for the `n` rows of a tile (`stride`: bytes between byte i
 * and byte i + 1 of a row): byte i of every row is contiguous, so each step is one multiply-add across rows
 * (vectorized across r, no per-row reduction). 4-bit: low nibbles against the even inputs, high ones against the
 * odd. Every row's value is the same sequence of operations whatever the tile or the rows around it, so a shard of
 * rows computes bit for bit what the whole matrix computes for them. */
static inline __attribute__((always_inline)) void block_dots(const uint8_t *restrict codes, Py_ssize_t stride,
                                                             const float *restrict x, Py_ssize_t x_stride,
                                                             Py_ssize_t tokens, float *restrict dots, Py_ssize_t n,
                                                             int bits, Py_ssize_t block)
{
    memset(dots, 0, (size_t)(tokens * n) * sizeof(float));
    for (Py_ssize_t i = 0; i < block * bits / 8; i++) {
        const uint8_t *c = codes + i * stride;
        for (Py_ssize_t r = 0; r < n; r += 64)  /* past the array's end near the last block: a prefetch never faults */
            __builtin_prefetch(c + PREFETCH * stride + r);
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

/* Scales and minimums come as float32 or as float16 (what GGUF stores: half the bytes, exactly the file's values). */
#if defined(__FLT16_MANT_DIG__)
typedef _Float16 half;
#define HALF_TO_FLOAT(h) ((float)(h))
#else  /* a compiler without _Float16: the bits by hand */
typedef uint16_t half;
static inline float half_bits_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (mant << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    else {
        const float f = (float)mant * (1.0f / 16777216.0f);  /* zero or subnormal: mant x 2^-24 */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define HALF_TO_FLOAT(h) half_bits_to_float(h)
#endif

/* A tile's `m` values of one block row as float32: the array itself, or converted into `into`. */
static inline __attribute__((always_inline)) const float *as_floats(const void *values, int is_half, Py_ssize_t at,
                                                                    Py_ssize_t m, float *into)
{
    if (!is_half)
        return (const float *)values + at;
    const half *h = (const half *)values + at;
    for (Py_ssize_t r = 0; r < m; r++)
        into[r] = HALF_TO_FLOAT(h[r]);
    return into;
}

/* One multiplication: x @ W.T into out, with the inputs' per-block sums computed once. */
typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets;  /* float32 or float16 (is_half); offsets NULL: none */
    int is_half, bits;
    const float *x, *x_sums;
    float *out;
    Py_ssize_t tokens, blocks, n, block;
} Job;

/* Rows r0 .. r0 + m of the output. scratch: 2 x tokens x m + 2 x m floats.
 * One body compiled for three x86-64 levels, picked at load time by the CPU it runs on (AVX-512: 2.7x the SSE2
 * build here, 0.011 vs 0.031 ms for a 576 x 576 Q4_1 matrix); elsewhere (aarch64: NEON) the one build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static void tile_rows(const Job *job, Py_ssize_t r0, Py_ssize_t m, float *scratch)
{
    const Py_ssize_t n = job->n, tokens = job->tokens, blocks = job->blocks, block = job->block;
    const Py_ssize_t row_bytes = block * job->bits / 8, k = blocks * block;
    const float zero_point = (float)(1 << (job->bits - 1));
    float *dots = scratch, *sums = scratch + tokens * m, *converted = scratch + 2 * tokens * m;
    memset(sums, 0, (size_t)(tokens * m) * sizeof(float));
    for (Py_ssize_t b = 0; b < blocks; b++) {
        block_dots(job->codes + b * row_bytes * n + r0, n, job->x + b * block, k, tokens, dots, m, job->bits, block);
        const float *sb = as_floats(job->scales, job->is_half, b * n + r0, m, converted);
        const float *mb = job->offsets ? as_floats(job->offsets, job->is_half, b * n + r0, m, converted + m) : NULL;
        for (Py_ssize_t t = 0; t < tokens; t++) {
            const float *d = dots + t * m, x_sum = job->x_sums[t * blocks + b];
            float *y = sums + t * m;
            if (mb) {
                for (Py_ssize_t r = 0; r < m; r++)
                    y[r] += sb[r] * (d[r] - zero_point * x_sum) + mb[r] * x_sum;
            } else {
                for (Py_ssize_t r = 0; r < m; r++)
                    y[r] += sb[r] * (d[r] - zero_point * x_sum);
            }
        }
    }
    for (Py_ssize_t t = 0; t < tokens; t++)
        memcpy(job->out + t * n + r0, sums + t * m, (size_t)m * sizeof(float));
}

/* The tiles of rows on `threads` threads (OpenMP, where the build has it): with more than one, no tile is wider
 * than a thread's share of the rows, in whole cache lines of codes. A row's value never depends on its tile, so
 * every thread count gives the same bits. Returns -1 when out of memory. */
static int matmul(Job *job, int threads)
{
    const Py_ssize_t n = job->n, tokens = job->tokens, blocks = job->blocks, block = job->block;
    Py_ssize_t tile = n <= WHOLE_ROWS ? n : TILE;
    if (threads > 1) {
        const Py_ssize_t share = ((n + threads - 1) / threads + 63) / 64 * 64;
        tile = share < tile ? share : tile;
    }
    const Py_ssize_t tiles = (n + tile - 1) / tile, scratch_floats = 2 * tokens * tile + 2 * tile;
    float *x_sums = PyMem_RawMalloc((size_t)(tokens * blocks) * sizeof(float));
    if (!x_sums)
        return -1;
    for (Py_ssize_t t = 0; t < tokens; t++)
        for (Py_ssize_t b = 0; b < blocks; b++) {
            float s = 0.f;
            for (Py_ssize_t i = 0; i < block; i++)
                s += job->x[t * blocks * block + b * block + i];
            x_sums[t * blocks + b] = s;
        }
    job->x_sums = x_sums;
    int failed = 0;
#ifdef _OPENMP
    if (threads > 1 && tiles > 1) {
#pragma omp parallel num_threads(threads)
        {
            float *scratch = malloc((size_t)scratch_floats * sizeof(float));
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (Py_ssize_t i = 0; i < tiles; i++)
                if (scratch)
                    tile_rows(job, i * tile, n - i * tile < tile ? n - i * tile : tile, scratch);
            free(scratch);
        }
        PyMem_RawFree(x_sums);
        return failed ? -1 : 0;
    }
#endif
    float *scratch = PyMem_RawMalloc((size_t)scratch_floats * sizeof(float));
    if (!scratch)
        failed = 1;
    for (Py_ssize_t i = 0; i < tiles && !failed; i++)
        tile_rows(job, i * tile, n - i * tile < tile ? n - i * tile : tile, scratch);
    PyMem_RawFree(scratch), PyMem_RawFree(x_sums);
    return failed ? -1 : 0;
}

/* A C-contiguous buffer of `items` values of type `format` ("B": uint8, "f": float32, "e": float16; "fe": either;
 * any count when items < 0). */
static int contiguous(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t items, const char *format,
                      int writable)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *found = view->format ? view->format : "B";
    const Py_ssize_t itemsize = found[0] == 'f' ? 4 : found[0] == 'e' ? 2 : 1;
    if (strlen(found) != 1 || !strchr(format, found[0]) || view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s holds values of type '%s'; it must be %s", name, found,
                     !strcmp(format, "fe") ? "float32 ('f') or float16 ('e')"
                     : format[0] == 'f' ? "float32 ('f')" : "uint8 ('B')");
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
    static char *names[] = {"codes", "scales", "offsets", "x", "out", "bits", "block", "threads", NULL};
    PyObject *codes_obj, *scales_obj, *offsets_obj, *x_obj, *out_obj;
    int bits, threads = 1;
    Py_ssize_t block;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOin|i", names, &codes_obj, &scales_obj, &offsets_obj, &x_obj,
                                     &out_obj, &bits, &block, &threads))
        return NULL;
    if ((bits != 4 && bits != 8) || block <= 0 || block % 2) {
        PyErr_Format(PyExc_ValueError, "bits must be 4 or 8 and the block even and positive (got %d, %zd)", bits, block);
        return NULL;
    }
    if (threads < 1 || threads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..1024 (got %d)", threads);
        return NULL;
    }
    Py_buffer codes, scales, offsets = {0}, x, out;
    if (contiguous(scales_obj, &scales, "scales", -1, "fe", 0) < 0)
        return NULL;
    if (scales.ndim != 2) {
        PyBuffer_Release(&scales);
        PyErr_SetString(PyExc_ValueError, "scales must be a [blocks, n] float32 or float16 array");
        return NULL;
    }
    const int is_half = scales.format[0] == 'e';
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
    int have_offsets = offsets_obj != Py_None;
    if (have_offsets && contiguous(offsets_obj, &offsets, "offsets", scales.len / scales.itemsize,
                                   is_half ? "e" : "f", 0) < 0) {
        PyBuffer_Release(&scales), PyBuffer_Release(&codes);
        return NULL;
    }
    if (contiguous(x_obj, &x, "x", -1, "f", 0) < 0) {
        PyBuffer_Release(&scales), PyBuffer_Release(&codes);
        if (have_offsets) PyBuffer_Release(&offsets);
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
        Job job = {codes.buf, scales.buf, have_offsets ? offsets.buf : NULL, is_half, bits, x.buf, NULL, out.buf,
                   tokens, blocks, n, block};
        failed = matmul(&job, threads);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    if (failed) {
        PyErr_NoMemory();
        goto fail_x;
    }
    PyBuffer_Release(&x), PyBuffer_Release(&scales), PyBuffer_Release(&codes);
    if (have_offsets) PyBuffer_Release(&offsets);
    Py_RETURN_NONE;
fail_x:
    PyBuffer_Release(&x), PyBuffer_Release(&scales), PyBuffer_Release(&codes);
    if (have_offsets) PyBuffer_Release(&offsets);
    return NULL;
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS,
     "matmul(codes, scales, offsets, x, out, bits, block, threads=1): out[T, n] = x[T, k] @ W.T for W held as rows-last codes "
     "[blocks, block*bits/8, n] (uint8), scales and offsets [blocks, n] (both float32 or both float16; offsets "
     "None: none): weight = (code - 2^(bits-1)) x scale + offset."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nbits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nbits(void) { return PyModule_Create(&module); }
