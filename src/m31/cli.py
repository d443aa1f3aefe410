"""The `m31` command line. Errors in input end with one line naming the file or field, exit 2."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from m31.bench import cli as bench_cli
from m31.progress import progress_bar
from m31.serve.config import (
    BODY_TIMEOUT_S,
    MAX_BATCH_SIZE,
    MAX_QUEUE,
    MAX_QUEUE_DELAY_MS,
    MAX_SLICE_MS,
    TIMEOUT_MS,
)

app = typer.Typer(no_args_is_help=True, add_completion=False, help="m31: ads retrieval engine.")

# Options shared by the evaluation commands.
SplitOption = Annotated[str, typer.Option(help="Which split's features (leave-last-out or time).")]
MaxUsersOption = Annotated[
    int | None, typer.Option(help="Evaluate a seeded sample of test requests.")
]
ExcludeSeenOption = Annotated[
    bool | None,
    typer.Option(
        help="Drop ads engaged before (default: on where the dataset's meta says "
        "repeat_engagement false)."
    ),
]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Write the results as JSON.")]
DeviceOption = Annotated[str, typer.Option(help="cpu or cuda.")]
world_app = typer.Typer(no_args_is_help=True, help="The synthetic ads marketplace.")
data_app = typer.Typer(no_args_is_help=True, help="Datasets: import and inspect.")
features_app = typer.Typer(no_args_is_help=True, help="Feature tables for training.")
index_app = typer.Typer(no_args_is_help=True, help="The ad index: build it from a trained model.")
app.add_typer(world_app, name="world")
app.add_typer(data_app, name="data")
app.add_typer(features_app, name="features")
app.add_typer(index_app, name="index")
cluster_app = typer.Typer(no_args_is_help=True, help="A sharded index on Ray: offline commands.")
app.add_typer(cluster_app, name="cluster")


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", err=True, fg="red")
    raise typer.Exit(2)


def cli_errors(fn):
    """Turn the project's input errors into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from m31.data.dataset import DatasetError

        try:
            return fn(*args, **kwargs)
        except (DatasetError, ValueError, FileNotFoundError, PermissionError) as e:
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    return wrapper


@world_app.command("generate")
@cli_errors
def world_generate(
    out: Annotated[Path, typer.Option(help="Dataset folder to create.")],
    preset: Annotated[str, typer.Option(help="tiny, demo or bench.")] = "demo",
    seed: Annotated[int, typer.Option(help="Random seed: one seed, identical tables.")] = 0,
    users: Annotated[int | None, typer.Option(help="Override the preset's user count.")] = None,
    ads: Annotated[int | None, typer.Option(help="Override the preset's ad count.")] = None,
    impressions: Annotated[int | None, typer.Option(help="Override the impression count.")] = None,
    facet_weight_scale: Annotated[
        float | None,
        typer.Option(
            help="Scale of the spread of each user's interest weights (preset 1): 0 weighs a "
            "user's interests alike, so the best ads of a request mix them."
        ),
    ] = None,
    reuse: Annotated[
        bool, typer.Option(help="Keep an existing folder made with the same settings.")
    ] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
) -> None:
    """Generate a synthetic ads marketplace into OUT (atomically)."""
    from m31.data import dataset
    from m31.data.summary import print_summary
    from m31.world.config import WorldConfig
    from m31.world.config import preset as get_preset
    from m31.world.generate import generate

    cfg = get_preset(preset).with_overrides(
        n_users=users, n_ads=ads, n_impressions=impressions, facet_weight_scale=facet_weight_scale
    )
    if out.exists() and reuse:
        try:
            existing = dataset.load(out)
            same = WorldConfig.from_dict(existing.meta.get("config") or {}) == cfg
        except (dataset.DatasetError, TypeError, ValueError):
            existing, same = None, False
        if same and existing.meta.get("seed") == seed:
            typer.echo(f"reusing {out} (same preset and seed)")
            print_summary(existing)
            return
        if not overwrite:
            _fail(f"{out}: exists with other settings (pass --overwrite to replace it)")
    elif out.exists() and not overwrite:
        _fail(f"{out}: already exists (pass --overwrite to replace it, or --reuse)")

    import resource

    start = time.perf_counter()
    bar, callback = progress_bar()
    with bar:
        ds, truth = generate(cfg, seed, progress=callback)
    gen_s = time.perf_counter() - start
    ds.meta["generated_in_s"] = round(gen_s, 2)
    dataset.save(ds, out, overwrite=True, extra=truth.to_arrays())
    total_s = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    typer.echo(
        f"wrote {out} in {total_s:.1f} s (generation {gen_s:.1f} s), peak memory {peak_mib:,.0f} MiB"
    )
    print_summary(ds)


