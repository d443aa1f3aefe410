"""The dynamic batcher between HTTP handlers and the device (DESIGN §7).

Handlers `submit` work items (one HTTP call: a list of requests) and await their results. One
worker task drains the queue: it takes the first item, then keeps taking items until the batch
holds `max_batch_size` requests or `max_queue_delay_ms` have passed since that first item, and
runs the batch on a single-thread executor (the event loop never blocks on the device, and the
device sees one batch at a time). Every item carries a deadline:

* the queue is bounded: an item that does not fit is refused at once (`QueueFull` -> 429);
* an item whose expected wait (queued requests / batch size + 1 batches, at the recent batch
  time) already exceeds its deadline is refused at once (`WouldMissDeadline` -> 503);
* an item still queued at its deadline is dropped without running (`DeadlineExceeded` -> 504),
  and a handler stops waiting at the deadline whatever happens (so never hangs).

A batch that fails as a whole is retried item by item, so one bad item cannot fail the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


def _fail(future: asyncio.Future, error: Exception) -> None:
    """Fail a waiter's future; marked retrieved, since its waiter may have given up already."""
    if not future.done():
        future.set_exception(error)
        future.exception()


class QueueFull(RuntimeError):
    pass


class WouldMissDeadline(RuntimeError):
    pass


class DeadlineExceeded(RuntimeError):
    pass


@dataclass
class _Item:
    payload: Any
    size: int  # requests in the item: what max_batch_size counts
    deadline: float  # time.monotonic() seconds
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class DynamicBatcher:
    """`run(payloads) -> results` is called off the loop with the payloads of one batch."""

    def __init__(
        self,
        run: Callable[[Sequence[Any]], Sequence[Any]],
        max_batch_size: int = 64,
        max_queue_delay_ms: float = 2.0,
        max_queue: int = 1024,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_queue_delay_ms < 0:
            raise ValueError(
                "max_batch_size and max_queue must be >= 1 and max_queue_delay_ms >= 0"
            )
        self.run = run
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay_ms / 1000
        self.max_queue = max_queue  # requests, not items
        self.on_batch = on_batch  # (batch size in requests, seconds) after each device call
        self._queue: deque[_Item] = deque()
        self._queued = 0  # requests waiting
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="m31-device")
        self._batch_ema: float | None = None  # seconds per batch, smoothed

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
        for item in self._queue:
            _fail(item.future, DeadlineExceeded("server shutting down"))
        self._queue.clear()
        self._queued = 0
        self._executor.shutdown(wait=True)

    async def submit(self, payload: Any, size: int, timeout_s: float) -> Any:
        if self._worker is None:
            raise RuntimeError("batcher not started")
        now = time.monotonic()
        if self._queued + size > self.max_queue:
            raise QueueFull(f"queue full ({self._queued} requests waiting, limit {self.max_queue})")
        expected = (self._queued // self.max_batch_size + 1) * (self._batch_ema or 0.0)
        if expected > timeout_s:
            raise WouldMissDeadline(
                f"expected wait {expected * 1000:.0f} ms exceeds the deadline "
                f"({timeout_s * 1000:.0f} ms)"
            )
        item = _Item(payload, size, now + timeout_s, asyncio.get_running_loop().create_future())
        self._queue.append(item)
        self._queued += size
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(item.future), timeout_s)
        except TimeoutError:
            item.future.cancel()  # if still queued, the worker drops it
            raise DeadlineExceeded(
                f"no answer within the deadline ({timeout_s * 1000:.0f} ms)"
            ) from None

    def _take(self, batch: list[_Item], size: int) -> int:
        """Move queued items into `batch` while they fit; expired ones are failed and dropped."""
        now = time.monotonic()
        while self._queue:
            item = self._queue[0]
            if item.future.done() or item.deadline <= now:
                self._queue.popleft()
                self._queued -= item.size
                _fail(item.future, DeadlineExceeded("deadline passed in the queue"))
                continue
            if batch and size + item.size > self.max_batch_size:
                break
            self._queue.popleft()
            self._queued -= item.size
            batch.append(item)
            size += item.size
        return size

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch: list[_Item] = []
                size = self._take(batch, 0)
                if not batch:
                    continue
                # Wait for more only while the first item's delay budget lasts.
                close_at = batch[0].enqueued + self.max_queue_delay
                while size < self.max_batch_size and time.monotonic() < close_at:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), close_at - time.monotonic())
                    except TimeoutError:
                        pass
                    size = self._take(batch, size)
                await self._run(loop, batch, size)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Item], size: int) -> None:
        start = time.monotonic()
        try:
            results = await loop.run_in_executor(
                self._executor, self.run, [i.payload for i in batch]
            )
        except Exception as whole:
            if len(batch) == 1:
                results = [whole]
            else:  # find the culprit: each item alone
                results = []
                for item in batch:
                    try:
                        results.extend(
                            await loop.run_in_executor(self._executor, self.run, [item.payload])
                        )
                    except Exception as e:
                        results.append(e)
        elapsed = time.monotonic() - start
        self._batch_ema = (
            elapsed if self._batch_ema is None else 0.8 * self._batch_ema + 0.2 * elapsed
        )
        if self.on_batch is not None:
            self.on_batch(size, elapsed)
        for item, result in zip(batch, results, strict=True):
            if item.future.done():  # its handler gave up at the deadline
                continue
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)
