"""Calls between the processes of a cluster on one machine without Ray's call path: a socket
an actor serves beside Ray (Linux). Ray stays the control plane: it places the actors, restarts
them, and carries every call to an actor on another machine and every call made before a
channel is open.

What goes over channels (`Link`, one per actor a process calls): an ingress's reads of the
shards on its node (searches, `m31.cluster.read`, also connected from the endpoint a shard's
answer carries; stored users, ads, and groups for frequency caps, `m31.cluster.cluster`), its
mutations to the coordinator, and the coordinator's prepares, commits and aborts to the shards
(`m31.cluster.coordinator`).

Why: on the 2-core development machine a Ray actor call that computes 10 ms costs about 2.3 ms
beyond it (1.2 ms to arrive, 1.1 ms back; an empty one about 1 ms, but the threads on its path
sleep while the call computes and each wakes late), as much as a fifth of a B = 1 call over
HTTP; a call on this socket costs about 0.5 ms (docs/SCALING.md). An events call makes three
such calls one after the other (the ingress's to the coordinator, then each shard's prepare and
commit). Ray's compiled graphs, which keep a channel between two actors, cost about 1.4 ms
there, hung in a test, and are torn down for good by an actor's death.

How: an actor's channel has an endpoint (its node and the socket's name); a caller on that
node connects and asks its later calls there. A channel that breaks (the actor's process died)
fails the calls on it with `ChannelClosed`, which the caller takes as the failed Ray call it
stands for: the actor is down, is asked again through Ray, and the restarted process's endpoint
is the one to connect to next. A process that stops answers nothing either way (its deadline).
The socket is in Linux's abstract namespace (no file to leave behind) and takes only
connections of its own user (SO_PEERCRED), who can reach the process anyway.

Wire: frames of (payload length u64, call id u64, payload) in little endian, the payload a
pickle (protocol 5). A call is (method, args); an answer is (ok, value or exception).
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import secrets
import socket
import struct
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

_HEADER = struct.Struct("<QQ")


class ChannelClosed(ConnectionError):
    """The channel broke (the shard's process died, or the connection failed): what a failed
    Ray call would have said."""


def available() -> bool:
    return sys.platform.startswith("linux")


def _send(sock: socket.socket, call_id: int, obj: Any) -> None:
    payload = pickle.dumps(obj, protocol=5)
    sock.sendall(_HEADER.pack(len(payload), call_id) + payload)


def _receive(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the channel closed")
        got += n
    return buf


def _frame(sock: socket.socket) -> tuple[int, bytearray]:
    size, call_id = _HEADER.unpack(_receive(sock, _HEADER.size))
    return call_id, _receive(sock, size)


class Server:
    """Serves `methods` (name -> function) to the connections of this process's user, each
    call on a pool of `workers` threads (as Ray's threaded actor serves its calls), but those
    named in `inline`: they run on their connection's own thread, one after the other in the
    order they came, which saves two thread hops a call (the calls one caller sends one at a
    time anyway: a coordinator's prepares and commits to a shard)."""

    def __init__(
        self, methods: Mapping[str, Callable], workers: int, inline: frozenset[str] = frozenset()
    ) -> None:
        self.methods, self.inline = dict(methods), frozenset(inline)
        self.name = f"\0m31-shard-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.name)
        self._listener.listen()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "m31-channel")
        threading.Thread(target=self._accept, name="m31-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lock = threading.Lock()  # one answer on the wire at a time

        def answer(call_id: int, done: concurrent.futures.Future) -> None:
            error = done.exception()
            message = (True, done.result()) if error is None else (False, error)
            with lock:
                try:
                    try:
                        _send(conn, call_id, message)
                    except (pickle.PicklingError, TypeError, AttributeError) as e:
                        _send(
                            conn,
                            call_id,
                            (False, RuntimeError(f"an answer that cannot be sent: {e}")),
                        )
                except OSError:
                    pass  # the caller is gone

        with conn:
            while True:
                try:
                    call_id, payload = _frame(conn)
                except (EOFError, OSError):
                    return
                done: concurrent.futures.Future = concurrent.futures.Future()
                try:
                    method, args = pickle.loads(payload)
                    fn = self.methods[method]
                except Exception as e:  # a call this process cannot take: its caller's error
                    done.set_exception(e)
                    answer(call_id, done)
                    continue
                if method in self.inline:
                    try:
                        done.set_result(fn(*args))
                    except BaseException as e:
                        done.set_exception(e)
                    answer(call_id, done)
                else:
                    self._pool.submit(fn, *args).add_done_callback(
                        lambda done, call_id=call_id: answer(call_id, done)
                    )


class Channel:
    """The caller's end: `call` sends, one reader thread settles the Futures. Thread-safe."""

    def __init__(self, name: str, timeout_s: float = 1.0) -> None:
        self.name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(name)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._next = 0
        self.closed = False
        threading.Thread(target=self._read, name="m31-channel", daemon=True).start()

    def call(self, method: str, *args) -> concurrent.futures.Future:
        """A Future of `method(*args)` on the server: its value, the method's own exception, or
        `ChannelClosed`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            payload = pickle.dumps((method, args), protocol=5)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            future.set_exception(TypeError(f"a call that cannot be sent: {e}"))
            return future
        with self._lock:
            if self.closed:
                future.set_exception(ChannelClosed(f"channel {self.name[1:]!r} closed"))
                return future
            self._next += 1
            self._pending[self._next] = future
            try:
                self._sock.sendall(_HEADER.pack(len(payload), self._next) + payload)
            except OSError as e:
                self._close_locked(e)
        return future

    def _read(self) -> None:
        while True:
            try:
                call_id, payload = _frame(self._sock)
            except (EOFError, OSError) as e:
                with self._lock:
                    self._close_locked(e)
                return
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is None:
                continue
            try:
                ok, value = pickle.loads(payload)
            except Exception as e:  # an exception class this process lacks: fail the call alone
                ok, value = False, RuntimeError(f"an answer that does not unpickle here: {e!r}")
            (future.set_result if ok else future.set_exception)(value)

    def close(self) -> None:
        with self._lock:
            self._close_locked(None)

    def _close_locked(self, why: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(ChannelClosed(f"channel {self.name[1:]!r} closed: {why}"))
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class Link:
    """Calls to one Ray actor that serves a channel (its `endpoint()`: (node id, name) or None):
    on the channel while one is open, else as Ray calls. `call` answers a Future either way,
    failing with the method's own exception, or with `ChannelClosed` where the actor's process is
    gone or restarting (a Ray call's `RayActorError`). The first call, and the first after one
    failed so, also asks the actor its endpoint; on this process's node, later calls take the
    channel. Thread-safe; not pickled (each process links its own)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.direct = available()  # whether to take a channel at all (else Ray calls only)
        self._channel: Channel | None = None
        self._ask = True  # whether the next call asks the endpoint
        self._lock = threading.Lock()

    @property
    def channel(self) -> Channel | None:
        """The open channel, if any."""
        found = self._channel
        return found if found is not None and not found.closed else None

    def call(self, method: str, *args) -> concurrent.futures.Future:
        direct = self.channel
        future = (
            direct.call(method, *args)
            if direct is not None
            else _settled(getattr(self.handle, method).remote(*args))
        )
        with self._lock:
            ask, self._ask = self._ask and self.direct, False
        if ask:
            self.handle.endpoint.remote().future().add_done_callback(self._answered)
        future.add_done_callback(self._watch)
        return future

    def _watch(self, done: concurrent.futures.Future) -> None:
        if isinstance(done.exception(), ChannelClosed):
            with self._lock:
                self._ask = True  # a restarted process serves another endpoint, maybe elsewhere

    def _answered(self, asked: concurrent.futures.Future) -> None:
        if asked.exception() is not None:
            with self._lock:
                self._ask = True
        else:
            self.connect(asked.result())

    def connect(self, endpoint: tuple[str, str] | None) -> None:
        """Take the channel at `endpoint` (the actor's: asked, or carried by an answer) if it
        is on this process's node and differs from the open one."""
        if endpoint is None or not self.direct or endpoint[0] != _node():
            return  # none, or on another machine: Ray calls
        with self._lock:
            if self.channel is not None and self.channel.name == endpoint[1]:
                return
            try:
                opened = Channel(endpoint[1])
            except OSError:
                return  # that process is gone; a call failing says when to ask its successor
            old, self._channel = self._channel, opened
        if old is not None:
            old.close()


def _node() -> str:
    """This process's Ray node id (asked each time: a process may connect to another cluster)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _settled(ref) -> concurrent.futures.Future:
    """A Ray call's answer as a channel's: the method's own exception (not `RayTaskError`), and
    `ChannelClosed` for `RayActorError`."""
    from ray.exceptions import RayActorError, RayTaskError

    out: concurrent.futures.Future = concurrent.futures.Future()

    def settle(done: concurrent.futures.Future) -> None:
        error = done.exception()
        if error is None:
            out.set_result(done.result())
        elif isinstance(error, RayTaskError):
            out.set_exception(error.cause if error.cause is not None else error)
        elif isinstance(error, RayActorError):
            closed = ChannelClosed(f"the actor is down or restarting ({error})")
            closed.__cause__ = error
            out.set_exception(closed)
        else:
            out.set_exception(error)

    ref.future().add_done_callback(settle)
    return out
