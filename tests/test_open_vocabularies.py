"""A dataset's categorical values are its own data: a world whose surfaces, platforms, formats
and genders are not the built-in marketplace's validates, trains, indexes and serves without a
code change; the model's vocabularies decide what a request may name (422 listing them), the
OpenAPI schema lists them, and a value first seen online on an ad is the unknown value."""

from __future__ import annotations

import json

import httpx
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from serve_helpers import ADMIN, ThreadServer, new_ad

from m31.data import dataset
from m31.data.dataset import DatasetError, vocabularies
from m31.data.validate import validate
from m31.engine import AdRequest, RequestError, Retriever
from m31.engine.build import build_snapshot
from m31.engine.load import serving_folder
from m31.features.folder import features_for
from m31.index import AdIndexError
from m31.model import build_model, model_preset, save_checkpoint, vocab_sizes
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend

# The built-in world's values, renamed into another team's: (column vocabulary, old, new).
RENAMED = {
    "surface": {"feed": "watch"},
    "platform": {"web": "tv"},
    "format": {"video": "story_ad"},
    "gender": {"F": "female", "M": "male"},
}
COLUMNS = {  # (table, column) -> the vocabulary its values come from
    ("users", "gender"): "gender",
    ("users", "platform"): "platform",
    ("ads", "format"): "format",
    ("ads", "target_genders"): "gender",
    ("ads", "target_platforms"): "platform",
    ("events", "surface"): "surface",
    ("events", "platform"): "platform",
}


def _renamed(column: pa.ChunkedArray, mapping: dict[str, str]) -> pa.ChunkedArray:
    def one(values: pa.Array) -> pa.Array:
        for old, new in mapping.items():
            values = pc.replace_substring_regex(values, f"^{old}$", new)
        return values

    if pa.types.is_list(column.type):
        flat = column.combine_chunks()
        return pa.ListArray.from_arrays(flat.offsets, one(flat.flatten()))
    return one(column.combine_chunks())


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_world):
    """The tiny world with renamed values (and a declared gender no user has), its features,
    an untrained tiny moe and the index it makes."""
    root = tmp_path_factory.mktemp("open-vocab")
    ds = tiny_world.ds
    tables = {name: ds.table(name) for name in dataset.TABLES}
    for (name, column), vocab in COLUMNS.items():
        t = tables[name]
        i = t.schema.get_field_index(column)
        tables[name] = t.set_column(i, t.schema.field(i), _renamed(t[column], RENAMED[vocab]))
    meta = dict(ds.meta)
    meta["vocab"] = {
        name: [RENAMED.get(name, {}).get(v, v) for v in values]
        for name, values in ds.meta["vocab"].items()
    }
    meta["vocab"]["gender"].append("nonbinary")
    data = root / "world"
    dataset.save(dataset.Dataset(**tables, meta=meta), data)
    feats = features_for(data)
    torch.manual_seed(0)
    model = build_model(
        model_preset("tiny", "moe"),
        vocab_sizes(feats),
        feats.text_emb.shape[1],
        feats.cooc_emb.shape[1],
    ).eval()
    ckpt = save_checkpoint(root / "runs" / "moe.pt", model, feats, [])
    snapshot = root / "index"
    index = build_snapshot(data, ckpt, snapshot)
    return root, data, feats, model, ckpt, index, snapshot


def test_declared_values_validate_and_size_the_model(world):
    _, data, feats, model, *_ = world
    report = validate(data)
    assert not report.errors, report.errors
    vocab = vocabularies(json.loads((data / "meta.json").read_text()))
    assert vocab["surface"][0] == "watch" and "feed" not in vocab["surface"]
    assert feats.meta["vocab"]["gender"] == ["female", "male", "nonbinary"]
    # One row per value and one for the unknown value, which stays zero.
    assert model.user.gender.num_embeddings == 4
    assert not model.user.gender.weight[-1].any()
    assert model.user.context.surface.num_embeddings == len(vocab["surface"]) + 1


def test_a_declared_vocabulary_is_checked():
    for bad in ({"surface": "feed"}, {"surface": ["feed", "feed"]}, {"surface": [""]}, [1]):
        with pytest.raises(DatasetError, match=r"meta\.json: vocab"):
            vocabularies({"vocab": bad})
    # A folder written before vocabularies were declared keeps the built-in marketplace's.
    assert "feed" in vocabularies({})["surface"]
    # One that declares some has no values for the others.
    assert vocabularies({"vocab": {"surface": ["watch"]}})["format"] == ()


def test_requests_name_the_models_values(world):
    _, _data, feats, model, _, index, _ = world
    engine = Retriever(model, feats, index)
    user = int(feats.users["user_id"][0])
    ts = int(feats.meta["time_range"][1])
    out = engine.retrieve([AdRequest(user, ts, "watch", "tv")], k=10)
    assert len(out.results[0].ad_ids) == 10
    with pytest.raises(RequestError, match=r"requests\[0\]\.surface: 'feed' is not one of watch"):
        engine.retrieve([AdRequest(user, ts, "feed", "tv")], k=10)
    # Targeting lists hold the model's values: the index was built with them.
    assert index.targeting["target_platforms"] == tuple(feats.meta["vocab"]["platform"])
    zeros = torch.zeros(1, index.dim_g)
    with pytest.raises(AdIndexError, match="target_platforms 'web' is not one of"):
        index.upsert([10**9], zeros, torch.zeros(1, index.dim_x), torch.zeros(1),
                     [{"advertiser_id": 1, "target_platforms": ["web"]}])  # fmt: skip


def values(prop: dict) -> dict:
    """The string schema of a property that may also be null (`anyOf` [string, null])."""
    return next(p for p in prop.get("anyOf", [prop]) if p.get("type") == "string")


def test_the_server_lists_and_checks_the_models_values(world):
    _root, _data, feats, _, ckpt, _, snapshot = world
    config = ServeConfig(index=serving_folder(snapshot), model=ckpt, admin_token=ADMIN)
    with ThreadServer(create_app(config, LocalBackend.load)) as s:
        schema = httpx.get(f"{s.url}/openapi.json").json()["components"]["schemas"]
        request = schema["RetrieveRequest"]["properties"]
        assert values(request["surface"])["enum"] == feats.meta["vocab"]["surface"]
        assert values(request["platform"])["enum"] == feats.meta["vocab"]["platform"]
        assert "story_ad" in values(schema["AdIn"]["properties"]["format"])["description"]
        user = int(feats.users["user_id"][0])
        ok = {"user_id": user, "surface": "watch", "platform": "tv", "k": 5}
        r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [ok]})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [{**ok, "surface": "feed"}]})
        assert r.status_code == 422
        assert r.json()["detail"].startswith("requests[0].surface: 'feed' is not one of watch")
        auth = {"Authorization": f"Bearer {ADMIN}"}
        # A format first seen online is taken (the unknown value); a platform the targeting
        # vocabulary does not hold is refused, naming it.
        ad = new_ad(900_001, "new", format="hologram", target_platforms=["tv"])
        r = httpx.put(f"{s.url}/v1/ads", json={"ads": [ad]}, headers=auth)
        assert r.status_code == 200, r.text
        ad = new_ad(900_002, "new", target_platforms=["web"])
        r = httpx.put(f"{s.url}/v1/ads", json={"ads": [ad]}, headers=auth)
        assert r.status_code == 422 and "target_platforms 'web'" in r.json()["detail"]
