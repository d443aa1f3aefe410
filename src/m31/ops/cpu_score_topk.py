"""Exhaustive score·gate·filter·top-K on CPU: bf16 products, proven bounds, exact rescoring.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, n ads per block,
S (request, ad) pairs that survive a filter.

Same contract as `torch_score_topk` (DESIGN §2): (scores [B, K'] fp32, rows [B, K'] int64) with
K' = min(k, N), best first, ties to the lower row; a request with fewer eligible ads ends in rows
NO_ROW and scores -inf. The returned scores are the reference's own (`rounded_score`: the §2
formula in fp64, rounded to fp32 once), so they depend on an ad's row alone.

The table is streamed once, in blocks of n ads that `threads` worker threads take in turn (torch
on one core each; the products release the GIL): 1. an affinity filter (one bf16 product per
block gives an upper bound U on every pair's score), 2. the gate for the survivors only (bounds
ℓ ≤ s ≤ h), 3. a threshold top-K shared by the workers (τ_r, the K-th largest ℓ, never above
the K-th best score), 4. an exact finish (the last candidates rescored with `rounded_score`,
an exact stable top-K). Why this is exact, the bounds with their exact expressions, the 8-bit
path (`cpu_score_topk_int8`, compiled as `cpu_int8.c` where a C compiler is at hand) and where
the time goes: DESIGN §5, "The cpu kernel and why it is exact".

Two cases skip the filters. Requests with at most K' eligible ads: every eligible ad is in the
answer, so step 4 alone scores and sorts them. Inputs whose logits or scores could pass 2¹⁰⁰ in
magnitude (by Cauchy–Schwarz on the norms), or a table holding NaN or ±inf: the reference scores
them, since the bounds' arithmetic assumes finite intermediates (`_in_range`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import queue
import threading
import weakref
from dataclasses import dataclass

import torch

from m31.ops import native
from m31.ops.masks import PackedMask, mask_rows
from m31.ops.quant import INT8_MAX, Int8Table, checked_int8_table
from m31.ops.threads import single_threaded
from m31.ops.torch_score import rounded_score
from m31.ops.torch_score_topk import NO_ROW, check_args, torch_score_topk

_U32 = 2.0**-24  # fp32 unit roundoff
_BF16_U = 2.0**-8  # bf16 unit roundoff (8 significant bits, round to nearest)
_INT8_U = 2.0**-21  # relative rounding of an 8-bit product's scaled result (3 fp32 roundings)
_HI = 255  # a split query's high part counts 255 low units (`_split_query`)
_WIDE = _HI * INT8_MAX + INT8_MAX
# the longest rows whose two-part products fit int32: |255·hi·y + lo·y| ≤ 256·127·128·C, with
# ads' int8 values down to -128 (`quantize_ad_table` writes ±127, a hand-made table may not)
_WIDE_DIM = (2**31 - 1) // ((_HI + 1) * INT8_MAX * 128)  # 516
# B·E·n elements per block (a bf16 product of 2 MiB). A sweep of blocks of 2^9..2^17 ads at
# B = 1, 16, 64 on the 2-core development machine favoured this size (65,536 ads at B = 1, 8,192 at
# B = 16, 2,048 at B = 64); smaller blocks pay per-op overhead, larger ones leave the caches.
_TILE = 1 << 20
_MIN_BLOCK, _MAX_BLOCK = 512, 65_536
_FP32_ROWS = 32  # B·E from which bf16 tables take fp32 products without native bf16 (B = 4: 1.3x)
# 8-bit tables: int32 products [P·B·E, n] of 4-8 MiB (B = 1: 131,072 ads, 1.2x faster than 65,536
# at N = 1 M, the per-op overhead being a larger share of the int8 path; B = 64: 2,048)
_INT8_TILE, INT8_MAX_BLOCK = 1 << 20, 131_072
# survivors gathered before the sparse gate step runs: amortises per-op overhead (65,536 measured
# ~7% faster than 16,384 at B = 64, where a block has ~14 K survivors, and no different at B = 1, 16)
_REFINE_PAIRS = 65_536
# ... and with one request, where each block has a few thousand survivors and the threshold that
# the next blocks are filtered by only rises at a gate step (N = 1 M: 25-30% fewer survivors)
_REFINE_PAIRS_ONE = 16_384
_CHUNK = 1 << 16  # rows of an 8-bit table dequantized at a time (for its norms)
# the compiled steps keep per-expert scratch on the thread's stack (E·256 int32 in step 2)
_NATIVE_MAX_EXPERTS = 512
_RESCORE_PAIRS = 1 << 15  # (request, candidate) pairs per chunk of the exact rescoring
_SLACK = 2.0**-20  # relative slack for the fp32 arithmetic of the filters themselves
# step 2's exponentials may be off by a relative 2^-19 (the compiled ones, `exp_f` in
# cpu_int8.c; torch's are within an ulp): as a logit error, < 2^-18, added to η
_EXP_ETA = 2.0**-18
# The filters run on inputs whose logits and scores stay below 2^100 in magnitude: their bound
# arithmetic (squared norms, e^(2η)·m, ...) then never meets inf·0 (see `_in_range`).
_RANGE = 2.0**100


def _gamma(terms: int) -> float:
    """Error bound of an fp32 sum of `terms` products, relative to the sum of magnitudes."""
    return terms * _U32 / (1 - terms * _U32)


def _product_dtype(t: torch.Tensor, rows: int) -> torch.dtype:
    """The dtype of the products of t with a query of `rows` rows: bf16 for a bf16 table, but
    fp32 (bf16 values are exact in it) on a CPU without bf16 dot-product instructions for
    `_FP32_ROWS` rows or more, where the emulated bf16 products of a batch ran 5x slower than
    fp32 ones on an Ice Lake Xeon (one request streams the table, where bf16's half of the bytes
    wins), and for any rows without AVX-512, where torch's bf16 products are slower still (Zen 3
    EPYC, AVX2: [8, 64] x [64, 65,536] 13.4 ms in bf16, 2.4 ms in fp32; B = 1, N = 1 M 2.1x
    faster in fp32)."""
    if t.dtype != torch.bfloat16:
        return torch.float32
    if _native_bf16() or (rows < _FP32_ROWS and _avx512()):
        return torch.bfloat16
    return torch.float32


@functools.cache
def _avx512() -> bool:
    """Whether torch's CPU kernels run with AVX-512 here."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@functools.cache
