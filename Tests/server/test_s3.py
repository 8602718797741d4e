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
from test_api import error, sha
from ubiqstack import Api, ScaleStorage, ServerProcess, create_account

pytestmark = pytest.mark.skipif(
    "scale" not in os.environ.get("UBIQFS_TEST_ENGINES", "embedded,scale").split(","),
    reason="S3 tests need the scale engine",
)

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FlakyS3Proxy:
    """Forwards to the S3 gateway; answers the next `fail_next` requests (or all of them
    while `fail_all`) with 503 SlowDown. Records every request's method, path and headers."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
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
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

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

    def start(env: dict | None = None):
        proxy = FlakyS3Proxy(scale_stack.s3.s3_port)
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


def test_session_token_is_sent_and_signed(start_proxied):
    proxy, api = start_proxied({"UBIQFS_S3_SESSION_TOKEN": "ubiq-test-session-token"})
    data = os.urandom(1000)
    assert api.put(f"/v1/chunks/{sha(data)}", data).status == 201
    method, path, headers = proxy.requests[-1]
    assert headers["x-amz-security-token"] == "ubiq-test-session-token"
    assert "x-amz-security-token" in headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    assert headers["host"] == proxy.endpoint.removeprefix("http://")
