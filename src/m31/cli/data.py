"""Datasets: `m31 world generate|summary`, `m31 data summary|movielens|import|validate` and
`m31 features build`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from m31.cli.common import DataOption, OverwriteOption, cli_errors, fail
from m31.progress import progress_bar

OutOption = Annotated[Path, typer.Option(help="Dataset folder to create.")]
FolderArgument = Annotated[Path, typer.Argument(help="Dataset folder.")]
FacetWeightScaleOption = Annotated[
    float | None,
    typer.Option(
        help="Scale of the spread of each user's interest weights (preset 1): 0 weighs a "
        "user's interests alike, so the best ads of a request mix them."
    ),
]


@cli_errors
def world_generate(
    out: OutOption,
    preset: Annotated[str, typer.Option(help="tiny, demo or bench.")] = "demo",
    seed: Annotated[int, typer.Option(help="Random seed: one seed, identical tables.")] = 0,
    users: Annotated[int | None, typer.Option(help="Override the preset's user count.")] = None,
    ads: Annotated[int | None, typer.Option(help="Override the preset's ad count.")] = None,
    impressions: Annotated[int | None, typer.Option(help="Override the impression count.")] = None,
    facet_weight_scale: FacetWeightScaleOption = None,
    reuse: Annotated[
        bool, typer.Option(help="Keep an existing folder made with the same settings.")
    ] = False,
    overwrite: OverwriteOption = False,
) -> None:
    """Generate a synthetic ads marketplace into OUT (atomically)."""
    import resource

    from m31.data.summary import print_summary
    from m31.world.config import preset as get_preset
    from m31.world.generate import generate_folder

    cfg = get_preset(preset).with_overrides(
        n_users=users, n_ads=ads, n_impressions=impressions, facet_weight_scale=facet_weight_scale
    )
    start = time.perf_counter()
    bar, callback = progress_bar()
    with bar:
        ds, reused = generate_folder(
            out, cfg, seed, reuse=reuse, overwrite=overwrite, progress=callback
        )
    if reused:
        typer.echo(f"reusing {out} (same preset and seed)")
    else:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        typer.echo(
            f"wrote {out} in {time.perf_counter() - start:.1f} s (generation "
            f"{ds.meta['generated_in_s']:.1f} s), peak memory {peak_mib:,.0f} MiB"
        )
    print_summary(ds)


@cli_errors
def summary(
    folder: FolderArgument,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Print a dataset's counts, CTR and CVR, by surface and format; for a synthetic world, how
    much its users' best ads mix interests."""
    from m31.data.dataset import load, load_truth
    from m31.data.summary import print_summary, summarize
    from m31.world.truth import GroundTruth

    ds = load(folder)
    mix = None
    if (folder / "truth.npz").is_file():
        mix = GroundTruth.from_arrays(load_truth(folder)).interest_mix()
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


@cli_errors
def data_movielens(
    out: OutOption,
    path: Annotated[
        Path, typer.Option(help="A MovieLens-100K style folder (u.data, u.user, u.item).")
    ] = Path("../shared/data/movielens-100k"),
    overwrite: OverwriteOption = False,
) -> None:
    """Import MovieLens-format files into an m31 dataset folder (movies as ads)."""
    from m31.data import dataset
    from m31.data.movielens import load_movielens
    from m31.data.summary import print_summary

    if out.exists() and not overwrite:
        fail(f"{out}: already exists (pass --overwrite to replace it)")
    start = time.perf_counter()
    ds = load_movielens(path)
    dataset.save(ds, out, overwrite=overwrite)
    typer.echo(f"loaded {path} and wrote {out} in {time.perf_counter() - start:.2f} s")
    print_summary(ds)


