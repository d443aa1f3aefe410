"""A stopped training goes on where it stopped (`m31 train --resume`): the state written after
every epoch restores the weights, the optimizer and the random generators, so that the resumed
run ends with the weights and history of a run never stopped; a run that used its epochs while
still gaining keeps its state for more, one that patience ended does not; a state of another
config or other features, or a damaged one, is refused."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from m31.model import model_preset
from m31.model.checkpoint import save_atomic
from m31.training import train
from m31.training.job import resume_path, train_checkpoint


@pytest.fixture(scope="module")
def feats(tiny_world):
    return tiny_world.feats


# the attention pool; the transformer (a target at every position, dropout); a pair model
CONFIGS = {
    "moe": {},
    "moe-transformer": {"sequence_encoder": "transformer", "dropout": 0.2},
    "dense": {},
}


def config(name: str, **overrides):
    kind = name.split("-")[0]
    return dataclasses.replace(
        model_preset("tiny", kind), **{"patience": 5, **CONFIGS[name], **overrides}
    )


def run(cfg, feats, resume=None):
    """(model, history without the timings, the state after each epoch)."""
    states = []
    model, history = train(
        cfg, feats, "cpu", log=lambda _: None, progress=False, resume=resume,
        on_epoch=lambda s: states.append(copy.deepcopy(s)),
    )  # fmt: skip
    return model, [{k: v for k, v in h.items() if k != "seconds"} for h in history], states


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_resumed_training_ends_as_one_never_stopped(feats, name):
    whole, history, states = run(config(name, epochs=3), feats)
    assert [s["epoch"] for s in states] == [1, 2, 3]
    # stopped after its first epoch (a run given one epoch is that run stopped there)
    _, _, first = run(config(name, epochs=1), feats)
    resumed, resumed_history, later = run(config(name, epochs=3), feats, resume=first[0])
    assert resumed_history == history
    assert [s["epoch"] for s in later] == [2, 3]
    assert_same_weights(resumed, whole)
    # and from the uninterrupted run's own second state
    again, again_history, _ = run(config(name, epochs=3), feats, resume=states[1])
    assert again_history == history
    assert_same_weights(again, whole)


def test_a_state_that_had_stopped_early_trains_no_further(feats):
    cfg = config("moe", epochs=2)
    _, history, states = run(cfg, feats)
    stopped = {**states[0], "bad_epochs": cfg.patience}  # as if epoch 1 had ended the run
    again, again_history, later = run(cfg, feats, resume=stopped)
    assert later == [] and again_history == history[:1]
    best = run(config("moe", epochs=1), feats)[0]
    assert_same_weights(again, best)


def test_a_state_of_another_config_is_refused(feats):
    _, _, states = run(config("moe", epochs=1), feats)
    with pytest.raises(ValueError, match=r"another config \(lr, seed\)"):
        run(config("moe", epochs=2, lr=0.5, seed=9), feats, resume=states[0])
    # more epochs and more patience are no other config: a run can be given more
    run(config("moe", epochs=2, patience=9), feats, resume=states[0])


class Stop(Exception):
    """Stands for the kill of a training process."""


def test_the_job_resumes_from_its_state_file(feats, tmp_path):
    data = feats.save(tmp_path / "features")
    cfg = config("moe-transformer", epochs=3)
    whole = train_checkpoint(cfg, data, tmp_path / "whole.pt", log=lambda _: None)
    out = tmp_path / "stopped.pt"

    def stop_in_epoch_two(line: str) -> None:
        if line.startswith("epoch 2:"):  # the log line before epoch 2's state is written
            raise Stop

    with pytest.raises(Stop):
        train_checkpoint(cfg, data, out, log=stop_in_epoch_two)
    state = torch.load(resume_path(out), weights_only=False)
    assert state["epoch"] == 1 and out.is_file()  # the best epoch so far, kept
    lines = []
    resumed = train_checkpoint(cfg, data, out, resume=True, log=lines.append)
    assert any(line.startswith(f"resuming {resume_path(out)} after epoch 1") for line in lines)
    assert_same_weights(resumed.model, whole.model)
    blobs = [torch.load(p, weights_only=False) for p in (tmp_path / "whole.pt", out)]
    assert [h["epoch"] for h in blobs[1]["history"]] == [1, 2, 3]
    for key, value in blobs[0]["state_dict"].items():
        assert torch.equal(value, blobs[1]["state_dict"][key]), key

    # both used their 3 epochs within their patience of 5: the state stays, for more epochs
    assert not whole.stopped_early and resume_path(tmp_path / "whole.pt").is_file()
    assert f"{resume_path(out)} kept" in lines[-1]
    more = train_checkpoint(config("moe-transformer", epochs=4), data, out, resume=True,
                            log=lambda _: None)  # fmt: skip
    assert [h["epoch"] for h in more.history] == [1, 2, 3, 4]
    assert more.history[:3] == resumed.history

    # patience ends a training that cannot gain (an lr of 1e-30 moves no weight by a float32
    # step, so every epoch validates the same), and takes its state with it
    frozen = config("moe", epochs=9, patience=2, lr=1e-30)
    still = train_checkpoint(frozen, data, tmp_path / "still.pt", log=lambda _: None)
    assert still.stopped_early and [h["epoch"] for h in still.history] == [1, 2, 3]
    assert not resume_path(tmp_path / "still.pt").exists()

    # nothing to resume: trains from the start, and says so
    lines = []
    train_checkpoint(config("moe", epochs=1), data, tmp_path / "fresh.pt", resume=True,
                     log=lines.append)  # fmt: skip
    assert f"no stopped training at {resume_path(tmp_path / 'fresh.pt')}" in "\n".join(lines)


def test_the_job_refuses_a_damaged_state_or_one_of_other_features(feats, tmp_path):
    data = feats.save(tmp_path / "features")
    cfg, out = config("moe", epochs=1), tmp_path / "m.pt"
    resume_path(out).write_bytes(b"not a state")
    with pytest.raises(ValueError, match="not a readable training state"):
        train_checkpoint(cfg, data, out, resume=True, log=lambda _: None)
    save_atomic({"format": "something else"}, resume_path(out))
    with pytest.raises(ValueError, match="not an m31 training state"):
        train_checkpoint(cfg, data, out, resume=True, log=lambda _: None)
    _, _, states = run(cfg, feats)
    save_atomic(
        {**states[0], "format": "m31-resume-1", "trained_on": ("other", {}), "seconds": 1.0},
        resume_path(out),
    )
    with pytest.raises(ValueError, match="other features or another split"):
        train_checkpoint(cfg, data, out, resume=True, log=lambda _: None)
    # without --resume the stale state is replaced
    lines = []
    train_checkpoint(cfg, data, out, log=lines.append)
    assert any("a stopped training's state, replaced" in line for line in lines)
    assert torch.load(resume_path(out), weights_only=False)["trained_on"] != ("other", {})
