"""Files written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path | str, write: Callable[[BinaryIO], None]) -> Path:
    """`write(f)` to `path` through a temporary file beside it, synced and renamed over it: a
    reader sees the old file or the new one, never a part of one, whenever the writer stops.
    The file is readable by all and writable by its owner (0644), as with the usual umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # not mkstemp's private 0600
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