def _native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX-512 BF16 or AMX)."""
    cpu = torch.cpu
    return any(
        getattr(cpu, probe, lambda: False)()
        for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


@dataclass(frozen=True)
class _Plan:
    """Per-call constants: the rounded query in the product dtypes and the bound coefficients."""

    n_req: int
    n_exp: int
    k: int
    qh: torch.Tensor | None  # [B·E, G] q/√G in g's product dtype; None when G = 0
    vh: torch.Tensor  # [B·E, D] v in x's product dtype
    p_t: torch.Tensor  # [E, B] fp32 gate priors
    p_abs_max: float
    coef: torch.Tensor  # [B, 3] per request: coefficient of ‖g‖ in η, constant of η, ‖x‖ in a
    eta_l: float  # coefficient of Λ̂ in η
    u_a: float  # u' of the affinity product
    u_scan: float  # u'' = u'/(1 - u')
    kappa: float
    u_x: float  # coefficient of ‖x‖ in U (all requests)
    # 8-bit tables (`_plan_int8`): qh is then int8 [B, P·E, G] and vh int8 [P·B·E, D] (P = 1 or 2
    # parts, `_split_query`), with one scale per request that makes them the rounded query:
    # q[r]/√G ≈ q_scale[r]·w, v[r] ≈ v_scale[r]·w
    q_scale: torch.Tensor | None = None  # [B] fp32
    v_scale: torch.Tensor | None = None  # [B] fp32
    # ... and the same integers whole, for the compiled helpers (`m31.ops.native`): w = 255·hi + lo
    q_int: torch.Tensor | None = None  # int16 [B, E, G]
    v_int: torch.Tensor | None = None  # int16 [B, E, D]

    @property
    def quantized(self) -> bool:
        return self.v_scale is not None

    @property
    def refine_pairs(self) -> int:
        """Survivors of step 1 a worker gathers before it runs step 2 on them."""
        return _REFINE_PAIRS_ONE if self.n_req == 1 else _REFINE_PAIRS

    @property
    def candidate_room(self) -> int:
        """Candidates a worker keeps before it first prunes them (then twice what is left)."""
        return max(8 * self.n_req * self.k, 1 << 15)


def _plan(q, v, p, g, x, k) -> _Plan:
    n_req, n_exp, gdim = q.shape
    ddim = v.shape[2]
    q64, v64 = q.double(), v.double()
    gd, xd = _product_dtype(g, n_req * n_exp), _product_dtype(x, n_req * n_exp)
    u_l = _BF16_U / (1 - _BF16_U) if gd == torch.bfloat16 else 0.0
    u_a = _BF16_U / (1 - _BF16_U) if xd == torch.bfloat16 else 0.0
    if gdim:
        qs = (q.float() / math.sqrt(gdim)).to(gd)  # [B, E, G]
        dq = (qs.double() - q64 / math.sqrt(gdim)).norm(dim=2).amax(1)  # [B]
        q_norm = qs.double().norm(dim=2).amax(1)  # [B]
        eta_g = dq + (2 * _gamma(gdim) + 2 * _U32) * q_norm
        qh = qs.reshape(n_req * n_exp, gdim).contiguous()
    else:
        eta_g, qh = torch.zeros(n_req, dtype=torch.float64), None
    vh = v.float().to(xd)  # [B, E, D]
    dv = (vh.double() - v64).norm(dim=2).amax(1)  # [B]
    v_norm = vh.double().norm(dim=2).amax(1)  # [B]
    vh = vh.reshape(n_req * n_exp, ddim).contiguous()
    return _bounds_plan(k, qh, vh, p, eta_g, dv, v_norm, ddim, u_l, u_a)


def _bounds_plan(k, qh, vh, p, eta_g, dv, v_norm, ddim: int, u_l: float, u_a: float, **scales):
    """The `_Plan` of a rounded query: qh, vh in the products' form; eta_g [B] the part of η
    that multiplies ‖g‖; dv [B], v_norm [B] the rounding of v and the norm of its rounded form
    (largest over E); u_l, u_a the relative output rounding of the logits and the affinities."""
    n_req, n_exp = p.shape
    kappa = (2 * n_exp + 64) * _U32
    p32 = p.float()
    return _Plan(
        n_req=n_req,
        n_exp=n_exp,
        k=k,
        qh=qh,
        vh=vh,
        p_t=p32.T.contiguous(),
        p_abs_max=float(p32.abs().max()),
        coef=torch.stack(
            [
                eta_g,
                2.0**-21 * p32.double().abs().amax(1) + _EXP_ETA,
                dv + 2 * _gamma(ddim) * v_norm,
            ],
            dim=1,
        ).float(),
        eta_l=u_l + 2.0**-21,
        u_a=u_a,
        u_scan=u_a / (1 - u_a),
        kappa=kappa,
        u_x=float((dv + (2 * _gamma(ddim) + 4 * kappa) * v_norm).max()) * (1 + _SLACK),
        **scales,
    )


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


def _plan_int8(q, v, p, k) -> _Plan:
    """`_plan` for an 8-bit table: the query rounded to integers as well (`_split_query`).

    The integer products are exact (int32 sums), then converted to fp32 and scaled twice (the
    query's scale, then the ad row's), so an affinity or logit is within 3 fp32 roundings of
    scale·(integer product): u' = 2⁻²¹ covers them. The ads' values are the dequantized table's,
    which differ from the ad scale times the integers by one fp32 rounding, a relative 2⁻²⁴ of
    each term, that the γ terms cover (they count no accumulation error here: there is none)."""
    n_req, _, gdim = q.shape
    ddim = v.shape[2]
    if gdim:
        qq, q_scale, dq, q_norm = _split_query(q.double() / math.sqrt(gdim), (1, 2))
        eta_g = dq + (2 * _gamma(gdim) + 2 * _U32) * q_norm
        qh = qq.transpose(0, 1).reshape(n_req, -1, gdim).contiguous()  # [B, P·E, G]
        q_int = _joined(qq)
    else:
        eta_g, qh, q_scale = torch.zeros(n_req, dtype=torch.float64), None, torch.ones(n_req)
        q_int = None
    # one scale per request (for E experts): the max over E of the integer affinities is then the
    # max over E of the affinities, and a pair's E values share one scale
    vq, v_scale, dv, v_norm = _split_query(v.double(), (1, 2))
    vh = vq.reshape(-1, ddim)  # [P·B·E, D]
    return _bounds_plan(
        k, qh, vh, p, eta_g, dv, v_norm, ddim, _INT8_U, _INT8_U,
        q_scale=q_scale.reshape(-1).contiguous(), v_scale=v_scale.reshape(-1).contiguous(),
        q_int=q_int, v_int=_joined(vq),
    )  # fmt: skip


def _int_products(query: torch.Tensor, ads: torch.Tensor, rows: int, buf: torch.Tensor | None):
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


@dataclass(frozen=True)
class _TableStats:
    """Per-ad constants of a table, fp32; no query changes them."""

    per_ad: torch.Tensor  # [3, N]: ‖g‖ and ‖x‖ bounds and b, one gather for step 2's survivors
    scan_bias: torch.Tensor  # [N] b + (u'' + 2⁻²¹ + slack)|b|: the bias part of step 1's offset
    largest: tuple[float, float, float]  # max ‖g‖, max ‖x‖, max |b| (NaN or inf if not finite)

    @property
    def x_norm(self) -> torch.Tensor:
        return self.per_ad[1]


# The constants of the last few tables, by the tensors' identities. An entry serves a call only if
# the same three tensor objects are alive and their version counters are unchanged: every in-place
# torch op bumps them, also through a view (autograd trusts the same counters). Writes that bypass
# torch (into a NumPy array sharing the memory) are not seen.
_STATS: dict[tuple[int, int, int], tuple[tuple, tuple[int, ...], _TableStats]] = {}
_STATS_LOCK = threading.Lock()
_STATS_TABLES = 4


def _table_stats(
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    g_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> _TableStats:
    """The constants of the table (g, x, b), or of the 8-bit table (g, x, b, g_scale, x_scale),
    computed once per table when it can be tracked; an 8-bit table's norms are its dequantized
    rows' (`Int8Table.dequantize`).

    The norms cost a pass over the table (as much as the affinity product at B = 1), and a serving
    process scores the same index over and over."""
    quantized = g_scale is not None
    table = (g, x, b, g_scale, x_scale) if quantized else (g, x, b)
    tracked = not any(t.is_inference() for t in table)  # inference tensors have no version
    if tracked:
        key, versions = tuple(map(id, table)), tuple(t._version for t in table)
        with _STATS_LOCK:
            for dead in [k for k, (refs, _, _) in _STATS.items() if any(r() is None for r in refs)]:
                del _STATS[dead]
            hit = _STATS.get(key)
            if (
                hit
                and hit[1] == versions
                and all(r() is t for r, t in zip(hit[0], table, strict=True))
            ):
                return hit[2]
    if quantized:
        u_a = _INT8_U
        norms = [[torch.zeros(0)], [torch.zeros(0)]]  # ‖g‖, ‖x‖ of the dequantized rows
        for lo in range(0, len(b), _CHUNK):  # in chunks: no dequantized copy of the table
            rows = Int8Table(g, g_scale, x, x_scale, b).dequantize(slice(lo, lo + _CHUNK))
            for out, part in zip(norms, rows[:2], strict=True):
                out.append(_row_norms(part))
        norms = [torch.cat(parts) for parts in norms]
    else:
        # the largest u' the table's products may have (the plan's own u'' is then covered)
        u_a = _BF16_U / (1 - _BF16_U) if x.dtype == torch.bfloat16 else 0.0
        norms = [_row_norms(g), _row_norms(x)]
    bias = b.float()
    per_ad = torch.stack([*norms, bias])  # [3, N]
    stats = _TableStats(
        per_ad=per_ad,
        scan_bias=bias.abs().mul_(u_a / (1 - u_a) + 2.0**-21 + _SLACK).add_(bias),
        largest=tuple(per_ad.abs().amax(1).tolist()),
    )
    if tracked:
        with _STATS_LOCK:
            _STATS[key] = (tuple(weakref.ref(t) for t in table), versions, stats)
            while len(_STATS) > _STATS_TABLES:
                del _STATS[next(iter(_STATS))]  # the oldest
    return stats


class _Threshold:
    """τ [B], shared by the workers: the K-th largest lower bound ℓ seen so far per request.

    It keeps the K largest ℓ of each request ([B, K]); K eligible ads score at least their ℓ, so
    τ ≤ s_K at all times. τ only rises, so a stale read is still a valid threshold.
    `for_refine` and `for_scan` are τ lowered by the slack the fp32 arithmetic of the two filters
    needs (the scan also moves the output rounding u'|M̂| of U over to τ's side).
    """

    def __init__(self, n_req: int, k: int, u_scan: float):
        self._lock = threading.Lock()
        self._u_scan = u_scan
        self._top = torch.full((n_req, k), -math.inf)  # [B, K] largest ℓ
        self.tau = self.for_refine = self.for_scan = self._top[:, -1]

    def offer(self, req: torch.Tensor, lower: torch.Tensor) -> None:
        """Merge the lower bounds ℓ [P] of pairs of requests req [P] (each pair offered once)."""
        with self._lock:
            n_req, k = self._top.shape
            merged = torch.cat([self._top, _pad_by_request(lower, req, n_req)], dim=1)
            self._top = merged.topk(k, dim=1).values
            self.tau = self._top[:, -1]
            self.for_refine = self.tau - _SLACK * self.tau.abs()
            self.for_scan = self.tau - (self._u_scan + _SLACK) * self.tau.abs()


def _pad_by_request(values: torch.Tensor, req: torch.Tensor, n_req: int) -> torch.Tensor:
    """[B, width]: the values [P] of each request (req [P]) in its row, padded with -inf."""
    if n_req == 1:
        return values[None]
    counts = torch.bincount(req, minlength=n_req)  # [B]
    order = torch.argsort(req, stable=True)
    req_sorted = req[order]
    pos = torch.arange(len(req)) - (torch.cumsum(counts, 0) - counts)[req_sorted]
    padded = torch.full((n_req, int(counts.max()) if len(req) else 0), -math.inf)
    padded[req_sorted, pos] = values[order]
    return padded


def _in_range(q: torch.Tensor, v: torch.Tensor, p: torch.Tensor, stats: _TableStats) -> bool:
    """Whether every |logit| and |score| of the call is below 2^100 (Cauchy–Schwarz on the norms
    of the query and the table). False as well for a table holding NaN or ±inf (its norms do)."""
    gdim = q.shape[2]
    g_max, x_max, b_max = stats.largest
    q_max = float(q.double().norm(dim=2).max()) / math.sqrt(gdim) if gdim else 0.0
    logit = q_max * g_max + float(p.double().abs().max())
    value = float(v.double().norm(dim=2).max()) * x_max + b_max
    return logit < _RANGE and value < _RANGE


def _row_norms(t: torch.Tensor) -> torch.Tensor:
    """Upper bounds on the rows' Euclidean norms, fp32 [n] (bf16 norms are rounded, so inflate)."""
    if t.dtype == torch.bfloat16:
        return t.norm(dim=1).float().mul_(1 + 2 * _BF16_U)
    return t.float().norm(dim=1).mul_(1 + 2.0**-20)


