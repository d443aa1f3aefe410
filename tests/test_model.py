import dataclasses
import math

import numpy as np
import pytest
import torch

from m31.data.dataset import VOCABULARIES
from m31.features import FeatureConfig, build_features
from m31.model import (
    Catalog,
    DenseModel,
    ModelConfig,
    RankingModel,
    RetrievalModel,
    model_preset,
)
from m31.model.checkpoint import build_model, load_checkpoint, save_checkpoint, vocab_sizes
from m31.model.inference import encode_ads, encode_requests
from m31.model.retrieval import balance_loss, sampled_softmax_loss
from m31.model.towers import ItemEncoder, hash_ids, idle_inputs
from m31.ops import score
from m31.training.losses import retrieval_loss
from m31.training.train import requests_for

# Each categorical vocabulary of two values, plus the unknown row (`vocab_sizes`).
VOCAB_SIZES = dict.fromkeys(VOCABULARIES, 3)


@pytest.fixture(scope="module")
def feats(tiny_world):
    # Stand-in text vectors (the real encoder is tested in test_features): non-zero, so the
    # text projections get gradients. A copy: the shared features stay as they are.
    text = np.random.default_rng(0).standard_normal(tiny_world.feats.text_emb.shape)
    return dataclasses.replace(tiny_world.feats, text_emb=text.astype(np.float32))


def make(kind, feats, seed=0):
    torch.manual_seed(seed)
    cfg = model_preset("tiny", kind)
    return build_model(cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1])


def some_requests(feats, n=13):
    test = feats.splits["test"]
    return requests_for(feats, test, np.arange(n), 8)


def naive_score(q, v, p, g, x, b):
    """DESIGN §2 written pair by pair, expert by expert."""
    n_req, n_exp, gdim = q.shape
    out = torch.empty(n_req, g.shape[0], dtype=torch.float64)
    for r in range(n_req):
        for a in range(g.shape[0]):
            logits = [
                (float(q[r, e] @ g[a]) / math.sqrt(gdim) if gdim else 0.0) + float(p[r, e])
                for e in range(n_exp)
            ]
            m = max(logits)
            w = [math.exp(t - m) for t in logits]
            out[r, a] = sum(w[e] / sum(w) * float(v[r, e] @ x[a]) for e in range(n_exp)) + float(
                b[a]
            )
    return out


