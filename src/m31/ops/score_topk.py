"""`score_topk`: the public dispatcher of the exhaustive score·filter·top-K pass (DESIGN §5).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results.
"""

from __future__ import annotations

import torch

from m31.ops.torch_score_topk import NO_ROW, torch_score_topk

KERNELS = ("torch",)


def score_topk(
    query: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ad_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    k: int,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K eligible ads of each request under the DESIGN §2 score, exact, ties to the lower row.

    query = (q [B, E, G], v [B, E, D], p [B, E]); ad_table = (g [N, G], x [N, D], b [N]);
    mask: bool [N] or [B, N] or None. Returns (scores [B, min(k, N)] fp32, rows [B, min(k, N)]
    int64), best first; a request with fewer eligible ads than that ends in rows NO_ROW (-1).
    """
    q, v, p = query
    g, x, b = ad_table
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if q.dim() != 3 or v.dim() != 3 or p.dim() != 2:
        raise ValueError(
            f"query must be q [B, E, G], v [B, E, D], p [B, E]; got {tuple(q.shape)}, {tuple(v.shape)}, {tuple(p.shape)}"
        )
    n_req, n_exp = p.shape
    if q.shape[:2] != (n_req, n_exp) or v.shape[:2] != (n_req, n_exp):
        raise ValueError(
            f"q, v and p disagree on B or E: {tuple(q.shape)}, {tuple(v.shape)}, {tuple(p.shape)}"
        )
    n_ads = g.shape[0]
    if g.shape[1] != q.shape[2] or x.shape != (n_ads, v.shape[2]) or b.shape != (n_ads,):
        raise ValueError(
            f"ad table must be g [N, {q.shape[2]}], x [N, {v.shape[2]}], b [N]; "
            f"got {tuple(g.shape)}, {tuple(x.shape)}, {tuple(b.shape)}"
        )
    if mask is not None and (
        mask.dtype != torch.bool or mask.shape not in ((n_ads,), (n_req, n_ads))
    ):
        raise ValueError(
            f"mask must be bool [{n_ads}] or [{n_req}, {n_ads}], got {mask.dtype} {tuple(mask.shape)}"
        )
    if kernel not in ("auto", *KERNELS):
        raise ValueError(f"unknown kernel {kernel!r}; choose auto or one of {', '.join(KERNELS)}")
    return torch_score_topk(q, v, p, g, x, b, mask, k)


__all__ = ["KERNELS", "NO_ROW", "score_topk"]
