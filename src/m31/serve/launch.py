"""Starting a server (`m31 serve`): the serving folder made once from a snapshot, then the app
over a `LocalBackend` on uvicorn. `check` and `start_logging` are the steps every server takes
first, a sharded one on Ray too (`m31.cluster.serve`, which the command line picks)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

from m31.serve.config import ServeConfig


def check(config: ServeConfig) -> None:
    """The config's limits, and its model there, before any folder is made."""
    config.check()
    if not Path(config.model).is_file():
        raise FileNotFoundError(f"--model: {config.model}: no such checkpoint")


def start_logging(config: ServeConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if config.admin_token is None:
        print("no admin token: ad management endpoints answer 403", file=sys.stderr)


def serve(
    config: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8031,
    *,
    state: Path | None = None,
    access_log: bool = False,
    log=print,
) -> None:
    """Serve until stopped. `config.index`: an index snapshot, or the serving folder made from
    one; a snapshot's is made once at `state` (default INDEX.serving) and served from then on."""
    check(config)
    import uvicorn

    from m31.engine.load import serving_folder
    from m31.serve.app import create_app
    from m31.serve.local import LocalBackend

    served = serving_folder(config.index, state, config.device, echo=log)
    config = dataclasses.replace(config, index=served)
    start_logging(config)
    app = create_app(config, LocalBackend.load)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=access_log)
