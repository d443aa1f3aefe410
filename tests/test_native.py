"""m31.ops.cpu.native: the cpu kernel's compiled helpers (cpu/csrc/), built with the real compiler.

Step 1 must return the torch path's survivors and affinities bit for bit, step 2 the same kept
pairs with bounds within fp32 rounding of the torch ops' (the bounds of the cpu kernel are
proved for any such evaluation, and for the compiled exponentials' stated error, checked here):
compared block by block on odd sizes and every mask kind, for this CPU's build (AVX-512 or AVX2
loops) and the plain one. The whole compiled pass (`m31_pass`) is checked end to end against the
definition in test_score_topk, and here for the threshold it shares between threads.
Then the loader: the cache, the switch, and what happens without a compiler or with a broken one.
"""

import fnmatch
import logging
import math
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from score_topk_helpers import assert_same, full_sort, int8_problem, make_mask, needs_exact_int8

from m31.ops import PackedMask, rounded_score, score
from m31.ops.cpu import cpu_score_topk_int8, native, native_pass
from m31.ops.cpu.bounds import affinity_offset
from m31.ops.cpu.int8 import plan_int8
from m31.ops.cpu.native import ptr
from m31.ops.cpu.native_pass import _mask_args, compiled_pass
from m31.ops.cpu.partition import block_spans
from m31.ops.cpu.stats import table_stats
from m31.ops.cpu.worker import Threshold, Worker
from m31.ops.masks import pack

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"

pytestmark = [
    needs_exact_int8,
    pytest.mark.skipif(native.library() is None, reason="no C compiler: the helpers are not built"),
]


def setup_block(n_req, n_ads, n_exp, gdim, ddim, mask_kind, seed):
    """(worker, plan) over one block of all n_ads, in torch ops (the definition the compiled
    helpers are held to), τ of each request at a random level near the scores' middle (they are
    of unit size), so that some pairs pass step 1 and some do not."""
    query, table, _ = int8_problem(n_req, n_ads, n_exp, gdim, ddim, seed=seed)
    if mask_kind.startswith("mostly-shared"):  # each request drops a tenth of a shared set
        gen = torch.Generator().manual_seed(seed)
        shared = torch.rand(n_ads, generator=gen) < 0.6
        mask = shared & (torch.rand(n_req, n_ads, generator=gen) < 0.9)
    else:
        kind = {"packed": "per-request", "packed-shared": "shared"}.get(mask_kind, mask_kind)
        mask = make_mask(kind, n_req, n_ads, seed)
    if mask_kind in ("packed", "mostly-shared-packed"):
        mask = PackedMask.of(mask)
    elif mask_kind == "packed-shared":  # one bitmap for every request
        mask = PackedMask(pack(mask[None]), torch.zeros(n_req, dtype=torch.int64), n_ads)
    plan = plan_int8(*query, 5)
    stats = table_stats(table.g, table.x, table.b, table.g_scale, table.x_scale)
    shared = Threshold(n_req, 1, plan.u_scan)
    level = torch.randn(n_req, generator=torch.Generator().manual_seed(seed)) * 0.1
    shared.offer(torch.arange(n_req), level)
    worker = Worker(plan, table, stats, mask, shared, block=n_ads)
    worker.refine_pairs = math.inf  # keep step 1's survivors pending
    return worker, plan


def compiled_scan(lib, worker, n_ads):
    """`m31_scan_int8` on the worker's block of all n_ads: (req, row, Â [E, S])."""
    plan, stats, table = worker.plan, worker.stats, worker.table
    offset = affinity_offset(plan, stats.x_norm, stats.scan_bias)
    tau = worker.shared.for_scan.contiguous()
    mode, data, stride, index = _mask_args(worker.mask)
    cap = plan.n_req * n_ads + 3  # a stride that is not the count
    req, ad = torch.empty(cap, dtype=torch.long), torch.empty(cap, dtype=torch.long)
    aff = torch.empty(plan.n_exp, cap)
    count = lib.m31_scan_int8(
        ptr(table.x), ptr(table.x_scale), ptr(offset), n_ads, table.x.shape[1], ptr(plan.v_int),
        ptr(plan.v_scale), ptr(tau), plan.n_req, plan.n_exp, mode, ptr(data), stride, ptr(index),
        0, ptr(req), ptr(ad), ptr(aff), cap,
    )  # fmt: skip
    return req[:count], ad[:count], aff[:, :count]


