"""Offline: the ad index a trained retrieval model makes of a dataset's catalogue.

    dataset folder + checkpoint -> ad tower over every ad -> AdIndex -> snapshot folder

This is `m31 index build`, and what `make demo` runs; the snapshot records the checkpoint's
hash, so that a server started on it can tell whether its model made it, and carries the online
features in `online/` (`m31.engine.load`), so that a server needs nothing else. The extra
attribute columns a dataset declares (meta.json `item_attributes`) become filter fields of the
index. `index_from_table` is the adapter from a dataset's ads table to an `AdIndex`, here where
both are known (the index knows no dataset).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from m31.data import dataset
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.engine.load import ONLINE, model_and_features, write_online
from m31.features import Features
from m31.features.embedding_cache import embedding_cache_dir
from m31.index import AdIndex, AdIndexError
from m31.index.checks import shape_of
from m31.index.hierarchical import Clusters
from m31.index.reads import TARGETING_VOCAB
from m31.model import Catalog, RetrievalModel, checkpoint_hash, encode_ads


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
    return index_from_table(
        ads, g, x, b, dtype=dtype, targeting=targeting, extra_fields=dict(extra or {})
    )


# Columns of the dataset's ads table that `index_from_table` keeps for filters.
TABLE_EXTRA_FIELDS: dict[str, str] = {
    "campaign_id": "int",
    "objective": "str",
    "format": "str",
    "topic": "int",
    "category": "int",
}


def index_from_table(
    ads: pa.Table,
    g: Any,
    x: Any,
    b: Any,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    capacity: int = 1024,
    targeting: Mapping[str, Sequence[str]] | None = None,
    extra_fields: Mapping[str, str] | None = None,
) -> AdIndex:
    """An `AdIndex` over a dataset's ads table (`m31.data.schema.ADS`), rows aligned with g, x, b
    (what `m31 index build` and the tests build from).

    The schedule starts at `created_at` (null: open) and never ends; `tags` and
    `target_surfaces` are taken when the table has them and are empty otherwise, as are `bid`
    and `pacing` (null otherwise; checked as the index checks them). Nulls are
    kept as nulls (an open age bound, an ad without an advertiser, a filter that never
    matches). `targeting`: as `AdIndex`'s. `extra_fields`: more columns of the table to keep
    as filter fields, name -> kind (a dataset's `item_attributes`); one named `tags` or
    `target_surfaces` feeds that attribute.
    """
    renamed = {"schedule_start": "created_at"}  # index attribute -> ads table column
    kept = [
        "advertiser_id",
        "status",
        "target_countries",
        "target_age_min",
        "target_age_max",
        "target_genders",
        "target_platforms",
    ]
    optional = ["target_surfaces", "tags", "bid", "pacing", *TABLE_EXTRA_FIELDS]
    extra = dict(extra_fields or {})
    taken = sorted(set(extra) & {"ad_id", *renamed.values(), *kept, *TABLE_EXTRA_FIELDS})
    if taken:
        raise AdIndexError(f"extra field {taken[0]!r} is a column the index reads already")
    # Any other built-in attribute an extra field names is refused by the constructor.
    fed = {k for k, v in extra.items() if k in optional[:2] and v == "str_list"}
    fields = {**TABLE_EXTRA_FIELDS, **{k: v for k, v in extra.items() if k not in fed}}
    missing = [c for c in ["ad_id", *renamed.values(), *kept, *extra] if c not in ads.column_names]
    if missing:
        raise AdIndexError(f"ads table: missing column {missing[0]!r}")
    columns = {name: ads.column(col) for name, col in renamed.items()}
    columns |= {c: ads.column(c) for c in [*kept, *optional, *extra] if c in ads.column_names}
    g_shape, x_shape = shape_of(g), shape_of(x)
    if len(g_shape) != 2 or len(x_shape) != 2:
        raise AdIndexError(f"g and x must be 2-d, got shapes {list(g_shape)}, {list(x_shape)}")
    index = AdIndex(
        g_shape[1],
        x_shape[1],
        device,
        dtype,
        max(capacity, ads.num_rows),
        extra_fields=fields,
        targeting=targeting,
    )
    index.upsert(ads.column("ad_id"), g, x, b, pa.table(columns))
    return index


def build_snapshot(
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
