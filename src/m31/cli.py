"""The `m31` command line. Errors in input end with one line naming the file or field, exit 2."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="m31: ads retrieval engine.")
world_app = typer.Typer(no_args_is_help=True, help="The synthetic ads marketplace.")
data_app = typer.Typer(no_args_is_help=True, help="Datasets: import and inspect.")
features_app = typer.Typer(no_args_is_help=True, help="Feature tables for training.")
app.add_typer(world_app, name="world")
app.add_typer(data_app, name="data")
app.add_typer(features_app, name="features")


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


def _progress_bar():
    """A rich progress bar driven by `callback(stage, done, total)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
    tasks: dict[str, int] = {}

    def callback(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done)

    return bar, callback


@world_app.command("generate")
@cli_errors
def world_generate(
    out: Annotated[Path, typer.Option(help="Dataset folder to create.")],
    preset: Annotated[str, typer.Option(help="tiny, demo or bench.")] = "demo",
    seed: Annotated[int, typer.Option(help="Random seed: one seed, identical tables.")] = 0,
    users: Annotated[int | None, typer.Option(help="Override the preset's user count.")] = None,
    ads: Annotated[int | None, typer.Option(help="Override the preset's ad count.")] = None,
    impressions: Annotated[int | None, typer.Option(help="Override the impression count.")] = None,
    reuse: Annotated[
        bool, typer.Option(help="Keep an existing folder made with the same settings.")
    ] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing folder.")] = False,
) -> None:
    """Generate a synthetic ads marketplace into OUT (atomically)."""
    from m31.data import dataset
    from m31.data.summary import print_summary
    from m31.world.config import preset as get_preset
    from m31.world.generate import generate

    cfg = get_preset(preset).with_overrides(n_users=users, n_ads=ads, n_impressions=impressions)
    if out.exists() and reuse:
        try:
            existing = dataset.load(out)
        except dataset.DatasetError:
            existing = None
        if (
            existing
            and existing.meta.get("config") == cfg.to_dict()
            and existing.meta.get("seed") == seed
        ):
            typer.echo(f"reusing {out} (same preset and seed)")
            print_summary(existing)
            return
        if not overwrite:
            _fail(f"{out}: exists with other settings (pass --overwrite to replace it)")
    elif out.exists() and not overwrite:
        _fail(f"{out}: already exists (pass --overwrite to replace it, or --reuse)")

    import resource

    start = time.perf_counter()
    bar, callback = _progress_bar()
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
    """Print a dataset's counts, CTR and CVR, by surface and format."""
    from m31.data.dataset import load
    from m31.data.summary import print_summary, summarize

    ds = load(folder)
    if as_json:
        typer.echo(json.dumps(summarize(ds), indent=2, default=str))
    else:
        print_summary(ds)


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
    bar, callback = _progress_bar()
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


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
