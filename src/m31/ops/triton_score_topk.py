"""Fused score·gate·filter·top-K in Triton (DESIGN §2, §5, §6): one pass over the ad table per
batch of requests; no B×N score matrix ever reaches memory.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, C candidate slots
per request; a tile is BB requests × BN ads; EP, GP, DP are E, G, D padded to powers of two
(GP, DP ≥ 16 and BB·EP ≥ 16 because tl.dot needs every dim ≥ 16; padding is masked to zero).

Exact top-K by threshold (DESIGN §5):
1. Seed. A fixed-seed uniform sample of the table (`_SAMPLE_ROWS` ads, not a strided one, which
   aliases with periodic eligibility such as "every other ad") is scored with the fp32 reference.
   τ[r] is the j-th best eligible sample score, j chosen so that about `_TARGET_PER_K`·K ads of
   the table pass, and j ≥ `_MIN_SAMPLE_RANK` so that the survivor count is a stable estimate.
2. Scan. The kernel streams the table once; every eligible (request, ad) score ≥ τ[r] is appended
   to the request's candidate buffer [B, C] through an atomic counter, which keeps counting past
   C, so it ends as the exact number of survivors.
3. Sort. Each buffer is sorted by (score desc, row asc): ties go to the lower row.
4. Check. A request with fewer survivors than min(K, its eligible ads) (τ too high) is scanned
   again with a lower τ (a sample rank `_LOWER_FACTOR` times deeper, at last -inf, where every
   eligible ad survives but those scoring NaN); one whose survivors overflowed C again with
   C = its exact count. All ads scoring ≥ τ are in the buffer, so the result is the exact top-K
   of the kernel's scores, ties included.

Scores are fp32 evaluations of the §2 formula on the fp32 query and the table as stored, the
contract of every kernel (`score_topk`): each dot product sums the products of the fp32 query
with the table's values in fp32. A bf16 table (and an int8 one, whose values bf16 holds exactly)
takes the tensor cores: the query is split into three bf16 parts, hi + mid + lo = q exactly
(3 × 8 significant bits hold fp32's 24), so each bf16 product is exact and three products
replace one; the B = 1 pass is bound by streaming the table, so they cost little there. fp16
and fp32 tables are read as stored and multiplied in fp32 (`input_precision="ieee"`): exact,
on the CUDA cores. The gate runs in fp32 with exp2; the scale log2(e)/√G is applied to the fp32
gate dot product (one FMA with the prior p·log2(e)). When E = 1 or G = 0 the gate does not
depend on the ad; it is folded into one fp32 value vector per request (Σ_e softmax(p)_e v_e)
and each tile is a single [BB, D] × [D, BN] product. The answer equals the reference's up to
fp32 near-ties (scores a few ulps apart may swap). Every (request, ad) score comes from the same
instructions wherever the ad sits, so identical ads score identically and tie in row order.

8-bit tables (`Int8Table`): int8 rows convert to bf16 in registers (exact), and the per-row
scales multiply the fp32 dot products, so the kernel scores the dequantized table.

Tiles by batch size (`_pick_tiles`), 8 warps. DESIGN §6 measured the two gate layouts on an
H200 as sketches; the sizes here are the largest that ptxas (Triton 3.6, sm_90a, `ptxas -v`)
compiles without register spills at G = D = 64 for a bf16 table with the query in three parts,
and are not yet timed on a GPU:
* gate folded away (E = 1 or G = 0): BB = B rounded up to a power of two in [16, 64], BN = 128
  (64 at BB = 64).
* B·EP ≤ 64 after rounding B up to a power of two ("stacked"): all experts of the BB requests as
  one [BB·EP, ·] product, softmax by reshaping to [BB, EP, BN]; BN = 128. Small batches are
  bound by streaming the table, and this layout reached 90% of the memory limit at B = 1
  (BB = 2, E = 8).
* larger batches ("online"): experts walked one at a time with an online softmax (as flash
  attention walks keys), every product a plain [BB, BN] tile; BB = 32, BN = 64. The sketch ran
  fastest at BB = 64, BN = 128 (84 G pairs/s at B = 64 and 512), but with the candidate append,
  the ad tile kept across request tiles and three products per dot, BB = 64 spills.
fp16, fp32 and int8 tables hold more registers (their parts, the int8 scales): at 64 stacked
rows BN halves per extra part (and for int8), and an fp32 table halves the online BB.
Each program owns one BN-run of ads, loads it once and loops over all request tiles, so the
table is read once per batch; the ad axis is grid axis 0 (axes 1 and 2 stop at 65,535).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table, checked_int8_table
from m31.ops.torch_score import score, value_bias
from m31.ops.torch_score_topk import NO_ROW, check_args, torch_score_topk

_LOG2E = 1.4426950408889634
_MAX_DIM = 256  # largest G or D: one program holds a [256, BN] tile of each in registers
_SAMPLE_ROWS = 32_768  # ads scored by the reference to seed τ
_TARGET_PER_K = 3  # survivors aimed at: about 3·K of the table (DESIGN §5 suggests 2–4)
# τ never sits above the 32nd best sample score: the survivor count then has a relative spread
# of about 1/√32 ≈ 18%, so a buffer of twice the estimate overflows about once in 10^6 requests.
_MIN_SAMPLE_RANK = 32
_CAPACITY_FACTOR = 2
_LOWER_FACTOR = 8  # a τ that let fewer than K through moves to an 8× deeper sample rank
_SAMPLE_CHUNK = 1 << 24  # elements of one [B, S, E] reference intermediate while seeding
# Dot operands of bf16 tables are bf16. Triton 3.6's interpreter multiplies bf16 bit patterns
# as integers in tl.dot, so there they are fp32, which holds every bf16 value exactly: the same
# products.
_DOT_TYPE = tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16
# bf16 parts per table value (`_table_parts`), by the dtype the kernel reads; others go to fp32
_TABLE_PARTS = {torch.bfloat16: 1, torch.int8: 1, torch.float16: 2, torch.float32: 3}


# fmt: off
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
    (`_split3`), so every part-by-part product is exact and the fp32 accumulator sums the
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
    q_ptr, v_ptr, p_ptr, req0, n_req, gate_dim, value_dim, g0, g1, g2, x0, x1, x2, gate_col,
    BB: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
    BN: tl.constexpr, TP: tl.constexpr, DOT: tl.constexpr,
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
    q_ptr, v_ptr, p_ptr, req, req_ok, n_req, gate_dim, value_dim, g0, g1, g2, x0, x1, x2,
    gate_col, E: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, TP: tl.constexpr,
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
def _score_topk_kernel(
    q_ptr, v_ptr, p_ptr,  # query [3, B·E, G] and [3, B·E, D] bf16 parts, [B·E] fp32 p·log2(e)
    g_ptr, x_ptr, b_ptr, g_scale_ptr, x_scale_ptr,  # ad rows; the scales only when QUANT
    value_ptr,  # [N] fp32 value column, read only when HAS_VALUE
    bits_ptr, tau_ptr, count_ptr, cand_score_ptr, cand_row_ptr,  # [(B,) W], [B], [B], [B, C] x2
    n_req, n_ads, gate_dim, value_dim, stride_g, stride_x, stride_bits, capacity,
    gate_scale,  # log2(e) / √G
    BB: tl.constexpr, BN: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, GP: tl.constexpr,
    DP: tl.constexpr, HAS_GATE: tl.constexpr, STACKED: tl.constexpr, QUANT: tl.constexpr,
    HAS_VALUE: tl.constexpr,
    MASK_MODE: tl.constexpr,  # 0: no mask, 1: one [N] mask, 2: a [B, N] mask
    TP: tl.constexpr,  # bf16 parts per table value: 1 (bf16, int8 rows), 2 (fp16), 3 (fp32)
    DOT: tl.constexpr,  # dot operand type: bf16 (fp32 under the interpreter, see _DOT_TYPE)
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
                    q_ptr, v_ptr, p_ptr, req0, n_req, gate_dim, value_dim, g0, g1, g2, x0, x1,
                    x2, gate_col, BB, E, EP, GP, DP, BN, TP, DOT,
                )
            else:
                s = _online_scores(
                    q_ptr, v_ptr, p_ptr, req, req_ok, n_req, gate_dim, value_dim, g0, g1, g2,
                    x0, x1, x2, gate_col, E, GP, DP, TP, DOT,
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
# fmt: on


class _Tiles(NamedTuple):
    bb: int
    bn: int
    stacked: bool


_NUM_WARPS = 8  # with 4, ptxas (sm_90) spills registers in most of the layouts below


def _pick_tiles(
    n_req: int, n_exp_padded: int, dim_padded: int, has_gate: bool, extra: int = 0
) -> _Tiles:
    """Tile shape by batch size (the reasons are in the module docstring). Past a padded G or D
    of 64 the tiles shrink with it, as larger ones spill registers on sm_90; so do they with
    `extra`, the table's extra register weight: one per bf16 part past the first (`_Table`) and
    one for int8 scales. Every layout at G = D = 64 compiles without spills (ptxas -v, sm_90a)."""
    bb = triton.next_power_of_2(n_req)
    shrink = max(1, dim_padded // 64)
    bn = max(16, 128 // shrink)
    if not has_gate:
        bb = min(64, max(16, bb))
        return _Tiles(bb, bn if bb < 64 else max(16, bn // 2), False)
    if bb * n_exp_padded <= 64:  # BB·EP ≥ 16 rows for tl.dot
        bb = max(bb, 16 // n_exp_padded)
        return _Tiles(bb, bn if bb * n_exp_padded < 64 else max(16, bn >> extra), True)
    return _Tiles(max(16, min(32, bb) // shrink >> max(0, extra - 1)), 64, False)


class _Query(NamedTuple):
    """The query as the kernel reads it; with the gate folded away, E = 1 and q, p are unused."""

    q: torch.Tensor  # [3, B, E, G] bf16 parts (`_split3`)
    v: torch.Tensor  # [3, B, E, D] bf16 parts
    p: torch.Tensor  # [B, E] fp32, times log2(e)
    has_gate: bool

    def take(self, idx: torch.Tensor) -> _Query:
        q, v = (t[:, idx].contiguous() for t in (self.q, self.v))
        return _Query(q, v, self.p[idx], self.has_gate)


class _Table(NamedTuple):
    """The ad table as the kernel reads it: rows with unit column stride, bf16 or int8 (tensor-core
    dots) or fp16, fp32 (fp32 dots)."""

    g: torch.Tensor  # [N, G] (unused without the gate)
    x: torch.Tensor  # [N, D]
    b: torch.Tensor  # [N] fp32
    g_scale: torch.Tensor | None  # [N] fp32 for int8 tables
    x_scale: torch.Tensor | None  # [N] fp32 for int8 tables
    value: torch.Tensor | None = None  # [N] fp32 value column (`value_bias`)

    @property
    def parts(self) -> int:
        """bf16 parts that hold each table value exactly (`_table_parts`)."""
        return max(_TABLE_PARTS[t.dtype] for t in (self.g, self.x))


def _split3(t: torch.Tensor) -> torch.Tensor:
    """[3, ...] bf16: hi, mid, lo with hi + mid + lo = t (fp32) exactly. Each part holds the next
    8 significant bits of what the previous ones left (exact fp32 differences), and fp32 has 24."""
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


def _prepare_query(q: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> _Query:
    n_exp, gate_dim = q.shape[1], q.shape[2]
    if gate_dim == 0 or n_exp == 1:  # the gate is softmax(p) for every ad: fold it into v
        w = torch.softmax(p.float(), dim=1)  # [B, E]
        v1 = torch.einsum("be,bed->bd", w, v.float())[:, None, :]  # [B, 1, D]
        n_req = v1.shape[0]
        unused_q = v1.new_zeros(3, n_req, 1, 0, dtype=torch.bfloat16)
        return _Query(unused_q, _split3(v1), v1.new_zeros(n_req, 1), False)
    return _Query(_split3(q.float()), _split3(v.float()), (p.float() * _LOG2E).contiguous(), True)


def _rows_unit_stride(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t [N, ·] with unit column stride, in `dtype`; by default as stored (fp64 goes to fp32)."""
    if dtype is None:
        dtype = t.dtype if t.dtype in _TABLE_PARTS else torch.float32
    t = t.to(dtype)
    return t if t.shape[1] == 0 or t.stride(1) == 1 else t.contiguous()