def _expert_index(req: torch.Tensor, col: torch.Tensor, n_exp: int, width: int) -> torch.Tensor:
    """[E, S] flat positions of pairs (req [S], col [S]) in a [B·E, width] product, one per expert."""
    return (req * (n_exp * width) + col)[None, :] + (torch.arange(n_exp) * width)[:, None]


def _affinity_offset(plan: _Plan, x_norm: torch.Tensor, scan_bias: torch.Tensor) -> torch.Tensor:
    """Step 1's per-ad offset'' [n]: keep a pair when M̂ + offset'' ≥ τ'' (τ'' = `for_scan`).

    U = M̂ + u'|M̂| + offset with offset = b + u_x‖x‖ + 2⁻²³|b|. With T = τ - offset, U ≥ τ
    implies M̂ ≥ T - u''|T| (u'' = u'/(1 - u')), and |T| ≤ |τ| + |offset|: so moving τ and offset
    each by u''|·| gives a test that never drops a pair with U ≥ τ and needs no pass over |M̂|.
    offset'' = scan_bias + u_x(1 + u'' + slack)‖x‖ ≥ offset + u''|offset|, with room for the fp32
    rounding of this arithmetic; fp32 rounding is monotone, so the rounded sum M̂ + offset'' is
    ≥ τ'' whenever the exact one is.
    """
    return torch.mul(x_norm, _offset_alpha(plan)).add_(scan_bias)  # as `m31_pass` (no fma)


