"""The cpu kernel's integer arithmetic on an 8-bit table (`Int8Table` read as stored): the query
rounded to integers in two int8 parts (`plan_int8`), exact int32 products (`int_products`), and
whether this CPU computes them exactly (`exact_products`).

Shapes: B requests, E experts, G gate-key dim, D value dim, C either, n ads per block,
P parts of a split query (1 or 2). Why the bounds hold on this path: DESIGN §5, "8-bit tables".
"""

from __future__ import annotations

import functools
import math

import torch

from m31.ops.cpu.bounds import U32, Plan, bounds_plan, gamma
from m31.ops.quant import INT8_MAX

INT8_U = 2.0**-21  # relative rounding of an 8-bit product's scaled result (3 fp32 roundings)
_HI = 255  # a split query's high part counts 255 low units (`_split_query`)
_WIDE = _HI * INT8_MAX + INT8_MAX
# the longest rows whose two-part products fit int32: |255·hi·y + lo·y| ≤ 256·127·128·C, with
# ads' int8 values down to -128 (`quantize_ad_table` writes ±127, a hand-made table may not)
_WIDE_DIM = (2**31 - 1) // ((_HI + 1) * INT8_MAX * 128)  # 516
# |Σ_i a_i b_i| ≤ 127·128·C must fit in int32
_INT32_SUM_DIM = (2**31 - 1) // (INT8_MAX * 128)


def _split_query(t: torch.Tensor, dims: tuple[int, ...]):
    """Round t [B, E, C] (fp64) to integers for int8 products, in two int8 parts where C allows.

    w = round(t / scale) with one fp32 scale per row (dims=(2,)) or per request (dims=(1, 2)),
    |w| ≤ 32,512 = 255·127 + 127 split as w = 255·hi + lo (|hi|, |lo| ≤ 127): about 16 bits,
    whose rounding error is far below bf16's. Then 255·(hi·y) + lo·y = w·y exactly in int32 for
    int8 rows y of length C ≤ `_WIDE_DIM`; longer rows get one part (|w| ≤ 127).
    Returns (ints int8 [P, B, E, C] (P parts, high first), scale fp32 [B, E] or [B, 1], the
    rounding's largest ‖t̂ - t‖ [B] and ‖t̂‖ [B] over E, t̂ = scale·w evaluated exactly)."""
    wide = t.shape[2] <= _WIDE_DIM
    top = _WIDE if wide else INT8_MAX
    scale = (t.abs().amax(dim=dims, keepdim=True) / top).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    w = torch.round(t / scale.double()).clamp_(-top, top)
    exact = w * scale.double()  # an integer below 2^15 times an fp32: exact in fp64
    err, norm = (exact - t).norm(dim=2).amax(1), exact.norm(dim=2).amax(1)
    if wide:
        hi = torch.round(w / _HI)
        ints = torch.stack([hi, w - _HI * hi])
    else:
        ints = w[None]
    return ints.to(torch.int8), scale[..., 0], err, norm


def _joined(ints: torch.Tensor) -> torch.Tensor:
    """The integers w int16 [B, E, C] of a split query's parts ints [P, B, E, C] (`_split_query`)."""
    whole = ints[0].to(torch.int16)
    return whole.mul_(_HI).add_(ints[1]) if len(ints) == 2 else whole


def plan_int8(q, v, p, k) -> Plan:
    """`plan_float` for an 8-bit table: the query rounded to integers as well (`_split_query`).

    The integer products are exact (int32 sums), then converted to fp32 and scaled twice (the
    query's scale, then the ad row's), so an affinity or logit is within 3 fp32 roundings of
    scale·(integer product): u' = 2⁻²¹ covers them. The ads' values are the dequantized table's,
    which differ from the ad scale times the integers by one fp32 rounding, a relative 2⁻²⁴ of
    each term, that the γ terms cover (they count no accumulation error here: there is none)."""
    n_req, _, gdim = q.shape
    ddim = v.shape[2]
    if gdim:
        qq, q_scale, dq, q_norm = _split_query(q.double() / math.sqrt(gdim), (1, 2))
        eta_g = dq + (2 * gamma(gdim) + 2 * U32) * q_norm
        qh = qq.transpose(0, 1).reshape(n_req, -1, gdim).contiguous()  # [B, P·E, G]
        q_int = _joined(qq)
    else:
        eta_g, qh, q_scale = torch.zeros(n_req, dtype=torch.float64), None, torch.ones(n_req)
        q_int = None
    # one scale per request (for E experts): the max over E of the integer affinities is then the
    # max over E of the affinities, and a pair's E values share one scale
    vq, v_scale, dv, v_norm = _split_query(v.double(), (1, 2))
    vh = vq.reshape(-1, ddim)  # [P·B·E, D]
    return bounds_plan(
        k,
        qh,
        vh,
        p,
        eta_g,
        dv,
        v_norm,
        ddim,
        INT8_U,
        INT8_U,
        q_scale=q_scale.reshape(-1).contiguous(),
        v_scale=v_scale.reshape(-1).contiguous(),
        q_int=q_int,
        v_int=_joined(vq),
    )


def int_products(query: torch.Tensor, ads: torch.Tensor, rows: int, buf: torch.Tensor | None):
    """The exact integer products [rows, n] int32 of a split query (`_split_query`: [P·rows, C],
    P = 1 or 2 parts) with int8 ads [n, C]; buf: int32 scratch of at least P·rows·n elements
    (None: allocate; a reused buffer saves the page faults of a fresh one)."""
    n = ads.shape[0]
    out = None if buf is None else buf[: len(query) * n].view(len(query), n)
    if ads.shape[1] == 1:  # torch._int_mm returns wrong sums for rows of one value (torch 2.13)
        ints = torch.mul(query.int(), ads.int().T, out=out)
    else:
        ints = torch._int_mm(query, ads.T, out=out)  # [P·rows, n]
    if len(ints) == rows:
        return ints
    return ints[rows:].add_(ints[:rows], alpha=_HI)  # 255·hi + lo


def exact_products(gdim: int, ddim: int) -> bool:
    """Whether the integer products of rows of gdim and ddim values are exact here: their sums
    fit int32, and this CPU's int8 kernel does not saturate (`int8_products_exact`)."""
    return max(gdim, ddim) <= _INT32_SUM_DIM and int8_products_exact()


@functools.cache
def int8_products_exact() -> bool:
    """Whether `torch._int_mm` on this CPU returns exact int32 sums for int8 inputs of ±127.

    Some x86 int8 kernels (without VNNI) sum pairs of products in int16 with saturation, which
    operands of ±127 can overflow; the 8-bit filters' bounds assume exact sums, so they are only
    used where a worst-case probe (every sign pattern of ±127 pairs, both orientations the
    kernel uses) comes back exact."""
    signs = torch.tensor([[1, 1], [1, -1], [-1, 1], [-1, -1]], dtype=torch.int8)
    a = (signs * INT8_MAX).repeat(1, 48).repeat(5, 1)  # [20, 96]: ±127 in every pairing
    b = torch.cat([a, -a, torch.full((1, 96), -INT8_MAX, dtype=torch.int8)])  # [41, 96]
    want = a.long() @ b.long().T
    with torch.no_grad():  # as the filters call it: a query [m, C] times a block's rows [n, C]ᵀ
        return all(
            torch.equal(torch._int_mm(lhs, rhs.T).long(), out)
            for lhs, rhs, out in ((a, b, want), (b, a, want.T), (a[:1], b, want[:1]))
        )
