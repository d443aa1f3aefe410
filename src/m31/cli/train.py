"""`m31 train`: the options of a training job (`m31.training.job`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from m31.cli.common import cli_errors, fail

TrainDataOption = Annotated[
    Path, typer.Option(help="Dataset folder (features are built into it once).")
]
PresetOption = Annotated[
    str | None,
    typer.Option(
        help="Model preset: tiny, demo or sasrec (the sequence expert alone). Left out, the "
        "recipe the dataset supports is chosen and said (sasrec under the standard protocol for "
        "sequence files, demo otherwise; no slots for expert families without inputs)."
    ),
]
PatienceOption = Annotated[
    int | None, typer.Option(help="Override the epochs without validation gain to stop at.")
]
ProtocolOption = Annotated[
    str | None,
    typer.Option(
        help="Select the epoch under an evaluation protocol (loo-position: every validation "
        "request, the history excluded, NDCG@10); implies its split."
    ),
]
LossOption = Annotated[
    str | None,
    typer.Option(
        help="The retrieval models' loss: softmax (sampled, in-batch and uniform negatives, "
        "logQ; the tiny and demo presets'), full (the softmax over every item, nothing "
        "sampled; the sasrec preset's) or bce (SASRec's: each target against one uniform "
        "negative)."
    ),
]
AttributeBucketsOption = Annotated[
    int | None,
    typer.Option(
        help="Rows of the item-attribute token table (preset 65536); 0 leaves the dataset's "
        "item attributes out of the ad tower (an ablation)."
    ),
]
SequenceEncoderOption = Annotated[
    str | None,
    typer.Option(
        help="The sequence expert: transformer (causal self-attention, a target at every "
        "position) or pool (the attention pool, for ablations)."
    ),
]
PoolSinkOption = Annotated[
    bool,
    typer.Option(
        "--pool-sink",
        help="Let the attention pools attend their learned null key beside every history, as "
        "the models trained before 2026-12-03 did (an ablation: a pool can then put all its "
        "attention there and give every user one vector).",
    ),
]
MaxLenOption = Annotated[
    int | None,
    typer.Option(help="Override the preset's engagement-sequence length (the last events)."),
]
ExpertsOption = Annotated[
    str | None,
    typer.Option(
        help="Expert slots per family, e.g. sequence=8,cohort=0 (0 drops a family); the "
        "families not named keep the preset's."
    ),
]
GateDimOption = Annotated[
    int | None,
    typer.Option(
        help="moe only: override the gate-key width G; 0 routes every ad of a request with "
        "the same expert weights (no per-ad routing)."
    ),
]
BalanceWeightOption = Annotated[
    float | None,
    typer.Option(
        help="moe only: override the weight of the gate's mutual-information term (preset "
        "0.02); higher spreads the ads over the experts more evenly and routes each one more "
        "decisively."
    ),
]
HardNegativesOption = Annotated[
    Path | None,
    typer.Option(
        help="Ranking model only: a trained moe or two-tower checkpoint (same data and "
        "split); each request also gets --hard negatives drawn from its top --hard-pool ads."
    ),
]
BaseOption = Annotated[
    Path | None,
    typer.Option(
        help="Ranking model only: a trained moe or two-tower checkpoint (same data and split) "
        "whose score the ranking model adds to its own, learning a correction to its order."
    ),
]
HardPoolOption = Annotated[
    int | None,
    typer.Option(help="The retriever's top ads per request they come from (default 500)."),
]
ResumeOption = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Go on from the state a stopped training of the same options left beside --out "
        "(OUT.resume, written after every epoch; kept at the end if the run used its epochs "
        "while still gaining), if there is one: the result is that of a training never "
        "stopped. --epochs and --patience may differ from the stopped run's.",
    ),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="NAME=VALUE: any other setting of the model config (e.g. dropout=0.2, hidden=128, "
        "sequence_heads=1, weight_decay=0), parsed as its field's type; repeat for more.",
    ),
]
TrainDeviceOption = Annotated[
    str | None, typer.Option(help="cpu or cuda (default: cuda when present).")
]


@cli_errors
def train_cmd(
    model: Annotated[str, typer.Option(help="moe, two-tower, dense or ranking.")],
    data: TrainDataOption,
    out: Annotated[Path, typer.Option(help="Checkpoint file to write.")],
    preset: PresetOption = None,
    epochs: Annotated[int | None, typer.Option(help="Override the preset's epoch count.")] = None,
    patience: PatienceOption = None,
    split: Annotated[str, typer.Option(help="leave-last-out or time.")] = "leave-last-out",
    protocol: ProtocolOption = None,
    sequence_encoder: SequenceEncoderOption = None,
    loss: LossOption = None,
    attribute_buckets: AttributeBucketsOption = None,
    pool_sink: PoolSinkOption = False,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    max_len: MaxLenOption = None,
    lr: Annotated[float | None, typer.Option(help="Override the preset's learning rate.")] = None,
    experts: ExpertsOption = None,
    gate_dim: GateDimOption = None,
    balance_weight: BalanceWeightOption = None,
    hard_negatives: HardNegativesOption = None,
    hard: Annotated[
        int | None, typer.Option(help="Hard negatives per request (default 32).")
    ] = None,
    base: BaseOption = None,
    hard_pool: HardPoolOption = None,
    device: TrainDeviceOption = None,
    resume: ResumeOption = False,
    settings: SetOption = None,
) -> None:
    """Train a model and write a checkpoint (weights, config, vocabularies, history)."""
    from m31.training.job import configure, train_checkpoint

    named = dict(epochs=epochs, seed=seed, max_len=max_len, lr=lr, patience=patience, loss=loss)
    named |= dict(sequence_encoder=sequence_encoder, attribute_buckets=attribute_buckets)
    named["pool_sink"] = pool_sink or None
    slots = None if experts is None else _expert_slots(experts)
    if preset is None:
        from m31.training.recipe import resolve

        preset, protocol, slots = resolve(data, model, protocol, split, slots, log=typer.echo)
    cfg, split = configure(
        model,
        preset,
        split=split,
        protocol=protocol,
        experts=slots,
        gate_dim=gate_dim,
        balance_weight=balance_weight,
        hard_negatives=hard_negatives is not None,
        hard=hard,
        hard_pool=hard_pool,
        base=base is not None,
        **_with_settings(named, settings or []),
    )
    trained = train_checkpoint(
        cfg,
        data,
        out,
        split,
        preset=preset,
        device=device,
        hard_negatives=hard_negatives,
        base=base,
        resume=resume,
        log=typer.echo,
        progress=sys.stderr.isatty(),
    )
    _report(trained, out)


def _with_settings(named: dict, settings: list[str]) -> dict:
    """The overrides of the named options (None: not given) and the --set settings; a field
    given both ways is refused."""
    from m31.model.config import parse_settings

    try:
        parsed = parse_settings(settings)
    except ValueError as e:
        fail(str(e))
    both = sorted(k for k in parsed if named.get(k) is not None)
    if both:
        fail(f"--set {both[0]}: also given as --{both[0].replace('_', '-')}; give it once")
    return {**named, **parsed}


def _report(trained, out: Path) -> None:
    """The checkpoint written, its best epoch and its cost per pair."""
    best, metric = trained.best, trained.cfg.val_metric
    selected = "" if metric in ("hr@10", "hr@50") else f", {metric} {best[f'val_{metric}']:.4f}"
    typer.echo(
        f"wrote {out} after {trained.seconds:.0f} s; best epoch {best['epoch']} of "
        f"{trained.history[-1]['epoch']}: val HR@10 {best['val_hr@10']:.4f}, HR@50 "
        f"{best['val_hr@50']:.4f}{selected}; "
        f"{trained.model.flops_per_pair():,} FLOPs per (request, ad) pair"
    )
    if "experts" in best:
        typer.echo(f"expert usage: {json.dumps(best['experts'])}")


def _expert_slots(text: str) -> dict[str, int]:
    """--experts FAMILY=SLOTS,...: strict, every name a family and every count an int >= 0."""
    from m31.model.config import EXPERT_FAMILIES

    out = {}
    for item in text.split(","):
        name, sep, count = item.strip().partition("=")
        if not sep or name not in EXPERT_FAMILIES or not count.isdigit():
            fail(
                f"--experts: expected FAMILY=SLOTS with FAMILY one of {', '.join(EXPERT_FAMILIES)} "
                f"and SLOTS an integer >= 0, got {item.strip()!r}"
            )
        if name in out:
            fail(f"--experts: {name} given twice")
        out[name] = int(count)
    return out
