"""`m31 bench`: throughput of the score·filter·top-K pass and of the engine, with every baseline
measured in the same run (DESIGN §5, §6).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, C ads per chunk.

    python -m m31.bench                         # timings at the device's default shapes
    python -m m31.bench --canonical --engine    # DESIGN §6's shapes, then the engine end to end
    python -m m31.bench --check                 # every kernel against the reference; exit 1 if not

Variants of one problem (a random bf16 ad table as the index keeps it, about half the ads
eligible, E experts, G = D = --dim):
* kernel      — the dispatcher's fast path: triton on CUDA, cpu on the CPU;
* kernel-int8 — the same over the 8-bit table (`m31.ops.quant`), with its recall@K against bf16;
* reference   — `score_topk(kernel="torch")`, the chunked definition of correct;
* eager       — the §2 formula as unfused PyTorch (bf16 products, fp32 gate) and `torch.topk`,
                over chunks of ads so that the [B, E, C] intermediates stay bounded at any N;
* compile     — the same chunk function under `torch.compile`;
* two-tower   — the E = 1, G = 0 special case: a bf16 matmul and `torch.topk`;
* faiss       — FAISS `IndexFlatIP` on the CPU for the two-tower case (fp32, an ID bitmap for
                eligibility); needs the optional faiss package.

Units: ads/s = N / t (a batch streams the table once), pairs/s = B·N / t, GB/s = N · bytes per
ad / t. "% of limit" is the roofline of the variant's own problem on the device: pairs/s at most
min(B · bandwidth / bytes per ad, matrix FLOP/s / FLOPs per pair), with 2·E·(G+D) FLOPs per pair
(two-tower: 2·D). Bandwidth is a device copy (read + write) and the matrix rate a bf16 product:
DESIGN §6's anchors on an H200, measured in the same run anywhere else. A table small enough to
stay in the CPU's caches can beat the memory-bound figure (more than 100%).

Timings: one untimed warm-up call (compilation, caches), then the median of up to --repeat
calls, fewer once --budget seconds of timed calls are spent; the device is synchronised around
each call. Shapes whose memory does not fit and variants that cannot run here are skipped with
the reason, never a crash.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from m31.ops import NO_ROW, score
from m31.ops.quant import quantize_ad_table
from m31.ops.score_topk import available_kernels, score_topk
from m31.ops.torch_score_topk import torch_score_topk

VARIANTS = ("kernel", "kernel-int8", "reference", "eager", "compile", "two-tower", "faiss")
_BF16 = tuple(v for v in VARIANTS if v != "kernel-int8")
# DESIGN §6: N in {1 M, 10 M, 100 M}, B in {1, 64, 512}, K in {100, 1000}; (N, Bs, Ks, variants)
CANONICAL: tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[str, ...]], ...] = (
    (10_000_000, (1, 64, 512), (100, 1000), _BF16),
    (10_000_000, (1, 64), (100, 1000), ("kernel-int8",)),
    (1_000_000, (64,), (100,), _BF16),
    (100_000_000, (64,), (100,), _BF16),
)
# The fused kernel's acceptance on one H200 at N = 10 M, E = 8, G = D = 64.
ACCEPT_SHAPE = {"n": 10_000_000, "e": 8, "g": 64, "d": 64}
ACCEPT_ADS_B1 = 12e9  # ads/s at B = 1, K = 100
ACCEPT_PAIRS_B64 = 150e9  # pairs/s at B = 64, K = 100
ACCEPT_K_RATIO = 1.5  # time at K = 1000 over time at K = 100
# (request, ad) pairs per chunk of the eager and compiled baselines: [B, E, C] fp32 intermediates
# of about 1 GB on a GPU, 64 MB on a CPU (E = 8).
PAIRS_PER_CHUNK = {"cuda": 1 << 25, "cpu": 1 << 21}
# Share of the free memory a measurement may plan to use; the rest is headroom for the allocator.
MEMORY_SHARE = 0.85
# Kernel results against the reference: both read the same bf16 (or dequantized 8-bit) table,
# the reference in fp32; a kernel may round the query to bf16 (about 2^-9 relative), and a real
# bug moves scores by O(1) at the unit scale of the check's data.
CHECK_ATOL, CHECK_RTOL = 2e-2, 2e-2
# (B, N, E, G, D, K, mask): odd sizes, K > N, nothing eligible, the G = 0 two-tower case.
CHECK_CASES = (
    (1, 1, 1, 64, 64, 5, "none"),
    (3, 1_000, 8, 64, 64, 100, "shared"),
    (2, 777, 3, 16, 48, 1_000, "per-request"),
    (5, 4_099, 8, 64, 64, 1_000, "shared"),
    (4, 3_001, 8, 64, 64, 50, "nothing"),
    (3, 2_049, 1, 0, 32, 17, "shared"),
)
CHECK_CASES_LARGE = (
    (6, 65_537, 8, 64, 64, 100, "per-request"),
    (64, 100_003, 8, 64, 64, 1_000, "shared"),
)

Log = Callable[[str], None]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Skip(Exception):
    """A measurement that cannot run here; the message says why."""


# ---- device limits ------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    source: str
    bandwidth: float  # bytes/s of a device copy, read + write
    matmul_bf16: float  # FLOP/s
    matmul_fp32: float | None  # FLOP/s (only the CPU's is used: FAISS)


H200_ANCHORS = Limits("NVIDIA H200, DESIGN §6 anchors", 4.20e12, 748e12, None)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


@functools.cache
def device_limits(device: torch.device, measure: bool = False) -> Limits:
    """DESIGN §6's anchors on an H200 (unless `measure`), else measured here in about a second
    (once per process: every row of a run is held to the same limits)."""
    if device.type == "cuda" and not measure and "H200" in device_name(device):
        return H200_ANCHORS
    return measure_limits(device)


def measure_limits(device: torch.device) -> Limits:
    cuda = device.type == "cuda"
    bandwidth = _copy_rate(device, 1 << (31 if cuda else 28))
    size = 8192 if cuda else 2048
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        t, _, _ = time_call(lambda a=a, b=b: a @ b, device, repeat=5, budget_s=5.0)
        rates[dtype] = 2 * size**3 / t
    return Limits(
        f"{device_name(device)}, measured", bandwidth, rates[torch.bfloat16], rates[torch.float32]
    )


def _copy_rate(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a copy between two device buffers, read and write counted."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t, _, _ = time_call(lambda: dst.copy_(src), device, repeat=5, budget_s=5.0)
    return 2 * nbytes / t


# ---- timing and memory ------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], Any], device: torch.device, repeat: int, budget_s: float
) -> tuple[float, int, Any]:
    """(median seconds, timed calls, last output) of fn() after one untimed warm-up call."""
    out = fn()
    _sync(device)
    times: list[float] = []
    while len(times) < max(1, repeat) and (not times or sum(times) < budget_s):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times), out


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # blocks PyTorch's allocator holds but no tensor uses are free to us as well
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _fits(need: float, device: torch.device, what: str) -> None:
    free = free_bytes(device)
    if need > MEMORY_SHARE * free:
        raise Skip(f"{what} needs {_gb(need)}, {_gb(free)} free on {device.type}")


# ---- the problem ----------------------------------------------------------------------------


def row_bytes(table: Sequence[torch.Tensor]) -> int:
    """Bytes of one ad's row over all arrays of a table (bf16: 2·(G+D)+2; 8-bit: G+D+12)."""
    return sum(t.element_size() * (t[0].numel() if t.dim() > 1 else 1) for t in table)


