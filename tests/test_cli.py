"""The command line as a user runs it: real commands, real files, exit codes and messages."""

import json
import subprocess
import sys

import pytest
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
    assert code == 0 and json.loads(out)["counts"]["ads"] == 200


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
