"""Reads made while one runs share the next (`m31.cluster.coalesce.Coalesced`): each call gets
exactly what a read of its own ids would give, or the shared read's error."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from m31.cluster.coalesce import Coalesced

BOUND_S = 60.0  # the longest any wait here may take before the test fails (not a timing)


class Store:
    """A read of user ids as of times: (id, ts) per id; the first read waits for `release`."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.asked: list[list[int]] = []

    def read(self, ids: np.ndarray, ts: np.ndarray) -> list:
        self.asked.append(ids.tolist())
        self.started.set()
        assert self.release.wait(BOUND_S)
        if (ids < 0).any():
            raise LookupError(f"no user {int(ids[ids < 0][0])}")
        return [(int(u), int(t)) for u, t in zip(ids, ts, strict=True)]


def run(shared: Coalesced, calls: dict[str, tuple], out: dict) -> threading.Thread:
    def one(name: str, ids, ts) -> None:
        try:
            out[name] = shared(ids, ts)
        except LookupError as e:
            out[name] = e

    threads = [threading.Thread(target=one, args=(n, *c)) for n, c in calls.items()]
    for t in threads:
        t.start()
    return threads


def wait_until(condition) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


@pytest.mark.parametrize("bad", [False, True])
def test_calls_made_while_a_read_runs_share_the_next(bad):
    store = Store()
    shared = Coalesced(store.read)
    out: dict = {}
    first = run(shared, {"a": ([1, 2], [10, 20])}, out)
    assert store.started.wait(BOUND_S)
    later = {"b": ([3], [30]), "c": ([], []), "d": ([4, -5 if bad else 5, 1], [40, 50, 60])}
    threads = run(shared, later, out)
    wait_until(lambda: len(shared._waiting) == 3)  # all three queued behind the first read
    store.release.set()
    for t in first + threads:
        t.join(BOUND_S)
    assert store.asked[0] == [1, 2] and len(store.asked) == 2 and shared.reads == 2
    assert sorted(store.asked[1]) == sorted([3, 4, -5 if bad else 5, 1])  # one read of them all
    assert out["a"] == [(1, 10), (2, 20)]
    if bad:  # the shared read's error reaches each of its calls
        assert all(isinstance(out[n], LookupError) for n in "bcd")
    else:
        assert out["b"] == [(3, 30)] and out["c"] == [] and out["d"] == [(4, 40), (5, 50), (1, 60)]
    assert shared(np.array([7]), np.array([70])) == [(7, 70)]  # alone: at once, its own read
    assert shared.reads == 3