def _pack_mask(mask: torch.Tensor | PackedMask) -> torch.Tensor:
    """bool [..., N] -> int32 [..., ceil(N / 32)]: bit j of word w is ad 32·w + j.

    A `PackedMask` already has that layout, byte by byte (`m31.ops.masks`): its bitmaps are read
    as little-endian int32 words, [W32] when one bitmap serves every request, else gathered per
    request into [B, W32] (N / 32 words a request, where the bool mask would take N bytes)."""
    if isinstance(mask, PackedMask):
        width = 4 * -(-mask.n // 32)  # bytes of whole words
        bits = mask.bits
        if bits.shape[1] != width or bits.stride() != (width, 1):  # (bits past N are unread)
            take = min(width, bits.shape[1])
            bits = bits.new_zeros(len(bits), width)
            bits[:, :take] = mask.bits[:, :take]
        words = bits.view(torch.int32)  # [U, W32]
        return words[0] if len(words) == 1 else words.index_select(0, mask.index)
    n_ads = mask.shape[-1]
    n_words = -(-n_ads // 32)
    bits = torch.zeros(*mask.shape[:-1], n_words * 32, dtype=torch.bool, device=mask.device)
    bits[..., :n_ads] = mask
    bits = bits.view(*mask.shape[:-1], n_words, 32)
    weight = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(
        32, device=mask.device
    )
    words = torch.empty(*mask.shape[:-1], n_words, dtype=torch.int32, device=mask.device)
    step = max(1, _SAMPLE_CHUNK // (32 * max(1, math.prod(mask.shape[:-1]))))
    for lo in range(0, n_words, step):  # chunks keep the int64 intermediate small
        w = (bits[..., lo : lo + step, :].long() * weight).sum(-1)  # [..., step] in [0, 2^32)
        words[..., lo : lo + step] = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return words


class _Seed(NamedTuple):
    """What the sample says about each request, to place and later lower τ."""

    sample: torch.Tensor  # [B, S] eligible sample scores, descending, -inf after the eligible
    n_sample: torch.Tensor  # [B] eligible ads in the sample
    n_eligible: torch.Tensor  # [B] eligible ads in the table


def _seed(q, v, p, fp32_rows, n_ads, mask, sample_rows) -> _Seed:
    """Score a fixed-seed uniform sample of the table with the fp32 reference."""
    n_req, n_exp = p.shape
    device = q.device
    if n_ads <= sample_rows:
        idx = torch.arange(n_ads, device=device)
    else:
        gen = torch.Generator(device=device).manual_seed(0)
        idx = torch.randint(n_ads, (sample_rows,), generator=gen, device=device).sort().values
    g_s, x_s, b_s = fp32_rows(idx)
    if mask is None:
        n_eligible = torch.full((n_req,), n_ads, device=device)
    elif isinstance(mask, PackedMask):
        n_eligible = mask.counts()
    else:
        n_eligible = mask.sum(-1).expand(n_req)
    step = max(1, _SAMPLE_CHUNK // (len(idx) * n_exp))
    sample = []
    for lo in range(0, n_req, step):
        s = score(q[lo : lo + step], v[lo : lo + step], p[lo : lo + step], g_s, x_s, b_s)
        dropped = s.isnan()  # [b, S] never returned (`score_topk`), so never a threshold
        if isinstance(mask, PackedMask):  # the sample's bits, of each distinct bitmap once
            held = (mask.bits[:, idx // 8] >> (idx % 8).to(torch.uint8)) & 1  # [U, S]
            dropped |= held.index_select(0, mask.index[lo : lo + step]) == 0
        elif mask is not None:
            dropped |= ~(mask[idx] if mask.dim() == 1 else mask[lo : lo + step, idx])
        s = s.masked_fill(dropped, float("-inf"))
        sample.append(torch.sort(s, dim=1, descending=True).values)
    sample = torch.cat(sample)  # [B, S]
    n_sample = (sample > float("-inf")).sum(1)
    return _Seed(sample, n_sample, n_eligible)


def _threshold(seed: _Seed, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(τ [B], estimated survivors [B]) at the given sample rank (1 = the best sample score)."""
    placed = rank <= seed.n_sample
    at = (rank.clamp(max=seed.sample.shape[1]) - 1).clamp(min=0)
    tau = torch.where(placed, seed.sample.gather(1, at[:, None])[:, 0], float("-inf"))
    estimate = rank * seed.n_eligible / seed.n_sample.clamp(min=1)
    return tau, torch.where(placed, estimate, seed.n_eligible.float())


def _capacity(estimate: torch.Tensor, n_eligible: torch.Tensor) -> int:
    """Candidate slots per request: twice the largest estimate, never more than can survive."""
    cap = torch.minimum((_CAPACITY_FACTOR * estimate).ceil(), n_eligible.float())
    return max(1, int(cap.max()))


def _scan(query: _Query, table: _Table, bits, tau, capacity: int):
    """One kernel pass: (survivor counts [B] int32, scores [B, C] fp32, rows [B, C] int32)."""
    n_req, n_exp, gate_dim = query.q.shape[1:]
    n_ads, value_dim = table.x.shape
    device = table.x.device
    exp_pad = triton.next_power_of_2(n_exp)
    gate_pad = max(16, triton.next_power_of_2(gate_dim))
    value_pad = max(16, triton.next_power_of_2(value_dim))
    quant = table.x_scale is not None
    extra = table.parts - 1 + quant
    tiles = _pick_tiles(n_req, exp_pad, max(gate_pad, value_pad), query.has_gate, extra)
    counts = torch.zeros(n_req, dtype=torch.int32, device=device)
    cand_score = torch.empty(n_req, capacity, dtype=torch.float32, device=device)
    cand_row = torch.empty(n_req, capacity, dtype=torch.int32, device=device)
    mask_mode = 0 if bits is None else (1 if bits.dim() == 1 else 2)
    bits = counts if bits is None else bits  # an unread stand-in pointer when there is no mask
    _score_topk_kernel[(triton.cdiv(n_ads, tiles.bn),)](
        query.q, query.v, query.p,
        table.g, table.x, table.b,
        table.g_scale if quant else table.b, table.x_scale if quant else table.b,
        table.b if table.value is None else table.value,
        bits, tau, counts, cand_score, cand_row,
        n_req, n_ads, gate_dim, value_dim,
        table.g.stride(0), table.x.stride(0), bits.stride(0) if mask_mode == 2 else 0, capacity,
        _LOG2E / math.sqrt(gate_dim) if query.has_gate else 1.0,
        BB=tiles.bb, BN=tiles.bn, E=n_exp, EP=exp_pad,
        GP=gate_pad, DP=value_pad,
        HAS_GATE=query.has_gate, STACKED=tiles.stacked, QUANT=quant,
        HAS_VALUE=table.value is not None, MASK_MODE=mask_mode,
        TP=table.parts, DOT=_DOT_TYPE,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return counts, cand_score, cand_row


def _exact_top(counts, cand_score, cand_row, k_out: int, n_ads: int):
    """Sort each request's survivors by (score desc, row asc) and keep the first k_out."""
    width = int(counts.max()) if counts.numel() else 0
    slot = torch.arange(width, device=counts.device)
    filled = slot[None, :] < counts[:, None].long()  # [b, width]
    s = cand_score[:, :width].masked_fill(~filled, float("-inf"))
    r = cand_row[:, :width].long().masked_fill(~filled, n_ads)  # empty slots sort last
    r, order = torch.sort(r, dim=1)  # row order first, so the stable sort below breaks ties by row
    s, order = torch.sort(s.gather(1, order), dim=1, descending=True, stable=True)
    r = r.gather(1, order)
    if width < k_out:
        s = torch.cat([s, s.new_full((s.shape[0], k_out - width), float("-inf"))], dim=1)
        r = torch.cat([r, r.new_full((r.shape[0], k_out - width), NO_ROW)], dim=1)
    s, r = s[:, :k_out], r[:, :k_out]
    return s, r.masked_fill(s == float("-inf"), NO_ROW)


def _at(value: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else value[idx]


def _check(q, v, p, g, x, b, mask, k, scales=(), value=None) -> None:
    n_ads = check_args(q, v, p, g, x, b, mask, k, value)[2]
    if not all(t.is_floating_point() for t in (q, v, p)):
        raise ValueError(f"query must be floating point, got {q.dtype}, {v.dtype}, {p.dtype}")
    if v.shape[2] < 1 or max(q.shape[2], v.shape[2]) > _MAX_DIM:
        raise ValueError(
            f"need 1 <= D <= {_MAX_DIM} and G <= {_MAX_DIM}, got G = {q.shape[2]}, D = {v.shape[2]}"
        )
    if n_ads >= 2**31:
        raise ValueError(f"ad rows are stored as int32: N must be below 2^31, got {n_ads}")
    masks = (
        [] if mask is None else [mask.bits, mask.index] if isinstance(mask, PackedMask) else [mask]
    )
    devices = {t.device for t in (q, v, p, g, x, b, *scales, *masks)}  # value: on b's
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if devices.pop().type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(
            "the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported)"
        )


def _score_topk(query: _Query, table: _Table, seed: _Seed, mask, k, tau, capacity):
    """The scan-check loop of the module docstring (steps 2–4) over a prepared query and table."""
    n_req, n_ads = query.v.shape[1], table.x.shape[0]
    k_out = min(k, n_ads)
    device = table.x.device
    scores = torch.full((n_req, k_out), float("-inf"), device=device)
    rows = torch.full((n_req, k_out), NO_ROW, dtype=torch.long, device=device)
    bits = None if mask is None else _pack_mask(mask)
    need = seed.n_eligible.clamp(max=k_out)  # [B] results each request must get

    rank = (_TARGET_PER_K * k_out * seed.n_sample / seed.n_eligible.clamp(min=1)).ceil().long()
    rank = rank.clamp(min=_MIN_SAMPLE_RANK)  # [B] the sample rank τ sits at
    threshold, estimate = _threshold(seed, rank)
    if tau is not None:
        threshold = torch.as_tensor(tau, dtype=torch.float32, device=device).expand(n_req).clone()
    cap = _capacity(estimate, seed.n_eligible) if capacity is None else capacity
    pending = torch.arange(n_req, device=device)  # requests still to scan
    while len(pending):
        req_bits = bits if bits is None or bits.dim() == 1 else bits[pending]
        counts, cand_score, cand_row = _scan(
            query.take(pending), table, req_bits, threshold[pending].contiguous(), cap
        )
        too_few = counts < need[pending]  # τ too high
        # at τ = -inf every eligible ad survives but those scoring NaN: nothing more to find
        too_few &= threshold[pending] > float("-inf")
        overflow = counts > cap
        done = ~(too_few | overflow)
        top_s, top_r = _exact_top(counts[done], cand_score[done], cand_row[done], k_out, n_ads)
        scores[pending[done]], rows[pending[done]] = top_s, top_r

        # overflow: the same τ again, with room for the exact count
        room = torch.where(overflow, counts.float(), 0.0)  # [len(pending)]
        # τ too high: a deeper sample rank (τ never rises), -inf once past the sample
        lower = pending[too_few]
        rank[lower] *= _LOWER_FACTOR
        deeper, estimate = _threshold(seed, rank)
        threshold[lower] = torch.minimum(deeper[lower], threshold[lower])
        expected = torch.minimum(_CAPACITY_FACTOR * estimate[lower], seed.n_eligible[lower].float())
        room[too_few] = torch.maximum(room[too_few], expected)
        pending = pending[~done]
        cap = max(1, int(room.max().ceil())) if len(pending) else cap
    return scores, rows


def triton_score_topk(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    _tau: torch.Tensor | float | None = None,
    _capacity: int | None = None,
    _sample_rows: int = _SAMPLE_ROWS,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, K'] fp32, rows [B, K'] int64), K' = min(k, N), best first, exact.

    The contract of `torch_score_topk`: q [B, E, G], v [B, E, D], p [B, E]; g [N, G], x [N, D],
    b [N] (any float dtype; bf16, fp16 and fp32 rows are read as stored, a bf16 table on the
    tensor cores, the others with fp32 products); mask bool [N] or [B, N], a `PackedMask`, or
    None; value None or fp32 [N], added to b as the tile is loaded (`value_bias`). Ties go to
    the lower row; requests with fewer eligible ads end with rows NO_ROW and scores -inf. The private
    arguments exist for tests of the retry paths: `_tau` replaces the seeded thresholds
    (a float or [B]), `_capacity` the first buffer size, `_sample_rows` the sample size.
    """
    _check(q, v, p, g, x, b, mask, k, value=value)
    if not all(t.is_floating_point() for t in (g, x, b)):
        raise ValueError(
            f"ad table must be floating point (an Int8Table goes to triton_score_topk_int8), "
            f"got {g.dtype}, {x.dtype}, {b.dtype}"
        )
    n_req, n_ads = p.shape[0], x.shape[0]
    if n_req == 0 or n_ads == 0:
        return torch_score_topk(q, v, p, g, x, b, mask, k, value=value)  # nothing to launch
    query = _prepare_query(q, v, p)
    x_k = _rows_unit_stride(x)
    g_k = _rows_unit_stride(g) if query.has_gate else x_k  # unread without the gate
    value = None if value is None else value.contiguous()
    table = _Table(g_k, x_k, b.float().contiguous(), None, None, value)

    def fp32_rows(idx):
        return g[idx].float(), x[idx].float(), value_bias(b[idx], _at(value, idx))

    seed = _seed(q, v, p, fp32_rows, n_ads, mask, _sample_rows)
    return _score_topk(query, table, seed, mask, k, _tau, _capacity)


def triton_score_topk_int8(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    table: Int8Table,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    _tau: torch.Tensor | float | None = None,
    _capacity: int | None = None,
    _sample_rows: int = _SAMPLE_ROWS,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_score_topk` on an 8-bit table: the exact top-K of the §2 score of
    `table.dequantize()` (up to fp32 rounding), reading one byte per ad dimension."""
    checked_int8_table(table)
    scales = (table.g_scale, table.x_scale)
    _check(q, v, p, table.g, table.x, table.b, mask, k, scales=scales, value=value)
    n_req, n_ads = p.shape[0], table.num_ads
    if n_req == 0 or n_ads == 0:  # nothing to launch
        return torch_score_topk(q, v, p, *table.dequantize(), mask, k, value=value)
    value = None if value is None else value.contiguous()
    kernel_table = _Table(
        _rows_unit_stride(table.g, torch.int8),
        _rows_unit_stride(table.x, torch.int8),
        table.b.contiguous(),  # fp32, as `Int8Table.check` requires
        table.g_scale.contiguous(),
        table.x_scale.contiguous(),
        value,
    )

    def fp32_rows(idx):
        g_s, x_s, b_s = table.dequantize(idx)
        return g_s, x_s, value_bias(b_s, _at(value, idx))

    seed = _seed(q, v, p, fp32_rows, n_ads, mask, _sample_rows)
    return _score_topk(_prepare_query(q, v, p), kernel_table, seed, mask, k, _tau, _capacity)


__all__ = ["triton_score_topk", "triton_score_topk_int8"]
