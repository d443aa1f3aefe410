"""What `m31 train` trains when no preset is named: the recipe the dataset supports, said with
its reasons (docs/QUALITY.md, "The default recipe", has the evidence behind each choice).

* **Sequence files** (a dataset whose clock is its order: `m31 data import --sequences`, no
  times, no serving context, no user attributes): the `sasrec` preset, the causal sequence
  expert trained with a target at every position, its epoch chosen under the standard
  leave-one-out protocol (`--protocol loo-position`: NDCG@10 over every validation user, the
  history excluded; a pair model, the ranking or the dense one, on a sample of validation
  users as its preset has it). The preset's moe is the sequence expert alone: on Amazon
  Beauty each expert family added to it lowered quality, and on Sports the E = 8 moe was no
  better than it (docs/QUALITY.md, the Pareto rows).
* **Anything else** (a clock, contexts, user attributes: the demo marketplace, MovieLens): the
  `demo` preset.

Either way a moe gives no slots to an expert family whose inputs the dataset lacks entirely
(`m31.model.towers.inputless`: no text for the semantic family, users alike for the cohort
family, neither organic events nor co-engagement for the co-engagement family): such slots
learn one vector each and spend the gate's FLOPs on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

_LOSS_NAMES = {
    "softmax": "a sampled softmax",
    "full": "the softmax over every item",
    "bce": "binary cross-entropy against one negative",
}


@dataclass(frozen=True)
class Recipe:
    preset: str
    protocol: str | None  # `m31.eval.protocol` name, or None: the preset's own selection
    experts: dict[str, int] | None  # slots per family for a moe, or None: the preset's
    reasons: list[str] = field(default_factory=list)  # one line per choice, for the log


def dataset_meta(data: Path) -> dict:
    """The dataset folder's meta.json (a features folder's own meta where `data` is one)."""
    path = Path(data) / "meta.json"
    if not path.is_file():
        raise ValueError(f"{data}: no meta.json (not a dataset folder: see m31 data import)")
    return json.loads(path.read_text())


def choose(data: Path, kind: str, feats=None) -> Recipe:
    """The recipe for a model `kind` on the dataset folder `data` (its features `feats`, if
    already loaded, tell which families have inputs)."""
    from m31.model import model_preset
    from m31.model.towers import inputless

    meta = dataset_meta(data)
    reasons = []
    if meta.get("clock") == "order":
        preset, protocol = "sasrec", None
        loss = _LOSS_NAMES[model_preset(preset, kind).loss]
        reasons.append(
            "sequence files (the dataset's clock is its order: no times, contexts or user "
            f"attributes): the sasrec preset, the causal sequence expert trained with {loss} "
            "at every position"
        )
        if kind in ("moe", "two-tower"):
            protocol = "loo-position"
            reasons.append(
                "epoch chosen under --protocol loo-position (NDCG@10 over every validation "
                "user, the history excluded)"
            )
        else:  # every item for every validation user is a pass of a pair model's network each
            reasons.append(
                f"the {kind} model's epoch chosen on a sample of validation users (every user "
                "and every item would be a pass of its network each)"
            )
    else:
        preset, protocol = "demo", None
        reasons.append("a dataset with a clock and contexts: the demo preset")
    experts = None
    if kind == "moe":
        if feats is None:
            from m31.features.folder import features_for

            feats = features_for(data)
        slots = dict(model_preset(preset, kind).experts)
        idle = inputless(slots, feats)
        if idle and sum(k for f, k in slots.items() if f not in idle) > 0:
            experts = {f: (0 if f in idle else k) for f, k in slots.items()}
            for family, why in idle.items():
                reasons.append(f"no {family} slots: {why}")
    return Recipe(preset, protocol, experts, reasons)


def resolve(
    data: Path,
    kind: str,
    protocol: str | None,
    split: str,
    experts: dict[str, int] | None,
    log=print,
) -> tuple[str, str | None, dict[str, int] | None]:
    """(preset, protocol, experts) of a training that named no preset: the recipe's (`choose`,
    each reason logged), what the command line gave winning — a protocol, a split other than
    leave-last-out (then no protocol), and the slots of the families it names."""
    recipe = choose(data, kind)
    for reason in recipe.reasons:
        log(f"recipe: {reason}")
    if protocol is None and split == "leave-last-out":
        protocol = recipe.protocol
    if recipe.experts is not None:
        experts = {**recipe.experts, **(experts or {})}
    return recipe.preset, protocol, experts
