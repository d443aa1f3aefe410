/* The per-block steps of the cpu kernel on an 8-bit table, fused (m31.ops.native loads this).
 *
 * Shapes: B requests, E experts, D value dim, G gate-key dim, n ads in a block, S pairs.
 *
 * Step 1 (`m31_scan_int8`) computes exactly what the torch operations it replaces in
 * m31/ops/cpu/worker.py compute: the same exact integer products, converted to fp32 and
 * multiplied by the same scales in the same order, so its survivors and their values are the
 * torch path's bit for bit. Step 2 (`m31_step2`) is another fp32 evaluation of the same
 * formulas, with exponentials of its own whose error the bounds proved there allow for. Both
 * need IEEE fp32 arithmetic without contraction or reassociation: the loader compiles with
 * -ffp-contract=off and never with -ffast-math. `m31_pass` runs steps 1-3 over the table for
 * one worker thread, the threads sharing τ and the blocks still to scan, so that a call takes
 * the GIL only to start and to collect its candidates.
 *
 * Integer products: a query value w is an int16 (|w| <= 32,512, `_split_query`: 255·hi + lo),
 * an ad value an int8, and rows are short enough (D, G <= 516, `_WIDE_DIM`) that every sum fits
 * int32 exactly. With AVX-512 the products run as int16 multiply-adds (vpdpwssd with VNNI), four
 * experts at a time, lane sums by a shuffle tree; with AVX2 as vpmaddwd, eight experts at a time,
 * lane sums by horizontal adds; elsewhere (or built with -DM31_PLAIN) as plain loops, which the
 * compiler vectorizes less well (on Zen 3, 1.3-1.4x slower than the AVX2 path). On AVX2, step 1
 * of two or more requests runs with the ads in the lanes instead (`scan_tiled`): no lane sums.
 */
#define _POSIX_C_SOURCE 200809L /* pthread under -std=c11 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* max and min of finite floats, inline (fmaxf and fminf are library calls unless NaN can be
 * ruled out to the compiler, which -ffast-math would do for every operation) */
INLINE float max_f(float a, float b) { return a > b ? a : b; }
INLINE float min_f(float a, float b) { return a < b ? a : b; }

/* E integer products of an ad's row x [d] with a request's rows w [E, d] into out [E] (room
 * for E + 7); their maximum. The plain loops are the definition; the AVX-512 and AVX2 paths
 * below compute the same sums. */
INLINE int32_t products_plain(const int16_t *w, const int8_t *x, int64_t n_exp, int64_t d,
                              int32_t *out) {
    int32_t best = INT32_MIN;
    for (int64_t e = 0; e < n_exp; e++) {
        int32_t acc = 0;
        for (int64_t i = 0; i < d; i++) acc += (int32_t)w[e * d + i] * (int32_t)x[i];
        out[e] = acc;
        best = acc > best ? acc : best;
    }
    return best;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(M31_PLAIN)
#include <immintrin.h>
#define M31_SIMD "avx512"
#define CHUNK 32 /* int16 values in a register */
#define MAX_CHUNKS 17 /* rows of up to 544 values in registers; longer ones take the plain loops */

/* An ad's row as int16 in chunks of 32 (the last one zero-padded), converted once per ad. */
typedef struct {
    const int8_t *x;
    __m512i v[MAX_CHUNKS];
} row_t;

INLINE __mmask32 tail(int64_t d, int64_t c) {
    const int64_t left = d - 32 * c;
    return left >= 32 ? (__mmask32)0xFFFFFFFFu : (((__mmask32)1 << left) - 1);
}

INLINE void load_row(const int8_t *x, int64_t d, int64_t chunks, row_t *row) {
    row->x = x;
    if (chunks > MAX_CHUNKS) return;
    for (int64_t c = 0; c < chunks; c++)
        row->v[c] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail(d, c), x + 32 * c));
}

/* acc + the products of 32 int16 pairs, summed in adjacent pairs (exact in int32). */
INLINE __m512i madd16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* The lane sums of four vectors, as four int32. */
INLINE __m128i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0x4E)); /* 128-bit lanes 0+2, 1+3 */
    t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xB1)); /* ... + 1, + 0 */
    return _mm512_castsi512_si128(t);
}

INLINE int32_t products(const int16_t *w, const row_t *row, int64_t n_exp, int64_t d,
                        int64_t chunks, int32_t *out) {
    if (chunks > MAX_CHUNKS) return products_plain(w, row->x, n_exp, d, out);
    __m128i top = _mm_set1_epi32(INT32_MIN);
    for (int64_t e = 0; e < n_exp; e += 4) {
        /* four experts at a time; past the last one, repeat it (its sums are not kept) */
        const int16_t *w0 = w + e * d;
        const int16_t *w1 = e + 1 < n_exp ? w0 + d : w0;
        const int16_t *w2 = e + 2 < n_exp ? w0 + 2 * d : w0;
        const int16_t *w3 = e + 3 < n_exp ? w0 + 3 * d : w0;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = 0; c < chunks; c++) {
            const __mmask32 m = tail(d, c);
            const int64_t at = 32 * c;
            a0 = madd16(a0, _mm512_maskz_loadu_epi16(m, w0 + at), row->v[c]);
            a1 = madd16(a1, _mm512_maskz_loadu_epi16(m, w1 + at), row->v[c]);
            a2 = madd16(a2, _mm512_maskz_loadu_epi16(m, w2 + at), row->v[c]);
            a3 = madd16(a3, _mm512_maskz_loadu_epi16(m, w3 + at), row->v[c]);
        }
        const __m128i sums = sum4(a0, a1, a2, a3);
        _mm_storeu_si128((__m128i *)(out + e), sums); /* out has room for 7 more */
        top = _mm_max_epi32(top, sums);                /* the repeats are real sums too */
    }
    top = _mm_max_epi32(top, _mm_shuffle_epi32(top, 0x4E));
    top = _mm_max_epi32(top, _mm_shuffle_epi32(top, 0xB1));
    return _mm_cvtsi128_si32(top);
}
#elif defined(__AVX2__) && !defined(M31_PLAIN)
#include <immintrin.h>
#define M31_SIMD "avx2"
#define CHUNK 16
#define MAX_CHUNKS 12 /* rows of up to 192 values in registers, of a multiple of 16 values */

/* An ad's row as int16 in chunks of 16, converted once per ad. AVX2 has no byte-masked loads,
 * so rows whose length is not a multiple of 16 take the plain loops. */
typedef struct {
    const int8_t *x;
    __m256i v[MAX_CHUNKS];
} row_t;

INLINE int in_registers(int64_t d, int64_t chunks) { return d % 16 == 0 && chunks <= MAX_CHUNKS; }

INLINE void load_row(const int8_t *x, int64_t d, int64_t chunks, row_t *row) {
    row->x = x;
    if (!in_registers(d, chunks)) return;
    for (int64_t c = 0; c < chunks; c++)
        row->v[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + 16 * c)));
}

/* The lane sums of eight vectors, as eight int32 in their order. */
INLINE __m256i sum8(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m256i a4, __m256i a5,
                    __m256i a6, __m256i a7) {
    /* per 128-bit half: [a0 | a1 | a2 | a3] sums of its four lanes, then of a4..a7 */
    const __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    const __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a4, a5), _mm256_hadd_epi32(a6, a7));
    return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20),
                            _mm256_permute2x128_si256(t0, t1, 0x31));
}

