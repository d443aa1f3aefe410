"""Inference-time ablations of a trained moe: how much its answers rest on the gate and on each
expert family (`m31 ablate`: `ablate`).

Shapes: B requests, E expert slots.

The model is not retrained: each variant changes the query (q [B, E, G], v [B, E, D], p [B, E])
of the trained model before scoring, so the ad table, the scoring contract (DESIGN §2) and
everything else stay as trained.
* `uniform gate`: q = 0 and p = 0, so every ad weighs the E experts 1/E each. If this scores
  as well as the full model, the trained gate routes nothing that matters.
* `without F`: the slots of family F get a prior of -inf, so the gate spreads their weight over
  the other slots in its own proportions (the softmax renormalised without them).
* `only F`: the same with every other family removed.
A retrained ablation (E = 1, 2, 4, 8; a family absent from training) answers a different
question, what the model could learn without it; these answer what the trained model uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from m31.eval.offline import Progress
from m31.eval.stats import PairedComparison, SeedSummary
from m31.model.config import ModelConfig

Query = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
QueryMap = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Query]


def expert_slots(cfg: ModelConfig) -> dict[str, list[int]]:
    """Family -> its expert slots, in the order the model stacks them (`UserFeatures.slots`)."""
    if cfg.kind != "moe":
        raise ValueError(f"ablations need a moe checkpoint, got {cfg.kind!r}")
    out, start = {}, 0
    for family, k in cfg.experts.items():
        if k > 0:
            out[family] = list(range(start, start + k))
            start += k
    return out


def uniform_gate(q: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> Query:
    """Every expert weighted 1/E for every ad."""
    return torch.zeros_like(q), v, torch.zeros_like(p)


def keep_slots(slots: list[int]) -> QueryMap:
    """The gate restricted to `slots`: the others' priors set to -inf."""

    def run(q: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> Query:
        dropped = torch.ones(p.shape[1], dtype=torch.bool, device=p.device)
        dropped[slots] = False
        return q, v, p.masked_fill(dropped, float("-inf"))

    return run


def ablations(cfg: ModelConfig) -> dict[str, QueryMap | None]:
    """Name -> query map of every variant, "full" (None: the model as trained) first."""
    families = expert_slots(cfg)
    out: dict[str, QueryMap | None] = {"full": None, "uniform gate": uniform_gate}
    every = range(cfg.n_experts)
    for family, slots in families.items():
        if len(families) > 1:
            out[f"without {family}"] = keep_slots([s for s in every if s not in slots])
            out[f"only {family}"] = keep_slots(slots)
    return out


@dataclass
class AblationReport:
    """What `m31 ablate` prints and writes: one metric of every variant over the moe's seeds,
    of the models retrained as variants and of the reference models, each but the full model
    compared with it request by request."""

    metric: str
    requests: int
    ads: int
    seeds: int  # moe checkpoints
    summaries: dict[str, SeedSummary]  # name -> the metric over its seeds, variants first
    references: list[str]  # the names drawn beside (not variants)
    retrained: list[str]  # the variants that are retrained models
    vs_full: dict[str, PairedComparison]  # every name but "full"

    @property
    def variants(self) -> list[str]:
        return [name for name in self.summaries if name not in self.references]

    def rows(self) -> dict[str, dict]:
        rows = {}
        for name in [*self.variants, *self.references]:
            s = self.summaries[name]
            rows[name] = {"mean": s.mean, "std": None if math.isnan(s.std) else s.std}
            rows[name] |= {"seeds": s.seeds, "retrained": name in self.retrained}
            if name in self.vs_full:
                rows[name]["vs_full"] = self.vs_full[name].as_dict()
        return rows

    def to_dict(self) -> dict:
        return {
            "metric": self.metric,
            "requests": self.requests,
            "seeds": self.seeds,
            "variants": self.rows(),
        }

    def format(self) -> str:
        lines = [
            f"{self.requests:,} test requests, {self.ads:,} ads each; {self.seeds} moe seed(s); "
            f"{self.metric}, mean ± std over seeds, and each variant against the full model on "
            "the same requests:"
        ]
        width = max(len(name) for name in self.summaries)
        for name in [*self.variants, *self.references]:
            s = self.summaries[name]
            line = f"  {name:<{width}} {s.mean:.4f}"
            line += "" if math.isnan(s.std) else f" ± {s.std:.4f}"
            if name in self.vs_full:
                c = self.vs_full[name]
                line += f"   {c.ratio:.3f}x of full [{c.ratio_lo:.3f}, {c.ratio_hi:.3f}]"
            lines.append(line)
        return "\n".join(lines)

    def plot(self, path: Path) -> Path:
        from m31.eval.plot import plot_ablation

        return plot_ablation(
            {name: (self.summaries[name].mean, self.summaries[name].std) for name in self.variants},
            {name: self.summaries[name].mean for name in self.references},
            self.metric,
            path,
            retrained=set(self.retrained),
        )


def ablate(
    data: Path,
    moes: list[Path],
    references: dict[str, list[Path]] | None = None,
    retrained: dict[str, list[Path]] | None = None,
    *,
    split: str = "leave-last-out",
    metric: str = "hr@10",
    max_users: int | None = None,
    exclude_seen: bool | None = None,
    device: str = "cpu",
    progress: Progress | None = None,
) -> AblationReport:
    """Every variant of each moe checkpoint in `moes` (one per training seed) scored over the
    full corpus on the same test requests of `data`, beside the models `retrained` as variants
    (name -> checkpoints, moes) and the `references` (name -> checkpoints, any retrieval model);
    `metric` hr@K or ndcg@K. Names the command line's options in its messages."""
    import numpy as np

    from m31.data.dataset import repeat_engagement
    from m31.eval.offline import evaluate
    from m31.eval.runs import SeedRuns, load_scorer
    from m31.features.folder import features_for
    from m31.model import Catalog

    kind, _, cutoff = metric.partition("@")
    if kind not in ("hr", "ndcg") or not cutoff.isdigit() or int(cutoff) <= 0:
        raise ValueError(f"--metric: expected hr@K or ndcg@K, got {metric!r}")
    references, retrained = references or {}, retrained or {}
    clash = (set(references) & set(retrained)) | ((set(references) | set(retrained)) & {"full"})
    if clash:
        raise ValueError(f"--reference/--retrained: the name {sorted(clash)[0]!r} is taken")
    feats = features_for(data, split)
    if exclude_seen is None:
        exclude_seen = not repeat_engagement(feats.meta)
    catalog = Catalog.from_features(feats).to(device)
    seeds = SeedRuns()
    others = {**retrained, **references}
    for s in range(max([len(moes), *(len(p) for p in others.values())])):
        fns = _variants(moes[s], feats, device, catalog) if s < len(moes) else {}
        for name, paths in others.items():
            if s < len(paths):
                fns[name] = load_scorer(paths[s], feats, device, catalog)
                if name in retrained and fns[name].model.cfg.kind != "moe":
                    raise ValueError(
                        f"--retrained: {paths[s]} is a {fns[name].model.cfg.kind} checkpoint"
                    )
        metrics, ranks = evaluate(
            fns,
            feats,
            split="test",
            ks=(int(cutoff),),
            max_users=max_users,
            exclude_seen=exclude_seen,
            progress=progress,
            return_ranks=True,
        )
        for name in fns:
            seeds.add(name, metrics[name], ranks[name])
    summaries = {name: s[metric] for name, s in seeds.summaries().items()}
    full_ranks = np.stack(seeds.ranks["full"])
    return AblationReport(
        metric=metric,
        requests=full_ranks.shape[-1],
        ads=feats.n_ads,
        seeds=len(moes),
        summaries=summaries,
        references=list(references),
        retrained=list(retrained),
        vs_full={name: seeds.paired(name, "full", metric) for name in summaries if name != "full"},
    )


def _variants(path: Path, feats, device: str, catalog) -> dict:
    """Every variant (`ablations`) of the moe checkpoint at `path`, by name."""
    from m31.eval.runs import load_scorer
    from m31.model import ScoreFunction

    full = load_scorer(path, feats, device, catalog)
    if full.model.cfg.kind != "moe":
        raise ValueError(f"--model: {path} is a {full.model.cfg.kind} checkpoint, not a moe")
    return {
        name: full
        if query_map is None
        else ScoreFunction(full.model, feats, catalog, query_map=query_map)
        for name, query_map in ablations(full.model.cfg).items()
    }


__all__ = [
    "AblationReport",
    "QueryMap",
    "ablate",
    "ablations",
    "expert_slots",
    "keep_slots",
    "uniform_gate",
]
