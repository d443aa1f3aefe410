"""Closed-loop load test of a running m31 server: QPS, latency percentiles, ads scored/s.

`concurrency` clients each send one retrieve call, wait for the answer, and send the next,
for `duration` seconds, each on a minimal HTTP/1.1 keep-alive connection (`m31.bench.http1`)
so that the load generator takes little of the machine it measures. Requests are drawn from
the dataset's users (stored user ids) with random surfaces and platforms of its vocabularies
(none, for data without them) at the current time. Server-side figures (device calls, ads scored) are read from /metrics before and after,
so batching shows as requests per device call.

With `events` (`EventLoad`), more clients stream engagement events meanwhile (POST /v1/events,
batches of random stored users and ads at the current time, closed loop or paced, with the
admin token), from a process of their own so that making their calls does not delay the
retrieve clients', each on a connection of its own too: events acknowledged per second and the
event calls' p99 join the row.

`m31 loadtest` prints the rows and appends their figures to the results table (`figures`,
`m31.bench.results`), as `m31 bench` does.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from m31.bench.http1 import Http1, HttpError
from m31.bench.results import Figure

JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class EventLoad:
    """Event streaming beside the retrieve load: `clients` senders of `batch` events each, on
    `ad_ids`, with the admin `token`; closed loop, or paced to `rate` events per second in all
    (0: as fast as the server acknowledges)."""

    clients: int
    batch: int
    ad_ids: np.ndarray
    token: str
    rate: float = 0.0


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)  # of successful calls
    errors: dict[str, int] = field(default_factory=dict)  # status (or exception) -> count
    device_calls: float = 0.0
    ads_scored: float = 0.0
    events: int = 0  # events acknowledged
    event_latencies_ms: list[float] = field(default_factory=list)  # of acknowledged event calls

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
            "events_per_s": self.events / self.seconds,
            "event_p99_ms": (
                float(np.percentile(self.event_latencies_ms, 99))
                if self.event_latencies_ms
                else 0.0
            ),
        }


def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (counters export NAME_total)."""
    total = 0.0
    for m in re.finditer(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


class _Window:
    """The measured window of `clients` concurrent clients: it opens when every client is
    connected (so a slow start is not counted as idle time) and lasts `duration` seconds; each
    client makes at least one call in it, however slow the machine, and a call started inside
    it is finished and counted."""

    def __init__(self, clients: int, duration: float) -> None:
        self._barrier = asyncio.Barrier(clients)
        self._duration = duration
        self._stop = math.inf

    async def ready(self) -> None:
        """Wait until every client is connected; the window is open after it."""
        if await self._barrier.wait() == 0:  # one of them opens it
            self._stop = time.perf_counter() + self._duration
        await self._barrier.wait()  # every client sees it open

    @property
    def opened(self) -> float:
        """When the window opened (`time.perf_counter`)."""
        return self._stop - self._duration

    def closed(self) -> bool:
        """Whether a client that has made a call stops (checked after each call)."""
        return time.perf_counter() >= self._stop


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
    clock = _Window(concurrency, duration)

    async def client(i: int) -> None:
        # One minimal keep-alive connection per client (`m31.bench.http1`): an httpx client
        # costs 3-4 ms of CPU a call, on the cores the server runs on, and its pauses were the
        # worst calls' latency (the retrieve p99 of `m31 serve --ray` alone: 49 ms with it, 29
        # ms without, the same server; docs/SCALING.md).
        rng = np.random.default_rng(seed * 1000 + i)
        http = Http1(url, {**headers, **JSON}, timeout_s=30)
        try:
            await clock.ready()
            while True:
                request = {"user_id": int(rng.choice(user_ids)), "k": k}
                if surfaces:
                    request["surface"] = surfaces[rng.integers(len(surfaces))]
                if platforms:
                    request["platform"] = platforms[rng.integers(len(platforms))]
                body = json.dumps({"requests": [request]}).encode()
                start = time.perf_counter()
                try:
                    status, _ = await http.post("/v1/retrieve", body)
                    kind = None if status == 200 else str(status)
                except (HttpError, TimeoutError) as e:
                    kind = type(e).__name__
                if kind is None:
                    result.latencies_ms.append(1000 * (time.perf_counter() - start))
                else:
                    result.errors[kind] = result.errors.get(kind, 0) + 1
                if clock.closed():
                    break
        finally:
            await http.close()

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    result.seconds = time.perf_counter() - clock.opened  # the measured window, calls finished
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        after = (await http.get("/metrics")).text
    for name, attr in (("m31_device_calls", "device_calls"), ("m31_ads_scored", "ads_scored")):
        setattr(result, attr, _metric(after, name) - _metric(before, name))
    return result


async def _stream(
    url: str,
    events: EventLoad,
    user_ids: np.ndarray,
    surfaces: Sequence[str],
    duration: float,
    seed: int,
    result: LoadResult,
) -> None:
    """`events.clients` event senders for `duration` seconds, counted into `result`."""
    clock = _Window(events.clients, duration)
    auth = {"Authorization": f"Bearer {events.token}"}
    # Paced: each client's calls at fixed times (a late call is not made up for later).
    every = events.clients * events.batch / events.rate if events.rate else 0.0

    async def sender(i: int) -> None:
        rng = np.random.default_rng(seed * 1000 + 500 + i)
        http = Http1(url, {**auth, **JSON}, timeout_s=30)  # httpx would cost as much as the server
        try:
            await clock.ready()
            due = time.perf_counter() + i * every / events.clients
            while True:
                if every:
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    due = max(due + every, time.perf_counter())
                body = _events_body(rng, user_ids, events.ad_ids, surfaces, events.batch)
                start = time.perf_counter()
                try:
                    status, _ = await http.post("/v1/events", body)
                    kind = None if status == 200 else f"events {status}"
                except (HttpError, TimeoutError) as e:
                    kind = f"events {type(e).__name__}"
                if kind is None:
                    result.events += events.batch
                    result.event_latencies_ms.append(1000 * (time.perf_counter() - start))
                else:
                    result.errors[kind] = result.errors.get(kind, 0) + 1
                if clock.closed():
                    break
        finally:
            await http.close()

    await asyncio.gather(*(sender(i) for i in range(events.clients)))


def _events_body(
    rng: np.random.Generator,
    user_ids: np.ndarray,
    ad_ids: np.ndarray,
    surfaces: Sequence[str],
    n: int,
) -> bytes:
    """A POST /v1/events body of `n` events now, of random users and ads (and surfaces), written
    directly: the client's cost per call stays well below the server's."""
    now = int(time.time())
    users, ads = rng.choice(user_ids, n).tolist(), rng.choice(ad_ids, n).tolist()
    if surfaces:
        named = [json.dumps(surfaces[i]) for i in rng.integers(len(surfaces), size=n).tolist()]
        rows = (
            f'{{"user_id":{u},"ad_id":{a},"ts":{now},"surface":{s}}}'
            for u, a, s in zip(users, ads, named, strict=True)
        )
    else:
        rows = (
            f'{{"user_id":{u},"ad_id":{a},"ts":{now}}}' for u, a in zip(users, ads, strict=True)
        )
    return ('{"events":[' + ",".join(rows) + "]}").encode()


def _stream_process(url, events, user_ids, surfaces, duration, seed, conn) -> None:
    """The event senders in a process of their own (so that building their calls does not
    delay the retrieve clients' timing): (events, latencies, errors) back through `conn`."""
    result = LoadResult(0, duration)
    conn.send("ready")
    conn.recv()  # go
    asyncio.run(_stream(url, events, user_ids, surfaces, duration, seed, result))
    conn.send((result.events, result.event_latencies_ms, result.errors))


def inputs(folder: Path) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[str, ...]]]:
    """(user ids, ad ids, vocabularies) to draw requests and events from: of a dataset folder,
    or of the online features of a served index (`online/`)."""
    import json

    import pyarrow.parquet as pq

    from m31.data.dataset import vocabularies

    folder = Path(folder)
    online = folder / "online"
    if (online / "meta.json").is_file():
        meta = json.loads((online / "meta.json").read_text())
        vocab = {name: tuple(meta["vocab"][name]) for name in ("surface", "platform")}
        users, ads = online / "users.parquet", online / "ads.parquet"
    else:
        if not (folder / "meta.json").is_file():
            raise FileNotFoundError(f"--data: {folder} holds neither meta.json nor online/")
        vocab = vocabularies(json.loads((folder / "meta.json").read_text()))
        users, ads = folder / "users.parquet", folder / "ads.parquet"
    read = lambda f, c: pq.read_table(f, columns=[c]).column(0).to_numpy()  # noqa: E731
    return read(users, "user_id"), read(ads, "ad_id"), vocab


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
    events: EventLoad | None = None,
) -> LoadResult:
    """`surfaces` and `platforms`: the values requests draw from (the dataset's vocabularies;
    empty: requests name none)."""
    if concurrency < (0 if events is not None else 1) or duration <= 0 or k < 1:
        raise ValueError("concurrency must be >= 1 (>= 0 with events), k >= 1 and duration > 0")
    if not len(user_ids):
        raise ValueError("no user ids to send")
    if events is not None and (
        events.clients < 1 or events.batch < 1 or events.rate < 0 or not len(events.ad_ids)
    ):
        raise ValueError(
            "events: clients and batch must be >= 1 and rate >= 0, with ad ids to engage with"
        )
    user_ids = np.asarray(user_ids)
    if events is None:
        return asyncio.run(
            _run(url, user_ids, concurrency, duration, k, token, seed, surfaces, platforms)
        )
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    args = (url, events, user_ids, list(surfaces), duration, seed, child_conn)
    child = ctx.Process(target=_stream_process, args=args, daemon=True)
    child.start()
    try:
        if conn.recv() != "ready":
            raise RuntimeError("the event senders did not start")
        conn.send("go")
        if concurrency:
            result = asyncio.run(
                _run(url, user_ids, concurrency, duration, k, token, seed, surfaces, platforms)
            )
        else:
            result = LoadResult(0, duration)
        result.events, result.event_latencies_ms, errors = conn.recv()
        for kind, n in errors.items():
            result.errors[kind] = result.errors.get(kind, 0) + n
    finally:
        child.join(60)
    return result


