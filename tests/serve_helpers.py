"""A tiny served world on disk, and real servers on free loopback ports (in a thread, in a child
process, or on Ray Serve over a sharded cluster), for the serving tests."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ADMIN, READ = "admin-secret", "read-secret"


@dataclass
class World:
    root: Path
    data: Path  # dataset folder (features under data/features)
    model: Path  # checkpoint
    snapshot: Path  # index snapshot the serving folders start from, with its online features


def build_world(
    root: Path, world: str = "tiny", model: str = "tiny", seed: int = 7, **overrides
) -> World:
    """A marketplace (the `world` preset, 10,000 impressions unless `overrides` say), features
    with real text embeddings, an untrained moe of the `model` preset, an index."""
    from m31.data import dataset
    from m31.engine.build import index_from_table
    from m31.engine.load import write_online
    from m31.features.folder import features_for
    from m31.model import (
        Catalog,
        build_model,
        encode_ads,
        model_preset,
        save_checkpoint,
        vocab_sizes,
    )
    from m31.world.config import preset
    from m31.world.generate import generate

    data = root / "world"
    cfg = preset(world).with_overrides(**{"n_impressions": 10_000, **overrides})
    ds, _ = generate(cfg, seed=seed)
    dataset.save(ds, data)
    feats = features_for(data)
    torch.manual_seed(0)
    sizes = vocab_sizes(feats)
    net = build_model(
        model_preset(model, "moe"), sizes, feats.text_emb.shape[1], feats.cooc_emb.shape[1]
    ).eval()
    ckpt = save_checkpoint(root / "runs" / "moe.pt", net, feats, [])
    g, x, b = encode_ads(net, Catalog.from_features(feats))
    snapshot = index_from_table(ds.ads, g, x, b).save(
        root / "index", beside=lambda folder: write_online(folder, feats, net.cfg.max_len)
    )
    return World(root, data, ckpt, snapshot)


def fresh_state(world: World, name: str) -> Path:
    """A new serving folder (snapshot + empty log + online features) made from the world's
    snapshot, named after `name` (and unique: test modules share one world)."""
    from m31.engine.load import serving_folder

    return serving_folder(world.snapshot, Path(tempfile.mkdtemp(prefix=f"{name}-", dir=world.root)))


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def free_port() -> int:
    """A loopback port free now, for a server that binds it itself (a race with another binder
    is unlikely on loopback)."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    return port


class ThreadServer:
    """uvicorn serving an app in a background thread of this process."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = free_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def until(condition, what: str, timeout: float = 300.0) -> None:
    """Poll `condition()` until it is true; `timeout` only bounds one that never comes true
    (on a busy machine a condition may take long: no test asserts how long)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def wait_ready(url: str, timeout: float = 600.0, proc: subprocess.Popen | None = None) -> None:
    """Poll /health/ready; `timeout` only bounds a server that never comes up (a busy machine
    loads the model and the text encoder slowly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


class ProcessServer:
    """`m31 serve` in a child process (so that it can be killed with SIGKILL)."""

    def __init__(self, world: World, state: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "m31.cli", "serve",
            "--index", str(state), "--model", str(world.model),
            "--port", str(self.port), *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProcessServer:
        env = {**os.environ, "M31_ADMIN_TOKEN": ADMIN}
        state = Path(self.args[self.args.index("--index") + 1])
        self.log = state.with_name(state.name + ".log").open("a")
        self.proc = subprocess.Popen(self.args, env=env, stdout=self.log, stderr=self.log)
        wait_ready(self.url, proc=self.proc)
        return self

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def new_ad(ad_id: int, tag: str, **over) -> dict:
    ad = {
        "ad_id": ad_id,
        "advertiser_id": 5,
        "objective": "clicks",
        "format": "video",
        "topic": 1,
        "category": 0,
        "text": f"Trail running shoes, model {ad_id}",
        "tags": [tag],
    }
    return {**ad, **over}


def start_cluster(snapshot: Path, root: Path, shards: int = 3):
    """A cluster of `shards` shards made from an index snapshot and its online features, in a
    new folder under `root`, started on the Ray cluster this process is connected to:
    (its state folder, its `Cluster`)."""
    from m31.cluster.actors import ClusterOptions
    from m31.cluster.cluster import Cluster
    from m31.cluster.layout import init_cluster
    from m31.engine.load import copy_online

    state = init_cluster(snapshot, Path(tempfile.mkdtemp(prefix="cluster-", dir=root)) / "c",
                         shards)  # fmt: skip
    copy_online(snapshot, state)
    return state, Cluster.start(state, ClusterOptions(shard_cpus=0))


def stop_cluster(cluster) -> None:
    """Kill a cluster's actors for good (a test's clusters go before the run's Ray cluster)."""
    import ray

    for actor in [*cluster.shards, cluster.coordinator]:
        ray.kill(actor, no_restart=True)


