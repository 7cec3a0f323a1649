/* halo._nbits: x @ W.T for a compact (4- or 8-bit, per-block scaled) weight, read straight from its codes with
 * integer dot products. What computes GGUF compact projections and int8 ones wherever the package was built with a
 * C compiler and the CPU has AVX2 or AVX-512 VNNI (halo.compute.linear.KernelProjection), and HALO's re-mapped groups on a
 * memory-bounded agent (halo.compute.linear.DequantKernel).
 *
 * Activations: per block of the weight's, x is quantized as MatMulNBits does at accuracy level 4, to int8 codes
 * q1 = rint(x / d1) with d1 = max|x| / 127, and (terms = 2) the residual r = x - q1 d1 to q2 = rint(r / d2), d2 =
 * max|r| / 127: x = q1 d1 + q2 d2 within ~1/64516 of the block's range (one term: 1/254). The codes times the
 * weights' codes are then exact integer sums (AVX-512 VNNI, AVX2, or plain C: the same integers on every CPU),
 * turned to float32 by the same operations in the same order on every path, so one row gets the same bits
 * whatever the CPU's vector width, its tile, its thread or the rows around it (a row shard = the whole matrix).
 *
 * Layout: one array, packed [tiles, blocks, unit] uint8, in the order the kernel reads it, so a matrix is one
 * sequential stream (with the codes in separate [blocks, words, n, 4] arrays a token read at ~24 GB/s from memory here;
 * packed, ~33). A tile is 16 rows; a unit is one block of a tile: its codes, words x 64 bytes (word w: 4 bytes of
 * each of the 16 rows, 4-bit: byte j of a block holds input 2j's weight in its low nibble, 2j + 1's in its high
 * one), then the 16 rows' scales, then their offsets (where the type has them), float32 or float16. The last tile's
 * rows past n are zeros. weight = (code - 2^(bits-1)) x scale + offset, so with z = 2^(bits-1) and
 * s = sum(x over block b):
 *     out[t, r] = sum_b scales[b, r] (d1 (codes . q1 - z sum q1) + d2 (codes . q2 - z sum q2)) + offsets[b, r] s
 * A 32-bit lane holds 4 bytes of one row: one VNNI instruction multiplies 16 rows x 4 bytes by 4 broadcast
 * activation codes. The GIL is released while it runs; OpenMP splits the tiles over `threads`. */
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
#if defined(__aarch64__) && defined(__GNUC__)
#include <arm_neon.h>
#include <sys/auxv.h>
#define HALO_ARM 1
#endif

/* Rows per tile (one AVX-512 vector of int32 sums). */
#define TILE_ROWS 16

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

/* The element-wise loops (activation quantization, norms, attention) built for several x86 levels, picked at load:
 * the same operations, in the same order, wider (division, rint and max are exact at any width). GCC 11 names the
 * levels; other compilers build the plain loops. */
#if defined(HALO_X86) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#ifndef CLONES
#define CLONES
#endif

/* The tile kernel's paths, slowest first: plain C, then this architecture's two vector levels (x86: AVX2, AVX-512
 * VNNI; aarch64: NEON as every Arm v8 core has it, e.g. the Pi 4's Cortex-A72, and NEON with the v8.2 dot product
 * instructions SDOT, e.g. the Pi 5's Cortex-A76). */
enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2 };
#define PATH_NEON PATH_AVX2
#define PATH_NEON_DOTPROD PATH_AVX512
#ifdef HALO_ARM
static const char *PATH_NAMES[] = {"scalar", "neon", "neon_dotprod"};
#else
static const char *PATH_NAMES[] = {"scalar", "avx2", "avx512_vnni"};
#endif

/* One multiplication. Per token and block: `quads` int32 words of 4 activation codes each, lined up with a code
 * word (4-bit: word w's low nibbles meet inputs 8w, 8w+2, 8w+4, 8w+6, its high ones 8w+1, +3, +5, +7: two quads;
 * 8-bit: inputs 4w .. 4w+3), term 1's then term 2's; `steps` d1, d2; `zero_sums` z x sum(q) per term; `x_sums`. */
typedef struct {
    const uint8_t *packed;   /* [tiles, blocks, unit] */
    int is_half, has_offsets, bits, terms;
    Py_ssize_t tokens, blocks, n, block, words, quads, unit;
    Py_ssize_t ahead;        /* bytes from a unit to the one whose lines are prefetched (prefetch_distance units) */
    const int32_t *x_quads;  /* [tokens, blocks, terms, quads] */
    const float *steps;      /* [tokens, blocks, 2] */
    const int32_t *zero_sums;/* [tokens, blocks, 2] */
    const float *x_sums;     /* [tokens, blocks] */
    float *out;
} Job;

/* Block b of tile i: codes at 0, the 16 scales at CODE_BYTES, the offsets 16 values after them. */
static inline const uint8_t *unit_of(const Job *job, Py_ssize_t i, Py_ssize_t b)
{
    return job->packed + (i * job->blocks + b) * job->unit;
}
#define CODE_BYTES(job) ((job)->words * 64)
#define SCALE_BYTES(job) ((job)->is_half ? 2 : 4)

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

/* Block b of tile i for every token in plain C (CPUs without AVX2: ~1 GB/s of codes on x86-64 here; without a
 * vector path the projections go to MatMulNBits, halo.compute.linear.C_KERNEL_VECTORIZED; a memory-bounded device's compact
 * groups still come here). y: [tokens, 16] sums of the tile's rows. */
static void unit_scalar(const Job *job, Py_ssize_t i, Py_ssize_t b, float *y)
{
    const uint8_t *u = unit_of(job, i, b);
    const void *scales = u + CODE_BYTES(job), *offsets = u + CODE_BYTES(job) + TILE_ROWS * SCALE_BYTES(job);
    int32_t dot[2][TILE_ROWS];
    for (Py_ssize_t t = 0; t < job->tokens; t++) {
        const int32_t *q = quads_of(job, t, b);
        memset(dot, 0, sizeof dot);
        for (int term = 0; term < job->terms; term++, q += job->quads)
            for (Py_ssize_t w = 0; w < job->words; w++) {
                const uint8_t *restrict c = u + w * 64;
                int32_t *restrict d = dot[term];
                if (job->bits == 8) {
                    const int8_t *x = (const int8_t *)(q + w);
                    const int32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
                    for (int r = 0; r < TILE_ROWS; r++)
                        d[r] += c[4 * r] * x0 + c[4 * r + 1] * x1 + c[4 * r + 2] * x2 + c[4 * r + 3] * x3;
                } else {
                    const int8_t *lo = (const int8_t *)(q + 2 * w), *hi = (const int8_t *)(q + 2 * w + 1);
                    const int32_t l0 = lo[0], l1 = lo[1], l2 = lo[2], l3 = lo[3];
                    const int32_t h0 = hi[0], h1 = hi[1], h2 = hi[2], h3 = hi[3];
                    for (int r = 0; r < TILE_ROWS; r++)
                        d[r] += (c[4 * r] & 15) * l0 + (c[4 * r + 1] & 15) * l1 + (c[4 * r + 2] & 15) * l2
                                + (c[4 * r + 3] & 15) * l3 + (c[4 * r] >> 4) * h0 + (c[4 * r + 1] >> 4) * h1
                                + (c[4 * r + 2] >> 4) * h2 + (c[4 * r + 3] >> 4) * h3;
                }
            }
        const int32_t *z = job->zero_sums + (t * job->blocks + b) * 2;
        const float *steps = job->steps + (t * job->blocks + b) * 2, x_sum = job->x_sums[t * job->blocks + b];
        float *yt = y + t * TILE_ROWS;
        for (int r = 0; r < TILE_ROWS; r++) {
            const float scale = value_at(scales, job->is_half, r);
            const float offset = job->has_offsets ? value_at(offsets, job->is_half, r) : 0.f;
            yt[r] = block_term(yt[r], scale, offset, job->has_offsets, dot[0][r] - z[0], dot[1][r] - z[1], steps,
                               x_sum);
        }
    }
}

static void tile_scalar(const Job *job, Py_ssize_t i, float *y)
{
    for (Py_ssize_t b = 0; b < job->blocks; b++)
        unit_scalar(job, i, b, y);
}

/* Calls BLOCKS(WORDS, BITS, TERMS) with the job's block shape as constants (GGUF's blocks of 32: 4 words of 4-bit
 * codes, 8 of 8-bit) or WORDS = 0 (any width). */
