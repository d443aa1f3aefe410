"""`m31 bench <what>`, also `python -m m31.bench <what>`: every benchmark of the project, one
subcommand each; `m31.cli` registers this typer group as `m31 bench`.

    m31 bench kernels                          # timings at the device's default shapes
    m31 bench kernels --check                  # every kernel against the reference; exit 1 if not
    m31 bench kernels --canonical              # DESIGN §6's shapes
    m31 bench engine                           # Retriever.retrieve end to end
    m31 bench eligibility | attribute-memory | embedding-cache       # the index's parts, CPU
    m31 bench explain --index DIR --model CKPT # explain and why-not against a plain retrieve
    m31 bench table-dtypes | hierarchical --data DIR --model CKPT    # on a trained model
    m31 bench cluster                          # the single process against S shards on Ray
    m31 bench events WORLD                     # events beside retrieves in one process

Each appends its figures to the results table (`m31.bench.results`: bench/results.csv of the
checkout, or --results PATH), one row per figure; so does `m31 loadtest` (`m31.bench.loadtest`).

Typer alone is imported at the top, each benchmark's module (and PyTorch, Ray) when it runs:
`m31.cli` imports this module, and its other commands should not wait for PyTorch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from m31.bench import results as _results
from m31.bench.cases import VARIANTS

app = typer.Typer(
    name="bench",
    no_args_is_help=True,
    add_completion=False,
    help="Benchmarks, one subcommand each; figures with dates and commands: bench/RESULTS.md.",
)

_DEFAULT_N = "10M on cuda, 1M on cpu, 20k with --quick"


def _counts(text: str | None, option: str, least: int = 1) -> tuple[int, ...] | None:
    """ "1,64" or "1M,10M" -> ints >= `least` (k, M, G suffixes; underscores allowed); None
    stays None."""
    if text is None:
        return None
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}
    out = []
    for part in text.split(","):
        s = part.strip().replace("_", "").lower()
        try:
            value = int(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else int(s)
        except ValueError:
            raise typer.BadParameter(f"not a count: {part!r}", param_hint=option) from None
        if value < least:
            raise typer.BadParameter(f"must be at least {least}: {part!r}", param_hint=option)
        out.append(value)
    return tuple(out)


def _choices(text: str, allowed, option: str, what: str) -> tuple[str, ...]:
    """A comma-separated list of an option's values, each one of `allowed`, none twice."""
    names = tuple(v.strip() for v in text.split(","))
    bad = [v for v in names if v not in allowed]
    if bad:
        raise typer.BadParameter(
            f"unknown {bad[0]!r}; choose from {', '.join(allowed)}", param_hint=option
        )
    if len(set(names)) != len(names):
        raise typer.BadParameter(f"a {what} given twice", param_hint=option)
    return names


def _ranks(text: str) -> tuple[str, ...]:
    """--rank "relevance,value" -> the requests' rankings."""
    from m31.engine.requests import RANKS

    return _choices(text, RANKS, "--rank", "ranking")


def _dtypes(text: str) -> tuple[str, ...]:
    """--dtype "bfloat16,int8" -> names of index table dtypes."""
    from m31.index.ad_table import TABLE_DTYPES

    return _choices(text, tuple(TABLE_DTYPES), "--dtype", "dtype")


