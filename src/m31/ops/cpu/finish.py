"""Step 4 of the cpu kernel: the candidates rescored exactly as the reference scores them and an
exact stable top-K (`exact_topk`); and the requests that need nothing else, those with at most
K' eligible ads (`few_eligible`, `every_eligible`).

Shapes: B requests, N ads, C candidates of a request, K' = min(k, N) results.
"""

from __future__ import annotations

import math

import torch

from m31.ops.contract import NO_ROW
from m31.ops.cpu.partition import spans_in_threads
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table
from m31.ops.reference.score import rounded_score, value_bias

_RESCORE_PAIRS = 1 << 15  # (request, candidate) pairs per chunk of the exact rescoring


def by_request(req: torch.Tensor, row: torch.Tensor, n_req: int):
    """Pairs (req [S], row [S]) sorted by request, then row -> (rows [B, C], valid [B, C]): each
    request's rows left-aligned, in row order; C is the most any request has."""
    counts = torch.bincount(req, minlength=n_req)  # [B]
    width = int(counts.max()) if len(req) else 0
    pos = torch.arange(len(req)) - (torch.cumsum(counts, 0) - counts)[req]
    rows = torch.zeros(n_req, width, dtype=torch.long)  # [B, C]
    rows[req, pos] = row
    valid = torch.zeros(n_req, width, dtype=torch.bool)  # [B, C]
    valid[req, pos] = True
    return rows, valid


def exact_topk(q, v, p, take, rows, valid, k_out: int, threads: int = 1):
    """Step 4: the reference's fp32 §2 scores of the candidates and an exact top k_out.

    take(index) -> the ads' (g, x, b) at index (`rows_of`); rows [B, C] (each request's
    candidates in row order) or [1, C] (the same for every request); valid [B, C] marks the real
    candidates (None: all are). The scores come from the same `rounded_score` as the reference's,
    so they depend on an ad's row alone, not on where it sits among the candidates; the stable
    sort then puts tied ads in row order.
    `threads`: threads that score chunks of candidates (`spans_in_threads`).
    """
    n_req, width = q.shape[0], rows.shape[1]
    scores = torch.empty(n_req, width)  # [B, C]
    step = max(1, _RESCORE_PAIRS // n_req)
    spans = [(lo, min(lo + step, width)) for lo in range(0, width, step)]

    def rescore(_: int, lo: int, hi: int) -> None:
        r = rows[:, lo:hi]  # [B or 1, c]
        scores[:, lo:hi] = rounded_score(q, v, p, *take(r[0] if len(r) == 1 else r))  # [B, c]

    spans_in_threads(min(threads, len(spans)), spans, rescore)
    if valid is not None:
        scores.masked_fill_(~valid, -math.inf)
    scores, pick = torch.sort(scores, dim=1, descending=True, stable=True)
    top, short = min(k_out, width), max(k_out - width, 0)
    scores = torch.cat([scores[:, :top], torch.full((n_req, short), -math.inf)], dim=1)
    rows = rows.expand(n_req, -1).gather(1, pick[:, :top])
    rows = torch.cat([rows, torch.full((n_req, short), NO_ROW)], dim=1)  # [B, K']
    return scores, rows.masked_fill(scores == -math.inf, NO_ROW)


def rows_of(table, value: torch.Tensor | None = None):
    """take(index) -> (g, x, b) of the ads at index: as stored, or dequantized for an 8-bit
    table exactly as `Int8Table.dequantize` does, so the rescored scores are the reference's;
    with a value column, b is the bias the reference scores (`value_bias`)."""
    if isinstance(table, Int8Table):
        take = table.dequantize
    else:
        g, x, b = table

        def take(i):
            return g[i], x[i], b[i]

    if value is None:
        return take

    def valued(i):
        g_i, x_i, b_i = take(i)
        return g_i, x_i, value_bias(b_i, value[i])

    return valued


def every_eligible(q, v, p, take, n_ads: int, mask, k_out: int, threads: int):
    """Requests with at most k_out eligible ads: every one of them is in the answer, so there is
    nothing to filter, only the eligible ads' scores to sort (step 4 on all of them)."""
    if isinstance(mask, PackedMask):
        mask = mask.unpack()  # [B, N] of these few requests
    if mask is None:
        rows, valid = torch.arange(n_ads)[None], None  # [1, N]
    elif mask.dim() == 1:
        rows, valid = mask.nonzero()[:, 0][None], None  # [1, N']
    else:
        req, row = mask.nonzero().unbind(1)  # by request, then row
        rows, valid = by_request(req, row, q.shape[0])  # [B, C] each
    return exact_topk(q, v, p, take, rows, valid, k_out, threads)


def few_eligible(mask, n_req: int, n_ads: int, k_out: int) -> torch.Tensor:
    """[B] bool: whether each request has at most k_out eligible ads.

    Counting costs ~4 ns per ad and request on a core (a quarter of the whole pass at B = 64,
    N = 1 M), so the first 16·k_out ads are counted first: a request with more than k_out
    eligible among them is settled (any mask denser than 1/16), and only the others are counted
    in full."""
    if mask is None:
        return torch.full((n_req,), n_ads <= k_out)
    if isinstance(mask, PackedMask):  # a popcount per distinct bitmap
        return mask.counts() <= k_out
    rows = mask if mask.dim() == 2 else mask[None]  # [B or 1, N]
    head = min(n_ads, 16 * k_out)
    count = torch.count_nonzero(rows[:, :head], dim=-1)  # [B or 1]
    open_ = torch.nonzero(count <= k_out)[:, 0]
    if head < n_ads and len(open_):
        count[open_] += torch.count_nonzero(rows[open_, head:], dim=-1)
    return (count <= k_out).expand(n_req)