def _offset_alpha(plan: _Plan) -> float:
    """The coefficient of ‖x‖ in step 1's offset'' (`_affinity_offset`)."""
    return plan.u_x * (1 + plan.u_scan + _SLACK)


def _gate_bounds(plan: _Plan, req, gate, aff, g_norm, x_norm, bias):
    """Step 2 for pairs (request req [S]): s̃ [S] and ε [S] with |s̃ - s| ≤ ε for the fp32 score s.

    gate: L̂ [E, S] (None when G = 0) and aff: Â [E, S] in the product dtype; g_norm, x_norm: upper
    bounds on ‖g‖, ‖x‖ [S]; bias: b [S] fp32. Consumes (overwrites) its arguments.
    """
    logits = plan.p_t.index_select(1, req)  # [E, S] priors
    if gate is None:
        lam = torch.zeros(len(req))
    else:
        gate = gate.float()
        lam = gate.abs().amax(0)  # [S] Λ̂
        logits = gate.add_(logits)
    aff = aff.float()  # [E, S]
    top, bottom = aff.amax(0), aff.amin(0)  # [S] each
    if float(lam.max()) + plan.p_abs_max + math.log(plan.n_exp) >= 80:  # exp or Σ could overflow
        logits.sub_(logits.amax(0))
    weights = logits.exp_()  # [E, S] unnormalised softmax
    den = weights.sum(0)  # [S]
    approx = (weights * aff).sum(0).div_(den).add_(bias)  # [S] s̃
    mag = weights.mul_(aff.abs_()).sum(0).div_(den)  # [S] m = Σ w̃|Â|
    reach = torch.maximum(top.abs(), bottom.abs())  # [S] M̂ = max_e |Â_e|
    coef = plan.coef.index_select(0, req)  # [S, 3]
    eta = torch.addcmul(coef[:, 1], coef[:, 0], g_norm).add_(lam, alpha=plan.eta_l)  # [S] η
    a = x_norm.mul_(coef[:, 2])  # [S]
    rounding = bias.abs_().add_(approx.abs()).mul_(plan.kappa)  # [S] κ(|b| + |s̃|)
    gated = torch.add(a, mag, alpha=1 + plan.u_a).mul_(torch.expm1(eta.mul_(2))).add_(a)
    gated.add_(mag, alpha=plan.u_a + 2 * plan.kappa).add_(rounding)  # [S] NaN if e^(2η)=inf, m=a=0
    spread = top.sub_(bottom).mul_(1 + 2.0**-23).add_(a).add_(rounding)
    spread.add_(reach, alpha=plan.u_a + 2 * plan.kappa)  # [S] the gate-free bound
    return approx, torch.fmin(gated, spread).mul_(1 + 2.0**-10)  # fmin skips a NaN: [S] ε


