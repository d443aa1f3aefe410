"""Retrieval models: the mixture of experts of DESIGN §2-3, and the two-tower baseline.

Shapes: B requests, N ads, E expert slots, G gate-key dim, D value dim, h hidden width.

Both produce exactly what the index and kernels consume: per request (q [B, E, G], v [B, E, D],
p [B, E]) and per ad (g [N, G], x [N, D], b [N]); scores are `m31.ops.score`. The two-tower model
is the case E = 1, G = 0: one user tower over the same features, a plain dot product.

Context conditioning of the ad side: the request's context generates a linear map M(ctx) [D, D]
that modulates every ad's value, x'[a] = M(ctx) x[a]. Since <v, M x> = <M^T v, x>, it is folded
into the query (v' = M^T v) at no per-ad cost, which keeps the model scorable exhaustively.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m31.model.config import ModelConfig
from m31.model.inputs import Catalog, RequestInputs
from m31.model.towers import AdTower, ItemEncoder, UserFeatures, mlp
from m31.ops import score


class RetrievalModel(nn.Module):
    def __init__(self, cfg: ModelConfig, sizes: dict[str, int], text_dim: int, cooc_dim: int):
        super().__init__()
        if cfg.kind not in ("moe", "two-tower"):
            raise ValueError(f"RetrievalModel is moe or two-tower, not {cfg.kind!r}")
        self.cfg = cfg
        h, d = cfg.hidden, cfg.value_dim
        self.E, self.G, self.D = cfg.n_experts, cfg.effective_gate_dim, d
        item = ItemEncoder(cfg, sizes, text_dim, cooc_dim)
        self.user = UserFeatures(cfg, sizes, item, text_dim, cooc_dim)
        self.ads = AdTower(cfg, sizes, item)
        out = self.G + self.D + 1
        if cfg.kind == "moe":
            self.head_w = nn.Parameter(torch.randn(self.E, h, out) * h**-0.5)
            self.head_b = nn.Parameter(torch.zeros(self.E, out))
        else:
            slots = sum(self.user.slots.values())
            self.joint = mlp([slots * h, 2 * h, out])
        self.modulation = nn.Linear(h, d * d)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def context_map(self, r: RequestInputs) -> torch.Tensor:
        """M(ctx): [B, D, D], the identity plus a learned context-dependent part."""
        eye = torch.eye(self.D, device=r.surface.device)
        ctx = self.user.context(r)
        return eye + self.modulation(ctx).view(-1, self.D, self.D)

    def encode_requests(
        self, r: RequestInputs, catalog: Catalog, fold_context: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [B, E, G], v [B, E, D], p [B, E]); with `fold_context`, v already holds M^T v."""
        return self._query(self.user(r, catalog), r, fold_context)

    def encode_positions(self, r: RequestInputs, catalog: Catalog):
        """The query at the request, as `encode_requests`, and after every history position:
        (q [B, L, E', G], v [B, L, E', D], p [B, L, E']) from the slots of the families with a
        state there (`UserFeatures.position_families`: the causal sequence expert, the cohort),
        which the moe's gate then weighs alone; the two-tower model needs all its families to
        have one. v is folded with the request's context map."""
        states, at = self.user.states(r, catalog, every_position=True)
        families = self.user.position_families
        if "sequence" not in families:
            raise ValueError("a query at every position needs the causal sequence expert")
        if self.cfg.kind == "moe":
            slots, start = [], 0
            for name, k in self.user.slots.items():
                if name in families:
                    slots += range(start, start + k)
                start += k
            hcat = torch.cat([at[n] for n in families], dim=2)  # [B, L, E', h]
            w, bias = self.head_w[slots], self.head_b[slots]
            out = torch.einsum("bleh,eho->bleo", hcat, w) + bias  # [B, L, E', G+D+1]
        else:
            if set(families) != set(self.user.slots):
                raise ValueError(
                    "a two-tower query at every position needs every family to have one; "
                    f"{sorted(set(self.user.slots) - set(families))} pool the whole history"
                )
            flat = torch.cat([at[n].flatten(2) for n in self.user.slots], dim=2)  # [B, L, k·h]
            out = self.joint(flat)[:, :, None, :]  # [B, L, 1, D+1]
        q, v, p = out.split([self.G, self.D, 1], dim=-1)
        v = torch.einsum("bij,blei->blej", self.context_map(r), v)
        return self._query(states, r), (q, v, p[..., 0])

    def _query(self, states: dict[str, torch.Tensor], r: RequestInputs, fold_context: bool = True):
        if self.cfg.kind == "moe":
            hcat = torch.cat([states[n] for n in self.user.slots], dim=1)  # [B, E, h]
            out = torch.einsum("beh,eho->beo", hcat, self.head_w) + self.head_b  # [B, E, G+D+1]
        else:
            flat = torch.cat([states[n].flatten(1) for n in self.user.slots], dim=1)
            out = self.joint(flat)[:, None, :]  # [B, 1, D+1]
        q, v, p = out.split([self.G, self.D, 1], dim=-1)
        if fold_context:
            v = torch.einsum("bij,bei->bej", self.context_map(r), v)  # v' = M^T v
        return q, v, p[..., 0]

    def encode_ads(self, ads: Catalog) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [N, G], x [N, D], b [N])."""
        return self.ads(ads)

    def forward(self, r: RequestInputs, catalog: Catalog, candidates: Catalog):
        """Scores of every request against every candidate, and the gate: [B, N], [B, N, E]."""
        q, v, p = self.encode_requests(r, catalog)
        g, x, b = self.encode_ads(candidates)
        return score(q, v, p, g, x, b, return_gate=True)

    def flops_per_pair(self) -> int:
        """Multiply-adds x 2 of DESIGN §2 per (request, ad): 2·E·(G+D), plus the bias add."""
        return 2 * self.E * (self.G + self.D) + 1


def balance_loss(gate: torch.Tensor) -> torch.Tensor:
    """Negative mutual information between ads and experts under the gate: [B, N, E] -> scalar.

    H(mean gate) - mean H(gate): high when experts are used evenly overall (no collapse) yet
    each ad is routed decisively. Minimising its negative keeps every expert in use.
    """
    eps = 1e-9
    w = gate.reshape(-1, gate.shape[-1])
    mean = w.mean(0)
    h_mean = -(mean * (mean + eps).log()).sum()
    mean_h = -(w * (w + eps).log()).sum(-1).mean()
    return mean_h - h_mean


def expert_usage(gate: torch.Tensor) -> dict:
    """Share of gate weight per expert and its entropy relative to uniform (1.0 = even)."""
    share = gate.reshape(-1, gate.shape[-1]).mean(0)
    e = share.numel()
    ent = (
        float(-(share * (share + 1e-12).log()).sum() / torch.log(torch.tensor(float(e))))
        if e > 1
        else 1.0
    )
    return {"share": [round(float(s), 4) for s in share], "evenness": round(ent, 4)}


def sampled_softmax_loss(
    scores: torch.Tensor,
    log_q: torch.Tensor,
    pos_cols: torch.Tensor,
    cand_ids: torch.Tensor,
    pos_ids: torch.Tensor,
) -> torch.Tensor:
    """Sampled softmax with logQ correction.

    scores [B, C]; log_q and cand_ids [C] (one candidate set for all requests) or [B, C]: the log
    probability that sampling put each candidate in the set, and its ad row; pos_cols [B] the
    column of each request's positive, pos_ids [B] its ad row. Candidates equal to the request's
    positive in any other column are masked: they are not negatives.
    """
    logits = scores - log_q
    same = cand_ids.expand_as(scores) == pos_ids[:, None]  # [B, C]
    same[torch.arange(len(pos_cols)), pos_cols] = False
    return F.cross_entropy(logits.masked_fill(same, float("-inf")), pos_cols)
