"""Exhaustive score + filter + top-K in plain PyTorch: the reference the fused kernels must match.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, C ads per chunk.

The ad table is scored chunk by chunk (memory stays O(B·C·E) however large N is), each chunk is
masked by eligibility and cut to its own top K, and a running top K is merged chunk after chunk.
Ties are broken by the lower ad row: sorts are stable, every chunk's rows come in row order, and
the running list (rows of earlier chunks) always stands before the new chunk when merged. Scores
are `rounded_score`, so byte-identical ads get identical scores wherever they sit. An ad whose
score is NaN (NaN or ±inf in its table row, see `score_topk`) is treated as ineligible.
"""

from __future__ import annotations

import torch

from m31.ops.masks import PackedMask, mask_rows
from m31.ops.torch_score import rounded_score, value_bias

NO_ROW = -1


class NonFiniteQueryError(ValueError):
    """A query tensor (q, v or p) holds NaN or ±inf: no §2 score is defined for that request."""


def check_args(q, v, p, g, x, b, mask, k, value=None) -> tuple[int, int, int]:
    """(B, E, N) of a score·top-K problem, or ValueError naming what is off. Every
    implementation takes these shapes: q [B, E, G], v [B, E, D], p [B, E], g [N, G], x [N, D],
    b [N], mask bool [N] or [B, N] or a `PackedMask` of B requests over N rows or None, k a
    positive int, value None or fp32 [N] on b's device (like b, a non-finite value makes
    the ad's score non-finite, see `score_topk`); and a finite query
    (NonFiniteQueryError otherwise: the kernels would disagree on what NaN means)."""
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be positive (an int), got {k!r}")
    if q.dim() != 3 or v.dim() != 3 or p.dim() != 2:
        raise ValueError(
            "query must be q [B, E, G], v [B, E, D], p [B, E]; "
            f"got {tuple(q.shape)}, {tuple(v.shape)}, {tuple(p.shape)}"
        )
    n_req, n_exp = p.shape
    if q.shape[:2] != (n_req, n_exp) or v.shape[:2] != (n_req, n_exp):
        raise ValueError(
            f"q, v and p disagree on B or E: {tuple(q.shape)}, {tuple(v.shape)}, {tuple(p.shape)}"
        )
    if n_exp < 1:
        raise ValueError("the query needs at least one expert (E >= 1)")
    n_ads = x.shape[0] if x.dim() == 2 else -1
    if g.shape != (n_ads, q.shape[2]) or x.shape != (n_ads, v.shape[2]) or b.shape != (n_ads,):
        raise ValueError(
            f"ad table must be g [N, {q.shape[2]}], x [N, {v.shape[2]}], b [N]; "
            f"got {tuple(g.shape)}, {tuple(x.shape)}, {tuple(b.shape)}"
        )
    if value is not None:
        _check_value(value, n_ads, b.device)
    if isinstance(mask, PackedMask):
        mask.check(n_req, n_ads)
    elif mask is not None and (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or mask.shape not in ((n_ads,), (n_req, n_ads))
    ):
        raise ValueError(
            f"mask must be bool [{n_ads}] or [{n_req}, {n_ads}], got {mask.dtype} "
            f"{tuple(mask.shape)}"
        )
    for name, t in (("q", q), ("v", v), ("p", p)):
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteQueryError(
                f"query {name} {tuple(t.shape)} holds NaN or ±inf; every value must be finite"
            )
    return n_req, n_exp, n_ads


def _check_value(value, n_ads: int, device: torch.device) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"value must be a float32 tensor [{n_ads}], got {type(value).__name__}")
    if value.dtype != torch.float32 or value.shape != (n_ads,) or value.device != device:
        raise ValueError(
            f"value must be float32 [{n_ads}] on {device}, "
            f"got {value.dtype} {tuple(value.shape)} on {value.device}"
        )


def torch_score_topk(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    chunk: int = 32_768,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, K'], rows [B, K']) with K' = min(k, N), best first.

    `mask` is bool [N] (one eligibility for all requests) or [B, N], a `PackedMask`, or None
    (all eligible). `value`: None, or fp32 [N], each ad's value term, scored as part of its
    bias (`value_bias`: b + value in fp32).
    Requests with fewer than K' eligible ads get rows NO_ROW and scores -inf in the tail.
    """
    check_args(q, v, p, g, x, b, mask, k, value)
    n_req, n_ads = q.shape[0], g.shape[0]
    k_out = min(k, n_ads)
    best_s = torch.full((n_req, 0), float("-inf"), device=q.device)
    best_r = torch.full((n_req, 0), NO_ROW, dtype=torch.long, device=q.device)
    for lo in range(0, n_ads, chunk):
        hi = min(lo + chunk, n_ads)
        bias = value_bias(b[lo:hi], None if value is None else value[lo:hi])  # [C]
        s = rounded_score(q, v, p, g[lo:hi], x[lo:hi], bias)  # [B, C] fp32
        dropped = s.isnan()  # [B, C]
        if mask is not None:
            dropped |= ~mask_rows(mask, lo, hi)
        s = s.masked_fill(dropped, float("-inf"))
        s, order = torch.sort(s, dim=1, descending=True, stable=True)
        s, rows = s[:, :k_out], order[:, :k_out] + lo  # [B, <=K]
        merged_s = torch.cat([best_s, s], dim=1)
        merged_r = torch.cat([best_r, rows], dim=1)
        merged_s, order = torch.sort(merged_s, dim=1, descending=True, stable=True)
        best_s = merged_s[:, :k_out]
        best_r = merged_r.gather(1, order[:, :k_out])
    best_r = best_r.masked_fill(best_s == float("-inf"), NO_ROW)
    return best_s, best_r
