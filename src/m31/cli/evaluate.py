"""Offline evaluation: `m31 eval`, `m31 simulate` and `m31 auction` (`m31.eval.runs`),
`m31 ablate` (`m31.eval.ablation`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from m31.cli.common import (
    DataOption,
    DeviceOption,
    ExcludeSeenOption,
    JsonOption,
    MaxUsersOption,
    SplitOption,
    cli_errors,
    fail,
    grouped,
    named_paths,
    write_json,
)
from m31.progress import progress_bar

ModelsOption = Annotated[
    list[str] | None,
    typer.Option(
        help="NAME=CHECKPOINT, repeatable; repeat a NAME (or give a glob) for several "
        "training seeds of one model."
    ),
]
BaselinesOption = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated: popularity, recent-popularity, item-knn, recency-knn, als."
    ),
]
CompareOption = Annotated[
    list[str] | None,
    typer.Option(help="A,B: paired comparison of two models, repeatable (default: moe,two-tower)."),
]
RerankOption = Annotated[
    str | None,
    typer.Option(
        help="FIRST,SECOND[,K]: also the two-stage model where SECOND (a ranking model) "
        "orders FIRST's top K (default 500), named FIRST>SECOND."
    ),
]
RerankOnlyOption = Annotated[
    bool,
    typer.Option(
        "--rerank-only",
        help="With --rerank: SECOND scores FIRST's candidates only, not the whole corpus "
        "(a ranking model over a large catalogue).",
    ),
]
ProtocolOption = Annotated[
    str | None,
    typer.Option(
        help="A published protocol (loo-position: the last item test, every item ranked for "
        "every user, the history excluded, HR and NDCG @5/10/20); sets the split, cut-offs "
        "and exclusions, and refuses models reading more history than it allows."
    ),
]
ParetoOption = Annotated[
    Path | None,
    typer.Option(
        help="Write a PNG of each model's HR@10 (or --pareto-metric; mean ± std over its "
        "checkpoints) against its FLOPs per (request, ad) pair, log scale, the front joined."
    ),
]
ParetoMetricOption = Annotated[
    str | None,
    typer.Option(help="The metric of --pareto, e.g. truth_recall@50 (default: hr@10)."),
]
RecordOption = Annotated[
    Path | None,
    typer.Option(
        help="Write what this call scores (each model's and baseline's rank of every target, "
        "FLOPs per pair, the checkpoints' training histories) to this .npz file, for a later "
        "--from-record."
    ),
]
FromRecordOption = Annotated[
    list[str] | None,
    typer.Option(
        help="An earlier call's --record (repeatable, or a glob): its models join this table, "
        "its comparisons and plots, as if scored here; it must be of the same requests (--data, "
        "--split or --protocol, --max-users). A name in several records: seeds of one model."
    ),
]
ReferenceOption = Annotated[
    str | None, typer.Option(help="Model whose top-K the others are compared with.")
]


@cli_errors
def eval_cmd(
    data: DataOption,
    model: ModelsOption = None,
    baselines: BaselinesOption = None,
    compare: CompareOption = None,
    rerank: RerankOption = None,
    rerank_only: RerankOnlyOption = False,
    split: SplitOption = "leave-last-out",
    protocol: ProtocolOption = None,
    max_users: MaxUsersOption = None,
    ks: Annotated[str, typer.Option(help="Cut-offs, comma-separated.")] = "10,50,100,500",
    reference: ReferenceOption = None,
    exclude_seen: ExcludeSeenOption = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of recall@K against K.")] = None,
    pareto: ParetoOption = None,
    pareto_metric: ParetoMetricOption = None,
    json_out: JsonOption = None,
    record: RecordOption = None,
    from_record: FromRecordOption = None,
    device: DeviceOption = "cpu",
) -> None:
    """Full-corpus offline metrics (every ad scored) of models and baselines on the same requests.

    A model given with several checkpoints (training seeds) is reported as mean ± sample standard
    deviation over them; two models are compared request by request (per-request metric averaged
    over seeds) with a 95% percentile-bootstrap interval over test requests (m31.eval.stats).
    """
    from m31.eval.plot import plot_recall_at_k
    from m31.eval.runs import evaluate_runs

    try:
        cutoffs = tuple(int(k) for k in ks.split(","))
    except ValueError:
        fail(f"--ks: expected comma-separated integers, got {ks!r}")
    runs = named_paths(model, "--model")
    two_stage = _rerank(rerank, rerank_only, reference)
    bar, callback = progress_bar()
    with bar:
        report = evaluate_runs(
            data,
            runs,
            [b for b in (baselines or "").split(",") if b],
            split=split,
            ks=cutoffs,
            protocol=protocol,
            max_users=max_users,
            exclude_seen=exclude_seen,
            reference=reference,
            rerank=two_stage,
            compare=_pairs(compare),
            records=_records(from_record),
            record=record,
            device=device,
            progress=callback,
        )
    typer.echo(report.format())
    if json_out:
        write_json(json_out, report.to_dict())
    if plot:
        plot_recall_at_k(report.means(), plot, "truth_recall" if report.truth else "hr")
        typer.echo(f"wrote {plot}")
    if pareto:
        metric = pareto_metric or f"hr@{10 if 10 in cutoffs else cutoffs[0]}"
        _plot_pareto(report, pareto, metric, Path(data).name)
        typer.echo(f"wrote {pareto}")


def _plot_pareto(report, path: Path, metric: str, title: str) -> None:
    """--pareto: quality (`metric`) against FLOPs per pair, each model a point."""
    from m31.eval.plot import plot_pareto

    known = sorted({m for s in report.summaries.values() for m in s})
    if metric not in known:
        fail(f"--pareto-metric: {metric!r} is not one of {', '.join(known)}")
    plot_pareto(report.pareto(metric), metric, path, title, report.baselines(metric))


def _records(values: list[str] | None) -> list[Path]:
    """--from-record values, each glob expanded to its matches in order."""
    import glob

    paths: list[Path] = []
    for v in values or []:
        matches = sorted(glob.glob(v)) if glob.has_magic(v) else [v]
        if not matches:
            fail(f"--from-record: no evaluation record matches {v!r}")
        paths += [Path(m) for m in matches]
    return paths


def _pairs(specs: list[str] | None) -> list[tuple[str, str]]:
    """--compare A,B values as (A, B)."""
    out = []
    for spec in specs or []:
        a, sep, b = spec.partition(",")
        if not sep:
            fail(f"--compare: need two evaluated models A,B, got {spec!r}")
        out.append((a, b))
    return out


def _rerank(text: str | None, only: bool, reference: str | None):
    """--rerank FIRST,SECOND[,K] (with --rerank-only) as an `m31.eval.runs.Rerank`, or None."""
    from m31.eval.runs import Rerank

    if text is None:
        if only:
            fail("--rerank-only goes with --rerank")
        return None
    parts = text.split(",")
    if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
        fail(f"--rerank: expected FIRST,SECOND[,K], got {text!r}")
    k = int(parts[2]) if len(parts) == 3 else 500
    if k <= 0:
        fail(f"--rerank: K must be positive, got {k}")
    if only and reference == parts[1]:
        fail(f"--reference {reference!r}: with --rerank-only it scores no whole corpus")
    return Rerank(parts[0], parts[1], k, only)


MoesOption = Annotated[
    list[str],
    typer.Option(help="moe checkpoint(s), repeatable or a glob: one per training seed."),
]
AblationReferenceOption = Annotated[
    list[str] | None,
    typer.Option(help="NAME=CHECKPOINT (or glob) of a model drawn beside, e.g. two-tower."),
]
RetrainedOption = Annotated[
    list[str] | None,
    typer.Option(
        help="NAME=CHECKPOINT (or glob): a moe retrained as a variant (m31 train --experts, "
        "--gate-dim), compared with the full model like the others."
    ),
]


@cli_errors
def ablate_cmd(
    data: DataOption,
    model: MoesOption,
    reference: AblationReferenceOption = None,
    retrained: RetrainedOption = None,
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
    from m31.eval.ablation import ablate

    moes = [path for _, path in named_paths(model, "--model")]
    references = grouped(named_paths(reference, "--reference", named=True))
    variants = grouped(named_paths(retrained, "--retrained", named=True))
    bar, callback = progress_bar()
    with bar:
        report = ablate(
            data,
            moes,
            references,
            variants,
            split=split,
            metric=metric,
            max_users=max_users,
            exclude_seen=exclude_seen,
            device=device,
            progress=callback,
        )
    typer.echo(report.format())
    if json_out:
        write_json(json_out, report.to_dict())
    if plot:
        report.plot(plot)
        typer.echo(f"wrote {plot}")


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
    from m31.eval.funnel import format_funnel
    from m31.eval.simulations import simulate_funnel

    result = simulate_funnel(
        data,
        named_paths(retriever, "--retriever", unique=True),
        ranker,
        k=k,
        slots=slots,
        requests=requests,
        seed=seed,
        split=split,
        device=device,
    )
    typer.echo(format_funnel(result))
    if json_out:
        write_json(json_out, result)


@cli_errors
def auction_cmd(
    data: Annotated[Path, typer.Option(help="Dataset folder of a synthetic marketplace.")],
    model: Annotated[Path, typer.Option(help="Retrieval checkpoint (moe or two-tower).")],
    ranker: Annotated[Path, typer.Option(help="Checkpoint whose scores predict conversions.")],
    minutes: Annotated[int, typer.Option(min=1, help="Simulated minutes in the day.")] = 60,
    per_minute: Annotated[int, typer.Option(min=1, help="Requests per simulated minute.")] = 25,
    k: Annotated[int, typer.Option(min=1, help="Ads retrieved per request.")] = 100,
    slots: Annotated[int, typer.Option(min=1, help="Winners per auction.")] = 4,
    max_per: Annotated[
        int, typer.Option(min=1, help="The capped arms' most ads per advertiser.")
    ] = 2,
    budget_share: Annotated[
        float, typer.Option(help="Budgets: this share of what ads spend with no budget.")
    ] = 0.5,
    seed: Annotated[int, typer.Option(help="Seed of the values and the conversion draws.")] = 0,
    split: SplitOption = "leave-last-out",
    json_out: JsonOption = None,
    device: DeviceOption = "cpu",
) -> None:
    """The funnel as an auction: relevance- against value-ranked retrieval, with and without a
    cap per advertiser; second-price auctions, budgets and pacing (DESIGN §8)."""
    from m31.eval.auction import AuctionConfig, format_auction
    from m31.eval.simulations import simulate_auction_run

    try:
        cfg = AuctionConfig(
            minutes=minutes,
            per_minute=per_minute,
            k=k,
            slots=slots,
            budget_share=budget_share,
            seed=seed,
        )
    except ValueError as e:
        fail(str(e))
    arms = (("relevance", None), ("value", None), ("relevance", max_per), ("value", max_per))
    result = simulate_auction_run(
        data, model, ranker, cfg, arms=arms, split=split, device=device, log=typer.echo
    )
    typer.echo(format_auction(result))
    if json_out:
        write_json(json_out, result)
