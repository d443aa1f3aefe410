"""The sequence expert's causal self-attention (`m31.model.sequence`): no position sees a later
engagement, padding is no input, an empty history is defined; the query after every history
position and its training (a target at every position); the attention pool kept as an option."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from m31.model import model_preset
from m31.model.checkpoint import build_model, load_checkpoint, save_checkpoint, vocab_sizes
from m31.model.config import ModelConfig
from m31.model.inputs import Catalog
from m31.model.sequence import CausalSequenceEncoder, causal_mask
from m31.model.towers import AttentionPool
from m31.training import train
from m31.training.train import _anchors, requests_for


@pytest.fixture(scope="module")
def feats(tiny_world):
    return tiny_world.feats


def make(feats, **overrides):
    torch.manual_seed(0)
    cfg = dataclasses.replace(
        model_preset("tiny", "moe"), **{"sequence_encoder": "transformer", **overrides}
    )
    model = build_model(cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1])
    return model.eval()


def encoder(length=7, h=12):
    torch.manual_seed(1)
    return CausalSequenceEncoder(h, length, blocks=3, heads=3, dropout=0.3).eval()


@pytest.mark.parametrize("i", [0, 3, 5])
def test_no_position_sees_a_later_item(i):
    enc = encoder()
    seq = torch.randn(5, 7, 12)
    valid = torch.ones(5, 7, dtype=torch.bool)
    valid[1, :2] = False  # a shorter history, right-aligned
    changed = seq.clone()
    changed[:, i + 1 :] = torch.randn_like(changed[:, i + 1 :])
    a, b = enc(seq, valid), enc(changed, valid)
    assert torch.equal(a[:, : i + 1], b[:, : i + 1])
    assert not torch.allclose(a[:, i + 1 :], b[:, i + 1 :])


def test_the_mask_reads_earlier_valid_positions_and_padding_only_itself():
    valid = torch.tensor([[False, True, True]])
    m = causal_mask(valid)[0, 0].int().tolist()
    assert m == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]


def test_padding_is_no_input_and_an_empty_history_is_defined():
    enc = encoder()
    seq, valid = torch.randn(3, 7, 12), torch.ones(3, 7, dtype=torch.bool)
    valid[0, :4] = False
    valid[2] = False
    noise = seq.clone()
    noise[0, :4] = torch.randn(4, 12)
    noise[2] = torch.randn(7, 12)
    a, b = enc(seq, valid), enc(noise, valid)
    assert torch.equal(a[0, 4:], b[0, 4:]) and torch.equal(a[2, -1], b[2, -1])
    assert torch.isfinite(a).all()


def _histories(b, length, seed):
    """valid [b, length]: right-aligned histories of every length 0..length, and gaps."""
    g = torch.Generator().manual_seed(seed)
    spans = torch.randint(0, length + 1, (b,), generator=g)
    spans[:3] = torch.tensor([0, length, 1])[: min(3, b)]  # empty, full, one engagement
    valid = torch.arange(length)[None, :] >= (length - spans)[:, None]
    gaps = torch.rand(b, length, generator=g) < 0.1
    return valid & ~gaps


@pytest.mark.parametrize("b,length", [(0, 7), (1, 7), (9, 3), (33, 7), (64, 50), (17, 33)])
def test_grouping_rows_by_history_length_changes_nothing(b, length):
    """`forward` trims each row to its history's bucket; `encode` runs every column: the same
    outputs at every position (padding's included) and the same gradients. In float64: a
    parameter's gradient sums over every row, which the groups visit in another order, and in
    float32 that order alone moved one of them by 2.5e-5 on one CPU."""
    torch.manual_seed(2)
    enc = CausalSequenceEncoder(12, 50, blocks=2, heads=3, dropout=0.3).double().eval()
    valid = _histories(b, length, seed=length)
    seq = torch.randn(b, length, 12, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(b, length, 12, dtype=torch.float64)
    fast, plain = enc(seq, valid), enc.encode(seq, valid)
    torch.testing.assert_close(fast, plain, atol=1e-12, rtol=1e-12)
    grads = []
    for out in (fast, plain):
        grads.append(torch.autograd.grad((out * weights).sum(), [seq, *enc.parameters()]))
    for a, c in zip(*grads, strict=True):
        torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-10)


def test_dropout_trains_and_eval_is_deterministic():
    enc = encoder()
    seq, valid = torch.randn(2, 7, 12), torch.ones(2, 7, dtype=torch.bool)
    assert torch.equal(enc(seq, valid), enc(seq, valid))
    enc.train()
    assert not torch.equal(enc(seq, valid), enc(seq, valid))


def test_the_models_query_after_each_position_is_causal(feats):
    model = make(feats)
    catalog = Catalog.from_features(feats)
    test = feats.splits["test"]
    r = requests_for(feats, test, np.arange(20), 8)
    row, i = 3, 4
    r.hist_item[row] = torch.arange(8) * 5  # a full history
    changed = dataclasses.replace(r, hist_item=r.hist_item.clone())
    changed.hist_item[row, i + 1 :] = (changed.hist_item[row, i + 1 :] + 7) % len(catalog)
    with torch.no_grad():
        (qf, vf, pf), (q, v, _) = model.encode_positions(r, catalog)
        (_, vf2, _), (q2, v2, _) = model.encode_positions(changed, catalog)
        alone = model.encode_requests(r, catalog)
    assert v.shape[:3] == (20, 8, 2) and q.shape[-1] == 16  # the sequence and cohort slots
    assert torch.equal(v[row, : i + 1], v2[row, : i + 1])
    assert torch.equal(q[row, : i + 1], q2[row, : i + 1])
    assert not torch.allclose(v[row, i + 1 :], v2[row, i + 1 :])
    assert not torch.allclose(vf[row], vf2[row])  # the request sees every engagement
    for a, b in zip((qf, vf, pf), alone, strict=True):
        assert torch.equal(a, b)
    # the sequence expert's slot at the last position is the request's sequence slot
    assert torch.allclose(v[:, -1, 0], vf[:, 0], atol=1e-6)


def test_anchors_make_each_train_engagement_one_target():
    split = {"user": np.array([0, 0, 0, 0, 0, 1, 1, 2]), "ts": np.array([5, 1, 2, 3, 4, 9, 8, 1])}
    # user 0 in time order: rows 1 2 3 4 0; every 2nd from the last: rows 0, 3, 1
    assert _anchors(split, 2).tolist() == [0, 1, 3, 5, 7]
    assert _anchors(split, 8).tolist() == [0, 5, 7]


def test_every_position_training_and_the_pool_ablation(feats, tmp_path):
    for encoder_name in ("transformer", "pool"):
        cfg = dataclasses.replace(
            model_preset("tiny", "moe"), sequence_encoder=encoder_name, epochs=2, patience=2
        )
        assert cfg.trains_every_position == (encoder_name == "transformer")
        model, history = train(cfg, feats, "cpu", log=lambda _: None, progress=False)
        assert all(np.isfinite(h["loss"]) for h in history)
        path = save_checkpoint(tmp_path / f"{encoder_name}.pt", model, feats, history)
        again, blob = load_checkpoint(path, feats)
        assert blob["config"]["sequence_encoder"] == encoder_name
        assert hasattr(again.user, "encoder") == (encoder_name == "transformer")


def test_a_config_from_before_the_transformer_is_the_pool():
    d = ModelConfig().to_dict()
    del d["sequence_encoder"]
    assert ModelConfig.from_dict(d).sequence_encoder == "pool"
    assert ModelConfig().sequence_encoder == "pool"  # the tiny and demo presets' default
    assert model_preset("sasrec", "moe").sequence_encoder == "transformer"
    with pytest.raises(ValueError, match="sequence_encoder"):
        ModelConfig(sequence_encoder="rnn")
    with pytest.raises(ValueError, match="sequence_heads"):
        ModelConfig(hidden=64, sequence_heads=3)


def test_without_the_sink_the_pools_null_key_is_only_an_empty_historys():
    torch.manual_seed(0)
    seq, ctx = torch.randn(3, 5, 12), torch.randn(3, 12)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[1, :3] = False
    valid[2] = False  # an empty history
    pool = AttentionPool(12, 2, sink=False)
    with torch.no_grad():  # both queries u for every user, keys the states themselves
        pool.queries.copy_(torch.ones(2, 12))
        pool.ctx.weight.zero_(), pool.ctx.bias.zero_()
        pool.key.weight.copy_(torch.eye(12)), pool.key.bias.zero_()
    before = pool(seq, valid, ctx)
    with torch.no_grad():  # a null key far along u: it takes the attention wherever it may
        pool.null.fill_(100.0)
    after = pool(seq, valid, ctx)
    assert torch.equal(before[:2], after[:2]), "a history's pool never reads the null key"
    null_value = pool.value(pool.null)[0, 0]
    assert torch.allclose(after[2], null_value.expand(2, -1)), "an empty history pools to it"
    sink = AttentionPool(12, 2, sink=True)
    sink.load_state_dict(pool.state_dict())
    collapsed = sink(seq, valid, ctx)
    # with the sink (the old pools), every user's state becomes the null's value: the collapse
    assert torch.allclose(collapsed, null_value.expand(3, 2, -1), atol=1e-4)


def test_a_config_from_before_the_pools_null_key_change_keeps_the_sink(feats):
    d = ModelConfig().to_dict()
    del d["pool_sink"]
    old = ModelConfig.from_dict(d)
    assert old.pool_sink and not ModelConfig().pool_sink
    model = build_model(old, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1])
    assert set(model.user.pools) == {"sequence", "semantic"}
    assert all(pool.sink for pool in model.user.pools.values())


def test_a_two_tower_over_the_sequence_alone_has_a_query_at_every_position(feats):
    model = make(
        feats,
        kind="two-tower",
        experts={"sequence": 1, "cohort": 0, "semantic": 0, "coengagement": 0},
    )
    r = requests_for(feats, feats.splits["test"], np.arange(4), 8)
    with torch.no_grad():
        _, (_, v, _) = model.encode_positions(r, Catalog.from_features(feats))
    assert v.shape == (4, 8, 1, 16)
    assert model.cfg.trains_every_position
    assert not model_preset("tiny", "two-tower").trains_every_position  # it trains at the request
    with pytest.raises(ValueError, match="pool the whole history"):
        make(feats, kind="two-tower").encode_positions(r, Catalog.from_features(feats))


@pytest.mark.parametrize("kind", ["moe", "two-tower"])
def test_the_full_softmax_is_cross_entropy_over_every_item(feats, kind):
    """`loss="full"` with a target at every position: the same value and gradient as a plain
    reference that scores each query against each item alone (`model.score_one`'s formula,
    DESIGN §2, one item at a time) and takes the softmax over all of them directly."""
    from m31.training.losses import next_targets, position_loss

    cfg = dataclasses.replace(
        model_preset("tiny", kind),
        sequence_encoder="transformer",
        loss="full",
        dropout=0.0,
        experts={"sequence": 1, "cohort": 1, "semantic": 0, "coengagement": 0},
    )
    torch.manual_seed(0)
    model = build_model(cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1])
    catalog = Catalog.from_features(feats)
    train_split = feats.splits["train"]
    anchors = _anchors(train_split, cfg.max_len)

    def histories(rows):
        r = requests_for(feats, train_split, rows, cfg.max_len)
        _, _, ts, _ = feats.history(train_split["user"][rows], train_split["ts"][rows], 8)
        return r, ts

    # 5 requests, 4 of them with a target after some history position, 1 without any
    with_targets = next_targets(*histories(anchors), "cpu")[0].any(1).numpy()
    rows = np.r_[anchors[with_targets][:4], anchors[~with_targets][:1]]
    r, hist_ts = histories(rows)
    pos = torch.from_numpy(train_split["item"][rows])
    cfg = dataclasses.replace(cfg, balance_weight=0.0)  # the loss alone

    loss, _ = position_loss(model, r, catalog, pos, hist_ts, None, feats.n_ads, cfg, None, "cpu")
    fast = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    def one(q, v, p, g, x, b):  # [E, G], [E, D], [E], [G], [D], []: one pair's score
        w = (
            torch.softmax(q @ g / max(q.shape[-1], 1) ** 0.5 + p, 0)
            if q.shape[-1]
            else (torch.softmax(p, 0))
        )
        return (w * (v @ x)).sum() + b

    (qf, vf, pf), (q, v, p) = model.encode_positions(r, catalog)
    g, x, b = model.encode_ads(catalog)
    has, target = next_targets(r, hist_ts, "cpu")
    queries = [(qf[i], vf[i], pf[i], int(pos[i])) for i in range(len(pos))]
    at = has.nonzero().tolist()
    queries += [(q[i, j], v[i, j], p[i, j], int(t)) for (i, j), t in zip(at, target, strict=True)]
    terms = []
    for qq, vv, pp, t in queries:
        logits = torch.stack([one(qq, vv, pp, g[a], x[a], b[a]) for a in range(feats.n_ads)])
        terms.append(torch.logsumexp(logits, 0) - logits[t])
    want = torch.stack(terms).mean()
    plain = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    assert len(target) > 0 and float(loss) == pytest.approx(float(want), rel=1e-5)
    for a, b_ in zip(fast, plain, strict=True):
        assert (a is None) == (b_ is None)
        if a is not None:
            torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6)
