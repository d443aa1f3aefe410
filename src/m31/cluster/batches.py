"""The batcher's batches over the shards (DESIGN §7, "Failure and partial answers"): each call
of a batch (a chunk) is answered on its own, as soon as the shards it needs answered: all of
them for a call that wants a whole answer, those that are not down for one that allows a
partial answer. A chunk still waiting just before its own deadline is answered then (503
naming the missing shards, or the partial answer).

Where the batcher settles a chunk later (`DynamicBatcher.deferred_results`: `defer`), the
batch's device call ends once only chunks waiting for shards that are down are left, or once a
shard is slower than a straggler (`STRAGGLER_S`, or `STRAGGLER_FACTOR` times a typical batch):
those chunks are handed to a waiter thread, and the calls behind them run meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from m31.cluster.cluster import Cluster
from m31.cluster.read import Gathered, Read, ready
from m31.index.errors import Unavailable
from m31.serve.backend import Ask, Part
from m31.serve.schemas import Ranked

# A chunk still waiting is answered this share of its time before its deadline (within the
# bounds below), so that the answer (503 naming the shards, or partial) reaches its handler
# before the batcher's own timer answers 504 naming nothing.
ANSWER_MARGIN_SHARE = 0.1
ANSWER_MARGIN_S = (0.05, 0.5)
# The device call of a batch ends (its waiting chunks handed to the waiter) once it waited this
# long, or this many times a typical batch's gather, for a shard not known to be down (a
# stopped shard fails no call); a typical gather weighs the last ones by STRAGGLER_MEMORY.
STRAGGLER_S = 0.25
STRAGGLER_FACTOR = 4.0
STRAGGLER_MEMORY = 0.9
# How often the waiter looks for batches handed to it while it waits on Ray.
WAITER_POLL_S = 0.05


class Batches:
    """The reads of an ingress's batches over one `Cluster`; `gathered` is told of every
    answer a chunk is given (its version, the rows it scored)."""

    def __init__(self, cluster: Cluster, gathered: Callable[[Gathered], None]) -> None:
        self.cluster, self.gathered = cluster, gathered
        self._typical_s = 0.0  # a batch's gather, when every shard answers
        self._waiter: _Waiter | None = None
        self._waiter_lock = threading.Lock()

    def run(
        self,
        query: tuple[np.ndarray, np.ndarray, np.ndarray],
        chunks: Sequence[Sequence[Ask]],
        encode_ms: float,
        defer: bool,
        explain: tuple[dict[int, tuple], list[str]] | None = None,
    ) -> list[Part | BaseException | concurrent.futures.Future]:
        """Scatter the batch's encoded `query` (q, v, p [B, E, *]) and answer each chunk: its
        part, its exception, or (`defer`) a Future the waiter settles. `explain`: the query per
        expert slot of each request that asks for an explanation, by its row in the batch, and
        the slots' names."""
        prepared = [a.prepared for chunk in chunks for a in chunk]
        read = self.cluster.scatter(
            query,
            [(one.request, dict(one.targeting), one.clauses) for one in prepared],
            [one.k for one in prepared],
            explain,
        )
        parts = _chunks(chunks)
        batch = _Batch(self, read, parts, len(prepared), encode_ms)
        straggler_at = time.monotonic() + max(STRAGGLER_S, STRAGGLER_FACTOR * self._typical_s)
        while True:
            try:
                batch.settle()
            except Exception as e:  # a shard's bug: every chunk fails with it
                batch.settle(e)
            if not batch.open:
                break
            if defer and (time.monotonic() >= straggler_at or batch.waits_only_for_down()):
                for chunk in batch.open:
                    chunk.future = concurrent.futures.Future()
                self._waiting().add(batch)
                break
            until = batch.next_deadline()
            if defer:
                until = min(until, straggler_at)
            try:
                read.wait(until)
            except Exception as e:
                batch.settle(e)
        return [c.future if c.future is not None else c.answer for c in parts]

    def observe(self, seconds: float) -> None:
        """A whole gather took `seconds`: what a typical batch takes."""
        keep = STRAGGLER_MEMORY if self._typical_s else 0.0
        self._typical_s = keep * self._typical_s + (1 - keep) * seconds

    def _waiting(self) -> _Waiter:
        with self._waiter_lock:
            if self._waiter is None:
                self._waiter = _Waiter()
            return self._waiter


def _chunks(chunks: Sequence[Sequence[Ask]]) -> list[_Chunk]:
    """Each call's rows of the batch, and when it is answered with what there is."""
    now, parts, at = time.monotonic(), [], 0
    for chunk in chunks:
        left = chunk[0].deadline - now
        margin = min(max(ANSWER_MARGIN_SHARE * left, ANSWER_MARGIN_S[0]), ANSWER_MARGIN_S[1])
        rows = range(at, at + len(chunk))
        ks = [a.prepared.k for a in chunk]
        parts.append(_Chunk(rows, ks, chunk[0].deadline - margin, chunk[0].allow_partial))
        at += len(chunk)
    return parts


