"""Building blocks shared by the retrieval and ranking models.

Shapes: B requests, N ads, L sequence length, Lo organic length, k slots of one family,
h hidden width, H text-embedding dim.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from m31.model.inputs import N_TIME_BUCKETS, Catalog, RequestInputs
from m31.model.sequence import CausalSequenceEncoder

_HASH_MULT = 0x5DEECE66D  # odd multiplier: spreads consecutive ids across buckets


def hash_ids(ids: torch.Tensor, buckets: int, salt: int) -> torch.Tensor:
    """Ids (any int64, also unseen ones) -> [0, buckets)."""
    return torch.remainder((ids + salt) * _HASH_MULT + (ids >> 17), buckets)


def vocab_embedding(sizes: dict[str, int], name: str, h: int) -> nn.Embedding:
    """The embedding of a categorical vocabulary (`checkpoint.vocab_sizes`): its last row is
    the unknown value's (a null, or a value the vocabulary does not hold), zero and never
    trained, so an unknown value adds nothing."""
    return nn.Embedding(sizes[name], h, padding_idx=sizes[name] - 1)


def advertiser_embedding(table: nn.Embedding, advertiser: torch.Tensor, salt: int) -> torch.Tensor:
    """[.., h] the hashed embedding of external advertiser ids; zero for an ad without one (a
    negative id, `inputs.NO_ADVERTISER`): no advertiser input."""
    rows = hash_ids(advertiser.clamp_min(0), table.num_embeddings, salt)
    return table(rows) * (advertiser >= 0).unsqueeze(-1).to(table.weight.dtype)


def mlp(dims: list[int], last_activation: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2 or last_activation:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


class ItemEncoder(nn.Module):
    """An ad's content -> [.., h]: hashed id, topic, category, format, text, co-engagement and,
    where the data declares item attributes (`sizes["attributes"]` > 0) and the config reads
    them, the mean of its hashed attribute tokens' embeddings."""

    def __init__(self, cfg, sizes: dict[str, int], text_dim: int, cooc_dim: int) -> None:
        super().__init__()
        h = cfg.hidden
        self.id_buckets = cfg.id_buckets
        self.id = nn.Embedding(cfg.id_buckets, h)
        self.topic = vocab_embedding(sizes, "topic", h)
        self.category = vocab_embedding(sizes, "category", h)
        self.format = vocab_embedding(sizes, "format", h)
        self.text = nn.Linear(text_dim, h)
        self.cooc = nn.Linear(cooc_dim, h)
        self.norm = nn.LayerNorm(h)
        nn.init.normal_(self.id.weight, std=0.02)
        self.attribute_buckets = cfg.attribute_buckets if sizes.get("attributes", 0) else 0
        self.attributes = None
        if self.attribute_buckets:
            self.attributes = nn.Embedding(self.attribute_buckets, h)
            nn.init.normal_(self.attributes.weight, std=0.02)

    def forward(self, ads: Catalog) -> torch.Tensor:
        e = (
            self.id(hash_ids(ads.ad_id, self.id_buckets, 1))
            + self.topic(ads.topic)
            + self.category(ads.category)
            + self.format(ads.format)
            + self.text(ads.text_emb)
            + self.cooc(ads.cooc_emb)
        )
        if self.attributes is not None and ads.attributes.shape[-1]:
            e = e + self.attribute_mean(ads.attributes)
        return self.norm(e)

    def attribute_mean(self, tokens: torch.Tensor) -> torch.Tensor:
        """[.., T] attribute tokens (-1 padding) -> [.., h], the mean of their hashed rows (no
        token: zeros). One `embedding_bag` pass: the [.., T, h] gather a plain mean would build,
        and its backward, were a fifth of a training step on Sports (T = 16)."""
        flat = tokens.reshape(-1, tokens.shape[-1])
        valid = (flat >= 0).to(self.attributes.weight.dtype)
        weights = valid / valid.sum(-1, keepdim=True).clamp_min(1.0)
        rows = hash_ids(flat.clamp_min(0), self.attribute_buckets, 2)
        mean = F.embedding_bag(rows, self.attributes.weight, per_sample_weights=weights, mode="sum")
        return mean.reshape(*tokens.shape[:-1], -1)


class ContextEncoder(nn.Module):
    """Serving context (surface, hour, platform) -> [B, h]."""

    def __init__(self, h: int, sizes: dict[str, int]) -> None:
        super().__init__()
        self.surface = vocab_embedding(sizes, "surface", h)
        self.hour = nn.Embedding(24, h)
        self.platform = vocab_embedding(sizes, "platform", h)

    def forward(self, r: RequestInputs) -> torch.Tensor:
        return self.surface(r.surface) + self.hour(r.hour) + self.platform(r.platform)


