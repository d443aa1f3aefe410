"""The dense interaction retrieval model: the design the moe's gate replaces (DESIGN §3).

Shapes: B requests, C candidates per request, D value dim, H the MLP's widths.

The same user towers and ad tower as the retrieval models give a user vector u [B, D] (the
two-tower model's joint MLP over every slot) and an ad vector a [C, D]; an MLP then reads each
pair, score(u, a) = MLP([u, a, u ⊙ a]) + b_a, the interaction of the 2024 design that
Andromeda's MoE gate approaches at a fraction of the FLOPs. Unlike the moe's score it is not a
sum of per-request and per-ad parts, so no index can hold it: like the ranking model it scores
given candidates, and it is compared with the moe by `m31 eval`, never served.

The first layer is split by its input, W [u, a, u ⊙ a] = W_u u + W_a a + W_p (u ⊙ a): the first
two terms are computed once per request and once per ad, so a pair costs the third, the sum,
and the layers after it (`flops_per_pair`).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from m31.model.config import ModelConfig
from m31.model.inputs import Catalog, RequestInputs
from m31.model.towers import AdTower, ItemEncoder, UserFeatures, mlp


class DenseModel(nn.Module):
    def __init__(self, cfg: ModelConfig, sizes: dict[str, int], text_dim: int, cooc_dim: int):
        super().__init__()
        if cfg.kind != "dense":
            raise ValueError(f"DenseModel is the dense model, not {cfg.kind!r}")
        self.cfg = cfg
        h, d = cfg.hidden, cfg.value_dim
        widths = cfg.ranking_mlp  # the pair MLP's hidden widths, as the ranking model's
        item = ItemEncoder(cfg, sizes, text_dim, cooc_dim)
        self.user = UserFeatures(cfg, sizes, item, text_dim, cooc_dim)
        self.ads = AdTower(cfg, sizes, item)  # G = 0: (an empty g, x [.., D], b [..])
        slots = sum(self.user.slots.values())
        self.joint = mlp([slots * h, 2 * h, d])
        self.first_u = nn.Linear(d, widths[0])
        self.first_a = nn.Linear(d, widths[0], bias=False)
        self.first_p = nn.Linear(d, widths[0], bias=False)
        self.act = nn.GELU()
        self.rest = mlp([*widths, 1])

    def encode_user(self, r: RequestInputs, catalog: Catalog) -> torch.Tensor:
        """u [B, D]."""
        states = self.user(r, catalog)
        return self.joint(torch.cat([states[n].flatten(1) for n in self.user.slots], dim=1))

    def forward(self, r: RequestInputs, catalog: Catalog, cand_rows: torch.Tensor) -> torch.Tensor:
        """Scores [B, C] of each request's candidate ad rows cand_rows [B, C] (or [C], shared)."""
        u = self.encode_user(r, catalog)  # [B, D]
        _, a, b = self.ads(catalog.take(cand_rows.reshape(-1)))  # [n, D], [n]
        a, b = a.reshape(*cand_rows.shape, -1), b.reshape(cand_rows.shape)
        if cand_rows.dim() == 1:  # shared: [C, D] -> [1, C, D]
            a, b = a[None], b[None]
        pair = u[:, None, :] * a  # [B, C, D]
        first = self.first_u(u)[:, None, :] + self.first_a(a) + self.first_p(pair)  # [B, C, H0]
        return self.rest(self.act(first))[..., 0] + b

    def flops_per_pair(self) -> int:
        """Pair-specific FLOPs only (request-side and ad-side work amortised away): the product
        u ⊙ a, its first-layer term, the two adds, then the MLP's later layers and the bias."""
        d, widths = self.cfg.value_dim, self.cfg.ranking_mlp
        first = d + 2 * d * widths[0] + 2 * widths[0]
        rest = sum(2 * i * o for i, o in itertools.pairwise([*widths, 1]))
        return first + rest + 1
