"""The library face (`import m31`) and the online features a served index carries: the README's
example runs as written on files in the Beauty benchmark's formats, the engine answers what
the retriever does, and serving from the online features answers what the full features do."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

import m31
from m31.cli import app
from m31.data import dataset
from m31.engine import Retriever
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.engine.load import ONLINE, copy_online, load_engine, serving_folder
from m31.features import Features
from m31.features.sequences import EventSequences
from m31.index import AdIndex
from m31.model import build_model, vocab_sizes

README = Path(__file__).resolve().parents[1] / "README.md"
runner = CliRunner()


def run(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def beauty(tmp_path_factory):
    """A folder laid out as the README's walkthrough leaves it, from files in the formats of
    `../shared/data/amazon-sr/`: `data/beauty` imported, `runs/beauty.pt` trained."""
    root = tmp_path_factory.mktemp("beauty")
    rng = np.random.default_rng(0)
    lines = [
        " ".join(
            map(str, [u, *rng.choice(np.arange(1, 41), size=rng.integers(3, 9), replace=False)])
        )
        for u in range(1, 31)
    ]
    (root / "Beauty.txt").write_text("\n".join(lines) + "\n")
    attributes = {
        str(i): [int(a) for a in rng.choice(30, size=2, replace=False)] for i in range(1, 41)
    }
    attributes["12"] = [12, 3]
    (root / "Beauty_item2attributes.json").write_text(json.dumps(attributes))
    run("data", "import", "--sequences", root / "Beauty.txt",
        "--items", root / "Beauty_item2attributes.json", "--out", root / "data" / "beauty")  # fmt: skip
    run("train", "--model", "moe", "--data", root / "data" / "beauty",
        "--out", root / "runs" / "beauty.pt", "--preset", "tiny", "--epochs", "1")  # fmt: skip
    return root


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("### In Python") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_as_written(beauty, monkeypatch):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 15
    monkeypatch.chdir(beauty)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    assert "Retrieved(ad_ids=array(" in printed
    assert (beauty / "serving" / "beauty-int8" / ONLINE / "meta.json").is_file()


def test_the_engine_answers_what_the_retriever_does(beauty):
    data = beauty / "data" / "beauty"
    model = m31.load_model(beauty / "runs" / "beauty.pt", data=data)
    index = m31.build_index(model)
    engine = m31.Engine(model, index)
    requests = [m31.AdRequest(user_id=u, ts=2_000_000_000) for u in (1, 7, 30)]
    want = Retriever(model.net, model.features, index).retrieve(requests, k=7).results
    got = engine.retrieve(requests, k=7)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.ad_ids, w.ad_ids)
        np.testing.assert_array_equal(g.scores, w.scores)
    one = engine.retrieve(requests[1], k=7)
    np.testing.assert_array_equal(one.ad_ids, want[1].ad_ids)
    # The default time is now; a filter on the imported attributes is honoured.
    only = engine.retrieve(m31.AdRequest(user_id=7, filter={"contains": ["attributes", "12"]}))
    rows = {a["ad_id"]: a["attributes"] for a in dataset.load(data).ads.to_pylist()}
    assert len(only.ad_ids) and all("12" in rows[int(i)] for i in only.ad_ids)
    with pytest.raises(ValueError, match="dtype: 'fp8'"):
        m31.build_index(model, dtype="fp8")
    with pytest.raises(m31.RequestError, match="unknown user 999"):
        engine.retrieve(m31.AdRequest(user_id=999))


def test_the_engine_explains_an_answer_on_an_imported_file(beauty):
    """`Engine.retrieve(..., explain=True, why_not=...)` on the imported Amazon-format files: the
    filter's stage keeps the items holding the attribute, each result's terms add up to its
    score, and the why-nots name the filter, an unknown id and the rank."""
    data = beauty / "data" / "beauty"
    model = m31.load_model(beauty / "runs" / "beauty.pt", data=data)
    engine = m31.Engine(model, m31.build_index(model))
    rows = {a["ad_id"]: a["attributes"] for a in dataset.load(data).ads.to_pylist()}
    holding = sorted(a for a, attrs in rows.items() if "12" in attrs)
    lacking = next(a for a in rows if a not in holding)
    request = m31.AdRequest(user_id=7, filter={"contains": ["attributes", "12"]})
    got = engine.retrieve(request, k=2, explain=True, why_not=[lacking, 10**6, *holding])
    e = got.explanation
    assert e.eligible["live"] == len(rows) and e.eligible["filter"] == len(holding)
    assert e.experts == ["sequence", "cohort", "semantic", "coengagement"]  # the tiny preset
    assert e.kth_score == float(got.scores[-1])
    for ad, score in zip(e.ads, got.scores.tolist(), strict=True):
        assert sum(ad.contributions) + ad.bias == pytest.approx(score, abs=1e-4)
    why = {w.ad_id: w for w in e.why_not}
    assert why[lacking].stage == "filter" and "request's filter" in why[lacking].reason
    assert why[10**6].stage == "unknown"
    ranked = sorted((why[a].rank, a) for a in holding)
    assert [r for r, _ in ranked] == list(range(1, len(holding) + 1))
    assert [a for _, a in ranked[:2]] == got.ad_ids.tolist()
    assert all(why[a].stage == "rank" for _, a in ranked[2:])
    assert engine.retrieve(request, k=2).explanation is None


def test_ads_the_model_never_saw_go_through_its_ad_tower(beauty):
    data = beauty / "data" / "beauty"
    model = m31.load_model(beauty / "runs" / "beauty.pt", data=data)
    ads = dataset.load(data).ads
    full = m31.build_index(model, dtype="float32")
    # Three catalogue ads under new ids (with a text): encoded from the table's columns.
    renamed = ads.set_column(0, "ad_id", pa.array(np.r_[[10_001, 10_002, 10_003],
                                                        ads["ad_id"].to_numpy()[3:]]))  # fmt: skip
    texts = pa.array(["a lipstick", None, "a shampoo"] + [None] * (len(ads) - 3), pa.string())
    renamed = renamed.set_column(renamed.schema.get_field_index("text"), "text", texts)
    mixed = m31.build_index(model, ads=renamed, dtype="float32")
    encoder = AdEncoder(model.net, model.features)
    new = renamed.slice(0, 3).to_pylist()
    fields = ("ad_id", "advertiser_id", "objective", "format", "topic", "category", "text")
    g, x, b = encoder.encode(
        [NewAd(**{f: a[f] for f in fields}, quality=a["quality"], attributes=a) for a in new]
    )
    # Up to fp32 rounding: a batch of three and the whole catalogue go through the tower's
    # matrix products in other blockings (and thread counts), which round in other orders.
    for i, ad_id in enumerate((10_001, 10_002, 10_003)):
        row = mixed.get(ad_id)
        torch.testing.assert_close(row.g, g[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(row.x, x[i], rtol=1e-5, atol=1e-6)
        assert row.b == pytest.approx(float(b[i]), rel=1e-5, abs=1e-6)
    # The other ads are the catalogue's, encoded from their features as before.
    for ad_id in ads["ad_id"].to_numpy()[3:10].tolist():
        torch.testing.assert_close(mixed.get(ad_id).g, full.get(ad_id).g, rtol=0, atol=0)


def test_the_ad_tower_reads_the_item_attributes(beauty):
    """The imported attributes are tokens of the ad tower: a new ad's, made by the server's
    encoder, are the features' tokens of the same values; other attributes, another vector."""
    data = beauty / "data" / "beauty"
    model = m31.load_model(beauty / "runs" / "beauty.pt", data=data)
    feats = model.features
    assert model.net.ads.item.attributes is not None
    assert feats.meta["attribute_tokens"] == {"attributes": "str_list"}
    ads = dataset.load(data).ads.to_pylist()
    encoder = AdEncoder(model.net, feats)
    fields = ("ad_id", "advertiser_id", "objective", "format", "topic", "category", "text")
    new = [NewAd(**{f: a[f] for f in fields}, attributes=a) for a in ads[:5]]
    row = {int(i): r for r, i in enumerate(feats.ads["ad_id"])}
    for a, tokens in zip(ads[:5], encoder.tokens(new), strict=True):
        want = feats.attr_tokens[row[a["ad_id"]]]
        assert tokens.tolist() == want[want >= 0].tolist() and len(tokens) == 2
    other = [dataclasses.replace(new[0], attributes={"attributes": ["99", "98"]}), new[0]]
    x = encoder.encode(other)[1]
    assert not torch.equal(x[0], x[1])
    # `m31 train --attribute-buckets 0`: the ablation without them
    cfg = model.net.cfg.with_overrides(attribute_buckets=0)
    sizes = vocab_sizes(feats)
    assert sizes["attributes"] == 2
    assert build_model(cfg, sizes, 384, feats.cooc_emb.shape[1]).ads.item.attributes is None


