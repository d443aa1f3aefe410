"""Property-based fuzzing of the HTTP API from its own OpenAPI schema, every schemathesis check
on: no input gives a 5xx (beyond the documented 503/504 of a retrieve call whose deadline
cannot be met), and every answer is one the schema documents, with the body it documents.

Schemathesis generates bodies, paths and parameters from /openapi.json (valid ones and, in its
negative phase, ones that break the schema) and calls the real server on loopback, with and
without the admin token. The checks read scripts/schemathesis.toml, as scripts/fuzz_serve.sh
(the longer run) does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from serve_helpers import ADMIN, ThreadServer, fresh_state

from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend

CHECKS = Path(__file__).resolve().parents[1] / "scripts" / "schemathesis.toml"


@pytest.fixture(scope="module")
def fuzzed_server(served_world):
    world = served_world
    config = ServeConfig(
        index=fresh_state(world, "fuzz"),
        model=world.model,
        admin_token=ADMIN,
        max_body_bytes=1 << 20,
    )
    with ThreadServer(create_app(config, LocalBackend.load)) as server:
        yield server


def fuzz(operation, mode, failures: list[str], statuses: dict[int, int]) -> None:
    """Call the server with generated cases of one operation, as admin and anonymous."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def run(case):
        for headers in ({"Authorization": f"Bearer {ADMIN}"}, {}):
            response = case.call(headers=headers, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            try:
                case.validate_response(response, headers=headers)
            except FailureGroup as group:
                failures.append(
                    f"{operation.method.upper()} {case.formatted_path} ({mode.value}) "
                    f"body={str(case.body)[:300]} -> {response.status_code}: "
                    f"{response.text[:300]}: " + "; ".join(f.title for f in group.exceptions)
                )

    run()


def test_no_server_errors(fuzzed_server):
    schema = schemathesis.openapi.from_url(
        f"{fuzzed_server.url}/openapi.json", config=SchemathesisConfig.from_path(CHECKS)
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9  # every endpoint of the API is fuzzed
    failures: list[str] = []
    statuses: dict[int, int] = {}
    for operation in operations:
        fuzz(operation, GenerationMode.POSITIVE, failures, statuses)
        try:  # inputs that break the schema, where it has anything to break
            fuzz(operation, GenerationMode.NEGATIVE, failures, statuses)
        except Unsatisfiable:
            assert not (operation.body or operation.path_parameters), operation.path
    assert not failures, "\n".join(failures[:10])
    # The fuzzing reached past validation and auth, not only into 401 and 422.
    assert statuses.get(200, 0) > 50 and statuses.get(422, 0) > 50, statuses