def random_table(n: int, gdim: int, ddim: int, device: torch.device, seed: int):
    """(g [N, G], x [N, D], b [N]) bf16 as the index keeps them, and mask [N]: about half True.

    Scaled so that logits, affinities and scores are of unit size with unit-size queries.
    """
    gen = torch.Generator(device).manual_seed(seed)
    g = torch.randn(n, gdim, generator=gen, device=device, dtype=torch.bfloat16)  # [N, G]
    x = torch.randn(n, ddim, generator=gen, device=device, dtype=torch.bfloat16)  # [N, D]
    x.mul_(ddim**-0.5)
    b = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.1)  # [N]
    mask = torch.rand(n, generator=gen, device=device) < 0.5  # [N]
    return (g, x, b), mask


def random_query(n_req: int, n_exp: int, gdim: int, ddim: int, device: torch.device, seed: int):
    """(q [B, E, G], v [B, E, D], p [B, E]) fp32, as a model's request encoder produces them."""
    gen = torch.Generator(device).manual_seed(seed)
    return tuple(
        torch.randn(*shape, generator=gen, device=device)
        for shape in ((n_req, n_exp, gdim), (n_req, n_exp, ddim), (n_req, n_exp))
    )


# ---- baselines --------------------------------------------------------------------------------


def gate_scores(q2, v2, p, g, x, b, mask):
    """One chunk of §2 scores, unfused: q2 [B·E, G] (pre-scaled by 1/sqrt(G)) and v2 [B·E, D] in
    the table's dtype, p [B, E] fp32; g [C, G], x [C, D], b [C], mask [C] -> [B, C] fp32, -inf
    where ineligible. Products in the table's dtype (tensor cores), the gate in fp32."""
    n_req, n_exp = p.shape
    logit = (q2 @ g.T).float().view(n_req, n_exp, -1) + p[:, :, None]  # [B, E, C]
    w = torch.softmax(logit, dim=1)  # [B, E, C]
    affinity = (v2 @ x.T).float().view(n_req, n_exp, -1)  # [B, E, C]
    s = (w * affinity).sum(1) + b.float()  # [B, C]
    return s.masked_fill(~mask, float("-inf"))


