/* halo._nbits: x @ W.T for a compact (4- or 8-bit, per-block scaled) weight, read straight from its codes with
 * integer dot products. What computes GGUF compact projections and int8 ones wherever the package was built with a
 * C compiler and the CPU has AVX2 or AVX-512 VNNI (halo.linear.KernelProjection), and HALO's re-mapped groups on a
 * memory-bounded agent (halo.linear.DequantKernel).
 *
 * Activations: per block of the weight's, x is quantized as MatMulNBits does at accuracy level 4, to int8 codes
 * q1 = rint(x / d1) with d1 = max|x| / 127, and (terms = 2) the residual r = x - q1 d1 to q2 = rint(r / d2), d2 =
 * max|r| / 127: x = q1 d1 + q2 d2 within ~1/64516 of the block's range (one term: 1/254). The codes times the
 * weights' codes are then exact integer sums (AVX-512 VNNI, AVX2, or plain C: the same integers on every CPU),
 * turned to float32 by the same operations in the same order on every path, so one row gets the same bits
 * whatever the CPU's vector width, its tile, its thread or the rows around it (a row shard = the whole matrix).
 *
 * Layout (MatMulNBits' arrays with the rows moved next to last, in 4-byte words): codes [blocks, words, n, 4]
 * (words = block x bits / 32; 4-bit: byte j of a block holds input 2j's weight in its low nibble, 2j + 1's in its
 * high one), scales and offsets [blocks, n], x [T, blocks x block], out [T, n]; weight = (code - 2^(bits-1)) x
 * scale + offset (Q4_1's minimums; no offsets: none), so with z = 2^(bits-1) and s = sum(x over block b):
 *     out[t, r] = sum_b scales[b, r] (d1 (codes . q1 - z sum q1) + d2 (codes . q2 - z sum q2)) + offsets[b, r] s
 * A 32-bit lane holds 4 bytes of one row: one VNNI instruction multiplies 16 rows x 4 bytes by 4 broadcast
 * activation codes. The GIL is released while it runs; OpenMP splits the rows over `threads`. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HALO_X86 1
#endif

/* Rows per tile on wide matrices: a tile's partial sums (tokens x TILE floats) stay in cache while every block of
 * its rows goes by; up to WHOLE_ROWS rows are one tile, so the codes stream in file order. PREFETCH: code rows
 * (of n x 4 bytes) ahead asked of the memory while this one is computed. */
#define TILE 2048
#define WHOLE_ROWS 4096
#define PREFETCH_WORDS 8

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

enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2 };
static const char *PATH_NAMES[] = {"scalar", "avx2", "avx512_vnni"};

/* One multiplication. Per token and block: `quads` int32 words of 4 activation codes each, lined up with a code
 * word (4-bit: word w's low nibbles meet inputs 8w, 8w+2, 8w+4, 8w+6, its high ones 8w+1, +3, +5, +7: two quads;
 * 8-bit: inputs 4w .. 4w+3), term 1's then term 2's; `steps` d1, d2; `zero_sums` z x sum(q) per term; `x_sums`. */
typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets;  /* float32 or float16 (is_half); offsets NULL: none */
    int is_half, bits, terms;
    Py_ssize_t tokens, blocks, n, block, words, quads;
    const int32_t *x_quads;  /* [tokens, blocks, terms, quads] */
    const float *steps;      /* [tokens, blocks, 2] */
    const int32_t *zero_sums;/* [tokens, blocks, 2] */
    const float *x_sums;     /* [tokens, blocks] */
    float *out;
} Job;

static inline const int32_t *quads_of(const Job *job, Py_ssize_t t, Py_ssize_t b)
{
    return job->x_quads + (t * job->blocks + b) * job->terms * job->quads;
}

/* What a block adds to a row's sum, from its two integer dot products: the one sequence of float operations every
 * path performs (the vector paths lane by lane with the same roundings: mul, fma, mul, add, fma). */
