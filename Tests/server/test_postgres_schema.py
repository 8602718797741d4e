"""The PostgreSQL engine's schema next to running servers: a server that starts while others
hold transactions on its tables must not wait on them (DDL locks a table against every other
transaction), and a schema update that has to wait for them is tried again, not fatal."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
from test_api import C, put_file
from ubiqstack import Api, PostgresCluster, ServerProcess, create_account

pytestmark = pytest.mark.skipif(
    "scale" not in os.environ.get("UBIQFS_TEST_ENGINES", "embedded,scale").split(","),
    reason="PostgreSQL schema tests need the scale engine",
)


class HeldLock:
    """A psql session holding `LOCK TABLE items IN ROW EXCLUSIVE MODE` (what every running
    server's commit holds) in an open transaction until `release`."""

    def __init__(self, pg: PostgresCluster):
        url = pg.url.replace("?sslmode=disable", "")
        self.proc = subprocess.Popen(
            [f"{PostgresCluster.bindir()}/psql", "-q", "-v", "ON_ERROR_STOP=1", url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.proc.stdin.write("BEGIN;\nLOCK TABLE items IN ROW EXCLUSIVE MODE;\n\\echo locked\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.strip() == "locked", line

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("COMMIT;\n\\q\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)


def psql(pg: PostgresCluster, sql: str) -> str:
    url = pg.url.replace("?sslmode=disable", "")
    return subprocess.run(
        [f"{PostgresCluster.bindir()}/psql", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", url, "-c", sql],
        check=True, capture_output=True, text=True,
    ).stdout.strip()


def serves(server: ServerProcess, storage) -> None:
    """The server commits an item for a new account."""
    api = Api(server.url, create_account(storage, f"schema-{time.monotonic_ns()}"))
    api.ensure_container(C)
    r = put_file(api, "f1", "f", b"schema")
    assert r.status == 201, r


def test_a_server_starts_next_to_running_ones_without_waiting_on_their_transactions(scale_stack, tmp_path):
    storage = scale_stack.storage()
    first = ServerProcess(storage, tmp_path / "first.log").start()
    lock = HeldLock(scale_stack.pg)
    second = ServerProcess(storage, tmp_path / "second.log")
    try:
        started = threading.Thread(target=second.start, daemon=True)
        started.start()
        started.join(20)
        assert not started.is_alive(), "the second server waited on a running transaction: " + (
            tmp_path / "second.log").read_text(errors="replace")[-2000:]
        assert second.proc.poll() is None, (tmp_path / "second.log").read_text(errors="replace")
        serves(second, storage)
    finally:
        lock.release()
        second.stop()
        first.stop()


def test_a_schema_update_that_waits_on_running_transactions_is_tried_again(scale_stack, tmp_path):
    storage = scale_stack.storage()
    ServerProcess(storage, tmp_path / "first.log").start().stop()
    # A database from an older build: no schema recorded, so the server updates it.
    psql(scale_stack.pg, "DELETE FROM schema_version")
    lock = HeldLock(scale_stack.pg)
    server = ServerProcess(storage, tmp_path / "server.log")
    try:
        starting = threading.Thread(target=server.start, daemon=True)
        starting.start()
        # The update waits for the lock (5 s at most each time), gives up, and tries again.
        deadline = time.monotonic() + 30
        log = tmp_path / "server.log"
        while "trying again" not in (log.read_text(errors="replace") if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text(errors="replace") if log.exists() else "no log"
            assert server.proc is None or server.proc.poll() is None, log.read_text(errors="replace")
            time.sleep(0.2)
        lock.release()
        starting.join(60)
        assert not starting.is_alive()
        assert server.proc.poll() is None, log.read_text(errors="replace")
        assert psql(scale_stack.pg, "SELECT count(*) FROM schema_version") == "1"
        serves(server, storage)
    finally:
        lock.release()
        server.stop()