def run_levels(
    url: str,
    data: Path,
    levels: Sequence[int],
    duration: float = 10.0,
    k: int = 100,
    token: str | None = None,
    *,
    event_clients: int = 0,
    event_batch: int = 100,
    event_rate: float = 0.0,
    admin_token: str | None = None,
    log=print,
) -> list[dict]:
    """`m31 loadtest`: the rows (`LoadResult.row`) of `run` at each concurrency of `levels`,
    with users and ads from `data` (`inputs`); with `event_clients`, each level runs twice,
    alone and beside that many clients streaming events (0 clients: the events alone). Names
    the command line's options in its messages; `log` tells each level as it starts."""
    if event_clients < 0 or event_batch < 1 or event_rate < 0:
        raise ValueError(
            "--event-clients and --event-rate must be at least 0, --event-batch at least 1"
        )
    if any(c < 0 for c in levels) or (0 in levels and not event_clients):
        raise ValueError(
            "--concurrency: client counts are at least 1 (0 only with --event-clients)"
        )
    if event_clients and not admin_token:
        raise ValueError("--event-clients: events need the admin token ($M31_ADMIN_TOKEN)")
    user_ids, ad_ids, vocab = inputs(data)
    events = [None]
    if event_clients:
        events.append(EventLoad(event_clients, event_batch, ad_ids, admin_token, event_rate))
    rows = []
    for c in levels:
        for stream in events if c else events[1:]:  # 0 clients: the events alone
            with_events = f", {event_clients} event clients" if stream else ""
            log(f"concurrency {c}{with_events}: {duration:.0f} s …")
            result = run(
                url,
                user_ids,
                c,
                vocab["surface"],
                vocab["platform"],
                duration,
                k,
                token,
                events=stream,
            )
            streamed = (
                {"event_clients": stream.clients, "event_rate": stream.rate} if stream else {}
            )
            rows.append(result.row() | {"event_clients": 0, "event_rate": 0.0} | streamed)
    return rows


