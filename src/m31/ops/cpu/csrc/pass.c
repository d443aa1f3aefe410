/* The pass: steps 1-3 over the whole table in compiled code, one call per worker thread, the
 * threads sharing τ (`Threshold`'s counterpart) and the blocks still to scan (native.h). */
#include "native.h"

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