class AttentionPool(nn.Module):
    """k learned queries, shifted by the context, attend over a sequence: [B, L, h] -> [B, k, h].

    A learned null key/value gives an empty history a state (no NaN). With `sink` it is attended
    beside every history as well, and training can put all the attention on it: every user then
    gets the same vector and the model ranks by popularity (one of three MovieLens trainings of
    the one-expert moe did, docs/QUALITY.md). Without, it is an empty history's state only.
    """

    def __init__(self, h: int, k: int, sink: bool = False) -> None:
        super().__init__()
        self.sink = sink
        self.queries = nn.Parameter(torch.randn(k, h) * 0.1)
        self.ctx = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.null = nn.Parameter(torch.zeros(1, 1, h))
        self.scale = h**-0.5

    def forward(self, seq: torch.Tensor, valid: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        b = seq.shape[0]
        seq = torch.cat([self.null.expand(b, 1, -1), seq], dim=1)  # [B, 1+L, h]
        null = valid.new_ones(b, 1) if self.sink else ~valid.any(1, keepdim=True)  # [B, 1]
        valid = torch.cat([null, valid], dim=1)  # [B, 1+L]
        q = self.queries[None] + self.ctx(ctx)[:, None, :]  # [B, k, h]
        att = torch.einsum("bkh,blh->bkl", q, self.key(seq)) * self.scale
        att = att.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)  # [B, k, 1+L]
        return torch.einsum("bkl,blh->bkh", att, self.value(seq))  # [B, k, h]


def masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, L, h] mean over valid positions -> [B, h] (zeros if none)."""
    w = valid.to(x.dtype)[..., None]
    return (x * w).sum(1) / w.sum(1).clamp_min(1.0)


class UserFeatures(nn.Module):
    """Per-family hidden states of a request: family name -> [B, k, h].

    * sequence: causal self-attention over the engaged ads (content, surface, position, time
      since; `m31.model.sequence`), its state after the latest engagement plus a learned offset
      per slot; or, with `sequence_encoder="pool"`, attention over them with one context-shifted
      learned query per slot;
    * cohort: demographic and cohort embeddings with the context;
    * semantic: attention over sentence embeddings of the engaged ads' texts;
    * coengagement: organic-engagement topics and the engaged ads' co-engagement embeddings.

    `states(r, catalog, every_position=True)` also gives the states after every history
    position, [B, L, k, h], of the families that read no later engagement there: the causal
    sequence encoder's, and the cohort family's (no history; the same at every position).
    Semantic and co-engagement pool the whole history, so they have none.
    """

    def __init__(self, cfg, sizes: dict[str, int], item: ItemEncoder, text_dim: int, cooc_dim: int):
        super().__init__()
        h = cfg.hidden
        self.slots = {name: k for name, k in cfg.experts.items() if k > 0}
        self.item = item
        self.context = ContextEncoder(h, sizes)
        self.hist_surface = vocab_embedding(sizes, "surface", h)
        self.hist_time = nn.Embedding(N_TIME_BUCKETS, h)
        self.sequence_time = cfg.sequence_time
        self.causal = cfg.sequence_encoder == "transformer"
        pools, trunks, offsets = {}, {}, {}
        for name, k in self.slots.items():
            if name in cfg.pooled_families:
                pools[name] = AttentionPool(h, k, sink=cfg.pool_sink)
            else:
                offsets[name] = nn.Parameter(torch.randn(k, h) * 0.1)
            trunks[name] = nn.Sequential(
                mlp([2 * h, 2 * h, h], last_activation=True), nn.LayerNorm(h)
            )
        self.pools = nn.ModuleDict(pools)
        self.trunks = nn.ModuleDict(trunks)
        self.offsets = nn.ParameterDict(offsets)
        if "sequence" in self.slots and self.causal:
            self.encoder = CausalSequenceEncoder(
                h, cfg.max_len, cfg.sequence_blocks, cfg.sequence_heads, cfg.dropout
            )
        if "semantic" in self.slots:
            self.sem_text = nn.Linear(text_dim, h)
        if "cohort" in self.slots:
            self.cohort = vocab_embedding(sizes, "cohort", h)
            self.age = vocab_embedding(sizes, "age", h)
            self.gender = vocab_embedding(sizes, "gender", h)
            self.country = vocab_embedding(sizes, "country", h)
        if "coengagement" in self.slots:
            self.organic = vocab_embedding(sizes, "topic", h)
            self.cooc = nn.Linear(cooc_dim, h)

    @property
    def position_families(self) -> list[str]:
        """The families with a state at every history position (see the class docstring)."""
        return [n for n in self.slots if n == "cohort" or (n == "sequence" and self.causal)]

    def forward(self, r: RequestInputs, catalog: Catalog) -> dict[str, torch.Tensor]:
        return self.states(r, catalog)[0]

    def states(
        self, r: RequestInputs, catalog: Catalog, every_position: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(family -> [B, k, h] at the request; with `every_position`, family -> [B, L, k, h]
        after each history position for the `position_families`, else None)."""
        ctx = self.context(r)  # [B, h]
        valid = r.hist_item >= 0  # [B, L]
        hist = catalog.take(r.hist_item)
        out, at = {}, {} if every_position else None
        for name in self.slots:
            if name == "sequence":
                seq = self.item(hist) + self.hist_surface(r.hist_surface)  # [B, L, h]
                if self.sequence_time:
                    seq = seq + self.hist_time(r.hist_time)
                if self.causal:
                    after = self.encoder(seq, valid)  # [B, L, h]
                    if at is not None:
                        at[name] = self._trunk(name, after[:, :, None] + self.offsets[name], ctx)
                    pooled = after[:, -1, None] + self.offsets[name][None]  # [B, k, h]
                else:
                    pooled = self.pools[name](seq, valid, ctx)  # [B, k, h]
            elif name == "semantic":
                seq = self.sem_text(hist.text_emb) + self.hist_time(r.hist_time)
                pooled = self.pools[name](seq, valid, ctx)
            elif name == "cohort":
                demo = (
                    self.cohort(r.cohort)
                    + self.age(r.age_bucket)
                    + self.gender(r.gender)
                    + self.country(r.country)
                )
                pooled = demo[:, None, :] + self.offsets[name][None]
            else:  # coengagement
                org_valid = r.organic >= 0
                organic = masked_mean(self.organic(r.organic.clamp_min(0)), org_valid)
                cooc = masked_mean(self.cooc(hist.cooc_emb), valid)
                pooled = (organic + cooc)[:, None, :] + self.offsets[name][None]
            out[name] = self._trunk(name, pooled, ctx)  # [B, k, h]
            if at is not None and name == "cohort":
                at[name] = out[name][:, None].expand(-1, valid.shape[1], -1, -1)  # [B, L, k, h]
        return out, at

    def _trunk(self, name: str, pooled: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """The family's trunk over its slots' states [B, .., k, h] with the context [B, h]."""
        c = ctx.view(ctx.shape[0], *([1] * (pooled.dim() - 2)), -1).expand_as(pooled)
        return self.trunks[name](torch.cat([pooled, c], dim=-1))


USER_ATTRIBUTES = ("cohort", "age_bucket", "gender", "country")  # what the cohort family reads


def idle_inputs(experts: dict[str, int], feats) -> dict[str, str]:
    """Family -> what it reads instead, for each family given slots in `experts` whose own
    inputs `feats` (`m31.features.Features`) lacks: item text (semantic), user attributes that
    tell users apart (cohort), organic events and co-engagement (coengagement). Such a family
    still trains, on what is left; said at training so that nobody reads its slots as more."""
    idle = {}
    if experts.get("semantic", 0) and not feats.text_emb.any():
        idle["semantic"] = "no item has text, so it reads only the history's time buckets"
    if experts.get("cohort", 0) and all(
        len(np.unique(feats.users[c])) <= 1 for c in USER_ATTRIBUTES
    ):
        idle["cohort"] = (
            f"every user has the same {', '.join(USER_ATTRIBUTES)}, so its slots are one "
            "learned vector each, read with the request's context"
        )
    if experts.get("coengagement", 0):
        organic, cooc = len(feats.organic.ts) > 0, bool(feats.cooc_emb.any())
        if not (organic and cooc):
            idle["coengagement"] = {
                (False, True): "no organic events, so it reads only the history's co-engagement "
                "embeddings",
                (True, False): "no item has co-engagement, so it reads only the organic events",
                (False, False): "no organic events and no co-engagement, so its slots are one "
                "learned vector each, read with the request's context",
            }[organic, cooc]
    return idle


def inputless(experts: dict[str, int], feats) -> dict[str, str]:
    """The families of `idle_inputs` that read nothing of the user at all (family -> why): no
    item text (semantic: the history's time buckets alone), users all alike (cohort), neither
    organic events nor co-engagement (co-engagement). Their slots learn one vector each."""
    idle = idle_inputs(experts, feats)
    both_missing = not len(feats.organic.ts) and not feats.cooc_emb.any()
    return {f: why for f, why in idle.items() if f != "coengagement" or both_missing}


class AdTower(nn.Module):
    """Ad features -> (g [N, G], x [N, D], b [N])."""

    def __init__(self, cfg, sizes: dict[str, int], item: ItemEncoder) -> None:
        super().__init__()
        h = cfg.hidden
        self.gate_dim, self.value_dim = cfg.effective_gate_dim, cfg.value_dim
        self.item = item
        self.advertiser = nn.Embedding(cfg.advertiser_buckets, h)
        self.objective = vocab_embedding(sizes, "objective", h)
        self.quality = nn.Linear(1, h)
        self.net = mlp([h, 2 * h, self.gate_dim + self.value_dim + 1])
        nn.init.normal_(self.advertiser.weight, std=0.02)

    def forward(self, ads: Catalog) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = (
            self.item(ads)
            + advertiser_embedding(self.advertiser, ads.advertiser, 2)
            + self.objective(ads.objective)
            + self.quality(ads.quality[..., None])
        )
        out = self.net(e)
        g, x, b = out.split([self.gate_dim, self.value_dim, 1], dim=-1)
        return g, x, b[..., 0]
