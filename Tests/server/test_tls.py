"""Transport security (docs/protocol.md, "Transport"), on both engines: `ubiqfs serve --tls-cert
--tls-key` speaks HTTPS; `ubiqfs account login` verifies the server's certificate (against the
CA given with --ca-cert, kept with the account) and refuses to send a token over plain http://
to anything but loopback unless --insecure-http."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_api import C, put_file
from ubiqstack import UBIQFS_BIN, Api, PostgresCluster, ScaleStorage, ServerProcess, TlsFiles, create_account, run_cli


def _non_loopback_ip() -> str | None:
    """This machine's own address on its first non-loopback interface (traffic to it stays here)."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                             timeout=10).stdout
    except OSError:
        return None
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            return parts[parts.index("inet") + 1].split("/")[0]
    return None


def _ubiq(state: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "UBIQFS_STATE_DIR": str(state)}
    return subprocess.run([UBIQFS_BIN, *map(str, args)], capture_output=True, text=True, env=env, timeout=60)


def _one_line_error(cp: subprocess.CompletedProcess) -> str:
    assert cp.returncode != 0, cp
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ubiqfs: "), cp.stderr
    return lines[0]


@pytest.fixture
def tls(tmp_path) -> TlsFiles:
    return TlsFiles(tmp_path / "tls")


@pytest.fixture
def tls_server(storage, tmp_path, tls):
    s = ServerProcess(storage, tmp_path / "serve-tls.log", tls=tls)
    try:
        yield s.start()
    finally:
        s.stop()


def test_https_api_with_the_ca(storage, tls_server, tls):
    token = create_account(storage, "tls-api")
    api = Api(tls_server.url, token, ca=tls.ca)
    assert tls_server.url.startswith("https://")
    assert api.get("/v1/account").json()["account"] == "tls-api"
    assert api.ensure_container(C)["token"] == 2
    assert put_file(api, "f1", "over-tls.txt", b"secret bytes").status == 201
    # The port speaks only TLS: a plain HTTP request gets no HTTP answer.
    plain = socket.create_connection(("127.0.0.1", tls_server.port), timeout=5)
    try:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = plain.recv(64)
    except OSError:
        answer = b""
    finally:
        plain.close()
    assert not answer.startswith(b"HTTP/1.1 200"), answer
    # Without the CA, Python's default trust store refuses the certificate too.
    with pytest.raises(Exception) as e:
        Api(tls_server.url, token).get("/healthz")
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value) or "certificate" in str(e.value).lower()


def test_login_over_https_verifies_the_certificate(storage, tls_server, tls, tmp_path):
    token = create_account(storage, "tls-login")
    # No CA: the self-signed chain is not trusted; nothing is saved.
    state = tmp_path / "no-ca"
    line = _one_line_error(_ubiq(state, "account", "login", "--server", tls_server.url, "--token", token))
    assert "certificate" in line and "--ca-cert" in line, line
    assert not (state / "account.json").exists()
    # Another CA: refused as well.
    other = TlsFiles(tmp_path / "other-ca")
    line = _one_line_error(
        _ubiq(state, "account", "login", "--server", tls_server.url, "--token", token, "--ca-cert", other.ca))
    assert "certificate" in line, line
    # The right CA: signed in, the CA is kept with the account and used by later commands.
    state = tmp_path / "with-ca"
    cp = _ubiq(state, "account", "login", "--server", tls_server.url, "--token", token, "--ca-cert", tls.ca,
               "--device", "tls-dev")
    assert cp.returncode == 0, cp
    cfg = json.loads((state / "account.json").read_text())
    assert cfg["server"] == tls_server.url
    assert (state / "account.json").stat().st_mode & 0o777 == 0o600
    assert state.stat().st_mode & 0o777 == 0o700
    assert "BEGIN CERTIFICATE" in cfg["caCertificatePEM"]
    st = _ubiq(state, "account", "status", "--json")
    assert st.returncode == 0, st
    assert json.loads(st.stdout)["reachable"] is True, st.stdout
    # The device token works over HTTPS.
    assert Api(tls_server.url, cfg["token"], ca=tls.ca).get("/v1/account").json()["device"] == "tls-dev"


