"""The Triton kernel's own parts (under TRITON_INTERPRET=1 on CPU): the exact sort of a candidate
buffer filled in any order, the retries (a threshold too high, a buffer too small, a threshold
from a small sample), the gate folded into the query, its own arguments, the 8-bit table's
recall against bf16, and the real sm_90 binary compiled without a GPU. Its answers are held to
the reference with every other kernel's in test_score_topk (the contract).

Inputs are fp32 values that bf16 holds exactly, so the kernel's fp32 sums of exact products and
the reference score the same numbers and must return the same rows.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from score_topk_helpers import assert_same, bf16_exact, full_sort, make_mask, random_problem

from m31.ops import NO_ROW, quantize_ad_table, score
from m31.ops.reference import torch_score_topk
from m31.ops.triton import triton_score_topk, triton_score_topk_int8
from m31.ops.triton.score_topk import _exact_top


def problem(n_req, n_ads, n_exp, gdim, ddim, seed, levels=None):
    """(query, table) of bf16-exact fp32 values; `levels` makes few distinct values (ties)."""
    query, table = random_problem(
        n_req, n_ads, n_exp, gdim, ddim, seed, torch.float32, levels=levels
    )
    return (query, table) if levels is not None else (bf16_exact(query), bf16_exact(table))


@pytest.mark.parametrize(("n_req", "n_exp", "gdim"), [(3, 3, 4), (20, 2, 4), (2, 1, 0)])
def test_ties_survive_a_buffer_overflow(n_req, n_exp, gdim):
    # 7 distinct ads repeated over 300 rows: every score has 40+ exact ties, across tiles; a
    # buffer of 5 overflows on the first scan (the ties without it: test_score_topk)
    query, table = problem(n_req, 7, n_exp, gdim, 3, seed=3, levels=1)
    table = tuple(t.repeat(43, *([1] * (t.dim() - 1)))[:300] for t in table)
    want = full_sort(query, table, None, 100)
    assert_same(triton_score_topk(*query, *table, None, 100, _capacity=5), want)


def test_candidates_in_any_order_sort_by_score_then_row():
    # On a GPU the atomic counter fills the buffer in any order; the interpreter runs programs
    # in row order, so shuffle a buffer by hand. Slots past the count hold garbage.
    gen = torch.Generator().manual_seed(11)
    rows = torch.randperm(500, generator=gen)[:40].int()
    scores = torch.randint(0, 4, (40,), generator=gen).float()  # 4 values: ties everywhere
    buffer_s = torch.cat([scores, torch.full((5,), 9.0)])[None]  # [1, 45]
    buffer_r = torch.cat([rows, torch.zeros(5, dtype=torch.int32)])[None]
    got_s, got_r = _exact_top(torch.tensor([40]), buffer_s, buffer_r, 50, 500)
    order = sorted(range(40), key=lambda i: (-scores[i].item(), rows[i].item()))
    assert got_r[0, :40].tolist() == [rows[i].item() for i in order]
    assert got_s[0, :40].tolist() == [scores[i].item() for i in order]
    assert (got_r[0, 40:] == NO_ROW).all() and torch.isinf(got_s[0, 40:]).all()


def test_gate_folded_into_the_query_when_g_is_0():
    # G = 0 with E > 1: Σ_e softmax(p)_e v_e is rounded to bf16 once, so scores agree to bf16
    query, table = problem(5, 800, 3, 0, 16, seed=4)
    scores, rows = triton_score_topk(*query, *table, None, 50)
    exact = score(*query, *table)  # [B, N]
    torch.testing.assert_close(scores, exact.gather(1, rows), atol=0.05, rtol=1e-2)
    want_rows = full_sort(query, table, None, 50)[1]
    recall = [
        len(set(a) & set(b)) / 50 for a, b in zip(rows.tolist(), want_rows.tolist(), strict=True)
    ]
    assert min(recall) >= 0.9


def test_threshold_too_high_is_retried():
    query, table = problem(3, 900, 3, 8, 8, seed=5)
    mask = make_mask("per-request", 3, 900, seed=5)
    want = full_sort(query, table, mask, 60)
    assert_same(triton_score_topk(*query, *table, mask, 60, _tau=float("inf")), want)
    mixed = torch.tensor([float("inf"), 1e6, float("-inf")])  # -inf: everything survives
    assert_same(triton_score_topk(*query, *table, mask, 60, _tau=mixed), want)


def test_buffer_overflow_is_retried():
    query, table = problem(3, 900, 8, 8, 8, seed=6)
    want = full_sort(query, table, None, 60)
    assert_same(triton_score_topk(*query, *table, None, 60, _capacity=1), want)
    assert_same(triton_score_topk(*query, *table, None, 60, _capacity=1, _tau=float("-inf")), want)


def test_thresholds_from_a_small_sample():
    # 64 sampled ads of 3000: τ sits at a sample rank estimate instead of an exact count
    query, table = problem(4, 3000, 3, 8, 8, seed=7)
    mask = make_mask("shared", 4, 3000, seed=7)
    for k in (5, 200):
        want = full_sort(query, table, mask, k)
        assert_same(triton_score_topk(*query, *table, mask, k, _sample_rows=64), want)


@pytest.mark.parametrize(
    ("n_req", "n_exp", "gdim", "ddim", "mask_kind"),
    [(1, 8, 16, 16, "none"), (17, 3, 8, 5, "per-request"), (3, 1, 0, 12, "shared")],
)
def test_int8_threshold_too_high_is_retried(n_req, n_exp, gdim, ddim, mask_kind):
    query, table = problem(n_req, 700, n_exp, gdim, ddim, seed=9)
    int8 = quantize_ad_table(*table)
    mask = make_mask(mask_kind, n_req, 700, seed=9)
    want = torch_score_topk(*query, *int8.dequantize(), mask, 40)
    assert_same(triton_score_topk_int8(*query, int8, mask, 40, _tau=float("inf")), want)


def test_int8_recall_against_bf16():
    query, table = problem(4, 4000, 8, 32, 32, seed=10)
    k = 100
    bf16_rows = triton_score_topk(*query, *table, None, k)[1]
    int8_rows = triton_score_topk_int8(*query, quantize_ad_table(*table), None, k)[1]
    recall = sum(
        len(set(a) & set(b)) for a, b in zip(bf16_rows.tolist(), int8_rows.tolist(), strict=True)
    ) / (k * 4)
    print(f"int8 recall@{k} vs bf16 (B=4, N=4000, E=8, G=D=32, random normal): {recall:.3f}")
    assert recall >= 0.9


@pytest.mark.parametrize(
    ("change", "message"),
    [  # the arguments every kernel takes: test_score_topk.test_bad_arguments
        ({"g": torch.zeros(9, 4, dtype=torch.int8)}, "floating point"),
        ({"q": torch.zeros(2, 2, 300), "g": torch.zeros(9, 300)}, "G <= 256"),
        ({"v": torch.zeros(2, 2, 0), "x": torch.zeros(9, 0)}, "1 <= D"),
    ],
)
def test_bad_arguments(change, message):
    (q, v, p), (g, x, b) = problem(2, 9, 2, 4, 4, seed=0)
    kw = {"q": q, "v": v, "p": p, "g": g, "x": x, "b": b, "mask": None, "k": 3} | change
    with pytest.raises(ValueError, match=message):
        triton_score_topk(**kw)


COMPILE_FOR_HOPPER = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from m31.ops.triton.kernel import score_topk_kernel
from m31.ops.triton.launch import NUM_WARPS, pick_tiles

def compile_variant(n_req, n_exp, gdim, ddim, quant, mask_mode, table="*bf16", value=False):
    has_gate = gdim > 0 and n_exp > 1
    ep, gp, dp = (triton.next_power_of_2(n) for n in (n_exp, gdim, ddim))
    gp, dp = max(16, gp), max(16, dp)
    table = "*i8" if quant else table
    parts = {"*i8": 1, "*bf16": 1, "*fp16": 2, "*fp32": 3}[table]
    tiles = pick_tiles(n_req, ep, max(gp, dp), has_gate, parts - 1 + quant)
    ptr = dict(q_ptr="*bf16", v_ptr="*bf16", p_ptr="*fp32", g_ptr=table, x_ptr=table,
               b_ptr="*fp32", g_scale_ptr="*fp32", x_scale_ptr="*fp32", value_ptr="*fp32",
               bits_ptr="*i32",
               tau_ptr="*fp32", count_ptr="*i32", cand_score_ptr="*fp32", cand_row_ptr="*i32")
    ints = dict(n_req="i32", n_ads="i32", gate_dim="i32", value_dim="i32", stride_g="i64",
                stride_x="i64", stride_bits="i32", capacity="i32", gate_scale="fp32")
    const = dict(BB=tiles.bb, BN=tiles.bn, E=n_exp, EP=ep, GP=gp, DP=dp, HAS_GATE=has_gate,
                 STACKED=tiles.stacked, QUANT=quant, HAS_VALUE=value, MASK_MODE=mask_mode,
                 TP=parts, DOT=tl.bfloat16)
    signature = ptr | ints | {name: "constexpr" for name in const}
    src = ASTSource(score_topk_kernel, signature, constexprs=const)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": NUM_WARPS})
    assert "mma" in kernel.asm["ptx"], "no tensor-core instruction"

compile_variant(1, 8, 64, 64, False, 2)  # stacked
compile_variant(1, 8, 64, 64, False, 2, value=True)  # stacked, with a value column
compile_variant(64, 8, 64, 64, True, 1)  # online, int8
compile_variant(64, 8, 64, 64, True, 1, value=True)  # online, int8, with a value column
compile_variant(17, 3, 8, 5, False, 0)  # online, padded dims
compile_variant(5, 1, 0, 64, True, 2)  # gate folded away
compile_variant(1, 8, 64, 64, False, 0, "*fp16")  # stacked, an fp16 table in two bf16 parts
compile_variant(64, 8, 64, 64, False, 2, "*fp32")  # online, an fp32 table in three parts
compile_variant(5, 1, 0, 64, False, 1, "*fp16")  # gate folded away, an fp16 table
print("compiled")
"""


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter accepts more than the compiler: build the real sm_90 binary (ptxas)."""
    env = os.environ | {"TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COMPILE_FOR_HOPPER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
