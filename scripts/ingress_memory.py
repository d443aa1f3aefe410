"""An ingress's memory against the number of users the cluster stores (docs/SCALING.md,
"Users"), measured on a running `m31 serve --ray`: the same script measures any checkout, so
before and after come from one run.

    python scripts/serve_limits.py build DIR --ads 50000          # a served world, once
    python scripts/ingress_memory.py DIR [--checkout SRC] [--shards 2] [--users 2000000]

The server runs one ingress, in its own process (the default of `m31 serve --ray`), over
--shards shards. Two phases send the same traffic, PUT /v1/users calls of 5,000 users each
(--users in all) and then 300 single-request retrieves of random stored users, and the
ingress's resident memory (VmRSS of the server's process) is read after each:

* phase 1 rewrites the attributes of the world's own users (20,000 stored users after it);
* phase 2 creates --users new users (20,000 + --users stored after it).

So the two readings differ only in the number of users the cluster stores. Prints both and
their ratio, and writes them as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import httpx
from serve_limits import Server

TOKEN = "ingress-memory"
PER_CALL = 5_000
RETRIEVES = 300


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid`, MB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def put_users(client: httpx.Client, url: str, ids: list[int], rng: random.Random) -> int:
    """Replace the attributes of `ids` (creating the new ones), PER_CALL a call; the users the
    cluster reports holding after the last call."""
    held = 0
    for at in range(0, len(ids), PER_CALL):
        body = {"users": [{"user_id": u, "age": rng.randrange(18, 80)}
                          for u in ids[at : at + PER_CALL]]}  # fmt: skip
        r = client.put(f"{url}/v1/users", json=body, timeout=600)
        r.raise_for_status()
        held = r.json()["users"]
    return held


def retrieves(client: httpx.Client, url: str, ids: list[int], rng: random.Random) -> float:
    """RETRIEVES single-request calls of random users of `ids`; their median time, ms."""
    times = []
    for _ in range(RETRIEVES):
        body = {"requests": [{"user_id": rng.choice(ids), "surface": "feed", "k": 100}]}
        start = time.perf_counter()
        r = client.post(f"{url}/v1/retrieve", json=body, timeout=600)
        r.raise_for_status()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a world `serve_limits.py build` made")
    parser.add_argument("--checkout", type=Path, help="another checkout's root (default: this)")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--users", type=int, default=2_000_000, help="new users in phase 2")
    parser.add_argument("--port", type=int, default=8761)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import pyarrow.parquet as pq

    own = pq.read_table(args.dir / "world" / "users.parquet").column("user_id").to_pylist()
    new = list(range(10**12, 10**12 + args.users))
    os.environ["M31_ADMIN_TOKEN"] = TOKEN
    server = Server(args.dir, args.checkout, args.port, ["--ray", "--shards", str(args.shards)])
    rng = random.Random(0)
    out = {"checkout": str(args.checkout or "."), "shards": args.shards, "phases": []}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(headers=headers) as client:
            retrieves(client, server.url, own, rng)  # warm
            for name, ids in (("rewrite", own), ("create", new)):
                start = time.perf_counter()
                users = put_users(client, server.url, ids, rng)
                put_s = time.perf_counter() - start
                p50 = retrieves(client, server.url, own + ids if name == "create" else own, rng)
                phase = {"phase": name, "users_put": len(ids), "stored_users": users,
                         "put_s": round(put_s, 1), "retrieve_p50_ms": round(p50, 2),
                         "ingress_rss_mb": round(rss_mb(server.proc.pid), 1)}  # fmt: skip
                out["phases"].append(phase)
                print(json.dumps(phase), flush=True)
    finally:
        server.stop()
    first, last = (p["ingress_rss_mb"] for p in (out["phases"][0], out["phases"][-1]))
    out["rss_ratio"] = round(last / first, 3)
    print(f"ingress RSS {first:.0f} MB at {out['phases'][0]['stored_users']:,} stored users, "
          f"{last:.0f} MB at {out['phases'][-1]['stored_users']:,}: {out['rss_ratio']}x")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