static inline float block_term(float y, float scale, float offset, int has_offset, int32_t dot1, int32_t dot2,
                               const float *steps, float x_sum)
{
    float t = steps[0] * (float)dot1;
    t = fmaf(steps[1], (float)dot2, t);
    y = y + scale * t;
    return has_offset ? fmaf(offset, x_sum, y) : y;
}

static inline float value_at(const void *values, int is_half, Py_ssize_t i)
{
    return is_half ? HALF_TO_FLOAT(((const half *)values)[i]) : ((const float *)values)[i];
}

/* Rows r0 .. r1 of a tile (the rows a vector does not fill, and CPUs without AVX2), up to 64 at a time, in plain C
 * (~1 GB/s of codes on x86-64 here: without a vector path the projections go to MatMulNBits,
 * halo.linear.C_KERNEL_VECTORIZED; a memory-bounded device's compact groups still come here). */
#define SCALAR_ROWS 64
static void rows_scalar(const Job *job, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t b, float *y, Py_ssize_t m,
                        Py_ssize_t tile_start)
{
    const Py_ssize_t n = job->n, words = job->words;
    int32_t dot[2][SCALAR_ROWS];
    for (Py_ssize_t start = r0; start < r1; start += SCALAR_ROWS) {
        const Py_ssize_t rows = r1 - start < SCALAR_ROWS ? r1 - start : SCALAR_ROWS;
        for (Py_ssize_t t = 0; t < job->tokens; t++) {
            const int32_t *q = quads_of(job, t, b);
            memset(dot, 0, sizeof dot);
            for (int term = 0; term < job->terms; term++, q += job->quads)
                for (Py_ssize_t w = 0; w < words; w++) {
                    const uint8_t *restrict c = job->codes + ((b * words + w) * n + start) * 4;
                    int32_t *restrict d = dot[term];
                    if (job->bits == 8) {
                        const int8_t *x = (const int8_t *)(q + w);
                        const int32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
                        for (Py_ssize_t r = 0; r < rows; r++)
                            d[r] += c[4 * r] * x0 + c[4 * r + 1] * x1 + c[4 * r + 2] * x2 + c[4 * r + 3] * x3;
                    } else {
                        const int8_t *lo = (const int8_t *)(q + 2 * w), *hi = (const int8_t *)(q + 2 * w + 1);
                        const int32_t l0 = lo[0], l1 = lo[1], l2 = lo[2], l3 = lo[3];
                        const int32_t h0 = hi[0], h1 = hi[1], h2 = hi[2], h3 = hi[3];
                        for (Py_ssize_t r = 0; r < rows; r++)
                            d[r] += (c[4 * r] & 15) * l0 + (c[4 * r + 1] & 15) * l1 + (c[4 * r + 2] & 15) * l2
                                    + (c[4 * r + 3] & 15) * l3 + (c[4 * r] >> 4) * h0 + (c[4 * r + 1] >> 4) * h1
                                    + (c[4 * r + 2] >> 4) * h2 + (c[4 * r + 3] >> 4) * h3;
                    }
                }
            const int32_t *z = job->zero_sums + (t * job->blocks + b) * 2;
            const float *steps = job->steps + (t * job->blocks + b) * 2, x_sum = job->x_sums[t * job->blocks + b];
            float *yt = y + t * m + (start - tile_start);
            for (Py_ssize_t r = 0; r < rows; r++) {
                const float scale = value_at(job->scales, job->is_half, b * n + start + r);
                const float offset = job->offsets ? value_at(job->offsets, job->is_half, b * n + start + r) : 0.f;
                yt[r] = block_term(yt[r], scale, offset, job->offsets != NULL, dot[0][r] - z[0], dot[1][r] - z[1],
                                   steps, x_sum);
            }
        }
    }
}

#ifdef HALO_X86
/* 16 rows' scales (or minimums) of block b from row r as float32. */
#define LOAD16(values, at)                                                                                      \
    (job->is_half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(values) + (at))))  \
                  : _mm512_loadu_ps((const float *)(values) + (at)))

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

