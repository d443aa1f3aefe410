"""How the cpu kernel splits its work: the table into spans of ads (`block_spans`), taken in turn
by worker threads that each run torch on one core (`spans_in_threads`)."""

from __future__ import annotations

import math
import queue
import threading

import torch

from m31.ops.threads import single_threaded


def block_spans(n_ads: int, block: int) -> list[tuple[int, int]]:
    """Ad ranges [lo, hi) to scan: blocks of `block` ads after a warm-up of shorter ones.

    τ starts at -inf, so every eligible pair of the first blocks goes through the gate step; the
    warm-up (block/16, /16, /8, /8, /4, /4, /2, /2, each worker taking the next) raises τ on
    fewer pairs. At B = 1, N = 1 M this cuts the pairs gated by 30%.
    """
    sizes = [block >> shift for shift in (4, 4, 3, 3, 2, 2, 1, 1) if block >> shift >= 64]
    spans, lo = [], 0
    for size in [*sizes, *[block] * math.ceil(n_ads / block)]:
        if lo >= n_ads:
            break
        spans.append((lo, min(lo + size, n_ads)))
        lo += size
    return spans


def in_threads(n_threads: int, work) -> None:
    """work(i) in threads i < n_threads (the caller's is 0), each running torch on one core.
    Products and most other ops release the GIL, and so do the compiled helpers; many small
    OpenMP regions instead stall on a busy machine, each waiting for its slowest thread. The
    first error is re-raised here."""
    caller_threads = torch.get_num_threads()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with single_threaded(caller_threads):
                work(i)
        except BaseException as err:  # re-raised in the caller below
            errors.append(err)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(1, n_threads)]
    for t in pool:
        t.start()
    run(0)
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def spans_in_threads(n_threads: int, spans, work, last=None) -> None:
    """work(i, lo, hi) for every span (lo, hi), then last(i), in threads i < n_threads
    (`in_threads`) that take the spans in turn."""
    todo: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
    for span in spans:
        todo.put(span)

    def run(i: int) -> None:
        while True:
            try:
                lo, hi = todo.get_nowait()
            except queue.Empty:
                break
            work(i, lo, hi)
        if last is not None:
            last(i)

    in_threads(n_threads, run)
