"""Steps 1-3 of the cpu kernel on an 8-bit table in compiled code: the driver of `m31_pass`
(`csrc/pass.c`, built and loaded by `m31.ops.cpu.native`), one call per worker thread.

Shapes: B requests, N ads, E experts, n_spans spans of ads.
"""

from __future__ import annotations

import ctypes
import math

import torch

from m31.ops.cpu import native
from m31.ops.cpu.bounds import SLACK, Plan, offset_alpha
from m31.ops.cpu.partition import in_threads
from m31.ops.cpu.stats import TableStats
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table

# the compiled steps keep per-expert scratch on the thread's stack (E·256 int32 in step 2)
_MAX_EXPERTS = 512


def library_for(plan: Plan) -> ctypes.CDLL | None:
    """The compiled helpers where they take this call (an 8-bit table, at most `_MAX_EXPERTS`
    experts) and are built; None sends it to the torch ops (`Worker`)."""
    if not plan.quantized or plan.n_exp > _MAX_EXPERTS:
        return None
    return native.library()


def _mask_args(mask) -> tuple[int, torch.Tensor | None, int, torch.Tensor | None]:
    """(mode, data, stride, index) of a mask for `m31_scan_int8` (see `csrc/scan.c`):
    0 for none; 1 for bool [N] (stride 0) or [B, N] (stride N); 2 for a `PackedMask`'s bits."""
    if mask is None:
        return 0, None, 0, None
    if isinstance(mask, PackedMask):
        bits = mask.bits.contiguous()
        return 2, bits, bits.shape[1], mask.index.contiguous()
    mask = mask.contiguous()
    return 1, mask, mask.shape[-1] if mask.dim() == 2 else 0, None


def compiled_pass(
    lib, plan: Plan, table: Int8Table, stats: TableStats, mask, spans, block: int, n_workers: int
):
    """Steps 1-3 on an 8-bit table in compiled code (`m31_pass` in `csrc/pass.c`): each
    worker thread one call that takes the spans in turn with the others and shares τ with them,
    so that the GIL is taken only to start the calls and to collect their candidates. The same
    steps as `Worker`'s, with step 2's exponentials compiled too (DESIGN §5).
    -> (req, row, h) of the candidates, and τ for the final filter ([B] `for_refine`)."""
    ptr, n_req = native.ptr, plan.n_req
    mode, mask_data, mask_stride, mask_index = _mask_args(mask)
    span_at = torch.tensor(spans, dtype=torch.long)  # [n_spans, 2]
    args = native.PassArgs(
        spans=ptr(span_at),
        n_spans=len(spans),
        block=block,
        x=ptr(table.x),
        x_scale=ptr(table.x_scale),
        d=table.x.shape[1],
        g=ptr(table.g),
        g_scale=ptr(table.g_scale),
        gdim=table.g.shape[1],
        per_ad=ptr(stats.per_ad),
        scan_bias=ptr(stats.scan_bias),
        n_ads=len(stats.scan_bias),
        w=ptr(plan.v_int),
        v_scale=ptr(plan.v_scale),
        wq=ptr(plan.q_int),
        q_scale=ptr(plan.q_scale),
        p_t=ptr(plan.p_t),
        coef=ptr(plan.coef),
        n_req=n_req,
        n_exp=plan.n_exp,
        alpha=offset_alpha(plan),
        shift_base=plan.p_abs_max + math.log(plan.n_exp),
        eta_l=plan.eta_l,
        kappa=plan.kappa,
        one_u=1 + plan.u_a,
        u_2kappa=plan.u_a + 2 * plan.kappa,
        mask_mode=mode,
        mask=ptr(mask_data),
        mask_stride=mask_stride,
        mask_index=ptr(mask_index),
        refine_pairs=plan.refine_pairs,
        room=plan.candidate_room,
    )
    shared = lib.m31_shared_new(n_req, plan.k, SLACK, plan.u_scan + SLACK)
    if not shared:
        raise MemoryError("the cpu kernel's threshold: out of memory")
    found: list[tuple[torch.Tensor, ...]] = []

    def work(_: int) -> None:
        cands = ctypes.c_void_p()
        count = lib.m31_pass(shared, ctypes.byref(args), ctypes.byref(cands))
        if count < 0:
            raise MemoryError("the cpu kernel's compiled pass: out of memory")
        try:
            req, row = torch.empty(count, dtype=torch.long), torch.empty(count, dtype=torch.long)
            upper = torch.empty(count)
        except BaseException:
            lib.m31_cands_free(cands)
            raise
        lib.m31_cands_take(cands, ptr(req), ptr(row), ptr(upper))
        found.append((req, row, upper))

    try:
        in_threads(n_workers, work)
        tau = torch.empty(n_req)
        lib.m31_shared_tau(shared, ptr(tau))
    finally:
        lib.m31_shared_free(shared)
    req, row, upper = (torch.cat(t) for t in zip(*found, strict=True))
    return req, row, upper, tau
