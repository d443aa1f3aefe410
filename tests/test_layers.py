"""The package layout is the architecture (DESIGN §7): the HTTP layer depends on an interface,
not on what implements it, and nothing below the routes speaks HTTP. Checked on the source's
imports (every `import` and `from ... import`, at any depth, parsed, not run)."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import m31

SOURCE = Path(m31.__file__).parent
HTTP = ("fastapi", "starlette", "uvicorn")


def imports(path: Path) -> set[str]:
    """The modules `path` imports, as absolute names (a relative import resolved against its
    package)."""
    package = ".".join(path.relative_to(SOURCE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def banned_in(path: Path, banned: tuple[str, ...]) -> list[str]:
    """The modules of `banned` (or within them) that `path` imports."""
    return sorted(
        name for name in imports(path) if any(name == b or name.startswith(b + ".") for b in banned)
    )


def offending(folder: str, banned: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict:
    """{module: the banned modules it imports} over the modules under `folder`."""
    paths = [p for p in sorted((SOURCE / folder).rglob("*.py")) if p.name not in skip]
    found = {p.relative_to(SOURCE).as_posix(): banned_in(p, banned) for p in paths}
    return {name: bad for name, bad in found.items() if bad}


def test_imports_are_read():
    """The check sees what it is meant to: the cluster's serving entry point imports the serve
    package and Ray, the app FastAPI."""
    assert {"m31.serve.launch", "ray"} <= imports(SOURCE / "cluster" / "serve.py")
    assert "fastapi" in imports(SOURCE / "serve" / "app.py")


def test_serve_imports_neither_the_cluster_nor_ray():
    """`m31.serve` drives a `Backend` (`m31.serve.backend`); the command line picks the
    cluster's (`m31.cli.serve`), so a server without the ray extra imports none of it."""
    assert not offending("serve", ("m31.cluster", "ray"))


def test_the_cluster_core_does_not_import_the_http_layer():
    """The shards, the coordinator and the ingress's handle of them raise the index's errors
    (`m31.index.errors`); only the backend and the Ray Serve entry point use `m31.serve`."""
    assert not offending("cluster", ("m31.serve",), skip=("backend.py", "batches.py", "serve.py"))


def test_no_http_type_below_the_routes():
    """Backends and the cluster raise domain errors; only the routes and the app (and the Ray
    Serve entry point, which runs the app) map them to status codes."""
    assert not offending("cluster", HTTP, skip=("serve.py",))
    assert not offending("index", HTTP)
    for name in ("backend.py", "local.py", "bodies.py"):
        assert not banned_in(SOURCE / "serve" / name, HTTP), name


class _Down:
    """A backend whose index is down and holds no ads: what reaches the routes is the index's
    errors alone, which carry no HTTP. (Implements `Backend` without inheriting anything.)"""

    writers = 1

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.retriever = SimpleNamespace(vocab={})
        self.encoder = SimpleNamespace(codes={}, text_encoder_loaded=None)
        self.version = self.ads = self.rows = self.users = 0

    def _down(self, *args):
        from m31.index.errors import Unavailable

        raise Unavailable("shards [1] did not answer (down or restarting)", [1])

    stats = reached = retrieve_batch = upsert = update = delete = add_events = _down
    set_users = snapshot = _down

    def get_ad(self, ad_id: int):
        from m31.index.errors import NotFound

        raise NotFound(f"ad id {ad_id} is not in the index")

    def close(self) -> None:
        pass


def _unit(module: str) -> str | None:
    """The top-level unit of m31 a module belongs to: its package (`m31.index`), or a module of
    m31's own (`m31.files`); None outside m31."""
    parts = module.split(".")
    if parts[0] != "m31" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def test_the_packages_import_each_other_without_a_circle():
    """The packages form a graph without a circle, counting every import at any depth (a
    function-level import is a dependency as much as a module-level one): each package can be
    read, tested and replaced from the bottom up."""
    graph: dict[str, set[str]] = {}
    for path in SOURCE.rglob("*.py"):
        unit = _unit("m31." + ".".join(path.relative_to(SOURCE).with_suffix("").parts))
        targets = {_unit(name) for name in imports(path)} - {None, unit, "m31.__init__"}
        graph.setdefault(unit, set()).update(
            t for t in targets if (SOURCE / t[4:]).exists() or (SOURCE / f"{t[4:]}.py").exists()
        )
    assert {"m31.index", "m31.engine", "m31.serve", "m31.cluster"} <= set(graph)
    done: set[str] = set()

    def visit(unit: str, path: tuple[str, ...]) -> None:
        if unit in path:
            raise AssertionError(
                f"an import circle: {' -> '.join((*path[path.index(unit) :], unit))}"
            )
        if unit in done:
            return
        for target in sorted(graph.get(unit, ())):
            visit(target, (*path, unit))
        done.add(unit)

    for unit in sorted(graph):
        visit(unit, ())


def test_the_app_maps_a_backends_errors():
    """No such ad is 404; an outage is 503 with Retry-After on every route it reaches,
    readiness and `min_version` included (never 500); /metrics keeps answering."""
    from starlette.testclient import TestClient

    from m31.serve.app import ServeConfig, create_app

    config = ServeConfig(index=Path("unused"), model=Path("unused"), admin_token="t")
    app = create_app(config, lambda cfg: _Down())
    admin = {"Authorization": "Bearer t"}
    with TestClient(app) as client:
        loaded_by = time.monotonic() + 60
        while app.state.batcher is None:  # loaded in a thread
            assert time.monotonic() < loaded_by, app.state.load_error
            time.sleep(0.01)
        r = client.get("/v1/ads/7")
        assert (r.status_code, r.json()) == (404, {"detail": "ad id 7 is not in the index"})
        calls = [
            client.get("/health/ready"),
            client.delete("/v1/ads/7", headers=admin),
            client.post("/v1/admin/snapshot", headers=admin),
            client.put("/v1/users", headers=admin, json={"users": [{"user_id": 1}]}),
            client.post("/v1/retrieve", json={"requests": [{"user_id": 1}], "min_version": 3}),
        ]
        for r in calls:
            assert r.status_code == 503, (r.request.url, r.text)
            assert r.headers["Retry-After"] == "1"
            assert r.json() == {"detail": "shards [1] did not answer (down or restarting)"}
        assert client.get("/metrics").status_code == 200
