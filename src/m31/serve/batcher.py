"""The dynamic batcher between HTTP handlers and the device (DESIGN §7).

Handlers `submit` calls (one HTTP call: a list of requests) and await their results. One worker
task drains the queue: it takes requests from the queued calls in arrival order until the batch
holds `max_batch_size` requests or `max_queue_delay_ms` have passed since its first call came,
and runs the batch on a single-thread executor (the event loop never blocks on the device, and
the device sees one batch at a time).

A call larger than the room left in a batch is cut: the batch takes what fits and the rest of
the call rejoins the queue behind the calls that came while the batch ran, so one large call
never holds the device for more than one batch at a time and other calls interleave with its
chunks. The call's answer is the run function's results for its chunks, in order.

Admission is decided from the work queued right now and a cost model of the device (seconds per
device call = fixed + per request × requests, fitted to the recent calls; see `_CostModel`).
Every call carries a deadline:

* a call larger than `max_queue` can never be queued: `ValueError` (-> 422);
* the queue is bounded: a call that does not fit is refused at once (`QueueFull` -> 429);
* a call that would miss its deadline even on an idle device (its own device time is longer)
  is refused at once (`WouldMissDeadline` -> 503): waiting would not help;
* a call that would make its deadline alone but not behind the work queued now is refused at
  once (`Overloaded` -> 429): the server sheds load, and the caller may retry later;
* a call still queued at its deadline is dropped without running (`DeadlineExceeded` -> 504),
  and a handler stops waiting at the deadline whatever happens (so never hangs).

The cost model is refreshed only by device calls, so while the device stands idle its estimate
halves every `estimate_half_life_s`: one slow call (a cold start, a burst of overload) cannot
keep refusing work once the device is free.

A batch that fails as a whole is retried chunk by chunk, so one bad call cannot fail the others;
a call with a failed chunk fails, and its chunks still queued are dropped.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# Defaults of a server (`m31.serve.config.ServeConfig`, `m31 serve`).
MAX_BATCH_SIZE = 64  # requests per device call
MAX_QUEUE_DELAY_MS = 2.0  # how long a batch's first call waits for company
# Requests waiting: room for a few of the largest calls (1,024 requests, `schemas.MAX_REQUESTS`)
# beside the small ones, so one large call does not fill the queue by itself.
MAX_QUEUE = 4096


def _fail(future: asyncio.Future, error: Exception) -> None:
    """Fail a waiter's future; marked retrieved, since its waiter may have given up already."""
    if not future.done():
        future.set_exception(error)
        future.exception()


class Overloaded(RuntimeError):
    """A call could make its deadline on an idle device, but not behind the queued work."""


class QueueFull(Overloaded):
    pass


class WouldMissDeadline(RuntimeError):
    pass


class DeadlineExceeded(RuntimeError):
    pass


class _CostModel:
    """Seconds of one device call of n requests: `fixed + per_request * n`.

    Least squares over the recent calls, each call's weight shrinking by `memory` per later call
    and halving per `half_life_s` the device stood idle before it, so the fit follows the
    device's load. Until calls of two sizes have been seen, the whole time is charged per
    request (pessimistic for larger batches until one runs).
    """

    def __init__(self, memory: float, half_life_s: float) -> None:
        self.memory, self.half_life_s = memory, half_life_s
        # Weighted sums of 1, n, t, n², n·t over the observed calls.
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def _fade(self, idle_s: float) -> float:
        return 0.5 ** (max(idle_s, 0.0) / self.half_life_s)

    def observe(self, n: int, seconds: float, idle_s: float) -> None:
        """A device call of `n` requests took `seconds`, after `idle_s` of an idle device."""
        keep = self.memory * self._fade(idle_s)
        self._w = keep * self._w + 1
        self._n = keep * self._n + n
        self._t = keep * self._t + seconds
        self._nn = keep * self._nn + n * n
        self._nt = keep * self._nt + n * seconds

    def fit(self, idle_s: float) -> tuple[float, float]:
        """(fixed seconds per call, seconds per request), faded by `idle_s` of idleness now."""
        if self._w == 0:
            return 0.0, 0.0  # nothing measured yet: admit, and learn from the first call
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n**2
        fixed, per_request = 0.0, self._t / self._n
        # Sizes are whole numbers: a spread under half a request is rounding, not a second size.
        if var > 0.25:
            slope = (self._nt / self._w - mean_n * mean_t) / var
            intercept = mean_t - slope * mean_n
            if slope >= 0 and intercept >= 0:
                fixed, per_request = intercept, slope
        fade = self._fade(idle_s)
        return fixed * fade, per_request * fade


