"""Shared test setup."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from m31.data.dataset import Dataset
    from m31.features import Features
    from m31.world.truth import GroundTruth

# Without a GPU the Triton kernels run under Triton's interpreter, which is chosen when a kernel
# is decorated: the flag has to be set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: runs on the run's Ray cluster (`ray_local`)")


def uses_ray(item) -> bool:
    """On the run's Ray cluster, or on a Ray of its own in this process (marked `ray`)."""
    return "ray_local" in item.fixturenames or item.get_closest_marker("ray") is not None


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture parameters
def pytest_collection_modifyitems(items):
    """The tests on Ray last, in their order: the run's Ray cluster, started by the first of
    them, is then up only while they run (idle, it and Serve take a tenth of a core). Under
    `make test`'s two pytest-xdist workers (`--dist loadscope`: a module's tests on one worker,
    so its module fixtures are built once) each worker that meets a Ray test starts its own."""
    items[:] = [i for i in items if not uses_ray(i)] + [i for i in items if uses_ray(i)]


@pytest.fixture(scope="session", autouse=True)
def bench_results(tmp_path_factory):
    """`m31 bench` and `m31 loadtest` append their rows to a table of the run's own, not to the
    checkout's bench/results.csv (their --results default)."""
    path = tmp_path_factory.mktemp("bench") / "results.csv"
    os.environ["M31_BENCH_RESULTS"] = str(path)
    return path


@dataclass(frozen=True)
class TinyWorld:
    """The tiny marketplace the modules that train, evaluate or validate share."""

    folder: Path  # the dataset folder: its tables, meta.json and truth.npz
    ds: Dataset
    truth: GroundTruth
    feats: Features  # L = 8, no text encoder (zero text vectors); never changed in place


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> TinyWorld:
    """`TinyWorld`, generated once per worker (its 20,000 impressions take seconds). A module
    that needs other features builds them from `ds`; one that changes them makes a copy."""
    from m31.data import dataset
    from m31.features import FeatureConfig, build_features
    from m31.world.config import preset
    from m31.world.generate import generate

    ds, truth = generate(preset("tiny").with_overrides(n_impressions=20_000), seed=3)
    folder = tmp_path_factory.mktemp("tiny") / "world"
    dataset.save(ds, folder, extra=truth.to_arrays())
    feats = build_features(ds, FeatureConfig(max_len=8, text_embeddings=False))
    return TinyWorld(folder, ds, truth, feats)


@pytest.fixture(scope="session")
def served_world(tmp_path_factory):
    """The serving tests' tiny world (`serve_helpers.build_world`), built once per run: the
    modules that serve it make their own serving folders from its snapshot (`fresh_state`)."""
    from serve_helpers import build_world

    return build_world(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the whole run, started by the first test that needs it (each
    start costs seconds): the modules start their own actors on it and kill them when done
    (`serve_helpers.stop_cluster`)."""
    ray = pytest.importorskip("ray")
    # Ray Serve's controller kills an HTTP proxy not ready within 5 s (then 10, 15, ...), and
    # `serve.start` fails with it: seen on a 2-core machine beside two CPU-bound jobs, where
    # every Serve test then errored. These bound only a proxy that never starts (Ray's own
    # processes inherit this environment).
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "300")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "300")
    # Ray gives its node a fixed 30 s to register (`ray._private.node`), which a machine busy
    # with other runs can miss: started again, up to three times in all.
    for attempt in range(3):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_serve(ray_local):
    """Ray Serve's HTTP proxy on a free loopback port for the whole run; its base URL. Each
    module deploys its own applications under their own names and route prefixes, and deletes
    them when done."""
    from ray import serve
    from serve_helpers import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
