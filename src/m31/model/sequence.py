"""The sequence expert's encoder: causal self-attention over the engagement sequence (SASRec's
design, Kang & McAuley 2018).

Shapes: B requests, L sequence length (`max_len`), h hidden width, n heads, d = h / n.

Histories are right-aligned (most recent last, padding first), so position L - 1 is always the
latest engagement and a learned position embedding counts from the end, as in SASRec's
left-padded sequences. The output at position i reads positions j <= i only: it is the user's
vector as of just after engagement i, which training asks to predict engagement i + 1 (a target
at every position) and which, at i = L - 1, is the request's. Padding positions read only
themselves (so that a query never attends to nothing) and no valid position reads them; an
empty history's output at L - 1 is then a learned constant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalBlock(nn.Module):
    """Pre-norm self-attention and feed-forward, each a residual branch: [B, L, h] -> [B, L, h]."""

    def __init__(self, h: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm_att = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.norm_ffn = nn.LayerNorm(h)
        self.ffn = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Dropout(dropout), nn.Linear(h, h))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x [B, L, h]; allowed [B, 1, L, L]: query i may read key j."""
        b, length, h = x.shape
        qkv = self.qkv(self.norm_att(x)).view(b, length, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # [B, n, L, d] each
        att = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0
        )  # [B, n, L, d]
        x = x + self.drop(self.out(att.transpose(1, 2).reshape(b, length, h)))
        return x + self.drop(self.ffn(self.norm_ffn(x)))


def causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, L] valid positions -> [B, 1, L, L]: query i reads key j iff j <= i and j is valid, or
    j = i (a padding query reads itself, never nothing)."""
    length = valid.shape[1]
    pos = torch.arange(length, device=valid.device)
    earlier = pos[None, :] <= pos[:, None]  # [L, L] key j at or before query i
    allowed = earlier[None] & valid[:, None, :]  # [B, L, L]
    return (allowed | torch.eye(length, dtype=torch.bool, device=valid.device))[:, None]


class CausalSequenceEncoder(nn.Module):
    """Engagement embeddings [B, L, h] (right-aligned) -> the user's vector after each one."""

    def __init__(self, h: int, max_len: int, blocks: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.position = nn.Embedding(max_len, h)
        self.blocks = nn.ModuleList(CausalBlock(h, heads, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(h)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, seq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """seq [B, L, h], valid [B, L] -> [B, L, h]; position L - 1 is the request's state.

        The same as `encode` (its reference), computed on less padding: each row runs in a
        group trimmed to the smallest of 4, 8, 16, ... L columns that holds its history (on
        Amazon Beauty a sixth of the [B, 50] positions), and its trimmed columns take the
        padding's output, which depends on the column alone (padding reads only itself)."""
        b, length, _ = seq.shape
        widths = _widths(length)
        if b == 0 or len(widths) == 1:
            return self.encode(seq, valid)
        any_valid = valid.any(1)
        first = torch.where(any_valid, valid.to(torch.int8).argmax(1), length - 1)  # [B]
        group = torch.bucketize(length - first, torch.tensor(widths, device=seq.device))
        if bool((group == len(widths) - 1).all()):
            return self.encode(seq, valid)
        padding = self.encode(torch.zeros_like(seq[:1]), torch.zeros_like(valid[:1]))  # [1, L, h]
        rows, parts = [], []
        for i, w in enumerate(widths):
            idx = torch.nonzero(group == i).flatten()
            if len(idx) == 0:
                continue
            out = self.encode(seq[idx, length - w :], valid[idx, length - w :])  # [n, w, h]
            if w < length:
                out = torch.cat([padding[:, : length - w].expand(len(idx), -1, -1), out], dim=1)
            rows.append(idx)
            parts.append(out)
        order = torch.cat(rows)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(b, device=seq.device)
        return torch.cat(parts)[inverse]

    def encode(self, seq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`forward` over every column as given: seq [B, L, h], valid [B, L] -> [B, L, h]."""
        length = seq.shape[1]
        # A history shorter than max_len (the engine may pass fewer columns) takes the last rows.
        pos = self.position.weight[-length:]  # [L, h]
        x = self.drop(seq * valid[..., None].to(seq.dtype) + pos[None])  # [B, L, h]
        allowed = causal_mask(valid)
        for block in self.blocks:
            x = block(x, allowed)
        return self.norm(x)


def _widths(length: int) -> list[int]:
    """The column counts rows are grouped at: 4, 8, 16, ... below `length`, then `length`."""
    widths, w = [], 4
    while w < length:
        widths.append(w)
        w *= 2
    return [*widths, length]
