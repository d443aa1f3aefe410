"""Steps 1-3 of the cpu kernel in torch ops: a `Worker` per thread scans blocks of ads (the
affinity filter, the gate for the survivors) and keeps its candidates; the threshold τ is
shared by the workers (`Threshold`). An 8-bit table takes the compiled pass instead where it is
built (`m31.ops.cpu.native_pass`), which this path is the definition of.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, n ads per block,
S (request, ad) pairs that survive a filter, P parts of a split query (1 or 2).
"""

from __future__ import annotations

import math
import threading

import torch

from m31.ops.cpu.bounds import SLACK, Plan, affinity_offset, gate_bounds
from m31.ops.cpu.int8 import int_products
from m31.ops.cpu.stats import TableStats
from m31.ops.masks import mask_rows


class Threshold:
    """τ [B], shared by the workers: the K-th largest lower bound ℓ seen so far per request.

    It keeps the K largest ℓ of each request ([B, K]), so τ never passes the K-th best score
    (DESIGN §5, "Exactness"). τ only rises, so a stale read is still a valid threshold.
    `for_refine` and `for_scan` are τ lowered by the slack the fp32 arithmetic of the two filters
    needs (the scan also moves the output rounding u'|M̂| of U over to τ's side).
    """

    def __init__(self, n_req: int, k: int, u_scan: float):
        self._lock = threading.Lock()
        self._u_scan = u_scan
        self._top = torch.full((n_req, k), -math.inf)  # [B, K] largest ℓ
        self.tau = self.for_refine = self.for_scan = self._top[:, -1]

    def offer(self, req: torch.Tensor, lower: torch.Tensor) -> None:
        """Merge the lower bounds ℓ [P] of pairs of requests req [P] (each pair offered once)."""
        with self._lock:
            n_req, k = self._top.shape
            merged = torch.cat([self._top, _pad_by_request(lower, req, n_req)], dim=1)
            self._top = merged.topk(k, dim=1).values
            self.tau = self._top[:, -1]
            self.for_refine = self.tau - SLACK * self.tau.abs()
            self.for_scan = self.tau - (self._u_scan + SLACK) * self.tau.abs()


def _pad_by_request(values: torch.Tensor, req: torch.Tensor, n_req: int) -> torch.Tensor:
    """[B, width]: the values [P] of each request (req [P]) in its row, padded with -inf."""
    if n_req == 1:
        return values[None]
    counts = torch.bincount(req, minlength=n_req)  # [B]
    order = torch.argsort(req, stable=True)
    req_sorted = req[order]
    pos = torch.arange(len(req)) - (torch.cumsum(counts, 0) - counts)[req_sorted]
    padded = torch.full((n_req, int(counts.max()) if len(req) else 0), -math.inf)
    padded[req_sorted, pos] = values[order]
    return padded


def _expert_index(req: torch.Tensor, col: torch.Tensor, n_exp: int, width: int) -> torch.Tensor:
    """[E, S] flat positions of pairs (req [S], col [S]) in a [B·E, width] product, one per expert."""
    return (req * (n_exp * width) + col)[None, :] + (torch.arange(n_exp) * width)[:, None]


