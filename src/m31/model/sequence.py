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
        """seq [B, L, h], valid [B, L] -> [B, L, h]; position L - 1 is the request's state."""
        length = seq.shape[1]
        # A history shorter than max_len (the engine may pass fewer columns) takes the last rows.
        pos = self.position.weight[-length:]  # [L, h]
        x = self.drop(seq * valid[..., None].to(seq.dtype) + pos[None])  # [B, L, h]
        allowed = causal_mask(valid)
        for block in self.blocks:
            x = block(x, allowed)
        return self.norm(x)
