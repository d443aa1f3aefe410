"""The command line as a user runs it: real commands, real files, exit codes and messages."""

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from m31.cli import app
from m31.data import dataset

runner = CliRunner()
SMALL = ["--preset", "tiny", "--users", "60", "--ads", "200", "--impressions", "2000"]


def run(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_generate_prints_summary_and_writes_a_dataset(tmp_path):
    code, out = run("world", "generate", "--out", str(tmp_path / "w"), *SMALL)
    assert code == 0, out
    assert "synthetic dataset: 60 users" in out and "by surface" in out
    ds = dataset.load(tmp_path / "w")
    assert ds.users.num_rows == 60 and ds.ads.num_rows == 200
    code, out = run("world", "summary", str(tmp_path / "w"), "--json")
    assert code == 0, out
    summary = json.loads(out)
    assert summary["counts"]["ads"] == 200
    mix = summary["interests"]  # a synthetic world's ground truth: how its best ads mix interests
    assert mix["users"] == 60 and 2 <= mix["facets_per_user"] <= 4
    assert set(mix["other_facet_share"]) == {"10", "100"}
    assert all(0 <= v <= 1 for v in mix["other_facet_share"].values())
    code, out = run("world", "summary", str(tmp_path / "w"))
    assert code == 0 and "a facet other than the heaviest wins" in out


def test_facet_weight_scale_is_recorded_and_checked(tmp_path):
    out_dir = tmp_path / "w"
    code, out = run("world", "generate", "--out", str(out_dir), *SMALL, "--facet-weight-scale", "0")
    assert code == 0, out
    assert dataset.load(out_dir).meta["config"]["facet_weight_scale"] == 0.0
    code, out = run("world", "generate", "--out", str(out_dir), "--reuse", *SMALL)
    assert code == 2 and "exists with other settings" in out
    # a world written before the setting existed is the default scale's, and is reused as such
    meta = json.loads((out_dir / "meta.json").read_text())
    del meta["config"]["facet_weight_scale"]
    (out_dir / "meta.json").write_text(json.dumps(meta))
    code, out = run("world", "generate", "--out", str(out_dir), "--reuse", *SMALL)
    assert code == 0 and "reusing" in out
    for bad in ("-1", "nan", "flat"):
        code, out = run(
            "world", "generate", "--out", str(tmp_path / "bad"), *SMALL, "--facet-weight-scale", bad
        )  # fmt: skip
        assert code == 2 and "facet" in out, (bad, out)
        if bad != "flat":  # not a number at all: the usage error of the option parser
            assert out.startswith("error: facet_weight_scale must be") and out.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_reuse_keeps_and_refuses(tmp_path):
    out_dir = str(tmp_path / "w")
    assert run("world", "generate", "--out", out_dir, *SMALL)[0] == 0
    before = (tmp_path / "w" / "events.parquet").stat().st_mtime_ns
    code, out = run("world", "generate", "--out", out_dir, "--reuse", *SMALL)
    assert code == 0 and "reusing" in out
    assert (tmp_path / "w" / "events.parquet").stat().st_mtime_ns == before
    code, out = run("world", "generate", "--out", out_dir, "--reuse", *SMALL, "--seed", "5")
    assert code == 2 and "exists with other settings" in out
    code, out = run("world", "generate", "--out", out_dir, *SMALL)
    assert code == 2 and "already exists" in out


def test_unknown_preset_is_one_line_error(tmp_path):
    code, out = run("world", "generate", "--out", str(tmp_path / "w"), "--preset", "huge")
    assert code == 2
    assert out.strip() == "error: unknown preset 'huge'; choose one of tiny, demo, bench"
    assert not (tmp_path / "w").exists()


def test_unwritable_output_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, out = run("world", "generate", "--out", str(blocker / "w"), *SMALL)
    assert code == 2 and str(blocker) in out and "cannot write there" in out
    assert out.count("\n") == 1


def test_movielens_errors_name_the_file(tmp_path):
    code, out = run(
        "data", "movielens", "--path", str(tmp_path / "nope"), "--out", str(tmp_path / "o")
    )
    assert code == 2 and str(tmp_path / "nope") in out
    (tmp_path / "ml").mkdir()
    (tmp_path / "ml" / "u.data").write_text("1\t1\t5\t880000000\n")
    code, out = run(
        "data", "movielens", "--path", str(tmp_path / "ml"), "--out", str(tmp_path / "o")
    )
    assert code == 2 and ("u.user" in out or "u.item" in out)
    assert not (tmp_path / "o").exists(), "no partial output"


def test_features_build_from_the_command_line(tmp_path):
    assert run("world", "generate", "--out", str(tmp_path / "w"), *SMALL)[0] == 0
    code, out = run(
        "features",
        "build",
        "--data",
        str(tmp_path / "w"),
        "--out",
        str(tmp_path / "f"),
        "--cache",
        str(tmp_path / "cache"),
        "--max-len",
        "5",
    )
    assert code == 0, out
    assert "split leave-last-out" in out
    code, out = run(
        "features",
        "build",
        "--data",
        str(tmp_path / "w"),
        "--out",
        str(tmp_path / "f"),
        "--split",
        "bogus",
        "--overwrite",
    )
    assert code == 2 and "split must be one of" in out


def test_console_script_exits_2_on_bad_input(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "m31.cli", "world", "summary", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path / 'missing'}: no such dataset folder"


@pytest.mark.parametrize("cmd", [["--help"], ["world", "--help"], ["features", "build", "--help"]])
def test_help(cmd):
    code, out = run(*cmd)
    assert code == 0 and "Usage" in out


@dataclass(frozen=True)
class Trained:
    """A tiny world and the checkpoints `m31 train` wrote for it, shared by the tests below."""

    data: Path
    runs: Path  # moe.pt, two-tower.pt, two-tower-s1.pt (a second seed), ranking.pt
    outputs: dict[str, str]  # checkpoint file -> what the command printed

    def __getitem__(self, name: str) -> str:
        return str(self.runs / name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    root = tmp_path_factory.mktemp("trained")
    data, runs = root / "w", root / "runs"
    code, out = run("world", "generate", "--out", str(data), "--preset", "tiny",
                    "--impressions", "15000")  # fmt: skip
    assert code == 0, out
    outputs = {}
    for kind, seed, out_file in (
        ("moe", 0, "moe.pt"),
        ("two-tower", 0, "two-tower.pt"),
        ("two-tower", 1, "two-tower-s1.pt"),
        ("ranking", 0, "ranking.pt"),
    ):
        code, outputs[out_file] = run(
            "train", "--model", kind, "--data", str(data), "--out", str(runs / out_file),
            "--preset", "tiny", "--epochs", "1", "--seed", str(seed),
        )  # fmt: skip
        assert code == 0, outputs[out_file]
    return Trained(data, runs, outputs)


def test_train_writes_checkpoints_and_keeps_the_features(trained):
    for out_file, out in trained.outputs.items():
        assert f"wrote {trained[out_file]}" in out and "FLOPs per (request, ad) pair" in out
    assert (trained.data / "features" / "leave-last-out" / "meta.json").is_file(), (
        "features kept for reuse"
    )


def _models(trained: Trained) -> list[str]:
    return [f"--model={k}={trained[f'{k}.pt']}" for k in ("moe", "two-tower", "ranking")]


def test_eval_models_side_by_side(trained, tmp_path):
    code, out = run(
        "eval", "--data", str(trained.data), *_models(trained), "--ks", "10,50",
        "--max-users", "60", "--plot", str(tmp_path / "recall.png"),
        "--pareto", str(tmp_path / "pareto.png"), "--pareto-metric", "truth_recall@50",
        "--json", str(tmp_path / "m.json"),
    )  # fmt: skip
    assert code == 0, out
    assert "60 test requests, 2,000 ads each" in out
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((tmp_path / "m.json").read_text())
    metrics = doc["means"]
    assert set(metrics) == {"moe", "two-tower", "ranking"}
    assert (
        metrics["ranking"]["ref_overlap@10"] == 1.0 and 0 <= metrics["moe"]["truth_recall@50"] <= 1
    )
    assert doc["std"]["moe"]["hr@10"] is None, "one seed: no standard deviation"
    assert [(p["a"], p["b"]) for p in doc["paired"]] == [("moe", "two-tower")]
    assert doc["paired"][0]["hr@10"]["requests"] == 60
    # on a synthetic world the truth recall is compared request by request too
    truth_pair = doc["paired"][0]["truth_recall@50"]
    assert truth_pair["mean_a"] == pytest.approx(metrics["moe"]["truth_recall@50"])
    assert truth_pair["mean_b"] == pytest.approx(metrics["two-tower"]["truth_recall@50"])
    assert truth_pair["diff_lo"] <= truth_pair["diff"] <= truth_pair["diff_hi"]
    assert "| truth_recall@10 |" in out
    assert (tmp_path / "recall.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_refuses_a_pareto_metric_it_does_not_measure(trained, tmp_path):
    code, out = run(
        "eval", "--data", str(trained.data), f"--model=moe={trained['moe.pt']}", "--ks", "10",
        "--max-users", "20", "--pareto", str(tmp_path / "p.png"), "--pareto-metric", "hr@50",
    )  # fmt: skip
    assert code != 0 and "--pareto-metric" in out and "hr@10" in out
    assert not (tmp_path / "p.png").exists()


def test_eval_seeds_baselines_and_chosen_pairs(trained, tmp_path):
    # Two seeds of the two-tower (a glob), baselines, a chosen pair.
    code, out = run(
        "eval", "--data", str(trained.data), f"--model=two-tower={trained['two-tower*.pt']}",
        f"--model=moe={trained['moe.pt']}", "--baselines", "popularity,item-knn",
        "--compare", "two-tower,popularity", "--compare", "moe,two-tower", "--ks", "10,50",
        "--max-users", "60", "--json", str(tmp_path / "m2.json"),
    )  # fmt: skip
    assert code == 0, out
    doc = json.loads((tmp_path / "m2.json").read_text())
    assert set(doc["means"]) == {"popularity", "item-knn", "two-tower", "moe"}
    assert len(doc["runs"]["two-tower"]) == 2 and doc["std"]["two-tower"]["hr@10"] is not None
    hr = [r["hr@10"] for r in doc["runs"]["two-tower"]]
    assert doc["means"]["two-tower"]["hr@10"] == pytest.approx(sum(hr) / 2)
    assert [(p["a"], p["b"]) for p in doc["paired"]] == [
        ("two-tower", "popularity"),
        ("moe", "two-tower"),
    ]
    assert "two-tower vs popularity" in out and "moe vs two-tower" in out
    assert doc["paired"][0]["hr@10"]["mean_a"] == pytest.approx(sum(hr) / 2)
    assert doc["paired"][1]["hr@10"]["mean_b"] == pytest.approx(sum(hr) / 2)
    tr = [r["truth_recall@10"] for r in doc["runs"]["two-tower"]]
    assert doc["paired"][0]["truth_recall@10"]["mean_a"] == pytest.approx(sum(tr) / 2)
    code, out = run(
        "eval", "--data", str(trained.data), f"--model=moe={trained['moe.pt']}", "--compare",
        "moe,nope", "--ks", "10", "--max-users", "20",
    )  # fmt: skip
    assert code == 2 and "--compare: need two evaluated models A,B, got 'moe,nope'" in out


def test_eval_records_join_later_evaluations(trained, tmp_path):
    # What one call scores, recorded, joins a later call as if scored there: the same table,
    # seeds and paired comparisons as one call over every checkpoint.
    common = ["--data", str(trained.data), "--ks", "10,50", "--max-users", "60"]
    tt0, tt1 = (f"--model=two-tower={trained[f]}" for f in ("two-tower.pt", "two-tower-s1.pt"))
    moe = f"--model=moe={trained['moe.pt']}"
    code, out = run(
        "eval", *common, moe, tt0, tt1, "--baselines", "popularity",
        "--json", str(tmp_path / "live.json"),
    )  # fmt: skip
    assert code == 0, out
    rec = tmp_path / "records"
    code, out = run("eval", *common, tt0, "--record", str(rec / "a.npz"))
    assert code == 0, out
    code, out = run(
        "eval", *common, tt1, "--baselines", "popularity", "--record", str(rec / "b.npz")
    )
    assert code == 0, out
    code, out = run(
        "eval", *common, moe, "--from-record", str(rec / "*.npz"), "--compare", "moe,two-tower",
        "--json", str(tmp_path / "joined.json"), "--pareto", str(tmp_path / "p.png"),
    )  # fmt: skip
    assert code == 0, out
    live, joined = (json.loads((tmp_path / f).read_text()) for f in ("live.json", "joined.json"))
    assert set(joined["means"]) == {"moe", "two-tower", "popularity"}
    assert len(joined["runs"]["two-tower"]) == 2
    for name in joined["means"]:
        assert joined["means"][name] == pytest.approx(live["means"][name], abs=1e-12), name
        assert joined["std"][name] == pytest.approx(live["std"][name], abs=1e-12), name
    assert joined["paired"] == live["paired"]  # the same per-request values, the same bootstrap
    assert joined["flops_per_pair"] == live["flops_per_pair"]
    assert joined["trainings"] == live["trainings"]  # each checkpoint's epochs, kept
    assert [t["file"] for t in live["trainings"]] == ["moe.pt", "two-tower.pt", "two-tower-s1.pt"]
    assert "best epoch 1 of 1 (validation hr@50 " in live["trainings"][0]["training"]
    assert "Trained:\n  moe (moe.pt): best epoch 1 of 1" in out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"

    from m31.eval.records import load_record
    from m31.model import load_checkpoint

    record = load_record(rec / "a.npz")
    assert [(r.model, r.source) for r in record.runs] == [("two-tower", "two-tower.pt")]
    assert record.runs[0].history == load_checkpoint(Path(trained["two-tower.pt"]))[1]["history"]
    assert record.runs[0].truth_recall is not None  # a synthetic world: compared on truth too
    assert [(r.model, r.source) for r in load_record(rec / "b.npz").runs] == [
        ("popularity", "baseline"),
        ("two-tower", "two-tower-s1.pt"),
    ]

    # records alone, no checkpoint at hand
    code, out = run("eval", *common, "--from-record", str(rec / "a.npz"))
    assert code == 0 and "| two-tower | 1 |" in out, out
    refusals = {
        "measured on other requests": ["--max-users", "50"],  # the last wins: other requests
        "not at every K of --ks": ["--ks", "10,20"],
        "two models under one name": [f"--model=two-tower={trained['moe.pt']}"],
        "a baseline is deterministic": ["--baselines", "popularity"],  # live and in b.npz
        "'two-tower' training of two-tower.pt, which is scored here already": [tt0],  # a.npz
    }
    for message, args in refusals.items():
        code, out = run("eval", *common, *args, "--from-record", str(rec / "[ab].npz"))
        assert code == 2 and message in out, (message, out)
    shutil.copy(rec / "a.npz", rec / "c.npz")  # one training's record twice
    code, out = run("eval", *common, "--from-record", str(rec / "*.npz"))
    assert code == 2 and "c.npz holds the 'two-tower' training of two-tower.pt" in out, out
    (tmp_path / "junk.npz").write_bytes(b"not a record")
    for path, message in (
        (tmp_path / "junk.npz", "not a readable m31 evaluation record"),
        (tmp_path / "none-*.npz", "no evaluation record matches"),
        (tmp_path / "missing.npz", "no such evaluation record"),
    ):
        code, out = run("eval", *common, "--from-record", str(path))
        assert code == 2 and message in out, (message, out)


def test_eval_two_stage(trained, tmp_path):
    models = _models(trained)
    # Two-stage, with a reference (the ranking model, one seed) beside two seeds of another.
    code, out = run(
        "eval", "--data", str(trained.data), *models, f"--model=tt={trained['two-tower*.pt']}",
        "--rerank", "moe,ranking,50", "--ks", "10,50", "--max-users", "60",
        "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert code == 0, out
    doc = json.loads((tmp_path / "r.json").read_text())
    means = doc["means"]
    assert means["moe>ranking"]["hr@50"] == pytest.approx(means["moe"]["hr@50"])  # same top 50
    assert len(doc["runs"]["tt"]) == 2 and len(doc["runs"]["ranking"]) == 1
    assert "ref_overlap@10" in doc["runs"]["tt"][1]  # the one ranking model served both rounds
    # --rerank-only: the ranking model scores the moe's candidates, never the whole corpus.
    code, out = run(
        "eval", "--data", str(trained.data), *models, "--rerank", "moe,ranking,50",
        "--rerank-only", "--ks", "10,50", "--max-users", "60", "--json", str(tmp_path / "ro.json"),
    )  # fmt: skip
    assert code == 0, out
    only = json.loads((tmp_path / "ro.json").read_text())
    assert "ranking" not in only["means"] and "ref_overlap@10" not in only["runs"]["moe"][0]
    assert only["means"]["moe>ranking"] == pytest.approx(
        {k: v for k, v in means["moe>ranking"].items() if not k.startswith("ref_")}
    )  # the same two-stage figures as above
    for args in (
        ["--rerank", "moe"], ["--rerank", "moe,ranking,x"], ["--rerank", "moe,nope"],
        ["--rerank-only"],
        ["--rerank", "moe,ranking", "--rerank-only", "--reference", "ranking"],
    ):  # fmt: skip
        code, out = run("eval", "--data", str(trained.data), *models, *args, "--max-users", "9")
        assert code == 2 and "--re" in out, (args, out)


def test_eval_refuses_unknown_baselines_and_missing_checkpoints(trained):
    code, out = run("eval", "--data", str(trained.data), "--baselines", "nope")
    assert code == 2 and "unknown baseline" in out
    code, out = run("eval", "--data", str(trained.data), f"--model={trained['missing.pt']}")
    assert code == 2 and "no such checkpoint" in out


def test_ablate(trained, tmp_path):
    data = str(trained.data)
    code, out = run(
        "ablate", "--data", data, "--model", trained["moe.pt"],
        f"--reference=two-tower={trained['two-tower*.pt']}", "--max-users", "60",
        "--plot", str(tmp_path / "ablation.png"), "--json", str(tmp_path / "a.json"),
        f"--retrained=again={trained['moe.pt']}", "--metric", "hr@100",
    )  # fmt: skip
    assert code == 0, out
    doc = json.loads((tmp_path / "a.json").read_text())
    # a "retrained" checkpoint that is the full model itself: the same figure, request by request
    again = doc["variants"]["again"]
    assert again["retrained"] and not doc["variants"]["full"]["retrained"]
    assert again["mean"] == doc["variants"]["full"]["mean"] > 0 and again["vs_full"]["ratio"] == 1
    assert doc["requests"] == 60 and doc["seeds"] == 1 and doc["metric"] == "hr@100"
    assert {"full", "uniform gate", "without cohort", "only semantic", "two-tower"} <= set(
        doc["variants"]
    )
    assert doc["variants"]["two-tower"]["std"] is not None  # two seeds of the reference
    assert doc["variants"]["uniform gate"]["vs_full"]["requests"] == 60
    assert (tmp_path / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    code, out = run("ablate", "--data", data, "--model", trained["two-tower.pt"])
    assert code == 2 and "not a moe" in out
    moe = ["ablate", "--data", data, "--model", trained["moe.pt"]]
    for args, message in (
        ([f"--retrained=tt={trained['two-tower.pt']}"], "is a two-tower checkpoint"),
        ([f"--retrained=full={trained['moe.pt']}"], "the name 'full' is taken"),
        ([f"--retrained={trained['moe.pt']}"], "--retrained: give NAME=CHECKPOINT"),
        (
            [f"--retrained=x={trained['moe.pt']}", f"--reference=x={trained['moe.pt']}"],
            "the name 'x' is taken",
        ),
    ):
        code, out = run(*moe, *args, "--max-users", "9")
        assert code == 2 and message in out, (args, out)
    code, out = run(*moe, "--metric", "auc")
    assert code == 2 and "--metric" in out


def test_simulate(trained, tmp_path):
    code, out = run(
        "simulate", "--data", str(trained.data), f"--retriever=two-tower={trained['two-tower.pt']}",
        f"--retriever=moe={trained['moe.pt']}", "--ranker", trained["ranking.pt"], "--k", "50",
        "--requests", "80", "--json", str(tmp_path / "f.json"),
    )  # fmt: skip
    assert code == 0, out
    funnel = json.loads((tmp_path / "f.json").read_text())
    assert funnel["requests"] == 80 and funnel["pairs"][0]["model"] == "moe"
    assert "moe vs two-tower" in out


def test_index_build(trained, tmp_path):
    from m31.index import AdIndex, read_manifest
    from m31.model import checkpoint_hash

    data, index_dir = str(trained.data), tmp_path / "index"
    code, out = run("index", "build", "--data", data, "--model", trained["moe.pt"],
                    "--out", str(index_dir))  # fmt: skip
    assert code == 0, out
    assert len(AdIndex.load(index_dir)) == 2_000
    assert read_manifest(index_dir)["model_hash"] == checkpoint_hash(trained["moe.pt"])
    code, out = run(
        "index", "build", "--data", data, "--model", trained["moe.pt"],
        "--out", str(tmp_path / "index8"), "--dtype", "int8",
    )  # fmt: skip
    assert code == 0 and "int8" in out, out
    assert AdIndex.load(tmp_path / "index8").dtype == torch.int8
    code, out = run("index", "build", "--data", data, "--model", trained["ranking.pt"],
                    "--out", str(tmp_path / "index2"))  # fmt: skip
    assert code == 2 and "no index can hold" in out
    code, out = run("index", "build", "--data", data, "--model", trained["moe.pt"],
                    "--out", str(index_dir))  # fmt: skip
    assert code == 2 and "exists" in out


def test_train_options_reach_the_checkpoint(trained, tmp_path):
    from m31.index import AdIndex

    def train_moe(name, *options):
        """Train a one-epoch moe with `options`; its checkpoint's config."""
        code, out = run(
            "train", "--model", "moe", "--data", str(trained.data), "--out", str(tmp_path / name),
            "--preset", "tiny", "--epochs", "1", *options,
        )  # fmt: skip
        assert code == 0, out
        return torch.load(tmp_path / name, map_location="cpu", weights_only=False)["config"]

    # A retrained ablation: the sequence family alone, two slots, a longer sequence.
    config = train_moe(
        "seq.pt", "--max-len", "13", "--lr", "0.004", "--experts",
        "sequence=2,cohort=0,semantic=0,coengagement=0",
    )  # fmt: skip
    assert config["experts"] == {"sequence": 2, "cohort": 0, "semantic": 0, "coengagement": 0}
    assert (config["max_len"], config["lr"]) == (13, 0.004)
    assert config["pool_sink"] is False
    # A stronger specialisation term on the gate; the pools' null key as before 2026-12-03.
    # (--resume: nothing to go on from, so it trains from the start; its one epoch used while
    # still gaining, its state stays for more)
    config = train_moe("bal.pt", "--balance-weight", "0.25", "--pool-sink", "--resume")
    assert config["balance_weight"] == 0.25 and config["pool_sink"] is True
    assert (tmp_path / "bal.pt.resume").is_file()
    # No per-ad routing (G = 0); such a moe indexes like any other.
    assert train_moe("g0.pt", "--gate-dim", "0")["gate_dim"] == 0
    code, out = run(
        "index", "build", "--data", str(trained.data), "--model", str(tmp_path / "g0.pt"),
        "--out", str(tmp_path / "index-g0"),
    )  # fmt: skip
    assert code == 0, out
    index_g0 = AdIndex.load(tmp_path / "index-g0")
    assert index_g0.get(int(index_g0.ids()[0])).g.shape == (0,)


def test_train_a_ranking_model_on_a_retrievers_output(trained, tmp_path):
    data = str(trained.data)
    # The ranking model with hard negatives from the moe's top ads.
    code, out = run(
        "train", "--model", "ranking", "--data", data, "--out", str(tmp_path / "hard.pt"),
        "--preset", "tiny", "--epochs", "1", "--hard-negatives", trained["moe.pt"],
        "--hard", "4", "--hard-pool", "50",
    )  # fmt: skip
    assert code == 0, out
    assert "hard negatives: 4 per request from the retriever's top 50" in out
    blob = torch.load(tmp_path / "hard.pt", map_location="cpu", weights_only=False)
    assert (blob["config"]["ranking_hard"], blob["config"]["ranking_hard_pool"]) == (4, 50)
    # The ranking model as a correction to the moe's score: epoch 0 is the moe alone.
    code, out = run(
        "train", "--model", "ranking", "--data", data, "--out", str(tmp_path / "res.pt"),
        "--preset", "tiny", "--epochs", "1", "--base", trained["moe.pt"],
    )  # fmt: skip
    assert code == 0, out
    assert "epoch 0 (the base alone)" in out
    blob = torch.load(tmp_path / "res.pt", map_location="cpu", weights_only=False)
    moe_blob = torch.load(trained["moe.pt"], map_location="cpu", weights_only=False)
    assert blob["config"]["ranking_base"] == moe_blob["config"]
    # it validates on the moe's top ads only: on as many requests as the moe
    assert blob["config"]["val_requests"] == moe_blob["config"]["val_requests"]
    assert [h["epoch"] for h in blob["history"]] == [0, 1]


def test_train_refuses_bad_options(trained, tmp_path):
    data, bad_pt = str(trained.data), str(tmp_path / "bad.pt")
    moe, ranking, nope = trained["moe.pt"], trained["ranking.pt"], trained["nope.pt"]
    poolless = ["--experts", "semantic=0", "--sequence-encoder", "transformer"]
    for args, message in (
        (["--model", "moe", "--base", moe], "takes a base"),
        (["--model", "two-tower", "--gate-dim", "0"], "the moe has a gate"),
        (["--model", "two-tower", "--balance-weight", "0.1"], "the moe's gate has the term"),
        (["--model", "ranking", "--base", ranking], "--base: "),
        (["--model", "ranking", "--base", nope], "no such"),
        (["--model", "moe", "--hard-negatives", moe], "trains the ranking"),
        (["--model", "ranking", "--hard", "4"], "go with --hard-negatives"),
        (["--model", "moe", *poolless, "--pool-sink"], "no attention pool"),
        (["--model", "ranking", "--hard-negatives", ranking], "is a ranking"),
        (["--model", "ranking", "--hard-negatives", nope], "no such"),
        (["--model", "ranking", "--hard-negatives", moe, "--hard", "0"], "must be >= 1"),
        (
            ["--model", "ranking", "--hard-negatives", moe, "--hard-pool", "1999"],
            "hard-negative pool",
        ),
    ):
        code, out = run(
            "train", "--data", data, "--out", bad_pt, "--preset", "tiny", "--epochs", "1", *args
        )
        assert code == 2 and message in out, (args, out)
    for bad, message in (
        ("sequence=x", "--experts"),
        ("nope=1", "--experts"),
        ("sequence=1,sequence=2", "twice"),
        ("sequence=0,cohort=0,semantic=0,coengagement=0", "at least one slot"),
    ):
        code, out = run(
            "train", "--model", "moe", "--data", data, "--out", bad_pt, "--experts", bad
        )
        assert code == 2 and message in out, (bad, out)
    for option, bad, message in (
        ("--max-len", "0", "max_len must be positive"),
        ("--max-len", "ten", "--max-len"),
        ("--lr", "0", "lr must be a positive finite number"),
        ("--lr", "nan", "lr must be a positive finite number"),
        ("--lr", "fast", "--lr"),
        ("--gate-dim", "-1", "--gate-dim must be >= 0"),
        ("--gate-dim", "wide", "--gate-dim"),
        ("--balance-weight", "-0.1", "balance_weight must be a finite number >= 0"),
        ("--balance-weight", "inf", "balance_weight must be a finite number >= 0"),
        ("--balance-weight", "much", "--balance-weight"),
    ):
        code, out = run("train", "--model", "moe", "--data", data, "--out", bad_pt, option, bad)
        assert code == 2 and message in out, (option, bad, out)
    assert not (tmp_path / "bad.pt").exists()
    code, out = run("train", "--model", "gbdt", "--data", data, "--out", str(tmp_path / "x.pt"))
    assert code == 2 and "kind must be one of" in out


def test_demo_runs_end_to_end_on_a_tiny_world(tmp_path):
    from m31.demo import run
    from m31.index import AdIndex, read_manifest

    lines = []
    out = run(tmp_path / "demo", log=lines.append, world="tiny", models_preset="tiny", epochs=1)
    text = "\n".join(str(x) for x in lines)
    assert "quality on" in text and "moe vs two-tower" in text and "M ads scored per second" in text
    assert set(out["quality"]) == {"moe", "two-tower"} and out["ads_per_s"] > 0
    assert "the funnel as an auction" in text and "value, max 2 per advertiser" in text
    assert len(out["auction"]["arms"]) == 4
    index = AdIndex.load(tmp_path / "demo" / "index")
    assert len(index) == 2_000 and read_manifest(tmp_path / "demo" / "index")["model_hash"]
    again = run(tmp_path / "demo", log=lines.append, world="tiny", models_preset="tiny", epochs=1)
    assert again["timings"]["train moe"] < out["timings"]["train moe"], "models are reused"
