"""The cpu kernel's per-table constants: the ads' norms and biases its bounds read
(`table_stats`, cached per table), and whether a call's inputs are in the bounds' range
(`in_range`; outside it the reference scores them).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import torch

from m31.ops.cpu.bounds import BF16_U, SLACK
from m31.ops.cpu.int8 import INT8_U
from m31.ops.quant import Int8Table
from m31.ops.reference.score import value_bias

_CHUNK = 1 << 16  # rows of an 8-bit table dequantized at a time (for its norms)

# The filters run on inputs whose logits and scores stay below 2^100 in magnitude: their bound
# arithmetic (squared norms, e^(2η)·m, ...) then never meets inf·0 (see `in_range`).
_RANGE = 2.0**100


@dataclass(frozen=True)
class TableStats:
    """Per-ad constants of a table, fp32; no query changes them."""

    per_ad: torch.Tensor  # [3, N]: ‖g‖ and ‖x‖ bounds and b, one gather for step 2's survivors
    scan_bias: torch.Tensor  # [N] b + (u'' + 2⁻²¹ + slack)|b|: the bias part of step 1's offset
    largest: tuple[float, float, float]  # max ‖g‖, max ‖x‖, max |b| (NaN or inf if not finite)
    u_a: float  # the largest u' of the table's products (`scan_bias` allows for it)

    @property
    def x_norm(self) -> torch.Tensor:
        return self.per_ad[1]


# The constants of the last few tables used (and of tables with a value column), by the tensors'
# identities. An entry serves a call only if the same tensor objects are alive and their version
# counters are unchanged: every in-place torch op bumps them, also through a view (autograd trusts
# the same counters). Writes that bypass torch (into a NumPy array sharing the memory) are not
# seen. A hit moves its entry to the end, so a table whose value column changes every version
# keeps its own entry (its norms) while the old columns' entries leave.
_STATS: dict[tuple[int, ...], tuple[tuple, tuple[int, ...], TableStats]] = {}
_STATS_LOCK = threading.Lock()
_STATS_TABLES = 4


def table_stats(
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    g_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> TableStats:
    """The constants of the table (g, x, b), or of the 8-bit table (g, x, b, g_scale, x_scale),
    computed once per table when it can be tracked; an 8-bit table's norms are its dequantized
    rows' (`Int8Table.dequantize`). With a `value` column [N] the bias they hold is
    `value_bias(b, value)` (what the pass scores; the norms are the table's own, found again).

    The norms cost a pass over the table (as much as the affinity product at B = 1), and a serving
    process scores the same index over and over."""
    quantized = g_scale is not None
    table = (g, x, b, g_scale, x_scale) if quantized else (g, x, b)
    if value is not None:
        table = (*table, value)
    tracked = not any(t.is_inference() for t in table)  # inference tensors have no version
    if tracked:
        hit = _cached(table)
        if hit is not None:
            return hit
    if value is not None:
        stats = _with_value(table_stats(g, x, b, g_scale, x_scale), b, value)
    else:
        stats = _stats(g, x, b, g_scale, x_scale)
    if tracked:
        with _STATS_LOCK:
            _STATS[tuple(map(id, table))] = (
                tuple(weakref.ref(t) for t in table),
                tuple(t._version for t in table),
                stats,
            )
            while len(_STATS) > _STATS_TABLES:
                del _STATS[next(iter(_STATS))]  # the oldest
    return stats


def _cached(table: tuple[torch.Tensor, ...]) -> TableStats | None:
    """The cached constants of these very tensors, unchanged since (or None)."""
    key, versions = tuple(map(id, table)), tuple(t._version for t in table)
    with _STATS_LOCK:
        for dead in [k for k, (refs, _, _) in _STATS.items() if any(r() is None for r in refs)]:
            del _STATS[dead]
        hit = _STATS.get(key)
        if hit and hit[1] == versions and all(r() is t for r, t in zip(hit[0], table, strict=True)):
            _STATS[key] = _STATS.pop(key)  # the most recently used
            return hit[2]
    return None


def _with_value(stats: TableStats, b: torch.Tensor, value: torch.Tensor) -> TableStats:
    """`stats` with the bias of a value column: an O(N) pass over two floats per ad, once per
    (table, value) pair, where the norms would cost a pass over the table."""
    return _finish(stats.per_ad[:2], value_bias(b, value), stats.u_a)


def _stats(g, x, b, g_scale, x_scale) -> TableStats:
    """The constants of a table, computed (`table_stats` caches them)."""
    quantized = g_scale is not None
    if quantized:
        u_a = INT8_U
        norms = [[torch.zeros(0)], [torch.zeros(0)]]  # ‖g‖, ‖x‖ of the dequantized rows
        for lo in range(0, len(b), _CHUNK):  # in chunks: no dequantized copy of the table
            rows = Int8Table(g, g_scale, x, x_scale, b).dequantize(slice(lo, lo + _CHUNK))
            for out, part in zip(norms, rows[:2], strict=True):
                out.append(_row_norms(part))
        norms = [torch.cat(parts) for parts in norms]
    else:
        # the largest u' the table's products may have (the plan's own u'' is then covered)
        u_a = BF16_U / (1 - BF16_U) if x.dtype == torch.bfloat16 else 0.0
        norms = [_row_norms(g), _row_norms(x)]
    return _finish(norms, b.float(), u_a)


def _finish(norms, bias: torch.Tensor, u_a: float) -> TableStats:
    per_ad = torch.stack([*norms, bias])  # [3, N]
    return TableStats(
        per_ad=per_ad,
        scan_bias=bias.abs().mul_(u_a / (1 - u_a) + 2.0**-21 + SLACK).add_(bias),
        largest=tuple(per_ad.abs().amax(1).tolist()),
        u_a=u_a,
    )


def in_range(q: torch.Tensor, v: torch.Tensor, p: torch.Tensor, stats: TableStats) -> bool:
    """Whether every |logit| and |score| of the call is below 2^100 (Cauchy–Schwarz on the norms
    of the query and the table). False as well for a table holding NaN or ±inf (its norms do)."""
    gdim = q.shape[2]
    g_max, x_max, b_max = stats.largest
    q_max = float(q.double().norm(dim=2).max()) / math.sqrt(gdim) if gdim else 0.0
    logit = q_max * g_max + float(p.double().abs().max())
    value = float(v.double().norm(dim=2).max()) * x_max + b_max
    return logit < _RANGE and value < _RANGE


def _row_norms(t: torch.Tensor) -> torch.Tensor:
    """Upper bounds on the rows' Euclidean norms, fp32 [n] (bf16 norms are rounded, so inflate)."""
    if t.dtype == torch.bfloat16:
        return t.norm(dim=1).float().mul_(1 + 2 * BF16_U)
    return t.float().norm(dim=1).mul_(1 + 2.0**-20)
