"""Online: what a server (or one shard of a cluster) needs to start, from the files on disk.

    serving folder (snapshot + write-ahead log) + checkpoint + dataset folder
        -> Retriever (model, features, users, index) + DurableIndex + AdEncoder

The index must have been made by a model with the checkpoint's dimensions; a different
checkpoint hash is allowed (a retrained model of the same shape) but logged, since scores then
mix two models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from m31.engine.ad_encoder import AdEncoder
from m31.engine.retriever import Retriever
from m31.features import Features
from m31.index import DurableIndex
from m31.model import checkpoint_hash, load_checkpoint
from m31.model.checkpoint import check_trained_on
from m31.pipeline import embedding_cache_dir, features_for

log = logging.getLogger("m31.engine")


@dataclass
class LoadedEngine:
    retriever: Retriever
    store: DurableIndex  # owns the serving folder's lock: close it
    encoder: AdEncoder

    def close(self) -> None:
        self.store.close()


def load_model(model: Path, data: Path, device: str = "cpu") -> tuple:
    """(model, features): the checkpoint and the features of `data` for the split it was
    trained on (the features hold every user's history, not just the train part)."""
    net, blob = load_checkpoint(Path(model), device=device)
    feats: Features = features_for(Path(data), split=blob["split"]["name"])
    check_trained_on(blob, feats, Path(model))
    return net, feats


def load_engine(index: Path, model: Path, data: Path, device: str = "cpu") -> LoadedEngine:
    """Open the serving folder `index` and the model that made it, ready to answer."""
    net, feats = load_model(model, data, device)
    users = pq.read_table(Path(data) / "users.parquet")  # targeting: country, age…
    store = DurableIndex.open(index, device=device)
    try:
        if store.index.dim_g != net.G or store.index.dim_x != net.D:
            raise ValueError(
                f"{index}: index vectors are G = {store.index.dim_g}, D = {store.index.dim_x}; "
                f"the model's are G = {net.G}, D = {net.D}"
            )
        digest, made_by = checkpoint_hash(model), store.index.model_hash
        if made_by is not None and made_by != digest:
            log.warning(
                "the index was made by checkpoint %s, not %s (%s): scores mix two models",
                made_by, digest, model,
            )  # fmt: skip
        retriever = Retriever(net, feats, store.index, users)
    except BaseException:
        store.close()
        raise
    return LoadedEngine(retriever, store, AdEncoder(net, feats, embedding_cache_dir()))
