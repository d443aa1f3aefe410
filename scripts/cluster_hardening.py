"""The figures of docs/SCALING.md's "Hardening" section: what `m31 serve --ray` costs over HTTP
against `m31 serve` on the same index, and how long it takes to recover by itself from a
coordinator restarted beside a dying shard.

    .venv/bin/python scripts/cluster_hardening.py --world data/hardening            # both
    .venv/bin/python scripts/cluster_hardening.py --world data/hardening --only overhead

The world (made once, reused): the demo marketplace (50,000 ads, `m31 world generate --preset
demo`), its features, an untrained demo moe (E = 8, G = D = 64; a trained one prunes the scan
differently, so absolute times differ, not what is compared) and its bf16 index; or pass a
`make demo` folder (DIR/world, DIR/runs/moe.pt, DIR/index).

Overhead: one `m31 serve` and, for each S of --shards, one `m31 serve --ray --shards S` (its own
local Ray cluster), both up at once; one client sends B = 1 calls (K = 100, stored users,
random surfaces and platforms, the same sequence to both) to each in turn, --calls per server
in rounds of --round, so that whatever else runs on the machine weighs on both alike. The ratio
of each percentile is the cluster's over the single process's of the same phase.

Recovery: `m31 serve --ray --shards 3`; shard 1's process stopped (SIGSTOP), the coordinator's
killed (SIGKILL), and shard 1's killed once the restarted coordinator's process opened its log;
strict reads every 0.2 s from the last kill until one answers 200 whole (or --give-up seconds).
The actors' processes are found by the files they hold (a shard its index folder's lock, the
coordinator its decisions log).

Only the servers import m31 (`python -m m31.cli`, with this environment), so the same script
measures another checkout: PYTHONPATH=/path/to/it/src .venv/bin/python scripts/...
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq

SURFACES = ["feed", "reels", "stories", "search", "marketplace"]
PLATFORMS = ["ios", "android", "web"]


def build_world(root: Path) -> None:
    """The demo world, its features, an untrained demo moe and its index, under `root`."""
    import torch

    from m31.data import dataset
    from m31.engine.build import build_snapshot
    from m31.features.folder import features_for
    from m31.model import build_model, model_preset, save_checkpoint, vocab_sizes
    from m31.world.config import preset
    from m31.world.generate import generate

    data = root / "world"
    if not (data / "meta.json").is_file():
        ds, _ = generate(preset("demo"), seed=0)
        dataset.save(ds, data)
    feats = features_for(data)
    torch.manual_seed(0)
    sizes = vocab_sizes(feats)
    model = build_model(
        model_preset("demo", "moe"), sizes, feats.text_emb.shape[1], feats.cooc_emb.shape[1]
    ).eval()
    ckpt = save_checkpoint(root / "runs" / "moe.pt", model, feats, [])
    build_snapshot(data, ckpt, root / "index", overwrite=True)


@functools.cache
def data_option(world: Path) -> list[str]:
    """`--data WORLD/world` for a checkout from before served indexes carried their online
    features (its `m31 serve` reads the dataset folder); one from after refuses the option."""
    help_ = subprocess.run([sys.executable, "-m", "m31.cli", "serve", "--help"],
                           capture_output=True, text=True).stdout  # fmt: skip
    return ["--data", str(world / "world")] if "--data" in help_ else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`m31 serve [--ray --shards S]` on a free port, its output in `log`."""

    def __init__(self, world: Path, work: Path, shards: int | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = "single process" if shards is None else f"ray, S = {shards}"
        state = work / ("serving" if shards is None else f"cluster-{shards}")
        args = [
            sys.executable, "-m", "m31.cli", "serve", "--index", str(world / "index"),
            "--state", str(state), "--model", str(world / "runs" / "moe.pt"),
            *data_option(world), "--port", str(self.port), "--timeout-ms", "30000",
        ]  # fmt: skip
        if shards is not None:
            args += ["--ray", "--shards", str(shards)]
        self.log = (work / f"{state.name}.log").open("w")
        env = {**os.environ, "M31_ADMIN_TOKEN": "hardening"}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def ready(self, timeout: float = 900.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def bodies(world: Path, n: int, seed: int) -> list[dict]:
    users = pq.read_table(world / "world" / "users.parquet").column("user_id").to_numpy()
    rng = np.random.default_rng(seed)
    return [
        {
            "requests": [
                {
                    "user_id": int(rng.choice(users)),
                    "surface": SURFACES[int(rng.integers(len(SURFACES)))],
                    "platform": PLATFORMS[int(rng.integers(len(PLATFORMS)))],
                    "k": 100,
                }
            ]
        }
        for _ in range(n)
    ]


def timed_calls(http: httpx.Client, calls: list[dict]) -> list[float]:
    out = []
    for body in calls:
        t = time.perf_counter()
        r = http.post("/v1/retrieve", json=body)
        out.append(1000 * (time.perf_counter() - t))
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return out


def overhead(world: Path, work: Path, shard_counts: list[int], calls: int, round_: int) -> str:
    rows = []
    single = Server(world, work, None).ready()
    try:
        for s in shard_counts:
            cluster = Server(world, work, s).ready()
            try:
                servers = [single, cluster]
                clients = [httpx.Client(base_url=x.url, timeout=60) for x in servers]
                sequence = bodies(world, calls, seed=s)
                for c in clients:
                    timed_calls(c, sequence[:30])  # warm-up: caches, the batcher's cost model
                lat: list[list[float]] = [[], []]
                for start in range(0, calls, round_):
                    for i, c in enumerate(clients):
                        lat[i] += timed_calls(c, sequence[start : start + round_])
                for c in clients:
                    c.close()
                p = [np.percentile(x, [50, 99]) for x in lat]
                rows.append((s, *p[0], *p[1]))
            finally:
                cluster.stop()
    finally:
        single.stop()
    lines = [
        f"B = 1, K = 100, {calls} calls per server, alternating in rounds of {round_}",
        "",
        "| S | single p50 ms | single p99 ms | ray p50 ms | ray p99 ms | p50 ratio | p99 ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, s50, s99, c50, c99 in rows:
        lines.append(
            f"| {s} | {s50:.1f} | {s99:.1f} | {c50:.1f} | {c99:.1f} | {c50 / s50:.2f}× | "
            f"{c99 / s99:.2f}× |"
        )
    return "\n".join(lines)


def holding(root: int, suffix: str) -> int:
    """The process below `root` that has a file ending in `suffix` open."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            links = [
                os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")
            ]
        except OSError:
            continue
        if any(link.endswith(suffix) for link in links) and _below(int(entry), root):
            return int(entry)
    raise LookupError(f"no process below {root} holds *{suffix}")


def _below(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return False


def recovery(world: Path, work: Path, give_up: float) -> str:
    server = Server(world, work, 3).ready()
    statuses: dict[int, int] = {}
    try:
        body = bodies(world, 1, seed=7)[0] | {"timeout_ms": 2000}
        whole = httpx.post(f"{server.url}/v1/retrieve", json=body, timeout=60).json()
        shard = holding(server.proc.pid, "/shard-1/index/LOCK")
        coordinator = holding(server.proc.pid, "/coordinator/decisions.log")
        os.kill(shard, signal.SIGSTOP)
        os.kill(coordinator, signal.SIGKILL)
        # Shard 1 dies while the restarted coordinator starts: once its process has opened
        # its log, it is past any moment where shard 1 could already be back.
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline:
            try:
                if holding(server.proc.pid, "/coordinator/decisions.log") != coordinator:
                    break
            except LookupError:
                pass
            time.sleep(0.01)
        os.kill(shard, signal.SIGKILL)
        killed = time.monotonic()
        back = None
        while time.monotonic() - killed < give_up:
            try:
                r = httpx.post(f"{server.url}/v1/retrieve", json=body, timeout=60)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200 and not r.json()["partial"]:
                    assert r.json()["results"] == whole["results"], "a different answer"
                    back = time.monotonic() - killed
                    break
            except httpx.TransportError as e:
                statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
            time.sleep(0.2)
    finally:
        server.stop()
    seen = ", ".join(f"{n} × {k}" for k, n in statuses.items())
    if back is None:
        return f"no whole answer within {give_up:.0f} s of the last kill (answers: {seen})"
    return f"reads whole again {back:.1f} s after the last kill (answers meanwhile: {seen})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=Path, required=True, help="made here if absent")
    parser.add_argument("--only", choices=["overhead", "recovery"], default=None)
    parser.add_argument("--shards", default="1,3")
    parser.add_argument("--calls", type=int, default=600, help="B = 1 calls per server")
    parser.add_argument("--round", type=int, default=50, help="calls per server per turn")
    parser.add_argument("--give-up", type=float, default=150.0, help="seconds (recovery)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if not (args.world / "index" / "manifest.json").is_file():
        build_world(args.world)
    import m31

    out = [f"code: {Path(m31.__file__).parent}"]
    with tempfile.TemporaryDirectory(prefix="m31-hardening-") as tmp:
        work = Path(tmp)
        if args.only in (None, "recovery"):
            out.append("recovery: " + recovery(args.world, work, args.give_up))
            print(out[-1], flush=True)
        if args.only in (None, "overhead"):
            shards = [int(s) for s in args.shards.split(",")]
            out.append(overhead(args.world, work, shards, args.calls, args.round))
            print(out[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n\n".join(out) + "\n")
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
