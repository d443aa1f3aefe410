"""The HTTP API through Ray Serve over a 3-shard cluster (`m31 serve --ray`): the API tests of
the single-process server (tests/test_serve.py), run unchanged against it, plus the partial
answers of a sharded server."""

from __future__ import annotations

import itertools
import os
import signal
from dataclasses import replace

import httpx
import pytest

ray = pytest.importorskip("ray")

import test_serve  # noqa: E402
from ray import serve  # noqa: E402
from serve_helpers import free_socket, wait_ready  # noqa: E402

from m31.cluster.cluster import Cluster, ClusterOptions  # noqa: E402
from m31.cluster.layout import init_cluster  # noqa: E402
from m31.cluster.serve import IngressOptions, deploy  # noqa: E402
from m31.engine.load import copy_online  # noqa: E402

SHARDS = 3
# The API tests of the single-process server and their fixtures, in test_serve's order (the
# first needs the shared server untouched); they run here with `launch` below.
for _name in (
    "world",
    "server",
    "test_results_equal_the_engine",
    "test_concurrent_requests_are_batched",
    "test_bad_input_is_4xx",
    "test_auth",
    "test_overload_and_deadlines",
    "test_ad_management_and_versions",
    "test_concurrent_updates_and_queries_stay_consistent",
):
    globals()[_name] = getattr(test_serve, _name)


@pytest.fixture(scope="module")
def ray_serve():
    """A local Ray cluster with Serve's HTTP proxy on a free loopback port."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


class RayServer:
    """A config's API as a Serve application over its own 3-shard cluster, made from the
    config's serving folder."""

    names = itertools.count()

    def __init__(self, base: str, cfg) -> None:
        self.cfg, self.name = cfg, f"app{next(self.names)}"
        self.url = f"{base}/{self.name}"

    def __enter__(self) -> RayServer:
        state = init_cluster(self.cfg.index / "snapshot", self.cfg.index.with_suffix(".cluster"),
                             SHARDS)  # fmt: skip
        copy_online(self.cfg.index, state)
        self.cluster = Cluster.start(state, ClusterOptions(shard_cpus=0))
        deploy(
            replace(self.cfg, index=state),
            self.cluster,
            IngressOptions(cpus=0),
            self.name,
            f"/{self.name}",
        )
        wait_ready(self.url)
        return self

    def __exit__(self, *exc) -> None:
        serve.delete(self.name)
        for actor in [*self.cluster.shards, self.cluster.coordinator]:
            ray.kill(actor, no_restart=True)


@pytest.fixture(scope="module")
def launch(ray_serve):
    return lambda cfg: RayServer(ray_serve, cfg)


def test_partial_answers_name_the_missing_shards(world, server):
    """A shard that stops answering: a call waits for it until its deadline and answers 503
    naming it, or, with allow_partial, 200 with partial: true and the shard listed."""
    users, _ = test_serve.users_and_time(world, 1)
    body = {"requests": [{"user_id": users[0], "surface": "feed", "platform": "ios", "k": 20}]}
    whole = httpx.post(f"{server.url}/v1/retrieve", json=body, timeout=60).json()
    assert whole["partial"] is False and whole["missing_shards"] == []
    pid = ray.get(server.cluster.shards[2].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        r = httpx.post(f"{server.url}/v1/retrieve", json={**body, "timeout_ms": 1500}, timeout=60)
        assert r.status_code == 503 and "shards [2]" in r.json()["detail"], r.text
        r = httpx.post(
            f"{server.url}/v1/retrieve",
            json={**body, "timeout_ms": 1500, "allow_partial": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["partial"] is True and got["missing_shards"] == [2]
        assert got["index_version"] == whole["index_version"]
    finally:
        os.kill(pid, signal.SIGKILL)  # Ray restarts it
    again = httpx.post(f"{server.url}/v1/retrieve", json={**body, "timeout_ms": 60_000},
                       timeout=120).json()  # fmt: skip
    assert again["partial"] is False
    assert again["results"][0]["ad_ids"] == whole["results"][0]["ad_ids"]