/* Sixteen rows of block b for every token. WORDS, BITS and TERMS are constants where it matters (GGUF's blocks of
 * 32: 4 words of 4-bit codes, 8 of 8-bit), so the loops unroll and the codes stay in registers across tokens;
 * WORDS = 0: any width, the codes read from cache per token. Four independent sums per term (integers: their
 * order cannot change the result) let the multiply-adds overlap. */
static inline __attribute__((always_inline)) AVX512 void chunk_avx512(const Job *job, Py_ssize_t r, Py_ssize_t b,
                                                                      float *y, Py_ssize_t m, Py_ssize_t tile_start,
                                                                      const int WORDS, const int BITS, const int TERMS)
{
    const Py_ssize_t n = job->n, words = WORDS ? WORDS : job->words, row_words = n * 4;
    const __m512i low = _mm512_set1_epi8(15);
    const uint8_t *codes = job->codes + (b * words * n + r) * 4;
    __m512i lo[8], hi[8];
    if (WORDS) {
        for (int w = 0; w < WORDS; w++) {
            _mm_prefetch((const char *)(codes + (w + PREFETCH_WORDS) * row_words), _MM_HINT_T0);
            lo[w] = _mm512_loadu_si512(codes + w * row_words);
            if (BITS == 4) {
                hi[w] = _mm512_and_si512(_mm512_srli_epi16(lo[w], 4), low);
                lo[w] = _mm512_and_si512(lo[w], low);
            }
        }
    }
    const __m512 scale = LOAD16(job->scales, b * n + r);
    const __m512 offset = job->offsets ? LOAD16(job->offsets, b * n + r) : _mm512_setzero_ps();
    for (Py_ssize_t t = 0; t < job->tokens; t++) {
        const int32_t *q = quads_of(job, t, b);
        __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int term = 0; term < TERMS; term++, q += job->quads) {
            __m512i part[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                               _mm512_setzero_si512()};
            for (Py_ssize_t w = 0; w < words; w++) {
                __m512i cl, ch = _mm512_setzero_si512();
                if (WORDS)
                    cl = lo[w], ch = BITS == 4 ? hi[w] : ch;
                else {
                    cl = _mm512_loadu_si512(codes + w * row_words);
                    if (BITS == 4)
                        ch = _mm512_and_si512(_mm512_srli_epi16(cl, 4), low), cl = _mm512_and_si512(cl, low);
                }
                if (BITS == 8)
                    part[w & 3] = _mm512_dpbusd_epi32(part[w & 3], cl, _mm512_set1_epi32(q[w]));
                else {
                    part[2 * (w & 1)] = _mm512_dpbusd_epi32(part[2 * (w & 1)], cl, _mm512_set1_epi32(q[2 * w]));
                    part[2 * (w & 1) + 1] = _mm512_dpbusd_epi32(part[2 * (w & 1) + 1], ch,
                                                                _mm512_set1_epi32(q[2 * w + 1]));
                }
            }
            dot[term] = _mm512_add_epi32(_mm512_add_epi32(part[0], part[1]), _mm512_add_epi32(part[2], part[3]));
        }
        const int32_t *z = job->zero_sums + (t * job->blocks + b) * 2;
        const float *steps = job->steps + (t * job->blocks + b) * 2;
        float *yt = y + t * m + (r - tile_start);
        __m512 s = _mm512_mul_ps(_mm512_set1_ps(steps[0]),
                                 _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[0], _mm512_set1_epi32(z[0]))));
        s = _mm512_fmadd_ps(_mm512_set1_ps(steps[1]),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[1], _mm512_set1_epi32(z[1]))), s);
        __m512 acc = _mm512_add_ps(_mm512_loadu_ps(yt), _mm512_mul_ps(scale, s));
        if (job->offsets)
            acc = _mm512_fmadd_ps(offset, _mm512_set1_ps(job->x_sums[t * job->blocks + b]), acc);
        _mm512_storeu_ps(yt, acc);
    }
}