@pytest.mark.parametrize("n_exp,gdim", [(1, 0), (3, 5), (8, 16)])
def test_scorer_equals_naive_loop(n_exp, gdim):
    gen = torch.Generator().manual_seed(n_exp)
    q, v, p = (
        torch.randn(3, n_exp, gdim, generator=gen),
        torch.randn(3, n_exp, 7, generator=gen),
        torch.randn(3, n_exp, generator=gen),
    )
    g, x, b = (
        torch.randn(11, gdim, generator=gen),
        torch.randn(11, 7, generator=gen),
        torch.randn(11, generator=gen),
    )
    torch.testing.assert_close(
        score(q, v, p, g, x, b).double(), naive_score(q, v, p, g, x, b), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("n_exp,gdim", [(1, 0), (3, 5)])
def test_scorer_takes_each_requests_own_ads(n_exp, gdim):
    """g [B, N, G], x [B, N, D], b [B, N]: request r's row equals scoring its ads alone."""
    gen = torch.Generator().manual_seed(7)
    n_req, n_ads = 5, 9
    q, v, p = (torch.randn(n_req, n_exp, s, generator=gen) for s in (gdim, 7, 1))
    p = p[..., 0]
    g, x, b = (
        torch.randn(n_req, n_ads, gdim, generator=gen),
        torch.randn(n_req, n_ads, 7, generator=gen),
        torch.randn(n_req, n_ads, generator=gen),
    )
    got = score(q, v, p, g, x, b)
    assert got.shape == (n_req, n_ads)
    for r in range(n_req):
        one = score(q[r : r + 1], v[r : r + 1], p[r : r + 1], g[r], x[r], b[r])[0]
        torch.testing.assert_close(got[r], one, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["moe", "two-tower"])
def test_retrieval_shapes_and_contract(feats, kind):
    model = make(kind, feats).eval()
    catalog = Catalog.from_features(feats)
    r = some_requests(feats)
    q, v, p = model.encode_requests(r, catalog)
    e, gdim = (1, 0) if kind == "two-tower" else (4, 16)
    assert q.shape == (13, e, gdim) and v.shape == (13, e, 16) and p.shape == (13, e)
    g, x, b = encode_ads(model, catalog, batch=700)  # batches that do not divide A
    assert (
        g.shape == (feats.n_ads, gdim)
        and x.shape == (feats.n_ads, 16)
        and b.shape == (feats.n_ads,)
    )
    with torch.no_grad():
        s, gate = model(r, catalog, catalog)
    torch.testing.assert_close(s, score(q, v, p, g, x, b))
    assert gate.shape == (13, feats.n_ads, e)
    torch.testing.assert_close(gate.sum(-1), torch.ones(13, feats.n_ads))


def test_encode_requests_api_matches_the_model(feats):
    model = make("moe", feats)
    catalog = Catalog.from_features(feats)
    t = feats.splits["test"]
    q, v, p = encode_requests(
        model,
        feats,
        catalog,
        t["user"][:5],
        t["ts"][:5],
        t["surface"][:5],
        t["hour"][:5],
        t["platform"][:5],
    )
    with torch.no_grad():
        q2, v2, p2 = model.encode_requests(
            requests_for(feats, t, np.arange(5), model.cfg.max_len), catalog
        )
    torch.testing.assert_close((q, v, p), (q2, v2, p2))


def test_context_folding_equals_modulating_every_ad(feats):
    model = make("moe", feats).eval()
    with torch.no_grad():
        model.modulation.weight.normal_(std=0.1)  # a non-trivial M(ctx)
        catalog = Catalog.from_features(feats)
        r = some_requests(feats, 6)
        q, v, p = model.encode_requests(r, catalog, fold_context=False)
        g, x, b = model.encode_ads(catalog)
        m = model.context_map(r)  # [B, D, D]
        assert not torch.allclose(m, torch.eye(16).expand_as(m))
        explicit = torch.stack(
            [score(q[i : i + 1], v[i : i + 1], p[i : i + 1], g, x @ m[i].T, b)[0] for i in range(6)]
        )  # every ad modulated: x'[a] = M x[a]
        folded = score(*model.encode_requests(r, catalog), g, x, b)
    torch.testing.assert_close(folded, explicit, rtol=1e-4, atol=1e-4)


def test_context_changes_scores(feats):
    model = make("moe", feats).eval()
    with torch.no_grad():
        model.modulation.weight.normal_(std=0.1)
        catalog = Catalog.from_features(feats)
        r = some_requests(feats, 4)
        s1 = model(r, catalog, catalog)[0]
        r.surface = (r.surface + 1) % 5
        s2 = model(r, catalog, catalog)[0]
    assert not torch.allclose(s1, s2)


@pytest.mark.parametrize("kind", ["ranking", "dense"])
def test_pair_models_score_pairs(feats, kind):
    model = make(kind, feats).eval()
    catalog = Catalog.from_features(feats)
    r = some_requests(feats, 5)
    cand = torch.randint(0, feats.n_ads, (5, 9))
    with torch.no_grad():
        s = model(r, catalog, cand)
        shared = model(r, catalog, cand[0])
        one = model(r.slice(2, 3), catalog, cand[2:3])
    assert s.shape == (5, 9) and shared.shape == (5, 9)
    torch.testing.assert_close(one[0], s[2], rtol=1e-5, atol=1e-5)


def test_dense_model_is_the_mlp_over_u_a_and_their_product(feats):
    """The split first layer (per request, per ad, per pair) against the plain MLP over the
    concatenation [u, a, u * a] of each pair, written out pair by pair."""
    model = make("dense", feats, seed=5).eval()
    catalog = Catalog.from_features(feats)
    r = some_requests(feats, 3)
    cand = torch.randint(0, feats.n_ads, (3, 7))
    with torch.no_grad():
        got = model(r, catalog, cand)
        u = model.encode_user(r, catalog)  # [3, D]
        _, a, b = model.ads(catalog.take(cand.reshape(-1)))
        a, b = a.reshape(3, 7, -1), b.reshape(3, 7)
        w = torch.cat([model.first_u.weight, model.first_a.weight, model.first_p.weight], dim=1)
        want = torch.empty(3, 7)
        for i in range(3):
            for j in range(7):
                x = torch.cat([u[i], a[i, j], u[i] * a[i, j]])  # [3D]
                hidden = torch.nn.functional.gelu(w @ x + model.first_u.bias)
                want[i, j] = model.rest(hidden)[0] + b[i, j]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="not dense models"):
        from m31.engine import Retriever

        Retriever(model, feats, None)