# `m31 data import`: the files, then each file's columns.
InteractionsOption = Annotated[
    Path | None,
    typer.Option(help="Engagements: CSV, TSV, Parquet or JSON lines, a row per engagement."),
]
SequencesOption = Annotated[
    Path | None, typer.Option(help="`user item item ...` per line, oldest first.")
]
ItemsOption = Annotated[
    Path | None,
    typer.Option(help="Catalogue (CSV, TSV, Parquet, JSON lines) or item -> ids JSON map."),
]
TimeColOption = Annotated[
    str | None, typer.Option(help="Interactions' time column; 'none': the file's order.")
]
ConversionEventsOption = Annotated[
    str | None, typer.Option(help="Comma-separated event types that are conversions.")
]
ConversionMinOption = Annotated[
    float | None, typer.Option(help="A weight at least this is a conversion.")
]
SortOption = Annotated[
    bool, typer.Option(help="Sort each user's events by time instead of refusing disorder.")
]
ListColsOption = Annotated[
    str | None, typer.Option(help="Comma-separated catalogue columns holding lists.")
]
RepeatEngagementOption = Annotated[
    bool | None,
    typer.Option(
        "--repeat-engagement/--no-repeat-engagement",
        help="Whether a user may engage with an item again (default: whether the files show it).",
    ),
]


@cli_errors
def data_import(
    out: OutOption,
    interactions: InteractionsOption = None,
    sequences: SequencesOption = None,
    items: ItemsOption = None,
    users: Annotated[Path | None, typer.Option(help="Users and their attributes.")] = None,
    user_col: Annotated[str | None, typer.Option(help="Interactions' user id column.")] = None,
    item_col: Annotated[str | None, typer.Option(help="Interactions' item id column.")] = None,
    time_col: TimeColOption = None,
    time_unit: Annotated[str, typer.Option(help="Of integer times: s or ms.")] = "s",
    surface_col: Annotated[str | None, typer.Option(help="Interactions' surface column.")] = None,
    platform_col: Annotated[str | None, typer.Option(help="Interactions' platform column.")] = None,
    event_col: Annotated[str | None, typer.Option(help="Interactions' event type column.")] = None,
    weight_col: Annotated[str | None, typer.Option(help="Interactions' weight column.")] = None,
    conversion_events: ConversionEventsOption = None,
    conversion_min: ConversionMinOption = None,
    sort: SortOption = False,
    item_id_col: Annotated[str | None, typer.Option(help="Catalogue's item id column.")] = None,
    text_col: Annotated[str | None, typer.Option(help="Catalogue's text column.")] = None,
    list_cols: ListColsOption = None,
    list_sep: Annotated[str, typer.Option(help="Separator inside a list column.")] = "|",
    user_id_col: Annotated[str | None, typer.Option(help="Users file's id column.")] = None,
    repeat_engagement: RepeatEngagementOption = None,
    overwrite: OverwriteOption = False,
) -> None:
    """Import a team's files into an m31 dataset folder: nothing a source lacks is invented
    (docs: README, "Your own data")."""
    from m31.data.importer import Interactions, Items, Users, import_dataset

    def names(text: str | None) -> tuple[str, ...]:
        return tuple(n.strip() for n in text.split(",") if n.strip()) if text else ()

    if interactions is not None:
        interactions = Interactions(
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
        )
    report = import_dataset(
        out,
        interactions=interactions,
        sequences=sequences,
        items=None
        if items is None
        else Items(items, item_id_col, text_col, names(list_cols), list_sep),
        users=None if users is None else Users(users, user_id_col),
        repeat_engagement=repeat_engagement,
        overwrite=overwrite,
    )
    typer.echo(report.summary())


@cli_errors
def data_validate(
    folder: FolderArgument,
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


@cli_errors
def features_build(
    data: DataOption,
    out: Annotated[Path, typer.Option(help="Feature folder to create.")],
    split: Annotated[str, typer.Option(help="leave-last-out or time.")] = "leave-last-out",
    max_len: Annotated[int, typer.Option(help="Engagement sequence length.")] = 50,
    cache: Annotated[Path, typer.Option(help="Text-embedding cache folder.")] = Path(
        ".cache/embeddings"
    ),
    overwrite: OverwriteOption = False,
) -> None:
    """Build the feature tables every model trains on."""
    from m31.data.dataset import load
    from m31.features import FeatureConfig, build_features

    if out.exists() and not overwrite:
        fail(f"{out}: already exists (pass --overwrite to replace it)")
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