@dataclass
class _Chunk:
    """One call's part of a batch: its requests (rows of the batch), deadline and policy."""

    rows: range
    ks: list[int]
    answer_at: float  # monotonic seconds: when it is answered with what there is
    allow_partial: bool
    answer: Any = None  # the part, or the exception, once settled
    settled: bool = False
    future: concurrent.futures.Future | None = None  # when handed to the waiter


class _Batch:
    """The chunks of one batch over one `Read`; `settle` answers those that can be."""

    def __init__(
        self, batches: Batches, read: Read, chunks: list[_Chunk], size: int, encode_ms: float
    ) -> None:
        self.batches, self.read, self.chunks, self.size = batches, read, chunks, size
        self.encode_ms, self.start = encode_ms, time.perf_counter()
        self.observed = False

    @property
    def open(self) -> list[_Chunk]:
        return [c for c in self.chunks if not c.settled]

    def next_deadline(self) -> float:
        return min(c.answer_at for c in self.open)

    def waits_only_for_down(self) -> bool:
        """Whether every open chunk waits only for shards (or a coordinator) known to be down,
        which no amount of waiting here will bring sooner."""
        read = self.read
        if read.point is None:
            return read.coordinator_failed
        return set(read.missing()) <= read.down()

    def settle(self, error: BaseException | None = None) -> None:
        """Answer each open chunk that has what it needs, or whose time is up (or `error`)."""
        read, now = self.read, time.monotonic()
        everyone = range(read.n)
        late = False
        for chunk in self.open:
            if error is not None:
                self._answer(chunk, error)
                continue
            need = everyone if not chunk.allow_partial else set(everyone) - read.down()
            if read.complete(need):
                self._answer(chunk, self._part(chunk))
            elif now >= chunk.answer_at:
                late = True
                self._answer(chunk, self._late(chunk))
        if late:
            read.overdue()
        if not self.open and not self.observed and not read.missing():
            # A whole gather, on the device call or the waiter: what a typical batch takes.
            self.observed = True
            self.batches.observe(time.perf_counter() - self.start)

    def _late(self, chunk: _Chunk) -> Part | Unavailable:
        """The answer of a chunk whose time is up: what there is, if it allows a partial
        answer and the read has a read point, else what is missing."""
        read = self.read
        if read.point is None:
            return Unavailable(
                "the coordinator did not answer within the deadline (down or restarting)"
            )
        if chunk.allow_partial:
            return self._part(chunk)
        missing = read.missing()
        return Unavailable(
            f"shards {missing} did not answer within the deadline (down or restarting); pass "
            "allow_partial: true for an answer without them",
            missing,
        )

    def _part(self, chunk: _Chunk) -> Part:
        out = self.read.gathered(chunk.rows, chunk.ks)
        self.batches.gathered(out)
        timings = {
            "encode": self.encode_ms,
            **out.timings_ms,
            "gather": round(1000 * (time.perf_counter() - self.start), 3),
        }
        results = [
            Ranked(
                ad_ids=r.ad_ids.tolist(),
                scores=r.scores.tolist(),
                explanation=None if e is None else dataclasses.asdict(e),
            )
            for r, e in zip(out.results, out.explanations, strict=True)
        ]
        return results, out.version, timings, self.size, out.missing

    def _answer(self, chunk: _Chunk, answer) -> None:
        chunk.answer, chunk.settled = answer, True
        if chunk.future is not None:
            if isinstance(answer, BaseException):
                chunk.future.set_exception(answer)
            else:
                chunk.future.set_result(answer)


class _Waiter:
    """One thread that drives the reads of batches handed over by their device calls, until
    every chunk of each is answered."""

    def __init__(self) -> None:
        self._new: list[_Batch] = []
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="m31-waiter", daemon=True)
        self._thread.start()

    def add(self, batch: _Batch) -> None:
        with self._wake:
            self._new.append(batch)
            self._wake.notify()

    def _run(self) -> None:
        batches: list[_Batch] = []
        while True:
            with self._wake:
                if not batches and not self._new:
                    self._wake.wait()
                batches += self._new
                self._new.clear()
            try:
                self._step(batches)
            except Exception as e:  # not a shard's: its calls fail with it, the thread goes on
                for b in batches:
                    b.settle(e)
            batches = [b for b in batches if b.open]

    @staticmethod
    def _step(batches: list[_Batch]) -> None:
        """Take what came for any batch (waiting up to the next deadline, or the poll for new
        batches), then answer what can be."""
        owner = {b.read: b for b in batches}
        wake = min(b.next_deadline() for b in batches)
        timeout = max(min(wake - time.monotonic(), WAITER_POLL_S), 0.0)
        if any(read.calls for read in owner):
            for read, call in ready(list(owner), timeout):
                try:
                    read.take(call)
                except Exception as e:  # a shard's bug: the batch's calls fail with it
                    owner[read].settle(e)
        else:
            time.sleep(timeout)
        for b in batches:
            if b.open:
                b.settle()
