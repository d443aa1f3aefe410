"""Size limits that keep the code readable (issue 29): a command parses its options, calls the
library and prints, so it stays short; and no source file grows past what a reader takes in."""

from __future__ import annotations

import inspect
from pathlib import Path

import m31
from m31.cli import app

MAX_COMMAND_LINES = 40  # a command's body: what it does once its options are parsed
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80  # a source function's def through its last line
MAX_LONG_FUNCTIONS = 6  # how many may be longer: a kernel's body, a generator's one pass
MAX_FMT_SKIPS = 15  # "# fmt: skip" only on data tables, whose layout is their meaning
SOURCE = Path(m31.__file__).parent
CODE = {".py", ".c", ".h"}  # data files (world/topics.json and the like) are not code


def _commands(typer_app, prefix=""):
    for command in typer_app.registered_commands:
        yield prefix + (command.name or command.callback.__name__), command.callback
    for group in typer_app.registered_groups:
        yield from _commands(group.typer_instance, f"{prefix}{group.name} ")


def _length(fn) -> int:
    """Lines of a command's body after its docstring: its options are declarations (one per
    option, however many), its body what it does with them."""
    import ast
    import textwrap

    source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    node = ast.parse(source).body[0]
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def test_every_command_is_short():
    commands = dict(_commands(app))
    assert {"train", "eval", "serve", "world generate", "bench kernels"} <= set(commands)
    long = {name: n for name, fn in commands.items() if (n := _length(fn)) > MAX_COMMAND_LINES}
    assert not long, f"command bodies over {MAX_COMMAND_LINES} lines: {long}"


def test_no_source_file_is_too_long():
    sizes = {
        path.relative_to(SOURCE).as_posix(): len(path.read_text().splitlines())
        for path in SOURCE.rglob("*")
        if path.suffix in CODE and path.is_file()
    }
    assert {"cli/__init__.py", "ops/cpu/csrc/native.h", "ops/cpu/csrc/scan.c"} <= set(sizes)
    long = {name: n for name, n in sizes.items() if n > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def _sources():
    return [path for path in sorted(SOURCE.rglob("*.py")) if path.is_file()]


def test_few_source_functions_are_long():
    """A long function is broken into named steps; the few left are listed here when they
    grow past the count."""
    import ast

    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(SOURCE)}:{node.name}"] = n
    assert len(long) <= MAX_LONG_FUNCTIONS, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_fmt_skip_only_on_data_tables():
    """The formatter's layout holds everywhere but on a few data tables."""
    skips = {
        path.relative_to(SOURCE).as_posix(): n
        for path in _sources()
        if (n := path.read_text().count("# fmt: skip"))
    }
    assert sum(skips.values()) <= MAX_FMT_SKIPS, f"# fmt: skip lines: {skips}"


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
