"""The HTTP API on Ray (`m31 serve --ray`): the routes of `m31.serve` over a `ClusterBackend`,
served by this process (one ingress, the default) or by ingress replicas that Ray Serve
starts, balances and autoscales (`--replicas N`, `--max-replicas`). `serve` is what the command
line calls: the cluster state made once from a snapshot, then `run`.

One ingress is uvicorn in the server's own process, as `m31 serve` runs it: Ray Serve's proxy
would add a hop (HTTP to the proxy, an actor call to the replica, the body and the answer
streamed between them) that costs more than the scatter-gather itself (docs/SCALING.md).

On Ray Serve, each replica builds the same FastAPI app (`m31.serve.app.create_app`) at its
start (`__serve_build_asgi_app__`, so nothing unpicklable travels: metrics registries,
locks), and runs its lifespan as uvicorn would: the model loads in a thread while
/health/live answers, then the dynamic batcher runs inside the replica. So batching,
admission (429/503/504), body limits and the Prometheus metrics are per replica, as they are
per process in `m31 serve`. Ray Serve is told to pass every request on
(`max_ongoing_requests`), so admission is the batcher's, not the proxy's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from m31.cluster.cluster import Cluster
from m31.serve import launch
from m31.serve.config import ServeConfig

# Requests a replica takes at once: enough that the batcher, not Ray Serve's proxy, decides
# what is admitted (its queue holds MAX_QUEUE requests; a call may hold many).
MAX_ONGOING = 4096


@dataclass(frozen=True)
class RayOptions:
    """A sharded index on Ray (the ray extra; docs/SCALING.md)."""

    shards: int | None = None  # of a new cluster state (default 2); an existing one must match
    address: str | None = None  # the Ray cluster to join (e.g. auto); None: a local one
    replicas: int = 1  # ingress replicas
    max_replicas: int | None = None  # autoscale ingress replicas up to this many


@dataclass
class IngressOptions:
    replicas: int = 1  # ingress replicas at the start (the minimum when autoscaling)
    max_replicas: int | None = None  # > replicas: autoscale between them
    target_ongoing_requests: float = 64.0  # per replica, what autoscaling aims at
    cpus: float = 1.0  # per replica
    gpus: float = 0.0  # per replica (the query encoder)


class Ingress:
    """One ingress replica: the app over the cluster's actors."""

    def __init__(self, config: ServeConfig, cluster: Cluster) -> None:
        self.config, self.cluster = config, cluster

    def __serve_build_asgi_app__(self):
        from m31.cluster.backend import ClusterBackend
        from m31.serve.app import create_app

        return create_app(self.config, lambda cfg: ClusterBackend.load(cfg, self.cluster))


def deploy(
    config: ServeConfig,
    cluster: Cluster,
    options: IngressOptions | None = None,
    name: str = "m31",
    route_prefix: str = "/",
):
    """Deploy the API as the Serve application `name` at `route_prefix` (Serve must be
    started: `serve.start(http_options=...)`); returns once it is deployed (the replicas
    then load the model: /health/ready says when)."""
    from ray import serve

    options = options or IngressOptions()
    scaling: dict = {"num_replicas": options.replicas}
    if options.max_replicas is not None and options.max_replicas > options.replicas:
        scaling = {
            "autoscaling_config": {
                "min_replicas": options.replicas,
                "max_replicas": options.max_replicas,
                "target_ongoing_requests": options.target_ongoing_requests,
            }
        }
    deployment = serve.deployment(
        name=f"{name}-ingress",
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": options.cpus, "num_gpus": options.gpus},
        **scaling,
    )(serve.ingress()(Ingress))
    serve.run(
        deployment.bind(config, cluster), name=name, route_prefix=route_prefix, blocking=False
    )


def serve(
    config: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8031,
    options: RayOptions | None = None,
    *,
    state: Path | None = None,
    log=print,
) -> None:
    """Serve until stopped. `config.index`: an index snapshot, or the cluster state made from
    one; a snapshot's is made once at `state` (default INDEX.cluster) and served from then on."""
    from m31.cluster.layout import serving_cluster
    from m31.engine.load import copy_online

    launch.check(config)
    options = options or RayOptions()
    served = serving_cluster(config.index, state, options.shards, config.device, log=log)
    copy_online(config.index, served)
    config = dataclasses.replace(config, index=served)
    launch.start_logging(config)
    ingress = IngressOptions(options.replicas, options.max_replicas)
    run(config, options.address, host, port, ingress, log=log)


