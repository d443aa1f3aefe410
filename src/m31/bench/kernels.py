"""The timings: every variant of one problem on the same tables, with its % of the device limit.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, C ads per chunk.

The problem: a random bf16 ad table as the index keeps it, about half the ads eligible,
E experts, G = D = dim. Its variants (`m31.bench.cases.VARIANTS`):
* kernel      — the dispatcher's fast path: triton on CUDA, cpu on the CPU;
* kernel-int8 — the same over the 8-bit table (`m31.ops.quant`), with its recall@K against bf16;
* kernel-int8-torch — the cpu kernel over the 8-bit table in torch ops alone (its compiled
  helpers off, `m31.ops.cpu.native`): what kernel-int8 runs without a C compiler; CPU only;
* reference   — `score_topk(kernel="torch")`, the chunked definition of correct;
* eager, compile, two-tower, faiss — `m31.bench.baselines`; the first three over an fp32 copy of
  the table where fp32 products measured faster than bf16 ones (`_Bench.baseline_table`).

Units: ads/s = N / t (a batch streams the table once), pairs/s = B·N / t, GB/s = N · bytes per
ad / t. "% of limit" is the roofline of the variant's own problem on the device: pairs/s at most
min(B · bandwidth / bytes per ad, matrix FLOP/s / FLOPs per pair), with 2·E·(G+D) FLOPs per pair
(two-tower: 2·D), against `m31.bench.common.device_limits` (the matrix rate: bf16 on a GPU, the
fastest measured on a CPU, see `_Bench.cost`). The cpu kernel skips ineligible pairs and gates
only the pairs its bound keeps, so it can pass 100% of this limit; so can a table small enough
to stay in the CPU's caches, of the memory-bound figure. Shapes whose memory does not fit and
variants that cannot run here are skipped with the reason, never a crash.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from m31.bench.baselines import (
    FaissFlat,
    chunk_size,
    chunked_topk,
    compiled_gate_scores,
    gate_scores,
    two_tower_topk,
)
from m31.bench.cases import VARIANTS, Case
from m31.bench.common import (
    Limits,
    Log,
    Skip,
    device_limits,
    device_name,
    fits,
    fmt_rate,
    gb,
    random_query,
    random_table,
    recall_at_k,
    row_bytes,
    time_call,
    to_stderr,
)
from m31.ops import available_kernels, quantize_ad_table, score_topk
from m31.ops.cpu import native


@dataclass
class Timing:
    device: str
    n: int
    b: int
    k: int
    e: int
    g: int
    d: int
    variant: str
    impl: str
    table: str
    status: str = "ok"  # ok | skipped
    median_ms: float | None = None
    repeats: int | None = None
    ads_per_s: float | None = None
    pairs_per_s: float | None = None
    gb_per_s: float | None = None
    limit_pairs_per_s: float | None = None
    pct_of_limit: float | None = None
    bound: str = ""  # memory | compute: which side of the roofline limits this shape
    recall_vs_bf16: float | None = None  # kernel-int8 only: recall@K against the bf16 kernel
    note: str = ""


def fast_kernel(device: torch.device) -> str:
    """The dispatcher's fast implementation for `device`, or Skip."""
    names = available_kernels(device)
    want = "triton" if device.type == "cuda" else "cpu"
    if want not in names:
        raise Skip(f"no {want} kernel on {device.type} here (available: {', '.join(names)})")
    return want


