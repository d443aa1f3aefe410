"""The engine as the service drives it: retrieval batches from the batcher, and mutations on
the writer thread. Everything here runs off the event loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from m31.engine import PreparedRequest, Retriever
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.engine.load import load_engine
from m31.index import DurableIndex
from m31.serve.config import ServeConfig
from m31.serve.schemas import AdIn, Ranked, check_bounds


class Service:
    """The loaded parts: engine, durable index, ad encoder (`m31.engine.load`)."""

    def __init__(self, retriever: Retriever, store: DurableIndex, encoder: AdEncoder) -> None:
        self.retriever, self.store, self.encoder = retriever, store, encoder

    @classmethod
    def load(cls, config: ServeConfig) -> Service:
        engine = load_engine(config.index, config.model, config.data, device=config.device)
        try:
            # Now, not on the first upsert: loading the sentence model takes seconds to a minute.
            engine.encoder.load_text_encoder()
        except BaseException:
            engine.close()
            raise
        return cls(engine.retriever, engine.store, engine.encoder)

    # -- retrieval: one call per batch of HTTP calls ------------------------------------------

    def retrieve_batch(self, chunks: Sequence[Sequence[PreparedRequest]]):
        """The prepared requests of the batch's chunks in one engine call, then split: per chunk
        (results, index version, timings, requests in the engine call). Each request gets its
        own k of the exact top-K (`Retriever.retrieve`)."""
        requests = [r for chunk in chunks for r in chunk]
        out = self.retriever.retrieve(requests)
        answers, at = [], 0
        for chunk in chunks:
            results = [
                Ranked(ad_ids=r.ad_ids.tolist(), scores=r.scores.tolist())
                for r in out.results[at : at + len(chunk)]
            ]
            at += len(chunk)
            answers.append((results, out.version, out.timings_ms, len(requests)))
        return answers

    @staticmethod
    def assemble(parts: Sequence[tuple[list[Ranked], int, dict[str, float], int]]):
        """One call's (results, index version, timings, batch requests) from its chunks' parts.

        A call larger than a batch runs in several engine calls, each at one version: the
        oldest is reported (every request saw it or a newer one), timings add up, and the
        batch size is the largest.
        """
        timings = {stage: round(sum(p[2][stage] for p in parts), 3) for stage in parts[0][2]}
        results = [r for p in parts for r in p[0]]
        return results, min(p[1] for p in parts), timings, max(p[3] for p in parts)

    # -- mutations ------------------------------------------------------------------------------

    def upsert(self, ads: list[AdIn]) -> int:
        new = [
            NewAd(
                a.ad_id,
                a.advertiser_id,
                a.objective,
                a.format,
                a.topic,
                a.category,
                a.text,
                a.quality,
            )
            for a in ads
        ]
        self.encoder.check(new)  # ValueError naming ads[i].field before any work
        g, x, b = self.encoder.encode(new)
        schema = self.store.index.schema
        attributes = []
        for a in ads:
            given = a.model_dump()
            attributes.append({name: given.get(name) for name in schema})
        return self.store.upsert([a.ad_id for a in ads], g, x, b, attributes)

    def update(self, ad_id: int, changes: Mapping[str, Any]) -> int:
        """Change some attributes of one ad. A range with one end changed is checked against
        the ad's other end; on the writer thread, so no other write comes in between."""
        check_bounds(changes, self.store.index.get(ad_id).attributes)
        return self.store.update_attributes(ad_id, **changes)
