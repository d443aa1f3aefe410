"""Shared test setup."""

import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter, which is chosen when a kernel
# is decorated: the flag has to be set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def served_world(tmp_path_factory):
    """The serving tests' tiny world (`serve_helpers.build_world`), built once per run: the
    modules that serve it make their own serving folders from its snapshot (`fresh_state`)."""
    from serve_helpers import build_world

    return build_world(tmp_path_factory.mktemp("served"))
