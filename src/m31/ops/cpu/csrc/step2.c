/* Step 2 of the cpu kernel on an 8-bit table (`m31_step2`): the gate logits of step 1's
 * survivors and their bounds ℓ, h, with exponentials of its own (native.h). */
#include "native.h"

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
