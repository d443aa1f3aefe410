"""How a server runs: `ServeConfig`, the one place its defaults live (the command line reads
them from here). Importing it loads neither FastAPI nor the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from m31.serve.batcher import MAX_BATCH_SIZE, MAX_QUEUE, MAX_QUEUE_DELAY_MS, MAX_SLICE_MS

__all__ = [
    "BODY_TIMEOUT_S",
    "MAX_BATCH_SIZE",
    "MAX_BODY_BYTES",
    "MAX_QUEUE",
    "MAX_QUEUE_DELAY_MS",
    "MAX_SLICE_MS",
    "TIMEOUT_MS",
    "ServeConfig",
    "read_token",
]

TIMEOUT_MS = 1000  # default deadline of a retrieve call
BODY_TIMEOUT_S = 10.0  # a body not in by then is a 408 (slow or stalled senders)
MAX_BODY_BYTES = 16 << 20


@dataclass
class ServeConfig:
    # durable serving state (snapshot + write-ahead log) or cluster state, with the online
    # features the model reads (`m31.engine.load`)
    index: Path
    model: Path  # checkpoint of the retrieval model whose ad tower made the index
    device: str = "cpu"
    max_batch_size: int = MAX_BATCH_SIZE  # requests per device call; 1 turns batching off
    max_queue_delay_ms: float = MAX_QUEUE_DELAY_MS
    max_queue: int = MAX_QUEUE  # requests waiting, beyond which calls get 429
    max_slice_ms: float = MAX_SLICE_MS  # device time per batch of a large call (`batcher`)
    timeout_ms: int = TIMEOUT_MS
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    admin_token: str | None = None  # bearer token of the write endpoints; None = disabled
    read_token: str | None = None  # bearer token of the read endpoints; None = open
    probe: int | None = None  # clusters of the hierarchical index each request scores; None: all

    def check(self) -> None:
        """Raise on limits no server runs with; named as `m31 serve`'s options."""
        for name, value in (
            ("--max-batch-size", self.max_batch_size),
            ("--max-queue", self.max_queue),
            ("--timeout-ms", self.timeout_ms),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"--body-timeout-s must be positive, got {self.body_timeout_s}")
        if not self.max_slice_ms > 0 or not self.max_queue_delay_ms >= 0:
            raise ValueError(
                "--max-slice-ms must be positive and --max-queue-delay-ms at least 0, got "
                f"{self.max_slice_ms} and {self.max_queue_delay_ms}"
            )


def read_token(env: str, file: Path | None, option: str) -> str | None:
    """A bearer token: the text of `file` (stripped; `option` names it in errors), or else the
    environment variable `env`; None where neither gives one."""
    if file is not None:
        try:
            token = Path(file).read_text().strip()
        except OSError as e:
            raise ValueError(f"{option}: cannot read {file} ({e.strerror})") from e
        if not token:
            raise ValueError(f"{option}: {file} is empty")
        return token
    return os.environ.get(env) or None
