"""The Triton kernel bodies of the fused score·gate·filter·top-K pass (DESIGN §2, §5): one
program per run of BN ads scores them against every request tile and appends the survivors of τ
to each request's candidate buffer.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, C candidate slots per request;
a tile is BB requests × BN ads; EP, GP, DP are E, G, D padded to powers of two (GP, DP ≥ 16 and
BB·EP ≥ 16 because tl.dot needs every dim ≥ 16; padding is masked to zero).

Scores are fp32 evaluations of the §2 formula on the fp32 query and the table as stored, the
contract of every kernel (`score_topk`): each dot product sums the products of the fp32 query
with the table's values in fp32. A bf16 table (and an int8 one, whose values bf16 holds exactly)
takes the tensor cores: the query comes as three bf16 parts, hi + mid + lo = q exactly
(`layout.split3`; 3 × 8 significant bits hold fp32's 24), so each bf16 product is exact and three
products replace one; the B = 1 pass is bound by streaming the table, so they cost little there.
fp16 and fp32 tables are split in registers into 2 or 3 bf16 parts the same way
(`_table_parts`): exact, at 2 or 3 times the products. The gate runs in fp32 with exp2; the
scale log2(e)/√G is applied to the fp32 gate dot product (one FMA with the prior p·log2(e)).
When E = 1 or G = 0 the gate does not depend on the ad; it is folded into one fp32 value vector
per request (`layout.prepare_query`) and each tile is a single [BB, D] × [D, BN] product. Every
(request, ad) score comes from the same instructions wherever the ad sits, so identical ads score
identically and tie in row order.

8-bit tables (`Int8Table`): int8 rows convert to bf16 in registers (exact), and the per-row
scales multiply the fp32 dot products, so the kernel scores the dequantized table.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Dot operands of bf16 tables are bf16. Triton 3.6's interpreter multiplies bf16 bit patterns
# as integers in tl.dot, so there they are fp32, which holds every bf16 value exactly: the same
# products.
DOT_TYPE = tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16


@triton.jit
def _table_parts(t, TP: tl.constexpr, DOT: tl.constexpr):
    """An ad tile t [K, BN] as stored, as TP bf16 tiles (in DOT) that add up to it exactly: 1 for
    bf16 and int8 rows, 2 for fp16 (11 significant bits), 3 for fp32 (24). Unused parts repeat
    the first and are never read."""
    if TP == 1:
        hi = t.to(DOT)  # straight from int8 too (exact), without a bf16 step
        mid = hi
        lo = hi
    else:
        hi = t.to(tl.bfloat16)
        rest = t.to(tl.float32) - hi.to(tl.float32)  # exact: the bits of t below hi's
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # exact: at most 8 bits are left
        hi, mid, lo = hi.to(DOT), mid.to(DOT), lo.to(DOT)
    return hi, mid, lo


@triton.jit
def _query_dot(ptrs, mask, part, t0, t1, t2, TP: tl.constexpr, DOT: tl.constexpr):
    """[M, BN] fp32: the fp32 query tile at ptrs [M, K] times the ad tile t0 + t1 + t2 [K, BN]
    (its TP bf16 parts, `_table_parts`).

    The query is stored as three bf16 parts `part` elements apart, hi + mid + lo = q exactly
    (`layout.split3`), so every part-by-part product is exact and the fp32 accumulator sums the
    products of the fp32 query with the table's values. A query part is loaded just before its
    products: splitting an fp32 tile here kept more registers live and spilled at B = 64.
    """
    acc = tl.zeros((ptrs.shape[0], t0.shape[1]), dtype=tl.float32)
    for i in tl.static_range(3):
        a = tl.load(ptrs + i * part, mask=mask, other=0.0).to(DOT)
        acc = tl.dot(a, t0, acc)
        if TP > 1:
            acc = tl.dot(a, t1, acc)
        if TP > 2:
            acc = tl.dot(a, t2, acc)
    return acc


@triton.jit
def _stacked_scores(
    q_ptr,
    v_ptr,
    p_ptr,
    req0,
    n_req,
    gate_dim,
    value_dim,
    g0,
    g1,
    g2,
    x0,
    x1,
    x2,
    gate_col,
    BB: tl.constexpr,
    E: tl.constexpr,
    EP: tl.constexpr,
    GP: tl.constexpr,
    DP: tl.constexpr,
    BN: tl.constexpr,
    TP: tl.constexpr,
    DOT: tl.constexpr,
):
    """[BB, BN] scores (before scale and bias): every expert of BB requests in one product."""
    m = tl.arange(0, BB * EP)  # stacked row m is expert m % EP of request req0 + m // EP
    req = req0 + m // EP
    exp_ok = (m % EP) < E
    ok = (req < n_req) & exp_ok
    qrow = req.to(tl.int64) * E + m % EP  # row in the [B·E, ·] query
    gc = tl.arange(0, GP)
    dc = tl.arange(0, DP)
    q_mask = ok[:, None] & (gc[None, :] < gate_dim)
    v_mask = ok[:, None] & (dc[None, :] < value_dim)
    q_ptrs = q_ptr + qrow[:, None] * gate_dim + gc[None, :]  # [BB·EP, GP]
    v_ptrs = v_ptr + qrow[:, None] * value_dim + dc[None, :]  # [BB·EP, DP]
    prior = tl.load(p_ptr + qrow, mask=ok, other=0.0)
    prior = tl.where(exp_ok, prior, float("-inf"))  # padded experts get zero weight
    logit = _query_dot(q_ptrs, q_mask, n_req * E * gate_dim, g0, g1, g2, TP, DOT)  # [BB·EP, BN]
    logit = logit * gate_col[None, :] + prior[:, None]  # log2 units
    logit = tl.reshape(logit, (BB, EP, BN))
    w = tl.exp2(logit - tl.max(logit, axis=1)[:, None, :])  # [BB, EP, BN]
    aff = _query_dot(v_ptrs, v_mask, n_req * E * value_dim, x0, x1, x2, TP, DOT)  # [BB·EP, BN]
    aff = tl.reshape(aff, (BB, EP, BN))
    return tl.sum(w * aff, axis=1) / tl.sum(w, axis=1)


@triton.jit
def _online_scores(
    q_ptr,
    v_ptr,
    p_ptr,
    req,
    req_ok,
    n_req,
    gate_dim,
    value_dim,
    g0,
    g1,
    g2,
    x0,
    x1,
    x2,
    gate_col,
    E: tl.constexpr,
    GP: tl.constexpr,
    DP: tl.constexpr,
    TP: tl.constexpr,
    DOT: tl.constexpr,
):
    """[BB, BN] scores (before scale and bias): experts one at a time, online softmax."""
    gc = tl.arange(0, GP)
    dc = tl.arange(0, DP)
    qrow = req.to(tl.int64) * E  # row of expert 0 in the [B·E, ·] query
    q_ptrs = q_ptr + qrow[:, None] * gate_dim + gc[None, :]  # [BB, GP]
    v_ptrs = v_ptr + qrow[:, None] * value_dim + dc[None, :]  # [BB, DP]
    q_mask = req_ok[:, None] & (gc[None, :] < gate_dim)
    v_mask = req_ok[:, None] & (dc[None, :] < value_dim)
    # expert 0 seeds the running max `top`, the weight sum `den` and the weighted affinity `num`
    q_part, v_part = n_req * E * gate_dim, n_req * E * value_dim  # elements between parts
    p_e = tl.load(p_ptr + qrow, mask=req_ok, other=0.0)
    top = _query_dot(q_ptrs, q_mask, q_part, g0, g1, g2, TP, DOT)  # [BB, BN]
    top = top * gate_col[None, :] + p_e[:, None]  # log2 units
    num = _query_dot(v_ptrs, v_mask, v_part, x0, x1, x2, TP, DOT)  # [BB, BN]
    den = tl.zeros_like(num) + 1.0
    for e in range(1, E):
        p_e = tl.load(p_ptr + qrow + e, mask=req_ok, other=0.0)
        logit = _query_dot(q_ptrs + e * gate_dim, q_mask, q_part, g0, g1, g2, TP, DOT)
        logit = logit * gate_col[None, :] + p_e[:, None]
        aff = _query_dot(v_ptrs + e * value_dim, v_mask, v_part, x0, x1, x2, TP, DOT)
        # One exponential per expert instead of two: whichever of (running max, new logit) is
        # smaller is the one rescaled by 2^-|difference|; the larger enters with weight 1.
        t = tl.exp2(-tl.abs(logit - top))
        up = logit > top
        num = tl.where(up, num * t + aff, num + t * aff)
        den = tl.where(up, den * t + 1.0, den + t)
        top = tl.maximum(top, logit)
    return num / den


@triton.jit
def score_topk_kernel(
    q_ptr,  # [3, B·E, G] bf16: the query's gate keys in three parts (`layout.split3`)
    v_ptr,  # [3, B·E, D] bf16: its values in three parts
    p_ptr,  # [B·E] fp32: p·log2(e)
    g_ptr,  # [N, G] ad rows, as stored
    x_ptr,  # [N, D] ad rows, as stored
    b_ptr,  # [N] fp32
    g_scale_ptr,  # [N] fp32, read only when QUANT
    x_scale_ptr,  # [N] fp32, read only when QUANT
    value_ptr,  # [N] fp32 value column, read only when HAS_VALUE
    bits_ptr,  # int32 mask words: [W] (MASK_MODE 1) or [B, W] (2)
    tau_ptr,  # [B] fp32 thresholds
    count_ptr,  # [B] int32 survivor counts
    cand_score_ptr,  # [B, C] fp32 candidate scores
    cand_row_ptr,  # [B, C] int32 candidate rows
    n_req,
    n_ads,
    gate_dim,
    value_dim,
    stride_g,
    stride_x,
    stride_bits,
    capacity,
    gate_scale,  # log2(e) / √G
    BB: tl.constexpr,
    BN: tl.constexpr,
    E: tl.constexpr,
    EP: tl.constexpr,
    GP: tl.constexpr,
    DP: tl.constexpr,
    HAS_GATE: tl.constexpr,
    STACKED: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_VALUE: tl.constexpr,
    MASK_MODE: tl.constexpr,  # 0: no mask, 1: one [N] mask, 2: a [B, N] mask
    TP: tl.constexpr,  # bf16 parts per table value: 1 (bf16, int8 rows), 2 (fp16), 3 (fp32)
    DOT: tl.constexpr,  # dot operand type: bf16 (fp32 under the interpreter, see DOT_TYPE)
):
    # 64-bit rows: N·stride passes 2^31 long before N does
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)  # [BN]
    row_ok = rows < n_ads
    # the ad tile: loaded once, transposed to [dim, BN], reused by every request tile
    dc = tl.arange(0, DP)
    x_mask = (dc[:, None] < value_dim) & row_ok[None, :]
    x_t = tl.load(x_ptr + rows[None, :] * stride_x + dc[:, None], mask=x_mask, other=0)
    x0, x1, x2 = _table_parts(x_t, TP, DOT)  # [DP, BN] each; exact for int8
    bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0)  # [BN]
    if HAS_VALUE:  # `value_bias`: one fp32 addition, as every kernel makes it
        bias = bias + tl.load(value_ptr + rows, mask=row_ok, other=0.0)
    if QUANT:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)  # [BN]
    if HAS_GATE:
        gc = tl.arange(0, GP)
        g_mask = (gc[:, None] < gate_dim) & row_ok[None, :]
        g_t = tl.load(g_ptr + rows[None, :] * stride_g + gc[:, None], mask=g_mask, other=0)
        g0, g1, g2 = _table_parts(g_t, TP, DOT)  # [GP, BN] each
        if QUANT:
            gate_col = tl.load(g_scale_ptr + rows, mask=row_ok, other=0.0) * gate_scale
        else:
            gate_col = tl.zeros((BN,), tl.float32) + gate_scale
    word = rows >> 5  # eligibility of ad a is bit a % 32 of int32 word a // 32
    bit = (rows & 31).to(tl.int32)
    if MASK_MODE == 1:
        words = tl.load(bits_ptr + word, mask=row_ok, other=0)
        shared_ok = ((words >> bit) & 1) != 0  # [BN]

    # a while loop, not range(0, n_req, BB): Triton 3.6's interpreter fails on a runtime range
    # bound under numpy >= 2.4 (triton-lang/triton#9171); both compile to the same loop
    req0 = 0
    while req0 < n_req:
        req = req0 + tl.arange(0, BB)  # [BB]
        req_ok = req < n_req
        if HAS_GATE:
            if STACKED:
                s = _stacked_scores(
                    q_ptr,
                    v_ptr,
                    p_ptr,
                    req0,
                    n_req,
                    gate_dim,
                    value_dim,
                    g0,
                    g1,
                    g2,
                    x0,
                    x1,
                    x2,
                    gate_col,
                    BB,
                    E,
                    EP,
                    GP,
                    DP,
                    BN,
                    TP,
                    DOT,
                )
            else:
                s = _online_scores(
                    q_ptr,
                    v_ptr,
                    p_ptr,
                    req,
                    req_ok,
                    n_req,
                    gate_dim,
                    value_dim,
                    g0,
                    g1,
                    g2,
                    x0,
                    x1,
                    x2,
                    gate_col,
                    E,
                    GP,
                    DP,
                    TP,
                    DOT,
                )
        else:
            v_ptrs = v_ptr + req.to(tl.int64)[:, None] * value_dim + dc[None, :]
            v_mask = req_ok[:, None] & (dc[None, :] < value_dim)
            s = _query_dot(v_ptrs, v_mask, n_req * value_dim, x0, x1, x2, TP, DOT)  # [BB, BN]
        if QUANT:
            s = s * x_scale[None, :]
        s = s + bias[None, :]

        if MASK_MODE == 0:
            eligible = req_ok[:, None] & row_ok[None, :]
        elif MASK_MODE == 1:
            eligible = req_ok[:, None] & shared_ok[None, :]
        else:
            word_ptrs = bits_ptr + req.to(tl.int64)[:, None] * stride_bits + word[None, :]
            words = tl.load(word_ptrs, mask=req_ok[:, None] & row_ok[None, :], other=0)
            eligible = ((words >> bit[None, :]) & 1) != 0
        tau = tl.load(tau_ptr + req, mask=req_ok, other=float("inf"))
        keep = eligible & (s >= tau[:, None])  # [BB, BN]

        # append the survivors: one atomic per request reserves a run of slots, and each
        # survivor's slot in it is the number of survivors before it in its row of the tile
        keep_i = keep.to(tl.int32)
        n_keep = tl.sum(keep_i, axis=1)  # [BB]
        base = tl.atomic_add(count_ptr + req, n_keep, mask=req_ok & (n_keep > 0), sem="relaxed")
        slot = base[:, None] + tl.cumsum(keep_i, axis=1) - keep_i  # [BB, BN]
        store = keep & (slot < capacity)  # the count goes on past C: a retry needs it
        offs = req.to(tl.int64)[:, None] * capacity + slot
        tl.store(cand_score_ptr + offs, s, mask=store)
        row_ids = tl.broadcast_to(rows.to(tl.int32)[None, :], (BB, BN))
        tl.store(cand_row_ptr + offs, row_ids, mask=store)
        req0 += BB