/* Rows r0 .. r1 of block b, sixteen at a time, for one block shape; returns the first row left to a narrower path. */
static inline __attribute__((always_inline)) AVX512 Py_ssize_t chunks_avx512(const Job *job, Py_ssize_t r0,
                                                                             Py_ssize_t r1, Py_ssize_t b, float *y,
                                                                             Py_ssize_t m, Py_ssize_t tile_start,
                                                                             const int WORDS, const int BITS,
                                                                             const int TERMS)
{
    Py_ssize_t r = r0;
    for (; r + 16 <= r1; r += 16)
        chunk_avx512(job, r, b, y, m, tile_start, WORDS, BITS, TERMS);
    return r;
}

/* Calls CHUNKS(WORDS, BITS, TERMS) with the job's block shape as constants (GGUF's blocks of 32: 4 words of 4-bit
 * codes, 8 of 8-bit) or WORDS = 0 (any width), and returns what it returns. */
#define BY_SHAPE(CHUNKS)                                                                                        \
    do {                                                                                                        \
        const int bits = job->bits, two = job->terms == 2, words = (int)job->words;                             \
        if (bits == 4 && words == 4) return two ? CHUNKS(4, 4, 2) : CHUNKS(4, 4, 1);                            \
        if (bits == 8 && words == 8) return two ? CHUNKS(8, 8, 2) : CHUNKS(8, 8, 1);                            \
        if (bits == 4) return two ? CHUNKS(0, 4, 2) : CHUNKS(0, 4, 1);                                          \
        return two ? CHUNKS(0, 8, 2) : CHUNKS(0, 8, 1);                                                         \
    } while (0)

#define CHUNKS_AVX512(WORDS, BITS, TERMS) chunks_avx512(job, r0, r1, b, y, m, tile_start, WORDS, BITS, TERMS)

AVX512 static Py_ssize_t rows_avx512(const Job *job, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t b, float *y,
                                     Py_ssize_t m, Py_ssize_t tile_start)
{
    BY_SHAPE(CHUNKS_AVX512);
}

/* AVX2 has no u8 x s8 -> s32 instruction: pmaddubsw (pairs into int16) then pmaddwd by ones. 4-bit pairs stay
 * within 2 x 15 x 127; 8-bit codes are taken as code - 128 (signed) against sign-adjusted activations (pairs
 * within 2 x 128 x 127), which is the zero point applied early: the same integer sums. */