class _Worker:
    """Scans blocks of ads for one thread and keeps that thread's candidates, in torch ops (an
    8-bit table takes `_compiled_pass` where the compiled helpers are built)."""

    def __init__(
        self, plan: _Plan, table, stats: _TableStats, mask, shared: _Threshold, block: int
    ):
        self.plan, self.shared, self.stats = plan, shared, stats
        self.table = table  # (g, x, b) or an Int8Table
        self.g, self.x = (table.g, table.x) if plan.quantized else table[:2]
        self.mask = mask
        # products' scratch: [B·E, n] in the product dtype, or [P·B·E, n] int32 (8-bit)
        out = torch.int32 if plan.quantized else plan.vh.dtype
        self.a_buf = torch.empty(len(plan.vh) * block, dtype=out)
        self.l_buf = None  # (8-bit tables compute logits per request, `logits_int8`)
        if plan.qh is not None and not plan.quantized:
            self.l_buf = torch.empty(len(plan.qh) * block, dtype=plan.qh.dtype)
        self.pending: list[tuple[torch.Tensor, ...]] = []
        self.n_pending = 0
        self.refine_pairs = plan.refine_pairs
        self.cands: list[tuple[torch.Tensor, ...]] = []  # (req, row, upper bound h)
        self.n_cands = 0
        self.cap = plan.candidate_room
        self.block = block

    def scan(self, lo: int, hi: int) -> None:
        """Step 1 on ads [lo, hi): the affinity bound U, eligibility, gather the survivors."""
        if self.plan.quantized:
            return self.scan_int8(lo, hi)
        plan, stats, n = self.plan, self.stats, hi - lo
        n_req, n_exp = plan.n_req, plan.n_exp
        xb = self.x[lo:hi].to(plan.vh.dtype)
        aff = torch.mm(plan.vh, xb.T, out=self.a_buf[: n_req * n_exp * n].view(-1, n))  # [B·E, n]
        best = aff.view(n_req, n_exp, n).amax(1)  # [B, n] M̂
        offset = _affinity_offset(plan, stats.x_norm[lo:hi], stats.scan_bias[lo:hi])  # [n]
        keep = torch.add(best, offset) >= self.shared.for_scan[:, None]  # [B, n]
        if self.mask is not None:
            keep &= mask_rows(self.mask, lo, hi)
        req, ad = keep.nonzero().unbind(1)  # [S], [S]
        if len(req) == 0:
            return
        row = ad + lo
        gate = None if plan.qh is None else self.gate_logits(lo, hi, req, ad)  # [S, E] L̂
        # Â stays [B·E, n] for the max over E along rows; the take gathers E strided values
        gathered = aff.take(_expert_index(req, ad, n_exp, n))  # [E, S] Â
        self.add_pending(req, row, gate, gathered, n)

    def add_pending(self, req, row, gate, aff, n: int) -> None:
        """Queue survivors (req [S], row [S], L̂ [S, E] or None, Â [E, S]) of a block of n ads."""
        per_ad = self.stats.per_ad.index_select(1, row)  # [3, S]
        self.pending.append((req, row, gate, aff, per_ad))
        self.n_pending += len(req)
        if self.n_pending >= self.refine_pairs or n < self.block:
            self.refine()  # after a short (warm-up) block at once: τ is what prunes the next

    def gate_logits(self, lo: int, hi: int, req: torch.Tensor, ad: torch.Tensor) -> torch.Tensor:
        """L̂ [S, E] of the surviving pairs (req [S], ad [S] in [0, hi - lo))."""
        plan, n = self.plan, hi - lo
        gb = self.g[lo:hi]
        if plan.n_req == 1 and 2 * len(ad) < n:  # one request: only its surviving ads' logits
            return torch.mm(gb.index_select(0, ad).to(plan.qh.dtype), plan.qh.T)
        # Ads by rows, so that a pair's E logits are adjacent: one 2E-byte row gather per pair.
        # (Gathering each request's surviving ads for a batch of small products measured no faster
        # at B = 16 and 64: the gathers cost what the skipped multiply-adds saved.)
        out = self.l_buf[: n * plan.n_req * plan.n_exp].view(n, -1)
        logits = torch.mm(gb.to(plan.qh.dtype), plan.qh.T, out=out)  # [n, B·E]
        return logits.view(n * plan.n_req, plan.n_exp).index_select(0, ad * plan.n_req + req)

    def scan_int8(self, lo: int, hi: int) -> None:
        """`scan` on an 8-bit table: exact integer products, scaled after the max over E.

        Â_e = (I_e·v_scale)·x_scale in fp32 with both scales positive, so max_e Â_e is the same
        expression of max_e I_e (fp32 rounding is monotone): one [B, n] scaling, not [B·E, n]."""
        plan, stats, table, n = self.plan, self.stats, self.table, hi - lo
        n_req, n_exp = plan.n_req, plan.n_exp
        ints = _int_products(plan.vh, table.x[lo:hi], n_req * n_exp, self.a_buf)  # [B·E, n] I
        best = ints.view(n_req, n_exp, n).amax(1).float()  # [B, n]
        x_scale = table.x_scale[lo:hi]
        best.mul_(plan.v_scale[:, None]).mul_(x_scale)  # M̂
        offset = _affinity_offset(plan, stats.x_norm[lo:hi], stats.scan_bias[lo:hi])  # [n]
        keep = best.add_(offset) >= self.shared.for_scan[:, None]  # [B, n]
        if self.mask is not None:
            keep &= mask_rows(self.mask, lo, hi)
        req, ad = keep.nonzero().unbind(1)  # [S], [S]
        if len(req) == 0:
            return
        aff = ints.take(_expert_index(req, ad, n_exp, n)).float()  # [E, S]
        aff.mul_(plan.v_scale.index_select(0, req)).mul_(x_scale.index_select(0, ad))  # Â
        self.add_pending(req, ad + lo, None, aff, n)  # the logits follow in `refine`

    def logits_int8(self, req, row, aff, per_ad):
        """L̂ [E, S] of the pending pairs of an 8-bit table, the pairs reordered by request.

        One integer product per request with its surviving ads' gathered rows of g: a pair's
        logits are computed once, where a product per block would compute all B·n of them (at
        B = 64, about 12 times as many as survive step 1)."""
        plan, table = self.plan, self.table
        if plan.n_req > 1:
            order = torch.argsort(req, stable=True)
            req, row = req.index_select(0, order), row.index_select(0, order)
            aff, per_ad = aff.index_select(1, order), per_ad.index_select(1, order)
        rows = table.g.index_select(0, row)  # [S, G]
        ints = torch.empty(plan.n_exp, len(row), dtype=torch.int32)  # [E, S]
        start = 0
        for r, count in enumerate(torch.bincount(req, minlength=plan.n_req).tolist()):
            if count:
                span = slice(start, start + count)
                ints[:, span] = _int_products(plan.qh[r], rows[span], plan.n_exp, None)
            start += count
        gate = ints.float().mul_(plan.q_scale.index_select(0, req))
        return req, row, aff, per_ad, gate.mul_(table.g_scale.index_select(0, row))

    def refine(self) -> None:
        """Step 2 on the gathered survivors: s̃ ± ε in fp32; keep the pairs with h ≥ τ."""
        if not self.pending:
            return
        req, row, lower, upper = self.bounds()
        promote = torch.nonzero(lower > self.shared.tau.index_select(0, req)).squeeze(1)
        if len(promote):
            self.shared.offer(req.index_select(0, promote), lower.index_select(0, promote))
        self.cands.append((req, row, upper))
        self.n_cands += len(req)
        if self.n_cands > self.cap:
            self.prune()
            self.cap = max(self.cap, 2 * self.n_cands)

    def bounds(self):
        """(req, row, ℓ, h) [S'] of the pending pairs with h ≥ τ, in torch ops."""
        plan = self.plan
        req, row, gates, affs, per_ad = zip(*self.pending, strict=True)
        self.pending, self.n_pending = [], 0
        req, row, aff = torch.cat(req), torch.cat(row), torch.cat(affs, dim=1)  # aff [E, S]
        per_ad = torch.cat(per_ad, dim=1)  # [3, S]
        gate = None  # [S, E] -> [E, S] fp32, in one copy
        if plan.quantized and plan.qh is not None:
            req, row, aff, per_ad, gate = self.logits_int8(req, row, aff, per_ad)
        elif gates[0] is not None:
            gate = torch.cat(gates).T.to(torch.float32, memory_format=torch.contiguous_format)
        g_norm, x_norm, bias = per_ad.unbind(0)  # [S] each (fresh: overwritten)
        approx, eps = _gate_bounds(plan, req, gate, aff, g_norm, x_norm, bias)  # [S], [S]
        lower, upper = approx - eps, approx + eps
        keep = torch.nonzero(upper >= self.shared.for_refine.index_select(0, req)).squeeze(1)
        req, row = req.index_select(0, keep), row.index_select(0, keep)
        return req, row, lower.index_select(0, keep), upper.index_select(0, keep)

    def prune(self) -> None:
        """Step 3: drop the candidates whose upper bound fell below τ."""
        req, row, upper = (torch.cat(parts) for parts in zip(*self.cands, strict=True))
        keep = torch.nonzero(upper >= self.shared.for_refine.index_select(0, req)).squeeze(1)
        self.cands = [tuple(t.index_select(0, keep) for t in (req, row, upper))]
        self.n_cands = len(keep)

    def finish(self) -> None:
        self.refine()
        if self.cands:
            self.prune()


