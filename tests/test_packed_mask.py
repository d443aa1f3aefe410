"""PackedMask: bitmaps with an index per request, as the index makes them, taken by every kernel
with the same answers as the bool mask they pack; pack/unpack at any offset."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from score_topk_helpers import assert_same, make_mask, random_problem

from m31.ops import PackedMask, available_kernels, quantize_ad_table, score_topk
from m31.ops.masks import _unpack_torch, pack, unpack


def packed(mask: torch.Tensor, shared_rows: int, seed: int) -> PackedMask:
    """mask [B, N] as a PackedMask whose bitmaps are shared: `shared_rows` distinct rows are
    repeated over B requests in a random order, with garbage in the bits past N."""
    gen = torch.Generator().manual_seed(seed)
    n_req, n = mask.shape
    distinct = mask[:shared_rows]
    index = torch.randint(0, shared_rows, (n_req,), generator=gen)
    bits = pack(distinct)
    wide = torch.cat([bits, torch.full((shared_rows, 3), 0xFF, dtype=torch.uint8)], dim=1)
    if n % 8:
        wide[:, bits.shape[1] - 1] |= torch.tensor(0xFF << (n % 8) & 0xFF, dtype=torch.uint8)
    return PackedMask(wide, index, n)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    lo=st.integers(0, 300),
    width=st.integers(0, 300),
    seed=st.integers(0, 99),
)
def test_rows_at_any_offset(n, lo, width, seed):
    lo, hi = min(lo, n), min(lo + width, n)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(5, n, generator=gen) < 0.4
    got = packed(mask, 3, seed)
    full = mask[:3][got.index]
    assert torch.equal(got.unpack(), full)
    assert torch.equal(got.rows(lo, hi), full[:, lo:hi])
    assert torch.equal(unpack(got.bits, hi - lo, lo), mask[:3, lo:hi])
    assert torch.equal(_unpack_torch(got.bits, hi - lo, lo), mask[:3, lo:hi])
    assert torch.equal(got.counts(), full.sum(1))  # the garbage past N is not counted
    pick = torch.tensor([4, 0, 0])
    assert torch.equal(got.select(pick).unpack(), full[pick])


def test_of_a_bool_mask_and_one_shared_bitmap():
    mask = make_mask("per-request", 4, 37, seed=1)
    assert torch.equal(PackedMask.of(mask).unpack(), mask)
    one = PackedMask(pack(mask[:1]), torch.zeros(4, dtype=torch.long), 37)
    assert torch.equal(one.rows(5, 30), mask[:1, 5:30].expand(4, -1))
    with pytest.raises(ValueError, match="bool"):
        PackedMask.of(mask[0])


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (
            PackedMask(torch.zeros(2, 2, dtype=torch.bool), torch.zeros(3, dtype=torch.long), 9),
            "uint8",
        ),
        (
            PackedMask(torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(3, dtype=torch.int32), 9),
            "int64",
        ),
        (
            PackedMask(torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(3, dtype=torch.long), 9),
            "2 bytes",
        ),
        (
            PackedMask(torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(3, dtype=torch.long), 8),
            "N = 9",
        ),
        (
            PackedMask(torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.long), 9),
            "B = 3",
        ),
        (PackedMask(torch.zeros(2, 2, dtype=torch.uint8), torch.tensor([0, 2, 1]), 9), r"\[0, 2\)"),
        (
            PackedMask(torch.zeros(2, 2, dtype=torch.uint8), torch.tensor([0, -1, 1]), 9),
            r"\[0, 2\)",
        ),
    ],
)
def test_malformed_masks_are_refused(mask, message):
    query, table = random_problem(3, 9, 2, 4, 4, seed=0, dtype=torch.float32)
    for kernel in available_kernels("cpu"):
        with pytest.raises(ValueError, match=message):
            score_topk(query, table, mask, 3, kernel=kernel)


@settings(max_examples=25, deadline=None)
@given(
    n_req=st.integers(1, 6),
    n_ads=st.integers(1, 500),
    shared=st.integers(1, 6),
    k=st.integers(1, 200),
    kind=st.sampled_from(["per-request", "nothing", "everything"]),
    dtype=st.sampled_from(["bf16", "fp32", "int8"]),
    seed=st.integers(0, 1000),
)
def test_every_kernel_answers_as_with_the_bool_mask(n_req, n_ads, shared, k, kind, dtype, seed):
    query, table = random_problem(n_req, n_ads, 3, 8, 8, seed, torch.float32)
    table = (
        quantize_ad_table(*table)
        if dtype == "int8"
        else tuple(t.to(torch.bfloat16) if dtype == "bf16" else t for t in table)
    )
    shared = min(shared, n_req)
    mask = packed(make_mask(kind, n_req, n_ads, seed).expand(n_req, n_ads), shared, seed)
    want = score_topk(query, table, mask.unpack(), k, kernel="torch")
    for kernel in available_kernels("cpu"):
        if kernel == "triton" and n_ads > 200:
            continue  # the interpreter is slow
        assert_same(score_topk(query, table, mask, k, kernel=kernel), want)


def test_triton_reads_packed_words_and_samples_them():
    """The Triton kernel's int32 words straight from the bitmaps, and its sampled threshold
    seeding from the packed bits (a sample smaller than the table)."""
    pytest.importorskip("triton")
    if "triton" not in available_kernels("cpu"):
        pytest.skip("the Triton interpreter is off")
    from m31.ops.triton import triton_score_topk
    from m31.ops.triton.layout import pack_mask

    mask = make_mask("per-request", 5, 203, seed=3)
    clean = PackedMask(pack(mask[:2]), torch.tensor([0, 1, 1, 0, 1]), 203)  # nothing past N
    assert torch.equal(pack_mask(clean), pack_mask(clean.unpack()))
    bits = packed(mask, 2, seed=4)  # set bits past N, which the kernel never reads
    one = PackedMask(pack(mask[:1]), torch.zeros(5, dtype=torch.long), 203)
    assert torch.equal(pack_mask(one), pack_mask(mask[0]))
    query, table = random_problem(5, 203, 3, 8, 8, seed=5, dtype=torch.float32)
    want = score_topk(query, table, bits.unpack(), 9, kernel="torch")
    assert_same(triton_score_topk(*query, *table, bits, 9, _sample_rows=17), want)
