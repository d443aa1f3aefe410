"""The query, the ad table and the mask as the Triton kernel reads them (`kernel.py`).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, W32 = ceil(N / 32) mask words.

* The query: q and v as three bf16 parts each, hi + mid + lo = the fp32 value exactly
  (`split3`), so every bf16 product the kernel makes is exact; p in log2 units. Where the gate
  does not depend on the ad (E = 1 or G = 0) it is folded into one value vector per request.
* The table: rows with unit column stride, as stored (bf16, fp16, fp32, or int8 with its fp32
  row scales); fp16 and fp32 are split into bf16 parts in registers (`TABLE_PARTS`).
* The mask: int32 words, bit j of word w is ad 32·w + j, [W32] shared or [B, W32] per request.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from m31.ops.masks import PackedMask

LOG2E = 1.4426950408889634
# bf16 parts per table value (`kernel._table_parts`), by the dtype the kernel reads; others go
# to fp32
TABLE_PARTS = {torch.bfloat16: 1, torch.int8: 1, torch.float16: 2, torch.float32: 3}
_PACK_CHUNK = 1 << 24  # elements of one int64 intermediate while packing a bool mask


class Query(NamedTuple):
    """The query as the kernel reads it; with the gate folded away, E = 1 and q, p are unused."""

    q: torch.Tensor  # [3, B, E, G] bf16 parts (`split3`)
    v: torch.Tensor  # [3, B, E, D] bf16 parts
    p: torch.Tensor  # [B, E] fp32, times log2(e)
    has_gate: bool

    def take(self, idx: torch.Tensor) -> Query:
        q, v = (t[:, idx].contiguous() for t in (self.q, self.v))
        return Query(q, v, self.p[idx], self.has_gate)


class Table(NamedTuple):
    """The ad table as the kernel reads it: rows with unit column stride, bf16 or int8 (one bf16
    part) or fp16, fp32 (two or three parts)."""

    g: torch.Tensor  # [N, G] (unused without the gate)
    x: torch.Tensor  # [N, D]
    b: torch.Tensor  # [N] fp32
    g_scale: torch.Tensor | None  # [N] fp32 for int8 tables
    x_scale: torch.Tensor | None  # [N] fp32 for int8 tables
    value: torch.Tensor | None = None  # [N] fp32 value column (`value_bias`)

    @property
    def parts(self) -> int:
        """bf16 parts that hold each table value exactly (`kernel._table_parts`)."""
        return max(TABLE_PARTS[t.dtype] for t in (self.g, self.x))


def split3(t: torch.Tensor) -> torch.Tensor:
    """[3, ...] bf16: hi, mid, lo with hi + mid + lo = t (fp32) exactly. Each part holds the next
    8 significant bits of what the previous ones left (exact fp32 differences), and fp32 has 24."""
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


def prepare_query(q: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> Query:
    n_exp, gate_dim = q.shape[1], q.shape[2]
    if gate_dim == 0 or n_exp == 1:  # the gate is softmax(p) for every ad: fold it into v
        w = torch.softmax(p.float(), dim=1)  # [B, E]
        v1 = torch.einsum("be,bed->bd", w, v.float())[:, None, :]  # [B, 1, D]
        n_req = v1.shape[0]
        unused_q = v1.new_zeros(3, n_req, 1, 0, dtype=torch.bfloat16)
        return Query(unused_q, split3(v1), v1.new_zeros(n_req, 1), False)
    return Query(split3(q.float()), split3(v.float()), (p.float() * LOG2E).contiguous(), True)


def rows_unit_stride(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t [N, ·] with unit column stride, in `dtype`; by default as stored (fp64 goes to fp32)."""
    if dtype is None:
        dtype = t.dtype if t.dtype in TABLE_PARTS else torch.float32
    t = t.to(dtype)
    return t if t.shape[1] == 0 or t.stride(1) == 1 else t.contiguous()


def pack_mask(mask: torch.Tensor | PackedMask) -> torch.Tensor:
    """bool [..., N] or a `PackedMask` -> int32 [..., W32]: bit j of word w is ad 32·w + j."""
    return _packed_words(mask) if isinstance(mask, PackedMask) else _bool_words(mask)


def _packed_words(mask: PackedMask) -> torch.Tensor:
    """A `PackedMask` already has the kernel's layout, byte by byte (`m31.ops.masks`): its bitmaps
    are read as little-endian int32 words, [W32] when one bitmap serves every request, else
    gathered per request into [B, W32] (N / 32 words a request, where a bool mask takes N bytes)."""
    width = 4 * -(-mask.n // 32)  # bytes of whole words
    bits = mask.bits
    if bits.shape[1] != width or bits.stride() != (width, 1):  # (bits past N are unread)
        take = min(width, bits.shape[1])
        bits = bits.new_zeros(len(bits), width)
        bits[:, :take] = mask.bits[:, :take]
    words = bits.view(torch.int32)  # [U, W32]
    return words[0] if len(words) == 1 else words.index_select(0, mask.index)


def _bool_words(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., N] -> int32 [..., W32], in chunks that keep the int64 intermediate small."""
    n_ads = mask.shape[-1]
    n_words = -(-n_ads // 32)
    bits = torch.zeros(*mask.shape[:-1], n_words * 32, dtype=torch.bool, device=mask.device)
    bits[..., :n_ads] = mask
    bits = bits.view(*mask.shape[:-1], n_words, 32)
    weight = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(
        32, device=mask.device
    )
    words = torch.empty(*mask.shape[:-1], n_words, dtype=torch.int32, device=mask.device)
    step = max(1, _PACK_CHUNK // (32 * max(1, math.prod(mask.shape[:-1]))))
    for lo in range(0, n_words, step):
        w = (bits[..., lo : lo + step, :].long() * weight).sum(-1)  # [..., step] in [0, 2^32)
        words[..., lo : lo + step] = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return words
