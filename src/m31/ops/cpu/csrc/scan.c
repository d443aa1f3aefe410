/* Step 1 of the cpu kernel on an 8-bit table (`m31_scan_int8`): per eligible pair the
 * products and the bound, and the pairs that pass τ, bit for bit the torch path's (native.h). */
#include "native.h"

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