class _Bench:
    """The tables of one N on the device, and how each variant runs and costs on them."""

    def __init__(self, n, experts, dim, device, measure, need_int8, seed):
        self.n, self.e, self.dim, self.device, self.measure = n, experts, dim, device, measure
        self.limits = device_limits(device, measure)
        self.table, self.mask = random_table(n, dim, dim, device, seed)
        self.int8 = None
        self.int8_note = ""
        if need_int8:
            try:
                fits(2 * 4 * n * dim, device, "quantizing the 8-bit table")  # fp32 temporaries
                self.int8 = quantize_ad_table(*self.table)
            except Skip as e:
                self.int8_note = str(e)
        self._faiss: FaissFlat | None = None
        self._fp32_table: tuple[torch.Tensor, ...] | None = None

    def runner(self, variant: str, query, k: int) -> tuple[Callable[[], Any], str, str]:
        """(call, implementation, table) for one variant, or Skip."""
        n_req = query[0].shape[0]
        dev, n, e, dim = self.device, self.n, self.e, self.dim
        if variant in ("kernel", "kernel-int8", "kernel-int8-torch"):
            name = fast_kernel(dev)
            table = self.table
            if variant.startswith("kernel-int8"):
                if self.int8 is None:
                    raise Skip(self.int8_note)
                table = self.int8
            if variant != "kernel-int8-torch":
                call = functools.partial(score_topk, query, table, self.mask, k, kernel=name)
                return call, name, "int8" if variant == "kernel-int8" else "bf16"
            if name != "cpu":
                raise Skip("the cpu kernel's torch path: on a CPU only")

            def torch_ops():
                with native.use("off"):
                    return score_topk(query, table, self.mask, k, kernel=name)

            return torch_ops, "cpu, torch ops only", "int8"
        if variant == "reference":
            fits(6 * 4 * n_req * 32_768 * e, dev, "the reference's chunk intermediates")
            return (
                lambda: score_topk(query, self.table, self.mask, k, kernel="torch"),
                "torch",
                "bf16",
            )
        if variant in ("eager", "compile"):
            chunk = chunk_size(n, n_req, dev)
            fits(6 * 4 * n_req * chunk * e, dev, f"[B, E, C] intermediates (C = {chunk:,})")
            fn = gate_scores if variant == "eager" else compiled_gate_scores()
            impl = f"torch {variant}, C = {chunk:,}"
            table, dtype = self.baseline_table()
            return lambda: chunked_topk(fn, query, table, self.mask, k, chunk), impl, dtype
        if variant == "two-tower":
            fits(6 * n_req * n, dev, "[B, N] scores")
            table, dtype = self.baseline_table()
            return lambda: two_tower_topk(query, table, self.mask, k), "torch", dtype
        if variant == "faiss":
            if self._faiss is None:
                fits(4 * n * dim, torch.device("cpu"), "the FAISS fp32 index")
                self._faiss = FaissFlat(self.table[1], self.mask)
            return lambda: self._faiss.search(query, k), "faiss IndexFlatIP", "fp32"
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")

    def baseline_table(self) -> tuple[tuple[torch.Tensor, ...], str]:
        """(table, its dtype's name) for the eager, compile and two-tower baselines: the bf16
        table, or a copy in fp32 where fp32 products measured faster here (a CPU without bf16
        dot-product instructions, as the cpu kernel does too), so that no baseline is held back
        by torch's emulated bf16."""
        limits = self.limits
        if self.device.type != "cpu" or limits.matmul_bf16 >= (limits.matmul_fp32 or 0.0):
            return self.table, "bf16"
        if self._fp32_table is None:
            fits(4 * self.n * 2 * self.dim, self.device, "the baselines' fp32 copy of the table")
            self._fp32_table = tuple(t.float() for t in self.table)
        return self._fp32_table, "fp32"

    def cost(self, variant: str) -> tuple[int, int, Limits, float]:
        """(bytes per ad, FLOPs per pair, limits, matrix FLOP/s) of the variant's own problem.

        On a CPU the matrix rate is the fastest product measured there, whatever the variant's
        dtype: without bf16 or VNNI instructions torch's bf16 and int8 products run far below the
        fp32 rate (0.3-1.3 GFLOP/s bf16 on a Zen 3 EPYC), and a variant that does its own products
        (the compiled 8-bit helpers) or takes fp32 ones would otherwise be held to that."""
        dim, limits = self.dim, self.limits
        if variant == "faiss":  # on the CPU whatever the device
            cpu = device_limits(torch.device("cpu"), self.measure)
            return 4 * dim, 2 * dim, cpu, cpu.fastest_matmul
        rate = limits.fastest_matmul if self.device.type == "cpu" else limits.matmul_bf16
        if variant == "two-tower":
            x = self.baseline_table()[0][1]
            return x.element_size() * dim, 2 * dim, limits, rate
        if variant.startswith("kernel-int8"):
            table = self.int8
        elif variant in ("eager", "compile"):
            table = self.baseline_table()[0]
        else:
            table = self.table
        return row_bytes(table), 2 * self.e * 2 * dim, limits, rate