def _mask_args(mask) -> tuple[int, torch.Tensor | None, int, torch.Tensor | None]:
    """(mode, data, stride, index) of a mask for `m31_scan_int8` (see `cpu_int8.c`): 0 for
    none; 1 for bool [N] (stride 0) or [B, N] (stride N); 2 for a `PackedMask`'s bits."""
    if mask is None:
        return 0, None, 0, None
    if isinstance(mask, PackedMask):
        bits = mask.bits.contiguous()
        return 2, bits, bits.shape[1], mask.index.contiguous()
    mask = mask.contiguous()
    return 1, mask, mask.shape[-1] if mask.dim() == 2 else 0, None


def _spans(n_ads: int, block: int) -> list[tuple[int, int]]:
    """Ad ranges [lo, hi) to scan: blocks of `block` ads after a warm-up of shorter ones.

    τ starts at -inf, so every eligible pair of the first blocks goes through the gate step; the
    warm-up (block/16, /16, /8, /8, /4, /4, /2, /2, each worker taking the next) raises τ on
    fewer pairs. At B = 1, N = 1 M this cuts the pairs gated by 30%.
    """
    sizes = [block >> shift for shift in (4, 4, 3, 3, 2, 2, 1, 1) if block >> shift >= 64]
    spans, lo = [], 0
    for size in [*sizes, *[block] * math.ceil(n_ads / block)]:
        if lo >= n_ads:
            break
        spans.append((lo, min(lo + size, n_ads)))
        lo += size
    return spans


def _compiled_pass(
    lib, plan: _Plan, table: Int8Table, stats: _TableStats, mask, spans, block: int, n_workers: int
):
    """Steps 1-3 on an 8-bit table in compiled code (`m31_pass` in `cpu_int8.c`): each worker
    thread one call that takes the spans in turn with the others and shares τ with them, so
    that the GIL is taken only to start the calls and to collect their candidates. The same
    steps as `_Worker`'s, with step 2's exponentials compiled too (DESIGN §5).
    -> (req, row, h) of the candidates, and τ for the final filter ([B] `for_refine`)."""
    ptr, n_req = native.ptr, plan.n_req
    mode, mask_data, mask_stride, mask_index = _mask_args(mask)
    span_at = torch.tensor(spans, dtype=torch.long)  # [n_spans, 2]
    args = native.PassArgs(
        spans=ptr(span_at), n_spans=len(spans), block=block,
        x=ptr(table.x), x_scale=ptr(table.x_scale), d=table.x.shape[1],
        g=ptr(table.g), g_scale=ptr(table.g_scale), gdim=table.g.shape[1],
        per_ad=ptr(stats.per_ad), scan_bias=ptr(stats.scan_bias), n_ads=len(stats.scan_bias),
        w=ptr(plan.v_int), v_scale=ptr(plan.v_scale), wq=ptr(plan.q_int), q_scale=ptr(plan.q_scale),
        p_t=ptr(plan.p_t), coef=ptr(plan.coef), n_req=n_req, n_exp=plan.n_exp,
        alpha=_offset_alpha(plan), shift_base=plan.p_abs_max + math.log(plan.n_exp),
        eta_l=plan.eta_l, kappa=plan.kappa, one_u=1 + plan.u_a,
        u_2kappa=plan.u_a + 2 * plan.kappa, mask_mode=mode, mask=ptr(mask_data),
        mask_stride=mask_stride, mask_index=ptr(mask_index),
        refine_pairs=plan.refine_pairs, room=plan.candidate_room,
    )  # fmt: skip
    shared = lib.m31_shared_new(n_req, plan.k, _SLACK, plan.u_scan + _SLACK)
    if not shared:
        raise MemoryError("the cpu kernel's threshold: out of memory")
    found: list[tuple[torch.Tensor, ...]] = []

    def work(_: int) -> None:
        cands = ctypes.c_void_p()
        count = lib.m31_pass(shared, ctypes.byref(args), ctypes.byref(cands))
        if count < 0:
            raise MemoryError("the cpu kernel's compiled pass: out of memory")
        try:
            req, row = torch.empty(count, dtype=torch.long), torch.empty(count, dtype=torch.long)
            upper = torch.empty(count)
        except BaseException:
            lib.m31_cands_free(cands)
            raise
        lib.m31_cands_take(cands, ptr(req), ptr(row), ptr(upper))
        found.append((req, row, upper))

    try:
        _in_threads(n_workers, work)
        tau = torch.empty(n_req)
        lib.m31_shared_tau(shared, ptr(tau))
    finally:
        lib.m31_shared_free(shared)
    req, row, upper = (torch.cat(t) for t in zip(*found, strict=True))
    return req, row, upper, tau


