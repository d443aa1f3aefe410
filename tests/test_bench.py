"""`m31 bench` on the CPU at tiny shapes: the kernels' CSV, the check, the engine, the baselines,
and a smoke run of every other subcommand (their figures are bench/RESULTS.md's: no speed here)."""

import csv
import importlib.util

import pytest
import torch

from m31.bench.baselines import (
    chunk_size,
    chunked_topk,
    compiled_gate_scores,
    gate_scores,
    two_tower_topk,
)
from m31.bench.cases import VARIANTS, canonical_cases
from m31.bench.check import CheckRow
from m31.bench.cli import main
from m31.bench.common import Limits, random_query, random_table
from m31.bench.engine import EngineTiming
from m31.bench.kernels import Timing, _Bench
from m31.bench.report import acceptance, ratios
from m31.ops import NO_ROW, score
from m31.ops.reference import torch_score_topk
from m31.ops.testing import check_topk

CPU = torch.device("cpu")
SUBCOMMANDS = (
    "kernels", "engine", "eligibility", "attribute-memory", "embedding-cache", "table-dtypes",
    "hierarchical", "cluster", "events",
)  # fmt: skip


def read_csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_timings_csv(tmp_path):
    variants = [v for v in VARIANTS if v != "compile"]  # compile: test_compile_baseline
    argv = ["kernels", "--device", "cpu", "--n", "5000", "--batches", "1,3", "--k", "100,1000"]
    argv += ["--variants", ",".join(variants), "--repeat", "2", "--budget", "0.5"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "bench.csv")
    assert list(rows[0]) == list(Timing.__dataclass_fields__)
    assert [(int(r["b"]), int(r["k"]), r["variant"]) for r in rows] == [
        (b, k, v) for b in (1, 3) for k in (100, 1000) for v in variants
    ]
    have_faiss = importlib.util.find_spec("faiss") is not None
    for r in rows:
        if r["variant"] == "faiss" and not have_faiss:
            assert r["status"] == "skipped" and "faiss" in r["note"]
            continue
        assert r["status"] == "ok", r
        assert (int(r["n"]), int(r["e"]), int(r["g"]), int(r["d"])) == (5000, 8, 64, 64)
        for col in ("median_ms", "ads_per_s", "pairs_per_s", "gb_per_s", "limit_pairs_per_s"):
            assert float(r[col]) > 0, (col, r)
        assert float(r["pairs_per_s"]) == pytest.approx(int(r["b"]) * float(r["ads_per_s"]))
        assert float(r["ads_per_s"]) == pytest.approx(5000 / (float(r["median_ms"]) / 1e3))
        assert 1 <= int(r["repeats"]) <= 2
        assert r["bound"] in ("memory", "compute")
        if r["variant"] == "kernel-int8":
            assert r["table"] == "int8"
            assert 0.5 < float(r["recall_vs_bf16"]) <= 1.0
        if r["variant"] == "kernel-int8-torch":
            assert (r["table"], r["impl"]) == ("int8", "cpu, torch ops only")
    md = (tmp_path / "bench.md").read_text()
    assert "every variant is held to the fastest of these" in md
    assert "| N | B | K | variant |" in md and "vs two-tower" in md and "time / K=100" in md
    assert "int8 compiled vs torch ops" in md
    assert (tmp_path / "bench.png").stat().st_size > 0 or "no PNG" in md


