"""`LocalBackend`: the `Backend` of one process (`m31 serve`): the engine over one durable index,
loaded whole (`m31.engine.load`). Retrieval batches run on the batcher's device thread,
mutations one at a time on the app's writer thread through the `DurableIndex` (DESIGN §7,
"Durability of writes")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from m31.engine import Retriever
from m31.engine.ad_encoder import AdEncoder
from m31.engine.load import load_engine
from m31.index import AdIndexError, DurableIndex
from m31.index.errors import NotFound
from m31.serve.backend import Ask, Part
from m31.serve.bodies import ad_attributes, encode_ads, event_columns, user_codes
from m31.serve.config import ServeConfig
from m31.serve.schemas import AdIn, EventIn, Ranked, UserAttributesIn, check_bounds


class LocalBackend:
    """The loaded parts: engine, durable index, ad encoder."""

    writers = 1  # the DurableIndex has one writer

    def __init__(self, retriever: Retriever, store: DurableIndex, encoder: AdEncoder) -> None:
        self.retriever, self.store, self.encoder = retriever, store, encoder

    @classmethod
    def load(cls, config: ServeConfig) -> LocalBackend:
        engine = load_engine(config.index, config.model, config.device, config.probe)
        try:
            # Now, not on the first upsert: loading the sentence model takes seconds to a minute.
            engine.encoder.load_text_encoder()
        except BaseException:
            engine.close()
            raise
        return cls(engine.retriever, engine.store, engine.encoder)

    # -- state ----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.store.version

    @property
    def ads(self) -> int:
        return len(self.store.index)

    @property
    def rows(self) -> int:
        return self.store.index.num_rows

    @property
    def users(self) -> int:
        return len(self.retriever.users)

    def stats(self) -> tuple[int, int, int]:
        return self.ads, self.rows, self.version

    def reached(self, version: int) -> bool:
        return self.store.version >= version

    def close(self) -> None:
        self.store.close()

    # -- retrieval: one engine call per batch of HTTP calls -------------------------------------

    def retrieve_batch(self, chunks: Sequence[Sequence[Ask]]) -> list[Part]:
        """The prepared requests of the batch's chunks in one engine call, then split, a part
        per chunk. Each request gets its own k of the exact top-K (`Retriever.retrieve`)."""
        requests = [a.prepared for chunk in chunks for a in chunk]
        out = self.retriever.retrieve(requests)
        answers, at = [], 0
        for chunk in chunks:
            results = [
                Ranked(
                    ad_ids=r.ad_ids.tolist(),
                    scores=r.scores.tolist(),
                    explanation=None if r.explanation is None else asdict(r.explanation),
                )
                for r in out.results[at : at + len(chunk)]
            ]
            at += len(chunk)
            answers.append((results, out.version, out.timings_ms, len(requests), []))
        return answers

    # -- reads and mutations (mutations on the writer thread) -----------------------------------

    def get_ad(self, ad_id: int) -> tuple[dict, int]:
        index = self.store.index
        try:
            with index.snapshot_view() as view:
                return index.get(ad_id).attributes, view.version
        except AdIndexError as e:
            raise NotFound(str(e)) from e

    def upsert(self, ads: list[AdIn]) -> int:
        g, x, b = encode_ads(self.encoder, ads)
        attributes = ad_attributes(self.retriever, ads)
        return self.store.upsert([a.ad_id for a in ads], g, x, b, attributes)

    def update(self, ad_id: int, changes: Mapping[str, Any]) -> int:
        """On the writer thread, so no other write comes between the range check against the
        stored ad and the change."""
        if ad_id not in self.store.index:
            raise NotFound(f"ad id {ad_id} is not in the index")
        check_bounds(changes, self.store.index.get(ad_id).attributes)
        return self.store.update_attributes(ad_id, **changes)

    def delete(self, ad_id: int) -> int:
        if ad_id not in self.store.index:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self.store.delete([ad_id])

    def snapshot(self) -> int:
        return self.store.snapshot()

    # -- users ----------------------------------------------------------------------------------

    def add_events(self, events: list[EventIn], key: str | None) -> int:
        """Logged, then added to the user store."""
        users, ads, ts, surfaces, types, weights = event_columns(events)
        return self.store.add_events(users, ads, ts, surfaces, key, types=types, weights=weights)

    def set_users(self, users: list[UserAttributesIn]) -> int:
        return self.store.set_users(user_codes(self.retriever, users))
