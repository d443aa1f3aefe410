"""What the commands share: options, the error wrapper, NAME=PATH values."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer

SplitOption = Annotated[str, typer.Option(help="Which split's features (leave-last-out or time).")]
MaxUsersOption = Annotated[
    int | None, typer.Option(help="Evaluate a seeded sample of test requests.")
]
ExcludeSeenOption = Annotated[
    bool | None,
    typer.Option(
        help="Drop ads engaged before (default: on where the dataset's meta says "
        "repeat_engagement false)."
    ),
]
DataOption = Annotated[Path, typer.Option(help="Dataset folder.")]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Write the results as JSON.")]
DeviceOption = Annotated[str, typer.Option(help="cpu or cuda.")]
OverwriteOption = Annotated[bool, typer.Option(help="Replace an existing folder.")]


def fail(msg: str) -> NoReturn:
    typer.secho(f"error: {msg}", err=True, fg="red")
    raise typer.Exit(2)


def cli_errors(fn):
    """Turn the project's input errors into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from m31.data.dataset import DatasetError

        try:
            return fn(*args, **kwargs)
        except (DatasetError, ValueError, FileNotFoundError, PermissionError) as e:
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    return wrapper


def write_json(path: Path, doc) -> None:
    """--json, --out: `doc` as indented JSON."""
    path.write_text(json.dumps(doc, indent=2) + "\n")


def named_paths(
    values: list[str] | None, option: str, *, named: bool = False, unique: bool = False
) -> list[tuple[str, Path]]:
    """`option`'s NAME=PATH values as (name, path), in order. PATH may be a glob: its matches,
    sorted (the seeds of one model). A bare PATH has the name "" (its checkpoint's model kind,
    once loaded) unless `named`; with `unique`, a name is given once."""
    import glob

    out: list[tuple[str, Path]] = []
    for v in values or []:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = "", v
        elif not name or not path:
            fail(f"{option}: expected NAME=PATH, got {v!r}")
        if named and not name:
            fail(f"{option}: give NAME=CHECKPOINT")
        if unique and name and any(name == seen for seen, _ in out):
            fail(f"{option}: the name {name!r} is given twice")
        if glob.has_magic(path):
            matches = sorted(glob.glob(path))
            if not matches:
                fail(f"{option}: no checkpoint matches {path!r}")
            out += [(name, Path(m)) for m in matches]
        else:
            out.append((name, Path(path)))
    return out


def grouped(pairs: list[tuple[str, Path]]) -> dict[str, list[Path]]:
    """(name, path) pairs as name -> its paths, in order."""
    out: dict[str, list[Path]] = {}
    for name, path in pairs:
        out.setdefault(name, []).append(path)
    return out
