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

from m31.ops.contract import NO_ROW, check_args
from m31.ops.masks import PackedMask, mask_rows
from m31.ops.reference.score import rounded_score, value_bias


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