def test_training_the_dense_model(feats):
    """It trains on per-request candidate sets, as the ranking model: the loss falls, and every
    training call scores [B, C] candidates, never the corpus."""
    from m31.training import train

    shapes = []
    forward = DenseModel.forward
    cfg = model_preset("tiny", "dense").with_overrides(epochs=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DenseModel, "forward",
                      lambda self, r, c, rows: shapes.append((self.training, rows.dim())) or forward(self, r, c, rows))  # fmt: skip
        _, history = train(cfg, feats, device="cpu", log=lambda _: None, progress=False)
    assert {d for training, d in shapes if training} == {2}  # validation scores the corpus
    assert history[1]["loss"] < history[0]["loss"]


def test_bce_loss_by_hand():
    from m31.training.losses import bce_loss

    pos, neg = torch.tensor([0.0, 2.0]), torch.tensor([0.0, -1.0])
    want = (2 * math.log(2) + math.log1p(math.exp(-2.0)) + math.log1p(math.exp(-1.0))) / 2
    assert float(bce_loss(pos, neg)) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="loss must be one of softmax, full, bce"):
        model_preset("tiny", "moe").with_overrides(loss="hinge")
    for kind in ("ranking", "dense"):
        with pytest.raises(ValueError, match=f"not a {kind} model"):
            model_preset("tiny", kind).with_overrides(loss="bce")


@pytest.mark.parametrize("encoder", ["transformer", "pool"])
def test_training_with_the_bce_loss(feats, encoder):
    """SASRec's loss, with a target at every position (transformer) or at the request only."""
    from m31.training import train

    cfg = model_preset("tiny", "moe").with_overrides(loss="bce", sequence_encoder=encoder, epochs=2)
    assert cfg.trains_every_position == (encoder == "transformer")
    _, history = train(cfg, feats, device="cpu", log=lambda _: None, progress=False)
    assert 0 < history[1]["loss"] < history[0]["loss"]


def with_base(feats, base_kind="moe"):
    """A ranking model over a (randomly initialised) base retrieval model, and the base."""
    base = make(base_kind, feats, seed=3).eval()
    torch.manual_seed(4)
    cfg = model_preset("tiny", "ranking").with_overrides(ranking_base=base.cfg.to_dict())
    model = build_model(cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1])
    model.base.load_state_dict(base.state_dict())
    return model, base