def compiled_step2(lib, worker, req, row, aff, tau):
    """`m31_step2` on pairs (req, row) with step 1's Â [E, S]: (req, row, ℓ, h) kept."""
    plan, stats, table = worker.plan, worker.stats, worker.table
    n_pairs = len(req)
    out = [torch.empty(n_pairs, dtype=torch.long) for _ in range(2)]
    out += [torch.empty(n_pairs) for _ in range(2)]
    count = lib.m31_step2(
        ptr(table.g), ptr(table.g_scale), table.g.shape[1], ptr(plan.q_int), ptr(plan.q_scale),
        ptr(plan.p_t), plan.n_req, plan.n_exp, ptr(plan.coef), ptr(stats.per_ad),
        len(stats.scan_bias), plan.p_abs_max + math.log(plan.n_exp), plan.eta_l, plan.kappa,
        1 + plan.u_a, plan.u_a + 2 * plan.kappa, ptr(req), ptr(row), ptr(aff.contiguous()),
        n_pairs, n_pairs, ptr(tau.contiguous()), *map(ptr, out),
    )  # fmt: skip
    return tuple(t[:count] for t in out)


def by_pair(req, row, *values, n_ads):
    order = torch.argsort(req * n_ads + row)
    return (req[order], row[order], *(v[..., order] for v in values))


CASES = [  # n_req, n_ads, n_exp, gdim, ddim, mask
    (1, 1000, 8, 64, 64, "shared"),
    (3, 999, 5, 33, 65, "per-request"),
    (5, 130, 3, 0, 7, "none"),  # a block of 2 x 64 ads and 2 more
    (4, 200, 1, 1, 1, "packed"),
    (2, 333, 6, 200, 580, "packed"),  # D past the registers: plain loops inside the AVX build
    (64, 67, 8, 16, 16, "per-request"),
    # AVX2 takes rows of a multiple of 16 values, up to 192, eight experts at a time
    (3, 130, 12, 48, 32, "shared"),  # E = 8 + 4: the second round repeats its last expert
    (2, 200, 3, 32, 48, "per-request"),
    (2, 101, 8, 192, 208, "none"),  # G in registers, D past them
    # AVX2, from 4 requests that share their eligible ads: the tiled scan (ads in the lanes)
    (4, 1000, 8, 64, 64, "shared"),
    (64, 301, 8, 64, 64, "packed-shared"),
    (5, 259, 9, 16, 32, "none"),  # E = 4 + 4 + 1, 259 ads: tiles of every fill
    (6, 150, 3, 8, 192, "shared"),  # E = 3: one expert at a time; the longest tiled row
    (4, 90, 2, 8, 208, "packed-shared"),  # D past the tiled rows: the per-pair scan
    # requests with their own masks: a tile of 64 is tiled when they want most of its ads
    (6, 500, 8, 64, 64, "mostly-shared"),
    (5, 300, 5, 32, 32, "mostly-shared-packed"),
    (64, 130, 8, 64, 64, "per-request"),  # half of each: one by one inside the tiled scan
]


@pytest.mark.parametrize("way", ["on", "plain"])
@pytest.mark.parametrize(("n_req", "n_ads", "n_exp", "gdim", "ddim", "mask_kind"), CASES)
def test_step_1_is_the_torch_ops_bit_for_bit(n_req, n_ads, n_exp, gdim, ddim, mask_kind, way):
    worker, _ = setup_block(n_req, n_ads, n_exp, gdim, ddim, mask_kind, seed=n_ads)
    with native.use(way):
        got = compiled_scan(native.library(), worker, n_ads)
    worker.scan(0, n_ads)
    assert len(worker.pending) == 1
    want_req, want_row, _, want_aff, _ = worker.pending[0]
    assert 0 < len(want_req) < n_req * n_ads  # τ filters some pairs, not all
    # the same pairs in the same order (by request, then ad), with the same affinities
    for w, g in zip((want_req, want_row, want_aff), got, strict=True):
        assert torch.equal(w, g)


@pytest.mark.parametrize("way", ["on", "plain"])
@pytest.mark.parametrize(("n_req", "n_ads", "n_exp", "gdim", "ddim", "mask_kind"), CASES)
def test_step_2_keeps_the_pairs_of_the_torch_ops_and_bounds_every_score(
    n_req, n_ads, n_exp, gdim, ddim, mask_kind, way
):
    """Step 2's s̃ ± ε is an fp32 evaluation of its own (sums over E in expert order, its own
    exponentials), which the proof of the bounds allows for: the same pairs kept, ℓ and h
    within fp32 rounding of the torch ops', and with τ = -inf every pair's exact and fp32 score
    inside [ℓ, h]."""
    worker, _ = setup_block(n_req, n_ads, n_exp, gdim, ddim, mask_kind, seed=n_ads + 1)
    worker.scan(0, n_ads)
    req, row, _, aff, _ = worker.pending[0]  # the same survivors for both (step 1 is tested above)
    n_pairs = len(req)
    with native.use(way):
        lib = native.library()
        got = by_pair(*compiled_step2(lib, worker, req, row, aff, worker.shared.for_refine),
                      n_ads=n_ads)  # fmt: skip
        everything = compiled_step2(lib, worker, req, row, aff, torch.full((n_req,), -math.inf))
    want = by_pair(*worker.bounds(), n_ads=n_ads)
    assert 0 < len(want[0]) < len(req) or n_exp == 1  # τ drops some (E = 1: step 1 is as tight)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for w, g in zip(want[2:], got[2:], strict=True):
        torch.testing.assert_close(g, w, rtol=2**-20, atol=2**-20 * float(w.abs().max()))
    # every pair, no threshold: [ℓ, h] holds the fp32 score and the exact one
    req, row, lower, upper = everything
    assert len(req) == n_pairs
    query, _, dequantized = int8_problem(n_req, n_ads, n_exp, gdim, ddim, seed=n_ads + 1)
    for scores in (score(*query, *dequantized), rounded_score(*query, *dequantized)):
        s = scores[req, row]
        assert ((lower <= s) & (s <= upper)).all()


