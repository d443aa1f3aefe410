"""How a server runs: `ServeConfig`, the one place its defaults live (the command line reads
them from here). Importing it loads neither FastAPI nor the engine."""

from __future__ import annotations

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
