"""The cpu kernel's bounds: per call, the rounded query and the coefficients of its error bounds
(`Plan`); per pair, the bound of step 1 (`affinity_offset`) and of step 2 (`gate_bounds`).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, n ads per block, S pairs.

The expressions, and why they bound every score: DESIGN §5, "The bounds".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

U32 = 2.0**-24  # fp32 unit roundoff
BF16_U = 2.0**-8  # bf16 unit roundoff (8 significant bits, round to nearest)
SLACK = 2.0**-20  # relative slack for the fp32 arithmetic of the filters themselves
# step 2's exponentials may be off by a relative 2^-19 (the compiled ones, `exp_f` in
# csrc/step2.c; torch's are within an ulp): as a logit error, < 2^-18, added to η
_EXP_ETA = 2.0**-18
_FP32_ROWS = 32  # B·E from which bf16 tables take fp32 products without native bf16 (B = 4: 1.3x)
# survivors gathered before the sparse gate step runs: amortises per-op overhead (65,536 measured
# ~7% faster than 16,384 at B = 64, where a block has ~14 K survivors, and no different at B = 1, 16)
_REFINE_PAIRS = 65_536
# ... and with one request, where each block has a few thousand survivors and the threshold that
# the next blocks are filtered by only rises at a gate step (N = 1 M: 25-30% fewer survivors)
_REFINE_PAIRS_ONE = 16_384


def gamma(terms: int) -> float:
    """Error bound of an fp32 sum of `terms` products, relative to the sum of magnitudes."""
    return terms * U32 / (1 - terms * U32)


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
class Plan:
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
    # 8-bit tables (`plan_int8`): qh is then int8 [B, P·E, G] and vh int8 [P·B·E, D] (P = 1 or 2
    # parts, `int8._split_query`), with one scale per request that makes them the rounded query:
    # q[r]/√G ≈ q_scale[r]·w, v[r] ≈ v_scale[r]·w
    q_scale: torch.Tensor | None = None  # [B] fp32
    v_scale: torch.Tensor | None = None  # [B] fp32
    # ... and the same integers whole, for the compiled helpers (`native`): w = 255·hi + lo
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


def plan_float(q, v, p, g, x, k) -> Plan:
    """The `Plan` of a query against a floating-point table (g, x): the query rounded to the
    dtype of each product (`_product_dtype`), that rounding measured for η and the bounds."""
    n_req, n_exp, gdim = q.shape
    ddim = v.shape[2]
    q64, v64 = q.double(), v.double()
    gd, xd = _product_dtype(g, n_req * n_exp), _product_dtype(x, n_req * n_exp)
    u_l = BF16_U / (1 - BF16_U) if gd == torch.bfloat16 else 0.0
    u_a = BF16_U / (1 - BF16_U) if xd == torch.bfloat16 else 0.0
    if gdim:
        qs = (q.float() / math.sqrt(gdim)).to(gd)  # [B, E, G]
        dq = (qs.double() - q64 / math.sqrt(gdim)).norm(dim=2).amax(1)  # [B]
        q_norm = qs.double().norm(dim=2).amax(1)  # [B]
        eta_g = dq + (2 * gamma(gdim) + 2 * U32) * q_norm
        qh = qs.reshape(n_req * n_exp, gdim).contiguous()
    else:
        eta_g, qh = torch.zeros(n_req, dtype=torch.float64), None
    vh = v.float().to(xd)  # [B, E, D]
    dv = (vh.double() - v64).norm(dim=2).amax(1)  # [B]
    v_norm = vh.double().norm(dim=2).amax(1)  # [B]
    vh = vh.reshape(n_req * n_exp, ddim).contiguous()
    return bounds_plan(k, qh, vh, p, eta_g, dv, v_norm, ddim, u_l, u_a)


def bounds_plan(k, qh, vh, p, eta_g, dv, v_norm, ddim: int, u_l: float, u_a: float, **scales):
    """The `Plan` of a rounded query: qh, vh in the products' form; eta_g [B] the part of η
    that multiplies ‖g‖; dv [B], v_norm [B] the rounding of v and the norm of its rounded form
    (largest over E); u_l, u_a the relative output rounding of the logits and the affinities."""
    n_req, n_exp = p.shape
    kappa = (2 * n_exp + 64) * U32
    p32 = p.float()
    return Plan(
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
                dv + 2 * gamma(ddim) * v_norm,
            ],
            dim=1,
        ).float(),
        eta_l=u_l + 2.0**-21,
        u_a=u_a,
        u_scan=u_a / (1 - u_a),
        kappa=kappa,
        u_x=float((dv + (2 * gamma(ddim) + 4 * kappa) * v_norm).max()) * (1 + SLACK),
        **scales,
    )


def affinity_offset(plan: Plan, x_norm: torch.Tensor, scan_bias: torch.Tensor) -> torch.Tensor:
    """Step 1's per-ad offset'' [n]: keep a pair when M̂ + offset'' ≥ τ'' (τ'' = `for_scan`).

    U = M̂ + u'|M̂| + offset with offset = b + u_x‖x‖ + 2⁻²³|b|. With T = τ - offset, U ≥ τ
    implies M̂ ≥ T - u''|T| (u'' = u'/(1 - u')), and |T| ≤ |τ| + |offset|: so moving τ and offset
    each by u''|·| gives a test that never drops a pair with U ≥ τ and needs no pass over |M̂|.
    offset'' = scan_bias + u_x(1 + u'' + slack)‖x‖ ≥ offset + u''|offset|, with room for the fp32
    rounding of this arithmetic; fp32 rounding is monotone, so the rounded sum M̂ + offset'' is
    ≥ τ'' whenever the exact one is.
    """
    return torch.mul(x_norm, offset_alpha(plan)).add_(scan_bias)  # as `m31_pass` (no fma)


def offset_alpha(plan: Plan) -> float:
    """The coefficient of ‖x‖ in step 1's offset'' (`affinity_offset`)."""
    return plan.u_x * (1 + plan.u_scan + SLACK)


def gate_bounds(plan: Plan, req, gate, aff, g_norm, x_norm, bias):
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
