"""Offline: the ad index a trained retrieval model makes of a dataset's catalogue.

    dataset folder + checkpoint -> ad tower over every ad -> AdIndex -> snapshot folder

This is `m31 index build`, and what `make demo` runs; the snapshot records the checkpoint's
hash, so that a server started on it can tell whether its model made it, and carries the online
features in `online/` (`m31.engine.load`), so that a server needs nothing else. The extra
attribute columns a dataset declares (meta.json `item_attributes`) become filter fields of the
index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from m31.data import dataset
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.engine.load import ONLINE, model_and_features, write_online
from m31.features import Features
from m31.index import AdIndex
from m31.index.ad_index import TARGETING_VOCAB
from m31.index.hierarchical import Clusters
from m31.model import Catalog, RetrievalModel, checkpoint_hash, encode_ads
from m31.pipeline import embedding_cache_dir


def index_from_model(data: Path, model: RetrievalModel, feats, dtype=torch.bfloat16) -> AdIndex:
    """The index of every ad of the dataset folder `data`, encoded by `model`'s ad tower, with
    the dataset's item attributes as extra filter fields."""
    extra = dataset.item_attributes(json.loads((Path(data) / "meta.json").read_text()))
    ads = pq.read_table(Path(data) / "ads.parquet")
    return index_of(ads, model, feats, dtype, extra)


def index_of(
    ads: pa.Table,
    model: RetrievalModel,
    feats: Features,
    dtype: torch.dtype = torch.bfloat16,
    extra: Mapping[str, str] | None = None,
) -> AdIndex:
    """The index of the ads of `ads` (a table of the ads schema, with the `extra` attribute
    columns: name -> kind, and `bid`, `pacing` where it has them), encoded by `model`'s ad
    tower: an ad of its catalogue (`feats`) from its features, another from the table's columns
    as the server encodes an upserted ad (`m31.engine.ad_encoder`: no co-engagement history)."""
    given, ads = ads, dataset.conform("ads", ads, extra or {})
    for name in ("bid", "pacing"):  # the value fields (DESIGN §2), which no dataset column feeds
        if name in given.column_names:
            ads = ads.append_column(name, given.column(name))
    ids = ads["ad_id"].to_numpy()
    known = feats.ads["ad_id"]
    order = np.argsort(known, kind="stable")
    pos = np.minimum(np.searchsorted(known[order], ids), max(len(known) - 1, 0))
    listed = known[order][pos] == ids if len(known) else np.zeros(len(ids), bool)  # [n]
    device = next(model.parameters()).device
    g, x, b = torch.empty(len(ids), model.G), torch.empty(len(ids), model.D), torch.empty(len(ids))
    if listed.any():
        catalog = Catalog.from_features(feats).to(device)
        rows = torch.as_tensor(order[pos][listed], device=device)
        at = torch.from_numpy(listed)
        g[at], x[at], b[at] = (t.cpu() for t in encode_ads(model, catalog.take(rows)))
    if not listed.all():
        fields = ("ad_id", "advertiser_id", "objective", "format", "topic", "category", "text")
        new = ads.filter(pa.array(~listed)).to_pylist()
        ads_ = [NewAd(**{f: a[f] for f in fields}, quality=a["quality"], attributes=a) for a in new]
        encoder = AdEncoder(model, feats, embedding_cache_dir())
        at = torch.from_numpy(~listed)
        g[at], x[at], b[at] = (t.cpu() for t in encoder.encode(ads_))
    vocab = feats.meta["vocab"]
    targeting = {name: vocab[v] for name, v in TARGETING_VOCAB.items()}
    return AdIndex.from_table(
        ads, g, x, b, dtype=dtype, targeting=targeting, extra_fields=dict(extra or {})
    )


def build_index(
    data: Path,
    model_path: Path,
    out: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    clusters: int = 0,
) -> AdIndex:
    """Encode the catalogue of `data` with the checkpoint's ad tower; snapshot it into `out`,
    with the online features and, with `clusters` > 0, the k-means clusters of a hierarchical
    index (`m31.index.hierarchical`) among them."""
    model, feats = model_and_features(model_path, data, device)
    if not isinstance(model, RetrievalModel):
        raise ValueError(
            f"--model: {model_path} is a {model.cfg.kind} model, whose score no index can "
            "hold (moe, two-tower)"
        )
    index = index_from_model(data, model, feats, dtype)
    index.model_hash = checkpoint_hash(model_path)
    if clusters < 0 or clusters > len(index):
        raise ValueError(f"--clusters: must be in [0, {len(index)}] (the ads), got {clusters}")
    found = Clusters.build(index.frozen_view(), clusters) if clusters else None

    def beside(folder: Path) -> None:
        write_online(folder, feats, model.cfg.max_len)
        if found is not None:
            found.save(folder / ONLINE)

    index.save(out, model_hash=index.model_hash, overwrite=overwrite, beside=beside)
    return index
