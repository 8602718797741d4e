"""Fixtures for the server API tests: each test runs on both engines (embedded: SQLite +
blob folder; scale: PostgreSQL + SeaweedFS S3, started once per session), starts its own
`ubiqfs serve` processes on loopback ports and stops them in teardown.

UBIQFS_TEST_ENGINES=embedded (or scale) limits the engines; UBIQFS_BIN names the binary.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from ubiqstack import UBIQFS_BIN, Api, EmbeddedStorage, ScaleStack, ServerProcess, create_account  # noqa: E402

ENGINES = [e for e in os.environ.get("UBIQFS_TEST_ENGINES", "embedded,scale").split(",") if e]


@pytest.fixture(scope="session", autouse=True)
def _binary():
    if not os.access(UBIQFS_BIN, os.X_OK):
        pytest.exit(f"ubiqfs binary not found at {UBIQFS_BIN} (swift build, or set UBIQFS_BIN)", returncode=2)


@pytest.fixture(scope="session")
def scale_stack():
    stack = ScaleStack()
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(params=ENGINES)
def storage(request, tmp_path):
    if request.param == "embedded":
        return EmbeddedStorage(tmp_path / "data")
    return request.getfixturevalue("scale_stack").storage()


@pytest.fixture
def start_server(storage, tmp_path):
    """Starts `ubiqfs serve` processes over the test's storage; all stopped at teardown."""
    started: list[ServerProcess] = []

    def start() -> ServerProcess:
        s = ServerProcess(storage, tmp_path / f"serve-{len(started)}.log")
        started.append(s)
        return s.start()

    try:
        yield start
    finally:
        for s in started:
            s.stop()


@pytest.fixture
def server(start_server) -> ServerProcess:
    return start_server()


def unique(prefix: str = "acct") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def new_account(storage, server):
    """Creates an account on the test's storage; returns an Api bound to its token."""

    def make(quota: str | None = None, srv: ServerProcess | None = None) -> Api:
        name = unique()
        token = create_account(storage, name, quota)
        api = Api((srv or server).url, token)
        api.account = name  # type: ignore[attr-defined]
        return api

    return make


@pytest.fixture
def api(new_account) -> Api:
    return new_account()