@pytest.mark.parametrize("base_kind", ["moe", "two-tower"])
def test_ranking_model_with_a_base_starts_at_the_bases_scores(feats, base_kind):
    model, base = with_base(feats, base_kind)
    catalog = Catalog.from_features(feats)
    test = feats.splits["test"]
    longer = requests_for(feats, test, np.arange(len(test["user"])), model.cfg.max_len)
    # requests with more history than the base reads (the ranking model reads 3x as much)
    rows = np.flatnonzero(longer.hist_item[:, -base.cfg.max_len - 1].numpy() >= 0)[:6]
    assert len(rows) == 6
    r = requests_for(feats, test, rows, model.cfg.max_len)
    base_r = requests_for(feats, test, rows, base.cfg.max_len)
    cand = torch.randint(0, feats.n_ads, (6, 11))
    with torch.no_grad():
        want = base(base_r, catalog, catalog)[0]  # [6, A]: the base as trained, on its history
        got = model.eval()(r, catalog, cand)
        shared = model(r, catalog, cand[0])
    torch.testing.assert_close(got, torch.take_along_dim(want, cand, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared, want[:, cand[0]], rtol=1e-5, atol=1e-5)
    assert model.flops_per_pair() == (
        build_model(
            model_preset("tiny", "ranking"), vocab_sizes(feats), feats.text_emb.shape[1],
            feats.cooc_emb.shape[1],
        ).flops_per_pair()
        + base.flops_per_pair()
    )  # fmt: skip


def test_ranking_model_with_a_base_trains_its_correction_only(feats):
    model = with_base(feats)[0]
    catalog = Catalog.from_features(feats)
    model.train()
    assert not model.base.training  # the base stays in inference mode
    out = model(some_requests(feats, 8), catalog, torch.randint(0, feats.n_ads, (8, 5)))
    out.square().mean().backward()
    assert all(p_.grad is None for p_ in model.base.parameters())
    assert model.mlp[-1].weight.grad.abs().sum() > 0


def test_training_a_ranking_model_with_a_base(feats):
    from m31.training import train

    model, base = with_base(feats)
    with pytest.raises(ValueError, match="not a moe model's"):
        ModelConfig(kind="moe", ranking_base=base.cfg.to_dict())
    with pytest.raises(ValueError, match="must be a moe or two-tower"):
        ModelConfig(kind="ranking", ranking_base=model_preset("tiny", "ranking").to_dict())
    cfg = model.cfg.with_overrides(epochs=1)
    quiet = {"device": "cpu", "log": lambda _: None, "progress": False}
    with pytest.raises(ValueError, match="needs both"):
        train(cfg, feats, **quiet)
    with pytest.raises(ValueError, match="needs both"):
        train(model_preset("tiny", "ranking"), feats, base=base, **quiet)
    with pytest.raises(ValueError, match=r"not cfg\.ranking_base"):
        train(cfg, feats, base=make("two-tower", feats), **quiet)
    trained, history = train(cfg, feats, base=base, **quiet)
    assert [h["epoch"] for h in history] == [0, 1] and history[0]["loss"] is None
    assert history[1]["loss"] > 0
    # epoch 0 re-ranks the base's top ads by the base's own score: the base's validation
    from m31.eval import evaluate
    from m31.model.inference import ScoreFunction

    fn = ScoreFunction(base, feats, Catalog.from_features(feats))
    want = evaluate({"base": fn}, feats, "val", ks=(10, 50), max_users=cfg.val_requests,
                    exclude_seen=False)["base"]  # fmt: skip
    for k in (10, 50):
        assert history[0][f"val_hr@{k}"] == pytest.approx(want[f"hr@{k}"], abs=0.02)
    assert want["hr@50"] > 0
    # and it scores each request's candidates [b, C], never the whole corpus (shared rows [A])
    from m31.training.train import _validate

    shapes = []
    forward = RankingModel.forward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RankingModel, "forward",
                      lambda self, r, c, rows: shapes.append(rows.dim()) or forward(self, r, c, rows))  # fmt: skip
        _validate(trained, feats, Catalog.from_features(feats), cfg, exclude_seen=False)
    assert shapes and set(shapes) == {2}
    for a, b in zip(trained.base.state_dict().values(), base.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # frozen


def test_demo_ranking_model_costs_over_100x_the_moe_per_pair():
    sizes = {"cohort": 3, "country": 3, "age": 7, "topic": 3, "category": 3, **VOCAB_SIZES}
    moe = build_model(model_preset("demo", "moe"), sizes, 384, 32)
    ranking = build_model(model_preset("demo", "ranking"), sizes, 384, 32)
    assert moe.flops_per_pair() == 2 * 8 * (64 + 64) + 1
    assert ranking.flops_per_pair() > 100 * moe.flops_per_pair()
    dense = build_model(model_preset("demo", "dense"), sizes, 384, 32)
    # u * a (D), its first-layer term (2·D·256) and the two adds (2·256), 256 -> 128 -> 1, bias
    assert dense.flops_per_pair() == 64 + 2 * 64 * 256 + 2 * 256 + 2 * 256 * 128 + 2 * 128 + 1
    assert dense.flops_per_pair() > 40 * moe.flops_per_pair()


@pytest.mark.parametrize("kind", ["moe", "two-tower", "ranking", "dense"])
def test_gradients_reach_every_tower(feats, kind):
    model = make(kind, feats)
    catalog = Catalog.from_features(feats)
    test = {k: v.copy() for k, v in feats.splits["test"].items()}
    test["ts"][0] = -1  # before every engagement: an empty history, the pools' null key's reader
    r = requests_for(feats, test, np.arange(16), 8)
    if kind in ("ranking", "dense"):
        out = model(r, catalog, torch.randint(0, feats.n_ads, (16, 5)))
    else:
        out = model(r, catalog, catalog.take(torch.arange(40)))[0]
    out.square().mean().backward()
    missing = [
        n for n, p_ in model.named_parameters() if p_.grad is None or not p_.grad.abs().sum() > 0
    ]
    # hashed-id rows never looked up have zero gradient; every module must still get one
    assert not [n for n in missing if not n.endswith(("id.weight", "advertiser.weight"))], missing


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 16)])
def test_attribute_mean_is_the_plain_mean_of_the_tokens_rows(feats, shape):
    """The ad tower's one-pass attribute mean (`embedding_bag`) against the plain gather and
    mean it replaces, values and gradients, on odd shapes; a row of padding only adds zeros."""
    torch.manual_seed(0)
    cfg = model_preset("tiny", "moe").with_overrides(attribute_buckets=97)
    item = ItemEncoder(cfg, {**vocab_sizes(feats), "attributes": shape[-1]}, 4, 3)
    tokens = torch.randint(-1, 1000, shape)
    tokens.view(-1, shape[-1])[0] = -1  # no token at all
    got = item.attribute_mean(tokens)
    weight = item.attributes.weight
    (g_got,) = torch.autograd.grad(got.square().sum(), weight)
    valid = (tokens >= 0).float()[..., None]
    rows = weight[hash_ids(tokens.clamp_min(0), 97, 2)]
    want = (rows * valid).sum(-2) / valid.sum(-2).clamp_min(1.0)
    (g_want,) = torch.autograd.grad(want.square().sum(), weight)
    assert got.shape == (*shape[:-1], cfg.hidden)
    assert not got.view(-1, cfg.hidden)[0].any()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)