#define LOAD8(values, at)                                                                                       \
    (job->is_half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(values) + (at))))     \
                  : _mm256_loadu_ps((const float *)(values) + (at)))

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* Rows r0 .. r1 of block b, eight at a time; WORDS, BITS and TERMS constants as in chunk_avx512. */
static inline __attribute__((always_inline)) AVX2 Py_ssize_t chunks_avx2(const Job *job, Py_ssize_t r0, Py_ssize_t r1,
                                                                         Py_ssize_t b, float *y, Py_ssize_t m,
                                                                         Py_ssize_t tile_start, const int WORDS,
                                                                         const int BITS, const int TERMS)
{
    const Py_ssize_t n = job->n, words = WORDS ? WORDS : job->words;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    Py_ssize_t r = r0;
    for (; r + 8 <= r1; r += 8) {
        const __m256 scale = LOAD8(job->scales, b * n + r);
        const __m256 offset = job->offsets ? LOAD8(job->offsets, b * n + r) : _mm256_setzero_ps();
        for (Py_ssize_t t = 0; t < job->tokens; t++) {
            const int32_t *q = quads_of(job, t, b);
            __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int term = 0; term < TERMS; term++, q += job->quads)
                for (Py_ssize_t w = 0; w < words; w++) {
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(job->codes + ((b * words + w) * n + r) * 4));
                    __m256i pairs;
                    if (BITS == 8) {
                        const __m256i signed_codes = _mm256_xor_si256(c, flip);
                        pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(signed_codes),
                                                     _mm256_sign_epi8(_mm256_set1_epi32(q[w]), signed_codes));
                    } else {
                        pairs = _mm256_add_epi16(
                            _mm256_maddubs_epi16(_mm256_and_si256(c, low), _mm256_set1_epi32(q[2 * w])),
                            _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), low),
                                                 _mm256_set1_epi32(q[2 * w + 1])));
                    }
                    dot[term] = _mm256_add_epi32(dot[term], _mm256_madd_epi16(pairs, ones));
                }
            const int32_t *z = job->zero_sums + (t * job->blocks + b) * 2;
            const float *steps = job->steps + (t * job->blocks + b) * 2;
            const int early = BITS == 8;  /* 8-bit sums already hold the zero point */
            float *yt = y + t * m + (r - tile_start);
            __m256 s = _mm256_mul_ps(_mm256_set1_ps(steps[0]), _mm256_cvtepi32_ps(
                early ? dot[0] : _mm256_sub_epi32(dot[0], _mm256_set1_epi32(z[0]))));
            s = _mm256_fmadd_ps(_mm256_set1_ps(steps[1]), _mm256_cvtepi32_ps(
                early ? dot[1] : _mm256_sub_epi32(dot[1], _mm256_set1_epi32(z[1]))), s);
            __m256 acc = _mm256_add_ps(_mm256_loadu_ps(yt), _mm256_mul_ps(scale, s));
            if (job->offsets)
                acc = _mm256_fmadd_ps(offset, _mm256_set1_ps(job->x_sums[t * job->blocks + b]), acc);
            _mm256_storeu_ps(yt, acc);
        }
    }
    return r;
}
#define CHUNKS_AVX2(WORDS, BITS, TERMS) chunks_avx2(job, r0, r1, b, y, m, tile_start, WORDS, BITS, TERMS)

AVX2 static Py_ssize_t rows_avx2(const Job *job, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t b, float *y, Py_ssize_t m,
                                 Py_ssize_t tile_start)
{
    BY_SHAPE(CHUNKS_AVX2);
}
#endif

/* Rows r0 .. r0 + m of the output on `path`; y: tokens x m floats of scratch. */
static void tile_rows(const Job *job, int path, Py_ssize_t r0, Py_ssize_t m, float *y)
{
    memset(y, 0, (size_t)(job->tokens * m) * sizeof(float));
    for (Py_ssize_t b = 0; b < job->blocks; b++) {
        Py_ssize_t r = r0;
#ifdef HALO_X86
        if (path == PATH_AVX512)
            r = rows_avx512(job, r, r0 + m, b, y, m, r0);
        if (path >= PATH_AVX2)
            r = rows_avx2(job, r, r0 + m, b, y, m, r0);
#endif
        rows_scalar(job, r, r0 + m, b, y, m, r0);
    }
    for (Py_ssize_t t = 0; t < job->tokens; t++)
        memcpy(job->out + t * job->n + r0, y + t * m, (size_t)m * sizeof(float));
}

static int best_path(void)
{
#ifdef HALO_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512vnni"))
        return PATH_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return PATH_AVX2;
#endif
    return PATH_SCALAR;
}