#define BY_SHAPE(BLOCKS)                                                                                        \
    do {                                                                                                        \
        const int bits = job->bits, two = job->terms == 2, words = (int)job->words;                             \
        if (bits == 4 && words == 4) two ? BLOCKS(4, 4, 2) : BLOCKS(4, 4, 1);                                   \
        else if (bits == 8 && words == 8) two ? BLOCKS(8, 8, 2) : BLOCKS(8, 8, 1);                              \
        else if (bits == 4) two ? BLOCKS(0, 4, 2) : BLOCKS(0, 4, 1);                                            \
        else two ? BLOCKS(0, 8, 2) : BLOCKS(0, 8, 1);                                                           \
    } while (0)

#ifdef HALO_X86
/* The lines of the unit job->ahead bytes past u (past the array's end: a hint, never a fault). */
#define PREFETCH_AHEAD(u)                                                                                       \
    for (Py_ssize_t at = 0; at < job->unit; at += 64)                                                           \
        _mm_prefetch((const char *)(u) + job->ahead + at, _MM_HINT_T0)

/* 16 scales (or minimums) from `at` as float32. */
#define LOAD16(at)                                                                                              \
    (job->is_half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at))) : _mm512_loadu_ps((const float *)(at)))

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

/* Block b of tile i (16 rows) for every token. WORDS, BITS and TERMS are constants where it matters (GGUF's blocks
 * of 32: 4 words of 4-bit codes, 8 of 8-bit), so the loops unroll and the codes stay in registers across tokens;
 * WORDS = 0: any width, the codes read from cache per token. Four independent sums per term (integers: their order
 * cannot change the result) let the multiply-adds overlap. */
static inline __attribute__((always_inline)) AVX512 void unit_avx512(const Job *job, Py_ssize_t i, Py_ssize_t b,
                                                                     float *y, const int WORDS, const int BITS,
                                                                     const int TERMS)
{
    const Py_ssize_t words = WORDS ? WORDS : job->words;
    const __m512i low = _mm512_set1_epi8(15);
    const uint8_t *codes = unit_of(job, i, b);
    PREFETCH_AHEAD(codes);
    __m512i lo[8], hi[8];
    if (WORDS) {
        for (int w = 0; w < WORDS; w++) {
            lo[w] = _mm512_loadu_si512(codes + w * 64);
            if (BITS == 4) {
                hi[w] = _mm512_and_si512(_mm512_srli_epi16(lo[w], 4), low);
                lo[w] = _mm512_and_si512(lo[w], low);
            }
        }
    }
    const uint8_t *values = codes + words * 64;
    const __m512 scale = LOAD16(values);
    const __m512 offset = job->has_offsets ? LOAD16(values + TILE_ROWS * SCALE_BYTES(job)) : _mm512_setzero_ps();
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
                    cl = _mm512_loadu_si512(codes + w * 64);
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
        float *yt = y + t * TILE_ROWS;
        __m512 s = _mm512_mul_ps(_mm512_set1_ps(steps[0]),
                                 _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[0], _mm512_set1_epi32(z[0]))));
        s = _mm512_fmadd_ps(_mm512_set1_ps(steps[1]),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[1], _mm512_set1_epi32(z[1]))), s);
        __m512 acc = _mm512_add_ps(_mm512_loadu_ps(yt), _mm512_mul_ps(scale, s));
        if (job->has_offsets)
            acc = _mm512_fmadd_ps(offset, _mm512_set1_ps(job->x_sums[t * job->blocks + b]), acc);
        _mm512_storeu_ps(yt, acc);
    }
}

static inline __attribute__((always_inline)) AVX512 void blocks_avx512(const Job *job, Py_ssize_t i, float *y,
                                                                       const int WORDS, const int BITS, const int TERMS)
{
    for (Py_ssize_t b = 0; b < job->blocks; b++)
        unit_avx512(job, i, b, y, WORDS, BITS, TERMS);
}


#define BLOCKS_AVX512(WORDS, BITS, TERMS) blocks_avx512(job, i, y, WORDS, BITS, TERMS)

AVX512 static void tile_avx512(const Job *job, Py_ssize_t i, float *y)
{
    BY_SHAPE(BLOCKS_AVX512);
}

/* AVX2 has no u8 x s8 -> s32 instruction: pmaddubsw (pairs into int16) then pmaddwd by ones. 4-bit pairs stay
 * within 2 x 15 x 127; 8-bit codes are taken as code - 128 (signed) against sign-adjusted activations (pairs
 * within 2 x 128 x 127), which is the zero point applied early: the same integer sums. */
#define LOAD8(at)                                                                                               \
    (job->is_half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at))) : _mm256_loadu_ps((const float *)(at)))

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* Block b of tile i, its two halves of eight rows; WORDS, BITS and TERMS constants as in unit_avx512. */
static inline __attribute__((always_inline)) AVX2 void unit_avx2(const Job *job, Py_ssize_t i, Py_ssize_t b, float *y,
                                                                 const int WORDS, const int BITS, const int TERMS)
{
    const Py_ssize_t words = WORDS ? WORDS : job->words;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const uint8_t *unit = unit_of(job, i, b), *values = unit + words * 64;
    PREFETCH_AHEAD(unit);
    for (int half = 0; half < 2; half++) {
        const uint8_t *codes = unit + 32 * half, *at = values + 8 * half * SCALE_BYTES(job);
        const __m256 scale = LOAD8(at);
        const __m256 offset = job->has_offsets ? LOAD8(at + TILE_ROWS * SCALE_BYTES(job)) : _mm256_setzero_ps();
        for (Py_ssize_t t = 0; t < job->tokens; t++) {
            const int32_t *q = quads_of(job, t, b);
            __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int term = 0; term < TERMS; term++, q += job->quads)
                for (Py_ssize_t w = 0; w < words; w++) {
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + w * 64));
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
            float *yt = y + t * TILE_ROWS + 8 * half;
            __m256 s = _mm256_mul_ps(_mm256_set1_ps(steps[0]), _mm256_cvtepi32_ps(
                early ? dot[0] : _mm256_sub_epi32(dot[0], _mm256_set1_epi32(z[0]))));
            s = _mm256_fmadd_ps(_mm256_set1_ps(steps[1]), _mm256_cvtepi32_ps(
                early ? dot[1] : _mm256_sub_epi32(dot[1], _mm256_set1_epi32(z[1]))), s);
            __m256 acc = _mm256_add_ps(_mm256_loadu_ps(yt), _mm256_mul_ps(scale, s));
            if (job->has_offsets)
                acc = _mm256_fmadd_ps(offset, _mm256_set1_ps(job->x_sums[t * job->blocks + b]), acc);
            _mm256_storeu_ps(yt, acc);
        }
    }
}

static inline __attribute__((always_inline)) AVX2 void blocks_avx2(const Job *job, Py_ssize_t i, float *y,
                                                                   const int WORDS, const int BITS, const int TERMS)
{
    for (Py_ssize_t b = 0; b < job->blocks; b++)
        unit_avx2(job, i, b, y, WORDS, BITS, TERMS);
}
#define BLOCKS_AVX2(WORDS, BITS, TERMS) blocks_avx2(job, i, y, WORDS, BITS, TERMS)

AVX2 static void tile_avx2(const Job *job, Py_ssize_t i, float *y)
{
    BY_SHAPE(BLOCKS_AVX2);
}
#endif

#ifdef HALO_ARM
/* Block b of tile i on Arm: four quarters of four rows, a NEON register of int32 sums each. A code word's 64 bytes
 * are the 16 rows' 4 bytes, so a quarter's 16 bytes are its 4 rows' and one DOT4 (below) adds each row's 4 products.
 * Both instructions are signed x signed: 4-bit codes (0..15) are already int8; 8-bit ones are taken as code - 128
 * against the activations, the zero point applied early as the AVX2 path does (the same integer sums). Then the
 * floats as block_term orders them, lane by lane: mul, fma, mul, add, fma. */
