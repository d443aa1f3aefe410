"""The cpu kernel's entry points, `cpu_score_topk` and `cpu_score_topk_int8`, and the driver
behind both: checks, the requests that skip the filters, the block size, then steps 1-3 (in
torch ops or compiled) and step 4 (the steps: `m31.ops.cpu`).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K' = min(k, N) results,
n ads per block, P parts of a split query (1 or 2).
"""

from __future__ import annotations

import math

import torch

from m31.ops.contract import NO_ROW, check_args
from m31.ops.cpu import native_pass
from m31.ops.cpu.bounds import plan_float
from m31.ops.cpu.finish import by_request, every_eligible, exact_topk, few_eligible, rows_of
from m31.ops.cpu.int8 import exact_products, plan_int8
from m31.ops.cpu.partition import block_spans, spans_in_threads
from m31.ops.cpu.stats import in_range, table_stats
from m31.ops.cpu.worker import Threshold, Worker
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table, checked_int8_table
from m31.ops.reference.score_topk import torch_score_topk
from m31.ops.threads import single_threaded

# B·E·n elements per block (a bf16 product of 2 MiB). A sweep of blocks of 2^9..2^17 ads at
# B = 1, 16, 64 on the 2-core development machine favoured this size (65,536 ads at B = 1, 8,192 at
# B = 16, 2,048 at B = 64); smaller blocks pay per-op overhead, larger ones leave the caches.
_TILE = 1 << 20
_MIN_BLOCK, _MAX_BLOCK = 512, 65_536
# 8-bit tables: int32 products [P·B·E, n] of 4-8 MiB (B = 1: 131,072 ads, 1.2x faster than 65,536
# at N = 1 M, the per-op overhead being a larger share of the int8 path; B = 64: 2,048)
_INT8_TILE, _INT8_MAX_BLOCK = 1 << 20, 131_072


def _check_mask(mask) -> None:
    device = mask.device if mask is not None else torch.device("cpu")
    if device.type != "cpu":
        raise ValueError(f"the mask must be on the CPU, got {device}")


def _check(q, v, p, g, x, b, mask, k, value) -> None:
    check_args(q, v, p, g, x, b, mask, k, value)
    _check_mask(mask)
    _check_float_cpu(q=q, v=v, p=p, g=g, x=x, b=b)


def _check_float_cpu(**named: torch.Tensor) -> None:
    for name, t in named.items():
        if not t.is_floating_point() or t.device.type != "cpu":
            raise ValueError(
                f"{name} must be a floating-point CPU tensor, got {t.dtype} on {t.device}"
            )


def cpu_score_topk(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    block: int | None = None,
    threads: int | None = None,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, K'] fp32, rows [B, K'] int64), K' = min(k, N): the contract of `torch_score_topk`.

    q [B, E, G], v [B, E, D], p [B, E]; g [N, G], x [N, D], b [N] (bf16 tables take bf16
    products, others fp32 ones, `bounds._product_dtype`); mask bool [N] or [B, N], a `PackedMask`
    (unpacked a block at a time) or None. `block`: ads per block (default: about 2²⁰ / (B·E),
    so a block's products stay in cache); `threads`: worker threads that split
    the blocks, each running torch on one core (default: torch.get_num_threads()). torch's thread
    count is set to 1 in those threads for the call (the MKL part of that setting is process-wide)
    and restored afterwards. Requests with at most K' eligible ads skip the filters (their answer
    is every eligible ad); inputs beyond the filters' range (`in_range`) go to the reference.
    `value`: fp32 [N] or None, added to the bias (`value_bias`); the steps read it through the
    per-ad constants they keep beside the table's norms (`table_stats`), so the bounds and the
    compiled pass hold as they are.
    """
    _check(q, v, p, g, x, b, mask, k, value)
    g, x, b = g.contiguous(), x.contiguous(), b.contiguous()
    return _solve(q, v, p, (g, x, b), mask, k, block, threads, value)


def cpu_score_topk_int8(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    table: Int8Table,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    block: int | None = None,
    threads: int | None = None,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cpu_score_topk` reading an 8-bit table as stored: the exact top K of its dequantized
    table (the `Int8Table` definition), with no dequantized copy of the table.

    The query is rounded to int8 as well (its rounding is measured and bounded like bf16's), so
    steps 1 and 2 run on integer products (`torch._int_mm`, VNNI on x86): a quarter of the bytes
    of an fp32 table and half of bf16's, at four times bf16's product rate. Where the integer
    product is not exact (`exact_products`: a CPU whose int8 kernel saturates, or D or G too
    large for int32 sums), this scores the dequantized table with `cpu_score_topk` instead.
    """
    checked_int8_table(table)
    g, x, b = table.g, table.x, table.b
    check_args(q, v, p, g, x, b, mask, k, value)
    _check_mask(mask)
    _check_float_cpu(q=q, v=v, p=p)
    if table.device.type != "cpu":
        raise ValueError(f"the table must be on the CPU, got {table.device}")
    if not exact_products(g.shape[1], x.shape[1]):
        return cpu_score_topk(
            q, v, p, *table.dequantize(), mask, k, block=block, threads=threads, value=value
        )
    table = Int8Table(*(t.contiguous() for t in table))
    return _solve(q, v, p, table, mask, k, block, threads, value)