/* x's blocks as activation codes (see the top of this file): the quads, steps, zero-point sums and float sums. */
static void quantize_activations(Job *job, const float *x, int32_t *x_quads, float *steps, int32_t *zero_sums,
                                 float *x_sums)
{
    const Py_ssize_t block = job->block, blocks = job->blocks;
    const int32_t zero_point = 1 << (job->bits - 1);
    float residual[block];
    int8_t codes[block];
    for (Py_ssize_t t = 0; t < job->tokens; t++)
        for (Py_ssize_t b = 0; b < blocks; b++) {
            const float *xb = x + (t * blocks + b) * block;
            const Py_ssize_t at = t * blocks + b;
            float sum = 0.f;
            for (Py_ssize_t i = 0; i < block; i++)
                sum += xb[i], residual[i] = xb[i];
            x_sums[at] = sum;
            steps[2 * at + 1] = 0.f, zero_sums[2 * at + 1] = 0;
            const int finite = isfinite(sum);  /* a NaN or infinity in the block: its outputs are NaN, not codes */
            for (int term = 0; term < job->terms; term++) {
                float amax = 0.f;
                for (Py_ssize_t i = 0; i < block; i++)
                    amax = fmaxf(amax, fabsf(residual[i]));
                const float step = finite ? fmaxf(amax / 127.f, 1e-30f) : NAN;
                int32_t code_sum = 0;
                for (Py_ssize_t i = 0; i < block; i++) {
                    const float code = finite ? rintf(residual[i] / step) : 0.f;
                    codes[i] = (int8_t)code, code_sum += (int32_t)code;
                    residual[i] = residual[i] - code * step;
                }
                steps[2 * at + term] = step, zero_sums[2 * at + term] = zero_point * code_sum;
                int8_t *quads = (int8_t *)(x_quads + (at * job->terms + term) * job->quads);
                for (Py_ssize_t w = 0; w < job->words; w++)
                    for (int j = 0; j < 4; j++) {
                        if (job->bits == 8)
                            quads[4 * w + j] = codes[4 * w + j];
                        else
                            quads[8 * w + j] = codes[8 * w + 2 * j], quads[8 * w + 4 + j] = codes[8 * w + 2 * j + 1];
                    }
            }
        }
}

/* The tiles of rows on `threads` threads (OpenMP, where the build has it): with more than one, no tile is wider
 * than a thread's share of the rows, in whole cache lines of codes. Returns -1 when out of memory. */