#define ARM_UNIT(NAME, ATTRIBUTES, DOT4)                                                                        \
    static inline __attribute__((always_inline)) ATTRIBUTES void NAME(const Job *job, Py_ssize_t i, Py_ssize_t b, \
                                                                      float *y, const int WORDS, const int BITS,  \
                                                                      const int TERMS)                            \
    {                                                                                                           \
        const Py_ssize_t words = WORDS ? WORDS : job->words;                                                    \
        const uint8_t *unit = unit_of(job, i, b), *values = unit + words * 64;                                  \
        for (Py_ssize_t at = 0; at < job->unit; at += 64)                                                       \
            __builtin_prefetch(unit + job->ahead + at);                                                         \
        for (int quarter = 0; quarter < 4; quarter++) {                                                         \
            const uint8_t *codes = unit + 16 * quarter, *at = values + 4 * quarter * SCALE_BYTES(job);          \
            const float32x4_t scale = LOAD4(at);                                                                \
            const float32x4_t offset = job->has_offsets ? LOAD4(at + TILE_ROWS * SCALE_BYTES(job))              \
                                                        : vdupq_n_f32(0.f);                                     \
            for (Py_ssize_t t = 0; t < job->tokens; t++) {                                                      \
                const int32_t *q = quads_of(job, t, b);                                                         \
                int32x4_t dot[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};                                            \
                for (int term = 0; term < TERMS; term++, q += job->quads)                                       \
                    for (Py_ssize_t w = 0; w < words; w++) {                                                    \
                        const uint8x16_t c = vld1q_u8(codes + w * 64);                                          \
                        if (BITS == 8)                                                                          \
                            dot[term] = DOT4(dot[term], vreinterpretq_s8_u8(veorq_u8(c, vdupq_n_u8(0x80))),     \
                                             vreinterpretq_s8_s32(vdupq_n_s32(q[w])));                          \
                        else {                                                                                  \
                            dot[term] = DOT4(dot[term], vreinterpretq_s8_u8(vandq_u8(c, vdupq_n_u8(15))),       \
                                             vreinterpretq_s8_s32(vdupq_n_s32(q[2 * w])));                      \
                            dot[term] = DOT4(dot[term], vreinterpretq_s8_u8(vshrq_n_u8(c, 4)),                  \
                                             vreinterpretq_s8_s32(vdupq_n_s32(q[2 * w + 1])));                  \
                        }                                                                                       \
                    }                                                                                           \
                const int32_t *z = job->zero_sums + (t * job->blocks + b) * 2;                                  \
                const float *steps = job->steps + (t * job->blocks + b) * 2;                                    \
                const int early = BITS == 8; /* 8-bit sums already hold the zero point */                      \
                float *yt = y + t * TILE_ROWS + 4 * quarter;                                                    \
                float32x4_t s = vmulq_f32(vdupq_n_f32(steps[0]), vcvtq_f32_s32(                                 \
                    early ? dot[0] : vsubq_s32(dot[0], vdupq_n_s32(z[0]))));                                    \
                s = vfmaq_f32(s, vdupq_n_f32(steps[1]),                                                         \
                              vcvtq_f32_s32(early ? dot[1] : vsubq_s32(dot[1], vdupq_n_s32(z[1]))));            \
                float32x4_t acc = vaddq_f32(vld1q_f32(yt), vmulq_f32(scale, s));                                \
                if (job->has_offsets)                                                                           \
                    acc = vfmaq_f32(acc, offset, vdupq_n_f32(job->x_sums[t * job->blocks + b]));               \
                vst1q_f32(yt, acc);                                                                             \
            }                                                                                                   \
        }                                                                                                       \
    }

/* 4 scales (or minimums) from `at` as float32. */
#define LOAD4(at)                                                                                               \
    (job->is_half ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(at))))                        \
                  : vld1q_f32((const float *)(at)))

/* Plain NEON (Cortex-A72): 8 products widened to int16 (|code x activation| <= 128 x 127), pairs added into int32,
 * then pairs of those: each row's 4 products in one lane. */
static inline int32x4_t dot4_neon(int32x4_t acc, int8x16_t codes, int8x16_t x)
{
    const int32x4_t low = vpaddlq_s16(vmull_s8(vget_low_s8(codes), vget_low_s8(x)));
    const int32x4_t high = vpaddlq_s16(vmull_high_s8(codes, x));
    return vaddq_s32(acc, vpaddq_s32(low, high));
}
ARM_UNIT(unit_neon, , dot4_neon)

/* SDOT (Cortex-A76 and later): 4 rows' 4 products added into their lanes in one instruction. */
#define DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
ARM_UNIT(unit_dotprod, DOTPROD, vdotq_s32)

static inline __attribute__((always_inline)) void blocks_neon(const Job *job, Py_ssize_t i, float *y, const int WORDS,
                                                              const int BITS, const int TERMS)
{
    for (Py_ssize_t b = 0; b < job->blocks; b++)
        unit_neon(job, i, b, y, WORDS, BITS, TERMS);
}
static inline __attribute__((always_inline)) DOTPROD void blocks_dotprod(const Job *job, Py_ssize_t i, float *y,
                                                                         const int WORDS, const int BITS,
                                                                         const int TERMS)
{
    for (Py_ssize_t b = 0; b < job->blocks; b++)
        unit_dotprod(job, i, b, y, WORDS, BITS, TERMS);
}
#define BLOCKS_NEON(WORDS, BITS, TERMS) blocks_neon(job, i, y, WORDS, BITS, TERMS)
#define BLOCKS_DOTPROD(WORDS, BITS, TERMS) blocks_dotprod(job, i, y, WORDS, BITS, TERMS)

static void tile_neon(const Job *job, Py_ssize_t i, float *y)
{
    BY_SHAPE(BLOCKS_NEON);
}

DOTPROD static void tile_dotprod(const Job *job, Py_ssize_t i, float *y)
{
    BY_SHAPE(BLOCKS_DOTPROD);
}
#endif

/* Tile i's rows of the output on `path`, block after block (a tile at a time: tiles computed side by side, two
 * streams or more, read from memory at a quarter of the speed here). y: tokens x 16 floats of scratch (one token and
 * a whole tile: summed in `out` itself). */
static void tile_rows(const Job *job, int path, Py_ssize_t i, float *y)
{
    const Py_ssize_t r0 = i * TILE_ROWS, rows = job->n - r0 < TILE_ROWS ? job->n - r0 : TILE_ROWS;
    const int direct = job->tokens == 1 && rows == TILE_ROWS;  /* a decode step's whole tile: sums in place */
    if (direct)
        y = job->out + r0;
    for (Py_ssize_t at = 0; at < job->tokens * TILE_ROWS; at++)
        y[at] = 0.f;
#ifdef HALO_X86
    if (path == PATH_AVX512)
        tile_avx512(job, i, y);
    else if (path == PATH_AVX2)
        tile_avx2(job, i, y);
    else
#endif
#ifdef HALO_ARM
    if (path == PATH_NEON_DOTPROD)
        tile_dotprod(job, i, y);
    else if (path == PATH_NEON)
        tile_neon(job, i, y);
    else
#endif
        tile_scalar(job, i, y);
    for (Py_ssize_t t = 0; t < job->tokens && !direct; t++)
        for (Py_ssize_t r = 0; r < rows; r++)
            job->out[t * job->n + r0 + r] = y[t * TILE_ROWS + r];
}

/* How far ahead of the unit it computes the kernel asks the memory for lines, in units (-1: not chosen yet). Measured
 * on two hosts of the project's 2-core machine kind (eval/results/): an AMD EPYC streamed Q4_0 from memory at 78 % of
 * its copy bandwidth 32 units (~9 KB) ahead (engine_decode_tinyllama-Q4_0.md); an Intel Xeon streamed it at 9.3 GB/s
 * there and 12.8 GB/s 4 units ahead (Q4_1 alike; Q8_0 12.4 -> 14.2), and decoded a TinyLlama token in 50.0 ms instead of 72.5
 * (kernel_prefetch.md: its own L2 streamer keeps up; requests that far out only crowd its miss queue).
 * prefetch_units() sets it. */
static Py_ssize_t prefetch_units = -1;
#define PREFETCH_UNITS_INTEL 4
#define PREFETCH_UNITS_OTHER 32

static Py_ssize_t prefetch_distance(void)
{
    if (prefetch_units < 0) {
        prefetch_units = PREFETCH_UNITS_OTHER;
#ifdef HALO_X86
        __builtin_cpu_init();
        if (__builtin_cpu_is("intel"))
            prefetch_units = PREFETCH_UNITS_INTEL;
#endif
    }
    return prefetch_units;
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
#ifdef HALO_ARM
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
    if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP)
        return PATH_NEON_DOTPROD;
    return PATH_NEON;  /* Advanced SIMD is part of every aarch64 core */
