"""The index's place among the layers (issue 50): `m31.index` holds the ad table and its
eligibility, and knows nothing above it. Read from the source with `ast`, every import counted:
at the top of a module, inside a function, or under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import m31

SOURCE = Path(m31.__file__).parent
INDEX = SOURCE / "index"
ABOVE = ("m31.data", "m31.engine", "m31.serve", "m31.users")


def _module(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (for `from m31.index import x`, m31.index.x too when that is
    a module of its own)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(path, node)
            found.add(base)
            for alias in node.names:
                sub = SOURCE.parent.joinpath(*f"{base}.{alias.name}".split("."))
                if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
                    found.add(f"{base}.{alias.name}")
    return found


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, a relative one resolved from `path`'s package."""
    if not node.level:
        return node.module or ""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def _above(module: str) -> bool:
    return any(module == a or module.startswith(f"{a}.") for a in ABOVE)


def _index_graph() -> dict[str, set[str]]:
    """m31.index module -> the m31.index modules it imports (its package's __init__ aside)."""
    modules = {_module(p): p for p in INDEX.rglob("*.py")}
    return {
        name: {m for m in _imports(path) if m in modules and m != "m31.index"}
        for name, path in modules.items()
    }


def test_the_index_imports_nothing_above_it():
    seen = {_module(p): sorted(filter(_above, _imports(p))) for p in sorted(INDEX.rglob("*.py"))}
    assert len(seen) > 10, "the index's modules were not found"
    wrong = {name: bad for name, bad in seen.items() if bad}
    assert not wrong, f"m31.index imports from {', '.join(ABOVE)}: {wrong}"


def test_no_import_cycle_among_the_index_modules():
    graph = _index_graph()
    assert "m31.index.ad_index" in graph and graph["m31.index.durable"]
    _check_acyclic(graph)


def _check_acyclic(graph: dict[str, set[str]]) -> None:
    """AssertionError naming a cycle of `graph` (module -> the modules it imports), if any."""
    state = dict.fromkeys(graph, "new")

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for nxt in sorted(graph[name]):
            if state[nxt] == "open":
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if state[nxt] == "new":
                visit(nxt, [*path, nxt])
        state[name] = "done"

    for name in sorted(graph):
        if state[name] == "new":
            visit(name, [name])


def test_the_check_sees_a_cycle_and_an_upward_import(tmp_path):
    """The checks above find what they look for: an import under TYPE_CHECKING or inside a
    function is an import."""
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from m31.data.schema import ADS\n"
    )
    (tmp_path / "b.py").write_text("def f():\n    from m31.users import UserStore\n")
    assert _above("m31.data.schema") and _above("m31.users") and not _above("m31.users_x")
    assert "m31.data.schema" in _imports(tmp_path / "a.py")
    assert "m31.users" in _imports(tmp_path / "b.py")
    graph = {"x": {"y"}, "y": {"z"}, "z": {"x"}}
    with pytest.raises(AssertionError, match="import cycle: x -> y -> z -> x"):
        _check_acyclic(graph)
