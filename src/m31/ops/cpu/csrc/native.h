/* The per-block steps of the cpu kernel on an 8-bit table, fused: step 1 in scan.c, step 2 in
 * step2.c, the pass over the table in pass.c, and here what they share (m31.ops.cpu.native
 * compiles the three into one library and loads it).
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
#ifndef M31_NATIVE_H
#define M31_NATIVE_H
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

/* Steps 1 and 2, which `m31_pass` calls (scan.c and step2.c say what they compute). */
int64_t m31_scan_int8(const int8_t *x, const float *x_scale, const float *offset, int64_t n,
                      int64_t d, const int16_t *w, const float *v_scale, const float *tau,
                      int64_t n_req, int64_t n_exp, int64_t mask_mode, const uint8_t *mask,
                      int64_t mask_stride, const int64_t *mask_index, int64_t mask_offset,
                      int64_t *out_req, int64_t *out_ad, float *out_aff, int64_t cap);
int64_t m31_step2(const int8_t *g, const float *g_scale, int64_t gdim, const int16_t *wq,
                  const float *q_scale, const float *p_t, int64_t n_req, int64_t n_exp,
                  const float *coef, const float *per_ad, int64_t n_ads, double shift_base,
                  float eta_l, float kappa, float one_u, float u_2kappa, const int64_t *req,
                  const int64_t *row, const float *aff, int64_t stride, int64_t n_pairs,
                  const float *tau, int64_t *out_req, int64_t *out_row, float *out_lower,
                  float *out_upper);
#endif