/* One expert's row w [d] against the ad's: eight int32 partial sums. */
INLINE __m256i dot16(const int16_t *w, const row_t *row, int64_t chunks) {
    __m256i acc = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)w), row->v[0]);
    for (int64_t c = 1; c < chunks; c++)
        acc = _mm256_add_epi32(
            acc, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(w + 16 * c)), row->v[c]));
    return acc;
}

INLINE int32_t products(const int16_t *w, const row_t *row, int64_t n_exp, int64_t d,
                        int64_t chunks, int32_t *out) {
    if (!in_registers(d, chunks)) return products_plain(w, row->x, n_exp, d, out);
    __m256i top = _mm256_set1_epi32(INT32_MIN);
    const int16_t *last = w + (n_exp - 1) * d;
    for (int64_t e = 0; e < n_exp; e += 8) {
        /* eight experts at a time; past the last one, repeat it (its sums are not kept) */
        const int16_t *w0 = w + e * d;
#define W(k) (e + k < n_exp ? w0 + k * d : last)
        const __m256i sums = sum8(dot16(w0, row, chunks), dot16(W(1), row, chunks),
                                  dot16(W(2), row, chunks), dot16(W(3), row, chunks),
                                  dot16(W(4), row, chunks), dot16(W(5), row, chunks),
                                  dot16(W(6), row, chunks), dot16(W(7), row, chunks));
#undef W
        _mm256_storeu_si256((__m256i *)(out + e), sums); /* out has room for 7 more */
        top = _mm256_max_epi32(top, sums);               /* the repeats are real sums too */
    }
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
    return _mm_cvtsi128_si32(m);
}
#else
#define M31_SIMD "plain"
#define CHUNK 32 /* unused */
typedef struct {
    const int8_t *x;
} row_t;

INLINE void load_row(const int8_t *x, int64_t d, int64_t chunks, row_t *row) {
    (void)d, (void)chunks;
    row->x = x;
}

INLINE int32_t products(const int16_t *w, const row_t *row, int64_t n_exp, int64_t d,
                        int64_t chunks, int32_t *out) {
    (void)chunks;
    return products_plain(w, row->x, n_exp, d, out);
}
#endif

/* Which of the two implementations of the products this build has. */
const char *m31_simd(void) { return M31_SIMD; }

#define SCAN_AHEAD 64 /* ads */
#ifndef TILED_MIN_REQUESTS
#define TILED_MIN_REQUESTS 2 /* the tiled scan's gather pays off from this many requests on */
#endif

/* Bit i of the result: whether request r may take ad a0 + i (block-local), i < count <= 64,
 * under the mask of the call. mode 0: no mask. 1: bool bytes, request r's row at
 * mask + r·stride (stride 0: one row shared by every request), offset to the block's first ad.
 * 2: packed bits (m31.ops.masks): bitmap index[r] at mask + index[r]·stride, ad a is bit
 * offset + a. Reads only the bytes that hold these ads. */
INLINE uint64_t eligible(int64_t mode, const uint8_t *mask, int64_t stride, const int64_t *index,
                         int64_t offset, int64_t r, int64_t a0, int64_t count) {
    const uint64_t all = count == 64 ? ~(uint64_t)0 : (((uint64_t)1 << count) - 1);
    if (mode == 0) return all;
    uint64_t word = 0;
    if (mode == 1) {
        const uint8_t *row = mask + r * stride + a0;
#if defined(__AVX512BW__) && !defined(M31_PLAIN)
        const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64)all, row);
        return (uint64_t)_mm512_test_epi8_mask(bytes, bytes);
#elif defined(__AVX2__) && !defined(M31_PLAIN)
        if (count == 64) { /* the bytes that are zero, as bits, inverted */
            const __m256i zero = _mm256_setzero_si256();
            const uint32_t lo = (uint32_t)_mm256_movemask_epi8(
                _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)row), zero));
            const uint32_t hi = (uint32_t)_mm256_movemask_epi8(
                _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(row + 32)), zero));
            return ~((uint64_t)hi << 32 | lo);
        }
        for (int64_t i = 0; i < count; i++) word |= (uint64_t)(row[i] != 0) << i;
        return word;
#else
        for (int64_t i = 0; i < count; i++) word |= (uint64_t)(row[i] != 0) << i;
        return word;
#endif
    }
    const uint8_t *bits = mask + index[r] * stride;
    const int64_t bit = offset + a0, first = bit >> 3, shift = bit & 7;
    const int64_t n_bytes = (shift + count + 7) >> 3; /* at most 9 */
    for (int64_t i = 0; i < n_bytes; i++) {
        const uint64_t byte = bits[first + i];
        word |= i == 0 ? byte >> shift : byte << (8 * i - shift);
    }
    return word & all;
}

/* One eligible pair (request r, ad a; wr its rows of w, vs its v_scale, t its tau): the
 * products, the bound M, and where M >= t the survivor at position s of the outputs. Returns
 * whether it survived. */
INLINE int scan_pair(const int8_t *x, const float *x_scale, const float *offset, int64_t d,
                     int64_t chunks, const int16_t *wr, float vs, float t, int64_t n_exp, int64_t r,
                     int64_t a, int64_t s, row_t *row, int32_t *ints, int64_t *out_req,
                     int64_t *out_ad, float *out_aff, int64_t cap) {
    /* the table streams from memory: ask for rows a little ahead (a hint, which never faults,
     * past the block's end included) */
    __builtin_prefetch(x + (a + SCAN_AHEAD) * d);
    load_row(x + a * d, d, chunks, row);
    const int32_t best = products(wr, row, n_exp, d, chunks, ints);
    const float xs = x_scale[a];
    float m = (float)best * vs;
    m = m * xs;
    m = m + offset[a];
    if (!(m >= t)) return 0;
    out_req[s] = r;
    out_ad[s] = a;
    for (int64_t e = 0; e < n_exp; e++) out_aff[e * cap + s] = ((float)ints[e] * vs) * xs;
    return 1;
}

INLINE int64_t scan(const int8_t *x, const float *x_scale, const float *offset, int64_t n,
                    int64_t d, int64_t chunks, const int16_t *w, const float *v_scale,
                    const float *tau, int64_t n_req, int64_t n_exp, int64_t mask_mode,
                    const uint8_t *mask, int64_t mask_stride, const int64_t *mask_index,
                    int64_t mask_offset, int64_t *out_req, int64_t *out_ad, float *out_aff,
                    int64_t cap) {
    int32_t ints[n_exp + 7];
    row_t row;
    int64_t s = 0;
    /* request by request (its rows of w stay in L1 while the block's ads stream from L2), 64
     * ads at a time, only the eligible ones (no branch per ineligible ad) */
    for (int64_t r = 0; r < n_req; r++) {
        const int16_t *wr = w + r * n_exp * d;
        const float vs = v_scale[r], t = tau[r];
        for (int64_t a0 = 0; a0 < n; a0 += 64) {
            const int64_t count = n - a0 < 64 ? n - a0 : 64;
            uint64_t todo = eligible(mask_mode, mask, mask_stride, mask_index, mask_offset, r, a0,
                                     count);
            for (; todo; todo &= todo - 1)
                s += scan_pair(x, x_scale, offset, d, chunks, wr, vs, t, n_exp, r,
                               a0 + __builtin_ctzll(todo), s, &row, ints, out_req, out_ad,
                               out_aff, cap);
        }
    }
    return s;
}

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(M31_PLAIN)
#define TILED 1
#define TILE_DIM 192 /* the longest row the tiled scan takes (a multiple of 16) */
#define TILE 64 /* slots of a tile: the ads of 64 that any request wants */
/* A tile of 64 ads goes the tiled way when the requests want at least this share of the pairs
 * of the ads that any of them wants (each such pair costs about half of one by one). */