@pytest.mark.parametrize("way", ["on", "plain"])
def test_the_compiled_exponentials_are_within_their_stated_error(way):
    """exp_f: within a relative 2⁻¹⁹ of e^l on [-86, 88] (the proof in step2.c; `_EXP_ETA`),
    below 2⁻¹²⁴ under -86, 1 at 0; expm1_f: within 2⁻¹⁵ of e^y - 1 for y ≥ 0, 0 at 0. Checked
    against fp64 on a dense grid."""
    with native.use(way):
        lib = native.library()

    def run(values, which):
        values = values.float().contiguous()
        out = torch.empty_like(values)
        lib.m31_exp(ptr(values), ptr(out), len(values), which)
        return values.double(), out.double()

    grid = torch.cat([torch.linspace(-86, 88, 2_000_001), torch.tensor([0.0, -1e-30, 1e-30])])
    logit, got = run(grid, 0)
    assert float(((got - logit.exp()) / logit.exp()).abs().max()) <= 2**-19
    assert float(got[-3]) == 1.0
    _, got = run(torch.linspace(-120, -86.0001, 10_001), 0)
    assert ((got >= 0) & (got < 2**-124)).all()
    y = torch.cat([torch.linspace(0, 1 / 16, 100_001), torch.linspace(1 / 16, 88, 1_000_001)])
    y, got = run(torch.cat([y, torch.tensor([1e-30, 1e-8])]), 1)
    want = torch.expm1(y)
    assert got[0] == 0 and float(((got - want) / want)[1:].abs().max()) <= 2**-15


def test_every_way_gives_the_definition_on_large_logits():
    """Gate logits large enough that a pair's logits are shifted before the exponential."""
    query, table, dequantized = int8_problem(3, 800, 4, 8, 8, seed=3, scale=12.0)
    mask = make_mask("per-request", 3, 800, seed=4)
    for way in ("on", "plain", "off"):
        with native.use(way):
            got = cpu_score_topk_int8(*query, table, mask, 25, block=128, threads=2)
        assert_same(got, full_sort(query, dequantized, mask, 25))


