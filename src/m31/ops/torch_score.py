"""The scoring function of DESIGN §2, in plain fp32 PyTorch: the definition of correct.

Shapes: B requests, N ads, E user experts, G gate-key dim, D value dim.

    logit[r, a, e] = <q[r, e], g[a]> / sqrt(G) + p[r, e]     # attention of ad a over experts
    w[r, a, :]     = softmax_e(logit[r, a, :])                 # MoE gate
    s[r, a]        = sum_e w[r, a, e] * <v[r, e], x[a]> + b[a]

A two-tower model is the case E = 1 (and G = 0: no gate key at all).
"""

from __future__ import annotations

import math

import torch


def gate_weights(q: torch.Tensor, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """w: q [B, E, G], p [B, E], g [N, G] -> [B, N, E]."""
    if q.shape[-1] == 0:
        logit = p[:, None, :].expand(-1, g.shape[0], -1)  # no gate key: priors alone route
    else:
        logit = torch.einsum("beg,ng->bne", q, g) / math.sqrt(q.shape[-1]) + p[:, None, :]
    return torch.softmax(logit, dim=-1)  # [B, N, E]


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

    q [B, E, G], v [B, E, D], p [B, E] from the request; g [N, G], x [N, D], b [N] from the ads.
    """
    q, v, p, g, x, b = (t.float() for t in (q, v, p, g, x, b))
    w = gate_weights(q, p, g)  # [B, N, E]
    affinity = torch.einsum("bed,nd->bne", v, x)  # [B, N, E]
    s = (w * affinity).sum(-1) + b[None, :]  # [B, N]
    return (s, w) if return_gate else s