def test_check_passes(tmp_path):
    assert main(["kernels", "--device", "cpu", "--check", "--quick", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "bench.csv").exists()  # --check alone runs the check alone
    rows = read_csv(tmp_path / "check.csv")
    assert list(rows[0]) == list(CheckRow.__dataclass_fields__)
    assert {r["status"] for r in rows} == {"ok"}  # --quick: no case is too large to run
    ran = {(r["kernel"], r["table"]) for r in rows if r["status"] == "ok"}
    assert {("torch", "bf16"), ("torch", "int8"), ("cpu", "bf16"), ("cpu", "int8")} <= ran
    assert "recall@100 of the 8-bit table" in (tmp_path / "check.md").read_text()


def test_check_topk_catches_wrong_results():
    query = random_query(3, 4, 16, 16, CPU, seed=1)
    table, mask = random_table(500, 16, 16, CPU, seed=2)
    ref = torch_score_topk(*query, *table, mask, 20)
    assert check_topk(ref, ref, query, table, mask) is None
    dense = score(*query, *table)  # [B, N]
    s, r = (t.clone() for t in ref)
    r[0, 5] = int(dense[0].masked_fill(~mask, float("inf")).argmin())  # eligible, not top K
    assert "not its row's score" in check_topk((s, r), ref, query, table, mask)
    s, r = (t.clone() for t in ref)
    r[0, 5] = int((~mask).nonzero()[0])
    assert "ineligible" in check_topk((s, r), ref, query, table, mask)
    s, r = (t.clone() for t in ref)
    r[1, 2] = r[1, 3]  # a row twice
    assert "twice" in check_topk((s, r), ref, query, table, mask)
    s, r = (t.clone() for t in ref)
    s[2] = s[2] + 0.5  # scores that are not the rows' scores
    assert check_topk((s, r), ref, query, table, mask) is not None
    s, r = (t.clone() for t in ref)
    r[0, -1], s[0, -1] = NO_ROW, float("-inf")  # a result dropped
    assert "NO_ROW" in check_topk((s, r), ref, query, table, mask)


@pytest.mark.parametrize("chunk", [5000, 1024, 333])
def test_eager_and_two_tower_baselines_are_top_k(chunk):
    """The baselines compute the problem they are timed on (within bf16 rounding)."""
    query = random_query(3, 8, 64, 64, CPU, seed=3)
    table, mask = random_table(5000, 64, 64, CPU, seed=4)
    eager = chunked_topk(gate_scores, query, table, mask, 100, chunk)
    ref = torch_score_topk(*query, *table, mask, 100)
    assert check_topk(eager, ref, query, table, mask) is None
    s, r = two_tower_topk(query, table, mask, 100)
    assert mask[r].all() and (s[:, 1:] <= s[:, :-1]).all()
    u = query[1][:, 0, :].to(torch.bfloat16).float()
    dense = (u @ table[1].float().T).masked_fill(~mask, float("-inf"))  # [B, N]
    assert torch.allclose(s, dense.topk(100, dim=1).values, atol=2e-2)


@pytest.mark.slow
def test_compile_baseline(tmp_path):
    query = random_query(2, 8, 64, 64, CPU, seed=5)
    table, mask = random_table(3000, 64, 64, CPU, seed=6)
    got = chunked_topk(compiled_gate_scores(), query, table, mask, 50, 1000)
    ref = torch_score_topk(*query, *table, mask, 50)
    assert check_topk(got, ref, query, table, mask) is None
    argv = ["kernels", "--device", "cpu", "--n", "3000", "--batches", "2", "--variants", "compile"]
    assert main([*argv, "--repeat", "1", "--out", str(tmp_path)]) == 0
    (row,) = read_csv(tmp_path / "bench.csv")
    assert row["status"] == "ok" and float(row["pairs_per_s"]) > 0


def test_engine(tmp_path):
    argv = ["engine", "--device", "cpu", "--n", "20000", "--batches", "1,3"]
    argv += ["--dtype", "bfloat16,int8"]
    assert main([*argv, "--repeat", "1", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "bench.csv").exists()  # the engine alone
    rows = read_csv(tmp_path / "engine.csv")
    assert list(rows[0]) == list(EngineTiming.__dataclass_fields__)
    assert [(r["dtype"], int(r["b"])) for r in rows] == [
        ("bfloat16", 1), ("bfloat16", 3), ("int8", 1), ("int8", 3),
    ]  # fmt: skip
    assert "| int8 | 64 | 3 | – |" in (tmp_path / "engine.md").read_text()
    for r in rows:
        assert (int(r["n"]), int(r["e"]), int(r["g"]), int(r["d"])) == (20_000, 8, 64, 64)
        for col in ("median_ms", "ads_per_s", "encode_ms", "mask_ms", "score_topk_ms"):
            assert float(r[col]) > 0, (col, r)
        assert float(r["pairs_per_s"]) == pytest.approx(int(r["b"]) * float(r["ads_per_s"]))
        # the engine's own parts fit in the wall time of the call
        parts = sum(float(r[c]) for c in ("encode_ms", "mask_ms", "score_topk_ms"))
        assert parts <= 1.5 * float(r["median_ms"])


def test_engine_with_caps_and_a_folded_model(tmp_path):
    argv = ["engine", "--device", "cpu", "--n", "5000", "--batches", "2", "--max-per", "0,2"]
    argv += ["--gate-dims", "64,0", "--repeat", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = read_csv(tmp_path / "engine.csv")
    assert [(int(r["g"]), int(r["max_per"])) for r in rows] == [(64, 0), (64, 2), (0, 0), (0, 2)]
    assert "| bfloat16 | 0 (folded) | 2 | 2 |" in (tmp_path / "engine.md").read_text()
    with pytest.raises(SystemExit) as bad:
        main(["engine", "--max-per", "-1"])
    assert bad.value.code == 2


def test_chunk_size_and_canonical_plan():
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    assert chunk_size(10_000_000, 1, cuda) == 10_000_000
    assert chunk_size(10_000_000, 64, cuda) == 500_000
    assert chunk_size(10_000_000, 512, cuda) == 62_500
    assert chunk_size(100_000_000, 64, cuda) == 500_000  # same shape: compiled once
    assert chunk_size(1_000_003, 64, cuda) == (1 << 25) // 64  # a prime: ragged last chunk
    cases = canonical_cases()
    at_10m = {(c.b, c.k) for c in cases if c.n == 10_000_000 and c.variant == "kernel"}
    assert at_10m == {(b, k) for b in (1, 64, 512) for k in (100, 1000)}
    assert {c.b for c in cases if c.variant == "kernel-int8"} == {1, 64}
    assert {c.n for c in cases if c.b == 64 and c.k == 100 and c.variant == "reference"} == {
        1_000_000,
        10_000_000,
        100_000_000,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["kernels", "--variants", "kernel,bogus"],
        ["kernels", "--canonical", "--n", "1000"],
        ["kernels", "--n", "0"],
        ["kernels", "--budget", "0"],
        ["engine", "--dtype", "int4"],
        ["engine", "--dtype", "int8,int8"],
        ["engine", "--dtype", ""],
        ["engine", "--k", "0"],
        ["--check"],  # the options belong to a subcommand now
        ["eligibility", "--batches", "1,x"],
        ["events", "no/such/world"],
    ],
)
def test_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_bench_alone_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit):  # no subcommand: the help, as every m31 group answers
        main([])
    shown = "".join(capsys.readouterr())
    for name in SUBCOMMANDS:
        assert name in shown
        assert main([name, "--help"]) == 0


def test_acceptance_and_ratios():
    n = 10_000_000

    def row(b, k, variant, ms, recall=None):
        t = ms / 1e3
        shape = {"n": n, "b": b, "k": k, "e": 8, "g": 64, "d": 64}
        rates = {"median_ms": ms, "ads_per_s": n / t, "pairs_per_s": b * n / t}
        return Timing(
            "NVIDIA H200",
            **shape,
            variant=variant,
            impl="",
            table="",
            **rates,
            recall_vs_bf16=recall,
        )

    rows = [
        row(1, 100, "kernel", 0.7),  # 14.3 G ads/s
        row(1, 1000, "kernel", 1.2),  # 1.71x K = 100
        row(64, 100, "kernel", 5.0),  # 128 G pairs/s
        row(64, 100, "compile", 40.0),
        row(64, 1000, "kernel", 6.0),  # 1.2x
        row(64, 100, "kernel-int8", 4.0, recall=0.995),
        row(64, 100, "kernel-int8-torch", 10.0),
    ]
    assert acceptance(rows) == [
        "PASS  B = 1 ≥ 12 G ads/s: 14.3 G",
        "FAIL  B = 64 ≥ 150 G pairs/s: 128 G",
        "FAIL  B = 1: K = 1000 ≤ 1.5x K = 100: 1.71x",
        "PASS  B = 64: K = 1000 ≤ 1.5x K = 100: 1.20x",
        "info  B = 64 K = 100: 8-bit recall@K vs bf16 0.9950",
    ]
    by_shape = {(e["b"], e["k"]): e for e in ratios(rows)}
    assert by_shape[(64, 100)] == {
        "n": n,
        "b": 64,
        "k": 100,
        "vs compile": 8.0,
        "int8 vs bf16": 1.25,
        "int8 compiled vs torch ops": 2.5,
    }
    assert by_shape[(64, 1000)]["time / K=100"] == pytest.approx(1.2)


def test_on_a_cpu_every_variant_is_held_to_the_fastest_matrix_rate():
    """A CPU without bf16 or VNNI instructions runs torch's bf16 and int8 products far below its
    fp32 rate: the roofline takes the fastest rate measured, for every variant."""
    bench = _Bench(2000, 8, 16, CPU, measure=True, need_int8=True, seed=0)
    limits = bench.limits
    assert limits.matmul_fp32 and limits.matmul_int8
    fastest = max(limits.matmul_bf16, limits.matmul_fp32, limits.matmul_int8)
    assert limits.fastest_matmul == fastest
    for variant in ("kernel", "kernel-int8", "two-tower", "faiss"):
        assert bench.cost(variant)[3] == fastest, variant
    assert bench.cost("kernel-int8")[0] == 16 + 16 + 12  # an 8-bit row, its scales and bias
    assert bench.cost("kernel")[0] == 2 * (16 + 16) + 2


def test_the_baselines_multiply_in_the_faster_of_bf16_and_fp32():
    """Where fp32 products measured faster (a CPU without bf16 instructions) the eager, compile
    and two-tower baselines take an fp32 copy of the table, as the cpu kernel takes fp32
    products there; otherwise the bf16 table as the index keeps it."""
    bench = _Bench(3000, 4, 16, CPU, measure=False, need_int8=False, seed=0)
    query = random_query(2, 4, 16, 16, CPU, seed=1)
    for bf16_rate, fp32_rate, want in ((1e9, 2e9, torch.float32), (2e9, 1e9, torch.bfloat16)):
        bench.limits = Limits("made up", 1e10, bf16_rate, fp32_rate)
        table, name = bench.baseline_table()
        assert table[1].dtype == want and name == ("fp32" if want == torch.float32 else "bf16")
        assert torch.equal(table[1].float(), bench.table[1].float())  # the same values
        for variant in ("eager", "two-tower"):
            call, _, dtype = bench.runner(variant, query, 10)
            assert dtype == name
            scores, _ = call()
            want_scores = (
                chunked_topk(gate_scores, query, bench.table, bench.mask, 10, 3000)[0]
                if variant == "eager"
                else two_tower_topk(query, bench.table, bench.mask, 10)[0]
            )
            torch.testing.assert_close(scores, want_scores, rtol=1e-2, atol=1e-2)
        assert bench.cost("two-tower")[0] == table[1].element_size() * 16


def test_eligibility(capsys):
    assert main(["eligibility", "--n", "3k", "--batches", "1,2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "N = 3,000: index built" in out and "B = 2 (" in out and "score·top-K" in out


def test_attribute_memory(capsys):
    assert main(["attribute-memory", "--ads", "2000", "--new-tags", "50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2,000 ads, capacity 2,048, device cpu")
    assert "host memory per distinct value (traced)" in out and "contains filter on tags" in out


def test_embedding_cache(capsys):
    from m31.features import text_encoder

    encoder = text_encoder.encode_texts
    assert main(["embedding-cache", "--cached", "20", "--batch", "1,4", "--repeat", "2"]) == 0
    assert text_encoder.encode_texts is encoder  # the random vectors were the bench's alone
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("20 texts cached in")
    assert [line.split()[0] for line in lines[2:]] == ["1", "4"]


def test_table_dtypes(served_world, capsys):
    argv = ["table-dtypes", "--data", str(served_world.data), "--model", str(served_world.model)]
    assert main([*argv, "--requests", "10", "--k", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("10 test requests, K = 10")
    assert "| bfloat16 |" in out and "| int8 |" in out


def test_hierarchical(served_world, capsys):
    argv = ["hierarchical", "--data", str(served_world.data), "--model", str(served_world.model)]
    assert main([*argv, "--clusters", "4", "--requests", "5", "--k", "10"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1", "2", "4"]
    assert rows[-1][1] == "1.000"  # every cluster probed: the exhaustive answer


def test_events(served_world, capsys):
    argv = ["events", str(served_world.root), "--rate", "1000", "--rounds", "2"]
    assert main([*argv, "--per-round", "2", "--batch", "10"]) == 0
    assert "\n| 1,000 | " in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.ray  # Ray in this process (the run's, if up): with the tests on Ray (conftest)
def test_cluster(tmp_path):
    pytest.importorskip("ray")
    argv = ["cluster", "--n", "2000", "--batches", "2", "--shards", "2", "--k", "10"]
    argv += ["--experts", "2", "--dim", "8", "--repeat", "1", "--cpus", "2"]
    assert main([*argv, "--out", str(tmp_path / "cluster.md")]) == 0
    table = (tmp_path / "cluster.md").read_text()
    assert "| 2 | 2 |" in table and "| NO |" not in table
