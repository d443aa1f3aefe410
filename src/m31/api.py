"""The library face of m31: a trained model, its index and an engine in a few lines.

    import m31

    model = m31.load_model("runs/beauty.pt", data="data/beauty")    # offline: with its dataset
    index = m31.build_index(model, dtype="int8")                      # its catalogue's ads
    engine = m31.Engine(model, index)
    best = engine.retrieve(m31.AdRequest(user_id=7), k=10)           # ts: now
    engine.save("serving/beauty")                                     # what `m31 serve` starts from
    engine = m31.Engine.open("serving/beauty", "runs/beauty.pt")     # online: no dataset folder

A request names a stored user (`user_id`) or carries one inline (`m31.InlineUser`), in a
serving context (surface, platform: None when unknown) at a time (`ts`, default now), with an
optional filter over the ads' attributes (`m31.index.filters`). Everything here is the engine
`m31 serve` runs (`m31.engine`); this module only assembles it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from m31.data import dataset
from m31.engine.build import index_of
from m31.engine.load import has_online, load_engine, model_and_features, write_online
from m31.engine.requests import AdRequest
from m31.engine.retriever import Retriever
from m31.engine.search import Retrieved
from m31.features import Features
from m31.index import AdIndex, DurableIndex
from m31.index.ad_table import TABLE_DTYPES
from m31.model import RetrievalModel, checkpoint_hash


@dataclass(frozen=True)
class Model:
    """A trained retrieval model with the features it reads (its catalogue and stored users)."""

    net: RetrievalModel
    features: Features
    path: Path  # the checkpoint
    data: Path | None  # the dataset folder it was loaded with; None: loaded from online features

    @property
    def hash(self) -> str:
        """The checkpoint's hash, which the indexes it makes record."""
        return checkpoint_hash(self.path)


def load_model(path: str | Path, data: str | Path, device: str = "cpu") -> Model:
    """The retrieval model of the checkpoint `path`, with the features of `data`: the dataset
    folder it was trained on (features are built into it once), or a folder holding the online
    features (an index snapshot or serving folder that `build_index`, `Engine.save` or
    `m31 index build` wrote)."""
    net, feats = model_and_features(Path(path), Path(data), device)
    if not isinstance(net, RetrievalModel):
        raise ValueError(
            f"{path}: a {net.cfg.kind} model, whose score no index can hold (moe, two-tower)"
        )
    return Model(net, feats, Path(path), None if has_online(Path(data)) else Path(data))


def build_index(model: Model, ads: pa.Table | None = None, dtype: str = "bfloat16") -> AdIndex:
    """The ad index of `ads` (a table of the dataset's ads schema; default: the catalogue of the
    dataset the model was loaded with), encoded by the model's ad tower, its table in `dtype`
    (bfloat16, float32, or int8: per-ad scales, what the CPU kernel reads fastest).

    An ad of the model's catalogue is encoded from its features, a new one from the table's
    columns (`m31.engine.build.index_of`); the dataset's declared item attributes become filter
    fields.
    """
    if dtype not in TABLE_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(TABLE_DTYPES)}")
    extra = {}
    if model.data is not None:
        extra = dataset.item_attributes(json.loads((model.data / "meta.json").read_text()))
        if ads is None:
            ads = dataset.load(model.data).ads
    elif ads is None:
        raise ValueError("ads: give the ads to index (the model was loaded without its dataset)")
    index = index_of(ads, model.net, model.features, TABLE_DTYPES[dtype], extra)
    index.model_hash = model.hash
    return index


class Engine:
    """The top-K eligible ads of requests, from a model and an index (`m31.engine.Retriever`).

    Make one from a model and an index, or `open` a folder `save` (or `m31 index build`) wrote.
    An engine opened on a serving folder holds its lock until `close` (or the `with` block's
    end); the index is then the server's durable one.
    """

    def __init__(self, model: Model, index: AdIndex) -> None:
        self.model, self.index = model, index
        self._retriever = Retriever(model.net, model.features, index)
        self._store: DurableIndex | None = None

    @classmethod
    def open(cls, folder: str | Path, model: str | Path, device: str = "cpu") -> Engine:
        """The engine of an index snapshot (loaded into memory) or a serving folder (opened
        durably, its write-ahead log replayed) with the checkpoint `model`; the folder's online
        features are all it reads besides them: no dataset folder."""
        folder = Path(folder)
        if not DurableIndex.is_folder(folder):
            return cls(load_model(model, folder, device), AdIndex.load(folder, device))
        loaded = load_engine(folder, Path(model), device)
        engine = cls(
            Model(loaded.retriever.model, loaded.retriever.feats, Path(model), None),
            loaded.store.index,
        )
        engine._store = loaded.store
        return engine

    def retrieve(
        self,
        requests: AdRequest | Sequence[AdRequest],
        k: int = 10,
        explain: bool = False,
        why_not: Sequence[int] = (),
    ) -> Retrieved | list[Retrieved]:
        """The top `k` eligible ads of one request (a `Retrieved`: ad ids and scores, best
        first, ties to the lower ad id) or of each of several (a list).

        With `explain`, each answer's `explanation` (`m31.engine.explain.Explanation`) says how
        many ads each eligibility stage left and splits every result's score over the experts;
        with `why_not`, it says for each of those ad ids what kept it out of the answer (as
        `AdRequest(explain=..., why_not=...)` asks per request)."""
        one = isinstance(requests, AdRequest)
        batch = [requests] if one else list(requests)
        if explain or why_not:
            batch = [
                dataclasses.replace(
                    r, explain=r.explain or explain, why_not=tuple(why_not) or r.why_not
                )
                for r in batch
            ]
        results = self._retriever.retrieve(batch, k).results
        return results[0] if one else results

    def save(self, folder: str | Path, overwrite: bool = False) -> Path:
        """Write the index snapshot with the online features into `folder` (atomically): what
        `Engine.open` and `m31 serve --index FOLDER --model CHECKPOINT` start from."""
        return self.index.save(
            folder,
            model_hash=self.model.hash,
            overwrite=overwrite,
            beside=lambda tmp: write_online(tmp, self.model.features, self.model.net.cfg.max_len),
        )

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Engine", "Model", "build_index", "load_model"]
