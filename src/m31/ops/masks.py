"""Eligibility masks as bits: `pack`/`unpack` and `PackedMask`, what the index hands the kernels.

Shapes: B requests, N ads (rows), U distinct bitmaps, W = ceil(N / 8) bytes per bitmap.

Row r is bit r % 8 of byte r // 8 (little-endian bit order, numpy's `bitorder="little"`), so a
bitmap of N rows takes N / 8 bytes: 125 KB at 1 M ads, where a bool row takes 1 MB. Requests of a
batch that share their targeting share one bitmap (`PackedMask.index`), so a batch of 64 requests
of one targeting key reads one 125 KB bitmap instead of a 64 MB [B, N] bool mask.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

_SHIFTS = torch.arange(8, dtype=torch.uint8)
# set bits of every byte value: popcount by lookup (torch has no popcount)
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def n_bytes(n: int) -> int:
    """Bytes of a bitmap of n rows."""
    return -(-n // 8)


def pack(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., n] -> uint8 [..., ceil(n / 8)]: row r is bit r % 8 of byte r // 8."""
    if mask.device.type == "cpu":  # numpy packs 15x faster than the tensor ops on a CPU
        return torch.from_numpy(np.packbits(mask.numpy(), axis=-1, bitorder="little"))
    return _pack_torch(mask)


def unpack(bits: torch.Tensor, n: int, offset: int = 0) -> torch.Tensor:
    """uint8 [..., W] -> bool [..., n], a fresh tensor: rows offset .. offset + n - 1 (W bytes
    must cover them; bytes past them are never read)."""
    if bits.device.type == "cpu":
        part = np.ascontiguousarray(bits[..., offset // 8 : n_bytes(offset + n)].numpy())
        out = np.unpackbits(part, axis=-1, bitorder="little")[..., offset % 8 : offset % 8 + n]
        return torch.from_numpy(np.ascontiguousarray(out)).view(torch.bool)
    return _unpack_torch(bits, n, offset)


def _pack_torch(mask: torch.Tensor) -> torch.Tensor:
    """`pack` in tensor ops (any device)."""
    n = mask.shape[-1]
    padded = torch.zeros(*mask.shape[:-1], 8 * n_bytes(n), dtype=torch.uint8, device=mask.device)
    padded[..., :n] = mask
    shifts = _SHIFTS.to(mask.device)
    return (padded.view(*mask.shape[:-1], -1, 8) << shifts).sum(-1, dtype=torch.uint8)


def _unpack_torch(bits: torch.Tensor, n: int, offset: int = 0) -> torch.Tensor:
    """`unpack` in tensor ops (any device)."""
    shifts = _SHIFTS.to(bits.device)
    spread = (bits[..., offset // 8 : n_bytes(offset + n), None] >> shifts) & 1  # [..., bytes, 8]
    rows = spread.view(*bits.shape[:-1], -1)[..., offset % 8 : offset % 8 + n]
    return rows.contiguous().view(torch.bool)


class PackedMask(NamedTuple):
    """Which of N rows each of B requests may return, as U ≤ B distinct bitmaps.

    bits: uint8 [U, W], W ≥ ceil(N / 8) (bits past row N are ignored); index: int64 [B], request
    b reads bitmap index[b]; n: N. `score_topk` takes it wherever it takes a bool mask."""

    bits: torch.Tensor
    index: torch.Tensor
    n: int

    @staticmethod
    def of(mask: torch.Tensor) -> PackedMask:
        """The packed form of a bool mask [B, N] (one bitmap per request)."""
        if mask.dtype != torch.bool or mask.dim() != 2:
            raise ValueError(f"mask must be bool [B, N], got {mask.dtype} {tuple(mask.shape)}")
        index = torch.arange(mask.shape[0], device=mask.device)
        return PackedMask(pack(mask), index, mask.shape[1])

    @property
    def batch(self) -> int:
        return self.index.shape[0]

    @property
    def device(self) -> torch.device:
        return self.bits.device

    def check(self, n_req: int, n_ads: int) -> None:
        """ValueError unless this is a well-formed mask of n_req requests over n_ads rows."""
        bits, index = self.bits, self.index
        if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8 or bits.dim() != 2:
            raise ValueError(f"packed mask bits must be uint8 [U, W], got {_describe(bits)}")
        if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
            raise ValueError(f"packed mask index must be int64 [B], got {_describe(index)}")
        if self.n != n_ads or bits.shape[1] < n_bytes(n_ads):
            raise ValueError(
                f"packed mask must cover N = {n_ads} rows in at least {n_bytes(n_ads)} bytes, "
                f"got n = {self.n} in {bits.shape[1]}"
            )
        if index.shape[0] != n_req:
            raise ValueError(f"packed mask index must have B = {n_req} entries, got {len(index)}")
        if n_req and (int(index.min()) < 0 or int(index.max()) >= bits.shape[0]):
            raise ValueError(f"packed mask index must lie in [0, {bits.shape[0]})")
        if index.device != bits.device:
            raise ValueError(f"packed mask bits on {bits.device} but index on {index.device}")

    def unpack(self) -> torch.Tensor:
        """bool [B, N]; a mask all B share comes expanded (read it, do not write it)."""
        if self.bits.shape[0] == 1:
            return unpack(self.bits, self.n).expand(self.batch, self.n)
        return unpack(self.bits, self.n).index_select(0, self.index)

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """bool [B, hi - lo]: rows lo .. hi - 1 of every request's mask, unpacking only the
        bytes that hold them, once per distinct bitmap."""
        part = unpack(self.bits, hi - lo, lo)  # [U, hi - lo]
        if part.shape[0] == 1:
            return part.expand(self.batch, -1)
        return part.index_select(0, self.index)

    def select(self, pick: torch.Tensor) -> PackedMask:
        """The mask of requests pick [b] (int64 indices or bool [B])."""
        return PackedMask(self.bits, self.index[pick], self.n)

    def counts(self) -> torch.Tensor:
        """int64 [B]: eligible rows per request."""
        full, rest = divmod(self.n, 8)
        per_map = _POPCOUNT.to(self.device)[self.bits[:, :full].long()].sum(1)  # [U]
        if rest:
            tail = self.bits[:, full].long() & ((1 << rest) - 1)
            per_map += _POPCOUNT.to(self.device)[tail]
        return per_map.index_select(0, self.index)


def mask_rows(mask: torch.Tensor | PackedMask, lo: int, hi: int) -> torch.Tensor:
    """Rows lo .. hi - 1 of any mask the kernels take: bool [hi - lo] of a shared [N] mask,
    else bool [B, hi - lo] (read them, do not write them)."""
    return mask.rows(lo, hi) if isinstance(mask, PackedMask) else mask[..., lo:hi]


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


__all__ = ["PackedMask", "mask_rows", "n_bytes", "pack", "unpack"]
