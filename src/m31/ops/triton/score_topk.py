"""The Triton kernel's entry points, `triton_score_topk` and `triton_score_topk_int8`: fused
score·gate·filter·top-K, one pass over the ad table per batch of requests; no B×N score matrix
ever reaches memory (DESIGN §2, §5, §6).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results, C candidate slots
per request.

Exact top-K by threshold (DESIGN §5):
1. Seed. A fixed-seed uniform sample of the table is scored with the fp32 reference; τ[r] is a
   sample score deep enough that about 3·K ads of the table pass (`threshold`).
2. Scan. The kernel streams the table once; every eligible (request, ad) score ≥ τ[r] is appended
   to the request's candidate buffer [B, C] through an atomic counter, which keeps counting past
   C, so it ends as the exact number of survivors (`launch.scan`, `kernel`).
3. Sort. Each buffer is sorted by (score desc, row asc): ties go to the lower row.
4. Check. A request with fewer survivors than min(K, its eligible ads) (τ too high) is scanned
   again with a lower τ (`threshold.go_deeper`, at last -inf, where every eligible ad survives
   but those scoring NaN); one whose survivors overflowed C again with C = its exact count. All
   ads scoring ≥ τ are in the buffer, so the result is the exact top-K of the kernel's scores,
   ties included.

The kernel's scores are fp32 evaluations of the §2 formula (`kernel`), so the answer equals the
reference's up to fp32 near-ties (scores a few ulps apart may swap).
"""

from __future__ import annotations

import torch
import triton

from m31.ops.contract import NO_ROW, check_args
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table, checked_int8_table
from m31.ops.reference.score import value_bias
from m31.ops.reference.score_topk import torch_score_topk
from m31.ops.triton import threshold as th
from m31.ops.triton.launch import scan
from m31.ops.triton.layout import Query, Table, pack_mask, prepare_query, rows_unit_stride

_MAX_DIM = 256  # largest G or D: one program holds a [256, BN] tile of each in registers


def _exact_top(counts, cand_score, cand_row, k_out: int, n_ads: int):
    """Sort each request's survivors by (score desc, row asc) and keep the first k_out."""
    width = int(counts.max()) if counts.numel() else 0
    slot = torch.arange(width, device=counts.device)
    filled = slot[None, :] < counts[:, None].long()  # [b, width]
    s = cand_score[:, :width].masked_fill(~filled, float("-inf"))
    r = cand_row[:, :width].long().masked_fill(~filled, n_ads)  # empty slots sort last
    r, order = torch.sort(r, dim=1)  # row order first, so the stable sort below breaks ties by row
    s, order = torch.sort(s.gather(1, order), dim=1, descending=True, stable=True)
    r = r.gather(1, order)
    if width < k_out:
        s = torch.cat([s, s.new_full((s.shape[0], k_out - width), float("-inf"))], dim=1)
        r = torch.cat([r, r.new_full((r.shape[0], k_out - width), NO_ROW)], dim=1)
    s, r = s[:, :k_out], r[:, :k_out]
    return s, r.masked_fill(s == float("-inf"), NO_ROW)