#endif
    return PATH_SCALAR;
}

/* x's blocks as activation codes (see the top of this file): the quads, steps, zero-point sums and float sums. */
CLONES static void quantize_activations(Job *job, const float *x, int32_t *x_quads, float *steps, int32_t *zero_sums,
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
                for (Py_ssize_t i = 0; i < block; i++) {  /* (a compare, not fmaxf: NaN never gets here as a code) */
                    const float v = fabsf(residual[i]);
                    amax = v > amax ? v : amax;
                }
                const float step = finite ? (amax / 127.f > 1e-30f ? amax / 127.f : 1e-30f) : NAN;
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

/* x's activation codes for a job (quantize_activations), in one buffer: kept across the projections of the same x
 * with the same quantization (bits, block, terms), as HALO's re-mapped MLP groups all read one normed input. */
typedef struct {
    char *buffer;
    int bits, terms;
    Py_ssize_t tokens, blocks, block;
} Codes;

static void codes_free(Codes *c)
{
    PyMem_RawFree(c->buffer);
    c->buffer = NULL;
}

/* Point job at x's codes: the ones in c where they were made for this quantization, else made now (into c). -1 when
 * out of memory. */
static int codes_for(Codes *c, Job *job, const float *x)
{
    const Py_ssize_t per_block = job->tokens * job->blocks;
    const size_t quad_bytes = (size_t)(per_block * job->terms * job->quads) * sizeof(int32_t);
    const int fresh = !c->buffer || c->bits != job->bits || c->terms != job->terms || c->tokens != job->tokens
                      || c->blocks != job->blocks || c->block != job->block;
    if (fresh) {
        codes_free(c);
        c->buffer = PyMem_RawMalloc(quad_bytes + (size_t)per_block * (2 * sizeof(float) + 2 * sizeof(int32_t)
                                                                      + sizeof(float)));
        if (!c->buffer)
            return -1;
        c->bits = job->bits, c->terms = job->terms, c->tokens = job->tokens, c->blocks = job->blocks;
        c->block = job->block;
    }
    int32_t *x_quads = (int32_t *)c->buffer;
    float *steps = (float *)(c->buffer + quad_bytes);
    int32_t *zero_sums = (int32_t *)(steps + 2 * per_block);
    float *x_sums = (float *)(zero_sums + 2 * per_block);
    if (fresh)
        quantize_activations(job, x, x_quads, steps, zero_sums, x_sums);
    job->x_quads = x_quads, job->steps = steps, job->zero_sums = zero_sums, job->x_sums = x_sums;
    return 0;
}

/* The tiles on `threads` threads (OpenMP, where the build has it; each thread a contiguous run of tiles), from x's
 * codes: kept in `codes` (for the next projection of the same x) or, where codes is NULL, made for this one. Returns
 * -1 when out of memory. */
static int matmul(Job *job, const float *x, int threads, int path, Codes *codes)
{
    const Py_ssize_t tokens = job->tokens, tiles = (job->n + TILE_ROWS - 1) / TILE_ROWS;
    Codes own = {0};
    if (codes_for(codes ? codes : &own, job, x) < 0)
        return -1;
    const size_t scratch_bytes = (size_t)(tokens * TILE_ROWS) * sizeof(float);
    int failed = 0;
#ifdef _OPENMP
    if (threads > 1 && tiles > 1) {
#pragma omp parallel num_threads(threads)
        {
            float *scratch = malloc(scratch_bytes);
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (Py_ssize_t i = 0; i < tiles; i++)
                if (scratch)
                    tile_rows(job, path, i, scratch);
            free(scratch);
        }
        codes_free(&own);
        return failed ? -1 : 0;
    }
#endif
    float *scratch = PyMem_RawMalloc(scratch_bytes);
    if (!scratch)
        failed = 1;
    for (Py_ssize_t i = 0; i < tiles && !failed; i++)
        tile_rows(job, path, i, scratch);
    PyMem_RawFree(scratch);
    codes_free(&own);
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
    const uint16_t one = 1;
    const char native = *(const char *)&one ? '<' : '>';
    if (found[0] == '@' || found[0] == '=' || found[0] == native)  /* this machine's byte order: the same values */
        found++;
    const Py_ssize_t itemsize = found[0] == 'f' || found[0] == 'i' ? 4 : found[0] == 'e' ? 2 : 1;
    if (strlen(found) != 1 || !strchr(format, found[0]) || view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s holds values of type '%s'; it must be %s", name, found,
                     !strcmp(format, "fe") ? "float32 ('f') or float16 ('e')"
                     : format[0] == 'f' ? "float32 ('f')" : format[0] == 'i' ? "int32 ('i')" : "uint8 ('B')");
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

/* A compact weight's packed array, checked against its shape (the buffer held until weight_close). */
typedef struct {
    Py_buffer packed;
    Job job;  /* the weight's fields filled; tokens, activations and out per call */
} Weight;

static void weight_close(Weight *w)
{
    PyBuffer_Release(&w->packed);
}

/* packed [ceil(n / 16), blocks, unit] uint8 (see the top of this file); 0, or -1 with a ValueError that says what
 * does not fit. */
static int weight_open(Weight *w, PyObject *packed_obj, Py_ssize_t n, int bits, Py_ssize_t block, int is_half,
                       int has_offsets, int terms)
{
    memset(w, 0, sizeof *w);
    if ((bits != 4 && bits != 8) || block <= 0 || block % (bits == 4 ? 8 : 4) || block > 4096) {
        PyErr_Format(PyExc_ValueError, "bits must be 4 or 8 and the block a multiple of %d up to 4096 (got %d, %zd)",
                     bits == 4 ? 8 : 4, bits, block);
        return -1;
    }
    if (terms != 1 && terms != 2) {
        PyErr_Format(PyExc_ValueError, "terms must be 1 or 2 (got %d)", terms);
        return -1;
    }
    if (n <= 0 || n > ((Py_ssize_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "n must be a positive number of rows (got %zd)", n);
        return -1;
    }
    if (contiguous(packed_obj, &w->packed, "packed", -1, "B", 0) < 0)
        return -1;
    const Py_ssize_t words = block * bits / 32, tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    const Py_ssize_t unit = words * 64 + TILE_ROWS * (is_half ? 2 : 4) * (has_offsets ? 2 : 1);
    /* shapes compared, never multiplied: the products of a real buffer's dimensions cannot overflow */
    if (w->packed.ndim != 3 || w->packed.shape[0] != tiles || w->packed.shape[1] < 1 || w->packed.shape[2] != unit) {
        PyErr_Format(PyExc_ValueError, "packed must be [tiles %zd, blocks >= 1, unit %zd] (16-row tiles of %zd rows; "
                     "halo.compute.linear.pack)", tiles, unit, n);
        PyBuffer_Release(&w->packed);
        return -1;
    }
    Job job = {w->packed.buf, is_half != 0, has_offsets != 0, bits, terms, 0, w->packed.shape[1], n, block, words,
               bits == 4 ? 2 * words : words, unit, prefetch_distance() * unit, NULL, NULL, NULL, NULL, NULL};
    w->job = job;
    return 0;
}

/* A weight handed over as the tuple (packed, n, bits, block, half, offsets, terms):
 * halo.compute.linear.DequantKernel.c_weight. */
static int weight_from(Weight *w, PyObject *tuple, const char *name)
{
    PyObject *packed;
    int bits, terms, is_half, has_offsets;
    Py_ssize_t n, block;
    if (!PyTuple_Check(tuple)
        || !PyArg_ParseTuple(tuple, "Oninppi", &packed, &n, &bits, &block, &is_half, &has_offsets, &terms)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a (packed, n, bits, block, half, offsets, terms) tuple "
                     "(halo.compute.linear.DequantKernel.c_weight)", name);
        return -1;
    }
    return weight_open(w, packed, n, bits, block, is_half, has_offsets, terms);
}

/* out [tokens, n] = x [tokens, blocks x block] @ W.T; -1 when out of memory. Runs without the GIL. */
static int project(const Weight *w, const float *x, Py_ssize_t tokens, float *out, int threads, int path, Codes *codes)
{
    Job job = w->job;
    job.tokens = tokens, job.out = out;
    return matmul(&job, x, threads, path, codes);
}

static int checked_threads(int threads)
{
    if (threads < 1 || threads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..1024 (got %d)", threads);
        return -1;
    }
    return 0;
}

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *names[] = {"weight", "x", "out", "threads", "path", NULL};
    PyObject *weight_obj, *x_obj, *out_obj;
    int threads = 1;
    const char *path_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|iz", names, &weight_obj, &x_obj, &out_obj, &threads,
                                     &path_name))
        return NULL;
    if (checked_threads(threads) < 0)
        return NULL;
    const int best = best_path();
    int path = best;
    if (path_name) {
        path = path_named(path_name);
        if (path < 0 || path > best) {
            PyErr_Format(PyExc_ValueError, "path %s: this CPU runs %s%s%s%s%s", path_name, PATH_NAMES[0],
                         best >= 1 ? ", " : "", best >= 1 ? PATH_NAMES[1] : "", best >= 2 ? ", " : "",
                         best >= 2 ? PATH_NAMES[2] : "");
            return NULL;
        }
    }
    Weight w;
    if (weight_from(&w, weight_obj, "weight") < 0)
        return NULL;
    const Py_ssize_t k = w.job.blocks * w.job.block, n = w.job.n;
    Py_buffer x, out;
    if (contiguous(x_obj, &x, "x", -1, "f", 0) < 0) {
        weight_close(&w);
        return NULL;
    }
    if (x.ndim != 2 || x.shape[1] != k) {
        PyErr_Format(PyExc_ValueError, "x must be [tokens, %zd] float32 inputs", k);
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
    if (tokens > 0) {
        Py_BEGIN_ALLOW_THREADS
        failed = project(&w, x.buf, tokens, out.buf, threads, path, NULL);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    if (failed) {
        PyErr_NoMemory();
        goto fail_x;
    }
    PyBuffer_Release(&x), weight_close(&w);
    Py_RETURN_NONE;
fail_x:
    PyBuffer_Release(&x), weight_close(&w);
    return NULL;
}

/* ---- Decode steps: one token through a whole block's share in one call ----
 * A decode step of a small model is mostly fixed costs around the kernel: SmolLM2's 576-wide layer spent ~110 us a
 * token in numpy and Python (norm, rotary, attention, the projections' wrappers) next to ~150 us in the kernel. These
 * run a block's share for one token (T = 1) here, start to end, without the GIL: the same quantities as
 * halo.compute.neuron_groups' numpy path (RMSNorm, rotate-half, softmax attention over the cache, SwiGLU), float32 throughout,
 * summed in a fixed order (so one head's output is the same whichever shard holds it; the bits may differ from numpy's
 * BLAS sums in the last place). */

/* sum a[i] b[i], in 16 lanes then added in order. */
static inline float dot(const float *a, const float *b, Py_ssize_t n)
{
    float lanes[16] = {0};
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++)
            lanes[l] += a[i + l] * b[i + l];
    float sum = 0.f;
    for (int l = 0; l < 16; l++)
        sum += lanes[l];
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* h = x * (1 / sqrt(mean(x^2) + eps)) * weight, as halo.model.ops.rmsnorm orders it (the sum of squares in 16 lanes). */
CLONES static void rms_norm(const float *x, const float *weight, Py_ssize_t d, float eps, float *h)
{
    const float scale = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (Py_ssize_t i = 0; i < d; i++)
        h[i] = x[i] * scale * weight[i];
}

/* Rotate-half of `heads` vectors of hd at one position (halo.model.ops.Rotary.apply: x1 cos - x2 sin, x2 cos + x1 sin). */
static void rotate(float *v, Py_ssize_t heads, Py_ssize_t hd, const float *cos, const float *sin)
{
    const Py_ssize_t half = hd / 2;
    for (Py_ssize_t h = 0; h < heads; h++, v += hd)
        for (Py_ssize_t i = 0; i < half; i++) {
            const float a = v[i], b = v[half + i];
            v[i] = a * cos[i] - b * sin[i];
            v[half + i] = b * cos[i] + a * sin[i];
        }
}

/* e^x in float operations a loop vectorizes (expf is a call per value): Cephes' expf, x = n ln2 + r with
 * |r| <= ln2 / 2, a degree-6 polynomial of r, times 2^n put in the exponent bits; within 2 ulp of expf over
 * [-87, 88] (clamped there: 2^-126 .. ~2^127), NaN stays NaN. */
static inline float exp_vectorizable(float x)
{
    const float magic = 12582912.0f;  /* 1.5 x 2^23: t = x log2(e) + magic holds round(x log2(e)) in its low bits */
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f + magic, n = t - magic;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits - 0x4B400000 + 127) * (1 << 23);  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#define ATTEND_HEADS_MAX 8  /* query heads attend_heads takes at once */
#define ATTEND_SPAN 64  /* output values a head keeps in registers while a tile's values add up (4 AVX-512 ones) */
#define ATTEND_HD_MAX 256  /* widest head whose keys a tile transposes (wider: one dot a score) */
#define ATTEND_TILE 32  /* cache positions a tile: 32 rows of keys or values (8 KB at a 64-wide head) stay in L1 */
typedef float f32x16 __attribute__((vector_size(64)));  /* 16 floats: one AVX-512 register (two AVX2 ones) */
typedef float f32x16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
#define FLOATS16(p) (*(const f32x16_unaligned *)(p))  /* 16 floats from any float address */

/* 16 rows of 16 floats (row r at src + r * src_stride) transposed into dst (row d at dst + d * dst_stride): four
 * rounds of interleaving row pairs (i, i + b) by blocks of b = 8, 4, 2, 1 floats, 64 vector shuffles where one move
 * a float took 256 loads and stores (most of an attention step with 3 query heads a KV head). Where the compiler has
 * no __builtin_shufflevector (GCC < 12), the tile is moved a float at a time. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define TRANSPOSE16_IN_VECTORS 1
#define INTERLEAVE(b, lo0, hi0)                                                                                        \
    for (int i = 0; i < 16; i++)                                                                                     \
        if (!(i & b)) {                                                                                              \
            const f32x16 x = r[i], y = r[i + b];                                                                     \
            r[i] = __builtin_shufflevector(x, y, lo0);                                                               \
            r[i + b] = __builtin_shufflevector(x, y, hi0);                                                           \
        }
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline void transpose16(const float *src, Py_ssize_t src_stride, float *dst, Py_ssize_t dst_stride)
{
    f32x16 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = FLOATS16(src + i * src_stride);
    INTERLEAVE(8, LO8, HI8)
    INTERLEAVE(4, LO4, HI4)
    INTERLEAVE(2, LO2, HI2)
    INTERLEAVE(1, LO1, HI1)
    for (int i = 0; i < 16; i++)
        memcpy(dst + i * dst_stride, &r[i], sizeof r[i]);
}
#else
#define TRANSPOSE16_IN_VECTORS 0
static inline void transpose16(const float *src, Py_ssize_t src_stride, float *dst, Py_ssize_t dst_stride)
{
    (void)src, (void)src_stride, (void)dst, (void)dst_stride;
}
#endif

/* Query heads q[0..n-1] [hd] (rotated) that read the same KV head (GQA: 8 of TinyLlama's 32 share each), over
 * positions 0..len-1 of its cache rows (stride floats apart) -> out[h] [hd]; scores [n * len] scratch. The cache is
 * walked in tiles of ATTEND_TILE positions that all n heads use while the tile sits in L1: its keys transposed once,
 * so a head's scores are 16-wide vector sums over the dims (no horizontal adds), and its values added into a span of
 * each head's output held in registers. (A head at a time, with one dot a score and the output updated through
 * memory a position, took 1.6x as long at 2,000 positions: eval/results/attention_step_tinyllama.md.) Per head the
 * same operations in the same order whichever heads share the call, so a head's bits do not depend on the shard.
 * Softmax as halo.model.ops.softmax (minus the max, exp, over the sum), the sum divided out once at the end; the exps in
 * one loop the compiler vectorizes (exp_vectorizable: expf is a call a score). */
CLONES static void attend_heads(const float *const *q, Py_ssize_t n, const float *keys, const float *values,
                                Py_ssize_t len, Py_ssize_t stride, Py_ssize_t hd, float scale, float *scores,
                                float *const *out)
{
    float kt[ATTEND_HD_MAX * ATTEND_TILE];  /* a tile of keys transposed: [hd][tile] */
    for (Py_ssize_t t = 0; t < len; t += ATTEND_TILE) {
        const Py_ssize_t end = t + ATTEND_TILE < len ? t + ATTEND_TILE : len;
        if (hd > ATTEND_HD_MAX) {
            for (Py_ssize_t h = 0; h < n; h++)
                for (Py_ssize_t s = t; s < end; s++)
                    scores[h * len + s] = dot(q[h], keys + s * stride, hd) * scale;
            continue;
        }
        if (end - t == ATTEND_TILE && hd % 16 == 0 && TRANSPOSE16_IN_VECTORS) {  /* whole 16 x 16 blocks */
            for (Py_ssize_t s = 0; s < ATTEND_TILE; s += 16)
                for (Py_ssize_t d = 0; d < hd; d += 16)
                    transpose16(keys + (t + s) * stride + d, stride, kt + d * ATTEND_TILE + s, ATTEND_TILE);
        } else {
            if (end - t < ATTEND_TILE)  /* the last tile's missing rows score 0, unused */
                memset(kt, 0, (size_t)(hd * ATTEND_TILE) * sizeof(float));
            for (Py_ssize_t s = t; s < end; s++) {
                const float *k = keys + s * stride;
                for (Py_ssize_t d = 0; d < hd; d++)
                    kt[d * ATTEND_TILE + (s - t)] = k[d];
            }
        }
        for (Py_ssize_t h = 0; h < n; h++) {  /* a tile's scores side by side: the dims in 4 interleaved sums */
            f32x16 acc[4][ATTEND_TILE / 16] = {{{0}}};
            Py_ssize_t d = 0;
            for (; d + 4 <= hd; d += 4)
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const float qd = q[h][d + k];
#pragma GCC unroll 2
                    for (int l = 0; l < ATTEND_TILE / 16; l++)
                        acc[k][l] += qd * FLOATS16(kt + (d + k) * ATTEND_TILE + 16 * l);
                }
            for (; d < hd; d++)
                for (int l = 0; l < ATTEND_TILE / 16; l++)
                    acc[0][l] += q[h][d] * FLOATS16(kt + d * ATTEND_TILE + 16 * l);
            float tile[ATTEND_TILE];
            for (int l = 0; l < ATTEND_TILE / 16; l++) {
                const f32x16 sum = ((acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l])) * scale;
                memcpy(tile + 16 * l, &sum, sizeof sum);
            }
            memcpy(scores + h * len + t, tile, (size_t)(end - t) * sizeof(float));
        }
    }
    float total[ATTEND_HEADS_MAX];
    for (Py_ssize_t h = 0; h < n; h++) {
        float *restrict row = scores + h * len, top = -INFINITY;
        for (Py_ssize_t s = 0; s < len; s++)
            top = row[s] > top ? row[s] : top;  /* NaN scores: NaN outputs either way (exp(NaN - top)) */
        for (Py_ssize_t s = 0; s < len; s++)
            row[s] = exp_vectorizable(row[s] - top);
        total[h] = 0.f;
        for (Py_ssize_t s = 0; s < len; s++)
            total[h] += row[s];
        memset(out[h], 0, (size_t)hd * sizeof(float));
    }
    for (Py_ssize_t t = 0; t < len; t += ATTEND_TILE) {
        const Py_ssize_t end = t + ATTEND_TILE < len ? t + ATTEND_TILE : len;
        for (Py_ssize_t h = 0; h < n; h++)
            for (Py_ssize_t i = 0; i < hd; i += ATTEND_SPAN) {  /* a span of the output in registers over the tile */
                const Py_ssize_t width = hd - i < ATTEND_SPAN ? hd - i : ATTEND_SPAN;
                const float *restrict p = scores + h * len;
                float acc[ATTEND_SPAN];
                memcpy(acc, out[h] + i, (size_t)width * sizeof(float));
                if (width == ATTEND_SPAN)
                    for (Py_ssize_t s = t; s < end; s++) {
                        const float *restrict v = values + s * stride + i;
                        for (int l = 0; l < ATTEND_SPAN; l++)
                            acc[l] += p[s] * v[l];
                    }
                else
                    for (Py_ssize_t s = t; s < end; s++)
                        for (Py_ssize_t l = 0; l < width; l++)
                            acc[l] += p[s] * values[s * stride + i + l];
                memcpy(out[h] + i, acc, (size_t)width * sizeof(float));
            }
    }
    for (Py_ssize_t h = 0; h < n; h++)
        for (Py_ssize_t i = 0; i < hd; i++)
            out[h][i] /= total[h];
}

