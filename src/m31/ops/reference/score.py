"""The scoring function of DESIGN §2, in plain fp32 PyTorch: the definition of correct.

Shapes: B requests, N ads, E user experts, G gate-key dim, D value dim.

    logit[r, a, e] = <q[r, e], g[a]> / sqrt(G) + p[r, e]     # attention of ad a over experts
    w[r, a, :]     = softmax_e(logit[r, a, :])                 # MoE gate
    s[r, a]        = sum_e w[r, a, e] * <v[r, e], x[a]> + b[a]

A two-tower model is the case E = 1 (and G = 0: no gate key at all).

`score` is the model's fp32 forward. The top-K kernels rank and return `rounded_score`: the same
formula evaluated in fp64 and rounded to fp32 once. An fp32 evaluation depends on where an ad
sits (BLAS sums the rows at a tile's edge in another order; vectorised loops finish with scalar
code and another exp), so byte-identical ads could score an ulp apart and tie out of row order.
In fp64 such differences are ~2⁻⁵⁰ of the terms' magnitudes and vanish in the rounding unless a
score lies that close to the middle between two fp32 numbers (about once in 10⁷ random scores).
"""

from __future__ import annotations

import math

import torch


def _gate(q: torch.Tensor, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """w [B, E, N] of q [B, E, G], p [B, E], g [N, G] (or [B, N, G], each request's own ads):
    the experts along dim 1, so that the softmax over E and the sum over E in `_score` run
    along the ads' contiguous rows (much faster on a CPU than with the experts last)."""
    if q.shape[-1] == 0:
        logit = p[:, :, None].expand(-1, -1, g.shape[-2])  # no gate key: priors alone route
    else:
        rows = "n" if g.dim() == 2 else "bn"
        logit = torch.einsum(f"bec,{rows}c->ben", q, g) / math.sqrt(q.shape[-1]) + p[:, :, None]
    return torch.softmax(logit, dim=1)


def _score(q, v, p, g, x, b) -> tuple[torch.Tensor, torch.Tensor]:
    """(s [B, N], w [B, E, N]) in the inputs' dtype."""
    w = _gate(q, p, g)
    rows = "n" if x.dim() == 2 else "bn"
    affinity = torch.einsum(f"bec,{rows}c->ben", v, x)  # [B, E, N]
    return (w * affinity).sum(1) + b, w


def score(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    return_gate: bool = False,
):
    """s [B, N] (and the gate [B, N, E] with `return_gate`), computed in fp32.

    q [B, E, G], v [B, E, D], p [B, E] from the request; g [N, G], x [N, D], b [N] from the ads
    shared by the requests, or g [B, N, G], x [B, N, D], b [B, N] to score each request against
    its own N ads (a ranking stage's candidates).
    """
    s, w = _score(*(t.float() for t in (q, v, p, g, x, b)))
    return (s, w.transpose(1, 2)) if return_gate else s


def value_bias(b: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
    """The bias a pass scores, fp32: b, or with a value column (DESIGN §2, "The value term")
    b + value, one fp32 addition, so that every kernel adds the same number."""
    return b.float() if value is None else b.float() + value


def rounded_score(q, v, p, g, x, b) -> torch.Tensor:
    """s [B, N] fp32: the §2 score evaluated in fp64, rounded to fp32 once (module docstring).

    q [B, E, G], v [B, E, D], p [B, E]; the ads g [N, G], x [N, D], b [N] shared by the requests,
    or g [B, N, G], x [B, N, D], b [B, N] to score each request against its own N ads.
    """
    return _score(*(t.double() for t in (q, v, p, g, x, b)))[0].float()
