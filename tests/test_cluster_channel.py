"""The channel a shard serves its searches on (m31.cluster.channel), without Ray: answers and
the shard's own errors come back to the call they belong to, calls are served concurrently,
an answer that cannot travel fails its call alone, and a server whose process dies fails every
call on the channel, waiting or new, with ChannelClosed (what the reader takes as a failed Ray
call)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from m31.cluster import channel

pytestmark = pytest.mark.skipif(not channel.available(), reason="Linux abstract sockets")


@pytest.fixture
def served():
    """A server of a few methods in this process, and a channel to it."""
    release = threading.Event()

    def fail(message: str):
        raise KeyError(message)

    methods = {
        "add": lambda a, b: a + b,
        "fail": fail,
        "hold": lambda: release.wait(60) and "held",
        "unpicklable": lambda: threading.Lock(),
    }
    server = channel.Server(methods, workers=4)
    link = channel.Channel(server.name)
    yield link, release
    release.set()
    link.close()


def test_answers_and_errors_reach_their_calls(served):
    link, _ = served
    calls = [link.call("add", i, 10) for i in range(20)]
    assert [c.result(30) for c in calls] == [i + 10 for i in range(20)]
    with pytest.raises(KeyError, match="the shard's own"):
        link.call("fail", "the shard's own").result(30)
    with pytest.raises(RuntimeError, match="cannot be sent"):
        link.call("unpicklable").result(30)
    with pytest.raises(KeyError):
        link.call("no such method").result(30)
    assert link.call("add", 1, 2).result(30) == 3  # none of these closed the channel


def test_calls_are_served_concurrently(served):
    link, release = served
    held = link.call("hold")
    assert link.call("add", 2, 3).result(30) == 5  # answered while the first still runs
    assert not held.done()
    release.set()
    assert held.result(30) == "held"


def test_inline_calls_run_in_order_on_their_connection_and_hold_only_it():
    """A shard's two-phase calls run on the coordinator's connection thread, in the order
    sent; its errors still reach their calls; another connection is served meanwhile."""
    release, seen = threading.Event(), []

    def record(i: int) -> str:
        seen.append((i, threading.current_thread().name))
        if i < 0:
            raise ValueError(f"refused {i}")
        return f"took {i}"

    methods = {"record": record, "hold": lambda: release.wait(60) and "held", "add": int.__add__}
    server = channel.Server(methods, workers=4, inline=frozenset({"record", "hold"}))
    first, second = channel.Channel(server.name), channel.Channel(server.name)
    try:
        calls = [first.call("record", i) for i in (3, 1, -2, 7)]
        assert [c.result(30) for c in calls[:2]] == ["took 3", "took 1"]
        with pytest.raises(ValueError, match="refused -2"):
            calls[2].result(30)
        assert calls[3].result(30) == "took 7"
        assert [i for i, _ in seen] == [3, 1, -2, 7]
        assert not any(name.startswith("m31-channel") for _, name in seen)  # not the pool's
        held = first.call("hold")
        after = first.call("add", 1, 2)  # behind the held call on its connection
        assert second.call("add", 2, 3).result(30) == 5  # another connection is not held
        assert not held.done() and not after.done()
        release.set()
        assert held.result(30) == "held" and after.result(30) == 3
    finally:
        release.set()
        first.close()
        second.close()


SERVER = """
import sys, time
from m31.cluster import channel
server = channel.Server({"sleep": time.sleep, "echo": lambda x: x}, workers=2)
print(server.name[1:], flush=True)
time.sleep(3600)
"""


def test_a_dead_server_fails_every_call_with_channel_closed():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        link = channel.Channel("\0" + proc.stdout.readline().strip())
        assert link.call("echo", "x").result(30) == "x"
        waiting = link.call("sleep", 3600)
        proc.kill()
        with pytest.raises(channel.ChannelClosed):
            waiting.result(30)
        assert link.closed
        with pytest.raises(channel.ChannelClosed):
            link.call("echo", "y").result(30)
    finally:
        proc.kill()
        proc.wait()
