"""The contract every score·top-K implementation keeps (DESIGN §2, §5): the shapes it takes,
`check_args`, the row that marks an empty slot, `NO_ROW`, and the error a non-finite query
raises, `NonFiniteQueryError`.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim.
"""

from __future__ import annotations

import torch

from m31.ops.masks import PackedMask

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
