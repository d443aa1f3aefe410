"""The dynamic batcher on its own, with a real run function and a clock the tests advance: the
estimate recovers without traffic, overload is shed with 429 before any 503, large calls are cut
into slices that other calls interleave with, a small call is neither refused nor kept waiting
behind a large one, a large call is admitted after steady small traffic, and one bad call fails
alone.

Time is driven by the test, never read from the wall: each device call advances the clock by
its cost, and a device call can be held at a gate until the test releases it. The real-time
deadlines of `submit` are only a bound against hangs, generous on any machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from m31.serve.batcher import (
    DeadlineExceeded,
    DynamicBatcher,
    Overloaded,
    QueueFull,
    WouldMissDeadline,
)

HANG = 60  # seconds: only a test that is broken waits this long


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Device:
    """The run function: answers `10 * x` per request, costs `fixed + per_request * n` seconds
    of the clock for n requests (`next_cost` instead, once), fails a batch holding "bad", and,
    when `hold` is set, stops at the gate until `release` is set."""

    def __init__(self, clock: Clock, per_request: float, fixed: float = 0.0) -> None:
        self.clock, self.per_request, self.fixed = clock, per_request, fixed
        self.next_cost: float | None = None
        self.batches: list[list[list]] = []  # the chunks of each device call
        self.ends: list[float] = []  # the clock at the end of each device call
        self.hold = False
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, chunks):
        self.batches.append([list(c) for c in chunks])
        if self.hold:
            self.hold = False
            self.entered.set()
            assert self.release.wait(HANG)
        n = sum(len(c) for c in chunks)
        cost, self.next_cost = self.next_cost, None
        self.clock.advance(self.fixed + self.per_request * n if cost is None else cost)
        self.ends.append(self.clock())
        if any(x == "bad" for c in chunks for x in c):
            raise ValueError("bad request")
        return [[10 * x for x in c] for c in chunks]

    async def held(self) -> None:
        """Wait until a device call is stopped at the gate."""
        assert await asyncio.to_thread(self.entered.wait, HANG)


def run(test, per_request: float = 1.0, fixed: float = 0.0, **kw):
    """Run `test(batcher, device, clock)` on a started batcher, then stop it."""

    async def main():
        clock = Clock()
        device = Device(clock, per_request, fixed)
        batcher = DynamicBatcher(device, **{"max_queue_delay_ms": 0, "clock": clock, **kw})
        batcher.start()
        try:
            await test(batcher, device, clock)
        finally:
            device.release.set()
            await batcher.stop()

    asyncio.run(main())


async def until(predicate) -> None:
    """Yield to the loop until `predicate()` holds (submitted calls reach the queue)."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_estimate_recovers_after_a_slow_call_without_traffic():
    async def test(b, device, clock):
        device.next_cost = 3_000.0  # one call takes 3,000 s (a cold start)
        assert await b.submit([1], HANG) == [[10]]
        with pytest.raises(WouldMissDeadline, match="idle device"):
            await b.submit([2], 30)
        clock.advance(10)  # the device stands idle for ten half-lives; no call comes
        assert await b.submit([2], 30) == [[20]]
        # That call's 1 s outweighs the old 3,000 s, faded by the idle time.
        assert b.expected_seconds(1)[0] < 5

    run(test, per_request=1.0, estimate_half_life_s=1.0)


def test_a_large_call_does_not_refuse_the_calls_after_it():
    async def test(b, device, clock):
        # 1,024 requests at 1 s each; with a slice longer than any batch, the batch size doubles
        # from 1 as each size is measured, up to full batches of 64.
        parts = await b.submit(list(range(1024)), 10_000)
        assert [x for p in parts for x in p] == [10 * x for x in range(1024)]
        sizes = [sum(map(len, batch)) for batch in device.batches]
        assert sizes == [1, 2, 4, 8, 16, 32, *[64] * 15, 1]
        # At once, no idle time: one request is estimated at 1 s, not 1,024 s or 64 s.
        alone, done = b.expected_seconds(1)
        assert alone == done == pytest.approx(1.0)
        assert await b.submit([7], 30) == [[70]]

    run(test, per_request=1.0, max_batch_size=64, max_queue=1024, max_slice_ms=1e9)


