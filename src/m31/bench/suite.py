"""One `m31 bench kernels` or `m31 bench engine` run: the sections asked for (check, timings,
engine), each written to its CSV and markdown file in the output folder, the report that the
command prints, and its figures as results rows (`m31.bench.results`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from m31.bench.results import Figure, short


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


def run_suite(plan: Plan, out: Path) -> tuple[str, bool, list[Figure]]:
    """Run `plan`, writing its tables and plot into `out`: (the report, whether a kernel
    disagreed with the reference, the figures). Progress goes to stderr."""
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
    figures: list[Figure] = []
    failed = False

    if plan.check:
        checks, recalls = run_check(dev, quick=quick, seed=plan.seed)
        report.write_csv(out / "check.csv", checks)
        failed = any(c.status == "FAIL" for c in checks)
        sections.append(report.check_report(checks, recalls, dev))
        figures += check_figures(checks, recalls)
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
            cases,
            dev,
            plan.experts,
            plan.dim,
            plan.repeat,
            plan.budget,
            plan.measure_limits,
            plan.seed,
        )
        report.write_csv(out / "bench.csv", rows)
        no_plot = report.plot(rows, out / "bench.png")
        limits = device_limits(dev, plan.measure_limits)
        sections.append(report.timings_report(rows, limits, cuda, no_plot))
        figures += timing_figures(rows)
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
            figures += engine_figures(engine_rows)
        (out / "engine.md").write_text(sections[-1] + "\n")

    to_stderr(f"wall time {time.perf_counter() - start:.0f} s; tables and plot in {out}")
    return "\n\n".join(sections), failed, figures


def _shape(n: int, b: int, k: int, e: int, g: int, d: int) -> str:
    return f"N={short(n)} B={b} K={k} E={e} G={g} D={d}"


def check_figures(checks, recalls) -> list[Figure]:
    """Per kernel and case checked, its largest score error and the share of the reference's
    rows it returned; the 8-bit table's recall@K against the bf16 table's."""
    out = []
    for c in checks:
        case = f"{_shape(c.n, c.b, c.k, c.e, c.g, c.d)} mask={c.mask}"
        for metric in ("max_abs_err", "rows_equal"):
            if getattr(c, metric) is not None:
                out.append(
                    Figure("kernels", case, f"{c.kernel} ({c.table})", metric, getattr(c, metric))
                )
    for r in recalls:
        case = f"N={short(r['n'])} B={r['b']} K={r['k']}"
        out.append(Figure("kernels", case, "kernel-int8 (int8)", "recall_vs_bf16", r["recall"]))
    return out


_TIMING_UNITS = {
    "median_ms": "ms", "ads_per_s": "ads/s", "pairs_per_s": "pairs/s", "gb_per_s": "GB/s",
    "pct_of_limit": "%", "recall_vs_bf16": "",
}  # fmt: skip


def timing_figures(rows) -> list[Figure]:
    """The timed variants' rates and times (skipped ones have none)."""
    out = []
    for t in rows:
        if t.status != "ok":
            continue
        case = _shape(t.n, t.b, t.k, t.e, t.g, t.d)
        variant = f"{t.variant} ({t.table})" if t.table else t.variant
        for metric, unit in _TIMING_UNITS.items():
            if getattr(t, metric) is not None:
                out.append(Figure("kernels", case, variant, metric, getattr(t, metric), unit))
    return out


_ENGINE_UNITS = {
    "median_ms": "ms", "ads_per_s": "ads/s", "pairs_per_s": "pairs/s", "encode_ms": "ms",
    "mask_ms": "ms", "score_topk_ms": "ms", "index_build_s": "s",
}  # fmt: skip


def engine_figures(rows) -> list[Figure]:
    """Retriever.retrieve's time, rates and parts per table dtype, cap and ranking."""
    out = []
    for r in rows:
        case = f"{_shape(r.n, r.b, r.k, r.e, r.g, r.d)} model={r.model}"
        variant = r.dtype
        if r.max_per:
            variant += f" max_per={r.max_per}"
        if r.rank != "relevance":
            variant += f" rank={r.rank}"
        out += [
            Figure("engine", case, variant, m, getattr(r, m), u) for m, u in _ENGINE_UNITS.items()
        ]
    return out