/* A 1-D float32 buffer of `items` (writable or not) or a 2/3-D one whose shape the caller checks. */
static int floats(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t items, int writable)
{
    return contiguous(obj, view, name, items, "f", writable);
}

/* Both weights of a step (the first released again if the second is refused); 0 or -1. */
static int weight_pair(Weight *a, PyObject *a_obj, const char *a_name, Weight *b, PyObject *b_obj, const char *b_name)
{
    if (weight_from(a, a_obj, a_name) < 0)
        return -1;
    if (weight_from(b, b_obj, b_name) < 0) {
        weight_close(a);
        return -1;
    }
    return 0;
}

/* A step's end: its views and weights released; None, or NULL with the error set (MemoryError when `failed`). */
static PyObject *step_done(int failed, Py_buffer *views, int held, Weight *a, Weight *b)
{
    if (failed == 1)
        PyErr_NoMemory();
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    weight_close(a), weight_close(b);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_attention_step(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *names[] = {"x", "norm", "eps", "qkv", "out", "cos", "sin", "cache_k", "cache_v", "pos", "kv_of_head",
                            "y", "threads", "rows", "attend", NULL};
    PyObject *x_obj, *norm_obj, *qkv_obj, *out_obj, *cos_obj, *sin_obj, *k_obj, *v_obj, *heads_obj, *y_obj;
    PyObject *rows_obj = Py_None;  /* a batched pass: [T, 2] int32 (slot, position) per row; caches [slots, ...] */
    float eps;
    Py_ssize_t pos;
    int threads = 1, attend = 1;  /* attend 0: only the keys and values written (a cache filled from a history) */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOfOOOOOOnOO|iOp", names, &x_obj, &norm_obj, &eps, &qkv_obj, &out_obj,
                                     &cos_obj, &sin_obj, &k_obj, &v_obj, &pos, &heads_obj, &y_obj, &threads, &rows_obj,
                                     &attend))
        return NULL;
    Weight qkv, wo;
    if (checked_threads(threads) < 0 || weight_pair(&qkv, qkv_obj, "qkv", &wo, out_obj, "out") < 0)
        return NULL;
    Py_buffer views[9];
    const int batched = rows_obj != Py_None;
    int held = 0, failed = -1;  /* -1: refused (an error set), 1: out of memory */
    const Py_ssize_t d = qkv.job.blocks * qkv.job.block;
    if (floats(x_obj, &views[held], "x", -1, 0) < 0 || (++held, floats(norm_obj, &views[held], "norm", d, 0) < 0)
        || (++held, floats(cos_obj, &views[held], "cos", -1, 0) < 0)
        || (++held, floats(sin_obj, &views[held], "sin", -1, 0) < 0)
        || (++held, floats(k_obj, &views[held], "cache_k", -1, 1) < 0)
        || (++held, floats(v_obj, &views[held], "cache_v", -1, 1) < 0)
        || (++held, floats(y_obj, &views[held], "y", -1, 1) < 0)
        || (++held, contiguous(heads_obj, &views[held], "kv_of_head", -1, "i", 0) < 0)
        || (batched && (++held, contiguous(rows_obj, &views[held], "rows", -1, "i", 0) < 0)))
        return step_done(failed, views, held, &qkv, &wo);
    held++;
    const Py_ssize_t tokens = views[0].len / 4 / d;  /* x [T, d]: T positions from pos on, y [T, out rows] */
    if (tokens < 1 || views[0].len != tokens * d * 4 || views[6].len != tokens * wo.job.n * 4) {
        PyErr_Format(PyExc_ValueError, "attention_step: x must be [T, %zd] and y [T, %zd] float32 (T >= 1 positions)",
                     d, wo.job.n);
        return step_done(failed, views, held, &qkv, &wo);
    }
    const Py_buffer *cos = &views[2], *sin = &views[3], *ck = &views[4], *cv = &views[5];
    const int dims = 3 + batched, lead = batched;  /* caches [positions, kv, hd], batched [slots, positions, kv, hd] */
    const Py_ssize_t kv = ck->ndim == dims ? ck->shape[lead + 1] : 0, hd = ck->ndim == dims ? ck->shape[lead + 2] : 0;
    const int32_t *kv_of_head = views[7].buf;
    const Py_ssize_t heads = views[7].len / 4;
    int heads_fit = heads > 0;
    for (Py_ssize_t i = 0; i < heads; i++)
        heads_fit &= kv_of_head[i] >= 0 && kv_of_head[i] < kv;
    if (ck->ndim != dims || cv->ndim != dims || memcmp(ck->shape, cv->shape, dims * sizeof(Py_ssize_t)) || kv == 0
        || hd % 2 || !heads_fit || cos->ndim != 2 || sin->ndim != 2 || cos->shape[1] != hd / 2
        || memcmp(cos->shape, sin->shape, 2 * sizeof(Py_ssize_t))) {
        PyErr_SetString(PyExc_ValueError,
                        batched ? "attention_step: caches must be [slots, positions, kv heads, head dim] (both alike) with "
                                  "rows, kv_of_head a KV head (0 .. kv heads - 1) for each query head, cos/sin "
                                  "[positions, head dim / 2]"
                                : "attention_step: caches must be [positions, kv heads, head dim] (both alike), kv_of_head "
                                  "a KV head (0 .. kv heads - 1) for each query head, cos/sin [positions, head dim / 2]");
        return step_done(failed, views, held, &qkv, &wo);
    }
    if (qkv.job.n != (heads + 2 * kv) * hd || wo.job.blocks * wo.job.block != heads * hd) {
        PyErr_Format(PyExc_ValueError, "attention_step: qkv has %zd rows and out %zd inputs; %zd heads and %zd KV heads of "
                     "%zd need %zd and %zd", qkv.job.n, wo.job.blocks * wo.job.block, heads, kv, hd,
                     (heads + 2 * kv) * hd, heads * hd);
        return step_done(failed, views, held, &qkv, &wo);
    }
    const Py_ssize_t context = ck->shape[lead] < cos->shape[0] ? ck->shape[lead] : cos->shape[0];
    const Py_ssize_t slots = batched ? ck->shape[0] : 1, slot_size = ck->shape[lead] * kv * hd;
    const int32_t *rows = batched ? views[8].buf : NULL;
    Py_ssize_t end = pos + tokens;  /* positions the longest attention reads */
    if (batched) {
        if (views[8].len != tokens * 2 * 4) {
            PyErr_Format(PyExc_ValueError, "attention_step: rows must be [%zd, 2] int32 (slot, position)", tokens);
            return step_done(failed, views, held, &qkv, &wo);
        }
        end = 0;
        for (Py_ssize_t t = 0; t < tokens; t++) {
            if (rows[2 * t] < 0 || rows[2 * t] >= slots || rows[2 * t + 1] < 0 || rows[2 * t + 1] >= context) {
                PyErr_Format(PyExc_ValueError, "attention_step: row %zd names slot %d at position %d; the caches hold "
                             "slots 0..%zd of %zd positions", t, rows[2 * t], rows[2 * t + 1], slots - 1, context);
                return step_done(failed, views, held, &qkv, &wo);
            }
            end = rows[2 * t + 1] + 1 > end ? rows[2 * t + 1] + 1 : end;
        }
    } else if (pos < 0 || pos + tokens > ck->shape[0] || pos + tokens > cos->shape[0]) {
        if (tokens == 1)
            PyErr_Format(PyExc_ValueError, "position %zd is beyond the context length %zd", pos, context);
        else
            PyErr_Format(PyExc_ValueError, "positions %zd..%zd are beyond the context length %zd", pos,
                         pos + tokens - 1, context);
        return step_done(failed, views, held, &qkv, &wo);
    }
    Py_BEGIN_ALLOW_THREADS
    const int path = best_path();
    const Py_ssize_t width = (heads + 2 * kv) * hd;
    float *scratch = malloc((size_t)(tokens * (d + width + heads * hd) + ATTEND_HEADS_MAX * end) * sizeof(float));
    if (!scratch)
        failed = 1;
    else {
        /* T positions as T single steps would run them (the same bits: a projection's rows are computed token by
         * token alike whatever T), with each weight read once: every position's keys and values are written
         * first, and position t attends to the cache up to pos + t only (batched: row t's slot, up to its position) */
        float *h = scratch, *q = h + tokens * d, *attended = q + tokens * width, *scores = attended + tokens * heads * hd;
        float *cache_k = ck->buf, *cache_v = cv->buf;
        for (Py_ssize_t t = 0; t < tokens; t++)
            rms_norm((const float *)views[0].buf + t * d, views[1].buf, d, eps, h + t * d);
        failed = project(&qkv, h, tokens, q, threads, path, NULL);
        for (Py_ssize_t t = 0; t < tokens && !failed; t++) {
            float *qt = q + t * width, *k = qt + heads * hd, *v = k + kv * hd;
            const Py_ssize_t at = batched ? rows[2 * t + 1] : pos + t, base = batched ? rows[2 * t] * slot_size : 0;
            const float *c = (const float *)cos->buf + at * (hd / 2), *s = (const float *)sin->buf + at * (hd / 2);
            rotate(qt, heads, hd, c, s);
            rotate(k, kv, hd, c, s);
            memcpy(cache_k + base + at * kv * hd, k, (size_t)(kv * hd) * sizeof(float));
            memcpy(cache_v + base + at * kv * hd, v, (size_t)(kv * hd) * sizeof(float));
        }
        const float scale = 1.0f / sqrtf((float)hd);
        for (Py_ssize_t t = 0; t < tokens && !failed && attend; t++) {
            const float *qt = q + t * width;
            float *at_out = attended + t * heads * hd;
            const Py_ssize_t seen = batched ? rows[2 * t + 1] + 1 : pos + t + 1;  /* positions this row attends to */
            const float *keys = cache_k + (batched ? rows[2 * t] * slot_size : 0);
            const float *values = cache_v + (batched ? rows[2 * t] * slot_size : 0);
            for (Py_ssize_t j = 0; j < kv; j++) {  /* the query heads of each KV head, up to ATTEND_HEADS_MAX a call */
                const float *qs[ATTEND_HEADS_MAX];
                float *outs[ATTEND_HEADS_MAX];
                Py_ssize_t n = 0;
                for (Py_ssize_t i = 0; i < heads; i++) {
                    if (kv_of_head[i] != j)
                        continue;
                    qs[n] = qt + i * hd, outs[n] = at_out + i * hd;
                    if (++n == ATTEND_HEADS_MAX) {
                        attend_heads(qs, n, keys + j * hd, values + j * hd, seen, kv * hd, hd, scale, scores, outs);
                        n = 0;
                    }
                }
                if (n)
                    attend_heads(qs, n, keys + j * hd, values + j * hd, seen, kv * hd, hd, scale, scores, outs);
            }
        }
        failed = failed || (attend && project(&wo, attended, tokens, views[6].buf, threads, path, NULL));
        free(scratch);
    }
    Py_END_ALLOW_THREADS
    return step_done(failed ? 1 : 0, views, held, &qkv, &wo);
}

