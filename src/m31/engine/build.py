"""Offline: the ad index a trained retrieval model makes of a dataset's catalogue.

    dataset folder + checkpoint -> ad tower over every ad -> AdIndex -> snapshot folder

This is `m31 index build`, and what `make demo` runs; the snapshot records the checkpoint's
hash, so that a server started on it can tell whether its model made it. The extra attribute
columns a dataset declares (meta.json `item_attributes`) become filter fields of the index.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch

from m31.data import dataset
from m31.engine.load import load_model
from m31.index import AdIndex
from m31.index.ad_index import TARGETING_VOCAB
from m31.model import Catalog, RetrievalModel, checkpoint_hash, encode_ads


def index_from_model(data: Path, model: RetrievalModel, feats, dtype=torch.bfloat16) -> AdIndex:
    """The index of every ad of the dataset folder `data`, encoded by `model`'s ad tower, with
    the dataset's item attributes as extra filter fields."""
    extra = dataset.item_attributes(json.loads((Path(data) / "meta.json").read_text()))
    ads = dataset.conform("ads", pq.read_table(Path(data) / "ads.parquet"), extra)
    catalog = Catalog.from_features(feats).to(next(model.parameters()).device)
    g, x, b = encode_ads(model, catalog)
    vocab = feats.meta["vocab"]
    targeting = {name: vocab[v] for name, v in TARGETING_VOCAB.items()}
    return AdIndex.from_table(
        ads, g.cpu(), x.cpu(), b.cpu(), dtype=dtype, targeting=targeting, extra_fields=extra
    )


def build_index(
    data: Path,
    model_path: Path,
    out: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> AdIndex:
    """Encode the catalogue of `data` with the checkpoint's ad tower; snapshot it into `out`."""
    model, feats = load_model(model_path, data, device)
    if not isinstance(model, RetrievalModel):
        raise ValueError(
            f"--model: {model_path} is a {model.cfg.kind} model, which has no ad tower"
        )
    index = index_from_model(data, model, feats, dtype)
    index.model_hash = checkpoint_hash(model_path)
    index.save(out, model_hash=index.model_hash, overwrite=overwrite)
    return index
