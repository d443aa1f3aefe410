"""What the score·top-K tests share: random problems and masks, the full-sort definition, the
comparisons, and `PATHS`, every way to run the contract on this machine (`test_score_topk`).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K' = min(K, N) results.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from unittest import mock

import pytest
import torch

from m31.ops import NO_ROW, Int8Table, available_kernels, quantize_ad_table, rounded_score
from m31.ops.cpu import bounds, cpu_score_topk, cpu_score_topk_int8, native
from m31.ops.cpu.int8 import int8_products_exact
from m31.ops.reference import torch_score_topk

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NEAR_TIE = 1e-5  # relative (floor 1): about 80 fp32 ulps, what an fp32 evaluation may swap

# Where the CPU's int8 products are not exact the kernel scores the dequantized table instead
# (still correct, and still tested), but the integer filters themselves are then not run.
needs_exact_int8 = pytest.mark.skipif(
    not int8_products_exact(), reason="this CPU's int8 products saturate: the filters are not used"
)


def random_problem(
    n_req, n_ads, n_exp, gdim, ddim, seed, dtype=torch.bfloat16, scale=1.0, levels=None
):
    """(query fp32, table in `dtype`) of standard normal values; `scale` multiplies q and p (the
    gate logits), `levels` rounds every value to a multiple of 1 / levels (many exact ties)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        t = torch.randn(*shape, generator=gen)
        return t if levels is None else torch.round(t * levels) / levels

    query = (r(n_req, n_exp, gdim) * scale, r(n_req, n_exp, ddim), r(n_req, n_exp) * scale)
    table = tuple(t.to(dtype) for t in (r(n_ads, gdim), r(n_ads, ddim), r(n_ads)))
    return query, table


def int8_problem(n_req, n_ads, n_exp, gdim, ddim, seed, scale=1.0):
    """(query, the 8-bit table, its dequantized fp32 table: what it scores as)."""
    query, table = random_problem(n_req, n_ads, n_exp, gdim, ddim, seed, torch.float32, scale)
    quantized = quantize_ad_table(*table)
    return query, quantized, quantized.dequantize()


def bf16_exact(tensors):
    """The values rounded to bf16, in their own dtype: every product of two is exact in fp32."""
    return tuple(t.to(torch.bfloat16).to(t.dtype) for t in tensors)


def as_table(table, dtype: str):
    """An fp32 (g, x, b) as the table a kernel reads: `dtype` bf16, fp16, fp32 or int8."""
    return (
        quantize_ad_table(*table) if dtype == "int8" else tuple(t.to(DTYPES[dtype]) for t in table)
    )


def scored(table):
    """The table as the reference scores it: an 8-bit table dequantized."""
    return table.dequantize() if isinstance(table, Int8Table) else table