@functools.cache
def compiled_gate_scores():
    # One compiled function for the whole process, so that each (B, C) compiles once.
    return torch.compile(gate_scores, dynamic=False)


def chunk_size(n: int, n_req: int, device: torch.device) -> int:
    """Ads per chunk for the eager and compiled baselines: about PAIRS_PER_CHUNK pairs; a divisor
    of N when one is within 2x, so that all chunks share one shape and compile once per B."""
    target = max(1, PAIRS_PER_CHUNK[device.type] // n_req)
    if target >= n:
        return n
    best = max(
        (d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i) if d <= target),
        default=1,
    )
    return best if 2 * best >= target else target


def chunked_topk(chunk_scores, query, table, mask, k: int, chunk: int):
    """(scores [B, K'], rows [B, K']): each chunk's top K merged into a running top K."""
    q, v, p = query
    g, x, b = table
    n_req, n_exp, gdim = q.shape
    scale = gdim**-0.5 if gdim else 1.0
    q2 = (q * scale).reshape(n_req * n_exp, gdim).to(g.dtype)  # [B·E, G]
    v2 = v.reshape(n_req * n_exp, -1).to(x.dtype)  # [B·E, D]
    best_s = best_r = None
    for lo in range(0, g.shape[0], chunk):
        hi = min(lo + chunk, g.shape[0])
        s = chunk_scores(q2, v2, p, g[lo:hi], x[lo:hi], b[lo:hi], mask[lo:hi])  # [B, C]
        s, r = s.topk(min(k, hi - lo), dim=1)
        r = r + lo
        if best_s is not None:
            s, r = torch.cat([best_s, s], 1), torch.cat([best_r, r], 1)
            s, pick = s.topk(min(k, s.shape[1]), dim=1)
            r = r.gather(1, pick)
        best_s, best_r = s, r
    return best_s, best_r


def two_tower_topk(query, table, mask, k: int):
    """The E = 1, G = 0 model: the first expert's value as the user vector, u·x, top K."""
    x = table[1]
    u = query[1][:, 0, :].to(x.dtype)  # [B, D]
    s = (u @ x.T).float()  # [B, N]
    s.masked_fill_(~mask, float("-inf"))
    return s.topk(min(k, x.shape[0]), dim=1)


class FaissFlat:
    """FAISS exact inner-product search on the CPU over x (fp32); eligibility as an ID bitmap."""

    def __init__(self, x: torch.Tensor, mask: torch.Tensor):
        try:
            import faiss
        except ImportError:
            raise Skip("faiss is not installed") from None
        self.index = faiss.IndexFlatIP(x.shape[1])
        self.index.add(x.float().cpu().numpy())
        # FAISS keeps raw pointers to the bitmap and the selector: both live as long as self.
        self._bits = np.packbits(mask.cpu().numpy(), bitorder="little")
        self._selector = faiss.IDSelectorBitmap(self._bits)
        self.params = faiss.SearchParameters(sel=self._selector)

    def search(self, query, k: int):
        u = query[1][:, 0, :].float().cpu().numpy()  # [B, D]
        return self.index.search(u, k, params=self.params)


def fast_kernel(device: torch.device) -> str:
    """The dispatcher's fast implementation for `device`, or Skip."""
    names = available_kernels(device)
    want = "triton" if device.type == "cuda" else "cpu"
    if want not in names:
        raise Skip(f"no {want} kernel on {device.type} here (available: {', '.join(names)})")
    return want


