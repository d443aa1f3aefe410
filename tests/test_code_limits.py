"""Size limits that keep the code readable (issue 29): a command parses its options, calls the
library and prints, so it stays short; and no source file grows past what a reader takes in."""

from __future__ import annotations

import inspect
from pathlib import Path

import m31
from m31.cli import app

MAX_COMMAND_LINES = 60  # the def through its last line, decorators excluded
MAX_FILE_LINES = 700
SOURCE = Path(m31.__file__).parent
CODE = {".py", ".c", ".h"}  # data files (world/topics.json and the like) are not code


def _commands(typer_app, prefix=""):
    for command in typer_app.registered_commands:
        yield prefix + (command.name or command.callback.__name__), command.callback
    for group in typer_app.registered_groups:
        yield from _commands(group.typer_instance, f"{prefix}{group.name} ")


def _length(fn) -> int:
    lines, _ = inspect.getsourcelines(fn)  # the function `cli_errors` wraps, decorators included
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    return len(lines) - start


def test_every_command_is_short():
    commands = dict(_commands(app))
    assert {"train", "eval", "serve", "world generate", "bench kernels"} <= set(commands)
    long = {name: n for name, fn in commands.items() if (n := _length(fn)) > MAX_COMMAND_LINES}
    assert not long, f"command functions over {MAX_COMMAND_LINES} lines: {long}"


def test_no_source_file_is_too_long():
    sizes = {
        path.relative_to(SOURCE).as_posix(): len(path.read_text().splitlines())
        for path in SOURCE.rglob("*")
        if path.suffix in CODE and path.is_file()
    }
    assert {"cli/__init__.py", "ops/cpu_native/native.h", "ops/cpu_native/scan.c"} <= set(sizes)
    long = {name: n for name, n in sizes.items() if n > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_every_design_reference_resolves():
    """Each "DESIGN §N" in the code names a section of docs/DESIGN.md, and each `§N, "Title"`
    a heading or a bold lead-in within that section."""
    import re

    design = (Path(__file__).parents[1] / "docs" / "DESIGN.md").read_text()
    sections = dict(re.findall(r"^## (\d+)\. .*?\n(.*?)(?=^## \d+\. |\Z)", design, re.M | re.S))
    seen = 0
    for path in sorted(SOURCE.rglob("*")):
        if path.suffix not in CODE:
            continue
        text = path.read_text()
        for number, title in re.findall(r'DESIGN §(\d+)(?:,? "([^"]+)")?', text):
            seen += 1
            where = f"{path.relative_to(SOURCE)}: DESIGN §{number}"
            assert number in sections, f"{where}: no such section"
            if title:
                title, body = " ".join(title.split()), sections[number]
                named = re.search(rf"^#+ {re.escape(title)}|\*\*{re.escape(title)}", body, re.M)
                assert named, f'{where}, "{title}": not a heading or lead-in of that section'
    assert seen > 40  # the code does cite it