def test_online_features_answer_what_the_full_ones_do(beauty):
    """The online features keep each user's last L engagements and no examples: a request at
    or after a user's last event gets the same answer from them."""
    data = beauty / "data" / "beauty"
    model = m31.load_model(beauty / "runs" / "beauty.pt", data=data)
    index = m31.build_index(model)
    online = model.features.online(max_len=3)
    assert online.is_online and online.splits == {}
    assert np.diff(online.engagements.offsets).max() == 3
    requests = [m31.AdRequest(user_id=u, ts=2_000_000_000) for u in range(1, 31)]
    full = Retriever(model.net, model.features, index).retrieve(requests, k=10).results
    kept = model.features.online(max_len=model.net.cfg.max_len)
    got = Retriever(model.net, kept, index).retrieve(requests, k=10).results
    for g, w in zip(got, full, strict=True):
        np.testing.assert_array_equal(g.ad_ids, w.ad_ids)
        np.testing.assert_array_equal(g.scores, w.scores)
    # Saved and loaded: the same features.
    saved = beauty / "online-copy"
    kept.save(saved)
    back = Features.load(saved)
    assert back.is_online and back.splits == {}
    np.testing.assert_array_equal(back.engagements.offsets, kept.engagements.offsets)
    np.testing.assert_array_equal(back.users["age"], model.features.users["age"])


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_last_events_match_a_plain_reference(n):
    rng = np.random.default_rng(n)
    user = rng.integers(0, 7, size=40)
    ts = rng.integers(0, 10, size=40)  # ties in time keep their input order
    seq = EventSequences.from_events(user, ts, 9, item=np.arange(40))
    last = seq.last(n)
    for u in range(9):
        run_ = slice(seq.offsets[u], seq.offsets[u + 1])
        want = seq.values["item"][run_][max(0, run_.stop - run_.start - n) :] if n else []
        got = last.values["item"][last.offsets[u] : last.offsets[u + 1]]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(
            last.ts[last.offsets[u] : last.offsets[u + 1]],
            seq.ts[run_][len(seq.ts[run_]) - len(want) :] if n else [],
        )