#define TILED_FILL 0.6

/* Whether every request of the call has the same eligible ads: no mask, one bool row for all,
 * or one packed bitmap for all. */
static int shared_mask(int64_t mode, int64_t stride, const int64_t *index, int64_t n_req) {
    if (mode == 0) return 1;
    if (mode == 1) return stride == 0;
    for (int64_t r = 1; r < n_req; r++)
        if (index[r] != index[0]) return 0;
    return 1;
}

/* Expert values w[2j], w[2j + 1] as one int32 in every lane (a broadcast load: from the
 * request's 1 KB of w, not from 32-byte copies of each pair, which at B = 64 outgrow L2). */
INLINE __m256i pair_of(const int16_t *w, int64_t j) {
    int32_t both;
    __builtin_memcpy(&both, w + 2 * j, sizeof both);
    return _mm256_set1_epi32(both);
}

/* The products of 8 tile slots with 4 experts' rows (w [4, d]) into out [4 experts][8 slots].
 * Four named accumulators: with eight, GCC 12 spills one and the loop waits on the store. */
INLINE void dots4(const int32_t *tile, const int16_t *w, int64_t d, int64_t pairs, int32_t *out) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#pragma GCC unroll 2
    for (int64_t j = 0; j < pairs; j++) {
        const __m256i xj = _mm256_load_si256((const __m256i *)(tile + j * TILE));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(xj, pair_of(w, j)));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(xj, pair_of(w + d, j)));
        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(xj, pair_of(w + 2 * d, j)));
        a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(xj, pair_of(w + 3 * d, j)));
    }
    _mm256_store_si256((__m256i *)out, a0);
    _mm256_store_si256((__m256i *)(out + 8), a1);
    _mm256_store_si256((__m256i *)(out + 16), a2);
    _mm256_store_si256((__m256i *)(out + 24), a3);
}

/* `dots4` for 16 slots, each expert's pair loaded once for both halves: slots 0-7 into out0
 * [4][8], slots 8-15 into out1. */
INLINE void dots4x2(const int32_t *tile, const int16_t *w, int64_t d, int64_t pairs,
                    int32_t *out0, int32_t *out1) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#pragma GCC unroll 2
    for (int64_t j = 0; j < pairs; j++) {
        const __m256i x0 = _mm256_load_si256((const __m256i *)(tile + j * TILE));
        const __m256i x1 = _mm256_load_si256((const __m256i *)(tile + j * TILE + 8));
        __m256i v = pair_of(w, j);
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(x0, v));
        b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(x1, v));
        v = pair_of(w + d, j);
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(x0, v));
        b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(x1, v));
        v = pair_of(w + 2 * d, j);
        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(x0, v));
        b2 = _mm256_add_epi32(b2, _mm256_madd_epi16(x1, v));
        v = pair_of(w + 3 * d, j);
        a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(x0, v));
        b3 = _mm256_add_epi32(b3, _mm256_madd_epi16(x1, v));
    }
    _mm256_store_si256((__m256i *)out0, a0);
    _mm256_store_si256((__m256i *)(out0 + 8), a1);
    _mm256_store_si256((__m256i *)(out0 + 16), a2);
    _mm256_store_si256((__m256i *)(out0 + 24), a3);
    _mm256_store_si256((__m256i *)out1, b0);
    _mm256_store_si256((__m256i *)(out1 + 8), b1);
    _mm256_store_si256((__m256i *)(out1 + 16), b2);
    _mm256_store_si256((__m256i *)(out1 + 24), b3);
}

/* The same for one expert (the last ones of an E that is not a multiple of 4). */
INLINE void dots1(const int32_t *tile, const int16_t *w, int64_t pairs, int32_t *out) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = 0; j < pairs; j++)
        acc = _mm256_add_epi32(
            acc, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(tile + j * TILE)),
                                   pair_of(w, j)));
    _mm256_store_si256((__m256i *)out, acc);
}

/* Slots s..s+7 of the tile from the rows of ads[0..8) (-1: a zero row), by pairs of values:
 * each row's 16 values at a time as int16 (eight pairs, as int32), then an 8 x 8 transpose. */
INLINE void gather8(const int8_t *x, int64_t d, const int64_t *ads, int32_t *tile) {
    static const int8_t zeros[TILE_DIM] = {0};
    const int8_t *rows[8];
    for (int k = 0; k < 8; k++) rows[k] = ads[k] < 0 ? zeros : x + ads[k] * d;
    for (int64_t c = 0; c < d / 16; c++) {
        __m256i v[8];
        for (int k = 0; k < 8; k++)
            v[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[k] + 16 * c)));
        /* 8 x 8 int32 transpose: the tile's row 8c + j gets pair 8c + j of the 8 rows */
        const __m256i u0 = _mm256_unpacklo_epi32(v[0], v[1]);
        const __m256i u1 = _mm256_unpackhi_epi32(v[0], v[1]);
        const __m256i u2 = _mm256_unpacklo_epi32(v[2], v[3]);
        const __m256i u3 = _mm256_unpackhi_epi32(v[2], v[3]);
        const __m256i u4 = _mm256_unpacklo_epi32(v[4], v[5]);
        const __m256i u5 = _mm256_unpackhi_epi32(v[4], v[5]);
        const __m256i u6 = _mm256_unpacklo_epi32(v[6], v[7]);
        const __m256i u7 = _mm256_unpackhi_epi32(v[6], v[7]);
        const __m256i w0 = _mm256_unpacklo_epi64(u0, u2), w1 = _mm256_unpackhi_epi64(u0, u2);
        const __m256i w2 = _mm256_unpacklo_epi64(u1, u3), w3 = _mm256_unpackhi_epi64(u1, u3);
        const __m256i w4 = _mm256_unpacklo_epi64(u4, u6), w5 = _mm256_unpackhi_epi64(u4, u6);
        const __m256i w6 = _mm256_unpacklo_epi64(u5, u7), w7 = _mm256_unpackhi_epi64(u5, u7);
        int32_t *out = tile + 8 * c * TILE;
#define PUT(j, lo, hi, sel) \
    _mm256_store_si256((__m256i *)(out + (j) * TILE), _mm256_permute2x128_si256(lo, hi, sel))
        PUT(0, w0, w4, 0x20), PUT(1, w1, w5, 0x20), PUT(2, w2, w6, 0x20), PUT(3, w3, w7, 0x20);
        PUT(4, w0, w4, 0x31), PUT(5, w1, w5, 0x31), PUT(6, w2, w6, 0x31), PUT(7, w3, w7, 0x31);
#undef PUT
    }
}

/* The bits of `word` at the positions of the set bits of `within`, packed from bit 0 (BMI2's
 * pext). */
INLINE uint64_t compress_bits(uint64_t word, uint64_t within) {
#ifdef __BMI2__
    return _pext_u64(word, within);
#else
    uint64_t out = 0;
    for (int64_t i = 0; within; within &= within - 1, i++)
        out |= (uint64_t)((word >> __builtin_ctzll(within)) & 1) << i;
    return out;
#endif
}