def _variants(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise typer.BadParameter("no variant given", param_hint="--variants")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise typer.BadParameter(
            f"unknown {unknown}; choose from {', '.join(VARIANTS)}", param_hint="--variants"
        )
    return names


def _positive(value: float) -> float:
    if value <= 0:
        raise typer.BadParameter("must be positive")
    return value


def _run_suite(plan, out: Path, results: Path | None) -> None:
    """Run a kernels or engine plan (`m31.bench.suite`), print its tables, append its figures;
    exit 1 on a failed check (its figures say which kernel erred)."""
    import torch

    from m31.bench.suite import run_suite

    text, failed, figures = run_suite(plan, out)
    print(text)
    gpu = torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else None
    _results.record(figures, results, gpu)
    if failed:
        raise typer.Exit(1)


DeviceOption = Annotated[str, typer.Option(help="auto (cuda if available), cuda or cpu.")]
TimingsOption = Annotated[
    bool, typer.Option("--timings", help="The timings as well as --check (on unless --check).")
]
CheckOption = Annotated[
    bool, typer.Option("--check", help="Kernels vs the reference; exit 1 if not.")
]
CanonicalOption = Annotated[
    bool, typer.Option("--canonical", help="Timings at DESIGN §6's shapes.")
]
QuickOption = Annotated[bool, typer.Option("--quick", help="Small shapes: a CPU smoke run.")]
NOption = Annotated[str | None, typer.Option(help=f"Ads, e.g. 1M,10M ({_DEFAULT_N}).")]
BatchesOption = Annotated[
    str | None, typer.Option(help="Requests per batch (1,64,512 on cuda, 1,64 on cpu).")
]
ALL_VARIANTS = ",".join(VARIANTS)
VariantsOption = Annotated[
    str,
    typer.Option(help=f"Comma-separated, of {', '.join(VARIANTS)} (all).", show_default=False),
]
MeasureLimitsOption = Annotated[
    bool, typer.Option("--measure-limits", help="Measure the limits even on an H200.")
]
RepeatOption = Annotated[int, typer.Option(min=1, help="Timed calls per measurement, at most.")]
BudgetOption = Annotated[
    float, typer.Option(callback=_positive, help="Seconds of timed calls, at most.")
]
SeedOption = Annotated[int, typer.Option(help="Seed of the tables, queries and world.")]
OutOption = Annotated[Path, typer.Option(help="Folder for CSV, MD, PNG.")]
EngineNOption = Annotated[str | None, typer.Option(help=f"Ads in the index ({_DEFAULT_N}).")]
EngineBatchesOption = Annotated[
    str | None, typer.Option(help="Requests per call (1,64,256; 1,3 with --quick).")
]
EngineDtypeOption = Annotated[
    str, typer.Option(help="The index's table dtypes, each timed: bfloat16,int8 compares.")
]
EngineModelOption = Annotated[str, typer.Option(help="Model preset (demo: E = 8, G = D = 64).")]
DataOption = Annotated[
    Path, typer.Option(exists=True, file_okay=False, help="Dataset folder the model learnt.")
]
ModelOption = Annotated[
    Path, typer.Option(exists=True, dir_okay=False, help="A moe or two-tower checkpoint.")
]
ResultsOption = Annotated[
    Path | None,
    typer.Option(
        envvar=_results.ENV,
        dir_okay=False,
        show_default=False,
        help="The results table this run's rows are appended to (default: the checkout's "
        "bench/results.csv).",
    ),
]  # also `m31 loadtest`'s


@app.command()
def kernels(
    device: DeviceOption = "auto",
    check: CheckOption = False,
    timings: TimingsOption = False,
    canonical: CanonicalOption = False,
    quick: QuickOption = False,
    n: NOption = None,
    batches: BatchesOption = None,
    k: Annotated[str | None, typer.Option(help="Results per request (100).")] = None,
    experts: Annotated[int, typer.Option(min=1, help="E.")] = 8,
    dim: Annotated[int, typer.Option(min=1, help="G = D.")] = 64,
    variants: VariantsOption = ALL_VARIANTS,
    repeat: RepeatOption = 5,
    budget: BudgetOption = 2.0,
    measure_limits: MeasureLimitsOption = False,
    seed: SeedOption = 0,
    out: OutOption = Path("bench/out"),
    results: ResultsOption = None,
) -> None:
    """score·filter·top-K against its baselines; --check: every kernel against the reference.

    The timings (bench.{csv,md,png}) measure every variant in the same run; --check (check.{csv,md})
    exits 1 if a kernel disagrees, and runs the timings too only when asked for (--timings,
    --canonical). Progress goes to stderr; the tables go to stdout, last, and to --out.
    """
    from m31.bench.suite import Plan

    plan = Plan(
        device=torch_device(device),
        check=check,
        timings=timings or canonical or not check,
        canonical=canonical,
        quick=quick,
        n=_counts(n, "--n"),
        batches=_counts(batches, "--batches"),
        k=_counts(k, "--k"),
        experts=experts,
        dim=dim,
        variants=_variants(variants),
        repeat=repeat,
        budget=budget,
        measure_limits=measure_limits,
        seed=seed,
    )
    if canonical and (plan.n or plan.batches or plan.k):
        raise typer.BadParameter(
            "it sets N, B and K itself; drop --n, --batches and --k", param_hint="--canonical"
        )
    _run_suite(plan, out, results)


@app.command()
def engine(
    n: EngineNOption = None,
    batches: EngineBatchesOption = None,
    k: Annotated[int, typer.Option(min=1, help="Results per request.")] = 100,
    dtype: EngineDtypeOption = "bfloat16",
    model: EngineModelOption = "demo",
    device: DeviceOption = "auto",
    quick: QuickOption = False,
    repeat: RepeatOption = 5,
    budget: BudgetOption = 2.0,
    seed: SeedOption = 0,
    out: OutOption = Path("bench/out"),
    max_per: Annotated[
        str, typer.Option(help="Caps per advertiser to time the requests with, a list (0: none).")
    ] = "0",
    gate_dims: Annotated[
        str | None, typer.Option(help="The model's G, each timed: 64,0 (0: one folded query).")
    ] = None,
    rank: Annotated[
        str,
        typer.Option(
            help="The requests' rankings to time, a list: relevance, value (the value column)."
        ),
    ] = "relevance",
    results: ResultsOption = None,
) -> None:
    """Retriever.retrieve end to end over a synthetic index of N ads, per table dtype.

    Encoding, masks and score·top-K timed apart (engine.{csv,md}); only the first of --n is used.
    """
    from m31.bench.suite import Plan

    plan = Plan(
        device=torch_device(device),
        timings=False,
        engine=True,
        quick=quick,
        engine_n=_counts(n, "--n"),
        engine_batches=_counts(batches, "--batches"),
        engine_k=k,
        engine_dtypes=_dtypes(dtype),
        engine_model=model,
        repeat=repeat,
        budget=budget,
        seed=seed,
        engine_max_per=_counts(max_per, "--max-per", least=0),
        engine_gate_dims=_counts(gate_dims, "--gate-dims", least=0),
        engine_ranks=_ranks(rank),
    )
    _run_suite(plan, out, results)


@app.command()
def eligibility(
    n: Annotated[str, typer.Option(help="Ads in the index, a list.")] = "1M,10M",
    batches: Annotated[str, typer.Option(help="Requests per batch, a list.")] = "1,64",
    repeat: RepeatOption = 5,
    engine: Annotated[
        bool, typer.Option("--engine", help="Also Retriever.retrieve with each builder (first N).")
    ] = False,
    results: ResultsOption = None,
) -> None:
    """Eligibility masks per request: the column builder against the row bitmaps (CPU).

    Per N and B, beside the score·top-K pass they feed; with --engine, Retriever.retrieve with
    each builder at the first N.
    """
    from m31.bench import eligibility as bench

    figures = bench.run(_counts(n, "--n"), _counts(batches, "--batches"), repeat, engine)
    _results.record(figures, results)


@app.command()
def explain(
    index: Annotated[Path, typer.Option(help="A served index (m31 index build's folder).")],
    model: Annotated[Path, typer.Option(help="The checkpoint it was built with.")],
    k: Annotated[int, typer.Option(min=1, help="Results per request.")] = 100,
    why_not: Annotated[int, typer.Option(min=0, max=100, help="Ads asked about.")] = 100,
    repeat: Annotated[int, typer.Option(min=1, help="Calls of each variant.")] = 40,
    results: ResultsOption = None,
) -> None:
    """What explaining costs: a retrieve plain, with explain, and with a why-not (B = 1)."""
    from m31.bench import explain as bench

    _results.record(bench.run(index, model, k, why_not, repeat), results)


@app.command("attribute-memory")
def attribute_memory(
    ads: Annotated[int, typer.Option(min=1, help="Ads in the index.")] = 50_000,
    new_tags: Annotated[int, typer.Option(min=1, help="Distinct values added.")] = 1_000,
    device: Annotated[str, typer.Option(help="The index's device.")] = "cpu",
    threads: Annotated[int, typer.Option(min=1, help="CPU threads of the mask timings.")] = 1,
    results: ResultsOption = None,
) -> None:
    """Memory of the attribute table per distinct list value, and a targeting mask's cost."""
    from m31.bench import attribute_memory as bench

    figures = bench.run(ads, new_tags, device, threads)
    _results.record(figures, results, _gpu(device))


@app.command("embedding-cache")
def embedding_cache(
    cached: Annotated[int, typer.Option(min=1, help="Texts in the cache first.")] = 3_000,
    batch: Annotated[str, typer.Option(help="Texts per upsert, a list.")] = "1,10,100",
    repeat: Annotated[int, typer.Option(min=1, help="Upserts timed per batch size.")] = 20,
    results: ResultsOption = None,
) -> None:
    """The text-embedding cache's cost per upsert, with --cached texts already in it."""
    from m31.bench import embedding_cache as bench

    _results.record(bench.run(cached, _counts(batch, "--batch"), repeat), results)


@app.command("table-dtypes")
def table_dtypes(
    data: DataOption,
    model: ModelOption,
    split: Annotated[str, typer.Option(help="leave-last-out or time.")] = "leave-last-out",
    requests: Annotated[int, typer.Option(min=1, help="Test requests sampled.")] = 2000,
    k: Annotated[int, typer.Option(min=1, help="Results per request.")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the sample.")] = 0,
    results: ResultsOption = None,
) -> None:
    """Overlap of the engine's results over bfloat16 and int8 ad tables with float32's."""
    from m31.bench import table_dtypes as bench

    _results.record(bench.run(data, model, split, requests, k, seed), results)


@app.command()
def hierarchical(
    data: DataOption,
    model: ModelOption,
    clusters: Annotated[int, typer.Option(min=1, help="k-means clusters.")] = 256,
    requests: Annotated[int, typer.Option(min=1, help="Test requests, at most.")] = 200,
    k: Annotated[int, typer.Option(min=1, help="Results per request.")] = 100,
    results: ResultsOption = None,
) -> None:
    """Recall and speed-up of the hierarchical index against exhaustive scoring, per probe."""
    from m31.bench import hierarchical as bench

    _results.record(bench.run(data, model, clusters, requests, k), results)


@app.command()
def cluster(
    n: Annotated[int, typer.Option(min=1, help="Ads.")] = 200_000,
    batches: Annotated[str, typer.Option(help="Requests per batch, a list.")] = "1,64",
    k: Annotated[int, typer.Option(min=1, help="Results per request.")] = 100,
    shards: Annotated[str, typer.Option(help="Shard counts, a list.")] = "1,2,4",
    experts: Annotated[int, typer.Option(min=1, help="E.")] = 8,
    dim: Annotated[int, typer.Option(min=1, help="G = D.")] = 64,
    repeat: Annotated[int, typer.Option(min=1, help="Timed batches per measurement.")] = 7,
    cpus: Annotated[int, typer.Option(min=1, help="Cores Ray may use.")] = os.cpu_count() or 1,
    out: Annotated[Path | None, typer.Option(help="Write the table here too.")] = None,
    results: ResultsOption = None,
) -> None:
    """Scatter-gather overhead: the single-process engine against S shards on Ray.

    Same corpus, same requests, one run; exits 1 if a cluster answer differs.
    """
    from m31.bench import cluster as bench

    figures = bench.run(
        n,
        _counts(batches, "--batches"),
        k,
        _counts(shards, "--shards"),
        experts,
        dim,
        repeat,
        cpus,
        out,
    )
    _results.record(figures, results)


@app.command()
def events(
    world: Annotated[
        Path,
        typer.Argument(
            exists=True, file_okay=False, help="A folder `scripts/serve_limits.py build` made."
        ),
    ],
    rate: Annotated[str, typer.Option(help="Events per second, a list.")] = "2000,10000,20000",
    batch: Annotated[int, typer.Option(min=1, help="Events per call.")] = 100,
    rounds: Annotated[int, typer.Option(min=2, help="Alternating rounds per rate.")] = 16,
    per_round: Annotated[int, typer.Option(min=1, help="Retrieves per round.")] = 30,
    results: ResultsOption = None,
) -> None:
    """What engagement events cost retrieval inside one server process, without HTTP."""
    from m31.bench import events as bench

    _results.record(bench.run(world, _counts(rate, "--rate"), batch, rounds, per_round), results)


def _gpu(device: str) -> str | None:
    """The GPU's name for the results rows when `device` is one."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def torch_device(name: str):
    """--device: auto (cuda if available), cuda or cpu."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("no CUDA device here", param_hint="--device")
    return dev


def main(argv: Sequence[str] | None = None) -> int:
    """`m31 bench` on `argv` (default: the process's) from Python, as the tests run it: returns
    the exit status (0, or 1 when --check failed); bad arguments exit 2 as on the command line."""
    try:
        app(args=sys.argv[1:] if argv is None else list(argv), prog_name="m31 bench")
    except SystemExit as e:  # standalone typer always exits, success included
        if e.code in (0, 1):
            return e.code
        raise
    return 0