def test_a_server_needs_the_index_and_the_checkpoint_alone(beauty, tmp_path):
    data = beauty / "data" / "beauty"
    ckpt = beauty / "runs" / "beauty.pt"
    run("index", "build", "--data", data, "--model", ckpt, "--out", tmp_path / "index")
    state = serving_folder(tmp_path / "index", tmp_path / "state")
    hidden = data.rename(beauty / "hidden")
    try:
        loaded = load_engine(state, ckpt)
        try:
            out = loaded.retriever.retrieve([m31.AdRequest(user_id=7)], k=5)
            assert len(out.results[0].ad_ids) == 5
        finally:
            loaded.close()
        with m31.Engine.open(tmp_path / "index", ckpt) as engine:  # a snapshot, in memory
            assert len(engine.retrieve(m31.AdRequest(user_id=7), k=5).ad_ids) == 5
    finally:
        hidden.rename(data)
    assert not any((data / "features").glob("*/online*"))


def test_an_index_without_online_features_is_refused_by_name(beauty, tmp_path):
    data = beauty / "data" / "beauty"
    model = m31.load_model(beauty / "runs" / "beauty.pt", data=data)
    old = m31.build_index(model).save(tmp_path / "old")  # a snapshot alone, as before
    with pytest.raises(FileNotFoundError, match=r"old/online: missing.*m31 index build"):
        serving_folder(old, tmp_path / "state")
    assert not (tmp_path / "state").exists()
    with pytest.raises(FileNotFoundError, match="online: missing"):
        copy_online(old, tmp_path / "cluster")
    result = runner.invoke(app, ["serve", "--index", str(old), "--model",
                                 str(beauty / "runs" / "beauty.pt")])  # fmt: skip
    assert result.exit_code == 2 and "m31 index build" in result.output
    assert isinstance(AdIndex.load(old), AdIndex)


def test_import_m31_is_light_and_lists_its_api():
    import subprocess
    import sys

    code = "import m31, sys; print('torch' in sys.modules); print(sorted(m31.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, names = out.stdout.splitlines()
    assert loaded == "False"
    for name in ("Engine", "load_model", "build_index", "AdRequest", "InlineUser"):
        assert name in names
    with pytest.raises(AttributeError, match="no attribute 'Requests'"):
        m31.Requests  # noqa: B018
