"""What is left of a local Ray cluster once the process that started it is gone: `m31 serve
--ray` starts this (`python -m m31.cluster.reaper`) beside the Ray cluster it starts, and
tells it, one per line on its stdin, the processes of that cluster ("pid starttime", from
/proc). When the server's end of the pipe closes — it exited, or was killed with SIGKILL — this
kills those still there (the same pid and start time, so a reused pid is spared).

Why: Ray ties its head processes to the process that started them, but its two agents
(dashboard, runtime env) outlive a raylet that was killed rather than stopped: they try to
report it to the head, which is gone too, for about a minute. Linux only (it reads /proc);
elsewhere the server starts no reaper. Imports nothing but the standard library, so that it
starts at once and holds no memory.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks after boot), None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below `root`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        started = start_time(pid)
        if started is not None:
            found.append((pid, started))
        todo += children.get(pid, [])
    return found


def main() -> None:
    # The server's terminal may interrupt its whole process group: this one must outlive it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watched: dict[int, str] = {}
    for line in sys.stdin:  # until the server's end closes
        pid, started = line.split()
        watched[int(pid)] = started
    for pid, started in watched.items():
        if pid != os.getpid() and start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main()
