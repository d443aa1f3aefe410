"""The ad table of DESIGN §4, "AdIndex": the rows g, x, b an `AdIndex` scores, each row's ad id
and whether it is live.

Shapes: cap allocated rows, N <= cap of them in use (live and tombstoned), G gate-key dim, D
value dim, n rows in one call.

The table is stored in one of `TABLE_DTYPES`: bfloat16, float16, float32 or int8. An 8-bit table holds each row's
codes with its own scales (`m31.ops.quant`: one fp32 scale for g and one for x per row) and b
in float32, so a row's bytes depend on that row alone.

Rows are write-once: `append` writes fresh rows after the last, `retire` tombstones rows (they
stay allocated, never live), and growth (`reserve`) and `compact` build new tensors. So the
tensors `stored` hands out never change afterwards, and a scorer may keep reading them while
later rows are written. Not thread-safe: its `AdIndex` calls it under its lock.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from m31.ops.quant import Int8Table

# The dtypes the ad table is stored in, by the name a snapshot's manifest, `m31 index build
# --dtype` and `m31.build_index(dtype=...)` give them: the one table of them
TABLE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int8": torch.int8,
}


class AdTable:
    """g [cap, G], x [cap, D], b [cap] (and an 8-bit table's g_scale, x_scale [cap]), row_ids
    [cap] int64 (the ad id of each row, -1 unused) and live [cap] bool; see the module
    docstring."""

    def __init__(
        self, dim_g: int, dim_x: int, dtype: torch.dtype, device: torch.device, capacity: int
    ):
        self.device = device
        self.quantized = dtype == torch.int8
        # what upserts are validated in, and b's dtype: an 8-bit table keeps b in float32
        self.value_dtype = torch.float32 if self.quantized else dtype
        self.capacity = capacity
        self.n = 0  # rows allocated so far, live or tombstoned
        self.g = torch.zeros(capacity, dim_g, dtype=dtype, device=device)  # [cap, G]
        self.x = torch.zeros(capacity, dim_x, dtype=dtype, device=device)  # [cap, D]
        self.b = torch.zeros(capacity, dtype=self.value_dtype, device=device)  # [cap]
        # int8: each row's scales ([cap] float32 each), else None
        self.g_scale = self.x_scale = None
        if self.quantized:
            self.g_scale = torch.ones(capacity, device=device)
            self.x_scale = torch.ones(capacity, device=device)
        self.row_ids = torch.full((capacity,), -1, dtype=torch.int64, device=device)  # [cap]
        self.live = torch.zeros(capacity, dtype=torch.bool, device=device)  # [cap]

    def _arrays(self) -> list[tuple[str, Any]]:
        """The per-row tensors (attribute name, fill of an unused row)."""
        arrays = [("g", 0), ("x", 0), ("b", 0), ("row_ids", -1), ("live", False)]
        return arrays + ([("g_scale", 1.0), ("x_scale", 1.0)] if self.quantized else [])

    # ---- reading ---------------------------------------------------------------------------

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [N, G], x [N, D], b [N], row_ids [N]) as stored, never modified afterwards."""
        n = self.n
        return self.g[:n], self.x[:n], self.b[:n], self.row_ids[:n]

    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(g_scale [N], x_scale [N]) of an 8-bit table (write-once like the rows), else None."""
        return None if not self.quantized else (self.g_scale[: self.n], self.x_scale[: self.n])

    def values(self, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the rows' (g, x, b) values: an 8-bit table's dequantized, in float32."""
        if self.quantized:
            scales = self.g_scale[rows], self.x_scale[rows]
            return Int8Table(
                self.g[rows], scales[0], self.x[rows], scales[1], self.b[rows]
            ).dequantize()
        return self.g[rows].clone(), self.x[rows].clone(), self.b[rows].clone()

    def live_rows(self) -> torch.Tensor:
        """[n_live] int64: the live rows, ascending."""
        return self.live[: self.n].nonzero().squeeze(1)

    def saved(self, rows: torch.Tensor) -> dict[str, np.ndarray]:
        """The arrays of `rows` [k] as a snapshot stores them (`m31.index.snapshot.npy_files`):
        bf16 and fp16 widened to float32 (exactly); int8 codes, scales and ids as they are."""
        arrays = {"g": self.g[rows], "x": self.x[rows], "b": self.b[rows]}  # [k, ·]
        arrays["ids"] = self.row_ids[rows]  # [k]
        if self.quantized:
            arrays |= {"g_scale": self.g_scale[rows], "x_scale": self.x_scale[rows]}
        return {
            name: (a.float() if a.is_floating_point() else a).cpu().numpy()
            for name, a in arrays.items()
        }

    def frozen(self) -> AdTable:
        """A copy of the table as it is: it shares the write-once tensors and copies the
        liveness of its N rows, which later writes change in place."""
        out = copy.copy(self)
        out.live = self.live[: self.n].clone()
        return out

    # ---- writing ---------------------------------------------------------------------------

    def reserve(self, need: int) -> None:
        """Room for `need` rows: new tensors (the old ones stay as they are, for the views that
        hold them), of twice the capacity until they fit."""
        if need <= self.capacity:
            return
        cap = self.capacity
        while cap < need:
            cap *= 2  # geometric growth: amortised O(1) copies per appended row
        for name, fill in self._arrays():
            old = getattr(self, name)
            grown = torch.full((cap, *old.shape[1:]), fill, dtype=old.dtype, device=self.device)
            grown[: self.n] = old[: self.n]
            setattr(self, name, grown)
        self.capacity = cap

    def append(
        self, ids: np.ndarray, table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | Int8Table
    ) -> torch.Tensor:
        """Write ads (ids [n], their rows as stored: an `Int8Table` for an 8-bit table) to n
        fresh live rows after the last (room reserved); those rows [n]."""
        start, n = self.n, len(ids)
        new = slice(start, start + n)
        if self.quantized:
            self.g[new], self.x[new], self.b[new] = table.g, table.x, table.b
            self.g_scale[new], self.x_scale[new] = table.g_scale, table.x_scale
        else:
            self.g[new], self.x[new], self.b[new] = table
        self.row_ids[new] = torch.from_numpy(ids).to(self.device)  # [n]
        self.live[new] = True
        self.n = start + n
        return torch.arange(start, start + n, device=self.device)  # [n]

    def retire(self, rows: torch.Tensor) -> None:
        """Tombstone `rows` [k]: allocated still, never live again."""
        self.live[rows] = False

    def compact(self) -> torch.Tensor:
        """Move the live rows, in order, to the front of new tensors of the same capacity (views
        keep the old ones); the rows they came from [n_live]."""
        live = self.live_rows()
        k = len(live)
        for name, fill in self._arrays():
            old = getattr(self, name)
            fresh = torch.full_like(old, fill)  # [cap, ...]: the live rows first, then unused
            fresh[:k] = old[live]
            setattr(self, name, fresh)
        self.n = k
        return live