def test_balance_loss_extremes():
    e = 4
    uniform = torch.full((3, 5, e), 1 / e)
    assert abs(float(balance_loss(uniform))) < 1e-6  # no information between ads and experts
    spread = torch.eye(e).repeat(5, 1)[None]  # every ad to one expert, all experts equally used
    assert float(balance_loss(spread)) == pytest.approx(-math.log(e), abs=1e-5)
    collapsed = torch.zeros(1, 8, e)
    collapsed[..., 0] = 1
    assert float(balance_loss(collapsed)) == pytest.approx(0.0, abs=1e-6)


def test_sampled_softmax_masks_accidental_positives():
    scores = torch.tensor([[2.0, 5.0, 0.0], [0.0, 1.0, 3.0]])
    cand = torch.tensor([7, 7, 9])  # request 0's positive (ad 7) also sits in column 1
    loss = sampled_softmax_loss(
        scores, torch.zeros(3), torch.tensor([0, 2]), cand, torch.tensor([7, 9])
    )
    want = (
        -torch.log_softmax(torch.tensor([2.0, 0.0]), 0)[0]
        - torch.log_softmax(torch.tensor([0.0, 1.0, 3.0]), 0)[2]
    ) / 2
    torch.testing.assert_close(loss, want)


def test_training_reduces_the_loss(feats):
    model = make("moe", feats)
    catalog = Catalog.from_features(feats)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    tr = feats.splits["train"]
    pop = np.bincount(tr["item"], minlength=feats.n_ads) / len(tr["item"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fixed = np.arange(256)
    r_fixed = requests_for(feats, tr, fixed, cfg.max_len)

    def held_loss():
        with torch.no_grad():
            return float(
                retrieval_loss(
                    model,
                    r_fixed,
                    catalog,
                    torch.from_numpy(tr["item"][fixed]),
                    pop,
                    feats.n_ads,
                    cfg,
                    np.random.default_rng(1),
                    "cpu",
                )[0]
            )

    before = held_loss()
    for _ in range(2):
        for lo in range(0, len(tr["user"]), 64):
            rows = np.arange(lo, min(lo + 64, len(tr["user"])))
            loss, _ = retrieval_loss(
                model,
                requests_for(feats, tr, rows, cfg.max_len),
                catalog,
                torch.from_numpy(tr["item"][rows]),
                pop,
                feats.n_ads,
                cfg,
                rng,
                "cpu",
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert held_loss() < before - 0.3


@pytest.mark.parametrize("kind", ["moe", "ranking", "ranking-with-base", "dense"])
def test_checkpoint_round_trips_exactly(feats, tmp_path, kind):
    model = with_base(feats)[0].eval() if kind == "ranking-with-base" else make(kind, feats).eval()
    path = save_checkpoint(tmp_path / "m.pt", model, feats, history=[{"epoch": 1}])
    again, blob = load_checkpoint(path, feats)
    assert blob["history"] == [{"epoch": 1}] and blob["config"] == model.cfg.to_dict()
    assert type(again) is type(model)
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    catalog = Catalog.from_features(feats)
    r = some_requests(feats, 3)
    with torch.no_grad():
        if kind != "moe":
            cand = torch.arange(7)
            assert torch.equal(model(r, catalog, cand), again(r, catalog, cand))
        else:
            assert torch.equal(model(r, catalog, catalog)[0], again(r, catalog, catalog)[0])


def test_checkpoint_errors(feats, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable m31 checkpoint"):
        load_checkpoint(tmp_path / "bad.pt")


def test_checkpoint_refuses_another_split(feats, tiny_world, tmp_path):
    """A model trained on one split has seen the other split's test period: never evaluate it
    there (an outside review scored such a model 0.158 instead of 0.144)."""
    path = save_checkpoint(tmp_path / "m.pt", make("moe", feats), feats, history=[])
    other = build_features(
        tiny_world.ds, FeatureConfig(max_len=8, text_embeddings=False, split="time")
    )
    with pytest.raises(
        ValueError, match="trained on the leave-last-out split, these features are the time split"
    ):
        load_checkpoint(path, other)
    shorter = build_features(
        tiny_world.ds,
        FeatureConfig(max_len=8, text_embeddings=False, time_split=(0.7, 0.9), split="time"),
    )
    timed = save_checkpoint(tmp_path / "t.pt", make("moe", other), other, history=[])
    with pytest.raises(ValueError, match="other time train examples"):
        load_checkpoint(timed, shorter)
    load_checkpoint(timed, other)
    blob = torch.load(path, weights_only=False)
    blob["format"] = "m31-checkpoint-1"
    torch.save(blob, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="retrain it"):
        load_checkpoint(tmp_path / "old.pt", feats)


def test_bad_model_config():
    with pytest.raises(ValueError, match="kind must be one of"):
        ModelConfig(kind="gbdt")
    with pytest.raises(ValueError, match="unknown expert families"):
        ModelConfig(experts={"sequence": 2, "vibes": 1})
    with pytest.raises(ValueError, match="gate_dim must be >= 0"):
        ModelConfig(gate_dim=-1)
    for bad in (-0.01, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="balance_weight must be a finite number >= 0"):
            ModelConfig(balance_weight=bad)
    with pytest.raises(ValueError, match="unknown model preset"):
        model_preset("huge", "moe")
    with pytest.raises(ValueError, match="RetrievalModel is moe or two-tower"):
        RetrievalModel(
            model_preset("tiny", "ranking"),
            {"cohort": 2, "country": 2, "age": 7, "topic": 2, "category": 2, **VOCAB_SIZES},
            4,
            4,
        )
    assert isinstance(
        build_model(
            model_preset("tiny", "ranking"),
            {"cohort": 2, "country": 2, "age": 7, "topic": 2, "category": 2, **VOCAB_SIZES},
            4,
            4,
        ),
        RankingModel,
    )


@pytest.mark.parametrize("kind", ["moe", "ranking", "dense"])
def test_score_function_full_corpus_and_ranking_agree(feats, kind):
    from m31.eval import requests_from_split
    from m31.model.inference import ScoreFunction

    fn = ScoreFunction(make(kind, feats), feats, Catalog.from_features(feats), ad_chunk=333)
    req = requests_from_split(feats, "test", max_users=7)
    full = fn(req)  # [7, A], ads scored in chunks that do not divide A
    assert full.shape == (7, feats.n_ads)
    cand = np.random.default_rng(0).integers(0, feats.n_ads, (7, 11))
    np.testing.assert_allclose(
        fn.rank(req, cand), np.take_along_axis(full, cand, 1), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("kind", ["moe", "two-tower"])
def test_retrieval_scores_in_ad_chunks_equal_the_whole_corpus_at_once(feats, kind):
    """The chunks only bound the gate's intermediates: each ad's score is the §2 formula over
    the same inputs, whatever chunk (here 7, 100 and the default's smallest, 256: none divides
    the 2,000 ads) it falls in."""
    from m31.eval import requests_from_split
    from m31.model.inference import ScoreFunction

    model, catalog = make(kind, feats).eval(), Catalog.from_features(feats)
    req = requests_from_split(feats, "test", max_users=9)
    whole = ScoreFunction(model, feats, catalog, ad_chunk=feats.n_ads)(req)
    small_budget = ScoreFunction(model, feats, catalog)
    small_budget.GATE_ELEMENTS = 1000  # the default rule's floor of 256 ads a chunk
    assert small_budget._gate_chunk(9, 4) == 256 and 256 < feats.n_ads
    # Equal up to fp32 rounding: BLAS sums an ad's products in an order that depends on where
    # its row falls in the chunk (ulps, ~5e-7 here on an AMD EPYC); a misplaced ad is off by O(1).
    for fn in (*(ScoreFunction(model, feats, catalog, ad_chunk=c) for c in (7, 100)), small_budget):
        np.testing.assert_allclose(fn(req), whole, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ad_chunk must be positive"):
        ScoreFunction(model, feats, catalog, ad_chunk=0)


def test_hard_negative_pool_is_the_retrievers_top_ads_less_the_users_own(feats):
    """Each training example's pool: the retriever's `pool` best ads for its request, written
    here as a plain loop over the examples; none of the user's own training ads."""
    from m31.model.inference import ScoreFunction
    from m31.training.losses import draw
    from m31.training.train import hard_negative_pool

    fn = ScoreFunction(make("moe", feats).eval(), feats, Catalog.from_features(feats))
    tr = feats.splits["train"]
    pool = hard_negative_pool(fn, feats, 40, batch=37)  # batches of an odd size
    assert pool.shape == (len(tr["user"]), 40) and pool.dtype == np.int32
    rows = np.random.default_rng(0).choice(len(tr["user"]), 50, replace=False)
    from types import SimpleNamespace

    keys = ("user", "ts", "surface", "hour", "platform")
    scores = fn(SimpleNamespace(**{k: tr[k][rows] for k in keys}))
    for i, row in enumerate(rows):
        own = set(tr["item"][tr["user"] == tr["user"][row]].tolist())
        assert own.isdisjoint(pool[row].tolist())
        ranked = [a for a in np.argsort(-scores[i], kind="stable").tolist() if a not in own]
        assert set(pool[row].tolist()) == set(ranked[:40]) or (
            # a tie at the boundary may pick either ad
            scores[i][ranked[39]] == scores[i][ranked[40]]
        )
    drawn = draw(pool[:5], 7, np.random.default_rng(1))
    assert drawn.shape == (5, 7)
    assert all(set(d.tolist()) <= set(p.tolist()) for d, p in zip(drawn, pool[:5], strict=True))
    most = int(np.bincount(tr["user"]).max())
    with pytest.raises(ValueError, match="hard-negative pool"):
        hard_negative_pool(fn, feats, feats.n_ads - most + 1)


def test_hard_negatives_train_the_ranking_model_only(feats):
    from m31.training import train

    with pytest.raises(ValueError, match="not a moe model"):
        ModelConfig(kind="moe", ranking_hard=4)
    with pytest.raises(ValueError, match="ranking_hard must be >= 0"):
        ModelConfig(kind="ranking", ranking_hard=-1)
    with pytest.raises(ValueError, match="ranking_hard_pool >= 1"):
        ModelConfig(kind="ranking", ranking_hard=2, ranking_hard_pool=0)
    cfg = model_preset("tiny", "ranking").with_overrides(ranking_hard=4, epochs=1)
    with pytest.raises(ValueError, match="need both"):
        train(cfg, feats, device="cpu", log=lambda _: None, progress=False)


def test_idle_inputs_names_only_the_families_whose_inputs_are_missing(feats):
    experts = {"sequence": 1, "semantic": 2, "cohort": 1, "coengagement": 2}
    assert idle_inputs(experts, feats) == {}  # the world has every input
    text, cooc, organic = feats.text_emb, feats.cooc_emb, feats.organic
    try:
        feats.text_emb, feats.cooc_emb = np.zeros_like(text), np.zeros_like(cooc)
        assert sorted(idle_inputs(experts, feats)) == ["coengagement", "semantic"]
        assert "only the organic events" in idle_inputs(experts, feats)["coengagement"]
        # a family without slots is never named, whatever its inputs
        assert idle_inputs({"sequence": 1, "cohort": 1}, feats) == {}
        feats.organic = organic.last(0)
        assert "one learned vector each" in idle_inputs(experts, feats)["coengagement"]
    finally:
        feats.text_emb, feats.cooc_emb, feats.organic = text, cooc, organic