def run_timings(
    cases: Sequence[Case],
    device: torch.device,
    experts: int = 8,
    dim: int = 64,
    repeat: int = 5,
    budget_s: float = 2.0,
    measure: bool = False,
    seed: int = 0,
    log: Log = to_stderr,
) -> list[Timing]:
    """Measure every case: tables are built once per N, queries once per B."""
    unknown = sorted({c.variant for c in cases} - set(VARIANTS))
    if unknown:
        raise ValueError(f"variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    name = device_name(device)
    rows: list[Timing] = []
    done = 0

    def emit(row: Timing) -> None:
        nonlocal done
        done += 1
        rows.append(row)
        head = f"[{done}/{len(cases)}] N = {row.n:,} B = {row.b} K = {row.k} {row.variant}"
        if row.status == "ok":
            log(
                f"{head}: {row.median_ms:.3f} ms, {fmt_rate(row.ads_per_s)} ads/s, "
                f"{fmt_rate(row.pairs_per_s)} pairs/s, {row.pct_of_limit:.1f}% of limit"
            )
        else:
            log(f"{head}: skipped ({row.note})")

    for n in dict.fromkeys(c.n for c in cases):
        at_n = [c for c in cases if c.n == n]

        def blank(c: Case) -> Timing:
            return Timing(name, c.n, c.b, c.k, experts, dim, dim, c.variant, "", "")

        try:
            fits(n * (2 * 2 * dim + 3), device, f"the N = {n:,} table")
            need_int8 = any(c.variant.startswith("kernel-int8") for c in at_n)
            bench = _Bench(n, experts, dim, device, measure, need_int8, seed)
        except (Skip, torch.cuda.OutOfMemoryError) as e:
            for c in at_n:
                row = blank(c)
                row.status, row.note = "skipped", str(e) or "out of device memory"
                emit(row)
            continue
        log(f"N = {n:,}: bf16 table of {gb(n * row_bytes(bench.table))} on {device.type}")
        kernel_rows: dict[tuple[int, int], torch.Tensor] = {}  # (B, K) -> bf16 kernel's rows
        for b in dict.fromkeys(c.b for c in at_n):
            query = random_query(b, experts, dim, dim, device, seed + b)
            for c in (c for c in at_n if c.b == b):
                emit(_measure(bench, c, query, blank(c), kernel_rows, repeat, budget_s))
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _measure(bench: _Bench, c: Case, query, row: Timing, kernel_rows, repeat, budget_s) -> Timing:
    try:
        fn, row.impl, row.table = bench.runner(c.variant, query, c.k)
        t, row.repeats, out = time_call(fn, bench.device, repeat, budget_s)
    except Skip as e:
        row.status, row.note = "skipped", str(e)
        return row
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        row.status, row.note = "skipped", "out of device memory"
        return row
    except Exception as e:
        # torch.compile needs a working toolchain (a C compiler on CPU, Triton on CUDA); without
        # one only this baseline is lost, not the run.
        if c.variant != "compile":
            raise
        row.status = "skipped"
        row.note = f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row
    bytes_per_ad, flops_per_pair, limits, matmul = bench.cost(c.variant)
    memory_bound = c.b * limits.bandwidth / bytes_per_ad
    compute_bound = matmul / flops_per_pair
    row.median_ms = 1e3 * t
    row.ads_per_s = c.n / t
    row.pairs_per_s = c.b * c.n / t
    row.gb_per_s = c.n * bytes_per_ad / t / 1e9
    row.limit_pairs_per_s = min(memory_bound, compute_bound)
    row.pct_of_limit = 100 * row.pairs_per_s / row.limit_pairs_per_s
    row.bound = "memory" if memory_bound <= compute_bound else "compute"
    if c.variant == "kernel":
        kernel_rows[(c.b, c.k)] = out[1]
    if c.variant == "kernel-int8" and (c.b, c.k) in kernel_rows:
        row.recall_vs_bf16 = recall_at_k(out[1], kernel_rows[(c.b, c.k)])
    return row
