"""The tables of `m31 bench`: markdown and CSV, the kernel's ratios to its baselines, the GPU
acceptance lines, the plot.

Shapes: N ads, B requests, K results, E experts, G gate-key dim, D value dim.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from m31.bench.cases import VARIANTS
from m31.bench.check import CheckRow
from m31.bench.common import Limits, device_name, fmt_rate
from m31.bench.engine import EngineTiming
from m31.bench.kernels import Timing

# The fused kernel's acceptance on one H200 at N = 10 M, E = 8, G = D = 64.
ACCEPT_SHAPE = {"n": 10_000_000, "e": 8, "g": 64, "d": 64}
ACCEPT_ADS_B1 = 12e9  # ads/s at B = 1, K = 100
ACCEPT_PAIRS_B64 = 150e9  # pairs/s at B = 64, K = 100
ACCEPT_K_RATIO = 1.5  # time at K = 1000 over time at K = 100


def _count(n: int) -> str:
    return fmt_rate(n).replace(" ", "")


def markdown(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[Any]) -> None:
    if not rows:
        return
    names = [f.name for f in fields(rows[0])]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})


def timings_markdown(rows: Sequence[Timing]) -> str:
    def cells(r: Timing):
        if r.status != "ok":
            return (_count(r.n), r.b, r.k, r.variant, r.impl, r.table, "", "", "", "", "", r.note)
        return (
            _count(r.n),
            r.b,
            r.k,
            r.variant,
            r.impl,
            r.table,
            f"{r.median_ms:.3f}",
            fmt_rate(r.ads_per_s),
            fmt_rate(r.pairs_per_s),
            f"{r.gb_per_s:.1f}",
            f"{r.pct_of_limit:.1f}% ({r.bound})",
            "" if r.recall_vs_bf16 is None else f"recall@K vs bf16 {r.recall_vs_bf16:.4f}",
        )

    header = ("N", "B", "K", "variant", "impl", "table", "median ms", "ads/s", "pairs/s")
    return markdown((*header, "GB/s", "% of limit", "note"), map(cells, rows))


def ratios(rows: Sequence[Timing]) -> list[dict]:
    """Per (N, B, K): the kernel's speed over each baseline's, the 8-bit kernel's over the bf16
    one's (and its compiled steps over its torch ops), and the kernel's time over its time at K = 100
    (same N and B)."""
    ok = {(r.n, r.b, r.k, r.variant): r for r in rows if r.status == "ok"}
    out = []
    for n, b, k in dict.fromkeys((r.n, r.b, r.k) for r in rows):
        kern = ok.get((n, b, k, "kernel"))
        if kern is None:
            continue
        entry: dict[str, Any] = {"n": n, "b": b, "k": k}
        for other in ("compile", "eager", "reference", "two-tower", "faiss"):
            if (n, b, k, other) in ok:
                entry[f"vs {other}"] = ok[(n, b, k, other)].median_ms / kern.median_ms
        if (n, b, k, "kernel-int8") in ok:
            int8 = ok[(n, b, k, "kernel-int8")].median_ms
            entry["int8 vs bf16"] = kern.median_ms / int8
            if (n, b, k, "kernel-int8-torch") in ok:
                entry["int8 compiled vs torch ops"] = (
                    ok[(n, b, k, "kernel-int8-torch")].median_ms / int8
                )
        if k != 100 and (n, b, 100, "kernel") in ok:
            entry["time / K=100"] = kern.median_ms / ok[(n, b, 100, "kernel")].median_ms
        out.append(entry)
    return out


def ratios_markdown(entries: Sequence[dict]) -> str:
    cols = list(dict.fromkeys(c for e in entries for c in e if c not in ("n", "b", "k")))
    return markdown(
        ("N", "B", "K", *cols),
        (
            (_count(e["n"]), e["b"], e["k"], *(f"{e[c]:.2f}x" if c in e else "" for c in cols))
            for e in entries
        ),
    )


def acceptance(rows: Sequence[Timing]) -> list[str]:
    """The fused kernel's GPU acceptance lines, for the shapes this run measured."""
    ok = {
        (r.b, r.k, r.variant): r
        for r in rows
        if r.status == "ok" and all(getattr(r, f) == v for f, v in ACCEPT_SHAPE.items())
    }
    lines = []

    def line(what: str, value: str, passed: bool) -> None:
        lines.append(f"{'PASS' if passed else 'FAIL'}  {what}: {value}")

    if (r := ok.get((1, 100, "kernel"))) is not None:
        line(
            f"B = 1 ≥ {fmt_rate(ACCEPT_ADS_B1)} ads/s",
            fmt_rate(r.ads_per_s),
            r.ads_per_s >= ACCEPT_ADS_B1,
        )
    if (r := ok.get((64, 100, "kernel"))) is not None:
        line(
            f"B = 64 ≥ {fmt_rate(ACCEPT_PAIRS_B64)} pairs/s",
            fmt_rate(r.pairs_per_s),
            r.pairs_per_s >= ACCEPT_PAIRS_B64,
        )
    for b in sorted({b for b, k, v in ok if k == 1000 and v == "kernel"}):
        if (b, 100, "kernel") in ok:
            ratio = ok[(b, 1000, "kernel")].median_ms / ok[(b, 100, "kernel")].median_ms
            line(
                f"B = {b}: K = 1000 ≤ {ACCEPT_K_RATIO}x K = 100",
                f"{ratio:.2f}x",
                ratio <= ACCEPT_K_RATIO,
            )
    for (b, k, v), r in sorted(ok.items()):
        if v == "kernel-int8" and r.recall_vs_bf16 is not None:
            lines.append(f"info  B = {b} K = {k}: 8-bit recall@K vs bf16 {r.recall_vs_bf16:.4f}")
    return lines


