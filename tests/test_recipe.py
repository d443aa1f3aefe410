"""What `m31 train` trains when no preset is named (`m31.training.recipe`): the sequence recipe
under the standard protocol for sequence files, the demo preset for data with a clock and
contexts, and no moe slots for a family whose inputs the dataset lacks; said when training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from m31.cli import app
from m31.data.importer import Interactions, import_dataset
from m31.model import model_preset
from m31.model.config import MODEL_KINDS
from m31.training.recipe import choose


def sequences(path: Path, users: int = 60, items: int = 40, seed: int = 0) -> Path:
    """A sequence file as the Amazon benchmarks' (`user item item ...`, oldest first)."""
    rng = np.random.default_rng(seed)
    lines = [
        " ".join(map(str, [u, *rng.choice(np.arange(1, items + 1), rng.integers(5, 12), False)]))
        for u in range(1, users + 1)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sequence_files_get_the_sequence_recipe_under_the_standard_protocol(tmp_path):
    import_dataset(tmp_path / "ds", sequences=sequences(tmp_path / "seq.txt"))
    recipe = choose(tmp_path / "ds", "moe")
    assert (recipe.preset, recipe.protocol, recipe.experts) == ("sasrec", "loo-position", None)
    assert "sequence files" in recipe.reasons[0]
    # a pair model reads 150 items and scores every item with its network: no protocol
    ranking = choose(tmp_path / "ds", "ranking")
    assert (ranking.preset, ranking.protocol) == ("sasrec", None)
    # the retrieval models learn with the softmax over every item; the pair models keep theirs
    assert "the softmax over every item" in recipe.reasons[0]
    losses = {kind: model_preset("sasrec", kind).loss for kind in MODEL_KINDS}
    assert losses == {"moe": "full", "two-tower": "full", "ranking": "softmax", "dense": "softmax"}


def test_a_clock_and_contexts_get_the_demo_preset(tiny_world):
    recipe = choose(tiny_world.folder, "moe")
    assert (recipe.preset, recipe.protocol, recipe.experts) == ("demo", None, None)


def test_families_without_inputs_get_no_slots(tmp_path):
    # Interactions with times and surfaces, but no item text and no user attributes.
    rng = np.random.default_rng(2)
    rows = ["user_id,item_id,ts,surface"] + [
        f"{u},{i},{1_700_000_000 + 3600 * n},{'feed' if n % 2 else 'search'}"
        for u in range(40)
        for n, i in enumerate(rng.choice(30, 8, replace=False))
    ]
    (tmp_path / "events.csv").write_text("\n".join(rows) + "\n")
    import_dataset(tmp_path / "ds", interactions=Interactions(tmp_path / "events.csv"))
    recipe = choose(tmp_path / "ds", "moe")
    assert recipe.preset == "demo" and recipe.protocol is None
    assert recipe.experts["semantic"] == 0 and recipe.experts["cohort"] == 0
    assert recipe.experts["sequence"] > 0
    assert any(r.startswith("no semantic slots: no item has text") for r in recipe.reasons)
    assert choose(tmp_path / "ds", "two-tower").experts is None  # a moe's slots only


def test_the_command_says_what_it_chose(tmp_path):
    import_dataset(tmp_path / "ds", sequences=sequences(tmp_path / "seq.txt"))
    out = tmp_path / "moe.pt"
    args = ["train", "--model", "moe", "--data", str(tmp_path / "ds"), "--out", str(out),
            "--epochs", "1", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "recipe: sequence files" in result.output
    assert "--protocol loo-position" in result.output
    import torch

    blob = torch.load(out, weights_only=False)
    cfg = blob["config"]
    assert cfg["sequence_encoder"] == "transformer" and cfg["max_len"] == 50
    assert cfg["val_metric"] == "ndcg@10" and cfg["val_requests"] == 0


def test_settings_are_parsed_strictly_as_their_fields():
    from m31.model.config import parse_settings

    got = parse_settings(["dropout=0.2", "hidden=128", "sequence_time=false", "loss=full",
                          "ranking_mlp=64,32"])  # fmt: skip
    assert got == {"dropout": 0.2, "hidden": 128, "sequence_time": False, "loss": "full",
                   "ranking_mlp": (64, 32)}  # fmt: skip
    for bad, message in [
        ("dropout", "expected NAME=VALUE"),
        ("nope=1", "expected NAME=VALUE with NAME one of"),
        ("experts=3", "expected NAME=VALUE with NAME one of"),  # its own option
        ("hidden=1.0", "hidden is an integer"),
        ("hidden=true", "hidden is an integer"),
        ("dropout=nan", "dropout is a finite number"),
        ("dropout=x", "dropout is a number"),
        ("sequence_time=1", "sequence_time is true or false"),
        ("ranking_mlp=64,", "ranking_mlp is integers separated by commas"),
    ]:
        with pytest.raises(ValueError, match=f"--set '{bad}': {message}"):
            parse_settings([bad])
    with pytest.raises(ValueError, match="hidden is set twice"):
        parse_settings(["hidden=32", "hidden=64"])


def test_the_command_takes_settings(tmp_path):
    import_dataset(tmp_path / "ds", sequences=sequences(tmp_path / "seq.txt"))
    out = tmp_path / "moe.pt"
    base = ["train", "--model", "moe", "--data", str(tmp_path / "ds"), "--out", str(out),
            "--epochs", "1", "--device", "cpu"]  # fmt: skip
    runner = CliRunner()
    result = runner.invoke(app, [*base, "--set", "dropout=0.2", "--set", "sequence_heads=1"])
    assert result.exit_code == 0, result.output
    import torch

    cfg = torch.load(out, weights_only=False)["config"]
    assert (cfg["dropout"], cfg["sequence_heads"], cfg["max_len"]) == (0.2, 1, 50)
    twice = runner.invoke(app, [*base, "--set", "epochs=2"])
    assert twice.exit_code == 2 and "--set epochs: also given as --epochs" in twice.output
    bad = runner.invoke(app, [*base, "--set", "dropout=1.5"])
    assert bad.exit_code != 0 and "dropout must lie in [0, 1)" in bad.output