class Worker:
    """Scans blocks of ads for one thread and keeps that thread's candidates, in torch ops (an
    8-bit table takes `compiled_pass` where the compiled helpers are built)."""

    def __init__(self, plan: Plan, table, stats: TableStats, mask, shared: Threshold, block: int):
        self.plan, self.shared, self.stats = plan, shared, stats
        self.table = table  # (g, x, b) or an Int8Table
        self.g, self.x = (table.g, table.x) if plan.quantized else table[:2]
        self.mask = mask
        # products' scratch: [B·E, n] in the product dtype, or [P·B·E, n] int32 (8-bit)
        out = torch.int32 if plan.quantized else plan.vh.dtype
        self.a_buf = torch.empty(len(plan.vh) * block, dtype=out)
        self.l_buf = None  # (8-bit tables compute logits per request, `logits_int8`)
        if plan.qh is not None and not plan.quantized:
            self.l_buf = torch.empty(len(plan.qh) * block, dtype=plan.qh.dtype)
        self.pending: list[tuple[torch.Tensor, ...]] = []
        self.n_pending = 0
        self.refine_pairs = plan.refine_pairs
        self.cands: list[tuple[torch.Tensor, ...]] = []  # (req, row, upper bound h)
        self.n_cands = 0
        self.cap = plan.candidate_room
        self.block = block

    def scan(self, lo: int, hi: int) -> None:
        """Step 1 on ads [lo, hi): the affinity bound U, eligibility, gather the survivors."""
        if self.plan.quantized:
            return self.scan_int8(lo, hi)
        plan, stats, n = self.plan, self.stats, hi - lo
        n_req, n_exp = plan.n_req, plan.n_exp
        xb = self.x[lo:hi].to(plan.vh.dtype)
        aff = torch.mm(plan.vh, xb.T, out=self.a_buf[: n_req * n_exp * n].view(-1, n))  # [B·E, n]
        best = aff.view(n_req, n_exp, n).amax(1)  # [B, n] M̂
        offset = affinity_offset(plan, stats.x_norm[lo:hi], stats.scan_bias[lo:hi])  # [n]
        keep = torch.add(best, offset) >= self.shared.for_scan[:, None]  # [B, n]
        if self.mask is not None:
            keep &= mask_rows(self.mask, lo, hi)
        req, ad = keep.nonzero().unbind(1)  # [S], [S]
        if len(req) == 0:
            return
        row = ad + lo
        gate = None if plan.qh is None else self.gate_logits(lo, hi, req, ad)  # [S, E] L̂
        # Â stays [B·E, n] for the max over E along rows; the take gathers E strided values
        gathered = aff.take(_expert_index(req, ad, n_exp, n))  # [E, S] Â
        self.add_pending(req, row, gate, gathered, n)

    def add_pending(self, req, row, gate, aff, n: int) -> None:
        """Queue survivors (req [S], row [S], L̂ [S, E] or None, Â [E, S]) of a block of n ads."""
        per_ad = self.stats.per_ad.index_select(1, row)  # [3, S]
        self.pending.append((req, row, gate, aff, per_ad))
        self.n_pending += len(req)
        if self.n_pending >= self.refine_pairs or n < self.block:
            self.refine()  # after a short (warm-up) block at once: τ is what prunes the next

    def gate_logits(self, lo: int, hi: int, req: torch.Tensor, ad: torch.Tensor) -> torch.Tensor:
        """L̂ [S, E] of the surviving pairs (req [S], ad [S] in [0, hi - lo))."""
        plan, n = self.plan, hi - lo
        gb = self.g[lo:hi]
        if plan.n_req == 1 and 2 * len(ad) < n:  # one request: only its surviving ads' logits
            return torch.mm(gb.index_select(0, ad).to(plan.qh.dtype), plan.qh.T)
        # Ads by rows, so that a pair's E logits are adjacent: one 2E-byte row gather per pair.
        # (Gathering each request's surviving ads for a batch of small products measured no faster
        # at B = 16 and 64: the gathers cost what the skipped multiply-adds saved.)
        out = self.l_buf[: n * plan.n_req * plan.n_exp].view(n, -1)
        logits = torch.mm(gb.to(plan.qh.dtype), plan.qh.T, out=out)  # [n, B·E]
        return logits.view(n * plan.n_req, plan.n_exp).index_select(0, ad * plan.n_req + req)

    def scan_int8(self, lo: int, hi: int) -> None:
        """`scan` on an 8-bit table: exact integer products, scaled after the max over E.

        Â_e = (I_e·v_scale)·x_scale in fp32 with both scales positive, so max_e Â_e is the same
        expression of max_e I_e (fp32 rounding is monotone): one [B, n] scaling, not [B·E, n]."""
        plan, stats, table, n = self.plan, self.stats, self.table, hi - lo
        n_req, n_exp = plan.n_req, plan.n_exp
        ints = int_products(plan.vh, table.x[lo:hi], n_req * n_exp, self.a_buf)  # [B·E, n] I
        best = ints.view(n_req, n_exp, n).amax(1).float()  # [B, n]
        x_scale = table.x_scale[lo:hi]
        best.mul_(plan.v_scale[:, None]).mul_(x_scale)  # M̂
        offset = affinity_offset(plan, stats.x_norm[lo:hi], stats.scan_bias[lo:hi])  # [n]
        keep = best.add_(offset) >= self.shared.for_scan[:, None]  # [B, n]
        if self.mask is not None:
            keep &= mask_rows(self.mask, lo, hi)
        req, ad = keep.nonzero().unbind(1)  # [S], [S]
        if len(req) == 0:
            return
        aff = ints.take(_expert_index(req, ad, n_exp, n)).float()  # [E, S]
        aff.mul_(plan.v_scale.index_select(0, req)).mul_(x_scale.index_select(0, ad))  # Â
        self.add_pending(req, ad + lo, None, aff, n)  # the logits follow in `refine`

    def logits_int8(self, req, row, aff, per_ad):
        """L̂ [E, S] of the pending pairs of an 8-bit table, the pairs reordered by request.

        One integer product per request with its surviving ads' gathered rows of g: a pair's
        logits are computed once, where a product per block would compute all B·n of them (at
        B = 64, about 12 times as many as survive step 1)."""
        plan, table = self.plan, self.table
        if plan.n_req > 1:
            order = torch.argsort(req, stable=True)
            req, row = req.index_select(0, order), row.index_select(0, order)
            aff, per_ad = aff.index_select(1, order), per_ad.index_select(1, order)
        rows = table.g.index_select(0, row)  # [S, G]
        ints = torch.empty(plan.n_exp, len(row), dtype=torch.int32)  # [E, S]
        start = 0
        for r, count in enumerate(torch.bincount(req, minlength=plan.n_req).tolist()):
            if count:
                span = slice(start, start + count)
                ints[:, span] = int_products(plan.qh[r], rows[span], plan.n_exp, None)
            start += count
        gate = ints.float().mul_(plan.q_scale.index_select(0, req))
        return req, row, aff, per_ad, gate.mul_(table.g_scale.index_select(0, row))

    def refine(self) -> None:
        """Step 2 on the gathered survivors: s̃ ± ε in fp32; keep the pairs with h ≥ τ."""
        if not self.pending:
            return
        req, row, lower, upper = self.bounds()
        promote = torch.nonzero(lower > self.shared.tau.index_select(0, req)).squeeze(1)
        if len(promote):
            self.shared.offer(req.index_select(0, promote), lower.index_select(0, promote))
        self.cands.append((req, row, upper))
        self.n_cands += len(req)
        if self.n_cands > self.cap:
            self.prune()
            self.cap = max(self.cap, 2 * self.n_cands)

    def bounds(self):
        """(req, row, ℓ, h) [S'] of the pending pairs with h ≥ τ, in torch ops."""
        plan = self.plan
        req, row, gates, affs, per_ad = zip(*self.pending, strict=True)
        self.pending, self.n_pending = [], 0
        req, row, aff = torch.cat(req), torch.cat(row), torch.cat(affs, dim=1)  # aff [E, S]
        per_ad = torch.cat(per_ad, dim=1)  # [3, S]
        gate = None  # [S, E] -> [E, S] fp32, in one copy
        if plan.quantized and plan.qh is not None:
            req, row, aff, per_ad, gate = self.logits_int8(req, row, aff, per_ad)
        elif gates[0] is not None:
            gate = torch.cat(gates).T.to(torch.float32, memory_format=torch.contiguous_format)
        g_norm, x_norm, bias = per_ad.unbind(0)  # [S] each (fresh: overwritten)
        approx, eps = gate_bounds(plan, req, gate, aff, g_norm, x_norm, bias)  # [S], [S]
        lower, upper = approx - eps, approx + eps
        keep = torch.nonzero(upper >= self.shared.for_refine.index_select(0, req)).squeeze(1)
        req, row = req.index_select(0, keep), row.index_select(0, keep)
        return req, row, lower.index_select(0, keep), upper.index_select(0, keep)

    def prune(self) -> None:
        """Step 3: drop the candidates whose upper bound fell below τ."""
        req, row, upper = (torch.cat(parts) for parts in zip(*self.cands, strict=True))
        keep = torch.nonzero(upper >= self.shared.for_refine.index_select(0, req)).squeeze(1)
        self.cands = [tuple(t.index_select(0, keep) for t in (req, row, upper))]
        self.n_cands = len(keep)

    def finish(self) -> None:
        self.refine()
        if self.cands:
            self.prune()
