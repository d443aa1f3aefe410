"""Thread counts for small CPU work.

PyTorch runs an op over an OpenMP team of `torch.get_num_threads()` threads. For small ops (a
request's encoding, bitmap arithmetic, the bookkeeping of the cpu kernel) the team's barriers
cost more than the work, and on a busy machine far more: a barrier waits for every member, and
a member another process holds the core from wakes a scheduler tick later. Measured on the
2-core development machine with two low-priority (nice 19) trainings running: the engine's
request encoding took 230 ms at B = 1 and 889 ms at B = 64 with 2 threads, 7.7 and 14.5 ms with
one; idle, 3.1 / 6.6 ms with 2 threads and 2.8 / 11.6 ms with one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def single_threaded(restore: int | None = None) -> Iterator[None]:
    """Run this thread's torch ops on one core, then restore `restore` threads (default: the
    count on entry). The OpenMP team size is per thread; MKL's part of the setting is
    process-wide, so other threads' MKL calls run on one core meanwhile."""
    restore = torch.get_num_threads() if restore is None else restore
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(restore)
