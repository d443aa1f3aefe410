"""Progress bars for long jobs: shown on a terminal, silent in logs and CI."""

from __future__ import annotations

import sys


def progress_bar():
    """A rich progress bar driven by `callback(stage, done, total)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
    tasks: dict[str, int] = {}

    def callback(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done)

    return bar, callback