@world_app.command("summary")
@data_app.command("summary")
@cli_errors
def summary(
    folder: Annotated[Path, typer.Argument(help="Dataset folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Print a dataset's counts, CTR and CVR, by surface and format; for a synthetic world, how
    much its users' best ads mix interests."""
    from m31.data.dataset import load
    from m31.data.summary import print_summary, summarize

    ds = load(folder)
    mix = _interest_mix(folder) if (folder / "truth.npz").is_file() else None
    if as_json:
        s = summarize(ds)
        if mix is not None:
            s["interests"] = mix
        typer.echo(json.dumps(s, indent=2, default=str))
        return
    print_summary(ds)
    if mix is not None:
        typer.echo(
            f"interests: {mix['facets_per_user']:.2f} per user; of a user's true top-K ads at the "
            f"log's end ({mix['users']:,} users), a facet other than the heaviest wins "
            + ", ".join(f"{v:.1%} at K = {k}" for k, v in mix["other_facet_share"].items())
        )


def _interest_mix(folder: Path, ks: tuple[int, ...] = (10, 100)) -> dict:
    """How much a synthetic world's best ads mix each user's interests (`facet_share`), over up
    to 500 users (fewer on a large catalogue: each costs a pass over every ad)."""
    import numpy as np

    from m31.data.dataset import load_truth
    from m31.world.truth import GroundTruth

    truth = GroundTruth.from_arrays(load_truth(folder))
    users = max(100, min(500, 25_000_000 // truth.n_ads))
    rows = np.random.default_rng(0).permutation(truth.n_users)[:users]
    ts = np.full(len(rows), truth.t0 + truth.span)
    return {
        "users": len(rows),
        "facets_per_user": float((truth.facet_topic >= 0).sum(1).mean()),
        "other_facet_share": {
            k: float(truth.facet_share(rows, ts, k).mean()) for k in ks if k <= truth.n_ads
        },
    }


@data_app.command("movielens")
@cli_errors
def data_movielens(
    out: Annotated[Path, typer.Option(help="Dataset folder to create.")],
    path: Annotated[
        Path, typer.Option(help="A MovieLens-100K style folder (u.data, u.user, u.item).")
    ] = Path("../shared/data/movielens-100k"),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
) -> None:
    """Import MovieLens-format files into an m31 dataset folder (movies as ads)."""
    from m31.data import dataset
    from m31.data.movielens import load_movielens
    from m31.data.summary import print_summary

    if out.exists() and not overwrite:
        _fail(f"{out}: already exists (pass --overwrite to replace it)")
    start = time.perf_counter()
    ds = load_movielens(path)
    dataset.save(ds, out, overwrite=overwrite)
    typer.echo(f"loaded {path} and wrote {out} in {time.perf_counter() - start:.2f} s")
    print_summary(ds)


@data_app.command("import")
@cli_errors
def data_import(
    out: Annotated[Path, typer.Option(help="Dataset folder to create.")],
    interactions: Annotated[
        Path | None,
        typer.Option(help="Engagements: CSV, TSV, Parquet or JSON lines, a row per engagement."),
    ] = None,
    sequences: Annotated[
        Path | None, typer.Option(help="`user item item ...` per line, oldest first.")
    ] = None,
    items: Annotated[
        Path | None,
        typer.Option(help="Catalogue (CSV, TSV, Parquet, JSON lines) or item -> ids JSON map."),
    ] = None,
    users: Annotated[Path | None, typer.Option(help="Users and their attributes.")] = None,
    user_col: Annotated[str | None, typer.Option(help="Interactions' user id column.")] = None,
    item_col: Annotated[str | None, typer.Option(help="Interactions' item id column.")] = None,
    time_col: Annotated[
        str | None, typer.Option(help="Interactions' time column; 'none': the file's order.")
    ] = None,
    time_unit: Annotated[str, typer.Option(help="Of integer times: s or ms.")] = "s",
    surface_col: Annotated[str | None, typer.Option(help="Interactions' surface column.")] = None,
    platform_col: Annotated[str | None, typer.Option(help="Interactions' platform column.")] = None,
    event_col: Annotated[str | None, typer.Option(help="Interactions' event type column.")] = None,
    weight_col: Annotated[str | None, typer.Option(help="Interactions' weight column.")] = None,
    conversion_events: Annotated[
        str | None, typer.Option(help="Comma-separated event types that are conversions.")
    ] = None,
    conversion_min: Annotated[
        float | None, typer.Option(help="A weight at least this is a conversion.")
    ] = None,
    sort: Annotated[
        bool, typer.Option(help="Sort each user's events by time instead of refusing disorder.")
    ] = False,
    item_id_col: Annotated[str | None, typer.Option(help="Catalogue's item id column.")] = None,
    text_col: Annotated[str | None, typer.Option(help="Catalogue's text column.")] = None,
    list_cols: Annotated[
        str | None, typer.Option(help="Comma-separated catalogue columns holding lists.")
    ] = None,
    list_sep: Annotated[str, typer.Option(help="Separator inside a list column.")] = "|",
    user_id_col: Annotated[str | None, typer.Option(help="Users file's id column.")] = None,
    repeat_engagement: Annotated[
        bool | None,
        typer.Option(
            "--repeat-engagement/--no-repeat-engagement",
            help="Whether a user may engage with an item again (default: whether the files "
            "show it).",
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
) -> None:
    """Import a team's files into an m31 dataset folder: nothing a source lacks is invented
    (docs: README, "Your own data")."""
    from m31.data.importer import Interactions, Items, Users, import_dataset

    def names(text: str | None) -> tuple[str, ...]:
        return tuple(n.strip() for n in text.split(",") if n.strip()) if text else ()

    report = import_dataset(
        out,
        interactions=None
        if interactions is None
        else Interactions(
            interactions,
            user_col,
            item_col,
            None if time_col == "none" else time_col,
            time_unit,
            surface_col,
            platform_col,
            event_col,
            weight_col,
            names(conversion_events),
            conversion_min,
            sort,
            no_time=time_col == "none",
        ),
        sequences=sequences,
        items=None
        if items is None
        else Items(items, item_id_col, text_col, names(list_cols), list_sep),
        users=None if users is None else Users(users, user_id_col),
        repeat_engagement=repeat_engagement,
        overwrite=overwrite,
    )
    typer.echo(report.summary())


@data_app.command("validate")
@cli_errors
def data_validate(
    folder: Annotated[Path, typer.Argument(help="Dataset folder.")],
    show: Annotated[
        int, typer.Option(min=0, help="How many errors, and how many warnings, to name.")
    ] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check a dataset folder (files, meta.json, column types, duplicate ids, references,
    vocabularies, numbers, time order), print what was found, and exit 1 on any error."""
    from m31.data.validate import summary, validate

    report = validate(folder)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo(summary(report, show))
    if not report.ok:
        raise typer.Exit(1)


@features_app.command("build")
@cli_errors
def features_build(
    data: Annotated[Path, typer.Option(help="Dataset folder.")],
    out: Annotated[Path, typer.Option(help="Feature folder to create.")],
    split: Annotated[str, typer.Option(help="leave-last-out or time.")] = "leave-last-out",
    max_len: Annotated[int, typer.Option(help="Engagement sequence length.")] = 50,
    cache: Annotated[Path, typer.Option(help="Text-embedding cache folder.")] = Path(
        ".cache/embeddings"
    ),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
) -> None:
    """Build the feature tables every model trains on."""
    from m31.data.dataset import load
    from m31.features import FeatureConfig, build_features

    if out.exists() and not overwrite:
        _fail(f"{out}: already exists (pass --overwrite to replace it)")
    bar, callback = progress_bar()
    start = time.perf_counter()
    with bar:
        feats = build_features(
            load(data),
            FeatureConfig(split=split, max_len=max_len),
            cache_dir=cache,
            progress=callback,
        )
    feats.save(out, overwrite=overwrite)
    typer.echo(f"wrote {out} in {time.perf_counter() - start:.1f} s: {feats.describe()}")


def _named_paths(values: list[str], option: str) -> dict[str, Path]:
    """NAME=PATH pairs (or bare paths, named by the checkpoint's model kind later)."""
    out = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = "", v
        if name in out:
            _fail(f"{option}: the name {name!r} is given twice")
        out[name] = Path(path)
    return out


def _load_models(specs: dict[str, Path], feats, device: str) -> dict:
    from m31.model import Catalog, ScoreFunction, load_checkpoint

    catalog = Catalog.from_features(feats).to(device)
    fns = {}
    for name, path in specs.items():
        model, blob = load_checkpoint(path, feats, device=device)
        key = name or blob["config"]["kind"]
        if key in fns:
            _fail(f"two models are named {key!r}; name them NAME=PATH")
        fns[key] = ScoreFunction(model, feats, catalog)
    return fns


@app.command("train")
@cli_errors
def train_cmd(
    model: Annotated[str, typer.Option(help="moe, two-tower or ranking.")],
    data: Annotated[Path, typer.Option(help="Dataset folder (features are built into it once).")],
    out: Annotated[Path, typer.Option(help="Checkpoint file to write.")],
    preset: Annotated[
        str,
        typer.Option(help="Model preset: tiny, demo or sasrec (the sequence expert alone)."),
    ] = "demo",
    epochs: Annotated[int | None, typer.Option(help="Override the preset's epoch count.")] = None,
    patience: Annotated[
        int | None, typer.Option(help="Override the epochs without validation gain to stop at.")
    ] = None,
    split: Annotated[str, typer.Option(help="leave-last-out or time.")] = "leave-last-out",
    protocol: Annotated[
        str | None,
        typer.Option(
            help="Select the epoch under an evaluation protocol (loo-position: every validation "
            "request, the history excluded, NDCG@10); implies its split."
        ),
    ] = None,
    sequence_encoder: Annotated[
        str | None,
        typer.Option(
            help="The sequence expert: transformer (causal self-attention, a target at every "
            "position) or pool (the attention pool, for ablations)."
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    max_len: Annotated[
        int | None,
        typer.Option(help="Override the preset's engagement-sequence length (the last events)."),
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Override the preset's learning rate.")] = None,
    experts: Annotated[
        str | None,
        typer.Option(
            help="Expert slots per family, e.g. sequence=8,cohort=0 (0 drops a family); the "
            "families not named keep the preset's."
        ),
    ] = None,
    gate_dim: Annotated[
        int | None,
        typer.Option(
            help="moe only: override the gate-key width G; 0 routes every ad of a request with "
            "the same expert weights (no per-ad routing)."
        ),
    ] = None,
    balance_weight: Annotated[
        float | None,
        typer.Option(
            help="moe only: override the weight of the gate's mutual-information term (preset "
            "0.02); higher spreads the ads over the experts more evenly and routes each one more "
            "decisively."
        ),
    ] = None,
    hard_negatives: Annotated[
        Path | None,
        typer.Option(
            help="Ranking model only: a trained moe or two-tower checkpoint (same data and "
            "split); each request also gets --hard negatives drawn from its top --hard-pool ads."
        ),
    ] = None,
    hard: Annotated[
        int | None, typer.Option(help="Hard negatives per request (default 32).")
    ] = None,
    base: Annotated[
        Path | None,
        typer.Option(
            help="Ranking model only: a trained moe or two-tower checkpoint (same data and split) "
            "whose score the ranking model adds to its own, learning a correction to its order."
        ),
    ] = None,
    hard_pool: Annotated[
        int | None,
        typer.Option(help="The retriever's top ads per request they come from (default 500)."),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="cpu or cuda (default: cuda when present).")
    ] = None,
) -> None:
    """Train a model and write a checkpoint (weights, config, vocabularies, history)."""
    import json as _json

    from m31.eval.protocol import protocol as named_protocol
    from m31.model import model_preset, save_checkpoint
    from m31.pipeline import features_for
    from m31.training import train

    cfg = model_preset(preset, model).with_overrides(
        epochs=epochs, seed=seed, max_len=max_len, lr=lr, patience=patience,
        sequence_encoder=sequence_encoder,
    )  # fmt: skip
    if hard_negatives is None and (hard is not None or hard_pool is not None):
        _fail("--hard and --hard-pool go with --hard-negatives")
    if hard_negatives is not None:
        if model != "ranking":
            _fail(f"--hard-negatives: trains the ranking model, not {model!r}")
        hard, hard_pool = 32 if hard is None else hard, 500 if hard_pool is None else hard_pool
        if hard < 1 or hard_pool < 1:
            _fail(f"--hard and --hard-pool must be >= 1, got {hard} and {hard_pool}")
        cfg = cfg.with_overrides(ranking_hard=hard, ranking_hard_pool=hard_pool)
    if experts is not None:
        cfg = cfg.with_overrides(experts={**cfg.experts, **_expert_slots(experts)})
    if gate_dim is not None:
        if model != "moe":
            _fail(f"--gate-dim: the moe has a gate, not {model!r}")
        if gate_dim < 0:
            _fail(f"--gate-dim must be >= 0, got {gate_dim}")
        cfg = cfg.with_overrides(gate_dim=gate_dim)
    if balance_weight is not None:
        if model != "moe":
            _fail(f"--balance-weight: the moe's gate has the term, not {model!r}")
        cfg = cfg.with_overrides(balance_weight=balance_weight)
    if base is not None and model != "ranking":
        _fail(f"--base: the ranking model takes a base, not {model!r}")
    if protocol is not None:
        proto = named_protocol(protocol)
        split, cfg = proto.split, proto.training(cfg)
    bar, callback = progress_bar()
    with bar:
        feats = features_for(data, split, progress=callback)
    typer.echo(f"features: {feats.describe()}")
    retriever = None
    if hard_negatives is not None:
        retriever = _retriever(hard_negatives, feats, device, "--hard-negatives")
    base_model = None if base is None else _retriever(base, feats, device, "--base").model
    if base_model is not None:
        # it validates on the base's top ads only, so on as many requests as a retrieval model
        val = model_preset(preset, base_model.cfg.kind).val_requests
        cfg = cfg.with_overrides(ranking_base=base_model.cfg.to_dict(), val_requests=val)
    start = time.perf_counter()
    trained, history = train(
        cfg, feats, device=device, log=typer.echo, progress=sys.stderr.isatty(),
        retriever=retriever, base=base_model,
        on_best=lambda m, h: save_checkpoint(out, m, feats, h),
    )  # fmt: skip
    save_checkpoint(out, trained, feats, history)
    key = f"val_{cfg.val_metric}"
    best = max(history, key=lambda h: h[key])
    typer.echo(
        f"wrote {out} after {time.perf_counter() - start:.0f} s; best epoch {best['epoch']} of "
        f"{history[-1]['epoch']}: val HR@10 {best['val_hr@10']:.4f}, HR@50 "
        f"{best['val_hr@50']:.4f}, {cfg.val_metric} {best[key]:.4f}; "
        f"{trained.flops_per_pair():,} FLOPs per (request, ad) pair"
    )
    if "experts" in best:
        typer.echo(f"expert usage: {_json.dumps(best['experts'])}")


def _retriever(path: Path, feats, device, option: str):
    """--hard-negatives, --base: the retrieval model's scorer over `feats` (checked: trained on
    them)."""
    from m31.model import load_checkpoint
    from m31.model.inference import ScoreFunction
    from m31.model.inputs import Catalog
    from m31.training.train import default_device

    device = device if device is not None else default_device()
    model, blob = load_checkpoint(path, feats, device=device)
    if blob["config"]["kind"] == "ranking":
        _fail(f"{option}: {path} is a ranking model; give a moe or two-tower checkpoint")
    return ScoreFunction(model, feats, Catalog.from_features(feats).to(device))


def _expert_slots(text: str) -> dict[str, int]:
    """--experts FAMILY=SLOTS,...: strict, every name a family and every count an int >= 0."""
    from m31.model.config import EXPERT_FAMILIES

    out = {}
    for item in text.split(","):
        name, sep, count = item.strip().partition("=")
        if not sep or name not in EXPERT_FAMILIES or not count.isdigit():
            _fail(
                f"--experts: expected FAMILY=SLOTS with FAMILY one of {', '.join(EXPERT_FAMILIES)} "
                f"and SLOTS an integer >= 0, got {item.strip()!r}"
            )
        if name in out:
            _fail(f"--experts: {name} given twice")
        out[name] = int(count)
    return out


def _grouped_runs(values: list[str] | None, option: str) -> dict[str, list[Path]]:
    """NAME=PATH options (PATH a glob, a NAME repeatable) grouped by name; names required."""
    out: dict[str, list[Path]] = {}
    for name, path in _named_runs(values or [], option):
        if not name:
            _fail(f"{option}: give NAME=CHECKPOINT")
        out.setdefault(name, []).append(path)
    return out


def _named_runs(values: list[str], option: str) -> list[tuple[str, Path]]:
    """NAME=PATH pairs, a name repeated for several training seeds; PATH may be a glob (sorted).
    A bare path is named by its checkpoint's model kind when loaded ("")."""
    import glob

    out = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = "", v
        if glob.has_magic(path):
            matches = sorted(glob.glob(path))
            if not matches:
                _fail(f"{option}: no checkpoint matches {path!r}")
            out += [(name, Path(m)) for m in matches]
        else:
            out.append((name, Path(path)))
    return out


@app.command("eval")
@cli_errors
def eval_cmd(
    data: Annotated[Path, typer.Option(help="Dataset folder.")],
    model: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=CHECKPOINT, repeatable; repeat a NAME (or give a glob) for several "
            "training seeds of one model."
        ),
    ] = None,
    baselines: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated: popularity, recent-popularity, item-knn, recency-knn, als."
        ),
    ] = None,
    compare: Annotated[
        list[str] | None,
        typer.Option(
            help="A,B: paired comparison of two models, repeatable (default: moe,two-tower)."
        ),
    ] = None,
    rerank: Annotated[
        str | None,
        typer.Option(
            help="FIRST,SECOND[,K]: also the two-stage model where SECOND (a ranking model) "
            "orders FIRST's top K (default 500), named FIRST>SECOND."
        ),
    ] = None,
    rerank_only: Annotated[
        bool,
        typer.Option(
            "--rerank-only",
            help="With --rerank: SECOND scores FIRST's candidates only, not the whole corpus "
            "(a ranking model over a large catalogue).",
        ),
    ] = False,
    split: SplitOption = "leave-last-out",
    protocol: Annotated[
        str | None,
        typer.Option(
            help="A published protocol (loo-position: the last item test, every item ranked for "
            "every user, the history excluded, HR and NDCG @5/10/20); sets the split, cut-offs "
            "and exclusions, and refuses models reading more history than it allows."
        ),
    ] = None,
    max_users: MaxUsersOption = None,
    ks: Annotated[str, typer.Option(help="Cut-offs, comma-separated.")] = "10,50,100,500",
    reference: Annotated[
        str | None, typer.Option(help="Model whose top-K the others are compared with.")
    ] = None,
    exclude_seen: ExcludeSeenOption = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of recall@K against K.")] = None,
    json_out: JsonOption = None,
    device: DeviceOption = "cpu",
) -> None:
    """Full-corpus offline metrics (every ad scored) of models and baselines on the same requests.

    A model given with several checkpoints (training seeds) is reported as mean ± sample standard
    deviation over them; two models are compared request by request (per-request metric averaged
    over seeds) with a 95% percentile-bootstrap interval over test requests (m31.eval.stats).
    """
    import numpy as np

    from m31.data import dataset
    from m31.data.dataset import repeat_engagement
    from m31.eval import evaluate, plot_recall_at_k
    from m31.eval.baselines import make_baselines
    from m31.eval.protocol import protocol as named_protocol
    from m31.eval.stats import (
        aggregate_seeds,
        format_paired,
        format_seed_table,
        paired_comparison,
        per_request,
    )
    from m31.model import Catalog, ScoreFunction, load_checkpoint
    from m31.pipeline import features_for

    try:
        cutoffs = tuple(int(k) for k in ks.split(","))
    except ValueError:
        _fail(f"--ks: expected comma-separated integers, got {ks!r}")
    proto = None
    if protocol is not None:
        proto = named_protocol(protocol)
        if max_users is not None or exclude_seen is False:
            _fail(f"--protocol {protocol}: every user is evaluated, the history excluded")
        split, cutoffs, exclude_seen = proto.split, proto.ks, proto.exclude_history
    runs = _named_runs(model or [], "--model")
    two_stage = None
    if rerank is not None:
        parts = rerank.split(",")
        if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
            _fail(f"--rerank: expected FIRST,SECOND[,K], got {rerank!r}")
        k_rerank = int(parts[2]) if len(parts) == 3 else 500
        if k_rerank <= 0:
            _fail(f"--rerank: K must be positive, got {k_rerank}")
        two_stage = (parts[0], parts[1], k_rerank)
        if rerank_only and reference == parts[1]:
            _fail(f"--reference {reference!r}: with --rerank-only it scores no whole corpus")
    elif rerank_only:
        _fail("--rerank-only goes with --rerank")
    base_names = [b for b in (baselines or "").split(",") if b]
    if not runs and not base_names:
        _fail("nothing to evaluate: give --model and/or --baselines")
    feats = features_for(data, split)
    truth = None
    if (data / "truth.npz").is_file():
        from m31.world.truth import GroundTruth

        truth = GroundTruth.from_arrays(dataset.load_truth(data))
    if exclude_seen is None:
        exclude_seen = not repeat_engagement(feats.meta)
    try:
        base_fns = make_baselines(base_names, feats)
    except ValueError as e:
        _fail(f"--baselines: {e}")

    # Checkpoints in rounds: round s holds the s-th checkpoint of every model, so memory holds one
    # checkpoint per model; baselines (deterministic) go with round 0.
    groups: dict[str, list[Path]] = {}
    for name, path in runs:
        groups.setdefault(name or f"\0{path}", []).append(path)
    catalog = Catalog.from_features(feats).to(device)
    per_seed: dict[str, list[dict]] = {}
    ranks: dict[str, list[np.ndarray]] = {}
    recalls: dict[str, list[dict[str, np.ndarray]]] = {}  # per-request truth recall, per seed
    latest: dict[str, ScoreFunction] = {}  # each model's last loaded checkpoint
    for s in range(max((len(p) for p in groups.values()), default=1)):
        fns = dict(base_fns) if s == 0 else {}
        for key, paths in groups.items():
            if s < len(paths):
                m, blob = load_checkpoint(paths[s], feats, device=device)
                if proto is not None:
                    proto.check_model(m.cfg, paths[s])
                name = blob["config"]["kind"] if key.startswith("\0") else key
                if name in fns:
                    _fail(f"two models are named {name!r}; name them NAME=PATH")
                fns[name] = latest[name] = ScoreFunction(m, feats, catalog)
        stages = {}
        if two_stage is not None:
            first, second, k_rerank = two_stage
            if s == 0 and (first not in fns or second not in fns):
                _fail(f"--rerank: {first!r} and {second!r} must both be given with --model")
            if first in fns:  # a second stage with fewer seeds serves the later rounds too
                stages[f"{first}>{second}"] = (first, latest[second].rank, k_rerank)
            if rerank_only:  # scored as the second stage only
                fns.pop(second, None)
        if reference is None and "ranking" in fns and len(fns) > 1:
            reference = "ranking"
        # A reference with fewer seeds than the others serves the later rounds as well, so that
        # every round reports the same metrics; its own metrics count once per checkpoint.
        reused = None
        if reference in latest and reference not in fns:
            fns[reference] = latest[reference]
            reused = reference
        bar, callback = progress_bar()
        with bar:
            metrics, r, *rows = evaluate(
                fns,
                feats,
                split="test",
                ks=cutoffs,
                max_users=max_users,
                exclude_seen=exclude_seen,
                truth=truth,
                reference=reference if reference in fns else None,
                progress=callback,
                return_ranks=True,
                rerank=stages,
                return_truth_recall=truth is not None,
            )
        for name in [*fns, *stages]:
            if name != reused:
                per_seed.setdefault(name, []).append(metrics[name])
                ranks.setdefault(name, []).append(r[name])
                if rows:
                    recalls.setdefault(name, []).append(rows[0][name])
        del fns

    n = len(next(iter(ranks.values()))[0])
    typer.echo(
        f"{n:,} test requests, {feats.n_ads:,} ads each (full corpus), "
        f"seen ads {'excluded' if exclude_seen else 'kept'}"
    )
    summaries = {name: aggregate_seeds(seeds) for name, seeds in per_seed.items()}
    typer.echo(format_seed_table(summaries))
    if not compare and {"moe", "two-tower"} <= set(ranks):
        compare = ["moe,two-tower"]
    pairs = []
    for spec in compare or []:
        a, _, b = spec.partition(",")
        if a not in ranks or b not in ranks:
            _fail(f"--compare: need two evaluated models A,B, got {spec!r}")
        paired = {
            metric: paired_comparison(
                per_request(np.stack(ranks[a]), metric), per_request(np.stack(ranks[b]), metric)
            )
            for metric in [f"{kind}@{k}" for kind in ("hr", "ndcg") for k in cutoffs]
        }
        for metric in [f"truth_recall@{k}" for k in cutoffs] if recalls else []:
            paired[metric] = paired_comparison(
                np.stack([seed[metric] for seed in recalls[a]]),
                np.stack([seed[metric] for seed in recalls[b]]),
            )
        typer.echo(
            f"\n{a} vs {b}, paired on the same {n:,} requests (per-request metric averaged over "
            f"seeds; 95% percentile bootstrap over requests):"
        )
        typer.echo(format_paired(a, b, paired))
        pairs.append({"a": a, "b": b, **{k: c.as_dict() for k, c in paired.items()}})
    means = {name: {k: v.mean for k, v in m.items()} for name, m in summaries.items()}
    if json_out:
        doc = {
            "requests": n,
            "means": means,
            "std": {  # null with one seed
                name: {k: None if np.isnan(v.std) else v.std for k, v in m.items()}
                for name, m in summaries.items()
            },
            "runs": per_seed,
            "paired": pairs,  # one entry per --compare
        }
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
    if plot:
        plot_recall_at_k(means, plot, metric_prefix="truth_recall" if truth is not None else "hr")
        typer.echo(f"wrote {plot}")


@app.command("ablate")
@cli_errors
def ablate_cmd(
    data: Annotated[Path, typer.Option(help="Dataset folder.")],
    model: Annotated[
        list[str],
        typer.Option(help="moe checkpoint(s), repeatable or a glob: one per training seed."),
    ],
    reference: Annotated[
        list[str] | None,
        typer.Option(help="NAME=CHECKPOINT (or glob) of a model drawn beside, e.g. two-tower."),
    ] = None,
    retrained: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=CHECKPOINT (or glob): a moe retrained as a variant (m31 train --experts, "
            "--gate-dim), compared with the full model like the others."
        ),
    ] = None,
    split: SplitOption = "leave-last-out",
    metric: Annotated[str, typer.Option(help="hr@K or ndcg@K.")] = "hr@10",
    max_users: MaxUsersOption = None,
    exclude_seen: ExcludeSeenOption = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the metric by variant.")] = None,
    json_out: JsonOption = None,
    device: DeviceOption = "cpu",
) -> None:
    """What a trained moe rests on: the gate, each expert family (m31.eval.ablation).

    Every variant rewrites the trained model's query (uniform gate; a family's slots removed;
    one family alone) and is scored over the full corpus on the same test requests as the model
    itself; each is compared with the full model request by request (95% percentile bootstrap).
    Models retrained without a part (--retrained) are compared the same way.
    """
    import numpy as np

    from m31.data.dataset import repeat_engagement
    from m31.eval import evaluate
    from m31.eval.ablation import ablations
    from m31.eval.plot import plot_ablation
    from m31.eval.stats import aggregate_seeds, paired_comparison, per_request
    from m31.model import Catalog, ScoreFunction, load_checkpoint
    from m31.pipeline import features_for

    kind, _, cutoff = metric.partition("@")
    if kind not in ("hr", "ndcg") or not cutoff.isdigit() or int(cutoff) <= 0:
        _fail(f"--metric: expected hr@K or ndcg@K, got {metric!r}")
    moes = [path for _, path in _named_runs(model, "--model")]
    by_ref = _grouped_runs(reference, "--reference")
    by_retrained = _grouped_runs(retrained, "--retrained")
    clash = (set(by_ref) & set(by_retrained)) | ((set(by_ref) | set(by_retrained)) & {"full"})
    if clash:
        _fail(f"--reference/--retrained: the name {sorted(clash)[0]!r} is taken")
    feats = features_for(data, split)
    if exclude_seen is None:
        exclude_seen = not repeat_engagement(feats.meta)
    catalog = Catalog.from_features(feats).to(device)
    per_seed: dict[str, list[dict]] = {}
    ranks: dict[str, list[np.ndarray]] = {}
    others = {**by_retrained, **by_ref}
    for s in range(max([len(moes), *(len(p) for p in others.values())])):
        fns = {}
        if s < len(moes):
            m, blob = load_checkpoint(moes[s], feats, device=device)
            if blob["config"]["kind"] != "moe":
                _fail(f"--model: {moes[s]} is a {blob['config']['kind']} checkpoint, not a moe")
            for name, query_map in ablations(m.cfg).items():
                fns[name] = ScoreFunction(m, feats, catalog, query_map=query_map)
        for name, paths in others.items():
            if s < len(paths):
                m, blob = load_checkpoint(paths[s], feats, device=device)
                if name in by_retrained and blob["config"]["kind"] != "moe":
                    _fail(f"--retrained: {paths[s]} is a {blob['config']['kind']} checkpoint")
                fns[name] = ScoreFunction(m, feats, catalog)
        bar, callback = progress_bar()
        with bar:
            metrics, r = evaluate(
                fns,
                feats,
                split="test",
                ks=(int(cutoff),),
                max_users=max_users,
                exclude_seen=exclude_seen,
                progress=callback,
                return_ranks=True,
            )
        for name in fns:
            per_seed.setdefault(name, []).append(metrics[name])
            ranks.setdefault(name, []).append(r[name])
    summaries = {name: aggregate_seeds(runs)[metric] for name, runs in per_seed.items()}
    variants = [name for name in summaries if name not in by_ref]
    full = per_request(np.stack(ranks["full"]), metric)
    n = full.shape[-1]
    typer.echo(
        f"{n:,} test requests, {feats.n_ads:,} ads each; {len(moes)} moe seed(s); {metric}, "
        f"mean ± std over seeds, and each variant against the full model on the same requests:"
    )
    rows = {}
    width = max(len(name) for name in summaries)
    for name in [*variants, *by_ref]:
        summary = summaries[name]
        line = f"  {name:<{width}} {summary.mean:.4f}"
        line += "" if np.isnan(summary.std) else f" ± {summary.std:.4f}"
        rows[name] = {"mean": summary.mean, "std": None if np.isnan(summary.std) else summary.std}
        rows[name]["seeds"] = len(per_seed[name])
        rows[name]["retrained"] = name in by_retrained
        if name != "full":
            c = paired_comparison(per_request(np.stack(ranks[name]), metric), full)
            rows[name]["vs_full"] = c.as_dict()
            line += f"   {c.ratio:.3f}x of full [{c.ratio_lo:.3f}, {c.ratio_hi:.3f}]"
        typer.echo(line)
    if json_out:
        doc = {"metric": metric, "requests": n, "seeds": len(moes), "variants": rows}
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
    if plot:
        plot_ablation(
            {name: (summaries[name].mean, summaries[name].std) for name in variants},
            {name: summaries[name].mean for name in by_ref},
            metric,
            plot,
            retrained=set(by_retrained),
        )
        typer.echo(f"wrote {plot}")


@app.command("simulate")
@cli_errors
def simulate_cmd(
    data: Annotated[Path, typer.Option(help="Dataset folder of a synthetic marketplace.")],
    retriever: Annotated[
        list[str], typer.Option(help="NAME=CHECKPOINT, repeatable; the first is the baseline.")
    ],
    ranker: Annotated[Path, typer.Option(help="Ranking-model checkpoint.")],
    k: Annotated[int, typer.Option(help="Ads retrieved per request.")] = 500,
    slots: Annotated[int, typer.Option(help="Ads shown per request.")] = 4,
    requests: Annotated[int, typer.Option(help="Held-out requests simulated.")] = 2000,
    seed: Annotated[int, typer.Option(help="Seed of the conversion draws.")] = 0,
    split: SplitOption = "leave-last-out",
    json_out: JsonOption = None,
    device: DeviceOption = "cpu",
) -> None:
    """Simulated funnel: retrieve K -> rank -> show -> conversions from the ground truth."""
    import numpy as np

    from m31.data import dataset
    from m31.eval import format_funnel, requests_from_split, simulate, topk_rows
    from m31.pipeline import features_for, funnel_eligibility
    from m31.world.truth import GroundTruth

    if not (data / "truth.npz").is_file():
        _fail(f"{data}: no truth.npz; the funnel needs a synthetic marketplace")
    feats = features_for(data, split)
    retrievers = _load_models(_named_paths(retriever, "--retriever"), feats, device)
    rank = _load_models({"ranking": ranker}, feats, device)["ranking"]
    truth = GroundTruth.from_arrays(dataset.load_truth(data))
    req = requests_from_split(feats, "test", max_users=requests, seed=seed)
    eligible = funnel_eligibility(data, feats)

    def retrieve_with(fn):
        # Retrieval scans only eligible ads, as the index does.
        return lambda r: topk_rows(np.where(eligible(r.ts), fn(r), -np.inf), k)

    result = simulate(
        {name: retrieve_with(fn) for name, fn in retrievers.items()},
        rank.rank,
        truth,
        req,
        k=k,
        slots=slots,
        seed=seed,
        eligible=eligible(req.ts),  # never show an ineligible ad, however few are eligible
    )
    typer.echo(format_funnel(result))
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")


@app.command("demo")
@cli_errors
def demo_cmd(
    out: Annotated[Path, typer.Option(help="Folder for the world, models and index.")] = Path(
        "data/demo"
    ),
) -> None:
    """The whole system on the default marketplace: data, models, index, requests, figures."""
    from m31.demo import run

    run(out, log=typer.echo)


def _token(env: str, file: Path | None, option: str) -> str | None:
    """A bearer token from a file (first line) or else an environment variable."""
    import os

    if file is not None:
        try:
            token = file.read_text().strip()
        except OSError as e:
            raise ValueError(f"{option}: cannot read {file} ({e.strerror})") from e
        if not token:
            raise ValueError(f"{option}: {file} is empty")
        return token
    return os.environ.get(env) or None


@index_app.command("build")
@cli_errors
def index_build(
    data: Annotated[Path, typer.Option(help="Dataset folder the model was trained on.")],
    model: Annotated[Path, typer.Option(help="Checkpoint of a retrieval model (moe, two-tower).")],
    out: Annotated[Path, typer.Option(help="Snapshot folder to create.")],
    dtype: Annotated[
        str,
        typer.Option(
            help="Ad table precision: bfloat16, float32, or int8 (8-bit codes with per-ad scales, "
            "what the CPU kernel reads fastest)."
        ),
    ] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu or cuda: where the ad tower runs.")] = "cpu",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
) -> None:
    """Run the model's ad tower over the dataset's catalogue and snapshot the ad index."""

    from m31.api import DTYPES
    from m31.engine.build import build_index

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    start = time.perf_counter()
    index = build_index(data, model, out, device=device, dtype=DTYPES[dtype], overwrite=overwrite)
    typer.echo(
        f"wrote {out} in {time.perf_counter() - start:.1f} s: {len(index):,} ads, {dtype}, "
        f"G = {index.dim_g}, D = {index.dim_x}, model {index.model_hash}"
    )


@cluster_app.command("init")
@cli_errors
def cluster_init(
    index: Annotated[Path, typer.Option(help="Index snapshot (m31 index build writes one).")],
    shards: Annotated[int, typer.Option(help="Shards.")],
    out: Annotated[Path, typer.Option(help="Cluster state folder to create.")],
    device: Annotated[str, typer.Option(help="cpu or cuda: where the shards are built.")] = "cpu",
) -> None:
    """Partition a snapshot over S shards: a cluster state folder for `m31 serve --ray`."""
    from m31.cluster.layout import init_cluster
    from m31.engine.load import copy_online, has_online

    init_cluster(index, out, shards, device, log=typer.echo)
    if has_online(index):  # what the ingress of `m31 serve --ray` reads
        copy_online(index, out)
    typer.echo(f"wrote {out}: {shards} shards")


@cluster_app.command("reshard")
@cli_errors
def cluster_reshard(
    from_: Annotated[Path, typer.Option("--from", help="Cluster state folder (not served).")],
    shards: Annotated[int, typer.Option(help="Shards of the new state.")],
    out: Annotated[Path, typer.Option(help="Cluster state folder to create.")],
    device: DeviceOption = "cpu",
) -> None:
    """Re-partition a cluster state over a new number of shards, offline, from its shards'
    snapshots and logs; the global version carries over."""
    from m31.cluster.layout import reshard
    from m31.engine.load import copy_online, has_online

    reshard(from_, shards, out, device, log=typer.echo)
    if has_online(from_):
        copy_online(from_, out)
    typer.echo(f"wrote {out}: {shards} shards")


@app.command("serve")
@cli_errors
def serve_cmd(
    index: Annotated[
        Path,
        typer.Option(
            help="Index snapshot (m31 demo writes DIR/index) or a serving folder made from one."
        ),
    ],
    model: Annotated[Path, typer.Option(help="Checkpoint whose ad tower made the index.")],
    state: Annotated[
        Path | None,
        typer.Option(
            help="Serving folder (snapshot + write-ahead log) for a snapshot --index "
            "(default: INDEX.serving)."
        ),
    ] = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8031,
    device: DeviceOption = "cpu",
    max_batch_size: Annotated[
        int, typer.Option(help="Requests per device call (1: no batching).")
    ] = MAX_BATCH_SIZE,
    max_queue_delay_ms: Annotated[
        float, typer.Option(help="How long the first request of a batch waits for others.")
    ] = MAX_QUEUE_DELAY_MS,
    max_queue: Annotated[
        int, typer.Option(help="Requests waiting before calls get 429.")
    ] = MAX_QUEUE,
    max_slice_ms: Annotated[
        float,
        typer.Option(
            help="Device time a large call may take per batch, so that small calls that come "
            "meanwhile wait at most about two slices."
        ),
    ] = MAX_SLICE_MS,
    timeout_ms: Annotated[
        int, typer.Option(help="Default deadline of a retrieve call.")
    ] = TIMEOUT_MS,
    body_timeout_s: Annotated[
        float, typer.Option(help="Seconds a request body may take to arrive (else 408).")
    ] = BODY_TIMEOUT_S,
    admin_token_file: Annotated[
        Path | None,
        typer.Option(
            help="Bearer token of the write endpoints (else $M31_ADMIN_TOKEN; "
            "without one, ad management is off)."
        ),
    ] = None,
    read_token_file: Annotated[
        Path | None,
        typer.Option(
            help="Bearer token of the read endpoints (else $M31_READ_TOKEN; "
            "without one, reads are open)."
        ),
    ] = None,
    access_log: Annotated[
        bool, typer.Option(help="Log every HTTP call (off: /metrics counts them).")
    ] = False,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Serve a sharded index on Ray: shard actors, the same API through Ray Serve "
            "(needs the ray extra; docs/SCALING.md).",
        ),
    ] = False,
    shards: Annotated[
        int | None,
        typer.Option(
            help="With --ray: shards of a new cluster state (default 2); an existing one must "
            "match (else `m31 cluster reshard`)."
        ),
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(help="With --ray: the Ray cluster to join (e.g. auto); default: a local one."),
    ] = None,
    replicas: Annotated[int, typer.Option(help="With --ray: ingress replicas.")] = 1,
    max_replicas: Annotated[
        int | None,
        typer.Option(help="With --ray: autoscale ingress replicas up to this many."),
    ] = None,
) -> None:
    """Serve retrieval and ad management over HTTP (FastAPI on uvicorn, or Ray Serve)."""
    import logging

    import uvicorn

    from m31.engine.load import copy_online, serving_folder
    from m31.serve.app import ServeConfig, create_app

    for name, value in (
        ("--max-batch-size", max_batch_size),
        ("--max-queue", max_queue),
        ("--timeout-ms", timeout_ms),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not body_timeout_s > 0:
        raise ValueError(f"--body-timeout-s must be positive, got {body_timeout_s}")
    if not max_slice_ms > 0 or not max_queue_delay_ms >= 0:
        raise ValueError(
            "--max-slice-ms must be positive and --max-queue-delay-ms at least 0, got "
            f"{max_slice_ms} and {max_queue_delay_ms}"
        )
    if not model.is_file():
        raise FileNotFoundError(f"--model: {model}: no such checkpoint")
    if not ray and (shards is not None or address is not None or max_replicas is not None):
        raise ValueError("--shards, --address and --max-replicas go with --ray")
    if ray:
        from m31.cluster.layout import serving_cluster

        served = serving_cluster(index, state, shards, device, log=typer.echo)
        copy_online(index, served)
    else:
        served = serving_folder(index, state, device, echo=typer.echo)
    config = ServeConfig(
        index=served,
        model=model,
        device=device,
        max_batch_size=max_batch_size,
        max_queue_delay_ms=max_queue_delay_ms,
        max_queue=max_queue,
        max_slice_ms=max_slice_ms,
        timeout_ms=timeout_ms,
        body_timeout_s=body_timeout_s,
        admin_token=_token("M31_ADMIN_TOKEN", admin_token_file, "--admin-token-file"),
        read_token=_token("M31_READ_TOKEN", read_token_file, "--read-token-file"),
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if config.admin_token is None:
        typer.echo("no admin token: ad management endpoints answer 403", err=True)
    if ray:
        from m31.cluster.serve import IngressOptions, run

        run(config, address, host, port, IngressOptions(replicas, max_replicas), log=typer.echo)
        return
    uvicorn.run(create_app(config), host=host, port=port, log_level="info", access_log=access_log)


@app.command("query")
@cli_errors
def query_cmd(
    user_id: Annotated[int, typer.Option(help="A stored user's id.")],
    surface: Annotated[str | None, typer.Option(help="Default: none (unknown).")] = None,
    platform: Annotated[str | None, typer.Option(help="Default: none (unknown).")] = None,
    k: Annotated[int, typer.Option(help="Results.")] = 10,
    ts: Annotated[int | None, typer.Option(help="Unix seconds (default: now).")] = None,
    filter: Annotated[
        str | None, typer.Option(help='Filter tree as JSON, e.g. \'{"eq": ["format", "video"]}\'.')
    ] = None,
    url: Annotated[str, typer.Option()] = "http://127.0.0.1:8031",
    token: Annotated[str | None, typer.Option(envvar="M31_READ_TOKEN")] = None,
) -> None:
    """Ask a running server for one user's top ads and print them."""
    from rich.console import Console
    from rich.table import Table

    from m31.client import Client, ServiceError

    request = {"user_id": user_id, "k": k}
    request |= {name: v for name, v in (("surface", surface), ("platform", platform)) if v}
    if ts is not None:
        request["ts"] = ts
    if filter is not None:
        try:
            request["filter"] = json.loads(filter)
        except json.JSONDecodeError as e:
            raise ValueError(f"--filter: not valid JSON ({e})") from e
    with Client(url, token=token) as client:
        try:
            out = client.retrieve([request])
        except ServiceError as e:
            raise ValueError(str(e)) from e
    res = out["results"][0]
    typer.echo(
        f"user {user_id}, {surface or 'any surface'} on {platform or 'any platform'}: "
        f"index version {out['index_version']}, {out['timings_ms']['total']:.1f} ms"
    )
    table = Table()
    for col in ("#", "ad", "score"):
        table.add_column(col, justify="right")
    for rank, (ad, s) in enumerate(zip(res["ad_ids"], res["scores"], strict=True), 1):
        table.add_row(str(rank), str(ad), f"{s:.3f}")
    Console().print(table)


@app.command("loadtest")
@cli_errors
def loadtest_cmd(
    data: Annotated[
        Path,
        typer.Option(
            help="Where the requests' users come from: the dataset folder, or the served index "
            "(its online/ folder)."
        ),
    ],
    url: Annotated[str, typer.Option()] = "http://127.0.0.1:8031",
    concurrency: Annotated[
        str, typer.Option(help="Comma-separated client counts (0: events alone).")
    ] = "1,8,64",
    duration: Annotated[float, typer.Option(help="Seconds per concurrency level.")] = 10.0,
    k: Annotated[int, typer.Option()] = 100,
    token: Annotated[str | None, typer.Option(envvar="M31_READ_TOKEN")] = None,
    event_clients: Annotated[
        int,
        typer.Option(
            help="0: retrieves only; N: each level runs twice, alone and beside N clients "
            "streaming events (POST /v1/events, with the admin token)."
        ),
    ] = 0,
    event_batch: Annotated[int, typer.Option(help="Events per event call.")] = 100,
    event_rate: Annotated[
        float, typer.Option(help="Events per second in all (0: as fast as acknowledged).")
    ] = 0.0,
    admin_token: Annotated[str | None, typer.Option(envvar="M31_ADMIN_TOKEN")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the rows as JSON here.")] = None,
) -> None:
    """Closed-loop load on a running server: QPS, p50/p99 latency, ads scored per second, and
    events acknowledged per second beside them."""
    from m31.serve import loadtest

    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError as e:
        raise ValueError(f"--concurrency: {concurrency!r} is not a list of integers") from e
    if event_clients < 0 or event_batch < 1 or event_rate < 0:
        raise ValueError(
            "--event-clients and --event-rate must be at least 0, --event-batch at least 1"
        )
    if any(c < 0 for c in levels) or (0 in levels and not event_clients):
        raise ValueError(
            "--concurrency: client counts are at least 1 (0 only with --event-clients)"
        )
    if event_clients and not admin_token:
        raise ValueError("--event-clients: events need the admin token ($M31_ADMIN_TOKEN)")
    user_ids, ad_ids, vocab = loadtest.inputs(data)
    events = [None]
    if event_clients:
        events.append(
            loadtest.EventLoad(event_clients, event_batch, ad_ids, admin_token, event_rate)
        )
    rows = []
    for c in levels:
        for stream in events if c else events[1:]:  # 0 clients: the events alone
            with_events = f", {event_clients} event clients" if stream else ""
            typer.echo(f"concurrency {c}{with_events}: {duration:.0f} s …", err=True)
            result = loadtest.run(
                url, user_ids, c, vocab["surface"], vocab["platform"], duration, k, token,
                events=stream,
            )  # fmt: skip
            rows.append(result.row())
    typer.echo(loadtest.format_rows(rows))
    if out is not None:
        out.write_text(json.dumps(rows, indent=2) + "\n")


app.command("bench")(bench_cli.bench)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