/* `scan` with the ads in the lanes, for two or more requests. The ads of each 64 that any
 * request may take are gathered once, for all requests, into a tile that holds them by pairs of
 * values: tile[j·TILE + slot] = x[ad, 2j] and x[ad, 2j + 1] as two int16. Each request's
 * products for 8 ads and one expert are then one vpmaddwd per pair of values (the 8 slots
 * against the expert's pair in every lane, `pair_of`) with no lane sums, where
 * `products` needs a shuffle tree per ad; a request keeps the slots of its own ads
 * (`compress_bits`). Where the requests want less than TILED_FILL of the pairs of a tile (their
 * masks differ), its pairs go one by one as in `scan`. The sums are exact int32 in any order,
 * so the values are `scan`'s. Survivors go to their request's region of the outputs (request r
 * from r·n) and are packed by request at the end: the same order as `scan` (by request, then
 * ad). d is a multiple of 16, at most TILE_DIM. */
INLINE int64_t scan_tiled(const int8_t *x, const float *x_scale, const float *offset, int64_t n,
                          int64_t d, const int16_t *w, const float *v_scale, const float *tau,
                          int64_t n_req, int64_t n_exp, int64_t mask_mode, const uint8_t *mask,
                          int64_t mask_stride, const int64_t *mask_index, int64_t mask_offset,
                          int64_t *out_req, int64_t *out_ad, float *out_aff, int64_t cap) {
    const int64_t pairs = d / 2, chunks = d / CHUNK;
    const int shared = shared_mask(mask_mode, mask_stride, mask_index, n_req);
    int32_t tile[TILE_DIM / 2 * TILE] __attribute__((aligned(32)));
    int32_t sums[2 * n_exp * 8] __attribute__((aligned(32))), ints[n_exp + 7];
    float xs[64] __attribute__((aligned(32))), off[64] __attribute__((aligned(32)));
    int64_t ads[64], kept[n_req];
    uint64_t words[n_req];
    row_t row;
    for (int64_t r = 0; r < n_req; r++) kept[r] = 0;
    for (int64_t a0 = 0; a0 < n; a0 += 64) {
        const int64_t count = n - a0 < 64 ? n - a0 : 64;
        uint64_t any = 0; /* the ads of these 64 that some request may take */
        int64_t wanted = 0; /* pairs */
        for (int64_t r = 0; r < n_req; r++) {
            words[r] = shared && r ? words[0]
                                   : eligible(mask_mode, mask, mask_stride, mask_index,
                                              mask_offset, r, a0, count);
            any |= words[r];
            wanted += __builtin_popcountll(words[r]);
        }
        const int64_t m = __builtin_popcountll(any);
        if (!m) continue;
        if ((double)wanted < TILED_FILL * (double)(n_req * m)) {
            /* requests that share few of these ads: their pairs one by one, as `scan` */
            for (int64_t r = 0; r < n_req; r++)
                for (uint64_t todo = words[r]; todo; todo &= todo - 1) {
                    const int64_t at = r * n + kept[r]; /* the next place in r's region */
                    kept[r] += scan_pair(x, x_scale, offset, d, chunks, w + r * n_exp * d,
                                         v_scale[r], tau[r], n_exp, r, a0 + __builtin_ctzll(todo),
                                         at, &row, ints, out_req, out_ad, out_aff, cap);
                }
            continue;
        }
        int64_t slot = 0;
        for (uint64_t todo = any; todo; todo &= todo - 1) {
            const int64_t a = a0 + __builtin_ctzll(todo);
            __builtin_prefetch(x + (a + SCAN_AHEAD) * d); /* as `scan` asks for rows ahead */
            ads[slot] = a, xs[slot] = x_scale[a], off[slot] = offset[a];
            slot++;
        }
        for (int64_t i = m; i < ((m + 7) & ~7); i++) /* the last 8's empty slots: zero rows */
            ads[i] = -1, xs[i] = 0.0f, off[i] = 0.0f;
        for (int64_t s0 = 0; s0 < m; s0 += 8) gather8(x, d, ads + s0, tile + s0);
        for (int64_t r = 0; r < n_req; r++) {
            const uint64_t mine = compress_bits(words[r], any); /* by slot */
            if (!mine) continue;
            const int16_t *wr = w + r * n_exp * d;
            const __m256 vs = _mm256_set1_ps(v_scale[r]), t = _mm256_set1_ps(tau[r]);
            for (int64_t s0 = 0; s0 < m; s0 += 16) { /* 16 slots, or the last 8 */
                if (!((mine >> s0) & 0xFFFF)) continue;
                const int64_t halves = m - s0 > 8 ? 2 : 1;
                int64_t e = 0;
                for (; e + 4 <= n_exp; e += 4) {
                    if (halves == 2)
                        dots4x2(tile + s0, wr + e * d, d, pairs, sums + e * 8,
                                sums + (n_exp + e) * 8);
                    else
                        dots4(tile + s0, wr + e * d, d, pairs, sums + e * 8);
                }
                for (; e < n_exp; e++)
                    for (int64_t h = 0; h < halves; h++)
                        dots1(tile + s0 + 8 * h, wr + e * d, pairs, sums + (h * n_exp + e) * 8);
                for (int64_t h = 0; h < halves; h++) {
                    const int32_t *part = sums + h * n_exp * 8;
                    const int64_t first = s0 + 8 * h;
                    __m256i best = _mm256_set1_epi32(INT32_MIN);
                    for (e = 0; e < n_exp; e++)
                        best = _mm256_max_epi32(best,
                                                _mm256_load_si256((const __m256i *)(part + e * 8)));
                    /* the bound, as `scan` evaluates it: ((float)best · vs) · xs + offset >= tau */
                    __m256 bound = _mm256_mul_ps(_mm256_cvtepi32_ps(best), vs);
                    bound = _mm256_mul_ps(bound, _mm256_load_ps(xs + first));
                    bound = _mm256_add_ps(bound, _mm256_load_ps(off + first));
                    uint32_t pass =
                        (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(bound, t, _CMP_GE_OQ));
                    pass &= (uint32_t)(mine >> first) & 0xFF; /* its own ads, no empty slots */
                    while (pass) {
                        const int64_t i = __builtin_ctz(pass);
                        pass &= pass - 1;
                        const int64_t s = r * n + kept[r]++;
                        const float scale = xs[first + i];
                        out_req[s] = r;
                        out_ad[s] = ads[first + i];
                        for (e = 0; e < n_exp; e++)
                            out_aff[e * cap + s] = ((float)part[e * 8 + i] * v_scale[r]) * scale;
                    }
                }
            }
        }
    }
    int64_t total = 0; /* the regions, packed by request */
    for (int64_t r = 0; r < n_req; r++) {
        if (total != r * n && kept[r]) {
            __builtin_memmove(out_req + total, out_req + r * n, kept[r] * sizeof *out_req);
            __builtin_memmove(out_ad + total, out_ad + r * n, kept[r] * sizeof *out_ad);
            for (int64_t e = 0; e < n_exp; e++)
                __builtin_memmove(out_aff + e * cap + total, out_aff + e * cap + r * n,
                                  kept[r] * sizeof *out_aff);
        }
        total += kept[r];
    }
    return total;
}
#else /* no tiled scan: a stub that `m31_scan_int8` never calls (TILED is 0) */
#define TILED 0
#define TILE_DIM 0
INLINE int64_t scan_tiled(const int8_t *x, const float *x_scale, const float *offset, int64_t n,
                          int64_t d, const int16_t *w, const float *v_scale, const float *tau,
                          int64_t n_req, int64_t n_exp, int64_t mask_mode, const uint8_t *mask,
                          int64_t mask_stride, const int64_t *mask_index, int64_t mask_offset,
                          int64_t *out_req, int64_t *out_ad, float *out_aff, int64_t cap) {
    (void)x, (void)x_scale, (void)offset, (void)n, (void)d, (void)w, (void)v_scale, (void)tau;
    (void)n_req, (void)n_exp, (void)mask_mode, (void)mask, (void)mask_stride, (void)mask_index;
    (void)mask_offset, (void)out_req, (void)out_ad, (void)out_aff, (void)cap;
    return 0;
}
#endif

