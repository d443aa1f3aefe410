"""A training job (`m31 train`): a preset's config with the overrides checked against the model
kind, the dataset's features (built once into its folder), the trained retrieval model a ranking
model draws hard negatives from or corrects, and the checkpoint, written at every new best epoch
so that a long run can be stopped. After every epoch the job also writes all a stopped run needs
to go on (`resume_path`): `resume=True` goes on from it. Patience ending the training removes it;
a training that ran out of epochs while still gaining keeps it, so that it can be given more.

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
RESUME_FORMAT = "m31-resume-1"


def resume_path(out: Path) -> Path:
    """Where the training that writes the checkpoint `out` keeps its state between epochs."""
    return Path(out).with_name(Path(out).name + ".resume")


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

    @property
    def stopped_early(self) -> bool:
        """Whether patience ended the training (its last `cfg.patience` epochs brought no
        validation gain), not its epoch count."""
        return self.history[-1]["epoch"] - self.best["epoch"] >= self.cfg.patience


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
    resume: bool = False,
    log=print,
    progress: bool = False,
) -> Trained:
    """Train `cfg` on the features of the dataset folder `data` for `split` and write the
    checkpoint `out` (at every new best epoch, and at the end).

    `hard_negatives`, `base` (ranking model only): a trained moe or two-tower checkpoint of the
    same data and split, whose top ads give each request hard negatives, or whose score the
    ranking model adds to its own; with a base, it validates on as many requests as `preset`
    gives the base's kind. `device` None: cuda when present. `resume`: go on from the state a
    stopped training of the same job left (`resume_path(out)`), if there is one; the result is
    the one an unstopped training gives."""
    from m31.features.folder import features_for
    from m31.model import save_checkpoint
    from m31.model.checkpoint import features_fingerprint, save_atomic, split_fingerprint
    from m31.progress import progress_bar
    from m31.training.train import default_device, train

    bar, callback = progress_bar()
    with bar:
        feats = features_for(data, split, progress=callback)
    log(f"features: {feats.describe()}")
    _note_idle(cfg, feats, log)
    at = device if device is not None else default_device()
    retrievers = _retrievers(feats, at, hard_negatives=hard_negatives, base=base)
    base_model = retrievers["--base"].model if base is not None else None
    if base_model is not None:
        cfg = _on_base(cfg, base_model, preset)
    state_file = resume_path(out)
    trained_on = (features_fingerprint(feats), split_fingerprint(feats))
    state = _resumed(state_file, trained_on, at, resume, log)
    earlier = 0.0 if state is None else state["seconds"]
    start = time.perf_counter()

    def on_epoch(s: dict) -> None:
        seconds = earlier + time.perf_counter() - start
        save_atomic(
            {**s, "format": RESUME_FORMAT, "trained_on": trained_on, "seconds": seconds},
            state_file,
        )

    model, history = train(
        cfg,
        feats,
        device=device,
        log=log,
        progress=progress,
        retriever=retrievers.get("--hard-negatives"),
        base=base_model,
        on_best=lambda m, h: save_checkpoint(out, m, feats, h),
        on_epoch=on_epoch,
        resume=state,
    )
    save_checkpoint(out, model, feats, history)
    trained = Trained(model, history, cfg, earlier + time.perf_counter() - start)
    if trained.stopped_early:
        state_file.unlink(missing_ok=True)
    else:
        log(
            f"{state_file} kept: the training ran its {cfg.epochs} epochs before {cfg.patience} "
            "without a validation gain could end it; --resume with more --epochs goes on from it"
        )
    return trained


def _note_idle(cfg: ModelConfig, feats, log) -> None:
    """Say which expert families have nothing to read in these features."""
    from m31.model.towers import idle_inputs

    for family, what in idle_inputs(cfg.experts, feats).items():
        k = cfg.experts[family]
        log(f"note: the {family} family ({k} slot{'s' if k != 1 else ''}): {what}")


def _retrievers(feats, device, **paths: Path | None) -> dict:
    """The retrieval models a ranking model's training reads, by option (`--hard-negatives`,
    `--base`): checkpoints of these features, never ranking models."""
    from m31.eval.runs import load_scorer

    retrievers = {}
    for name, path in paths.items():
        option = "--" + name.replace("_", "-")
        if path is None:
            continue
        retrievers[option] = load_scorer(path, feats, device)
        if retrievers[option].model.cfg.kind == "ranking":
            raise ValueError(
                f"{option}: {path} is a ranking model; give a moe or two-tower checkpoint"
            )
    return retrievers


def _on_base(cfg: ModelConfig, base_model, preset: str) -> ModelConfig:
    """A ranking model's config over `base_model`: it validates on the base's top ads only,
    so on as many requests as `preset` gives a retrieval model of the base's kind."""
    from m31.model import model_preset

    val = model_preset(preset, base_model.cfg.kind).val_requests
    return cfg.with_overrides(ranking_base=base_model.cfg.to_dict(), val_requests=val)


def _resumed(state_file: Path, trained_on: tuple, device, resume: bool, log) -> dict | None:
    """The stopped training's state to go on from (None: train from the start), said."""
    state = _stopped_state(state_file, trained_on, device) if resume else None
    if state is not None:
        log(f"resuming {state_file} after epoch {state['epoch']} ({state['seconds']:.0f} s)")
    elif resume:
        log(f"no stopped training at {state_file}: training from the start")
    elif state_file.is_file():
        log(f"{state_file}: a stopped training's state, replaced (--resume goes on from it)")
    return state


def _stopped_state(path: Path, trained_on: tuple, device) -> dict | None:
    """The state at `path` (None if there is none), checked to be of these features."""
    import torch

    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise ValueError(f"{path}: not a readable training state ({e}); remove it") from e
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        raise ValueError(f"{path}: not an m31 training state ({RESUME_FORMAT}); remove it")
    if tuple(state["trained_on"]) != trained_on:
        raise ValueError(
            f"{path}: a training on other features or another split; remove it to train afresh"
        )
    return state