def _in_threads(n_threads: int, work) -> None:
    """work(i) in threads i < n_threads (the caller's is 0), each running torch on one core.
    Products and most other ops release the GIL, and so do the compiled helpers; many small
    OpenMP regions instead stall on a busy machine, each waiting for its slowest thread. The
    first error is re-raised here."""
    caller_threads = torch.get_num_threads()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with single_threaded(caller_threads):
                work(i)
        except BaseException as err:  # re-raised in the caller below
            errors.append(err)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(1, n_threads)]
    for t in pool:
        t.start()
    run(0)
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def _spans_in_threads(n_threads: int, spans, work, last=None) -> None:
    """work(i, lo, hi) for every span (lo, hi), then last(i), in threads i < n_threads
    (`_in_threads`) that take the spans in turn."""
    todo: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    for span in spans:
        todo.put(span)

    def run(i: int) -> None:
        while True:
            try:
                lo, hi = todo.get_nowait()
            except queue.Empty:
                break
            work(i, lo, hi)
        if last is not None:
            last(i)

    _in_threads(n_threads, run)


def _by_request(req: torch.Tensor, row: torch.Tensor, n_req: int):
    """Pairs (req [S], row [S]) sorted by request, then row -> (rows [B, C], valid [B, C]): each
    request's rows left-aligned, in row order; C is the most any request has."""
    counts = torch.bincount(req, minlength=n_req)  # [B]
    width = int(counts.max()) if len(req) else 0
    pos = torch.arange(len(req)) - (torch.cumsum(counts, 0) - counts)[req]
    rows = torch.zeros(n_req, width, dtype=torch.long)  # [B, C]
    rows[req, pos] = row
    valid = torch.zeros(n_req, width, dtype=torch.bool)  # [B, C]
    valid[req, pos] = True
    return rows, valid


def _exact_topk(q, v, p, take, rows, valid, k_out: int, threads: int = 1):
    """Step 4: the reference's fp32 §2 scores of the candidates and an exact top k_out.

    take(index) -> the ads' (g, x, b) at index (`_rows_of`); rows [B, C] (each request's
    candidates in row order) or [1, C] (the same for every request); valid [B, C] marks the real
    candidates (None: all are). The scores come from the same `rounded_score` as the reference's,
    so they depend on an ad's row alone, not on where it sits among the candidates; the stable
    sort then puts tied ads in row order.
    `threads`: threads that score chunks of candidates (`_spans_in_threads`).
    """
    n_req, width = q.shape[0], rows.shape[1]
    scores = torch.empty(n_req, width)  # [B, C]
    step = max(1, _RESCORE_PAIRS // n_req)
    spans = [(lo, min(lo + step, width)) for lo in range(0, width, step)]

    def rescore(_: int, lo: int, hi: int) -> None:
        r = rows[:, lo:hi]  # [B or 1, c]
        scores[:, lo:hi] = rounded_score(q, v, p, *take(r[0] if len(r) == 1 else r))  # [B, c]

    _spans_in_threads(min(threads, len(spans)), spans, rescore)
    if valid is not None:
        scores.masked_fill_(~valid, -math.inf)
    scores, pick = torch.sort(scores, dim=1, descending=True, stable=True)
    top, short = min(k_out, width), max(k_out - width, 0)
    scores = torch.cat([scores[:, :top], torch.full((n_req, short), -math.inf)], dim=1)
    rows = rows.expand(n_req, -1).gather(1, pick[:, :top])
    rows = torch.cat([rows, torch.full((n_req, short), NO_ROW)], dim=1)  # [B, K']
    return scores, rows.masked_fill(scores == -math.inf, NO_ROW)


def _rows_of(table):
    """take(index) -> (g, x, b) of the ads at index: as stored, or dequantized for an 8-bit
    table exactly as `Int8Table.dequantize` does, so the rescored scores are the reference's."""
    if isinstance(table, Int8Table):
        return table.dequantize
    g, x, b = table
    return lambda i: (g[i], x[i], b[i])


def _every_eligible(q, v, p, take, n_ads: int, mask, k_out: int, threads: int):
    """Requests with at most k_out eligible ads: every one of them is in the answer, so there is
    nothing to filter, only the eligible ads' scores to sort (step 4 on all of them)."""
    if isinstance(mask, PackedMask):
        mask = mask.unpack()  # [B, N] of these few requests
    if mask is None:
        rows, valid = torch.arange(n_ads)[None], None  # [1, N]
    elif mask.dim() == 1:
        rows, valid = mask.nonzero()[:, 0][None], None  # [1, N']
    else:
        req, row = mask.nonzero().unbind(1)  # by request, then row
        rows, valid = _by_request(req, row, q.shape[0])  # [B, C] each
    return _exact_topk(q, v, p, take, rows, valid, k_out, threads)


def _few_eligible(mask, n_req: int, n_ads: int, k_out: int) -> torch.Tensor:
    """[B] bool: whether each request has at most k_out eligible ads.

    Counting costs ~4 ns per ad and request on a core (a quarter of the whole pass at B = 64,
    N = 1 M), so the first 16·k_out ads are counted first: a request with more than k_out
    eligible among them is settled (any mask denser than 1/16), and only the others are counted
    in full."""
    if mask is None:
        return torch.full((n_req,), n_ads <= k_out)
    if isinstance(mask, PackedMask):  # a popcount per distinct bitmap
        return mask.counts() <= k_out
    rows = mask if mask.dim() == 2 else mask[None]  # [B or 1, N]
    head = min(n_ads, 16 * k_out)
    count = torch.count_nonzero(rows[:, :head], dim=-1)  # [B or 1]
    open_ = torch.nonzero(count <= k_out)[:, 0]
    if head < n_ads and len(open_):
        count[open_] += torch.count_nonzero(rows[open_, head:], dim=-1)
    return (count <= k_out).expand(n_req)


def _check_mask(mask) -> None:
    device = mask.device if mask is not None else torch.device("cpu")
    if device.type != "cpu":
        raise ValueError(f"the mask must be on the CPU, got {device}")


def _check(q, v, p, g, x, b, mask, k) -> None:
    check_args(q, v, p, g, x, b, mask, k)
    _check_mask(mask)
    _check_float_cpu(q=q, v=v, p=p, g=g, x=x, b=b)


def _check_float_cpu(**named: torch.Tensor) -> None:
    for name, t in named.items():
        if not t.is_floating_point() or t.device.type != "cpu":
            raise ValueError(
                f"{name} must be a floating-point CPU tensor, got {t.dtype} on {t.device}"
            )


def cpu_score_topk(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    block: int | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, K'] fp32, rows [B, K'] int64), K' = min(k, N): the contract of `torch_score_topk`.

    q [B, E, G], v [B, E, D], p [B, E]; g [N, G], x [N, D], b [N] (bf16 tables take bf16
    products, others fp32 ones, `_product_dtype`); mask bool [N] or [B, N], a `PackedMask`
    (unpacked a block at a time) or None. `block`: ads per block (default: about 2²⁰ / (B·E),
    so a block's products stay in cache); `threads`: worker threads that split
    the blocks, each running torch on one core (default: torch.get_num_threads()). torch's thread
    count is set to 1 in those threads for the call (the MKL part of that setting is process-wide)
    and restored afterwards. Requests with at most K' eligible ads skip the filters (their answer
    is every eligible ad); inputs beyond the filters' range (`_in_range`) go to the reference.
    """
    _check(q, v, p, g, x, b, mask, k)
    g, x, b = g.contiguous(), x.contiguous(), b.contiguous()
    return _solve(q, v, p, (g, x, b), mask, k, block, threads)


def cpu_score_topk_int8(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    table: Int8Table,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    block: int | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cpu_score_topk` reading an 8-bit table as stored: the exact top K of its dequantized
    table (the `Int8Table` definition), with no dequantized copy of the table.

    The query is rounded to int8 as well (its rounding is measured and bounded like bf16's), so
    steps 1 and 2 run on integer products (`torch._int_mm`, VNNI on x86): a quarter of the bytes
    of an fp32 table and half of bf16's, at four times bf16's product rate. Where the integer
    product is not exact (`int8_products_exact`: a CPU whose int8 kernel saturates), or D or G is
    too large for int32 sums, this scores the dequantized table with `cpu_score_topk` instead.
    """
    checked_int8_table(table)
    g, x, b = table.g, table.x, table.b
    check_args(q, v, p, g, x, b, mask, k)
    _check_mask(mask)
    _check_float_cpu(q=q, v=v, p=p)
    if table.device.type != "cpu":
        raise ValueError(f"the table must be on the CPU, got {table.device}")
    if max(g.shape[1], x.shape[1]) > _INT32_SUM_DIM or not int8_products_exact():
        return cpu_score_topk(q, v, p, *table.dequantize(), mask, k, block=block, threads=threads)
    table = Int8Table(*(t.contiguous() for t in table))
    return _solve(q, v, p, table, mask, k, block, threads)