def test_the_builds_and_the_switch(monkeypatch):
    assert native.library().m31_simd() in (b"avx512", b"avx2", b"plain")
    with native.use("plain"):
        assert native.library().m31_simd() == b"plain"
    with native.use("off"):
        assert native.library() is None
    monkeypatch.setenv("M31_NATIVE", "0")
    assert native.library() is None
    with native.use("on"):  # the override wins over the environment
        assert native.library() is not None
    monkeypatch.setenv("M31_NATIVE", "plain")
    assert native.library().m31_simd() == b"plain"
    monkeypatch.setenv("M31_NATIVE", "maybe")
    with pytest.raises(ValueError, match="M31_NATIVE must be one of"):
        native.library()
    with pytest.raises(ValueError, match="wanted must be"), native.use("fast"):
        pass


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty cache folder and a loader that has built nothing yet in this process."""
    monkeypatch.setenv("M31_CACHE", str(tmp_path))
    monkeypatch.delenv("M31_NATIVE", raising=False)
    native._build.cache_clear()
    yield tmp_path / "native"
    native._build.cache_clear()


def test_the_library_is_built_once_per_source(fresh_build, monkeypatch, tmp_path_factory):
    lib = native.library()
    assert lib is not None
    built = sorted(fresh_build.glob("m31_cpu_native-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native._build.cache_clear()
    assert native.library() is not None  # a new process: loads the cached build
    assert built[0].stat().st_mtime_ns == stamp
    assert sorted(fresh_build.glob("m31_cpu_native-*.so")) == built
    changed = tmp_path_factory.mktemp("src") / "csrc"
    shutil.copytree(native.SOURCES, changed)
    with open(changed / "native.h", "a") as header:  # a file that is on no command line
        header.write("\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCES", changed)
    native._build.cache_clear()
    assert native.library() is not None
    assert len(list(fresh_build.glob("m31_cpu_native-*.so"))) == 2  # a changed file, a new build
    assert not list(fresh_build.glob("*.tmp*")) and len(list(fresh_build.iterdir())) == 2


def test_every_source_file_is_hashed_and_shipped(tmp_path, monkeypatch):
    """The build's name covers every .c and .h file of the folder, each byte of each: a change
    in any of them, or a file more, is a new build. And the package data ships them all."""
    package_data = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]
    cpu = native.SOURCES.parent
    for path in native._source_files():
        name = path.relative_to(cpu).as_posix()
        assert any(fnmatch.fnmatch(name, pattern) for pattern in package_data["m31.ops.cpu"]), name
    folder = tmp_path / "csrc"
    shutil.copytree(native.SOURCES, folder)
    monkeypatch.setattr(native, "SOURCES", folder)
    files = native._source_files()
    assert {"native.h", "scan.c", "step2.c", "pass.c"} <= {path.name for path in files}
    original = native._source_digest()
    seen = {original}
    for path in files:
        text = path.read_bytes()
        for at in (0, len(text) // 2, len(text) - 1):  # one byte changed, anywhere in the file
            path.write_bytes(text[:at] + bytes([text[at] ^ 1]) + text[at + 1 :])
            seen.add(native._source_digest())
        path.write_bytes(text)
    assert len(seen) == 1 + 3 * len(files)
    assert native._source_digest() == original
    (folder / "more.c").write_text("")
    assert native._source_digest() not in seen


@pytest.mark.parametrize(
    ("compiler", "message"),
    [("no-such-compiler-m31", "no C compiler"), ("false", "failed")],
)
def test_without_a_working_compiler_the_torch_path_answers(
    fresh_build, monkeypatch, caplog, compiler, message
):
    monkeypatch.setenv("CC", compiler)
    with caplog.at_level(logging.WARNING, logger="m31.ops.cpu.native"):
        assert native.library() is None
        assert native.library() is None  # said once
    assert [r.message for r in caplog.records if message in r.message] and len(caplog.records) == 1
    assert not list(fresh_build.glob("*"))  # nothing half-built left behind
    query, table, dequantized = int8_problem(2, 500, 3, 8, 8, seed=9)
    mask = make_mask("shared", 2, 500, seed=9)
    got = cpu_score_topk_int8(*query, table, mask, 10)
    assert_same(got, full_sort(query, dequantized, mask, 10))


def test_the_helpers_refuse_strided_tensors():
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        native.ptr(torch.zeros(4, 4).T)


def test_more_experts_than_the_stack_scratch_take_the_torch_ops(monkeypatch):
    monkeypatch.setattr(native_pass, "_MAX_EXPERTS", 4)

    def refuse(*args):
        raise AssertionError("the compiled pass ran")

    monkeypatch.setattr(native_pass, "compiled_pass", refuse)
    query, table, dequantized = int8_problem(2, 300, 5, 8, 8, seed=1)
    mask = make_mask("shared", 2, 300, seed=1)
    got = cpu_score_topk_int8(*query, table, mask, 7, block=64)
    assert_same(got, full_sort(query, dequantized, mask, 7))


@pytest.mark.parametrize(("n_req", "k", "threads", "block"), [(1, 50, 2, 256), (7, 13, 2, 128),
                                                              (3, 1, 1, 512), (2, 400, 2, 64)])  # fmt: skip
def test_the_compiled_pass_shares_a_threshold_that_is_valid_and_tight(n_req, k, threads, block):
    """τ that the workers of `m31_pass` share (the K largest lower bounds, per request): never
    above the K-th best score (every ad that reaches it is kept), and close below it (it
    prunes); the candidates hold every ad that scores at least the K-th best."""
    n_ads = 3000
    query, table, dequantized = int8_problem(n_req, n_ads, 4, 8, 16, seed=k)
    mask = make_mask("per-request", n_req, n_ads, seed=k)
    plan = plan_int8(*query, k)
    stats = table_stats(table.g, table.x, table.b, table.g_scale, table.x_scale)
    spans = block_spans(n_ads, block)
    lib = native.library()
    req, row, _, tau = compiled_pass(lib, plan, table, stats, mask, spans, block, threads)
    scores = rounded_score(*query, *dequantized).masked_fill(~mask, -math.inf)  # [B, N]
    kth = scores.topk(k, dim=1).values[:, -1]  # [B]
    assert (tau <= kth).all()
    assert (kth - tau <= 1e-3 * (1 + kth.abs())).all()
    for r in range(n_req):
        want = set((scores[r] >= kth[r]).nonzero()[:, 0].tolist())
        assert want <= set(row[req == r].tolist())
    assert len(req) < n_req * n_ads / 4  # the filters dropped most pairs
