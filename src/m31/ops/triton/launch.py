"""One launch of the Triton kernel (`kernel.score_topk_kernel`): the tile shape by batch size, the
compile-time arguments, the candidate buffers.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, C candidate slots per request;
a tile is BB requests × BN ads; EP, GP, DP are E, G, D padded to powers of two.

Tiles by batch size (`pick_tiles`), 8 warps. DESIGN §6 measured the two gate layouts on an
H200 as sketches; the sizes here are the largest that ptxas (Triton 3.6, sm_90a, `ptxas -v`)
compiles without register spills at G = D = 64 for a bf16 table with the query in three parts,
and are not yet timed on a GPU:
* gate folded away (E = 1 or G = 0): BB = B rounded up to a power of two in [16, 64], BN = 128
  (64 at BB = 64).
* B·EP ≤ 64 after rounding B up to a power of two ("stacked"): all experts of the BB requests as
  one [BB·EP, ·] product, softmax by reshaping to [BB, EP, BN]; BN = 128. Small batches are
  bound by streaming the table, and this layout reached 90% of the memory limit at B = 1
  (BB = 2, E = 8).
* larger batches ("online"): experts walked one at a time with an online softmax (as flash
  attention walks keys), every product a plain [BB, BN] tile; BB = 32, BN = 64. The sketch ran
  fastest at BB = 64, BN = 128 (84 G pairs/s at B = 64 and 512), but with the candidate append,
  the ad tile kept across request tiles and three products per dot, BB = 64 spills.
fp16, fp32 and int8 tables hold more registers (their parts, the int8 scales): at 64 stacked
rows BN halves per extra part (and for int8), and an fp32 table halves the online BB.
Each program owns one BN-run of ads, loads it once and loops over all request tiles, so the
table is read once per batch; the ad axis is grid axis 0 (axes 1 and 2 stop at 65,535).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from m31.ops.triton.kernel import DOT_TYPE, score_topk_kernel
from m31.ops.triton.layout import LOG2E, Query, Table


class Tiles(NamedTuple):
    bb: int
    bn: int
    stacked: bool


NUM_WARPS = 8  # with 4, ptxas (sm_90) spills registers in most of the layouts below


def pick_tiles(
    n_req: int, n_exp_padded: int, dim_padded: int, has_gate: bool, extra: int = 0
) -> Tiles:
    """Tile shape by batch size (the reasons are in the module docstring). Past a padded G or D
    of 64 the tiles shrink with it, as larger ones spill registers on sm_90; so do they with
    `extra`, the table's extra register weight: one per bf16 part past the first (`Table`) and
    one for int8 scales. Every layout at G = D = 64 compiles without spills (ptxas -v, sm_90a)."""
    bb = triton.next_power_of_2(n_req)
    shrink = max(1, dim_padded // 64)
    bn = max(16, 128 // shrink)
    if not has_gate:
        bb = min(64, max(16, bb))
        return Tiles(bb, bn if bb < 64 else max(16, bn // 2), False)
    if bb * n_exp_padded <= 64:  # BB·EP ≥ 16 rows for tl.dot
        bb = max(bb, 16 // n_exp_padded)
        return Tiles(bb, bn if bb * n_exp_padded < 64 else max(16, bn >> extra), True)
    return Tiles(max(16, min(32, bb) // shrink >> max(0, extra - 1)), 64, False)


def _constants(query: Query, table: Table, mask_mode: int) -> dict:
    """The kernel's compile-time arguments: the tile, the padded dims, the paths it takes."""
    n_req, n_exp, gate_dim = query.q.shape[1:]
    exp_pad = triton.next_power_of_2(n_exp)
    gate_pad = max(16, triton.next_power_of_2(gate_dim))
    value_pad = max(16, triton.next_power_of_2(table.x.shape[1]))
    quant = table.x_scale is not None
    extra = table.parts - 1 + quant
    tiles = pick_tiles(n_req, exp_pad, max(gate_pad, value_pad), query.has_gate, extra)
    return {
        "BB": tiles.bb,
        "BN": tiles.bn,
        "E": n_exp,
        "EP": exp_pad,
        "GP": gate_pad,
        "DP": value_pad,
        "HAS_GATE": query.has_gate,
        "STACKED": tiles.stacked,
        "QUANT": quant,
        "HAS_VALUE": table.value is not None,
        "MASK_MODE": mask_mode,
        "TP": table.parts,
        "DOT": DOT_TYPE,
    }


def scan(query: Query, table: Table, bits, tau, capacity: int):
    """One kernel pass: (survivor counts [B] int32, scores [B, C] fp32, rows [B, C] int32).

    bits: the mask's int32 words (`layout.pack_mask`), [W32] or [B, W32], or None; tau [B] fp32.
    """
    n_req, _, gate_dim = query.q.shape[1:]
    n_ads, value_dim = table.x.shape
    device = table.x.device
    counts = torch.zeros(n_req, dtype=torch.int32, device=device)
    cand_score = torch.empty(n_req, capacity, dtype=torch.float32, device=device)
    cand_row = torch.empty(n_req, capacity, dtype=torch.int32, device=device)
    mask_mode = 0 if bits is None else (1 if bits.dim() == 1 else 2)
    bits = counts if bits is None else bits  # an unread stand-in pointer when there is no mask
    const = _constants(query, table, mask_mode)
    quant = const["QUANT"]
    score_topk_kernel[(triton.cdiv(n_ads, const["BN"]),)](
        query.q,
        query.v,
        query.p,
        table.g,
        table.x,
        table.b,
        table.g_scale if quant else table.b,  # the scales are read only when QUANT
        table.x_scale if quant else table.b,
        table.b if table.value is None else table.value,  # read only when HAS_VALUE
        bits,
        tau,
        counts,
        cand_score,
        cand_row,
        n_req,
        n_ads,
        gate_dim,
        value_dim,
        table.g.stride(0),
        table.x.stride(0),
        bits.stride(0) if mask_mode == 2 else 0,
        capacity,
        LOG2E / math.sqrt(gate_dim) if query.has_gate else 1.0,
        **const,
        num_warps=NUM_WARPS,
    )
    return counts, cand_score, cand_row