# |Σ_i a_i b_i| ≤ 127·128·C must fit in int32
_INT32_SUM_DIM = (2**31 - 1) // (INT8_MAX * 128)


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


def _solve(q, v, p, table, mask, k: int, block, threads):
    """The driver behind both entry points: table (g, x, b) or an Int8Table, arguments checked."""
    if block is not None and block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if threads is not None and threads <= 0:
        raise ValueError(f"threads must be positive, got {threads}")
    quantized = isinstance(table, Int8Table)
    n_req, n_ads = p.shape[0], table.b.shape[0] if quantized else table[2].shape[0]
    k_out = min(k, n_ads)
    if n_req == 0 or n_ads == 0:
        return torch.full((n_req, k_out), -math.inf), torch.full((n_req, k_out), NO_ROW)
    if quantized:
        stats = _table_stats(table.g, table.x, table.b, table.g_scale, table.x_scale)
    else:
        stats = _table_stats(*table)
    if not _in_range(q, v, p, stats):
        return torch_score_topk(q, v, p, *(table.dequantize() if quantized else table), mask, k)
    # on one core: an OpenMP team woken here would spin on the cores the workers need next
    with single_threaded(torch.get_num_threads()):
        few = _few_eligible(mask, n_req, n_ads, k_out)  # [B]
    take = _rows_of(table)

    def filtered(q, v, p, mask):
        return _filtered_topk(q, v, p, table, take, stats, mask, k_out, block, threads)

    def every(q, v, p, mask):
        n_threads = threads or torch.get_num_threads()
        return _every_eligible(q, v, p, take, n_ads, mask, k_out, n_threads)

    scores = torch.empty(n_req, k_out)  # [B, K']
    rows = torch.empty(n_req, k_out, dtype=torch.long)  # [B, K']
    for part, solve in ((few, every), (~few, filtered)):
        idx = part.nonzero()[:, 0]
        if len(idx):
            if isinstance(mask, PackedMask):
                part_mask = mask.select(idx)
            else:
                part_mask = mask if mask is None or mask.dim() == 1 else mask[idx]
            scores[idx], rows[idx] = solve(q[idx], v[idx], p[idx], part_mask)
    return scores, rows


def _filtered_topk(q, v, p, table, take, stats, mask, k_out: int, block, threads):
    """Steps 1-4 (the module docstring) for requests with more than k_out eligible ads."""
    n_req, n_exp = p.shape
    n_ads = len(stats.scan_bias)
    if isinstance(table, Int8Table):
        plan = _plan_int8(q, v, p, k_out)
    else:
        plan = _plan(q, v, p, table[0], table[1], k_out)
    if block is None:
        tile, most = (_INT8_TILE, INT8_MAX_BLOCK) if plan.quantized else (_TILE, _MAX_BLOCK)
        block = 1 << round(math.log2(max(tile / (n_req * n_exp), 1)))
        block = min(max(block, _MIN_BLOCK), most)
    block = min(block, n_ads)
    spans = _spans(n_ads, block)
    n_workers = min(threads or torch.get_num_threads(), len(spans))
    lib = native.library() if plan.quantized and plan.n_exp <= _NATIVE_MAX_EXPERTS else None
    if lib is not None:
        req, row, upper, tau = _compiled_pass(
            lib, plan, table, stats, mask, spans, block, n_workers
        )
    else:
        shared = _Threshold(n_req, k_out, plan.u_scan)
        workers = [_Worker(plan, table, stats, mask, shared, block) for _ in range(n_workers)]
        _spans_in_threads(
            n_workers,
            spans,
            lambda i, lo, hi: workers[i].scan(lo, hi),
            lambda i: workers[i].finish(),
        )
        parts = [w.cands[0] for w in workers if w.cands]
        if not parts:
            return torch.full((n_req, k_out), -math.inf), torch.full((n_req, k_out), NO_ROW)
        req, row, upper = (torch.cat(t) for t in zip(*parts, strict=True))
        tau = shared.for_refine
    if not len(req):
        return torch.full((n_req, k_out), -math.inf), torch.full((n_req, k_out), NO_ROW)
    keep = upper >= tau[req]
    req, row = req[keep], row[keep]
    order = torch.argsort(req * n_ads + row)  # by request, then row
    rows, valid = _by_request(req[order], row[order], n_req)
    # the finish is small: one core avoids waking a thread team (costly on a busy machine)
    with single_threaded(torch.get_num_threads()):
        return _exact_topk(q, v, p, take, rows, valid, k_out)
