"""Inference-time ablations of a trained moe: how much its answers rest on the gate and on each
expert family (`m31 ablate`).

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

from collections.abc import Callable

import torch

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


__all__ = ["QueryMap", "ablations", "expert_slots", "keep_slots", "uniform_gate"]