static int matmul(Job *job, const float *x, int threads, int path)
{
    const Py_ssize_t n = job->n, tokens = job->tokens, blocks = job->blocks;
    Py_ssize_t tile = n <= WHOLE_ROWS ? n : TILE;
    if (threads > 1) {
        const Py_ssize_t share = ((n + threads - 1) / threads + 15) / 16 * 16;
        tile = share < tile ? share : tile;
    }
    const Py_ssize_t tiles = (n + tile - 1) / tile, per_block = tokens * blocks;
    const size_t quad_bytes = (size_t)(per_block * job->terms * job->quads) * sizeof(int32_t);
    char *prepared = PyMem_RawMalloc(quad_bytes + (size_t)per_block * (2 * sizeof(float) + 2 * sizeof(int32_t)
                                                                       + sizeof(float)));
    if (!prepared)
        return -1;
    int32_t *x_quads = (int32_t *)prepared;
    float *steps = (float *)(prepared + quad_bytes);
    int32_t *zero_sums = (int32_t *)(steps + 2 * per_block);
    float *x_sums = (float *)(zero_sums + 2 * per_block);
    quantize_activations(job, x, x_quads, steps, zero_sums, x_sums);
    job->x_quads = x_quads, job->steps = steps, job->zero_sums = zero_sums, job->x_sums = x_sums;
    int failed = 0;
#ifdef _OPENMP
    if (threads > 1 && tiles > 1) {
#pragma omp parallel num_threads(threads)
        {
            float *scratch = malloc((size_t)(tokens * tile) * sizeof(float));
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (Py_ssize_t i = 0; i < tiles; i++)
                if (scratch)
                    tile_rows(job, path, i * tile, n - i * tile < tile ? n - i * tile : tile, scratch);
            free(scratch);
        }
        PyMem_RawFree(prepared);
        return failed ? -1 : 0;
    }
#endif
    float *scratch = PyMem_RawMalloc((size_t)(tokens * tile) * sizeof(float));
    if (!scratch)
        failed = 1;
    for (Py_ssize_t i = 0; i < tiles && !failed; i++)
        tile_rows(job, path, i * tile, n - i * tile < tile ? n - i * tile : tile, scratch);
    PyMem_RawFree(scratch), PyMem_RawFree(prepared);
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

static int path_named(const char *name)
{
    for (int p = 0; p < 3; p++)
        if (!strcmp(name, PATH_NAMES[p]))
            return p;
    return -1;
}

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *names[] = {"codes", "scales", "offsets", "x", "out", "bits", "block", "terms", "threads", "path",
                            NULL};
    PyObject *codes_obj, *scales_obj, *offsets_obj, *x_obj, *out_obj;
    int bits, terms = 2, threads = 1;
    const char *path_name = NULL;
    Py_ssize_t block;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOin|iiz", names, &codes_obj, &scales_obj, &offsets_obj, &x_obj,
                                     &out_obj, &bits, &block, &terms, &threads, &path_name))
        return NULL;
    if ((bits != 4 && bits != 8) || block <= 0 || block % (bits == 4 ? 8 : 4) || block > 4096) {
        PyErr_Format(PyExc_ValueError, "bits must be 4 or 8 and the block a multiple of %d up to 4096 (got %d, %zd)",
                     bits == 4 ? 8 : 4, bits, block);
        return NULL;
    }
    if (terms != 1 && terms != 2) {
        PyErr_Format(PyExc_ValueError, "terms must be 1 or 2 (got %d)", terms);
        return NULL;
    }
    if (threads < 1 || threads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..1024 (got %d)", threads);
        return NULL;
    }
    const int best = best_path();
    int path = best;
    if (path_name) {
        path = path_named(path_name);
        if (path < 0 || path > best) {
            PyErr_Format(PyExc_ValueError, "path %s: this CPU runs %s%s%s", path_name, PATH_NAMES[0],
                         best >= 1 ? ", avx2" : "", best >= 2 ? ", avx512_vnni" : "");
            return NULL;
        }
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
    const Py_ssize_t blocks = scales.shape[0], n = scales.shape[1], words = block * bits / 32;
    if (blocks == 0) {
        PyBuffer_Release(&scales);
        PyErr_SetString(PyExc_ValueError, "scales hold no blocks: nothing to compute with");
        return NULL;
    }
    /* shapes compared, never multiplied: the products of a real buffer's dimensions cannot overflow */
    if (contiguous(codes_obj, &codes, "codes", -1, "B", 0) < 0) {
        PyBuffer_Release(&scales);
        return NULL;
    }
    if (codes.ndim != 4 || codes.shape[0] != blocks || codes.shape[1] != words || codes.shape[2] != n
        || codes.shape[3] != 4) {
        PyErr_Format(PyExc_ValueError, "codes must be [blocks %zd, words %zd, n %zd, 4] (rows next to last)", blocks,
                     words, n);
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
        Job job = {codes.buf, scales.buf, have_offsets ? offsets.buf : NULL, is_half, bits, terms,
                   tokens, blocks, n, block, words, bits == 4 ? 2 * words : words, NULL, NULL, NULL, NULL, out.buf};
        failed = matmul(&job, x.buf, threads, path);
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

static PyObject *py_paths(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    const int best = best_path();
    PyObject *names = PyTuple_New(best + 1);
    for (int p = 0; names && p <= best; p++)
        PyTuple_SET_ITEM(names, p, PyUnicode_FromString(PATH_NAMES[p]));
    return names;
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS,
     "matmul(codes, scales, offsets, x, out, bits, block, terms=2, threads=1, path=None): out[T, n] = x[T, k] @ W.T "
     "for W held as codes [blocks, block*bits/32, n, 4] (uint8), scales and offsets [blocks, n] (both float32 or "
     "both float16; offsets None: none): weight = (code - 2^(bits-1)) x scale + offset; x quantized per block to "
     "`terms` int8 terms. path: 'scalar', 'avx2' or 'avx512_vnni' (default: the best this CPU runs; same results)."},
    {"paths", py_paths, METH_NOARGS, "paths(): the vector paths this CPU runs, slowest first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nbits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nbits(void) { return PyModule_Create(&module); }
