"""The scale-out engine's S3 client against SeaweedFS through a pass-through proxy that can
answer `503 SlowDown` instead: transient S3 failures are retried with backoff, a store that
keeps failing surfaces as 503 `unavailable` within the retry policy's bounded total, and a
session token is sent (and signed) as `x-amz-security-token`. The proxy forwards the request
unchanged (Host included), so SeaweedFS checks the signature the server made for the proxy's
host:port."""

from __future__ import annotations

import http.client
import http.server
import os
import socketserver
import threading
import time

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from test_api import error, sha
from ubiqstack import S3_ACCESS_KEY, S3_SECRET_KEY, Api, ScaleStorage, ServerProcess, create_account

pytestmark = pytest.mark.skipif(
    "scale" not in os.environ.get("UBIQFS_TEST_ENGINES", "embedded,scale").split(","),
    reason="S3 tests need the scale engine",
)

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def botocore_signature(method: str, path: str, headers: dict, token: str | None) -> str:
    """The SigV4 signature botocore (an independent implementation) computes for the request
    as it arrived: its method, path, and the headers its Authorization lists as signed."""
    signed = headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    req = AWSRequest(method=method, url=f"http://{headers['host']}{path}", headers={h: headers[h] for h in signed})
    req.context["timestamp"] = headers["x-amz-date"]
    auth = S3SigV4Auth(Credentials(S3_ACCESS_KEY, S3_SECRET_KEY, token), "s3", "us-east-1")
    return auth.signature(auth.string_to_sign(req, auth.canonical_request(req)), req)


class CheckingS3:
    """A minimal S3 in memory (HEAD/PUT/GET of objects, HEAD of the bucket) that accepts a
    request only when it carries the expected session token and its signature is the one
    botocore computes for it; `bad` counts refusals."""

    def __init__(self, token: str | None):
        self.token = token
        self.bad = 0
        self.objects: dict[str, bytes] = {}

    def answer(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, bytes]:
        given = headers.get("authorization", "").split("Signature=")[-1]
        if headers.get("x-amz-security-token") != self.token or given != botocore_signature(
            method, path, headers, self.token
        ):
            self.bad += 1
            return 403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>"
        if method == "PUT":
            self.objects[path] = body
            return 200, b""
        if path in self.objects:
            return 200, self.objects[path] if method == "GET" else b""
        return (200, b"") if path.count("/") <= 2 and method == "HEAD" else (404, b"")


class FlakyS3Proxy:
    """Forwards to the S3 gateway; answers the next `fail_next` requests (or all of them
    while `fail_all`) with 503 SlowDown. Records every request's method, path and headers."""

    def __init__(self, upstream_port: int, store: CheckingS3 | None = None, base_path: str = ""):
        self.upstream_port = upstream_port
        self.store = store
        self.base_path = base_path
        self.fail_next = 0
        self.fail_all = False
        self.slowdowns = 0
        self.requests: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                    fail = proxy.fail_all or proxy.fail_next > 0
                    if fail:
                        proxy.fail_next = max(0, proxy.fail_next - 1)
                        proxy.slowdowns += 1
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOWDOWN)
                    return
                if proxy.store is not None:
                    status, data = proxy.store.answer(
                        self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body
                    )
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                c = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                c.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    c.putheader(k, v)
                c.endheaders(body if body else None)
                r = c.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = r.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                c.close()

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{self.base_path}"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class ProxiedStorage(ScaleStorage):
    """The scale stack's storage with S3 reached through the proxy, plus extra environment."""

    def __init__(self, base: ScaleStorage, proxy: FlakyS3Proxy, env: dict | None = None):
        super().__init__(base.pg, proxy, base.bucket)
        self.extra_env = env or {}

    def env(self) -> dict:
        return {**super().env(), **self.extra_env}


@pytest.fixture
def start_proxied(scale_stack, tmp_path):
    """start(env) -> (proxy, api): a server whose S3 traffic goes through a FlakyS3Proxy, with
    `env` added to its environment; all stopped at teardown."""
    started: list[tuple[ServerProcess, FlakyS3Proxy]] = []

    def start(env: dict | None = None, store: CheckingS3 | None = None, base_path: str = ""):
        proxy = FlakyS3Proxy(scale_stack.s3.s3_port, store, base_path)
        storage = ProxiedStorage(scale_stack.storage(), proxy, env)
        srv = ServerProcess(storage, tmp_path / f"serve-{len(started)}.log")
        started.append((srv, proxy))
        srv.start()
        return proxy, Api(srv.url, create_account(storage, f"s3-{os.urandom(5).hex()}"))

    try:
        yield start
    finally:
        for srv, proxy in started:
            srv.stop()
            proxy.stop()


@pytest.fixture
def flaky(start_proxied):
    return start_proxied()


def test_slowdown_is_retried(flaky):
    proxy, api = flaky
    data = os.urandom(100_000)
    h = sha(data)
    proxy.fail_next = 3
    assert api.put(f"/v1/chunks/{h}", data).status == 201
    assert proxy.slowdowns == 3
    proxy.fail_next = 2
    assert api.get(f"/v1/chunks/{h}").body == data
    assert proxy.slowdowns == 5


def test_a_store_that_keeps_failing_is_unavailable_within_the_bound(flaky):
    proxy, api = flaky
    data = os.urandom(1000)
    proxy.fail_all = True
    before = len(proxy.requests)
    start = time.monotonic()
    error(api.put(f"/v1/chunks/{sha(data)}", data), 503, "unavailable")
    elapsed = time.monotonic() - start
    tries = len(proxy.requests) - before
    # One S3 request, tried 5 times with waits of at most 0.1 + 0.2 + 0.4 + 0.8 s.
    assert tries == 5, proxy.requests[before:]
    assert elapsed < 10
    proxy.fail_all = False
    assert api.put(f"/v1/chunks/{sha(data)}", data).status == 201


def test_base_path_port_and_session_token_are_signed_as_sent(start_proxied):
    """SeaweedFS takes no base path and checks session tokens against its own STS, so this
    S3 is the in-memory one: every request must carry the signature botocore computes."""
    token = "ubiq-test-session-token"
    store = CheckingS3(token)
    proxy, api = start_proxied({"UBIQFS_S3_SESSION_TOKEN": token}, store, "/base/s3")
    data = os.urandom(1000)
    assert api.put(f"/v1/chunks/{sha(data)}", data).status == 201
    assert api.get(f"/v1/chunks/{sha(data)}").body == data
    assert store.bad == 0
    assert len(proxy.requests) >= 3
    for method, path, headers in proxy.requests:
        assert path.startswith("/base/s3/ubiq"), path
        assert headers["host"] == f"127.0.0.1:{proxy.httpd.server_address[1]}"
        assert headers["x-amz-security-token"] == token
        signed = headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
        assert {"host", "x-amz-security-token"} <= set(signed)
    # What the check would refuse: the same request signed without the base path or the port.
    method, path, headers = proxy.requests[-1]
    given = headers["authorization"].split("Signature=")[-1]
    assert botocore_signature(method, path, headers, token) == given
    assert botocore_signature(method, path.removeprefix("/base/s3"), headers, token) != given
    assert botocore_signature(method, path, dict(headers, host="127.0.0.1"), token) != given
