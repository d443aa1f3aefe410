"""Closed-loop load test of a running m31 server: QPS, latency percentiles, ads scored/s.

`concurrency` clients each send one retrieve call, wait for the answer, and send the next,
for `duration` seconds. Requests are drawn from the dataset's users (stored user ids) with
random surfaces and platforms of its vocabularies at the current time. Server-side figures (device calls, ads
scored) are read from /metrics before and after, so batching shows as requests per device call.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)  # of successful calls
    errors: dict[str, int] = field(default_factory=dict)  # status (or exception) -> count
    device_calls: float = 0.0
    ads_scored: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    def row(self) -> dict:
        lat = np.array(self.latencies_ms) if self.latencies_ms else np.array([np.nan])
        return {
            "concurrency": self.concurrency,
            "calls": self.ok,
            "qps": self.ok / self.seconds,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "requests_per_device_call": self.ok / self.device_calls if self.device_calls else 0.0,
            "ads_scored_per_s": self.ads_scored / self.seconds,
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
        }


def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (counters export NAME_total)."""
    total = 0.0
    for m in re.finditer(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


async def _run(
    url: str,
    user_ids: np.ndarray,
    concurrency: int,
    duration: float,
    k: int,
    token: str | None,
    seed: int,
    surfaces: Sequence[str],
    platforms: Sequence[str],
) -> LoadResult:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        before = (await http.get("/metrics")).text
    result = LoadResult(concurrency, duration)
    stop = time.perf_counter() + duration

    async def client(i: int) -> None:
        # One connection per client, each with its own httpx client: a shared pool of many
        # connections costs httpx more CPU per call than the server's work (measured: 140 vs
        # 880 calls/s on /health/live at 64 connections), and would measure the load generator.
        rng = np.random.default_rng(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as http:
            while time.perf_counter() < stop:
                body = {
                    "requests": [
                        {
                            "user_id": int(rng.choice(user_ids)),
                            "surface": surfaces[rng.integers(len(surfaces))],
                            "platform": platforms[rng.integers(len(platforms))],
                            "k": k,
                        }
                    ]
                }
                start = time.perf_counter()
                try:
                    r = await http.post("/v1/retrieve", json=body)
                    kind = None if r.status_code == 200 else str(r.status_code)
                except httpx.HTTPError as e:
                    kind = type(e).__name__
                if kind is None:
                    result.latencies_ms.append(1000 * (time.perf_counter() - start))
                else:
                    result.errors[kind] = result.errors.get(kind, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    result.seconds = time.perf_counter() - t0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        after = (await http.get("/metrics")).text
    for name, attr in (("m31_device_calls", "device_calls"), ("m31_ads_scored", "ads_scored")):
        setattr(result, attr, _metric(after, name) - _metric(before, name))
    return result


def run(
    url: str,
    user_ids: np.ndarray,
    concurrency: int,
    surfaces: Sequence[str],
    platforms: Sequence[str],
    duration: float = 10.0,
    k: int = 100,
    token: str | None = None,
    seed: int = 0,
) -> LoadResult:
    """`surfaces` and `platforms`: the values requests draw from (the dataset's vocabularies)."""
    if concurrency < 1 or duration <= 0 or k < 1:
        raise ValueError("concurrency and k must be >= 1 and duration > 0")
    if not len(user_ids) or not surfaces or not platforms:
        raise ValueError("no user ids, surfaces or platforms to send")
    return asyncio.run(
        _run(url, np.asarray(user_ids), concurrency, duration, k, token, seed, surfaces, platforms)
    )


def format_rows(rows: list[dict]) -> str:
    head = (
        "| concurrency | calls | QPS | p50 ms | p99 ms | requests / device call "
        "| ads scored / s | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {r['concurrency']} | {r['calls']} | {r['qps']:.1f} | {r['p50_ms']:.1f} | "
        f"{r['p99_ms']:.1f} | {r['requests_per_device_call']:.1f} | "
        f"{r['ads_scored_per_s'] / 1e6:.1f} M | {r['errors']}"
        + (
            f" ({', '.join(f'{k}: {v}' for k, v in r['error_kinds'].items())})"
            if r["errors"]
            else ""
        )
        + " |"
        for r in rows
    ]
    return "\n".join([head, *lines])
