"""`m31 bench kernels --check`: every kernel the device can run, on bf16 and 8-bit tables (and
the bf16 table with a value column, DESIGN §2 "The value term"), against the reference on fresh
random data, judged by `m31.ops.testing.check_topk` (the tests' comparison); and recall@K of the
8-bit table's top K against the bf16 table's.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from m31.bench.common import Log, random_query, random_table, recall_at_k, to_stderr
from m31.ops import NO_ROW, PackedMask, available_kernels, quantize_ad_table, score_topk
from m31.ops.masks import pack
from m31.ops.reference import torch_score_topk, value_bias
from m31.ops.testing import check_topk

# (B, N, E, G, D, K, mask): odd sizes, K > N, nothing eligible, the G = 0 two-tower case, and
# the index's packed masks (bitmaps shared by several requests, `m31.ops.PackedMask`).
CHECK_CASES = (
    (1, 1, 1, 64, 64, 5, "none"),
    (3, 1_000, 8, 64, 64, 100, "shared"),
    (2, 777, 3, 16, 48, 1_000, "per-request"),
    (5, 4_099, 8, 64, 64, 1_000, "shared"),
    (4, 3_001, 8, 64, 64, 50, "nothing"),
    (3, 2_049, 1, 0, 32, 17, "shared"),
    (7, 5_003, 8, 64, 64, 100, "packed"),
)
CHECK_CASES_LARGE = (
    (6, 65_537, 8, 64, 64, 100, "per-request"),
    (64, 100_003, 8, 64, 64, 1_000, "shared"),
    (64, 100_003, 8, 64, 64, 100, "packed"),
)


@dataclass
class CheckRow:
    kernel: str
    table: str
    b: int
    n: int
    e: int
    g: int
    d: int
    k: int
    mask: str
    status: str  # ok | FAIL | skipped
    max_abs_err: float | None = None
    rows_equal: float | None = None  # share of result slots holding the reference's row
    note: str = ""


def _check_mask(kind: str, n_req: int, n: int, device: torch.device, seed: int):
    """None, or bool [N] ("nothing": all False; "shared") or [B, N] ("per-request"), or a
    `PackedMask` ("packed": 3 bitmaps, each request reading one)."""
    gen = torch.Generator(device).manual_seed(seed)
    if kind == "none":
        return None
    if kind == "packed":
        maps = torch.rand((3, n), generator=gen, device=device) < 0.5
        which = torch.arange(n_req, device=device) % 3
        return PackedMask(pack(maps), which, n)
    if kind == "nothing":
        return torch.zeros(n, dtype=torch.bool, device=device)
    shape = (n,) if kind == "shared" else (n_req, n)
    return torch.rand(shape, generator=gen, device=device) < 0.5


def _check_kernel(row: CheckRow, query, table, plain, value, mask, ref) -> None:
    """Run `row.kernel` through the dispatcher and fill in the row's verdict."""
    try:
        got = score_topk(query, table, mask, row.k, kernel=row.kernel, value=value)
    except Exception as err:  # a kernel that raises fails this case; the check goes on
        row.status, row.note = "FAIL", f"raised {type(err).__name__}: {str(err).splitlines()[0]}"
        return
    problem = check_topk(
        got, ref, query, plain, mask.unpack() if isinstance(mask, PackedMask) else mask
    )
    if problem is not None:
        row.status, row.note = "FAIL", problem
        return
    (gs, gr), (rs, rr) = ((t.cpu() for t in pair) for pair in (got, ref))
    found = rr != NO_ROW  # [B, K']
    if found.any():
        row.max_abs_err = float((gs[found] - rs[found]).abs().max())
        row.rows_equal = float((gr == rr).float().mean())


def run_check(
    device: torch.device, quick: bool = False, seed: int = 0, log: Log = to_stderr
) -> tuple[list[CheckRow], list[dict]]:
    """Every available kernel, bf16 and 8-bit, against the reference on fresh random data; and
    recall@K of the 8-bit table's top K against the bf16 table's (the reference on both)."""
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    cases = CHECK_CASES if quick else CHECK_CASES + CHECK_CASES_LARGE
    rows: list[CheckRow] = []
    for i, (n_req, n, e, gdim, ddim, k, mask_kind) in enumerate(cases):
        query = random_query(n_req, e, gdim, ddim, device, seed + 2 * i)
        bf16, _ = random_table(n, gdim, ddim, device, seed + 2 * i + 1)
        mask = _check_mask(mask_kind, n_req, n, device, seed + i)
        int8 = quantize_ad_table(*bf16)
        gen = torch.Generator(device).manual_seed(seed + i)
        value = torch.randn(n, generator=gen, device=device)  # a value term of unit spread
        valued = (*bf16[:2], value_bias(bf16[2], value))  # the table the reference scores
        tables = {  # (scored, as the reference scores it, value column)
            "bf16": (bf16, bf16, None),
            "int8": (int8, int8.dequantize(), None),
            "bf16 + value": (bf16, valued, value),
        }
        refs = {
            name: torch_score_topk(*query, *plain, mask, k)
            for name, (_, plain, _) in tables.items()
        }
        for kernel in available_kernels(device):
            for name, (table, plain, value) in tables.items():
                row = CheckRow(kernel, name, n_req, n, e, gdim, ddim, k, mask_kind, "ok")
                if kernel == "triton" and interpreted and i >= len(CHECK_CASES):
                    row.status, row.note = "skipped", "interpreted Triton: small cases only"
                else:
                    _check_kernel(row, query, table, plain, value, mask, refs[name])
                rows.append(row)
                log(
                    f"check {row.status:<7} {kernel:<6} {name} B = {n_req} N = {n:,} E = {e} "
                    f"G = {gdim} D = {ddim} K = {k} mask {mask_kind}"
                    + (f": {row.note}" if row.note else "")
                )
    recalls = []
    n_req, n = 16, (1_000_000 if device.type == "cuda" else 20_000 if quick else 100_000)
    query = random_query(n_req, 8, 64, 64, device, seed + 101)
    table, mask = random_table(n, 64, 64, device, seed + 102)
    deq = quantize_ad_table(*table).dequantize()
    for k in (100, 1000):
        ref = torch_score_topk(*query, *table, mask, k)[1]
        got = torch_score_topk(*query, *deq, mask, k)[1]
        recalls.append({"n": n, "b": n_req, "k": k, "recall": recall_at_k(got, ref)})
        log(f"recall@{k} of the 8-bit table vs bf16, N = {n:,}: {recalls[-1]['recall']:.4f}")
    return rows, recalls