/* Step 1 on a block of n ads (`Worker.scan_int8`): for every eligible pair (r, a), the
 * integer affinities I_e = w[r, e]·x[a], the bound
 *     M = ((float)max_e I_e · v_scale[r]) · x_scale[a] + offset[a]
 * and, where M >= tau[r], the pair as a survivor: out_req, out_ad (block-local) and
 * out_aff[e·cap + s] = ((float)I_e · v_scale[r]) · x_scale[a].
 * x [n, d] int8, x_scale [n], offset [n] (`affinity_offset`), w [B, E, d] int16,
 * v_scale [B], tau [B] (`Threshold.for_scan`). cap >= B·n. Returns S; the pairs come by
 * request, then ad. `scan_tiled` where it is built (AVX2) for two or more requests and rows of a
 * multiple of 16 values up to TILE_DIM; `scan` otherwise, which gives the same. */
int64_t m31_scan_int8(const int8_t *x, const float *x_scale, const float *offset, int64_t n,
                      int64_t d, const int16_t *w, const float *v_scale, const float *tau,
                      int64_t n_req, int64_t n_exp, int64_t mask_mode, const uint8_t *mask,
                      int64_t mask_stride, const int64_t *mask_index, int64_t mask_offset,
                      int64_t *out_req, int64_t *out_ad, float *out_aff, int64_t cap) {
    if (TILED && n_req >= TILED_MIN_REQUESTS && d % 16 == 0 && d <= TILE_DIM) {
        if (n_exp == 8 && d == 64)
            return scan_tiled(x, x_scale, offset, n, 64, w, v_scale, tau, n_req, 8, mask_mode,
                              mask, mask_stride, mask_index, mask_offset, out_req, out_ad, out_aff,
                              cap);
        return scan_tiled(x, x_scale, offset, n, d, w, v_scale, tau, n_req, n_exp, mask_mode, mask,
                          mask_stride, mask_index, mask_offset, out_req, out_ad, out_aff, cap);
    }
    if (d == 64 && n_exp == 8) /* the common shape, its loops unrolled */
        return scan(x, x_scale, offset, n, 64, 64 / CHUNK, w, v_scale, tau, n_req, 8, mask_mode,
                    mask, mask_stride, mask_index, mask_offset, out_req, out_ad, out_aff, cap);
    if (d == 64)
        return scan(x, x_scale, offset, n, 64, 64 / CHUNK, w, v_scale, tau, n_req, n_exp,
                    mask_mode, mask, mask_stride, mask_index, mask_offset, out_req, out_ad, out_aff,
                    cap);
    return scan(x, x_scale, offset, n, d, (d + CHUNK - 1) / CHUNK, w, v_scale, tau, n_req, n_exp,
                mask_mode, mask, mask_stride, mask_index, mask_offset, out_req, out_ad, out_aff,
                cap);
}

#define PREFETCH 16 /* pairs */
#define BOUNDS_CHUNK 256 /* pairs */

/* e^l of a finite l within a relative 2^-19 for l in [-86, 88]; below -86, a value in
 * [0, 2^-124); above 88, one within 2^-19 or +inf (the caller's logits are finite and below 81:
 * `step2`). Loops of it vectorize (no library call, no branch). The proof, with u = 2^-24 the
 * unit roundoff of fp32:
 * - k = round(t), t = fl(l·log2 e): |t - l·log2 e| <= 128u, so r = l - k·ln 2 has
 *   |r| <= (1/2 + 128u)·ln 2 < 0.3466.
 * - r' = (l - k·LN2_HI) - k·LN2_LO: k·LN2_HI is exact (8 + 15 significant bits), the two
 *   subtractions and k·LN2_LO round by at most u·0.36, u·0.36 and u·2^-12, and
 *   |LN2_HI + LN2_LO - ln 2| < 2^-43: |r' - r| < 0.75u, a relative 0.75u of e^r.
 * - e^r' by its Taylor polynomial of degree 7 (coefficients rounded to fp32, each within u of
 *   1/j!): the tail is below r^8/8!·e^|r| < 2^-26.4·e^r; the coefficients' rounding adds at most
 *   u·(e^|r| - 1)/e^-|r| < 0.6u relative; Horner's 14 roundings at most γ_14·e^|r|/e^r' < 29u.
 * - the scaling by 2^k (k >= -124, a normal result) is exact. Below -86, k <= -124 and the
 *   result is at most e^l·(1 + 2^-19) or 0 (k = -127).
 * In all below 31u < 2^-19. A weight off by a relative ρ is a logit off by -ln(1 - ρ) < 2^-18,
 * which `_EXP_ETA` adds to η. */
INLINE float exp_f(float l) {
    const float t = l * 0x1.715476p+0f;             /* log2 e */
    const float kf = (t + 0x1.8p+23f) - 0x1.8p+23f; /* t rounded to an integer (|t| < 2^22) */
    float r = l - kf * 0x1.62e4p-1f;                /* LN2_HI */
    r = r - kf * 0x1.7f7d1cp-20f;                   /* LN2_LO */
    float p = 0x1.a01a02p-13f;                      /* 1/7! */
    p = p * r + 0x1.6c16c2p-10f;                    /* 1/6! */
    p = p * r + 0x1.111112p-7f;                     /* 1/5! */
    p = p * r + 0x1.555556p-5f;                     /* 1/4! */
    p = p * r + 0x1.555556p-3f;                     /* 1/3! */
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* 2^k from its exponent bits: k = -127 gives 0 and k = 128 +inf (k clamped to them, NaN
     * to -127); no branch, so that loops of it vectorize */
    const int32_t k = (int32_t)min_f(max_f(kf, -127.0f), 128.0f);
    union {
        uint32_t bits;
        float f;
    } two_k = {.bits = (uint32_t)(k + 127) << 23};
    return p * two_k.f;
}

/* e^y - 1 for y >= 0 within a relative 2^-15: its Taylor polynomial of degree 5 below 1/16
 * (tail < 2^-28, roundings < 10u), exp_f(y) - 1 above (exp_f's 2^-19 of e^y is at most
 * 2^-19·e^y/(e^y - 1) < 2^-15 of e^y - 1 for y >= 1/16). Step 2's bound multiplies it by
 * (1 + 2^-10), which covers this with the bound's own roundings (`gate_bounds`). */