_UNITS = {
    "qps": "calls/s", "p50_ms": "ms", "p99_ms": "ms", "requests_per_device_call": "",
    "ads_scored_per_s": "ads/s", "errors": "calls", "events_per_s": "events/s",
    "event_p99_ms": "ms",
}  # fmt: skip
_RETRIEVES = {"qps", "p50_ms", "p99_ms", "requests_per_device_call", "ads_scored_per_s"}
_EVENTS = {"events_per_s", "event_p99_ms"}


def figures(rows: list[dict], variant: str, k: int, duration: float) -> list[Figure]:
    """`run_levels`' rows as results rows: the retrieves' figures where there were retrieves,
    the events' where events were streamed; `variant` names the server's set-up."""
    out = []
    for r in rows:
        case = f"concurrency={r['concurrency']} K={k} seconds={duration:g}"
        if r["event_clients"]:
            case += f" event_clients={r['event_clients']} event_rate={r['event_rate']:g}"
        for metric, unit in _UNITS.items():
            if (metric in _RETRIEVES and not r["calls"]) or (
                metric in _EVENTS and not r["event_clients"]
            ):
                continue  # no call of that kind: no latency to tell
            out.append(Figure("loadtest", case, variant, metric, r[metric], unit))
    return out


def format_rows(rows: list[dict]) -> str:
    head = (
        "| concurrency | events / s | calls | QPS | p50 ms | p99 ms | requests / device call "
        "| ads scored / s | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {r['concurrency']} | {r['events_per_s']:,.0f} | {r['calls']} | {r['qps']:.1f} | "
        f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['requests_per_device_call']:.1f} | "
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
