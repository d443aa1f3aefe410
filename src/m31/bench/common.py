"""What every part of `m31 bench` shares: the device's limits, timing, memory, the random problem.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results.

The limits are DESIGN §6's anchors on an H200, measured in the same run anywhere else:
bandwidth is a device copy (read + write), the matrix rate a bf16 (and fp32) product.
Timings: one untimed warm-up call (compilation, caches), then the median of up to `repeat`
calls, fewer once `budget_s` seconds of timed calls are spent; the device is synchronised around
each call.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from m31.ops import NO_ROW

# Share of the free memory a measurement may plan to use; the rest is headroom for the allocator.
MEMORY_SHARE = 0.85

Log = Callable[[str], None]


def to_stderr(msg: str) -> None:
    """Progress lines: stderr, so that stdout holds the tables alone."""
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
    # int8 x int8 -> int32 OP/s, measured on a CPU (`torch._int_mm`), where the 8-bit kernel runs
    # integer products; None on GPUs (the Triton kernel runs bf16 products of the int8 values)
    matmul_int8: float | None = None

    @property
    def fastest_matmul(self) -> float:
        """The fastest of the measured matrix rates (FLOP/s or OP/s)."""
        return max(self.matmul_bf16, self.matmul_fp32 or 0.0, self.matmul_int8 or 0.0)


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
    largest = 8192 if cuda else 2048
    bf16, fp32 = (_matmul_rate(device, dtype, largest) for dtype in (torch.bfloat16, torch.float32))
    int8 = None if cuda else _matmul_rate(device, torch.int8, largest)
    return Limits(f"{device_name(device)}, measured", bandwidth, bf16, fp32, int8)


def _matmul_rate(device: torch.device, dtype: torch.dtype, largest: int) -> float:
    """FLOP/s (int8: OP/s, `torch._int_mm`) of a square product, S = 256, 512, ... up to
    `largest` while one takes under 0.1 s: a CPU without bf16 instructions multiplies bf16 at
    well under 1 GFLOP/s, where S = 2048 would take a minute."""
    size = 256
    while True:
        if dtype == torch.int8:
            a = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device)  # [S, S]
            b = a.T.contiguous()
            fn = functools.partial(torch._int_mm, a, b)
        else:
            a = torch.randn(size, size, device=device).to(dtype)  # [S, S]
            b = torch.randn(size, size, device=device).to(dtype)  # [S, S]
            fn = functools.partial(torch.mm, a, b)
        t, _, _ = time_call(fn, device, repeat=1, budget_s=0.0)
        if size >= largest or t > 0.1:
            break
        size *= 2
    t, _, _ = time_call(fn, device, repeat=5, budget_s=2.0)
    return 2 * size**3 / t


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


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median milliseconds of `repeat` calls of fn() on the CPU after one untimed warm-up call."""
    return 1e3 * time_call(fn, torch.device("cpu"), repeat, float("inf"))[0]


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # blocks PyTorch's allocator holds but no tensor uses are free to us as well
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def fits(need: float, device: torch.device, what: str) -> None:
    """Skip unless `need` bytes fit in the device's free memory, with headroom."""
    free = free_bytes(device)
    if need > MEMORY_SHARE * free:
        raise Skip(f"{what} needs {gb(need)}, {gb(free)} free on {device.type}")


def fmt_rate(x: float | None) -> str:
    """12_300_000 -> '12.3 M': the rates of progress lines and tables."""
    if x is None:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}"


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


def recall_at_k(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over requests of |got ∩ ref| / |ref| for rows [B, K] (NO_ROW ignored)."""
    shares = []
    for a, r in zip(got.cpu().numpy(), ref.cpu().numpy(), strict=True):
        r = r[r != NO_ROW]
        if len(r):
            shares.append(len(np.intersect1d(a[a != NO_ROW], r)) / len(r))
    return float(np.mean(shares)) if shares else 1.0