def run(
    config: ServeConfig,
    address: str | None,
    host: str,
    port: int,
    options: IngressOptions | None = None,
    log=print,
) -> None:
    """`m31 serve --ray`: join the Ray cluster at `address` (None: start a local one), start
    the shards and the coordinator of the cluster state `config.index`, deploy the API on
    Ray Serve at http://host:port, and serve until SIGTERM or SIGINT (Ctrl-C). Either signal,
    start-up included, stops it cleanly (exit status 0): Serve and Ray are shut down, and a
    local cluster's processes with them — even after a SIGKILL of this process (the reaper)."""
    import signal
    import threading

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    import ray
    from ray import serve

    from m31.cluster.actors import Cancelled

    reaper = _start_reaper() if address is None else None
    served = False
    try:
        try:
            # A local cluster's workers (the shards, the coordinator) run at the server's
            # priority: Ray's default, nice 15, let the ingress and any other job starve them.
            system = {"worker_niceness": 0} if address is None else None
            ray.init(address=address, include_dashboard=False, _system_config=system)
        except SystemExit:
            return  # SIGTERM, as ray.init's own handler (first thing it installs) answers it
        # That handler exits from inside whatever call runs (a start-up then aborted with a
        # stack dump); this one only asks to stop.
        signal.signal(signal.SIGTERM, on_signal)
        _watch(reaper)
        if stop.is_set():
            return
        options = options or IngressOptions()
        here = options.replicas == 1 and (options.max_replicas or 1) <= 1
        try:
            cluster = _start_cluster(config, options, here, stop)
        except Cancelled:
            return
        if stop.is_set():
            return
        if here:
            _serve_here(config, cluster, host, port, stop, reaper, log)
            return
        serve.start(http_options={"host": host, "port": port})
        served = True
        deploy(config, cluster, options)
        _watch(reaper)
        if stop.is_set():
            return
        log(f"serving {len(cluster.shards)} shards on Ray at http://{host}:{port} (Ctrl-C stops)")
        stop.wait()
    finally:
        if served:
            serve.shutdown()
        ray.shutdown()
        if reaper is not None:
            _watch(reaper)  # what shut down slowly, or not at all
            reaper.stdin.close()
            reaper.wait()


def _start_cluster(config: ServeConfig, options: IngressOptions, here: bool, stop) -> Cluster:
    """The actors of the cluster state `config.index`, placed beside the ingress replicas of
    `options` (none but this process if `here`; their CPUs set to what is left)."""
    import ray

    from m31.cluster.actors import ClusterOptions
    from m31.cluster.layout import read_layout

    # Every actor must be placeable at once: the shards and the most ingress replicas share the
    # cluster's CPUs (a laptop's few cores included), at most one each. A shard's kernel runs
    # one thread per CPU it has (Ray sets OMP_NUM_THREADS): more leave the ingress no core on
    # one machine (measured at S = 1 on 2 cores: B = 1 calls slower).
    replicas = 0 if here else max(options.replicas, options.max_replicas or 0)
    actors = read_layout(config.index) + replicas
    cpus = min(1.0, ray.cluster_resources().get("CPU", 1.0) / actors)
    options.cpus = min(options.cpus, cpus)
    gpus = 1.0 if config.device.startswith("cuda") else 0.0
    placement = ClusterOptions(device=config.device, shard_cpus=cpus, shard_gpus=gpus)
    return Cluster.start(config.index, placement, stop=stop)


def _serve_here(config: ServeConfig, cluster: Cluster, host, port, stop, reaper, log) -> None:
    """One ingress: the API served by this process (uvicorn in a thread, as `m31 serve` serves
    it) over the cluster's actors, until `stop`. Ray Serve's proxy would add a hop (HTTP to the
    proxy, an actor call to the replica, the body and answer streamed between them) that costs
    more than the whole scatter-gather on a few cores (docs/SCALING.md)."""
    import threading

    import uvicorn

    from m31.cluster.backend import ClusterBackend
    from m31.serve.app import create_app

    app = create_app(config, lambda cfg: ClusterBackend.load(cfg, cluster))
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="m31-http", daemon=True)
    thread.start()
    _watch(reaper)
    log(f"serving {len(cluster.shards)} shards on Ray at http://{host}:{port} (Ctrl-C stops)")
    try:
        while not stop.wait(0.5):
            if not thread.is_alive():
                raise RuntimeError(f"the HTTP server on {host}:{port} stopped (see above)")
    finally:
        server.should_exit = True
        thread.join(120)


def _start_reaper():
    """`m31.cluster.reaper` in its own session (a terminal's Ctrl-C does not reach it), or
    None where there is no /proc."""
    import subprocess
    import sys

    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "m31.cluster.reaper"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )


def _watch(reaper) -> None:
    """Tell the reaper every process below this one (Ray's, once it started them)."""
    import os

    from m31.cluster.reaper import descendants

    if reaper is None:
        return
    try:
        for pid, started in descendants(os.getpid()):
            if pid != reaper.pid:
                reaper.stdin.write(f"{pid} {started}\n")
        reaper.stdin.flush()
    except (BrokenPipeError, ValueError):
        pass  # the reaper is gone: nothing to tell
