"""Starting a server (`m31 serve`): the serving folder made once from a snapshot (or the cluster
state, sharded on Ray), then the app on uvicorn, or on Ray Serve (`m31.cluster.serve`)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from m31.serve.config import ServeConfig


@dataclass(frozen=True)
class RayOptions:
    """A sharded index on Ray (the ray extra; docs/SCALING.md)."""

    shards: int | None = None  # of a new cluster state (default 2); an existing one must match
    address: str | None = None  # the Ray cluster to join (e.g. auto); None: a local one
    replicas: int = 1  # ingress replicas
    max_replicas: int | None = None  # autoscale ingress replicas up to this many


def serve(
    config: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8031,
    *,
    state: Path | None = None,
    access_log: bool = False,
    ray: RayOptions | None = None,
    log=print,
) -> None:
    """Serve until stopped. `config.index`: an index snapshot, or the serving folder (with `ray`,
    the cluster state) made from one; a snapshot's is made once at `state` (default
    INDEX.serving, or INDEX.cluster with `ray`) and served from then on."""
    config.check()
    if not Path(config.model).is_file():
        raise FileNotFoundError(f"--model: {config.model}: no such checkpoint")
    from m31.engine.load import copy_online, serving_folder

    if ray is not None:
        from m31.cluster.layout import serving_cluster

        served = serving_cluster(config.index, state, ray.shards, config.device, log=log)
        copy_online(config.index, served)
    else:
        served = serving_folder(config.index, state, config.device, echo=log)
    config = dataclasses.replace(config, index=served)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if config.admin_token is None:
        print("no admin token: ad management endpoints answer 403", file=sys.stderr)
    if ray is not None:
        from m31.cluster.serve import IngressOptions, run

        options = IngressOptions(ray.replicas, ray.max_replicas)
        run(config, ray.address, host, port, options, log=log)
        return
    import uvicorn

    from m31.serve.app import create_app

    uvicorn.run(create_app(config), host=host, port=port, log_level="info", access_log=access_log)
