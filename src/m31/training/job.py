"""A training job (`m31 train`): a preset's config with the overrides checked against the model
kind, the dataset's features (built once into its folder), the trained retrieval model a ranking
model draws hard negatives from or corrects, and the checkpoint, written at every new best epoch
so that a long run can be stopped.

Messages name the command line's options (`--gate-dim`, `--base`, ...), whose values these
functions take.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from m31.model.config import ModelConfig

HARD = 32  # hard negatives per request, by default
HARD_POOL = 500  # the retriever's top ads per request they are drawn from, by default


def configure(
    kind: str,
    preset: str = "demo",
    *,
    split: str = "leave-last-out",
    protocol: str | None = None,
    experts: dict[str, int] | None = None,
    gate_dim: int | None = None,
    balance_weight: float | None = None,
    hard_negatives: bool = False,
    hard: int | None = None,
    hard_pool: int | None = None,
    base: bool = False,
    **overrides,
) -> tuple[ModelConfig, str]:
    """(config, split) of a model `kind` from `preset`: `overrides` (epochs, seed, max_len, lr,
    patience, sequence_encoder, loss, attribute_buckets, pool_sink; None keeps the preset's) and
    the checked options; a `protocol` (`m31.eval.protocol`) sets the split and how the epoch is
    selected. `experts`: slots per family, the families not named keeping the preset's.
    `hard_negatives`, `base`: whether a retrieval model is given for them
    (`train_checkpoint`)."""
    from m31.eval.protocol import protocol as named_protocol
    from m31.model import model_preset

    cfg = model_preset(preset, kind).with_overrides(**overrides)
    if not hard_negatives and (hard is not None or hard_pool is not None):
        raise ValueError("--hard and --hard-pool go with --hard-negatives")
    if hard_negatives:
        if kind != "ranking":
            raise ValueError(f"--hard-negatives: trains the ranking model, not {kind!r}")
        hard = HARD if hard is None else hard
        hard_pool = HARD_POOL if hard_pool is None else hard_pool
        if hard < 1 or hard_pool < 1:
            raise ValueError(f"--hard and --hard-pool must be >= 1, got {hard} and {hard_pool}")
        cfg = cfg.with_overrides(ranking_hard=hard, ranking_hard_pool=hard_pool)
    if experts is not None:
        cfg = cfg.with_overrides(experts={**cfg.experts, **experts})
    if gate_dim is not None:
        if kind != "moe":
            raise ValueError(f"--gate-dim: the moe has a gate, not {kind!r}")
        if gate_dim < 0:
            raise ValueError(f"--gate-dim must be >= 0, got {gate_dim}")
        cfg = cfg.with_overrides(gate_dim=gate_dim)
    if balance_weight is not None:
        if kind != "moe":
            raise ValueError(f"--balance-weight: the moe's gate has the term, not {kind!r}")
        cfg = cfg.with_overrides(balance_weight=balance_weight)
    if overrides.get("pool_sink") and not cfg.pooled_families:
        raise ValueError(
            "--pool-sink: this model has no attention pool (the transformer reads the sequence "
            "and it has no semantic slot)"
        )
    if base and kind != "ranking":
        raise ValueError(f"--base: the ranking model takes a base, not {kind!r}")
    if protocol is not None:
        proto = named_protocol(protocol)
        split, cfg = proto.split, proto.training(cfg)
    return cfg, split


@dataclass
class Trained:
    model: object  # the best epoch's
    history: list[dict]  # per epoch
    cfg: ModelConfig  # as trained (with a base's settings)
    seconds: float  # training, features excluded

    @property
    def best(self) -> dict:
        """The history of the epoch kept: the best on the validation metric."""
        return max(self.history, key=lambda h: h[f"val_{self.cfg.val_metric}"])


def train_checkpoint(
    cfg: ModelConfig,
    data: Path,
    out: Path,
    split: str = "leave-last-out",
    *,
    preset: str = "demo",
    device: str | None = None,
    hard_negatives: Path | None = None,
    base: Path | None = None,
    log=print,
    progress: bool = False,
) -> Trained:
    """Train `cfg` on the features of the dataset folder `data` for `split` and write the
    checkpoint `out` (at every new best epoch, and at the end).

    `hard_negatives`, `base` (ranking model only): a trained moe or two-tower checkpoint of the
    same data and split, whose top ads give each request hard negatives, or whose score the
    ranking model adds to its own; with a base, it validates on as many requests as `preset`
    gives the base's kind. `device` None: cuda when present."""
    from m31.eval.runs import load_scorer
    from m31.model import model_preset, save_checkpoint
    from m31.pipeline import features_for
    from m31.progress import progress_bar
    from m31.training.train import default_device, train

    bar, callback = progress_bar()
    with bar:
        feats = features_for(data, split, progress=callback)
    log(f"features: {feats.describe()}")
    at = device if device is not None else default_device()
    retrievers = {}
    for option, path in (("--hard-negatives", hard_negatives), ("--base", base)):
        if path is not None:
            retrievers[option] = load_scorer(path, feats, at)
            if retrievers[option].model.cfg.kind == "ranking":
                raise ValueError(
                    f"{option}: {path} is a ranking model; give a moe or two-tower checkpoint"
                )
    base_model = retrievers["--base"].model if base is not None else None
    if base_model is not None:
        # it validates on the base's top ads only, so on as many requests as a retrieval model
        val = model_preset(preset, base_model.cfg.kind).val_requests
        cfg = cfg.with_overrides(ranking_base=base_model.cfg.to_dict(), val_requests=val)
    start = time.perf_counter()
    model, history = train(
        cfg, feats, device=device, log=log, progress=progress,
        retriever=retrievers.get("--hard-negatives"), base=base_model,
        on_best=lambda m, h: save_checkpoint(out, m, feats, h),
    )  # fmt: skip
    save_checkpoint(out, model, feats, history)
    return Trained(model, history, cfg, time.perf_counter() - start)