/* SwiGLU: act = silu(gate) x up, silu(g) = g / (1 + exp(-g)) (halo.model.ops.silu); gate_up: the gate's n, then up's. */
CLONES static void swiglu(const float *gate_up, Py_ssize_t n, float *act)
{
    for (Py_ssize_t i = 0; i < n; i++)
        act[i] = gate_up[i] / (1.0f + exp_vectorizable(-gate_up[i])) * gate_up[n + i];
}

/* The weights of one MLP share: MLP groups as (gate_up, down) pairs, checked against each other and the input width
 * d; -1 with an error set (and nothing held) otherwise. */
static int mlp_groups_open(PyObject *groups_obj, Py_ssize_t d, Py_ssize_t d_out, Weight **weights, Py_ssize_t *count,
                           Py_ssize_t *widest)
{
    PyObject *groups = PySequence_Fast(groups_obj, "groups must be a list of (gate_up, down) weight pairs");
    if (!groups)
        return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(groups);
    Weight *w = n > 0 && n <= 65536 ? PyMem_Calloc((size_t)(2 * n), sizeof(Weight)) : NULL;
    if (!w) {
        Py_DECREF(groups);
        if (n > 0 && n <= 65536)
            PyErr_NoMemory();
        else
            PyErr_Format(PyExc_ValueError, "mlp_step: %zd groups; it takes 1 to 65536", n);
        return -1;
    }
    Py_ssize_t opened = 0, most = 0;
    for (; opened < n; opened++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(groups, opened), *gate_up, *down;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "mlp_step: group %zd is not a (gate_up, down) pair", opened);
            break;
        }
        gate_up = PyTuple_GET_ITEM(pair, 0), down = PyTuple_GET_ITEM(pair, 1);
        if (weight_pair(&w[2 * opened], gate_up, "gate_up", &w[2 * opened + 1], down, "down") < 0)
            break;
        const Job *gu = &w[2 * opened].job, *dn = &w[2 * opened + 1].job;
        if (gu->n % 2 || dn->blocks * dn->block != gu->n / 2 || gu->blocks * gu->block != d || dn->n != d_out) {
            PyErr_Format(PyExc_ValueError, "mlp_step: group %zd's gate_up has %zd rows (gate's, then up's) of %zd inputs "
                         "and down %zd rows of %zd inputs: they must be 2N rows of %zd and %zd rows of N", opened, gu->n,
                         gu->blocks * gu->block, dn->n, dn->blocks * dn->block, d, d_out);
            weight_close(&w[2 * opened]), weight_close(&w[2 * opened + 1]);
            break;
        }
        most = gu->n / 2 > most ? gu->n / 2 : most;
    }
    Py_DECREF(groups);
    if (opened < n) {
        while (opened-- > 0)
            weight_close(&w[2 * opened]), weight_close(&w[2 * opened + 1]);
        PyMem_Free(w);
        return -1;
    }
    *weights = w, *count = n, *widest = most;
    return 0;
}