def test_overload_is_shed_with_429_before_any_503():
    async def test(b, device, clock):
        # The device's cost, 10 s per request, measured at two sizes.
        assert await b.submit([0], HANG) == [[0]]
        assert await b.submit([0, 0], HANG) == [[0, 0]]
        device.hold = True
        first = asyncio.create_task(b.submit([1], HANG))
        await device.held()
        admitted, refused = [], None
        while refused is None:
            try:
                _, done = b.expected_seconds(1)
                task = asyncio.create_task(b.submit([2], 95))
                await until(lambda t=task: b.depth > len(admitted) or t.done())
                if task.done():
                    task.result()
                admitted.append((task, done))
            except (Overloaded, WouldMissDeadline) as e:
                refused = e
        assert isinstance(refused, Overloaded) and not isinstance(refused, QueueFull), refused
        # 10 s under way, then 10 s per queued request: room for 8 before the 95 s deadline.
        assert len(admitted) == 8 and admitted[-1][1] == pytest.approx(90.0)
        # A call that cannot make its deadline even on an idle device is a 503, busy or not:
        # in slices of 2 (twice one request's time), 10 requests take 100 s.
        with pytest.raises(WouldMissDeadline):
            await b.submit(list(range(10)), 95)
        device.release.set()
        assert await first == [[10]]
        assert [await t for t, _ in admitted] == [[[20]]] * 8
        assert await b.submit([3], 95) == [[30]]  # drained: admitted again

    run(test, per_request=10.0, max_batch_size=64)


async def measured(b, sizes) -> None:
    """Let the batcher measure the device at each size (one call each)."""
    for n in sizes:
        assert await b.submit([0] * n, HANG) == [[0] * n]


def test_a_large_call_is_cut_and_other_calls_interleave():
    async def test(b, device, clock):
        await measured(b, [1, 2])  # 1 s per request: a 4 s slice holds 4
        device.batches.clear()
        device.hold = True
        big = asyncio.create_task(b.submit(list(range(10)), HANG))
        await device.held()  # the first 4 of the large call are on the device
        small = asyncio.create_task(b.submit([100], HANG))
        await until(lambda: b.depth == 7)
        device.release.set()
        assert await small == [[1000]]
        assert await big == [[0, 10, 20, 30], [40, 50, 60], [70, 80, 90]]
        # The small call came during the first slice and ran right after it, in a batch the
        # large call filled only up to one slice.
        assert device.batches == [
            [[0, 1, 2, 3]],
            [[100], [4, 5, 6]],
            [[7, 8, 9]],
        ]

    run(test, max_batch_size=8, max_slice_ms=4000)


def test_small_calls_wait_for_slices_not_for_a_large_call():
    async def test(b, device, clock):
        # 20 ms + 10 ms per request (a batch of 64: 660 ms); the slice, 70 ms, holds 5.
        await measured(b, [1, 2, 4])
        assert b.slice_size() == 5
        big = asyncio.create_task(b.submit(list(range(1024)), 600))
        answered = []
        for i in range(30):
            await until(lambda: device.batches and b.depth < 1024)
            start = clock()
            # Refused before slices (a batch of the large call took 660 ms), answered now.
            assert await b.submit([-1 - i], 0.2) == [[-10 - 10 * i]]
            # (When its device call ended: the device may have run the next one meanwhile.)
            ran = next(j for j, batch in enumerate(device.batches) if [-1 - i] in batch)
            answered.append(device.ends[ran] - start)
        assert max(answered) <= 2 * 0.07 + 1e-9, answered
        assert [x for p in await big for x in p] == [10 * x for x in range(1024)]

    run(test, per_request=0.01, fixed=0.02, max_batch_size=64, max_queue=2048, max_slice_ms=70)


