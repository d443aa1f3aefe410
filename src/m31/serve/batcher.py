"""The dynamic batcher between HTTP handlers and the device (DESIGN §7).

Handlers `submit` calls (one HTTP call: a list of requests) and await their results. One worker
task drains the queue: it takes requests from the queued calls in turn until the batch holds
`max_batch_size` requests or `max_queue_delay_ms` have passed since its first call came, and
runs the batch on a single-thread executor (the event loop never blocks on the device, and the
device sees one batch at a time).

Calls share the device in turns, and no call holds it for long. The *slice* is the largest
number of requests whose device call is estimated to take at most `max_slice_ms`, or twice one
request's time if that is longer (at least 1, at most `max_batch_size`). A call no larger than a
slice joins a batch whole (while the batch has room); a larger call gives each batch only what
keeps the batch within one slice (at least one request, so it always progresses), and the rest
of it rejoins the queue behind the calls that came while the batch ran. So a small call that
comes while a large one runs waits for the device call under way and then runs in a batch of
about one slice: on a CPU it is answered within about two slices (25 ms each by default), and on
a GPU, where a slice holds a full batch, large calls lose nothing. The call's answer is the run
function's results for its chunks, in order.

Admission is decided from the work queued right now and a cost model of the device (seconds
of a device call of n requests, learned per size; see `_CostModel`). Every call carries a
deadline:

* a call larger than `max_queue` can never be queued: `ValueError` (-> 422);
* the queue is bounded: a call that does not fit is refused at once (`QueueFull` -> 429);
* a call that would miss its deadline even on an idle device (its own device time, in slices,
  is longer) is refused at once (`WouldMissDeadline` -> 503): waiting would not help;
* a call that would make its deadline alone but not behind the work queued now is refused at
  once (`Overloaded` -> 429): the server sheds load, and the caller may retry later;
* a call still queued at its deadline is dropped without running (`DeadlineExceeded` -> 504),
  and so are its chunks not yet run; a handler stops waiting at the deadline whatever happens
  (so never hangs).

The cost model is refreshed only by device calls, so while the device stands idle its estimate
halves every `estimate_half_life_s`: one slow call (a cold start, a burst of overload) cannot
keep refusing work once the device is free.

A batch that fails as a whole is retried chunk by chunk, so one bad call cannot fail the others;
a call with a failed chunk fails, and its chunks still queued are dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
# Device time one batch may spend on a large call: what a small call that comes meanwhile waits.
MAX_SLICE_MS = 25.0


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
    """Seconds of one device call of 1 to `max_size` requests, learned per size.

    Each size seen keeps its own average, in which the old value weighs `memory` against each
    new call of that size, less after the device stood idle before it (halved per
    `half_life_s`), so that the model follows the device's load: steady traffic of one size never
    makes it forget what other sizes cost. A size not seen is interpolated between the nearest
    sizes seen; above the largest it is extrapolated along the slope of the two largest (flat
    with one size), below the smallest in proportion to it. Both are optimistic (a larger call
    never costs less, and a call of n has no negative fixed part), so a size not measured yet
    is admitted rather than refused, and measured by its first call. No size is estimated above
    a larger one, so a stale slow small size (a cold start) is bounded by what larger calls
    cost now.
    """

    def __init__(self, max_size: int, memory: float, half_life_s: float) -> None:
        self.memory, self.half_life_s = memory, half_life_s
        self._sums: dict[int, tuple[float, float]] = {}  # size -> (Σ weight·seconds, Σ weight)
        self._table = [0.0] * (max_size + 1)  # [size] -> estimated seconds

    @property
    def largest(self) -> int:
        """The largest size seen (0 before the first call)."""
        return max(self._sums, default=0)

    def fade(self, idle_s: float) -> float:
        """The factor on estimates after `idle_s` seconds of an idle device."""
        return 0.5 ** (max(idle_s, 0.0) / self.half_life_s)

    def observe(self, n: int, seconds: float, idle_s: float) -> None:
        """A device call of `n` requests took `seconds`, after `idle_s` of an idle device."""
        keep = self.memory * self.fade(idle_s)
        total, weight = self._sums.get(n, (0.0, 0.0))
        self._sums[n] = (keep * total + seconds, keep * weight + 1.0)
        seen = {size: t / w for size, (t, w) in self._sums.items()}
        sizes = sorted(seen)
        table, at = self._table, 0
        for size in range(1, len(table)):
            while at < len(sizes) and sizes[at] < size:
                at += 1
            if at < len(sizes) and sizes[at] == size:
                table[size] = seen[size]
            elif at == 0:  # from the origin: a lower bound, as a call has no negative part
                table[size] = seen[sizes[0]] * size / sizes[0]
            elif at == len(sizes):
                top = seen[sizes[-1]]
                if len(sizes) > 1:
                    a, b = sizes[-2], sizes[-1]
                    top += max(seen[b] - seen[a], 0.0) / (b - a) * (size - b)
                table[size] = top
            else:
                a, b = sizes[at - 1], sizes[at]
                table[size] = seen[a] + (seen[b] - seen[a]) * (size - a) / (b - a)
        for size in range(len(table) - 2, 0, -1):
            table[size] = min(table[size], table[size + 1])

    def seconds(self, n: int) -> float:
        """Estimated seconds of a device call of `n` requests (0 before the first call)."""
        return self._table[n]


@dataclass
class _Call:
    requests: Sequence[Any]
    deadline: float  # clock() seconds
    future: asyncio.Future
    enqueued: float  # clock() seconds
    taken: int = 0  # requests handed to device calls so far
    parts: dict = field(default_factory=dict)  # chunk start -> the run function's result
    settled: int = 0  # requests whose chunk's result is in `parts`

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
    slice of one call's requests) and returns one result (or exception) per chunk, or a
    `concurrent.futures.Future` of it for a chunk that settles later (a sharded index waiting
    for a shard): the device is free for the next batch meanwhile, and the chunk's call is
    answered once all its chunks are in.

    `clock` (seconds, monotonic) times deadlines, device calls and idleness; tests pass a clock
    they advance themselves.
    """

    deferred_results = True  # `run` may answer a chunk with a Future (see above)

    def __init__(
        self,
        run: Callable[[Sequence[Sequence[Any]]], Sequence[Any]],
        max_batch_size: int = MAX_BATCH_SIZE,
        max_queue_delay_ms: float = MAX_QUEUE_DELAY_MS,
        max_queue: int = MAX_QUEUE,
        on_batch: Callable[[int, float], None] | None = None,
        max_slice_ms: float = MAX_SLICE_MS,
        estimate_memory: float = 0.9,
        estimate_half_life_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_queue_delay_ms < 0:
            raise ValueError(
                "max_batch_size and max_queue must be >= 1 and max_queue_delay_ms >= 0"
            )
        if not max_slice_ms > 0:
            raise ValueError(f"max_slice_ms must be > 0, got {max_slice_ms}")
        if not 0 <= estimate_memory < 1 or estimate_half_life_s <= 0:
            raise ValueError("estimate_memory must be in [0, 1) and estimate_half_life_s > 0")
        self.run = run
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay_ms / 1000
        self.max_queue = max_queue  # requests, not calls
        self.max_slice = max_slice_ms / 1000
        self.on_batch = on_batch  # (batch size in requests, seconds) after each device call
        self.clock = clock
        self._cost = _CostModel(max_batch_size, estimate_memory, estimate_half_life_s)
        self._queue: deque[_Call] = deque()  # calls with requests not yet taken, in turn order
        self._cuts: list[_Call] = []  # calls the forming or running batch cut; rejoin after it
        self._queued = 0  # requests waiting, the cut calls' included
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
        for call in [*self._queue, *self._cuts]:
            _fail(call.future, DeadlineExceeded("server shutting down"))
        self._queue.clear()
        self._cuts.clear()
        self._queued = 0
        self._executor.shutdown(wait=True)

    def slice_size(self) -> int:
        """Requests of one call per batch: the most whose device call is estimated within
        `max_slice_ms` or twice one request's time, whichever is longer (so that a slow device
        still batches a large call), at least 1, at most `max_batch_size`, and at most twice
        the largest call measured (so that a size is measured before it is trusted)."""
        cost = self._cost
        top = min(self.max_batch_size, max(1, 2 * cost.largest))
        budget = max(self.max_slice, 2 * cost.seconds(1))
        n = 1
        while n < top and cost.seconds(n + 1) <= budget:
            n += 1
        return n

    def expected_seconds(self, size: int) -> tuple[float, float]:
        """(seconds a call of `size` requests takes on an idle device, seconds until it would
        be done if submitted now).

        A call runs in turns of at most a slice, so it needs `turns = ceil(size / slice)` device
        calls; before its last, after the device call under way, the other waiting calls no
        larger than a slice run whole, and each larger one runs in each turn what the smaller
        ones leave of a slice (at least one request).
        """
        now = self.clock()
        fade = 1.0 if self._running else self._cost.fade(now - self._since)

        def seconds(n: int) -> float:
            return self._cost.seconds(n) * fade

        running = 0.0
        if self._running:
            running = max(seconds(self._running) - (now - self._since), 0.0)
        piece = self.slice_size()
        turns = math.ceil(size / piece)
        alone = turns * seconds(min(size, piece))
        others = [c.left for c in (*self._queue, *self._cuts)]
        small = sum(n for n in others if n <= piece) + min(size, piece)
        share = turns * max(1, piece - small)
        total = small - min(size, piece) + size + sum(min(n, share) for n in others if n > piece)
        calls = max(turns, math.ceil(total / self.max_batch_size))
        return alone, running + calls * seconds(math.ceil(total / calls))

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

    def _take(self, batch: list[_Chunk], size: int, piece: int) -> int:
        """Move queued requests into `batch` in turn while it has room: a call of at most
        `piece` requests whole, a larger one what keeps the batch within `piece` (at least
        one); a call cut rejoins after the batch. Calls past their deadline (or given up, or
        failed) are dropped."""
        now = self.clock()
        while self._queue and size < self.max_batch_size:
            call = self._queue.popleft()
            if call.future.done() or call.deadline <= now:
                self._queued -= call.left
                _fail(call.future, DeadlineExceeded("deadline passed in the queue"))
                continue
            room = self.max_batch_size - size
            n = min(call.left, room) if call.left <= piece else min(room, max(1, piece - size))
            batch.append(_Chunk(call, call.taken, call.taken + n))
            call.taken += n
            self._queued -= n
            size += n
            if call.left:
                self._cuts.append(call)
        return size

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch: list[_Chunk] = []
                piece = self.slice_size()
                size = self._take(batch, 0, piece)
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
                    size = self._take(batch, size, piece)
                await self._run(loop, batch, size)
                # Behind the calls that came during the batch.
                self._queue.extend(self._cuts)
                self._cuts.clear()

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
            if isinstance(result, concurrent.futures.Future):
                result.add_done_callback(lambda f, chunk=chunk: self._later(loop, chunk, f))
            else:
                self._settle(chunk, result)

    def _later(self, loop, chunk: _Chunk, done: concurrent.futures.Future) -> None:
        """A deferred chunk's result, from whatever thread settled it, onto the loop."""
        if done.cancelled():
            result: Any = DeadlineExceeded("the deferred answer was cancelled")
        else:
            result = done.exception() or done.result()
        try:
            loop.call_soon_threadsafe(self._settle, chunk, result)
        except RuntimeError:  # the loop is closed: the server stopped, nobody waits
            pass

    @staticmethod
    def _settle(chunk: _Chunk, result: Any) -> None:
        """A chunk's result into its call, which is answered (its chunks' results in order)
        once every chunk is in, or failed by the first that failed."""
        call = chunk.call
        if call.future.done():  # its handler gave up at the deadline, or a chunk failed
            return
        if isinstance(result, BaseException):
            _fail(call.future, result)
            return
        call.parts[chunk.start] = result
        call.settled += chunk.stop - chunk.start
        if call.settled == len(call.requests):
            call.future.set_result([call.parts[start] for start in sorted(call.parts)])
