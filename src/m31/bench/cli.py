"""`m31 bench`, also `python -m m31.bench`: one typer command, registered by `m31.cli` as well.

    m31 bench                           # timings at the device's default shapes
    m31 bench --canonical --engine      # DESIGN §6's shapes, then the engine end to end
    m31 bench --check                   # every kernel against the reference; exit 1 if not

Typer alone is imported at the top, PyTorch when the command runs: `m31.cli` imports this
module, and its other commands should not wait for PyTorch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from m31.bench.cases import VARIANTS

app = typer.Typer(add_completion=False)

_DEFAULT_N = "10M on cuda, 1M on cpu, 20k with --quick"


def _counts(text: str | None, option: str) -> tuple[int, ...] | None:
    """ "1,64" or "1M,10M" -> ints (k, M, G suffixes; underscores allowed); None stays None."""
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
        if value <= 0:
            raise typer.BadParameter(f"must be positive: {part!r}", param_hint=option)
        out.append(value)
    return tuple(out)


def _dtypes(text: str) -> tuple[str, ...]:
    """--engine-dtype "bfloat16,int8" -> names of index table dtypes, each known, none twice."""
    from m31.index.snapshot import DTYPES as _DTYPES

    names = tuple(v.strip() for v in text.split(","))
    bad = [v for v in names if v not in _DTYPES]
    if bad:
        raise typer.BadParameter(
            f"unknown {bad[0]!r}; choose from {', '.join(_DTYPES)}", param_hint="--engine-dtype"
        )
    if len(set(names)) != len(names):
        raise typer.BadParameter("a dtype given twice", param_hint="--engine-dtype")
    return names


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


TimingsOption = Annotated[
    bool, typer.Option("--timings", help="The timings: run unless --check or --engine alone.")
]
CheckOption = Annotated[
    bool, typer.Option("--check", help="Kernels vs the reference; exit 1 if not.")
]
EngineOption = Annotated[bool, typer.Option("--engine", help="Retriever.retrieve end to end.")]
CanonicalOption = Annotated[
    bool, typer.Option("--canonical", help="Timings at DESIGN §6's shapes.")
]
QuickOption = Annotated[bool, typer.Option("--quick", help="Small shapes: a CPU smoke run.")]
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
EngineNOption = Annotated[
    str | None, typer.Option(help=f"Ads in the engine's index ({_DEFAULT_N}).")
]
EngineBatchesOption = Annotated[
    str | None, typer.Option(help="Requests per call (1,64,256; 1,3 with --quick).")
]
EngineDtypeOption = Annotated[
    str,
    typer.Option(help="The engine index's table dtypes, each timed: bfloat16,int8 compares."),
]
EngineModelOption = Annotated[str, typer.Option(help="Model preset (demo: E = 8, G = D = 64).")]


@app.command()
def bench(
    device: Annotated[str, typer.Option(help="auto (cuda if available), cuda or cpu.")] = "auto",
    timings: TimingsOption = False,
    check: CheckOption = False,
    engine: EngineOption = False,
    canonical: CanonicalOption = False,
    quick: QuickOption = False,
    n: Annotated[str | None, typer.Option(help=f"Ads, e.g. 1M,10M ({_DEFAULT_N}).")] = None,
    batches: BatchesOption = None,
    k: Annotated[str | None, typer.Option(help="Results per request (100).")] = None,
    experts: Annotated[int, typer.Option(help="E.")] = 8,
    dim: Annotated[int, typer.Option(help="G = D.")] = 64,
    variants: VariantsOption = ALL_VARIANTS,
    repeat: Annotated[int, typer.Option(help="Timed calls per measurement, at most.")] = 5,
    budget: Annotated[float, typer.Option(help="Seconds of timed calls, at most.")] = 2.0,
    measure_limits: MeasureLimitsOption = False,
    engine_n: EngineNOption = None,
    engine_batches: EngineBatchesOption = None,
    engine_k: Annotated[int, typer.Option(help="Results per request of the engine.")] = 100,
    engine_dtype: EngineDtypeOption = "bfloat16",
    engine_model: EngineModelOption = "demo",
    seed: Annotated[int, typer.Option(help="Seed of the tables, queries and world.")] = 0,
    out: Annotated[Path, typer.Option(help="Folder for CSV, MD, PNG.")] = Path("bench/out"),
) -> None:
    """Throughput of score·filter·top-K against its baselines, every kernel against the
    reference (--check; exit 1 if one disagrees) and the engine end to end (--engine). The
    timings run when asked for (--timings, --canonical) or when neither --check nor --engine is
    given. Progress goes to stderr; the tables go to stdout, last, and to --out.
    """
    from m31.bench.suite import Plan, run_suite

    plan = Plan(
        device=torch_device(device), check=check, engine=engine, canonical=canonical,
        timings=timings or canonical or not (check or engine), quick=quick,
        n=_counts(n, "--n"), batches=_counts(batches, "--batches"), k=_counts(k, "--k"),
        experts=experts, dim=dim, variants=_variants(variants), repeat=repeat, budget=budget,
        measure_limits=measure_limits, engine_n=_counts(engine_n, "--engine-n"),
        engine_batches=_counts(engine_batches, "--engine-batches"), engine_k=engine_k,
        engine_dtypes=_dtypes(engine_dtype), engine_model=engine_model, seed=seed,
    )  # fmt: skip
    if canonical and (plan.n or plan.batches or plan.k):
        raise typer.BadParameter(
            "it sets N, B and K itself; drop --n, --batches and --k", param_hint="--canonical"
        )
    if min(experts, dim, repeat, budget, engine_k) <= 0:
        raise typer.BadParameter(
            "must be positive", param_hint="--experts, --dim, --repeat, --budget, --engine-k"
        )
    text, failed = run_suite(plan, out)
    print(text)
    if failed:
        raise typer.Exit(1)


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