def test_bad_tls_files_fail_at_start(storage, tmp_path, tls):
    missing = tmp_path / "nope.pem"
    cp = subprocess.run(
        [UBIQFS_BIN, "serve", "--listen", "127.0.0.1:0", "--tls-cert", str(missing), "--tls-key", str(tls.key),
         *storage.args()], capture_output=True, text=True, env={**os.environ, **storage.env()}, timeout=60)
    line = _one_line_error(cp)
    assert "nope.pem" in line, line
    cp = subprocess.run(
        [UBIQFS_BIN, "serve", "--listen", "127.0.0.1:0", "--tls-cert", str(tls.cert), *storage.args()],
        capture_output=True, text=True, env={**os.environ, **storage.env()}, timeout=60)
    assert cp.returncode != 0 and "--tls-key" in cp.stderr, cp


def test_plain_http_only_to_loopback_unless_insecure_http(storage, tmp_path):
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    token = create_account(storage, "plain-http")
    srv = ServerProcess(storage, tmp_path / "serve-ip.log", host=ip).start()
    try:
        state = tmp_path / "state"
        started = time.monotonic()
        line = _one_line_error(_ubiq(state, "account", "login", "--server", srv.url, "--token", token))
        assert "http://" in line and "--insecure-http" in line and ip in line, line
        assert not (state / "account.json").exists()
        assert time.monotonic() - started < 30
        cp = _ubiq(state, "account", "login", "--server", srv.url, "--token", token, "--insecure-http")
        assert cp.returncode == 0, cp
        cfg = json.loads((state / "account.json").read_text())
        assert cfg["insecureHTTP"] is True
        st = _ubiq(state, "account", "status", "--json")
        assert json.loads(st.stdout)["reachable"] is True, st.stdout
    finally:
        srv.stop()


def test_postgres_verify_full_with_a_root_certificate(request, tmp_path):
    """`--postgres-sslmode verify-full --postgres-ca FILE`: the server's storage connection is
    TLS, verified against that CA and the host name; a wrong CA or a plain-text-only server
    is refused with one line."""
    if "scale" not in os.environ.get("UBIQFS_TEST_ENGINES", "embedded,scale").split(","):
        pytest.skip("the scale engine is not selected (UBIQFS_TEST_ENGINES)")
    stack = request.getfixturevalue("scale_stack")
    tls = TlsFiles(tmp_path / "pg-tls")
    pg = PostgresCluster(tls=tls).start()
    try:
        base = f"postgres://postgres@127.0.0.1:{pg.port}/ubiq"
        storage = ScaleStorage(pg, stack.s3, bucket="ubiq-pgtls")
        plain = [a if a != pg.url else base for a in storage.args()]
        verified = [*plain, "--postgres-sslmode", "verify-full", "--postgres-ca", str(tls.ca)]
        token = run_cli("server", "account", "create", "pgtls", *verified, env_extra=storage.env()).stdout.strip()
        assert token.startswith("ubq_")
        # The server's connections really are TLS: PostgreSQL's own view of its sessions says so.
        class Verified:
            def args(self):
                return verified

            def env(self):
                return storage.env()

        srv = ServerProcess(Verified(), tmp_path / "serve-pgtls.log").start()
        try:
            assert Api(srv.url, token).get("/v1/account").json()["account"] == "pgtls"
            probe = subprocess.run(
                [f"{PostgresCluster.bindir()}/psql", f"{base}?sslmode=disable", "-At", "-c",
                 "SELECT s.ssl, count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
                 "WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid() GROUP BY s.ssl"],
                capture_output=True, text=True, timeout=30)
            assert probe.returncode == 0, probe
            assert probe.stdout.strip().splitlines() and all(
                line.startswith("t|") for line in probe.stdout.strip().splitlines()), probe.stdout
        finally:
            srv.stop()
        # Another CA: the certificate does not verify.
        other = TlsFiles(tmp_path / "other-ca")
        bad = run_cli("server", "account", "list", *plain, "--postgres-sslmode", "verify-full", "--postgres-ca",
                      str(other.ca), env_extra=storage.env(), check=False)
        line = _one_line_error(bad)
        assert "PostgreSQL" in line and "TLS" in line, line
        # A mode that does not exist.
        bad = run_cli("server", "account", "list", *plain, "--postgres-sslmode", "sometimes",
                      env_extra=storage.env(), check=False)
        assert bad.returncode != 0 and "sslmode" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad
    finally:
        pg.stop()
    # A server without TLS: verify-full refuses to go on in plain text.
    plain_pg = stack.pg
    args = [a if a != plain_pg.url else f"postgres://postgres@127.0.0.1:{plain_pg.port}/ubiq"
            for a in stack.storage().args()]
    bad = run_cli("server", "account", "list", *args, "--postgres-sslmode", "verify-full", "--postgres-ca",
                  str(tls.ca), env_extra=stack.storage().env(), check=False)
    _one_line_error(bad)