def _at(value: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else value[idx]


def _check(q, v, p, g, x, b, mask, k, scales=(), value=None) -> None:
    n_ads = check_args(q, v, p, g, x, b, mask, k, value)[2]
    if not all(t.is_floating_point() for t in (q, v, p)):
        raise ValueError(f"query must be floating point, got {q.dtype}, {v.dtype}, {p.dtype}")
    if v.shape[2] < 1 or max(q.shape[2], v.shape[2]) > _MAX_DIM:
        raise ValueError(
            f"need 1 <= D <= {_MAX_DIM} and G <= {_MAX_DIM}, got G = {q.shape[2]}, D = {v.shape[2]}"
        )
    if n_ads >= 2**31:
        raise ValueError(f"ad rows are stored as int32: N must be below 2^31, got {n_ads}")
    masks = (
        [] if mask is None else [mask.bits, mask.index] if isinstance(mask, PackedMask) else [mask]
    )
    devices = {t.device for t in (q, v, p, g, x, b, *scales, *masks)}  # value: on b's
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if devices.pop().type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(
            "the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported)"
        )


def _score_topk(query: Query, table: Table, seed: th.Seed, mask, k, tau, capacity):
    """The scan-check loop of the module docstring (steps 2–4) over a prepared query and table."""
    n_req, n_ads = query.v.shape[1], table.x.shape[0]
    k_out = min(k, n_ads)
    device = table.x.device
    scores = torch.full((n_req, k_out), float("-inf"), device=device)
    rows = torch.full((n_req, k_out), NO_ROW, dtype=torch.long, device=device)
    bits = None if mask is None else pack_mask(mask)
    need = seed.n_eligible.clamp(max=k_out)  # [B] results each request must get

    rank = th.first_rank(seed, k_out)  # [B] the sample rank τ sits at
    threshold, estimate = th.threshold_at(seed, rank)
    if tau is not None:
        threshold = torch.as_tensor(tau, dtype=torch.float32, device=device).expand(n_req).clone()
    cap = th.capacity(estimate, seed.n_eligible) if capacity is None else capacity
    pending = torch.arange(n_req, device=device)  # requests still to scan
    while len(pending):
        req_bits = bits if bits is None or bits.dim() == 1 else bits[pending]
        counts, cand_score, cand_row = scan(
            query.take(pending), table, req_bits, threshold[pending].contiguous(), cap
        )
        too_few = counts < need[pending]  # τ too high
        # at τ = -inf every eligible ad survives but those scoring NaN: nothing more to find
        too_few &= threshold[pending] > float("-inf")
        overflow = counts > cap
        done = ~(too_few | overflow)
        top_s, top_r = _exact_top(counts[done], cand_score[done], cand_row[done], k_out, n_ads)
        scores[pending[done]], rows[pending[done]] = top_s, top_r

        # overflow: the same τ again, with room for the exact count
        room = torch.where(overflow, counts.float(), 0.0)  # [len(pending)]
        expected = th.go_deeper(seed, rank, threshold, pending[too_few])
        room[too_few] = torch.maximum(room[too_few], expected)
        pending = pending[~done]
        cap = max(1, int(room.max().ceil())) if len(pending) else cap
    return scores, rows


def triton_score_topk(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    _tau: torch.Tensor | float | None = None,
    _capacity: int | None = None,
    _sample_rows: int = th.SAMPLE_ROWS,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, K'] fp32, rows [B, K'] int64), K' = min(k, N), best first, exact.

    The contract of `torch_score_topk`: q [B, E, G], v [B, E, D], p [B, E]; g [N, G], x [N, D],
    b [N] (any float dtype; bf16, fp16 and fp32 rows are read as stored, on the tensor cores in
    one, two or three bf16 parts); mask bool [N] or [B, N], a `PackedMask`, or
    None; value None or fp32 [N], added to b as the tile is loaded (`value_bias`). Ties go to
    the lower row; requests with fewer eligible ads end with rows NO_ROW and scores -inf. The
    private arguments exist for tests of the retry paths: `_tau` replaces the seeded thresholds
    (a float or [B]), `_capacity` the first buffer size, `_sample_rows` the sample size.
    """
    _check(q, v, p, g, x, b, mask, k, value=value)
    if not all(t.is_floating_point() for t in (g, x, b)):
        raise ValueError(
            f"ad table must be floating point (an Int8Table goes to triton_score_topk_int8), "
            f"got {g.dtype}, {x.dtype}, {b.dtype}"
        )
    n_req, n_ads = p.shape[0], x.shape[0]
    if n_req == 0 or n_ads == 0:
        return torch_score_topk(q, v, p, g, x, b, mask, k, value=value)  # nothing to launch
    query = prepare_query(q, v, p)
    x_k = rows_unit_stride(x)
    g_k = rows_unit_stride(g) if query.has_gate else x_k  # unread without the gate
    value = None if value is None else value.contiguous()
    table = Table(g_k, x_k, b.float().contiguous(), None, None, value)

    def fp32_rows(idx):
        return g[idx].float(), x[idx].float(), value_bias(b[idx], _at(value, idx))

    seed = th.seed(q, v, p, fp32_rows, n_ads, mask, _sample_rows)
    return _score_topk(query, table, seed, mask, k, _tau, _capacity)


def triton_score_topk_int8(
    q: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    table: Int8Table,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    *,
    _tau: torch.Tensor | float | None = None,
    _capacity: int | None = None,
    _sample_rows: int = th.SAMPLE_ROWS,
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_score_topk` on an 8-bit table: the exact top-K of the §2 score of
    `table.dequantize()` (up to fp32 rounding), reading one byte per ad dimension."""
    checked_int8_table(table)
    scales = (table.g_scale, table.x_scale)
    _check(q, v, p, table.g, table.x, table.b, mask, k, scales=scales, value=value)
    n_req, n_ads = p.shape[0], table.num_ads
    if n_req == 0 or n_ads == 0:  # nothing to launch
        return torch_score_topk(q, v, p, *table.dequantize(), mask, k, value=value)
    value = None if value is None else value.contiguous()
    kernel_table = Table(
        rows_unit_stride(table.g, torch.int8),
        rows_unit_stride(table.x, torch.int8),
        table.b.contiguous(),  # fp32, as `Int8Table.check` requires
        table.g_scale.contiguous(),
        table.x_scale.contiguous(),
        value,
    )

    def fp32_rows(idx):
        g_s, x_s, b_s = table.dequantize(idx)
        return g_s, x_s, value_bias(b_s, _at(value, idx))

    seed = th.seed(q, v, p, fp32_rows, n_ads, mask, _sample_rows)
    return _score_topk(prepare_query(q, v, p), kernel_table, seed, mask, k, _tau, _capacity)