def recall_at_k(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over requests of |got ∩ ref| / |ref| for rows [B, K] (NO_ROW ignored)."""
    shares = []
    for a, r in zip(got.cpu().numpy(), ref.cpu().numpy(), strict=True):
        r = r[r != NO_ROW]
        if len(r):
            shares.append(len(np.intersect1d(a[a != NO_ROW], r)) / len(r))
    return float(np.mean(shares)) if shares else 1.0


# ---- timings --------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Case:
    n: int
    b: int
    k: int
    variant: str


def plan_cases(
    ns: Iterable[int], batches: Iterable[int], ks: Iterable[int], variants: Iterable[str]
) -> list[Case]:
    return [Case(n, b, k, v) for n in ns for b in batches for k in ks for v in variants]


def canonical_cases(variants: Iterable[str] = VARIANTS) -> list[Case]:
    keep = set(variants)
    return [
        c
        for n, bs, ks, vs in CANONICAL
        for c in plan_cases([n], bs, ks, [v for v in vs if v in keep])
    ]


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
                _fits(2 * 4 * n * dim, device, "quantizing the 8-bit table")  # fp32 temporaries
                self.int8 = quantize_ad_table(*self.table)
            except Skip as e:
                self.int8_note = str(e)
        self._faiss: FaissFlat | None = None

    def runner(self, variant: str, query, k: int) -> tuple[Callable[[], Any], str, str]:
        """(call, implementation, table) for one variant, or Skip."""
        n_req = query[0].shape[0]
        dev, n, e, dim = self.device, self.n, self.e, self.dim
        if variant in ("kernel", "kernel-int8"):
            name = fast_kernel(dev)
            table = self.table
            if variant == "kernel-int8":
                if self.int8 is None:
                    raise Skip(self.int8_note)
                table = self.int8
            return (
                lambda: score_topk(query, table, self.mask, k, kernel=name),
                name,
                "int8" if variant == "kernel-int8" else "bf16",
            )
        if variant == "reference":
            _fits(6 * 4 * n_req * 32_768 * e, dev, "the reference's chunk intermediates")
            return (
                lambda: score_topk(query, self.table, self.mask, k, kernel="torch"),
                "torch",
                "bf16",
            )
        if variant in ("eager", "compile"):
            chunk = chunk_size(n, n_req, dev)
            _fits(6 * 4 * n_req * chunk * e, dev, f"[B, E, C] intermediates (C = {chunk:,})")
            fn = gate_scores if variant == "eager" else compiled_gate_scores()
            impl = f"torch {variant}, C = {chunk:,}"
            return (
                lambda: chunked_topk(fn, query, self.table, self.mask, k, chunk),
                impl,
                "bf16",
            )
        if variant == "two-tower":
            _fits(6 * n_req * n, dev, "[B, N] scores")
            return lambda: two_tower_topk(query, self.table, self.mask, k), "torch", "bf16"
        if variant == "faiss":
            if self._faiss is None:
                _fits(4 * n * dim, torch.device("cpu"), "the FAISS fp32 index")
                self._faiss = FaissFlat(self.table[1], self.mask)
            return lambda: self._faiss.search(query, k), "faiss IndexFlatIP", "fp32"
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")

    def cost(self, variant: str) -> tuple[int, int, Limits, float]:
        """(bytes per ad, FLOPs per pair, limits, matrix FLOP/s) of the variant's own problem."""
        dim = self.dim
        if variant == "two-tower":
            return 2 * dim, 2 * dim, self.limits, self.limits.matmul_bf16
        if variant == "faiss":  # on the CPU whatever the device
            cpu = device_limits(torch.device("cpu"), self.measure)
            return 4 * dim, 2 * dim, cpu, cpu.matmul_fp32
        table = self.int8 if variant == "kernel-int8" else self.table
        return row_bytes(table), 2 * self.e * 2 * dim, self.limits, self.limits.matmul_bf16


def run_timings(
    cases: Sequence[Case],
    device: torch.device,
    experts: int = 8,
    dim: int = 64,
    repeat: int = 5,
    budget_s: float = 2.0,
    measure: bool = False,
    seed: int = 0,
    log: Log = _log,
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
            _fits(n * (2 * 2 * dim + 3), device, f"the N = {n:,} table")
            need_int8 = any(c.variant == "kernel-int8" for c in at_n)
            bench = _Bench(n, experts, dim, device, measure, need_int8, seed)
        except (Skip, torch.cuda.OutOfMemoryError) as e:
            for c in at_n:
                row = blank(c)
                row.status, row.note = "skipped", str(e) or "out of device memory"
                emit(row)
            continue
        log(f"N = {n:,}: bf16 table of {_gb(n * row_bytes(bench.table))} on {device.type}")
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


# ---- correctness ------------------------------------------------------------------------------


@dataclass
class CheckRow:
    kernel: str
    table: str
    b: int
    n: int
    e: int
    g: int
    d: int
    k: int
    mask: str
    status: str  # ok | FAIL | skipped
    max_abs_err: float | None = None
    rows_equal: float | None = None  # share of result slots holding the reference's row
    note: str = ""


def check_topk(got, ref, query, table, mask, atol=CHECK_ATOL, rtol=CHECK_RTOL) -> str | None:
    """None if `got` is an exact top-K of `table` up to float rounding, else what is wrong.

    Rows may differ from the reference's only where scores tie within the tolerance: position by
    position the scores must match, and every returned row must be eligible, distinct, carry its
    own score and come best first; the NO_ROW tail must match exactly.
    """
    gs, gr = (t.cpu() for t in got)
    rs, rr = (t.cpu() for t in ref)
    if gs.shape != rs.shape or gr.shape != rr.shape:
        return f"shapes {tuple(gs.shape)}, {tuple(gr.shape)}; expected {tuple(rs.shape)}"
    if gr.dtype != torch.int64 or gs.dtype != torch.float32:
        return f"dtypes {gs.dtype}, {gr.dtype}; expected float32, int64"
    found = rr != NO_ROW  # [B, K']
    if not torch.equal(gr != NO_ROW, found):
        return "NO_ROW slots differ (a wrong count of eligible ads)"
    if not torch.isneginf(gs[~found]).all():
        return "scores of NO_ROW slots are not -inf"
    err = (gs[found] - rs[found]).abs()
    if (err > atol + rtol * rs[found].abs()).any():
        return f"scores differ from the reference by up to {float(err.max()):.3g}"
    q, v, p = (t.cpu() for t in query)
    g, x, b = (t.cpu() for t in table)
    for i in range(gr.shape[0]):
        rows, s = gr[i][found[i]], gs[i][found[i]]
        if len(rows) == 0:
            continue
        if len(set(rows.tolist())) != len(rows):
            return f"request {i}: a row returned twice"
        if (rows < 0).any() or (rows >= g.shape[0]).any():
            return f"request {i}: row out of range"
        m = None if mask is None else (mask if mask.dim() == 1 else mask[i]).cpu()
        if m is not None and not m[rows].all():
            return f"request {i}: an ineligible row returned"
        exact = score(q[i : i + 1], v[i : i + 1], p[i : i + 1], g[rows], x[rows], b[rows])[0]
        if ((exact - s).abs() > atol + rtol * exact.abs()).any():
            return f"request {i}: a returned score is not its row's score"
        if (s[1:] > s[:-1]).any():
            return f"request {i}: not best first"
    return None


def _check_mask(kind: str, n_req: int, n: int, device: torch.device, seed: int):
    gen = torch.Generator(device).manual_seed(seed)
    if kind == "none":
        return None
    if kind == "nothing":
        return torch.zeros(n, dtype=torch.bool, device=device)
    shape = (n,) if kind == "shared" else (n_req, n)
    return torch.rand(shape, generator=gen, device=device) < 0.5


def _check_kernel(row: CheckRow, query, table, plain, mask, ref) -> None:
    """Run `row.kernel` through the dispatcher and fill in the row's verdict."""
    try:
        got = score_topk(query, table, mask, row.k, kernel=row.kernel)
    except Exception as err:  # a kernel that raises fails this case; the check goes on
        row.status, row.note = "FAIL", f"raised {type(err).__name__}: {str(err).splitlines()[0]}"
        return
    problem = check_topk(got, ref, query, plain, mask)
    if problem is not None:
        row.status, row.note = "FAIL", problem
        return
    (gs, gr), (rs, rr) = ((t.cpu() for t in pair) for pair in (got, ref))
    found = rr != NO_ROW
    if found.any():
        row.max_abs_err = float((gs[found] - rs[found]).abs().max())
        row.rows_equal = float((gr == rr).float().mean())


def run_check(
    device: torch.device, quick: bool = False, seed: int = 0, log: Log = _log
) -> tuple[list[CheckRow], list[dict]]:
    """Every available kernel, bf16 and 8-bit, against the reference on fresh random data; and
    recall@K of the 8-bit table's top K against the bf16 table's (the reference on both)."""
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    cases = CHECK_CASES if quick else CHECK_CASES + CHECK_CASES_LARGE
    rows: list[CheckRow] = []
    for i, (n_req, n, e, gdim, ddim, k, mask_kind) in enumerate(cases):
        query = random_query(n_req, e, gdim, ddim, device, seed + 2 * i)
        bf16, _ = random_table(n, gdim, ddim, device, seed + 2 * i + 1)
        mask = _check_mask(mask_kind, n_req, n, device, seed + i)
        int8 = quantize_ad_table(*bf16)
        tables = {"bf16": (bf16, bf16), "int8": (int8, int8.dequantize())}  # (scored, reference)
        refs = {
            name: torch_score_topk(*query, *plain, mask, k) for name, (_, plain) in tables.items()
        }
        for kernel in available_kernels(device):
            for name, (table, plain) in tables.items():
                row = CheckRow(kernel, name, n_req, n, e, gdim, ddim, k, mask_kind, "ok")
                if kernel == "triton" and interpreted and i >= len(CHECK_CASES):
                    row.status, row.note = "skipped", "interpreted Triton: small cases only"
                else:
                    _check_kernel(row, query, table, plain, mask, refs[name])
                rows.append(row)
                log(
                    f"check {row.status:<7} {kernel:<6} {name} B = {n_req} N = {n:,} E = {e} "
                    f"G = {gdim} D = {ddim} K = {k} mask {mask_kind}"
                    + (f": {row.note}" if row.note else "")
                )
    recalls = []
    n_req, n = 16, (1_000_000 if device.type == "cuda" else 20_000 if quick else 100_000)
    query = random_query(n_req, 8, 64, 64, device, seed + 101)
    table, mask = random_table(n, 64, 64, device, seed + 102)
    deq = quantize_ad_table(*table).dequantize()
    for k in (100, 1000):
        ref = torch_score_topk(*query, *table, mask, k)[1]
        got = torch_score_topk(*query, *deq, mask, k)[1]
        recalls.append({"n": n, "b": n_req, "k": k, "recall": recall_at_k(got, ref)})
        log(f"recall@{k} of the 8-bit table vs bf16, N = {n:,}: {recalls[-1]['recall']:.4f}")
    return rows, recalls


# ---- the engine end to end ----------------------------------------------------------------


@dataclass
class EngineTiming:
    device: str
    n: int
    b: int
    k: int
    model: str
    e: int
    g: int
    d: int
    median_ms: float
    repeats: int
    ads_per_s: float
    pairs_per_s: float
    encode_ms: float  # medians of the engine's own breakdown (`RetrievalResult.timings_ms`)
    mask_ms: float
    score_topk_ms: float
    index_build_s: float


def synthetic_index(ads, n: int, gdim: int, ddim: int, device: torch.device, seed: int = 0):
    """An AdIndex of N ads: attributes repeat the rows of a dataset's ads table (targeting,
    status, schedules as real ads have them) under fresh ids 0..N-1; g, x, b are random."""
    import pyarrow as pa

    from m31.index import AdIndex

    # The creative texts are the one bulky column and no attribute of the index.
    keep = [c for c in ads.column_names if c != "text"]
    table = ads.select(keep).take(pa.array(np.arange(n) % ads.num_rows))
    table = table.set_column(
        table.schema.get_field_index("ad_id"), "ad_id", pa.array(np.arange(n, dtype=np.int64))
    )
    (g, x, b), _ = random_table(n, gdim, ddim, device, seed)
    return AdIndex.from_table(table, g, x, b, device=device)


def run_engine(
    device: torch.device,
    n: int,
    batches: Sequence[int] = (1, 64, 256),
    k: int = 100,
    model: str = "demo",
    repeat: int = 5,
    budget_s: float = 2.0,
    seed: int = 0,
    log: Log = _log,
) -> list[EngineTiming]:
    """`Retriever.retrieve` (request encoding, eligibility masks, score·top-K) over N ads.

    The `tiny` world gives users, histories and the ads whose attributes the N ads repeat; the
    retrieval MoE of preset `model` is untrained (its weights do not change the work done).
    """
    from m31.data.schema import PLATFORMS, SURFACES
    from m31.engine import AdRequest, Retriever
    from m31.features import FeatureConfig, build_features
    from m31.model import build_model, model_preset, vocab_sizes
    from m31.world.config import preset
    from m31.world.generate import generate

    start = time.perf_counter()
    ds, _ = generate(preset("tiny"), seed=seed)
    feats = build_features(ds, FeatureConfig(text_embeddings=False))
    torch.manual_seed(seed)
    cfg = model_preset(model, "moe")
    net = build_model(cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1])
    log(f"engine: tiny world and features in {time.perf_counter() - start:.1f} s")
    # the bf16 table, about 200 bytes of encoded attributes per ad, a [B, N] bool mask per call
    per_ad = 2 * (cfg.gate_dim + cfg.value_dim) + 2 + 200 + max(batches)
    _fits(n * per_ad, device, f"an index of {n:,} ads and its masks")
    start = time.perf_counter()
    index = synthetic_index(ds.ads, n, cfg.gate_dim, cfg.value_dim, device, seed)
    build_s = time.perf_counter() - start
    log(f"engine: index of {len(index):,} ads built with AdIndex.from_table in {build_s:.1f} s")
    engine = Retriever(net, feats, index, ds.users)
    user_ids = feats.users["user_id"]
    ts = int(ds.meta["time_range"][1])  # the end of the log: every ad of the world is created
    rng = np.random.default_rng(seed)
    rows = []
    for b in batches:
        requests = [
            AdRequest(
                user_id=int(rng.choice(user_ids)),
                ts=ts,
                surface=SURFACES[rng.integers(len(SURFACES))],
                platform=PLATFORMS[rng.integers(len(PLATFORMS))],
            )
            for _ in range(b)
        ]
        parts: list[dict[str, float]] = []  # the engine's own breakdown of every call

        def call(requests=requests, parts=parts):
            res = engine.retrieve(requests, k)
            parts.append(res.timings_ms)
            return res

        t, reps, _ = time_call(call, device, repeat, budget_s)
        part = {p: statistics.median(c[p] for c in parts[1:]) for p in parts[0]}  # no warm-up
        row = EngineTiming(
            device=device_name(device),
            n=n,
            b=b,
            k=k,
            model=model,
            e=cfg.n_experts,
            g=cfg.gate_dim,
            d=cfg.value_dim,
            median_ms=1e3 * t,
            repeats=reps,
            ads_per_s=n / t,
            pairs_per_s=b * n / t,
            encode_ms=part["encode"],
            mask_ms=part["mask"],
            score_topk_ms=part["score_topk"],
            index_build_s=build_s,
        )
        rows.append(row)
        log(
            f"engine B = {b}: {row.median_ms:.1f} ms, {fmt_rate(row.pairs_per_s)} ads scored/s "
            f"(encode {row.encode_ms:.1f}, masks {row.mask_ms:.1f}, score·top-K "
            f"{row.score_topk_ms:.1f} ms)"
        )
    return rows


# ---- reports ----------------------------------------------------------------------------------


def fmt_rate(x: float | None) -> str:
    if x is None:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}"


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
    one's, and the kernel's time over its time at K = 100 (same N and B)."""
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
            entry["int8 vs bf16"] = kern.median_ms / ok[(n, b, k, "kernel-int8")].median_ms
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
    ax.set_ylabel("pairs/s (dashed: bf16 §2 limit)")
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
        f"{limits.matmul_bf16 / 1e12:.3g} TFLOP/s.",
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
            f"D = {first.d}); index built in {first.index_build_s:.1f} s",
            "",
            markdown(
                ("B", "median ms", "ads/s", "pairs/s", "encode ms", "mask ms", "score·top-K ms"),
                (
                    (
                        r.b,
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


# ---- command line -------------------------------------------------------------------------


def _counts(text: str) -> tuple[int, ...]:
    """ "1,64" or "1M,10M" -> ints (k, M, G suffixes; underscores allowed)."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}
    out = []
    for part in text.split(","):
        s = part.strip().replace("_", "").lower()
        try:
            value = int(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a count: {part!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {part!r}")
        out.append(value)
    return tuple(out)


def _variants(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise argparse.ArgumentTypeError("no variant given")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(VARIANTS)}")
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="m31 bench",
        description="Throughput of score·filter·top-K against its baselines, correctness "
        "against the reference, and the engine end to end.",
    )
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument(
        "--timings", action="store_true", help="the timings: run unless --check or --engine alone"
    )
    ap.add_argument("--check", action="store_true", help="kernels vs the reference; exit 1 if not")
    ap.add_argument("--engine", action="store_true", help="Retriever.retrieve end to end")
    ap.add_argument("--canonical", action="store_true", help="timings at DESIGN §6's shapes")
    ap.add_argument("--quick", action="store_true", help="small shapes: a CPU smoke run")
    ap.add_argument("--n", type=_counts, help="ads, e.g. 1M,10M (default: 10M on cuda, 1M on cpu)")
    ap.add_argument("--batches", type=_counts, help="requests per batch (default 1,64[,512])")
    ap.add_argument("--k", type=_counts, help="results per request (default 100)")
    ap.add_argument("--experts", type=int, default=8, help="E")
    ap.add_argument("--dim", type=int, default=64, help="G = D")
    ap.add_argument("--variants", type=_variants, default=VARIANTS, help=", ".join(VARIANTS))
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per measurement, at most")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed calls, at most")
    ap.add_argument("--measure-limits", action="store_true", help="measure even on an H200")
    ap.add_argument("--engine-n", type=_counts, help="ads in the engine's index (10M / 1M)")
    ap.add_argument("--engine-batches", type=_counts, help="requests per call (1,64,256)")
    ap.add_argument("--engine-k", type=int, default=100)
    ap.add_argument("--engine-model", default="demo", help="model preset (demo: E = 8, G = D = 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/out"), help="folder for CSV, MD, PNG")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected parts: --check, the timings (when asked for with --timings or
    --canonical, or when neither --check nor --engine is given), --engine; tables last on
    stdout, progress on stderr.
    Returns 1 when --check found a kernel that disagrees with the reference, else 0."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device here")
    if args.canonical and (args.n or args.batches or args.k):
        ap.error("--canonical sets N, B and K itself; drop --n, --batches and --k")
    if min(args.experts, args.dim, args.repeat, args.budget, args.engine_k) <= 0:
        ap.error("--experts, --dim, --repeat, --budget and --engine-k must be positive")
    cuda, quick = device.type == "cuda", args.quick
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sections: list[str] = []
    failed = False

    if args.check:
        checks, recalls = run_check(device, quick=quick, seed=args.seed)
        write_csv(args.out / "check.csv", checks)
        failed = any(c.status == "FAIL" for c in checks)
        sections.append(check_report(checks, recalls, device))
        (args.out / "check.md").write_text(sections[-1] + "\n")

    if args.timings or args.canonical or not (args.check or args.engine):
        if args.canonical:
            cases = canonical_cases(args.variants)
        else:
            cases = plan_cases(
                args.n or ((20_000,) if quick else (10_000_000,) if cuda else (1_000_000,)),
                args.batches or ((1, 3) if quick else (1, 64, 512) if cuda else (1, 64)),
                args.k or (100,),
                args.variants,
            )
        rows = run_timings(
            cases,
            device,
            args.experts,
            args.dim,
            args.repeat,
            args.budget,
            args.measure_limits,
            args.seed,
        )
        write_csv(args.out / "bench.csv", rows)
        no_plot = plot(rows, args.out / "bench.png")
        limits = device_limits(device, args.measure_limits)
        sections.append(timings_report(rows, limits, cuda, no_plot))
        (args.out / "bench.md").write_text(sections[-1] + "\n")

    if args.engine:
        n = args.engine_n or ((20_000,) if quick else (10_000_000,) if cuda else (1_000_000,))
        batches = args.engine_batches or ((1, 3) if quick else (1, 64, 256))
        try:
            engine_rows = run_engine(
                device,
                n[0],
                batches,
                args.engine_k,
                args.engine_model,
                args.repeat,
                args.budget,
                args.seed,
            )
        except Skip as e:
            sections.append(f"## Engine end to end: skipped ({e})")
        else:
            write_csv(args.out / "engine.csv", engine_rows)
            sections.append(engine_report(engine_rows))
        (args.out / "engine.md").write_text(sections[-1] + "\n")

    _log(f"wall time {time.perf_counter() - start:.0f} s; tables and plot in {args.out}")
    print("\n\n".join(sections))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