INLINE float expm1_f(float y) {
    float s = y * 0x1.111112p-7f + 0x1.555556p-5f;
    s = s * y + 0x1.555556p-3f;
    s = s * y + 0.5f;
    s = s * y + 1.0f;
    union {
        float f;
        uint32_t bits;
    } small = {.f = s * y}, big = {.f = exp_f(y) - 1.0f};
    const uint32_t pick = -(uint32_t)(y < 0x1p-4f); /* a blend by bits: the loops vectorize */
    small.bits = (small.bits & pick) | (big.bits & ~pick);
    return small.f;
}

/* exp_f (which 0) or expm1_f (which 1) of n values, for the tests of their error. */
void m31_exp(const float *in, float *out, int64_t n, int64_t which) {
    if (which)
        for (int64_t i = 0; i < n; i++) out[i] = expm1_f(in[i]);
    else
        for (int64_t i = 0; i < n; i++) out[i] = exp_f(in[i]);
}

/* Step 2 on S pairs of an 8-bit table (`Worker.bounds`: the logits of its `logits_int8`, then
 * `gate_bounds` and the filter h >= tau), BOUNDS_CHUNK pairs at a time. Pair s = (req[s], row[s]):
 *   L_e = ((float)(wq[req, e]·g[row]) · q_scale[req]) · g_scale[row]   (none when gdim = 0)
 *   l_e = L_e + p_t[e, req], less the pair's largest l when max_e |L_e| + shift_base >= 80
 *         (shift_base = max |p| + ln E), where e^l or its sum could overflow; so l < 81
 *   2η = 2·((coef[req, 1] + coef[req, 0]·‖g‖) + max_e |L_e|·eta_l)
 *   weights exp_f(l_e), e^(2η) - 1 as expm1_f, then s~ and ε as `gate_bounds` computes them,
 *   each sum over E in expert order.
 * g [N, gdim] int8, g_scale [N], wq [B, E, gdim] int16, q_scale [B], p_t [E, B], coef [B, 3]
 * (`Plan.coef`, its η constant including `_EXP_ETA`), per_ad [3, N] the table's ‖g‖ and ‖x‖
 * bounds and b; aff[e·stride + s] step 1's affinities; kappa, one_u = 1 + u',
 * u_2kappa = u' + 2κ (`Plan`). Keeps the pairs with h = s~ + ε >= tau[req]: writes them
 * (req, row, ℓ = s~ - ε, h) in order and returns how many. */
INLINE int64_t step2(const int8_t *g, const float *g_scale, int64_t gdim, int64_t chunks,
                     const int16_t *wq, const float *q_scale, const float *p_t, int64_t n_req,
                     int64_t n_exp, const float *coef, const float *per_ad, int64_t n_ads,
                     double shift_base, float eta_l, float kappa, float one_u, float u_2kappa,
                     const int64_t *req, const int64_t *row, const float *aff, int64_t stride,
                     int64_t n_pairs, const float *tau, int64_t *out_req, int64_t *out_row,
                     float *out_lower, float *out_upper) {
    const float *g_norm = per_ad, *x_norm = per_ad + n_ads, *bias_of = per_ad + 2 * n_ads;
    /* per chunk: the products pair by pair, then the rest in loops over the pairs that the
     * compiler vectorizes; weight [E, BOUNDS_CHUNK] holds the integer products as fp32 (the
     * same conversion the formula makes), then the logits, then their exponentials */
    int32_t ints[n_exp + 7];
    float weight[n_exp * BOUNDS_CHUNK];
    float qs[BOUNDS_CHUNK], gs[BOUNDS_CHUNK], lam[BOUNDS_CHUNK], most[BOUNDS_CHUNK];
    float em[BOUNDS_CHUNK], top[BOUNDS_CHUNK], bottom[BOUNDS_CHUNK], den[BOUNDS_CHUNK];
    float num[BOUNDS_CHUNK], mag[BOUNDS_CHUNK], x_part[BOUNDS_CHUNK], bias[BOUNDS_CHUNK];
    float lower[BOUNDS_CHUNK], upper[BOUNDS_CHUNK];
    row_t ad;
    int64_t kept = 0;
    for (int64_t s0 = 0; s0 < n_pairs; s0 += BOUNDS_CHUNK) {
        const int64_t count = n_pairs - s0 < BOUNDS_CHUNK ? n_pairs - s0 : BOUNDS_CHUNK;
        const int64_t *r = req + s0, *a = row + s0;
        for (int64_t i = 0; i < count; i++) {
            /* the pairs' rows are gathered at random: ask for them a few pairs ahead */
            if (s0 + i + PREFETCH < n_pairs) {
                const int64_t next = row[s0 + i + PREFETCH];
                __builtin_prefetch(g + next * gdim);
                __builtin_prefetch(g_scale + next);
                __builtin_prefetch(g_norm + next);
                __builtin_prefetch(x_norm + next);
                __builtin_prefetch(bias_of + next);
            }
            qs[i] = q_scale[r[i]], gs[i] = g_scale[a[i]];
            lam[i] = 0.0f, most[i] = -INFINITY;
            if (gdim) {
                load_row(g + a[i] * gdim, gdim, chunks, &ad);
                products(wq + r[i] * n_exp * gdim, &ad, n_exp, gdim, chunks, ints);
                for (int64_t e = 0; e < n_exp; e++) weight[e * BOUNDS_CHUNK + i] = (float)ints[e];
            }
        }
        for (int64_t e = 0; e < n_exp; e++) { /* the logits */
            const float *prior = p_t + e * n_req;
            float *l = weight + e * BOUNDS_CHUNK;
            for (int64_t i = 0; i < count; i++) {
                float li = prior[r[i]];
                if (gdim) {
                    const float gate = (l[i] * qs[i]) * gs[i];
                    lam[i] = max_f(lam[i], fabsf(gate));
                    li = gate + li;
                }
                l[i] = li;
                most[i] = max_f(most[i], li);
            }
        }
        for (int64_t i = 0; i < count; i++) {
            if ((double)lam[i] + shift_base >= 80.0)
                for (int64_t e = 0; e < n_exp; e++) weight[e * BOUNDS_CHUNK + i] -= most[i];
            const float *c = coef + 3 * r[i];
            float eta = c[1] + c[0] * g_norm[a[i]];
            eta = eta + lam[i] * eta_l;
            em[i] = eta * 2.0f;
            top[i] = -INFINITY, bottom[i] = INFINITY, den[i] = num[i] = mag[i] = 0.0f;
            bias[i] = bias_of[a[i]];
            x_part[i] = x_norm[a[i]] * c[2];
        }
        for (int64_t i = 0; i < count; i++) em[i] = expm1_f(em[i]);
        for (int64_t e = 0; e < n_exp; e++) { /* the sums over E in expert order */
            const float *v = aff + e * stride + s0;
            float *w = weight + e * BOUNDS_CHUNK;
            for (int64_t i = 0; i < count; i++) {
                w[i] = exp_f(w[i]);
                top[i] = max_f(top[i], v[i]);
                bottom[i] = min_f(bottom[i], v[i]);
                den[i] += w[i];
                num[i] += w[i] * v[i];
                mag[i] += w[i] * fabsf(v[i]);
            }
        }
        for (int64_t i = 0; i < count; i++) {
            const float approx = num[i] / den[i] + bias[i];
            const float m = mag[i] / den[i];
            const float reach = max_f(fabsf(top[i]), fabsf(bottom[i]));
            const float rounding = (fabsf(bias[i]) + fabsf(approx)) * kappa;
            float gated = (x_part[i] + m * one_u) * em[i] + x_part[i];
            gated = gated + m * u_2kappa;
            gated = gated + rounding;
            float spread = (top[i] - bottom[i]) * (1.0f + 0x1p-23f) + x_part[i] + rounding;
            spread = spread + reach * u_2kappa;
            /* the smaller of the two, or the other where one is NaN (as fminf) */
            const float least =
                gated != gated ? spread : spread != spread ? gated : min_f(gated, spread);
            const float eps = least * (1.0f + 0x1p-10f);
            lower[i] = approx - eps;
            upper[i] = approx + eps;
        }
        for (int64_t i = 0; i < count; i++) {
            if (!(upper[i] >= tau[r[i]])) continue;
            out_req[kept] = r[i];
            out_row[kept] = a[i];
            out_lower[kept] = lower[i];
            out_upper[kept] = upper[i];
            kept++;
        }
    }
    return kept;
}

