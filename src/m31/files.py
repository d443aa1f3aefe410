"""Files and folders written whole or not at all.

`write_file_atomic` writes one file through a temporary file beside it; `write_folder_atomic`
fills a temporary sibling folder and renames it into place. Either way a reader sees the old
content or the new, never a part of one, whenever the writer stops.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class WriteRefused(ValueError):
    """A folder not written: it exists (and replacing it was not asked for), or its parent
    cannot be written to; the message names the path."""


def write_file_atomic(
    path: Path | str, write: Callable[[BinaryIO], None], mode: int = 0o644
) -> Path:
    """`write(f)` to `path` through a temporary file beside it, synced and renamed over it: a
    reader sees the old file or the new one, never a part of one, whenever the writer stops.
    The file gets `mode` (default: readable by all and writable by its owner, as with the
    usual umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # not mkstemp's private 0600
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_folder_atomic(out: Path, fill: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Create folder `out` by calling `fill(tmp)` on a temporary sibling and renaming it.

    An exception inside `fill` leaves `out` exactly as it was. With `overwrite`, an existing
    `out` is replaced only after the new folder is complete. `WriteRefused` if `out` exists
    without `overwrite`, or its parent cannot be written to.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise WriteRefused(f"{out}: already exists (pass overwrite to replace it)")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise WriteRefused(f"{parent}: cannot write there ({e.strerror or e})") from e
    try:
        fill(tmp)
        _fsync_tree(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
