"""One `m31 bench kernels` or `m31 bench engine` run: the sections asked for (check, timings,
engine), each written to its CSV and markdown file in the output folder, and the report that the
command prints."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Plan:
    """What to run, as the command's options give it (None: the device's default)."""

    device: torch.device
    check: bool = False  # every kernel against the reference
    timings: bool = True  # score·filter·top-K and its baselines
    engine: bool = False  # Retriever.retrieve end to end
    canonical: bool = False  # timings at DESIGN §6's shapes
    quick: bool = False  # small shapes: a CPU smoke run
    n: tuple[int, ...] | None = None
    batches: tuple[int, ...] | None = None
    k: tuple[int, ...] | None = None
    experts: int = 8
    dim: int = 64
    variants: tuple[str, ...] = ()
    repeat: int = 5
    budget: float = 2.0
    measure_limits: bool = False
    engine_n: tuple[int, ...] | None = None
    engine_batches: tuple[int, ...] | None = None
    engine_k: int = 100
    engine_dtypes: tuple[str, ...] = ("bfloat16",)
    engine_model: str = "demo"
    engine_max_per: tuple[int, ...] = (0,)  # caps per advertiser to time (0: none)
    engine_ranks: tuple[str, ...] = ("relevance",)  # the requests' rankings to time
    engine_gate_dims: tuple[int, ...] | None = None  # the model's G, each timed (None: preset's)
    seed: int = 0


def run_suite(plan: Plan, out: Path) -> tuple[str, bool]:
    """Run `plan`, writing its tables and plot into `out`: (the report, whether a kernel
    disagreed with the reference). Progress goes to stderr."""
    from m31.bench import report
    from m31.bench.cases import canonical_cases, plan_cases
    from m31.bench.check import run_check
    from m31.bench.common import Skip, device_limits, to_stderr
    from m31.bench.engine import run_engine
    from m31.bench.kernels import run_timings

    dev, quick = plan.device, plan.quick
    cuda = dev.type == "cuda"
    default_n = (20_000,) if quick else (10_000_000,) if cuda else (1_000_000,)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sections: list[str] = []
    failed = False

    if plan.check:
        checks, recalls = run_check(dev, quick=quick, seed=plan.seed)
        report.write_csv(out / "check.csv", checks)
        failed = any(c.status == "FAIL" for c in checks)
        sections.append(report.check_report(checks, recalls, dev))
        (out / "check.md").write_text(sections[-1] + "\n")

    if plan.timings:
        if plan.canonical:
            cases = canonical_cases(plan.variants)
        else:
            cases = plan_cases(
                plan.n or default_n,
                plan.batches or ((1, 3) if quick else (1, 64, 512) if cuda else (1, 64)),
                plan.k or (100,),
                plan.variants,
            )
        rows = run_timings(
            cases, dev, plan.experts, plan.dim, plan.repeat, plan.budget, plan.measure_limits,
            plan.seed,
        )  # fmt: skip
        report.write_csv(out / "bench.csv", rows)
        no_plot = report.plot(rows, out / "bench.png")
        limits = device_limits(dev, plan.measure_limits)
        sections.append(report.timings_report(rows, limits, cuda, no_plot))
        (out / "bench.md").write_text(sections[-1] + "\n")

    if plan.engine:
        try:
            engine_rows = run_engine(
                dev,
                (plan.engine_n or default_n)[0],
                plan.engine_batches or ((1, 3) if quick else (1, 64, 256)),
                plan.engine_k,
                plan.engine_model,
                plan.repeat,
                plan.budget,
                plan.seed,
                dtypes=plan.engine_dtypes,
                max_per=plan.engine_max_per,
                gate_dims=plan.engine_gate_dims,
                ranks=plan.engine_ranks,
            )
        except Skip as e:
            sections.append(f"## Engine end to end: skipped ({e})")
        else:
            report.write_csv(out / "engine.csv", engine_rows)
            sections.append(report.engine_report(engine_rows))
        (out / "engine.md").write_text(sections[-1] + "\n")

    to_stderr(f"wall time {time.perf_counter() - start:.0f} s; tables and plot in {out}")
    return "\n\n".join(sections), failed
