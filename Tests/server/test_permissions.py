"""The state `ubiqfs` creates on disk is private: the server's `--data` folder, its SQLite
database (with -wal and -shm) and blob folder, and a client's state folder with its key-value
mirror and embedded cloud, are created 0700 (folders) and 0600 (files)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from test_api import sha
from ubiqstack import UBIQFS_BIN, Api, EmbeddedStorage, ServerProcess, run_cli


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_server_state_is_private(tmp_path):
    data = tmp_path / "fresh" / "data"
    run_cli("server", "account", "create", "perm", "--data", data)
    srv = ServerProcess(EmbeddedStorage(data), tmp_path / "serve.log").start()
    try:
        token = run_cli("server", "token", "create", "perm", "--data", data).stdout.strip()
        a = Api(srv.url, token)
        assert a.put(f"/v1/chunks/{sha(b'p')}", b"p").status == 201
        assert _mode(data) == 0o700
        for name in ("cloud.sqlite", "cloud.sqlite-wal", "cloud.sqlite-shm"):
            assert (data / name).exists(), name
            assert _mode(data / name) == 0o600, name
        for d, _dirs, files in os.walk(data / "blobs"):
            assert _mode(Path(d)) == 0o700, d
            for f in files:
                assert _mode(Path(d) / f) & 0o077 == 0, f
    finally:
        srv.stop()


def test_client_state_is_private(tmp_path):
    state = tmp_path / "client" / "state"
    env = {"UBIQFS_STATE_DIR": str(state)}
    cp = subprocess.run([UBIQFS_BIN, "kv", "set", "theme", '"dark"'], capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert cp.returncode == 0, cp
    assert _mode(state) == 0o700
    kv = list(state.rglob("kv.sqlite"))
    assert kv, list(state.rglob("*"))
    for p in state.rglob("*"):
        if p.is_dir():
            assert _mode(p) == 0o700, p
        else:
            assert _mode(p) & 0o077 == 0, p