/* `step2`, its loops unrolled for the common shape (G = 64, E = 8). */
int64_t m31_step2(const int8_t *g, const float *g_scale, int64_t gdim, const int16_t *wq,
                  const float *q_scale, const float *p_t, int64_t n_req, int64_t n_exp,
                  const float *coef, const float *per_ad, int64_t n_ads, double shift_base,
                  float eta_l, float kappa, float one_u, float u_2kappa, const int64_t *req,
                  const int64_t *row, const float *aff, int64_t stride, int64_t n_pairs,
                  const float *tau, int64_t *out_req, int64_t *out_row, float *out_lower,
                  float *out_upper) {
#define STEP2(G, CHUNKS, E)                                                                        \
    step2(g, g_scale, G, CHUNKS, wq, q_scale, p_t, n_req, E, coef, per_ad, n_ads, shift_base,     \
          eta_l, kappa, one_u, u_2kappa, req, row, aff, stride, n_pairs, tau, out_req, out_row,   \
          out_lower, out_upper)
    if (gdim == 64 && n_exp == 8) return STEP2(64, 64 / CHUNK, 8);
    if (gdim == 64) return STEP2(64, 64 / CHUNK, n_exp);
    return STEP2(gdim, (gdim + CHUNK - 1) / CHUNK, n_exp);
#undef STEP2
}

/* ---- The pass: steps 1-3 over the whole table in compiled code, one call per worker thread,
 * the threads sharing τ (`Threshold`'s counterpart) and the blocks still to scan. ---- */

/* fp32 values written under the lock and read without it */
INLINE float load_f(const float *p) {
    float v;
    __atomic_load(p, &v, __ATOMIC_RELAXED);
    return v;
}
INLINE void store_f(float *p, float v) { __atomic_store(p, &v, __ATOMIC_RELAXED); }

/* τ [B]: per request the K largest lower bounds ℓ offered so far (a min-heap), τ the K-th of
 * them (-inf until there are K); tau_refine and tau_scan lowered by the slack of the two
 * filters as `Threshold` lowers them. */
typedef struct {
    pthread_mutex_t lock;
    int64_t n_req, k, next_span;
    float c_refine, c_scan;
    int64_t *filled; /* [B] */
    float *heap;     /* [B, K] */
    float *tau, *tau_refine, *tau_scan; /* [B] each */
} m31_shared;

void m31_shared_free(m31_shared *sh) {
    if (!sh) return;
    pthread_mutex_destroy(&sh->lock);
    free(sh->filled), free(sh->heap), free(sh->tau);
    free(sh);
}

/* c_refine = slack, c_scan = u'' + slack (`Threshold`). NULL when out of memory. */
m31_shared *m31_shared_new(int64_t n_req, int64_t k, float c_refine, float c_scan) {
    m31_shared *sh = calloc(1, sizeof *sh);
    if (!sh) return NULL;
    if (pthread_mutex_init(&sh->lock, NULL)) {
        free(sh);
        return NULL;
    }
    sh->n_req = n_req, sh->k = k, sh->c_refine = c_refine, sh->c_scan = c_scan;
    sh->filled = calloc((size_t)n_req, sizeof *sh->filled);
    sh->heap = malloc((size_t)(n_req * k) * sizeof *sh->heap);
    sh->tau = malloc((size_t)(3 * n_req) * sizeof *sh->tau);
    if (!sh->filled || !sh->heap || !sh->tau) {
        m31_shared_free(sh);
        return NULL;
    }
    sh->tau_refine = sh->tau + n_req, sh->tau_scan = sh->tau + 2 * n_req;
    for (int64_t r = 0; r < 3 * n_req; r++) sh->tau[r] = -INFINITY;
    return sh;
}

/* tau_refine [B] as it stands (after the workers: the final filter's threshold). */
void m31_shared_tau(m31_shared *sh, float *out) {
    for (int64_t r = 0; r < sh->n_req; r++) out[r] = load_f(sh->tau_refine + r);
}

/* Merge the lower bounds ℓ [n] of pairs of requests req [n], each pair offered once. */
static void offer(m31_shared *sh, const int64_t *req, const float *lower, int64_t n) {
    const int64_t k = sh->k;
    pthread_mutex_lock(&sh->lock);
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = req[i];
        float *h = sh->heap + r * k, v = lower[i];
        int64_t at;
        if (sh->filled[r] < k) { /* sift up from the end */
            at = sh->filled[r]++;
            while (at > 0 && h[(at - 1) / 2] > v) h[at] = h[(at - 1) / 2], at = (at - 1) / 2;
            h[at] = v;
        } else if (v > h[0]) { /* replace the smallest, sift down */
            at = 0;
            for (;;) {
                int64_t child = 2 * at + 1;
                if (child >= k) break;
                if (child + 1 < k && h[child + 1] < h[child]) child++;
                if (!(h[child] < v)) break;
                h[at] = h[child], at = child;
            }
            h[at] = v;
        } else {
            continue;
        }
        if (sh->filled[r] == k) {
            const float t = h[0];
            store_f(sh->tau + r, t);
            store_f(sh->tau_refine + r, t - sh->c_refine * fabsf(t));
            store_f(sh->tau_scan + r, t - sh->c_scan * fabsf(t));
        }
    }
    pthread_mutex_unlock(&sh->lock);
}

/* A worker's candidates (req, row, h), left by `m31_pass` for `m31_cands_take`. */
typedef struct {
    int64_t count, room;
    int64_t *req, *row;
    float *upper;
} m31_cands;

static int cands_room(m31_cands *c, int64_t want) {
    if (want <= c->room) return 0;
    int64_t room = c->room ? c->room : 1024;
    while (room < want) room *= 2;
    int64_t *req = realloc(c->req, (size_t)room * sizeof *req);
    if (req) c->req = req;
    int64_t *row = realloc(c->row, (size_t)room * sizeof *row);
    if (row) c->row = row;
    float *upper = realloc(c->upper, (size_t)room * sizeof *upper);
    if (upper) c->upper = upper;
    if (!req || !row || !upper) return -1;
    c->room = room;
    return 0;
}

void m31_cands_free(m31_cands *c) {
    if (!c) return;
    free(c->req), free(c->row), free(c->upper);
    free(c);
}

/* Copy the candidates out (req, row [count] int64, upper [count] fp32) and free them (or free
 * them alone: `m31_cands_free`). */
