"""Online: `m31 demo`, `m31 index build`, `m31 cluster init|reshard`, `m31 serve` (one process,
`m31.serve.launch`, or a sharded index on Ray, `m31.cluster.serve`), and the clients of a
running server, `m31 query` and `m31 loadtest`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from m31.bench.cli import ResultsOption
from m31.cli.common import DeviceOption, OverwriteOption, cli_errors, write_json
from m31.serve.config import (
    BODY_TIMEOUT_S,
    MAX_BATCH_SIZE,
    MAX_QUEUE,
    MAX_QUEUE_DELAY_MS,
    MAX_SLICE_MS,
    TIMEOUT_MS,
)

UrlOption = Annotated[str, typer.Option()]
URL = "http://127.0.0.1:8031"


@cli_errors
def demo_cmd(
    out: Annotated[Path, typer.Option(help="Folder for the world, models and index.")] = Path(
        "data/demo"
    ),
) -> None:
    """The whole system on the default marketplace: data, models, index, requests, figures."""
    from m31.demo import run

    run(out, log=typer.echo)


DtypeOption = Annotated[
    str,
    typer.Option(
        help="Ad table precision: bfloat16, float32, or int8 (8-bit codes with per-ad scales, "
        "what the CPU kernel reads fastest)."
    ),
]


@cli_errors
def index_build(
    data: Annotated[Path, typer.Option(help="Dataset folder the model was trained on.")],
    model: Annotated[Path, typer.Option(help="Checkpoint of a retrieval model (moe, two-tower).")],
    out: Annotated[Path, typer.Option(help="Snapshot folder to create.")],
    dtype: DtypeOption = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu or cuda: where the ad tower runs.")] = "cpu",
    overwrite: OverwriteOption = False,
    clusters: Annotated[
        int,
        typer.Option(help="k-means clusters of a hierarchical index (m31 serve --probe); 0: none."),
    ] = 0,
) -> None:
    """Run the model's ad tower over the dataset's catalogue and snapshot the ad index."""

    from m31.engine.build import build_snapshot
    from m31.index.ad_table import TABLE_DTYPES

    if dtype not in TABLE_DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(TABLE_DTYPES)}")
    start = time.perf_counter()
    index = build_snapshot(data, model, out, device, TABLE_DTYPES[dtype], overwrite, clusters)
    typer.echo(
        f"wrote {out} in {time.perf_counter() - start:.1f} s: {len(index):,} ads, {dtype}, "
        f"G = {index.dim_g}, D = {index.dim_x}, model {index.model_hash}"
    )


@cli_errors
def cluster_init(
    index: Annotated[Path, typer.Option(help="Index snapshot (m31 index build writes one).")],
    shards: Annotated[int, typer.Option(help="Shards.")],
    out: Annotated[Path, typer.Option(help="Cluster state folder to create.")],
    device: Annotated[str, typer.Option(help="cpu or cuda: where the shards are built.")] = "cpu",
) -> None:
    """Partition a snapshot over S shards: a cluster state folder for `m31 serve --ray`."""
    from m31.cluster.layout import init_cluster
    from m31.engine.load import copy_online, has_online

    init_cluster(index, out, shards, device, log=typer.echo)
    if has_online(index):  # what the ingress of `m31 serve --ray` reads
        copy_online(index, out)
    typer.echo(f"wrote {out}: {shards} shards")


@cli_errors
def cluster_reshard(
    from_: Annotated[Path, typer.Option("--from", help="Cluster state folder (not served).")],
    shards: Annotated[int, typer.Option(help="Shards of the new state.")],
    out: Annotated[Path, typer.Option(help="Cluster state folder to create.")],
    device: DeviceOption = "cpu",
) -> None:
    """Re-partition a cluster state over a new number of shards, offline, from its shards'
    snapshots and logs; the global version carries over."""
    from m31.cluster.layout import reshard
    from m31.engine.load import copy_online, has_online

    reshard(from_, shards, out, device, log=typer.echo)
    if has_online(from_):
        copy_online(from_, out)
    typer.echo(f"wrote {out}: {shards} shards")


# `m31 serve`: the folders, the batcher's limits, the tokens, then Ray.
IndexOption = Annotated[
    Path,
    typer.Option(
        help="Index snapshot (m31 demo writes DIR/index) or a serving folder made from one."
    ),
]
StateOption = Annotated[
    Path | None,
    typer.Option(
        help="Serving folder (snapshot + write-ahead log) for a snapshot --index "
        "(default: INDEX.serving)."
    ),
]
MaxBatchSizeOption = Annotated[int, typer.Option(help="Requests per device call (1: no batching).")]
MaxQueueDelayOption = Annotated[
    float, typer.Option(help="How long the first request of a batch waits for others.")
]
MaxQueueOption = Annotated[int, typer.Option(help="Requests waiting before calls get 429.")]
MaxSliceOption = Annotated[
    float,
    typer.Option(
        help="Device time a large call may take per batch, so that small calls that come "
        "meanwhile wait at most about two slices."
    ),
]
TimeoutOption = Annotated[int, typer.Option(help="Default deadline of a retrieve call.")]
BodyTimeoutOption = Annotated[
    float, typer.Option(help="Seconds a request body may take to arrive (else 408).")
]
AdminTokenFileOption = Annotated[
    Path | None,
    typer.Option(
        help="Bearer token of the write endpoints (else $M31_ADMIN_TOKEN; "
        "without one, ad management is off)."
    ),
]
ReadTokenFileOption = Annotated[
    Path | None,
    typer.Option(
        help="Bearer token of the read endpoints (else $M31_READ_TOKEN; "
        "without one, reads are open)."
    ),
]
AccessLogOption = Annotated[
    bool, typer.Option(help="Log every HTTP call (off: /metrics counts them).")
]
RayOption = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="Serve a sharded index on Ray: shard actors, the same API through Ray Serve "
        "(needs the ray extra; docs/SCALING.md).",
    ),
]
ShardsOption = Annotated[
    int | None,
    typer.Option(
        help="With --ray: shards of a new cluster state (default 2); an existing one must "
        "match (else `m31 cluster reshard`)."
    ),
]
AddressOption = Annotated[
    str | None,
    typer.Option(help="With --ray: the Ray cluster to join (e.g. auto); default: a local one."),
]
MaxReplicasOption = Annotated[
    int | None,
    typer.Option(help="With --ray: autoscale ingress replicas up to this many."),
]


@cli_errors
def serve_cmd(
    index: IndexOption,
    model: Annotated[Path, typer.Option(help="Checkpoint whose ad tower made the index.")],
    state: StateOption = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8031,
    device: DeviceOption = "cpu",
    max_batch_size: MaxBatchSizeOption = MAX_BATCH_SIZE,
    max_queue_delay_ms: MaxQueueDelayOption = MAX_QUEUE_DELAY_MS,
    max_queue: MaxQueueOption = MAX_QUEUE,
    max_slice_ms: MaxSliceOption = MAX_SLICE_MS,
    timeout_ms: TimeoutOption = TIMEOUT_MS,
    body_timeout_s: BodyTimeoutOption = BODY_TIMEOUT_S,
    admin_token_file: AdminTokenFileOption = None,
    read_token_file: ReadTokenFileOption = None,
    access_log: AccessLogOption = False,
    ray: RayOption = False,
    shards: ShardsOption = None,
    address: AddressOption = None,
    replicas: Annotated[int, typer.Option(help="With --ray: ingress replicas.")] = 1,
    max_replicas: MaxReplicasOption = None,
    probe: Annotated[
        int | None,
        typer.Option(
            help="Clusters of the index's hierarchical index (m31 index build --clusters) "
            "each request scores exactly; default: every ad."
        ),
    ] = None,
) -> None:
    """Serve retrieval and ad management over HTTP (FastAPI on uvicorn, or Ray Serve)."""
    from m31.serve.config import ServeConfig, read_token

    if not ray and (shards is not None or address is not None or max_replicas is not None):
        raise ValueError("--shards, --address and --max-replicas go with --ray")
    if ray and probe is not None:
        raise ValueError("--probe: the hierarchical index is served by m31 serve, not yet --ray")
    config = ServeConfig(
        index=index,
        model=model,
        device=device,
        max_batch_size=max_batch_size,
        max_queue_delay_ms=max_queue_delay_ms,
        max_queue=max_queue,
        max_slice_ms=max_slice_ms,
        timeout_ms=timeout_ms,
        body_timeout_s=body_timeout_s,
        admin_token=read_token("M31_ADMIN_TOKEN", admin_token_file, "--admin-token-file"),
        read_token=read_token("M31_READ_TOKEN", read_token_file, "--read-token-file"),
        probe=probe,
    )
    if ray:  # the one place that picks the backend: m31.serve never imports the cluster
        from m31.cluster import serve as sharded

        options = sharded.RayOptions(shards, address, replicas, max_replicas)
        sharded.serve(config, host, port, options, state=state, log=typer.echo)
    else:
        from m31.serve import launch

        launch.serve(config, host, port, state=state, access_log=access_log, log=typer.echo)


FilterOption = Annotated[
    str | None, typer.Option(help='Filter tree as JSON, e.g. \'{"eq": ["format", "video"]}\'.')
]


@cli_errors
def query_cmd(
    user_id: Annotated[int, typer.Option(help="A stored user's id.")],
    surface: Annotated[str | None, typer.Option(help="Default: none (unknown).")] = None,
    platform: Annotated[str | None, typer.Option(help="Default: none (unknown).")] = None,
    k: Annotated[int, typer.Option(help="Results.")] = 10,
    ts: Annotated[int | None, typer.Option(help="Unix seconds (default: now).")] = None,
    filter: FilterOption = None,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Also print the ads left after each eligibility stage and each result's "
            "score split over the model's experts.",
        ),
    ] = False,
    why_not: Annotated[
        str | None,
        typer.Option(help="Comma-separated ad ids: say why each is not in the answer."),
    ] = None,
    url: UrlOption = URL,
    token: Annotated[str | None, typer.Option(envvar="M31_READ_TOKEN")] = None,
) -> None:
    """Ask a running server for one user's top ads and print them (and why, with --explain
    or --why-not)."""
    from rich.console import Console
    from rich.table import Table

    from m31.client import Client, ServiceError

    request = {"user_id": user_id, "k": k}
    request |= {name: v for name, v in (("surface", surface), ("platform", platform)) if v}
    if ts is not None:
        request["ts"] = ts
    if filter is not None:
        try:
            request["filter"] = json.loads(filter)
        except json.JSONDecodeError as e:
            raise ValueError(f"--filter: not valid JSON ({e})") from e
    if explain:
        request["explain"] = True
    if why_not is not None:
        request["why_not"] = _ad_ids("--why-not", why_not)
    with Client(url, token=token) as client:
        try:
            out = client.retrieve([request])
        except ServiceError as e:
            raise ValueError(str(e)) from e
    res = out["results"][0]
    typer.echo(
        f"user {user_id}, {surface or 'any surface'} on {platform or 'any platform'}: "
        f"index version {out['index_version']}, {out['timings_ms']['total']:.1f} ms"
    )
    table = Table()
    for col in ("#", "ad", "score"):
        table.add_column(col, justify="right")
    for rank, (ad, s) in enumerate(zip(res["ad_ids"], res["scores"], strict=True), 1):
        table.add_row(str(rank), str(ad), f"{s:.3f}")
    Console().print(table)
    if res.get("explanation") is not None:
        _print_explanation(res["explanation"])


def _ad_ids(option: str, text: str) -> list[int]:
    """Comma-separated ad ids, each an integer (a ValueError naming `option` otherwise)."""
    ids = []
    for part in text.split(","):
        try:
            ids.append(int(part.strip()))
        except ValueError:
            raise ValueError(f"{option}: {part.strip()!r} is not an ad id") from None
    return ids


def _print_explanation(e: dict) -> None:
    """An answer's explanation as `m31 query` prints it: the stages; each result's score as its
    experts' parts, largest first, each with the gate's weight in brackets, then the bias (and
    the value term); the why-nots."""
    stages = " → ".join(f"{stage} {n:,}" for stage, n in e["eligible"].items())
    kth = "none" if e["kth_score"] is None else f"{e['kth_score']:.4f}"
    typer.echo(f"eligible after each stage: {stages}; K-th score {kth}")
    for ad in e["ads"]:
        parts = sorted(
            zip(ad["contributions"], e["experts"], ad["gate"], strict=True),
            key=lambda part: -abs(part[0]),
        )
        terms = " ".join(f"{c:+.3f} {name}[{w:.2f}]" for c, name, w in parts)
        value = "" if ad["value"] is None else f" {ad['value']:+.3f} value"
        typer.echo(f"ad {ad['ad_id']}: {ad['score']:.3f} = {terms} {ad['bias']:+.3f} bias{value}")
    for w in e["why_not"]:
        typer.echo(f"ad {w['ad_id']}: {w['stage']}: {w['reason']}")


UsersFromOption = Annotated[
    Path,
    typer.Option(
        help="Where the requests' users come from: the dataset folder, or the served index "
        "(its online/ folder)."
    ),
]
ConcurrencyOption = Annotated[
    str, typer.Option(help="Comma-separated client counts (0: events alone).")
]
EventClientsOption = Annotated[
    int,
    typer.Option(
        help="0: retrieves only; N: each level runs twice, alone and beside N clients "
        "streaming events (POST /v1/events, with the admin token)."
    ),
]
EventRateOption = Annotated[
    float, typer.Option(help="Events per second in all (0: as fast as acknowledged).")
]


@cli_errors
def loadtest_cmd(
    data: UsersFromOption,
    url: UrlOption = URL,
    concurrency: ConcurrencyOption = "1,8,64",
    duration: Annotated[float, typer.Option(help="Seconds per concurrency level.")] = 10.0,
    k: Annotated[int, typer.Option()] = 100,
    token: Annotated[str | None, typer.Option(envvar="M31_READ_TOKEN")] = None,
    event_clients: EventClientsOption = 0,
    event_batch: Annotated[int, typer.Option(help="Events per event call.")] = 100,
    event_rate: EventRateOption = 0.0,
    admin_token: Annotated[str | None, typer.Option(envvar="M31_ADMIN_TOKEN")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the rows as JSON here.")] = None,
    variant: Annotated[
        str, typer.Option(help="The server's set-up, as the results rows name it.")
    ] = "",
    results: ResultsOption = None,
) -> None:
    """Closed-loop load on a running server: QPS, p50/p99 latency, ads scored per second, and
    events acknowledged per second beside them; appended to the results table as rows."""
    from m31.bench import loadtest
    from m31.bench.results import record

    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError as e:
        raise ValueError(f"--concurrency: {concurrency!r} is not a list of integers") from e
    rows = loadtest.run_levels(
        url,
        data,
        levels,
        duration,
        k,
        token,
        event_clients=event_clients,
        event_batch=event_batch,
        event_rate=event_rate,
        admin_token=admin_token,
        log=lambda line: typer.echo(line, err=True),
    )
    typer.echo(loadtest.format_rows(rows))
    if out is not None:
        write_json(out, rows)
    record(loadtest.figures(rows, variant, k, duration), results)
