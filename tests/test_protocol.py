"""The standard sequential protocol (`m31 eval --protocol loo-position`, `m31.eval.protocol`) on
a tiny sequence file with hand-checked ranks: the last item test, the one before it validation,
every item ranked, the user's history excluded, ties to the lower item row; and training that
selects its epoch under it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from m31.cli import app
from m31.data import dataset
from m31.data.importer import Items, import_dataset
from m31.eval import evaluate
from m31.eval.baselines import make_baselines
from m31.eval.protocol import PROTOCOLS, protocol
from m31.features import FeatureConfig, build_features
from m31.model import Catalog, model_preset
from m31.training import train
from m31.training.train import _validate

LOO = PROTOCOLS["loo-position"]

# Items 1..6; leave-one-out by position:
#   user 1: train 1 2,   val 3, test 4
#   user 2: train 2 3,   val 5, test 1
#   user 3: train 3 2 6, val 4, test 5
# Train popularity: item 1: 1, 2: 3, 3: 2, 4: 0, 5: 0, 6: 1.
SEQUENCES = "1 1 2 3 4\n2 2 3 5 1\n3 3 2 6 4 5\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("loo")
    (tmp / "seq.txt").write_text(SEQUENCES)
    # the catalogue lists the items in id order, so item i is row i - 1
    attrs = {str(i): [i % 2] for i in range(1, 7)}
    (tmp / "attrs.json").write_text(json.dumps(attrs))
    import_dataset(tmp / "ds", sequences=tmp / "seq.txt", items=Items(tmp / "attrs.json"))
    return tmp / "ds"


@pytest.fixture(scope="module")
def feats(folder):
    return build_features(dataset.load(folder), FeatureConfig(text_embeddings=False))


def test_the_split_is_leave_one_out_by_position(feats):
    ids = feats.ads["ad_id"]
    assert ids.tolist() == [1, 2, 3, 4, 5, 6]
    for name, items in (("test", [4, 1, 5]), ("val", [3, 5, 4])):
        split = feats.splits[name]
        order = np.argsort(feats.users["user_id"][split["user"]])
        assert ids[split["item"][order]].tolist() == items
    assert sorted(ids[feats.splits["train"]["item"]].tolist()) == [1, 2, 2, 2, 3, 3, 6]


def test_hand_checked_ranks_exclude_the_history_and_break_ties_by_row(feats):
    pop = make_baselines(["popularity"], feats)
    metrics, ranks = evaluate(
        pop, feats, split="test", ks=LOO.ks, exclude_seen=LOO.exclude_history, return_ranks=True
    )
    user = feats.users["user_id"][feats.splits["test"]["user"]]
    got = dict(zip(user.tolist(), ranks["popularity"].tolist(), strict=True))
    # user 1 (history 1 2 3, target 4): 6 (1), then 4 and 5 tie at 0, 4 the lower row: rank 1
    # user 2 (history 2 3 5, target 1): 1 and 6 tie at 1, 1 the lower row: rank 0
    # user 3 (history 3 2 6 4, target 5): 1 (1), then 5: rank 1
    assert got == {1: 1, 2: 0, 3: 1}
    ndcg = (2 / math.log2(3) + 1) / 3
    m = metrics["popularity"]
    assert m["hr@5"] == m["hr@10"] == m["hr@20"] == 1.0
    assert m["ndcg@5"] == pytest.approx(ndcg) and m["ndcg@20"] == pytest.approx(ndcg)
    # without the exclusion the history ranks first: user 1's 4 comes after 2, 3, 1 and 6
    _, kept = evaluate(pop, feats, split="test", ks=LOO.ks, exclude_seen=False, return_ranks=True)
    assert dict(zip(user.tolist(), kept["popularity"].tolist(), strict=True))[1] == 4


def test_the_command_applies_the_protocol(folder, tmp_path):
    runner = CliRunner()
    out = tmp_path / "m.json"
    args = ["eval", "--data", str(folder), "--protocol", "loo-position",
            "--baselines", "popularity", "--json", str(out)]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    means = json.loads(out.read_text())["means"]["popularity"]
    assert sorted(means) == sorted(f"{m}@{k}" for m in ("hr", "ndcg") for k in (5, 10, 20))
    assert means["ndcg@10"] == pytest.approx((2 / math.log2(3) + 1) / 3)
    assert "3 test requests" in res.output and "seen ads excluded" in res.output
    # every user, the history excluded: a sample or the history kept is another protocol
    for extra in (["--max-users", "2"], ["--no-exclude-seen"]):
        bad = runner.invoke(app, args + extra)
        assert bad.exit_code == 2 and "every user is evaluated" in bad.output
    unknown = runner.invoke(app, ["eval", "--data", str(folder), "--protocol", "nope",
                                  "--baselines", "popularity"])  # fmt: skip
    assert unknown.exit_code == 2 and "unknown protocol 'nope'" in unknown.output


def test_training_selects_its_epoch_under_the_protocol(feats):
    cfg = model_preset("tiny", "moe")
    under = LOO.training(cfg)
    assert (under.val_requests, under.val_exclude_seen, under.val_metric) == (0, True, "ndcg@10")
    with pytest.raises(ValueError, match="at most 50 engagements"):
        LOO.training(cfg.with_overrides(max_len=51))
    with pytest.raises(ValueError, match="more than the protocol's 50"):
        protocol("loo-position").check_model(cfg.with_overrides(max_len=60), "m.pt")
    under = under.with_overrides(epochs=3, patience=3)
    model, history = train(under, feats, "cpu", log=lambda _: None, progress=False)
    assert [h["epoch"] for h in history] == [1, 2, 3]
    best = max(history, key=lambda h: h["val_ndcg@10"])
    # the model returned is the best epoch's, on every validation request, history excluded
    catalog = Catalog.from_features(feats)
    again = _validate(model, feats, catalog, under, exclude_seen=True)
    assert again["ndcg@10"] == pytest.approx(best["val_ndcg@10"])


def test_training_says_which_families_have_no_input(folder, tmp_path):
    """A sequence file has no text, no user attributes and no organic events: the semantic,
    cohort and co-engagement families train on what is left, and `m31 train` says so."""
    out = tmp_path / "m.pt"
    res = CliRunner().invoke(app, ["train", "--model", "moe", "--preset", "tiny", "--epochs", "1",
                                   "--data", str(folder), "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    notes = [line for line in res.output.splitlines() if line.startswith("note: the ")]
    families = model_preset("tiny", "moe").experts
    assert [n.split()[2] for n in notes] == ["semantic", "cohort", "coengagement"]
    assert families["semantic"] == 1 and "semantic family (1 slot): no item has text" in notes[0]
    assert "every user has the same cohort, age_bucket, gender, country" in notes[1]
    assert "no organic events, so it reads only the history's co-engagement" in notes[2]
    assert out.is_file()


@pytest.mark.parametrize("loss", ["softmax", "full"])
def test_training_and_validation_never_read_the_test_target(tmp_path, loss):
    """Two datasets that differ only in every user's last item (the test target) train to the
    same weights and the same validation figures, epoch by epoch: nothing before test reads
    it (not the features, the negatives' popularity, the co-engagement nor the selection)."""
    rng = np.random.default_rng(5)
    lines = {u: rng.choice(np.arange(1, 31), rng.integers(4, 9), replace=False).tolist()
             for u in range(1, 41)}  # fmt: skip
    runs = []
    for shift in (0, 7):
        text = ""
        for u, items in lines.items():
            last = [i for i in range(1, 31) if i not in items][shift % (30 - len(items))]
            text += " ".join(map(str, [u, *items, last])) + "\n"
        (tmp_path / f"seq{shift}.txt").write_text(text)
        import_dataset(tmp_path / f"ds{shift}", sequences=tmp_path / f"seq{shift}.txt")
        feats = build_features(dataset.load(tmp_path / f"ds{shift}"),
                               FeatureConfig(text_embeddings=False))  # fmt: skip
        cfg = LOO.training(model_preset("tiny", "moe")).with_overrides(
            sequence_encoder="transformer", loss=loss, epochs=2, patience=2
        )
        model, history = train(cfg, feats, "cpu", log=lambda _: None, progress=False)
        runs.append((feats, model.state_dict(), history))
    (a, wa, ha), (b, wb, hb) = runs
    assert not np.array_equal(a.splits["test"]["item"], b.splits["test"]["item"])
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    strip = lambda h: [{k: v for k, v in e.items() if k != "seconds"} for e in h]  # noqa: E731
    assert strip(ha) == strip(hb)