@dataclass
class _Call:
    requests: Sequence[Any]
    deadline: float  # clock() seconds
    future: asyncio.Future
    enqueued: float  # clock() seconds
    taken: int = 0  # requests handed to device calls so far
    parts: list = field(default_factory=list)  # the run function's results, one per chunk

    @property
    def left(self) -> int:
        return len(self.requests) - self.taken


@dataclass
class _Chunk:
    call: _Call
    start: int
    stop: int

    @property
    def payload(self) -> Sequence[Any]:
        return self.call.requests[self.start : self.stop]


class DynamicBatcher:
    """`run(chunks) -> results` is called off the loop with the chunks of one batch (each a
    slice of one call's requests) and returns one result (or exception) per chunk.

    `clock` (seconds, monotonic) times deadlines, device calls and idleness; tests pass a clock
    they advance themselves.
    """

    def __init__(
        self,
        run: Callable[[Sequence[Sequence[Any]]], Sequence[Any]],
        max_batch_size: int = MAX_BATCH_SIZE,
        max_queue_delay_ms: float = MAX_QUEUE_DELAY_MS,
        max_queue: int = MAX_QUEUE,
        on_batch: Callable[[int, float], None] | None = None,
        estimate_memory: float = 0.9,
        estimate_half_life_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_queue_delay_ms < 0:
            raise ValueError(
                "max_batch_size and max_queue must be >= 1 and max_queue_delay_ms >= 0"
            )
        if not 0 <= estimate_memory < 1 or estimate_half_life_s <= 0:
            raise ValueError("estimate_memory must be in [0, 1) and estimate_half_life_s > 0")
        self.run = run
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay_ms / 1000
        self.max_queue = max_queue  # requests, not calls
        self.on_batch = on_batch  # (batch size in requests, seconds) after each device call
        self.clock = clock
        self._cost = _CostModel(estimate_memory, estimate_half_life_s)
        self._queue: deque[_Call] = deque()  # calls with requests not yet taken, in turn order
        self._cut: _Call | None = None  # the call the running batch cut; rejoins after it
        self._queued = 0  # requests waiting, the cut call's included
        self._running = 0  # requests in the device call under way (0: the device is idle)
        self._since = clock()  # start of that device call, or since when the device is idle
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="m31-device")

    @property
    def depth(self) -> int:
        """Requests waiting in the queue."""
        return self._queued

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._worker = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        for call in [*self._queue, *([self._cut] if self._cut else [])]:
            _fail(call.future, DeadlineExceeded("server shutting down"))
        self._queue.clear()
        self._cut = None
        self._queued = 0
        self._executor.shutdown(wait=True)

    def _seconds(self, requests: int, fixed: float, per_request: float) -> float:
        """Device time of `requests` queued requests, run in full batches."""
        return math.ceil(requests / self.max_batch_size) * fixed + requests * per_request

    def expected_seconds(self, size: int) -> tuple[float, float]:
        """(seconds a call of `size` requests takes on an idle device, seconds until it would
        be done if submitted now).

        Calls share the device in turns of up to `max_batch_size` requests, so before this
        call is done, after the device call under way, each other waiting call runs as many
        requests as this one needs turns for (or all it has left).
        """
        now = self.clock()
        fixed, per_request = self._cost.fit(0.0 if self._running else now - self._since)
        running = 0.0
        if self._running:
            full = fixed + per_request * self._running
            running = max(full - (now - self._since), 0.0)
        share = math.ceil(size / self.max_batch_size) * self.max_batch_size
        others = [*self._queue, *([self._cut] if self._cut else [])]
        before_done = sum(min(c.left, share) for c in others) + size
        alone = self._seconds(size, fixed, per_request)
        return alone, running + self._seconds(before_done, fixed, per_request)

    async def submit(self, requests: Sequence[Any], timeout_s: float) -> list[Any]:
        """Run one call's requests within `timeout_s`: the results of its chunks, in order."""
        if self._worker is None:
            raise RuntimeError("batcher not started")
        size = len(requests)
        if not 1 <= size <= self.max_queue:
            raise ValueError(
                f"a call holds 1 to {self.max_queue} requests (the queue's size), got {size}"
            )
        if self._queued + size > self.max_queue:
            raise QueueFull(f"queue full ({self._queued} requests waiting, limit {self.max_queue})")
        alone, done = self.expected_seconds(size)
        if alone > timeout_s:
            raise WouldMissDeadline(
                f"{size} requests take about {alone * 1000:.0f} ms on an idle device, more than "
                f"the deadline ({timeout_s * 1000:.0f} ms)"
            )
        if done > timeout_s:
            raise Overloaded(
                f"overloaded: {self._queued} requests waiting, this call would be done in about "
                f"{done * 1000:.0f} ms, after its deadline ({timeout_s * 1000:.0f} ms)"
            )
        now = self.clock()
        call = _Call(requests, now + timeout_s, asyncio.get_running_loop().create_future(), now)
        self._queue.append(call)
        self._queued += size
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(call.future), timeout_s)
        except TimeoutError:
            call.future.cancel()  # if still queued, the worker drops it
            raise DeadlineExceeded(
                f"no answer within the deadline ({timeout_s * 1000:.0f} ms)"
            ) from None

    def _take(self, batch: list[_Chunk], size: int) -> int:
        """Move queued requests into `batch` while they fit, cutting the call that does not fit
        whole; calls past their deadline (or given up, or failed) are dropped."""
        now = self.clock()
        while self._queue and size < self.max_batch_size:
            call = self._queue[0]
            if call.future.done() or call.deadline <= now:
                self._queue.popleft()
                self._queued -= call.left
                _fail(call.future, DeadlineExceeded("deadline passed in the queue"))
                continue
            n = min(call.left, self.max_batch_size - size)
            self._queue.popleft()
            batch.append(_Chunk(call, call.taken, call.taken + n))
            call.taken += n
            self._queued -= n
            size += n
            if call.left:
                self._cut = call
        return size

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch: list[_Chunk] = []
                size = self._take(batch, 0)
                if not batch:
                    continue
                # Wait for more only while the first call's delay budget lasts.
                close_at = batch[0].call.enqueued + self.max_queue_delay
                while size < self.max_batch_size and self.clock() < close_at:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), close_at - self.clock())
                    except TimeoutError:
                        pass
                    size = self._take(batch, size)
                await self._run(loop, batch, size)
                if self._cut is not None:  # behind the calls that came during the batch
                    self._queue.append(self._cut)
                    self._cut = None

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Chunk], size: int) -> None:
        start = self.clock()
        idle = start - self._since
        self._running, self._since = size, start
        try:
            results = await loop.run_in_executor(
                self._executor, self.run, [c.payload for c in batch]
            )
        except Exception as whole:
            if len(batch) == 1:
                results = [whole]
            else:  # find the culprit: each chunk alone
                results = []
                for chunk in batch:
                    try:
                        results.extend(
                            await loop.run_in_executor(self._executor, self.run, [chunk.payload])
                        )
                    except Exception as e:
                        results.append(e)
        finally:
            end = self.clock()
            self._running, self._since = 0, end
        self._cost.observe(size, end - start, idle)
        if self.on_batch is not None:
            self.on_batch(size, end - start)
        for chunk, result in zip(batch, results, strict=True):
            call = chunk.call
            if call.future.done():  # its handler gave up at the deadline
                continue
            if isinstance(result, BaseException):
                call.future.set_exception(result)
            else:
                call.parts.append(result)
                if chunk.stop == len(call.requests):
                    call.future.set_result(call.parts)
