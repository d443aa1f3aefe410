"""Scatter-gather overhead: the single-process engine against S shards on Ray, same corpus,
same requests, one run (`m31 bench cluster`).

Shapes: N ads, B requests per batch, E experts, G gate-key dim, D value dim, K results.

Both sides get the same encoded queries (q [B, E, G], v [B, E, D], p [B, E]; encoding is the
same work on both, done once by the ingress) and the same requests (targeting and a filter
that keeps about half the ads), in turn, so that whatever else loads the machine weighs on
both. The single process builds the masks and runs `search` over the whole index; the cluster
sends the query to each shard (`Cluster.scatter`), each builds its masks and runs `search`
over its rows, and the ingress merges. Every cluster answer is checked against the single
process's (ids and order). The shards share this machine's cores as `m31 serve --ray` places
them (cores / S, at most one each; so at S = 4 on 2 cores the shards take turns), and the
ratio is the price of the split and of Ray's calls on one machine — on a cluster each shard
has its own device.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from m31.bench.results import Figure, short

# The workers (shards) at the driver's priority, as `m31 serve --ray` starts a local cluster.
NICE = {"_system_config": {"worker_niceness": 0}}


def corpus(n: int, dim: int, seed: int = 0):
    from m31.index import AdIndex

    rng = np.random.default_rng(seed)
    index = AdIndex(dim, dim, capacity=n, extra_fields={"format": "str"})  # bf16 table
    ids = rng.choice(10 * n, n, replace=False)
    attrs = [
        {"advertiser_id": int(a), "status": "active", "format": ["video", "image"][int(f)]}
        for a, f in zip(rng.integers(0, 1000, n), rng.integers(0, 2, n), strict=True)
    ]
    index.upsert(
        ids,
        rng.normal(size=(n, dim)).astype(np.float32),
        rng.normal(size=(n, dim)).astype(np.float32) / dim**0.5,
        rng.normal(size=n).astype(np.float32),
        attrs,
    )
    return index


def queries(b: int, experts: int, dim: int, seed: int):
    from m31.engine import AdRequest

    rng = np.random.default_rng(seed)
    query = (
        rng.normal(size=(b, experts, dim)).astype(np.float32),  # [B, E, G]
        rng.normal(size=(b, experts, dim)).astype(np.float32),  # [B, E, D]
        rng.normal(size=(b, experts)).astype(np.float32),  # [B, E]
    )
    requests = [
        (AdRequest(None, 0, "feed", "ios", filter={"eq": ["format", "video"]}), {})
        for _ in range(b)
    ]
    return query, requests


def single(index, query, requests, ks):
    from m31.engine import eligible_masks, request_context, search
    from m31.index import compile_filter

    view = index.frozen_view()
    ctx = [(request_context(r, w), compile_filter(r.filter, index.schema)) for r, w in requests]
    return search(tuple(torch.tensor(t) for t in query), view, eligible_masks(view, ctx), ks)


def timed(fns, repeat: int) -> list[tuple[float, object]]:
    """(median ms, last answer) of each of `fns`, run in turn `repeat` times after a warm-up
    (a shard's first frozen view, caches): whatever else loads the machine weighs on each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    outs: list[object] = [None] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            outs[i] = fn()
            times[i].append(1000 * (time.perf_counter() - t))
    return [(statistics.median(t), out) for t, out in zip(times, outs, strict=True)]


def run(
    n: int,
    batches: Sequence[int],
    k: int,
    shard_counts: Sequence[int],
    experts: int,
    dim: int,
    repeat: int,
    cpus: int,
    out: Path | None,
) -> list[Figure]:
    """`m31 bench cluster`: the table (printed, and written to `out`) and its figures; exits with
    a message if a cluster answer differs from the single process's. Ray is imported here, when
    it runs."""
    import ray

    from m31.cluster.actors import ClusterOptions
    from m31.cluster.cluster import Cluster
    from m31.cluster.layout import init_cluster

    index = corpus(n, dim)
    work = Path(tempfile.mkdtemp(prefix="m31-cluster-bench-"))
    rows = []
    try:
        snapshot = index.save(work / "snapshot")
        own = not ray.is_initialized()  # a Ray this process started already is used as it is
        if own:
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, **NICE)
        for s in shard_counts:
            state = init_cluster(snapshot, work / f"state-{s}", s)
            # As `m31 serve --ray` places them: at most one core each, one kernel thread.
            shard_cpus = min(1.0, cpus / s)
            cluster = Cluster.start(state, ClusterOptions(shard_cpus=shard_cpus))
            for b in batches:
                query, requests = queries(b, experts, dim, seed=b)

                def alone(query=query, requests=requests, b=b):
                    return single(index, query, requests, [k] * b)

                def scatter(query=query, requests=requests, b=b, cluster=cluster):
                    return cluster.search(query, requests, [k] * b, time.monotonic() + 600).results

                (ms_single, want), (ms, got) = timed([alone, scatter], repeat)
                exact = all(
                    g.ad_ids.tolist() == w.ad_ids.tolist() for g, w in zip(got, want, strict=True)
                )
                rows.append((b, s, ms_single, ms, exact))
            for actor in [*cluster.shards, cluster.coordinator]:
                ray.kill(actor, no_restart=True)
        if own:
            ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"N = {n:,} ads (bf16), E = {experts}, G = D = {dim}, K = {k}, "
        f"half the ads eligible, {cpus} cores; median of {repeat} batches",
        "",
        "| B | shards | single process ms | cluster ms | ratio | same ids and order |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for b, s, ms_single, ms, exact in rows:
        lines.append(
            f"| {b} | {s} | {ms_single:.1f} | {ms:.1f} | {ms / ms_single:.2f}× | "
            f"{'yes' if exact else 'NO'} |"
        )
    table = "\n".join(lines)
    print(table)
    if out is not None:
        out.write_text(table + "\n")
    if not all(r[4] for r in rows):
        raise SystemExit("cluster answers differ from the single process")
    figures = []
    for b, s, ms_single, ms, _ in rows:
        case = f"N={short(n)} B={b} K={k} E={experts} G={dim} D={dim} shards={s} cpus={cpus}"
        figures += [
            Figure("cluster", case, "single process", "median_ms", ms_single, "ms"),
            Figure("cluster", case, "ray", "median_ms", ms, "ms"),
            Figure("cluster", case, "ray vs single process", "ratio", ms / ms_single, "x"),
        ]
    return figures