void m31_cands_take(m31_cands *c, int64_t *req, int64_t *row, float *upper) {
    memcpy(req, c->req, (size_t)c->count * sizeof *req);
    memcpy(row, c->row, (size_t)c->count * sizeof *row);
    memcpy(upper, c->upper, (size_t)c->count * sizeof *upper);
    m31_cands_free(c);
}

/* Step 3's pruning: drop the candidates whose h fell below tau_refine. */
static void prune(m31_shared *sh, m31_cands *c) {
    int64_t kept = 0;
    for (int64_t i = 0; i < c->count; i++) {
        if (!(c->upper[i] >= load_f(sh->tau_refine + c->req[i]))) continue;
        c->req[kept] = c->req[i], c->row[kept] = c->row[i], c->upper[kept] = c->upper[i];
        kept++;
    }
    c->count = kept;
}

/* The arguments of `m31_pass`, one struct (mirrored by `native.PassArgs`, field by field). */
typedef struct {
    const int64_t *spans;
    int64_t n_spans;
    int64_t block;
    const int8_t *x;
    const float *x_scale;
    int64_t d;
    const int8_t *g;
    const float *g_scale;
    int64_t gdim;
    const float *per_ad;
    const float *scan_bias;
    int64_t n_ads;
    const int16_t *w;
    const float *v_scale;
    const int16_t *wq;
    const float *q_scale;
    const float *p_t;
    const float *coef;
    int64_t n_req;
    int64_t n_exp;
    float alpha;
    double shift_base;
    float eta_l;
    float kappa;
    float one_u;
    float u_2kappa;
    int64_t mask_mode;
    const uint8_t *mask;
    int64_t mask_stride;
    const int64_t *mask_index;
    int64_t refine_pairs;
    int64_t room;
} m31_pass_args;

/* Its size, so that the caller can check its mirror of the struct. */
int64_t m31_pass_args_size(void) { return (int64_t)sizeof(m31_pass_args); }

/* `Worker.scan` .. `finish` for one thread on an 8-bit table (the cpu kernel's steps 1-3):
 * takes the spans [lo, hi) of spans [n_spans, 2] in turn with the other workers of sh; per
 * span, step 1 (`m31_scan_int8`, with offset[a] = scan_bias[a] + x_norm[a]·alpha, as
 * `affinity_offset`); step 2 (`m31_step2`) on the pending survivors once there are
 * refine_pairs of them or after a span shorter than block; the pairs with ℓ above τ offered to
 * sh; those with h >= tau_refine kept as candidates, which are pruned whenever they pass room
 * (then doubled).
 * Arguments as `m31_scan_int8` and `m31_step2` take them (x, x_scale, g, g_scale of the whole
 * table; w = v_int, wq = q_int). Returns the candidates in *out, and their count, or -1 when
 * out of memory. */
int64_t m31_pass(m31_shared *sh, const m31_pass_args *args, m31_cands **out) {
    const int64_t n_req = args->n_req, n_exp = args->n_exp, block = args->block;
    const float *x_norm = args->per_ad + args->n_ads;
    const int64_t cap = args->refine_pairs + n_req * block; /* pending pairs: a block's on top */
    int64_t room = args->room; /* candidates kept before the next prune */
    int64_t *p_req = malloc((size_t)cap * sizeof *p_req);
    int64_t *p_row = malloc((size_t)cap * sizeof *p_row);
    float *p_aff = malloc((size_t)(n_exp * cap) * sizeof *p_aff); /* Â [E, cap] */
    int64_t *k_req = malloc((size_t)cap * sizeof *k_req);
    int64_t *k_row = malloc((size_t)cap * sizeof *k_row);
    float *lower = malloc((size_t)cap * sizeof *lower);
    float *upper = malloc((size_t)cap * sizeof *upper);
    float *offset = malloc((size_t)block * sizeof *offset);
    float *tau = malloc((size_t)n_req * sizeof *tau); /* a snapshot of one of sh's */
    m31_cands *cands = calloc(1, sizeof *cands);
    int64_t result = -1, pending = 0;
    if (!p_req || !p_row || !p_aff || !k_req || !k_row || !lower || !upper || !offset || !tau ||
        !cands)
        goto done;
    for (;;) {
        const int64_t span = __atomic_fetch_add(&sh->next_span, 1, __ATOMIC_RELAXED);
        int64_t lo = 0, n = 0;
        if (span < args->n_spans) lo = args->spans[2 * span], n = args->spans[2 * span + 1] - lo;
        if (n > 0) { /* step 1 */
            const float *bias = args->scan_bias + lo, *norm = x_norm + lo;
            const float alpha = args->alpha; /* a local: a store to offset[] may alias args->alpha */
            for (int64_t a = 0; a < n; a++) offset[a] = bias[a] + norm[a] * alpha;
            for (int64_t r = 0; r < n_req; r++) tau[r] = load_f(sh->tau_scan + r);
            const int64_t mode = args->mask_mode; /* a bool mask from lo, a packed one at offset lo */
            const int64_t found = m31_scan_int8(
                args->x + lo * args->d, args->x_scale + lo, offset, n, args->d, args->w,
                args->v_scale, tau, n_req, n_exp, mode, mode == 1 ? args->mask + lo : args->mask,
                args->mask_stride, args->mask_index, lo, p_req + pending, p_row + pending,
                p_aff + pending, cap);
            for (int64_t s = pending; s < pending + found; s++) p_row[s] += lo;
            pending += found;
        }
        const int last = span >= args->n_spans;
        if (pending && (pending >= args->refine_pairs || n < block || last)) { /* step 2 */
            for (int64_t r = 0; r < n_req; r++) tau[r] = load_f(sh->tau_refine + r);
            const int64_t kept = m31_step2(
                args->g, args->g_scale, args->gdim, args->wq, args->q_scale, args->p_t, n_req,
                n_exp, args->coef, args->per_ad, args->n_ads, args->shift_base, args->eta_l,
                args->kappa, args->one_u, args->u_2kappa, p_req, p_row, p_aff, cap, pending, tau,
                k_req, k_row, lower, upper);
            pending = 0;
            /* the pairs whose ℓ passes τ raise it (p_req, lower reused for them) */
            int64_t promoted = 0;
            for (int64_t s = 0; s < kept; s++) {
                if (!(lower[s] > load_f(sh->tau + k_req[s]))) continue;
                p_req[promoted] = k_req[s], lower[promoted] = lower[s];
                promoted++;
            }
            if (promoted) offer(sh, p_req, lower, promoted);
            if (cands_room(cands, cands->count + kept)) goto done;
            memcpy(cands->req + cands->count, k_req, (size_t)kept * sizeof *k_req);
            memcpy(cands->row + cands->count, k_row, (size_t)kept * sizeof *k_row);
            memcpy(cands->upper + cands->count, upper, (size_t)kept * sizeof *upper);
            cands->count += kept;
            if (cands->count > room) {
                prune(sh, cands);
                room = room > 2 * cands->count ? room : 2 * cands->count;
            }
        }
        if (last) break;
    }
    prune(sh, cands);
    result = cands->count;
    *out = cands;
    cands = NULL;
done:
    free(p_req), free(p_row), free(p_aff), free(k_req), free(k_row), free(lower), free(upper);
    free(offset), free(tau);
    m31_cands_free(cands);
    return result;
}