def make_mask(kind, n_req, n_ads, seed):
    """Eligibility of the kinds every implementation is tested on."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "none": None,
        "shared": torch.rand(n_ads, generator=gen) < 0.5,
        "per-request": torch.rand(n_req, n_ads, generator=gen) < 0.5,
        "nothing": torch.zeros(n_ads, dtype=torch.bool),
        "everything": torch.ones(n_req, n_ads, dtype=torch.bool),
    }[kind]


def full_sort(query, table, mask, k):
    """The definition: every score (`rounded_score`), ineligible ones dropped, stable sort (lower
    row first)."""
    s = rounded_score(*query, *table)  # [B, N]
    k_out = min(k, s.shape[1])
    out_s, out_r = [], []
    for i in range(s.shape[0]):
        m = torch.ones(s.shape[1], dtype=torch.bool) if mask is None else mask.expand_as(s)[i]
        rows = torch.nonzero(m)[:, 0]
        vals, order = torch.sort(s[i, rows], descending=True, stable=True)
        vals, rows = vals[:k_out], rows[order[:k_out]]
        pad = k_out - len(rows)
        out_s.append(torch.cat([vals, torch.full((pad,), -math.inf)]))
        out_r.append(torch.cat([rows, torch.full((pad,), NO_ROW, dtype=torch.long)]))
    return torch.stack(out_s), torch.stack(out_r)


def assert_same(got, want):
    """Same rows; scores agree to fp32 evaluation noise (both evaluate §2, in another order)."""
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.long
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def assert_up_to_near_ties(got, want, exact):
    """Rows equal but for swaps of fp32 near-ties (`NEAR_TIE`); scores near the exact ones.

    exact: the reference scores [B, N] (`rounded_score`)."""
    (got_s, got_r), (_, want_r) = got, want
    assert got_r.shape == want_r.shape and got_s.dtype == torch.float32
    assert got_r.dtype == torch.long
    assert torch.equal(got_r == NO_ROW, want_r == NO_ROW)
    found = got_r != NO_ROW
    at_got = exact.gather(1, got_r.clamp(min=0))  # [B, K'] reference score of each returned row
    at_want = exact.gather(1, want_r.clamp(min=0))
    scale = torch.maximum(at_got.abs(), at_want.abs()).clamp(min=1)
    assert ((got_r == want_r) | ((at_got - at_want).abs() <= NEAR_TIE * scale))[found].all()
    close = (got_s == at_got) | ((got_s - at_got).abs() <= NEAR_TIE * scale)  # == for ±inf
    assert close[found].all()


def _bf16_products(native_bf16: bool):
    """The cpu kernel's product dtype for bf16 tables, whatever this CPU has (`_product_dtype`):
    bf16 products, or fp32 ones, as where bf16 arithmetic is emulated."""
    return mock.patch.object(bounds, "_native_bf16", lambda: native_bf16)


@dataclass(frozen=True)
class KernelPath:
    """One way to run the contract: a kernel (`score_topk`'s name) and, for the cpu kernel, one
    of its paths. `dtypes`: the tables it is run on (where the path differs from the others);
    `exact_rows`: it returns the reference's own scores (`rounded_score`), so its rows are the
    reference's exactly, where an fp32 evaluation may swap near-ties (`assert_up_to_near_ties`)."""

    name: str
    kernel: str
    dtypes: tuple[str, ...]
    way: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    exact_rows: bool = True
    max_dim: int = 1 << 30  # largest G or D it takes
    max_work: int = 1 << 60  # the largest problems it is run on, in B·N·E (request, ad, expert)

    def __str__(self) -> str:
        return self.name

    def __call__(self, query, table, mask, k, block=None, threads=2, **options):
        """The kernel's own entry point on (query, table): the cpu kernel in blocks of `block`
        ads over `threads` threads, the reference in chunks of `block` ads."""
        with self.way():
            return _call(self.kernel, query, table, mask, k, block, threads, **options)


def _call(kernel, query, table, mask, k, block, threads, **options):
    int8 = isinstance(table, Int8Table)
    if kernel == "torch":
        chunk = {} if block is None else {"chunk": block}
        return torch_score_topk(*query, *scored(table), mask, k, **chunk, **options)
    args = (table,) if int8 else tuple(table)
    if kernel == "cpu":
        fn = cpu_score_topk_int8 if int8 else cpu_score_topk
        return fn(*query, *args, mask, k, block=block, threads=threads, **options)
    from m31.ops.triton import triton_score_topk, triton_score_topk_int8

    fn = triton_score_topk_int8 if int8 else triton_score_topk
    return fn(*query, *args, mask, k, **options)


def interpreted() -> bool:
    """Triton kernels run under its interpreter (no GPU: conftest.py sets TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def assert_copies_in_row_order(rows: torch.Tensor, source: torch.Tensor, mask=None) -> None:
    """Byte-identical ads score alike on every kernel, so they tie in row order: of each ad's
    eligible copies (`source` [N]: the ad each row copies), a request gets the first ones, in
    row order. rows [B, K']; mask: bool [N] or [B, N] or None."""
    for i, got in enumerate(rows):
        got = got[got != NO_ROW]
        eligible = True if mask is None else mask.expand(len(rows), -1)[i]
        for ad in source[got].unique():
            copies = got[source[got] == ad]
            first = ((source == ad) & eligible).nonzero()[: len(copies), 0]
            assert torch.equal(copies, first), f"request {i}, the copies of ad {int(ad)}"


def _paths() -> list[KernelPath]:
    every = (*DTYPES, "int8")
    paths = [
        KernelPath("torch", "torch", every),
        KernelPath("cpu", "cpu", tuple(DTYPES), partial(_bf16_products, True)),
        KernelPath("cpu-fp32-products", "cpu", ("bf16",), partial(_bf16_products, False)),
    ]
    ways = {"compiled": "on", "compiled-plain": "plain", "torch-ops": "off"}
    if native.library() is None:  # no C compiler: the torch ops alone
        ways = {"torch-ops": "off"}
    paths += [
        KernelPath(f"cpu-{name}", "cpu", ("int8",), partial(native.use, way))
        for name, way in ways.items()
    ]
    if "triton" in available_kernels("cpu"):  # CUDA or TRITON_INTERPRET=1 (conftest.py)
        # interpreted on the CPU, a program at a time: small problems only
        small = {"max_work": 50_000} if interpreted() else {}
        paths.append(KernelPath("triton", "triton", every, exact_rows=False, max_dim=256, **small))
    return paths


PATHS = _paths()
PATH_TABLES = [
    pytest.param(path, dtype, id=f"{path}-{dtype}") for path in PATHS for dtype in path.dtypes
]