def _solve(q, v, p, table, mask, k: int, block, threads, value):
    """The driver behind both entry points: table (g, x, b) or an Int8Table, arguments checked."""
    if block is not None and block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if threads is not None and threads <= 0:
        raise ValueError(f"threads must be positive, got {threads}")
    quantized = isinstance(table, Int8Table)
    n_req, n_ads = p.shape[0], table.b.shape[0] if quantized else table[2].shape[0]
    k_out = min(k, n_ads)
    if n_req == 0 or n_ads == 0:
        return torch.full((n_req, k_out), -math.inf), torch.full((n_req, k_out), NO_ROW)
    value = None if value is None else value.contiguous()
    if quantized:
        stats = table_stats(table.g, table.x, table.b, table.g_scale, table.x_scale, value)
    else:
        stats = table_stats(*table, value=value)
    if not in_range(q, v, p, stats):
        plain = table.dequantize() if quantized else table
        return torch_score_topk(q, v, p, *plain, mask, k, value=value)
    # on one core: an OpenMP team woken here would spin on the cores the workers need next
    with single_threaded(torch.get_num_threads()):
        few = few_eligible(mask, n_req, n_ads, k_out)  # [B]
    take = rows_of(table, value)

    def filtered(q, v, p, mask):
        return _filtered_topk(q, v, p, table, take, stats, mask, k_out, block, threads)

    def every(q, v, p, mask):
        n_threads = threads or torch.get_num_threads()
        return every_eligible(q, v, p, take, n_ads, mask, k_out, n_threads)

    scores = torch.empty(n_req, k_out)  # [B, K']
    rows = torch.empty(n_req, k_out, dtype=torch.long)  # [B, K']
    for part, solve in ((few, every), (~few, filtered)):
        idx = part.nonzero()[:, 0]
        if len(idx):
            if isinstance(mask, PackedMask):
                part_mask = mask.select(idx)
            else:
                part_mask = mask if mask is None or mask.dim() == 1 else mask[idx]
            scores[idx], rows[idx] = solve(q[idx], v[idx], p[idx], part_mask)
    return scores, rows


def _filtered_topk(q, v, p, table, take, stats, mask, k_out: int, block, threads):
    """Steps 1-4 (`m31.ops.cpu`) for requests with more than k_out eligible ads."""
    n_req, n_exp = p.shape
    n_ads = len(stats.scan_bias)
    if isinstance(table, Int8Table):
        plan = plan_int8(q, v, p, k_out)
    else:
        plan = plan_float(q, v, p, table[0], table[1], k_out)
    if block is None:
        tile, most = (_INT8_TILE, _INT8_MAX_BLOCK) if plan.quantized else (_TILE, _MAX_BLOCK)
        block = 1 << round(math.log2(max(tile / (n_req * n_exp), 1)))
        block = min(max(block, _MIN_BLOCK), most)
    block = min(block, n_ads)
    spans = block_spans(n_ads, block)
    n_workers = min(threads or torch.get_num_threads(), len(spans))
    lib = native_pass.library_for(plan)
    if lib is not None:
        req, row, upper, tau = native_pass.compiled_pass(
            lib, plan, table, stats, mask, spans, block, n_workers
        )
    else:
        shared = Threshold(n_req, k_out, plan.u_scan)
        workers = [Worker(plan, table, stats, mask, shared, block) for _ in range(n_workers)]
        spans_in_threads(
            n_workers,
            spans,
            lambda i, lo, hi: workers[i].scan(lo, hi),
            lambda i: workers[i].finish(),
        )
        parts = [w.cands[0] for w in workers if w.cands]
        if not parts:
            return torch.full((n_req, k_out), -math.inf), torch.full((n_req, k_out), NO_ROW)
        req, row, upper = (torch.cat(t) for t in zip(*parts, strict=True))
        tau = shared.for_refine
    if not len(req):
        return torch.full((n_req, k_out), -math.inf), torch.full((n_req, k_out), NO_ROW)
    keep = upper >= tau[req]
    req, row = req[keep], row[keep]
    order = torch.argsort(req * n_ads + row)  # by request, then row
    rows, valid = by_request(req[order], row[order], n_req)
    # the finish is small: one core avoids waking a thread team (costly on a busy machine)
    with single_threaded(torch.get_num_threads()):
        return exact_topk(q, v, p, take, rows, valid, k_out)
