"""The ranking model: a heavy cross model that defines "ranking-level" quality.

Shapes: B requests, C candidates per request, L sequence length, h hidden width.

Unlike the retrieval models it cannot be split into a request part and an ad part: the candidate
attends over the whole engagement history (target attention), and an MLP reads user, ad, context
and explicit cross features of each pair. That costs hundreds of times the FLOPs of the §2 scorer
per (request, ad) pair, which is why it only ranks what retrieval returns.

With a base (`ModelConfig.ranking_base`), a trained retrieval model sits inside it, frozen, and
the ranking model's score is the base's §2 score plus its own: it learns a correction to the
order retrieval already has. Its output layer starts at zero, so before training it ranks
exactly as the base does, and training keeps the epoch with the best validation (epoch 0: the
base alone), so it is never worse than the base on the validation split.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from m31.model.config import ModelConfig
from m31.model.inputs import N_TIME_BUCKETS, Catalog, RequestInputs
from m31.model.retrieval import RetrievalModel
from m31.model.towers import (
    ContextEncoder,
    ItemEncoder,
    advertiser_embedding,
    masked_mean,
    mlp,
    vocab_embedding,
)
from m31.ops import score

N_CROSS = 5


class RankingModel(nn.Module):
    def __init__(self, cfg: ModelConfig, sizes: dict[str, int], text_dim: int, cooc_dim: int):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.item = ItemEncoder(cfg, sizes, text_dim, cooc_dim)
        self.context = ContextEncoder(h, sizes)
        self.hist_surface = vocab_embedding(sizes, "surface", h)
        self.hist_time = nn.Embedding(N_TIME_BUCKETS, h)
        self.advertiser = nn.Embedding(cfg.advertiser_buckets, h)
        self.objective = vocab_embedding(sizes, "objective", h)
        self.quality = nn.Linear(1, h)
        self.cohort = vocab_embedding(sizes, "cohort", h)
        self.age = vocab_embedding(sizes, "age", h)
        self.gender = vocab_embedding(sizes, "gender", h)
        self.country = vocab_embedding(sizes, "country", h)
        self.organic = vocab_embedding(sizes, "topic", h)
        # The codes of an unknown topic and category: two ads without one share nothing.
        self.unknown_topic, self.unknown_category = sizes["topic"] - 1, sizes["category"] - 1
        self.att_q = nn.Linear(h, h)
        self.att_k = nn.Linear(h, h)
        self.att_v = nn.Linear(h, h)
        self.in_dim = 8 * h + N_CROSS
        self.mlp = mlp([self.in_dim, *cfg.ranking_mlp, 1])
        base = cfg.base_config()
        self.base = None if base is None else RetrievalModel(base, sizes, text_dim, cooc_dim)
        if self.base is not None:
            self.base.requires_grad_(False)
            out = self.mlp[-1]
            nn.init.zeros_(out.weight)  # the correction starts at zero: the base's order
            nn.init.zeros_(out.bias)

    def train(self, mode: bool = True) -> RankingModel:
        super().train(mode)
        if self.base is not None:
            self.base.eval()  # frozen: always in inference mode
        return self

    def base_score(
        self, r: RequestInputs, catalog: Catalog, cand_rows: torch.Tensor
    ) -> torch.Tensor:
        """The base model's §2 scores [B, C] of cand_rows [B, C] (or [C], shared), reading the
        last `max_len` history events it was trained with."""
        n = self.base.cfg.max_len
        hist = {k: getattr(r, k)[:, -n:] for k in ("hist_item", "hist_surface", "hist_time")}
        q, v, p = self.base.encode_requests(dataclasses.replace(r, **hist), catalog)
        g, x, b = self.base.encode_ads(catalog.take(cand_rows.reshape(-1)))
        if cand_rows.dim() == 2:
            g, x, b = (t.reshape(*cand_rows.shape, *t.shape[1:]) for t in (g, x, b))
        return score(q, v, p, g, x, b)

    def candidates(self, ads: Catalog) -> torch.Tensor:
        return (
            self.item(ads)
            + advertiser_embedding(self.advertiser, ads.advertiser, 2)
            + self.objective(ads.objective)
            + self.quality(ads.quality[..., None])
        )

    def forward(self, r: RequestInputs, catalog: Catalog, cand_rows: torch.Tensor) -> torch.Tensor:
        """Scores [B, C] of each request's candidate ad rows cand_rows [B, C] (or [C], shared)."""
        b = len(r)
        base = 0.0 if self.base is None else self.base_score(r, catalog, cand_rows)
        if cand_rows.dim() == 1:
            cand_rows = cand_rows[None, :].expand(b, -1)
        valid = r.hist_item >= 0  # [B, L]
        hist = catalog.take(r.hist_item)
        seq = self.item(hist) + self.hist_surface(r.hist_surface) + self.hist_time(r.hist_time)
        cand_feats = catalog.take(cand_rows)
        cand = self.candidates(cand_feats)  # [B, C, h]

        # Target attention: each candidate queries the whole history.
        att = (
            torch.einsum("bch,blh->bcl", self.att_q(cand), self.att_k(seq)) * seq.shape[-1] ** -0.5
        )
        att = att.masked_fill(~valid[:, None, :], -1e4).softmax(-1)
        target = torch.einsum("bcl,blh->bch", att, self.att_v(seq)) * valid.any(1)[:, None, None]

        mean_hist = masked_mean(seq, valid)  # [B, h]
        demo = (
            self.cohort(r.cohort)
            + self.age(r.age_bucket)
            + self.gender(r.gender)
            + self.country(r.country)
        )
        org_valid = r.organic >= 0
        organic = masked_mean(self.organic(r.organic.clamp_min(0)), org_valid)
        ctx = self.context(r)
        user = torch.cat([mean_hist, demo, organic, ctx], dim=-1)  # [B, 4h]

        vf = valid.float()
        n_hist = vf.sum(1).clamp_min(1.0)[:, None]  # [B, 1]
        same_topic = (cand_feats.topic[:, :, None] == hist.topic[:, None, :]) & (
            cand_feats.topic != self.unknown_topic
        )[:, :, None]  # [B, C, L]
        same_category = (cand_feats.category[:, :, None] == hist.category[:, None, :]) & (
            cand_feats.category != self.unknown_category
        )[:, :, None]
        hist_text = masked_mean(hist.text_emb, valid)  # [B, H]
        hist_cooc = masked_mean(hist.cooc_emb, valid)
        cross = torch.stack(
            [
                torch.einsum("bch,bh->bc", cand_feats.text_emb, hist_text),
                torch.einsum("bch,bh->bc", cand_feats.cooc_emb, hist_cooc),
                torch.einsum("bcl,bl->bc", same_topic.float(), vf) / n_hist,
                torch.einsum("bcl,bl->bc", same_category.float(), vf) / n_hist,
                (cand_feats.topic[:, :, None] == r.organic[:, None, :]).float().mean(-1),
            ],
            dim=-1,
        )  # [B, C, N_CROSS]
        c = cand.shape[1]
        feats = torch.cat(
            [
                target,
                cand,
                cand * mean_hist[:, None, :],
                cand * ctx[:, None, :],
                user[:, None, :].expand(-1, c, -1),
                cross,
            ],
            dim=-1,
        )  # [B, C, 8h + N_CROSS]
        return self.mlp(feats)[..., 0] + base

    def flops_per_pair(self) -> int:
        """Pair-specific FLOPs only (request-side and ad-side work amortised away)."""
        h, L = self.cfg.hidden, self.cfg.max_len
        dims = [self.in_dim, *self.cfg.ranking_mlp, 1]
        mlp_flops = sum(2 * a * b for a, b in itertools.pairwise(dims))
        attention = 2 * h * h + 4 * L * h  # query projection, scores, weighted sum
        cross = 2 * (384 + self.item.cooc.in_features) + 4 * L
        base = 0 if self.base is None else self.base.flops_per_pair()
        return mlp_flops + attention + cross + base