def test_a_large_call_is_admitted_after_steady_small_traffic():
    async def test(b, device, clock):
        # Only single requests, 60 ms each, for a long while: charged per request, the old
        # estimate of 1,024 was 61 s, past a 60 s deadline, though batches make it far less.
        for i in range(200):
            assert await b.submit([i], 1) == [[10 * i]]
        start = clock()
        parts = await b.submit(list(range(1024)), 60)
        assert [x for p in parts for x in p] == [10 * x for x in range(1024)]
        assert clock() - start < 60
        # The sizes its slices measured stay known after more single requests.
        for i in range(200):
            await b.submit([i], 1)
        assert b.slice_size() > 2

    run(test, per_request=0.01, fixed=0.05, max_batch_size=64, max_queue=2048)


def test_a_bad_call_fails_alone_and_its_later_chunks_are_dropped():
    async def test(b, device, clock):
        device.hold = True
        first = asyncio.create_task(b.submit([1], HANG))
        await device.held()
        calls = [[2, 3], ["bad"], [4], [5, 6, 7, "bad", 8, 9, 10, 11, 12]]
        tasks = [asyncio.create_task(b.submit(c, HANG)) for c in calls]
        await until(lambda: b.depth == 13)
        device.release.set()
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        assert results[0] == [[10]] and results[1] == [[20, 30]] and results[3] == [[40]]
        assert isinstance(results[2], ValueError) and isinstance(results[4], ValueError)
        # The batch that failed whole was retried chunk by chunk; the bad call's chunk with
        # "bad" failed it, and its chunks after that never ran.
        ran = [x for batch in device.batches for c in batch for x in c]
        assert 8 not in ran and b.depth == 0
        assert await b.submit([9], HANG) == [[90]]

    run(test, max_batch_size=4)


def test_a_chunk_settled_later_frees_the_device_for_the_calls_behind_it():
    later: dict[int, tuple[list, concurrent.futures.Future]] = {}

    def run(chunks):
        # A chunk holding a negative request is answered later, as a sharded index answers a
        # chunk that waits for a shard that is down.
        out = []
        for c in chunks:
            if min(c) < 0:
                later[min(c)] = (list(c), concurrent.futures.Future())
                out.append(later[min(c)][1])
            else:
                out.append([10 * x for x in c])
        return out

    async def main():
        b = DynamicBatcher(run, max_batch_size=2, max_queue_delay_ms=0, max_slice_ms=1e9)
        b.start()
        try:
            waiting = asyncio.create_task(b.submit([1, 2, -3, 4], HANG))
            failing = asyncio.create_task(b.submit([-5], HANG))
            for _ in range(HANG * 100):  # the device calls run on the batcher's thread
                if -3 in later and -5 in later:
                    break
                await asyncio.sleep(0.01)
            # The device went on: a call behind them is answered while they wait.
            assert await b.submit([6], HANG) == [[60]]
            assert not waiting.done() and not failing.done()
            chunk, future = later[-3]
            future.set_result([10 * x for x in chunk])
            later[-5][1].set_exception(ValueError("shard down"))
            # The call's chunks in order, the one settled later included.
            assert [x for part in await waiting for x in part] == [10, 20, -30, 40]
            with pytest.raises(ValueError, match="shard down"):
                await failing
        finally:
            await b.stop()

    asyncio.run(main())


def test_bounds_of_a_call():
    async def test(b, device, clock):
        with pytest.raises(ValueError, match="1 to 8 requests"):
            await b.submit(list(range(9)), HANG)
        device.hold = True
        first = asyncio.create_task(b.submit([1], HANG))
        await device.held()
        queued = asyncio.create_task(b.submit(list(range(8)), HANG))
        await until(lambda: b.depth == 8)
        with pytest.raises(QueueFull):
            await b.submit([2], HANG)
        clock.advance(HANG)  # past every deadline: the queued call is dropped unrun
        device.release.set()
        assert await first == [[10]]
        with pytest.raises(DeadlineExceeded, match="in the queue"):
            await queued

    run(test, per_request=0.0, max_batch_size=4, max_queue=8)