static PyObject *py_mlp_step(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *names[] = {"x", "norm", "eps", "groups", "y", "threads", NULL};
    PyObject *x_obj, *norm_obj, *groups_obj, *y_obj;
    float eps;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOfOO|i", names, &x_obj, &norm_obj, &eps, &groups_obj, &y_obj,
                                     &threads))
        return NULL;
    if (checked_threads(threads) < 0)
        return NULL;
    Py_buffer views[3];
    int held = 0, failed = 0;
    const int normed = norm_obj != Py_None;
    if (floats(x_obj, &views[held], "x", -1, 0) < 0 || (++held, floats(y_obj, &views[held], "y", -1, 1) < 0)
        || (++held, normed && floats(norm_obj, &views[held], "norm", views[0].ndim == 2 ? views[0].shape[1]
                                                                                    : views[0].len / 4, 0) < 0)) {
        for (int i = 0; i < held; i++)
            PyBuffer_Release(&views[i]);
        return NULL;
    }
    held += normed;
    /* x [T, d] and y [T, d_out] (1-D: one position) */
    const Py_ssize_t d = views[0].ndim == 2 ? views[0].shape[1] : views[0].len / 4;
    const Py_ssize_t tokens = views[0].ndim == 2 ? views[0].shape[0] : 1;
    const Py_ssize_t d_out = views[1].ndim == 2 ? views[1].shape[1] : views[1].len / 4;
    if (tokens < 1 || d < 1 || views[1].len != tokens * d_out * 4) {
        PyErr_Format(PyExc_ValueError, "mlp_step: x [T, %zd] and y [T, D] must hold T >= 1 positions alike", d);
        for (int i = 0; i < held; i++)
            PyBuffer_Release(&views[i]);
        return NULL;
    }
    Weight *w;
    Py_ssize_t count, widest;
    if (mlp_groups_open(groups_obj, d, d_out, &w, &count, &widest) < 0) {
        for (int i = 0; i < held; i++)
            PyBuffer_Release(&views[i]);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const int path = best_path();
    float *scratch = malloc((size_t)(tokens * (d + 3 * widest + d_out)) * sizeof(float));
    if (!scratch)
        failed = 1;
    else {
        /* T positions with each weight read once, each position's bits those of a step of its own */
        float *h = scratch, *gu = h + tokens * d, *act = gu + tokens * 2 * widest, *part = act + tokens * widest;
        float *y = views[1].buf;
        for (Py_ssize_t t = 0; t < tokens; t++) {
            if (normed)
                rms_norm((const float *)views[0].buf + t * d, views[2].buf, d, eps, h + t * d);
            else
                memcpy(h + t * d, (const float *)views[0].buf + t * d, (size_t)d * sizeof(float));
        }
        for (Py_ssize_t i = 0; i < tokens * d_out; i++)
            y[i] = 0.f;
        Codes h_codes = {0};  /* h quantized once for every group's gate/up (the same codes each would make) */
        for (Py_ssize_t g = 0; g < count && !failed; g++) {  /* each group's output added in order, as numpy adds */
            const Py_ssize_t neurons = w[2 * g].job.n / 2;
            failed = project(&w[2 * g], h, tokens, gu, threads, path, &h_codes) < 0;
            for (Py_ssize_t t = 0; t < tokens && !failed; t++)
                swiglu(gu + t * 2 * neurons, neurons, act + t * neurons);
            failed = failed || project(&w[2 * g + 1], act, tokens, part, threads, path, NULL) < 0;
            for (Py_ssize_t i = 0; i < tokens * d_out && !failed; i++)
                y[i] += part[i];
        }
        codes_free(&h_codes);
        free(scratch);
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < 2 * count; g++)
        weight_close(&w[g]);
    PyMem_Free(w);
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_prefetch_units(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t units = -1;
    if (!PyArg_ParseTuple(args, "|n", &units))
        return NULL;
    if (PyTuple_GET_SIZE(args)) {
        if (units < 1 || units > 1024) {
            PyErr_Format(PyExc_ValueError, "prefetch distance must be 1..1024 units (got %zd)", units);
            return NULL;
        }
        prefetch_units = units;
    }
    return PyLong_FromSsize_t(prefetch_distance());
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
     "matmul(weight, x, out, threads=1, path=None): out[T, n] = x[T, k] @ W.T for a compact weight given as "
     "(packed, n, bits, block, half, offsets, terms): packed [ceil(n / 16), blocks, unit] uint8 (halo.compute.linear.pack: "
     "16-row tiles, each block's codes then scales then offsets, float16 if half), weight = (code - 2^(bits-1)) x "
     "scale + offset; x quantized per block to `terms` int8 terms. path: 'scalar', 'avx2' or 'avx512_vnni' (x86), "
     "'neon' or 'neon_dotprod' (aarch64) (default: the best this CPU runs; same results)."},
    {"attention_step", (PyCFunction)(void (*)(void))py_attention_step, METH_VARARGS | METH_KEYWORDS,
     "attention_step(x, norm, eps, qkv, out, cos, sin, cache_k, cache_v, pos, kv_of_head, y, threads=1): one token's "
     "attention share: y[1, D] = W_o (attention of the rotated queries over cache positions 0..pos) for x [1, D] "
     "RMS-normed by `norm`; qkv: the query heads' rows then the KV heads' key rows then value rows; query head i reads "
     "KV head kv_of_head[i] (int32); the token's rotated keys and its values are written at cache position pos. qkv and "
     "out: weights as matmul takes them."},
    {"mlp_step", (PyCFunction)(void (*)(void))py_mlp_step, METH_VARARGS | METH_KEYWORDS,
     "mlp_step(x, norm, eps, groups, y, threads=1): one token's MLP share: y[1, D] = the sum over `groups` (a list of "
     "(gate_up, down) weight pairs, added in order) of W_down (silu(gate) x up) of x [1, D], RMS-normed by `norm` "
     "(None: x is normed already); gate_up: the gate rows then the up rows."},
    {"paths", py_paths, METH_NOARGS, "paths(): the vector paths this CPU runs, slowest first."},
    {"prefetch_units", py_prefetch_units, METH_VARARGS,
     "prefetch_units([units]): how many units (a 16-row tile's block: its codes, scales, offsets) ahead the kernels ask "
     "the memory for the weights they will read: chosen for the CPU at first use (Intel 4, others 32); given, from the "
     "next call on (a benchmark's knob; the same results at any distance)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nbits", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nbits(void) { return PyModule_Create(&module); }