def plot(rows: Sequence[Timing], path: Path) -> str | None:
    """pairs/s per shape and variant on a log scale, the §2 roofline as a dashed line; returns
    why no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    ok = [r for r in rows if r.status == "ok"]
    if not ok:
        return "nothing measured: no PNG"
    shapes = list(dict.fromkeys((r.n, r.b, r.k) for r in ok))
    variants = [v for v in VARIANTS if any(r.variant == v for r in ok)]
    by = {(r.n, r.b, r.k, r.variant): r for r in ok}
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(shapes) + 2), 4.8))
    for j, v in enumerate(variants):
        xs = [i for i, s in enumerate(shapes) if (*s, v) in by]
        ys = [by[(*shapes[i], v)].pairs_per_s for i in xs]
        ax.bar([i - 0.4 + (j + 0.5) * width for i in xs], ys, width, label=v)
    for i, s in enumerate(shapes):
        moe = next((by[(*s, v)] for v in ("kernel", "reference", "eager") if (*s, v) in by), None)
        if moe is not None:
            ax.hlines(moe.limit_pairs_per_s, i - 0.45, i + 0.45, colors="black", linestyles="--")
    first = ok[0]
    ax.set_yscale("log")
    ax.set_ylabel("pairs/s (dashed: §2 limit of the bf16 table)")
    ax.set_xticks(range(len(shapes)), [f"N={_count(n)}\nB={b} K={k}" for n, b, k in shapes])
    ax.set_title(f"score·filter·top-K, E = {first.e}, G = D = {first.d}; {first.device}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None


def check_report(checks: Sequence[CheckRow], recalls: Sequence[dict], device) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "FAIL", "skipped")}
    lines = [
        f"## Correctness against the reference on {device_name(device)}: {counts['ok']} ok, "
        f"{counts['FAIL']} failed, {counts['skipped']} skipped",
        "",
    ]
    if counts["ok"] == len(checks):
        lines.append("Every kernel, bf16 and 8-bit, matches the reference.")
    else:
        lines.append(
            markdown(
                ("kernel", "table", "B", "N", "E", "G", "D", "K", "mask", "status", "note"),
                (
                    (c.kernel, c.table, c.b, c.n, c.e, c.g, c.d, c.k, c.mask, c.status, c.note)
                    for c in checks
                    if c.status != "ok"
                ),
            )
        )
    if recalls:
        lines.append("")
    lines += [
        f"* recall@{r['k']} of the 8-bit table's top K against the bf16 table's (B = {r['b']}, "
        f"N = {r['n']:,}, random data): {r['recall']:.4f}"
        for r in recalls
    ]
    return "\n".join(lines)


def timings_report(rows: Sequence[Timing], limits: Limits, gpu: bool, no_plot: str | None) -> str:
    first = rows[0]
    parts = [
        f"## score·filter·top-K on {first.device}, E = {first.e}, G = {first.g}, D = {first.d}, "
        "half the ads eligible",
        "",
        f"Limits ({limits.source}): copy {limits.bandwidth / 1e12:.3g} TB/s, bf16 matrix "
        f"{limits.matmul_bf16 / 1e12:.3g} TFLOP/s"
        + (f", fp32 matrix {limits.matmul_fp32 / 1e12:.3g} TFLOP/s" if limits.matmul_fp32 else "")
        + (f", int8 matrix {limits.matmul_int8 / 1e12:.3g} TOP/s" if limits.matmul_int8 else "")
        + (" (on a CPU every variant is held to the fastest of these)." if not gpu else "."),
        "",
        timings_markdown(rows),
    ]
    if entries := ratios(rows):
        parts += [
            "",
            "The kernel's speed over each baseline's (vs ...), the 8-bit kernel's over the bf16 "
            "one's, and the kernel's time over its time at K = 100:",
            "",
            ratios_markdown(entries),
        ]
    if gpu and (lines := acceptance(rows)):
        parts += ["", "GPU acceptance (N = 10 M, E = 8, G = D = 64):", "", *lines]
    if no_plot:
        parts += ["", no_plot]
    return "\n".join(parts)


def engine_report(rows: Sequence[EngineTiming]) -> str:
    first = rows[0]
    return "\n".join(
        [
            f"## Engine end to end on {first.device}: Retriever.retrieve over N = {first.n:,} "
            f"ads, K = {first.k}, untrained {first.model} moe (E = {first.e}, G = {first.g}, "
            f"D = {first.d}); index built in "
            + ", ".join(
                f"{r.index_build_s:.1f} s ({r.dtype})"
                for r in rows
                if (r.b, r.max_per, r.g, r.rank) == (first.b, first.max_per, first.g, first.rank)
            ),
            "",
            markdown(
                (
                    "table",
                    "G",
                    "B",
                    "max per advertiser",
                    "rank",
                    "median ms",
                    "ads/s",
                    "pairs/s",
                    "encode ms",
                    "mask ms",
                    "score·top-K ms",
                ),
                (
                    (
                        r.dtype,
                        f"{r.g} (folded)" if r.g == 0 else r.g,
                        r.b,
                        r.max_per or "–",
                        r.rank,
                        f"{r.median_ms:.1f}",
                        fmt_rate(r.ads_per_s),
                        fmt_rate(r.pairs_per_s),
                        f"{r.encode_ms:.1f}",
                        f"{r.mask_ms:.1f}",
                        f"{r.score_topk_ms:.1f}",
                    )
                    for r in rows
                ),
            ),
        ]
    )
