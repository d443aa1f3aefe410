"""What one call can cost the others on `m31 serve` (docs/SERVING.md, "Limits"), measured on a
running server: the same script measures any checkout, so before and after come from one run.

    python scripts/serve_limits.py build DIR [--ads 50000]        # a served world, once
    python scripts/serve_limits.py run DIR [--checkout SRC] [--out FILE.json]

`build` writes a marketplace of --ads ads (the demo preset's shape, a shorter log), its features
with real text embeddings, an untrained moe of the demo preset (E = 8, G = D = 64: serving
costs do not depend on training) and its index. `run` starts `m31 serve` on it (from --checkout's
`src`, default this one) and measures, printing a table and writing every figure as JSON:

* **filter storm**: one retrieve whose filter is an `any` of 400,000 `eq` clauses (13 MB), sent
  while one client calls retrieve back to back and another /health/live: the heavy call's
  status and time, how long the other retrieves failed, the slowest /health/live;
* **fairness**: single-request calls (1 client, closed loop, default deadline) alone, then while
  one call of 1,024 requests (k = 100, 60 s deadline) runs: p50, p99, how many were refused,
  and the large call's status and time;
* **admission**: 300 single-request calls, then one call of 1,024 requests with a 60 s
  deadline: its status, time and, if refused, the server's reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

FILTER_CLAUSES = 400_000
BIG = 1024


def build(root: Path, ads: int) -> None:
    # The serving tests' builder (tests/serve_helpers.py), at the demo preset's shape.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_helpers import build_world

    build_world(root, world="demo", model="demo", seed=0, n_ads=ads, n_impressions=200_000)


def users(root: Path) -> list[int]:
    import pyarrow.parquet as pq

    return pq.read_table(root / "world" / "users.parquet").column("user_id").to_pylist()[:2000]


class Server:
    def __init__(self, root: Path, checkout: Path | None, port: int, extra: list[str]) -> None:
        self.state = Path(tempfile.mkdtemp()) / "serving"
        env = dict(os.environ)
        if checkout is not None:
            env["PYTHONPATH"] = str(checkout / "src")
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.state.parent / "server.log", "w")
        # A checkout from before served indexes carried their online features reads the dataset
        # folder (`--data`); one from after refuses the option.
        help_ = subprocess.run([sys.executable, "-m", "m31.cli", "serve", "--help"], env=env,
                               capture_output=True, text=True).stdout  # fmt: skip
        data = ["--data", str(root / "world")] if "--data" in help_ else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "m31.cli", "serve", "--index", str(root / "index"),
             "--state", str(self.state), "--model", str(root / "runs" / "moe.pt"),
             *data, "--port", str(port), *extra],
            env=env, stdout=self.log, stderr=self.log,
        )  # fmt: skip
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited: {(self.state.parent / 'server.log').read_text()}"
                )
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def one(client: httpx.Client, url: str, user: int, **body) -> tuple[int, float, str]:
    start = time.perf_counter()
    request = {"user_id": user, "surface": "feed", "platform": "ios", "k": 100}
    r = client.post(f"{url}/v1/retrieve", json={"requests": [request], **body}, timeout=600)
    detail = "" if r.status_code == 200 else r.json().get("detail", "")
    return r.status_code, time.perf_counter() - start, detail


def loop(url: str, ids: list[int], stop: threading.Event, out: list) -> None:
    """Single-request retrieves back to back until `stop`: (start, status, seconds)."""
    with httpx.Client() as client:
        i = 0
        while not stop.is_set():
            start = time.perf_counter()
            status, seconds, _ = one(client, url, ids[i % len(ids)])
            out.append((start, status, seconds))
            i += 1


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def filter_storm(url: str, ids: list[int]) -> dict:
    clauses = [{"eq": ["advertiser_id", i]} for i in range(FILTER_CLAUSES)]
    body = {"requests": [{"user_id": ids[0], "surface": "feed", "platform": "ios",
                          "filter": {"any": clauses}}]}  # fmt: skip
    payload = json.dumps(body).encode()
    stop, others, live = threading.Event(), [], []

    def live_loop() -> None:
        with httpx.Client() as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get(f"{url}/health/live", timeout=600)
                live.append(time.perf_counter() - start)
                time.sleep(0.05)

    threads = [threading.Thread(target=loop, args=(url, ids, stop, others)),
               threading.Thread(target=live_loop)]  # fmt: skip
    for t in threads:
        t.start()
    time.sleep(2)
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/retrieve", content=payload, timeout=600,
                   headers={"content-type": "application/json"})  # fmt: skip
    heavy_s = time.perf_counter() - start
    # Watch the others until they have answered 200 for 5 s in a row after the heavy call.
    while True:
        time.sleep(0.5)
        late = [o for o in others if o[0] > start]
        failed = [o for o in late if o[1] != 200]
        last_fail = max((o[0] + o[2] for o in failed), default=start)
        if time.perf_counter() - max(last_fail, start + heavy_s) > 5:
            break
    stop.set()
    for t in threads:
        t.join()
    late = [o for o in others if o[0] > start]
    failed = [o for o in late if o[1] != 200]
    return {
        "bytes": len(payload),
        "status": r.status_code,
        "detail": r.json().get("detail", "")[:160],
        "seconds": round(heavy_s, 3),
        "others_failed": len(failed),
        "others_answered": len(late),
        "others_failing_s": round(
            (max(o[0] + o[2] for o in failed) - min(o[0] for o in failed)) if failed else 0.0, 3
        ),
        "live_max_ms": round(1000 * max(live), 1),
    }


def fairness(url: str, ids: list[int], alone_calls: int = 300) -> dict:
    with httpx.Client() as client:
        alone = [one(client, url, ids[i % len(ids)]) for i in range(alone_calls)]
    big = [{"user_id": ids[i % len(ids)], "surface": "feed", "platform": "ios", "k": 100}
           for i in range(BIG)]  # fmt: skip
    stop, during = threading.Event(), []
    t = threading.Thread(target=loop, args=(url, ids, stop, during))
    t.start()
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/retrieve", json={"requests": big, "timeout_ms": 60_000}, timeout=600)
    big_s = time.perf_counter() - start
    stop.set()
    t.join()
    inside = [d for d in during if d[0] >= start and d[0] + d[2] <= start + big_s]
    ok_alone = [s for status, s, _ in alone if status == 200]
    ok_during = [s for _, status, s in inside if status == 200]
    return {
        "alone_p50_ms": round(1000 * statistics.median(ok_alone), 1),
        "alone_p99_ms": round(1000 * pct(ok_alone, 0.99), 1),
        "alone_refused": sum(status != 200 for status, _, _ in alone),
        "during_calls": len(inside),
        "during_refused": sum(status != 200 for _, status, _ in inside),
        "during_p50_ms": round(1000 * statistics.median(ok_during), 1) if ok_during else None,
        "during_p99_ms": round(1000 * pct(ok_during, 0.99), 1) if ok_during else None,
        "big_status": r.status_code,
        "big_seconds": round(big_s, 2),
    }


def admission(url: str, ids: list[int], small_calls: int = 300) -> dict:
    with httpx.Client() as client:
        for i in range(small_calls):
            one(client, url, ids[i % len(ids)])
    big = [{"user_id": ids[i % len(ids)], "surface": "feed", "platform": "ios", "k": 100}
           for i in range(BIG)]  # fmt: skip
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/retrieve", json={"requests": big, "timeout_ms": 60_000}, timeout=600)
    return {
        "status": r.status_code,
        "seconds": round(time.perf_counter() - start, 2),
        "detail": "" if r.status_code == 200 else r.json().get("detail", "")[:160],
    }


def run(root: Path, checkout: Path | None, port: int, extra: list[str], only: list[str]) -> dict:
    ids = users(root)
    out = {}
    for name, measure in (("admission", admission), ("fairness", fairness),
                          ("filter_storm", filter_storm)):  # fmt: skip
        if only and name not in only:
            continue
        server = Server(root, checkout, port, extra)  # a fresh server each: nothing carried over
        try:
            out[name] = measure(server.url, ids)
        finally:
            server.stop()
        print(name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--ads", type=int, default=50_000)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("--checkout", type=Path, help="another checkout's root (default: this one)")
    r.add_argument("--port", type=int, default=8741)
    r.add_argument("--out", type=Path)
    r.add_argument("--only", default="", help="comma-separated measurements (default: all)")
    r.add_argument(
        "--serve", default="", help="extra `m31 serve` options, e.g. '--max-slice-ms 50'"
    )
    args = parser.parse_args()
    if args.command == "build":
        build(args.dir, args.ads)
        return
    only = [m for m in args.only.split(",") if m]
    out = run(args.dir, args.checkout, args.port, args.serve.split(), only)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
