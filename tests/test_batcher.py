"""The dynamic batcher on its own, with a real run function and a clock the tests advance: the
estimate recovers without traffic, overload is shed with 429 before any 503, large calls are cut
into chunks that other calls interleave with, and one bad call fails alone.

Time is driven by the test, never read from the wall: each device call advances the clock by
its cost, and a device call can be held at a gate until the test releases it. The real-time
deadlines of `submit` are only a bound against hangs, generous on any machine.
"""

from __future__ import annotations

import asyncio
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
    """The run function: answers `10 * x` per request, costs `per_request` seconds of the clock
    per request (`next_cost` instead, once), fails a batch holding "bad", and, when `hold` is
    set, stops at the gate until `release` is set."""

    def __init__(self, clock: Clock, per_request: float) -> None:
        self.clock, self.per_request = clock, per_request
        self.next_cost: float | None = None
        self.batches: list[list[list]] = []  # the chunks of each device call
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
        self.clock.advance(self.per_request * n if cost is None else cost)
        if any(x == "bad" for c in chunks for x in c):
            raise ValueError("bad request")
        return [[10 * x for x in c] for c in chunks]

    async def held(self) -> None:
        """Wait until a device call is stopped at the gate."""
        assert await asyncio.to_thread(self.entered.wait, HANG)


def run(test, per_request: float = 1.0, **kw):
    """Run `test(batcher, device, clock)` on a started batcher, then stop it."""

    async def main():
        clock = Clock()
        device = Device(clock, per_request)
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
        # 1,024 requests at 1 s each: 16 device calls of 64, 1,024 s in all.
        parts = await b.submit(list(range(1024)), 10_000)
        assert [x for p in parts for x in p] == [10 * x for x in range(1024)]
        assert [sum(map(len, batch)) for batch in device.batches] == [64] * 16
        # At once, no idle time: one request is estimated at about 1 s, not 1,024 s or 64 s.
        alone, done = b.expected_seconds(1)
        assert alone == done == pytest.approx(1.0)
        assert await b.submit([7], 30) == [[70]]

    run(test, per_request=1.0, max_batch_size=64, max_queue=1024)


def test_overload_is_shed_with_429_before_any_503():
    async def test(b, device, clock):
        assert await b.submit([0], HANG) == [[0]]  # the device's cost: 10 s per request
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
        # A call that cannot make its deadline even on an idle device is a 503, busy or not.
        with pytest.raises(WouldMissDeadline):
            await b.submit(list(range(10)), 95)
        device.release.set()
        assert await first == [[10]]
        assert [await t for t, _ in admitted] == [[[20]]] * 8
        assert await b.submit([3], 95) == [[30]]  # drained: admitted again

    run(test, per_request=10.0, max_batch_size=64)


def test_a_large_call_is_cut_and_other_calls_interleave():
    async def test(b, device, clock):
        device.hold = True
        big = asyncio.create_task(b.submit(list(range(10)), HANG))
        await device.held()  # the first 4 of the large call are on the device
        small = asyncio.create_task(b.submit([100], HANG))
        await until(lambda: b.depth == 7)
        device.release.set()
        assert await small == [[1000]]
        assert await big == [[0, 10, 20, 30], [40, 50, 60], [70, 80, 90]]
        # The small call came during the first chunk and ran right after it.
        assert device.batches == [
            [[0, 1, 2, 3]],
            [[100], [4, 5, 6]],
            [[7, 8, 9]],
        ]

    run(test, max_batch_size=4)


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
