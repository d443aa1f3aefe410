"""The 8-bit ad table: symmetric int8 rows with one fp32 scale per row (DESIGN §4, "AdIndex";
§5, "8-bit tables").

Shapes: N ads, G gate-key dim, D value dim.

    g[a] ≈ g_q[a] * g_scale[a],   g_scale[a] = max|g[a]| / 127   (1 for an all-zero row)
    x[a] ≈ x_q[a] * x_scale[a],   x_scale[a] = max|x[a]| / 127

The bias stays fp32 (4 bytes of an ad's G + D + 12). Definition: the score of an `Int8Table` is
the §2 score of its `dequantize()`d table, so the reference for any 8-bit kernel is
`torch_score_topk` on that fp32 table. Quantizing is the lossy step, scoring it is not: an int8
value is exact in bf16 and the per-row scale is applied to the fp32 dot product.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT8_MAX = 127  # the symmetric int8 range: ±127 (never -128)


class Int8Table(NamedTuple):
    """An ad table in 8 bits: g [N, G] int8, g_scale [N] fp32, x [N, D] int8, x_scale [N] fp32,
    b [N] fp32."""

    g: torch.Tensor  # [N, G] int8
    g_scale: torch.Tensor  # [N] fp32
    x: torch.Tensor  # [N, D] int8
    x_scale: torch.Tensor  # [N] fp32
    b: torch.Tensor  # [N] fp32

    @property
    def num_ads(self) -> int:
        return self.x.shape[0]

    @property
    def gate_dim(self) -> int:
        return self.g.shape[1]

    @property
    def value_dim(self) -> int:
        return self.x.shape[1]

    @property
    def device(self) -> torch.device:
        return self.x.device

    def to(self, device: torch.device | str) -> Int8Table:
        return Int8Table(*(t.to(device) for t in self))

    def check(self) -> None:
        """ValueError unless this is a well-formed table: g [N, G] and x [N, D] int8, g_scale,
        x_scale and b [N] fp32, all on one device (what every 8-bit kernel reads)."""
        for name, t, dtype, dims in (
            ("g", self.g, torch.int8, 2),
            ("g_scale", self.g_scale, torch.float32, 1),
            ("x", self.x, torch.int8, 2),
            ("x_scale", self.x_scale, torch.float32, 1),
            ("b", self.b, torch.float32, 1),
        ):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != dims:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(f"Int8Table {name} must be {dtype} with {dims} dims, got {got}")
        if len({t.shape[0] for t in self}) != 1:
            shapes = ", ".join(
                f"{n} {tuple(t.shape)}" for n, t in zip(self._fields, self, strict=True)
            )
            raise ValueError(f"Int8Table arrays disagree on N: {shapes}")
        devices = {str(t.device) for t in self}
        if len(devices) != 1:
            raise ValueError(f"Int8Table arrays must be on one device, got {sorted(devices)}")

    def dequantize(
        self, rows: torch.Tensor | slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [N, G], x [N, D], b [N]) in fp32: the table this one's scores are defined on; with
        `rows` (an index tensor of any shape, or a slice), only those rows, computed the same
        way (so a kernel that dequantizes rows on the fly gets the same values)."""
        pick = slice(None) if rows is None else rows
        g = self.g[pick].float() * self.g_scale[pick][..., None]
        x = self.x[pick].float() * self.x_scale[pick][..., None]
        return g, x, self.b[pick].float()


def checked_int8_table(table) -> Int8Table:
    """table, if it is a well-formed `Int8Table` (TypeError if not one, ValueError if malformed)."""
    if not isinstance(table, Int8Table):
        raise TypeError(f"table must be an Int8Table, got {type(table).__name__}")
    table.check()
    return table


def _quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [N, C] -> (int8 [N, C], scale [N]) with symmetric per-row scales."""
    t = t.float()
    if t.shape[1] == 0:  # G = 0: nothing to scale
        return t.to(torch.int8), torch.ones(t.shape[0], device=t.device)
    scale = t.abs().amax(dim=1) / INT8_MAX  # [N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero rows stay exactly zero
    q = torch.round(t / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_ad_table(g: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> Int8Table:
    """Quantize an ad table g [N, G], x [N, D], b [N] (any float dtype) to an `Int8Table`."""
    if g.dim() != 2 or x.dim() != 2 or b.dim() != 1:
        raise ValueError(
            f"ad table must be g [N, G], x [N, D], b [N]; got {tuple(g.shape)}, {tuple(x.shape)}, {tuple(b.shape)}"
        )
    if not (g.shape[0] == x.shape[0] == b.shape[0]):
        raise ValueError(
            f"g, x and b disagree on N: {tuple(g.shape)}, {tuple(x.shape)}, {tuple(b.shape)}"
        )
    if not all(t.is_floating_point() for t in (g, x, b)):
        raise ValueError(f"ad table must be floating point, got {g.dtype}, {x.dtype}, {b.dtype}")
    g_q, g_scale = _quantize_rows(g)
    x_q, x_scale = _quantize_rows(x)
    return Int8Table(g_q, g_scale, x_q, x_scale, b.float())


__all__ = ["Int8Table", "checked_int8_table", "quantize_ad_table"]