class RayServer:
    """A config's API as a Serve application over `cluster` (the config's index is its state
    folder), on the Serve instance at `base`, under a name and route prefix of its own."""

    names = itertools.count()

    def __init__(self, base: str, cfg, cluster) -> None:
        self.cfg, self.cluster, self.name = cfg, cluster, f"app{next(self.names)}"
        self.url = f"{base}/{self.name}"

    def __enter__(self) -> RayServer:
        from m31.cluster.serve import IngressOptions, deploy

        deploy(self.cfg, self.cluster, IngressOptions(cpus=0), self.name, f"/{self.name}")
        wait_ready(self.url)
        return self

    def __exit__(self, *exc) -> None:
        from ray import serve

        # Not waited for: the replica's graceful stop takes seconds, and nothing reuses its name.
        serve.delete(self.name, _blocking=False)


def push_body(
    url: str,
    call: str,
    headers: str,
    size: int,
    chunked: bool = False,
    bound_s: float = 600.0,
):
    """Send `call` ("METHOD /path", under `url`'s own path) with `headers` (one a line, each
    ending in `\\n`) and then up to `size` bytes of body (in chunks if `chunked`) for as long
    as the server takes them and has not answered; (the answer, body bytes sent). A server
    that reads the whole body before answering makes this send all `size` bytes; one that
    answers first stops it early. `bound_s` bounds only a server that never answers."""
    import select
    from urllib.parse import urlsplit

    where = urlsplit(url)
    method, path = call.split(" ", 1)
    head = f"{method} {where.path}{path} HTTP/1.1\nHost: test\n{headers}\n"
    piece = b" " * (1 << 20)
    sent, deadline = 0, time.monotonic() + bound_s
    with socket.create_connection((where.hostname, where.port), timeout=bound_s) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode())
        while sent < size and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break  # answered (or closed) before the body was all sent
            if not writable:
                continue
            data = piece[: size - sent]
            framed = b"%x\r\n%s\r\n" % (len(data), data) if chunked else data
            try:
                sock.sendall(framed)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(data)
        if chunked and sent == size:
            sock.sendall(b"0\r\n\r\n")
        return read_answer(sock), sent


def read_answer(sock: socket.socket) -> bytes:
    """One HTTP answer with a content-length, read whole from `sock`."""
    import re

    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
        re.search(rb"content-length: (\d+)", answer.lower())[1]
    ):
        piece = sock.recv(65536)
        assert piece, f"the server closed the connection after {answer!r}"
        answer += piece
    return answer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def rss_bytes(pid: int) -> int:
    """A process's resident set size (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def route_calls(app) -> list[tuple[str, str, bool]]:
    """(method, path with its parameters filled, whether it declares a body) of every route of
    `app` (HEAD left out: it answers as GET)."""
    import re

    calls = []
    for route in app.routes:
        path = re.sub(r"\{[^}]+\}", "1", route.path)
        body = getattr(route, "body_field", None) is not None
        calls += [
            (m, path, body) for m in sorted(getattr(route, "methods", None) or ()) if m != "HEAD"
        ]
    return calls


def check_every_route_is_guarded(url: str, app, token: str, body_timeout_s: float) -> None:
    """Walk every route of `app` (served at `url`): without a token, a call declaring 300 MB is
    answered after 16 KiB of it (401/403 where a token is required, 413 on an open route that
    takes a body; an open route without a body answers as usual); with `token`, every route that
    takes a body answers such a call 413, and 408 to a body that stalls."""
    declared = 300 << 20
    json = "Content-Type: application/json\n"
    authorized = f"{json}Authorization: Bearer {token}\n"
    for method, path, body in route_calls(app):
        call = f"{method} {path}"
        answer, _ = push_body(
            url, call, f"{json}Content-Length: {declared}\n", 16 << 10, bound_s=120
        )
        status = status_of(answer)
        assert status < 500 and status != 408, (call, answer[:300])
        if body:
            assert status in (401, 403, 413), (call, answer[:300])
            answer, _ = push_body(url, call, f"{authorized}Content-Length: {declared}\n",
                                  16 << 10, bound_s=120)  # fmt: skip
            assert status_of(answer) == 413, (call, answer[:300])
            # 15 of 999 bytes, then nothing: refused after the body timeout, not held.
            answer, _ = push_body(url, call, f"{authorized}Content-Length: 999\n", 15, bound_s=120)
            assert status_of(answer) == 408, (call, answer[:300])
            assert f"{body_timeout_s:g} s".encode() in answer
