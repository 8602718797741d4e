"""Resource limits on both engines: unreferenced chunks are garbage-collected (`ubiqfs server gc`,
and every --gc-interval inside `serve`) without touching a chunk any item still refers to."""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from test_api import CQ, C, error, item, put_file, sha
from ubiqstack import S3_ACCESS_KEY, S3_SECRET_KEY, EmbeddedStorage, ServerProcess, run_cli


def blob_exists(storage, account: str, digest: str) -> bool:
    """Whether the chunk's bytes are still in the blob store (the folder, or the S3 bucket)."""
    if isinstance(storage, EmbeddedStorage):
        return (storage.data / "blobs" / account / digest[:2] / digest).exists()
    endpoint = urllib.parse.urlsplit(storage.s3.endpoint)
    path = f"/{storage.bucket}/{account}/{digest[:2]}/{digest}"
    req = AWSRequest(method="HEAD", url=f"{storage.s3.endpoint}{path}")
    req.headers["x-amz-content-sha256"] = sha(b"")
    S3SigV4Auth(Credentials(S3_ACCESS_KEY, S3_SECRET_KEY), "s3", "us-east-1").add_auth(req)
    conn = http.client.HTTPConnection(endpoint.hostname, endpoint.port, timeout=10)
    try:
        conn.request("HEAD", path, headers=dict(req.headers.items()))
        status = conn.getresponse().status
    finally:
        conn.close()
    assert status in (200, 404), f"S3 HEAD {path}: {status}"
    return status == 200


def gc(storage, grace: str = "0") -> dict[str, dict]:
    out = run_cli("server", "gc", "--grace", grace, "--json", *storage.args(), env_extra=storage.env())
    return {r["account"]: r for r in map(json.loads, out.stdout.splitlines())}


def test_gc_deletes_unreferenced_chunks_and_keeps_every_referenced_one(storage, api):
    api.ensure_container(C)
    kept, first, second, orphan, deleted = (os.urandom(3000 + i) for i in range(5))
    assert put_file(api, "k1", "kept.bin", kept).status == 201
    v1 = put_file(api, "r1", "rewritten.bin", first).json()
    assert put_file(api, "r1", "rewritten.bin", second, if_match=v1["etag"]).status == 200
    assert api.put(f"/v1/chunks/{sha(orphan)}", orphan).status == 201  # uploaded, never committed
    d1 = put_file(api, "d1", "deleted.bin", deleted).json()
    assert api.delete(f"{CQ}/items/d1?device=dev-test", headers={"If-Match": f'"{d1["etag"]}"'}).status == 200
    usage = api.get("/v1/usage").json()["usedBytes"]
    assert usage == sum(map(len, (kept, first, second, orphan, deleted)))

    # With the default grace (24 h) nothing just used goes.
    assert gc(storage, "24h")[api.account] == {"account": api.account, "chunks": 0, "bytes": 0}
    time.sleep(1.1)  # grace 0 keeps what was used within the current second
    freed = gc(storage)[api.account]

    assert freed == {"account": api.account, "chunks": 3, "bytes": len(first) + len(orphan) + len(deleted)}
    assert api.get("/v1/usage").json()["usedBytes"] == len(kept) + len(second)
    for gone in (first, orphan, deleted):
        error(api.get(f"/v1/chunks/{sha(gone)}"), 404, "not_found")
        assert not blob_exists(storage, api.account, sha(gone))
    for live in (kept, second):
        assert api.chunk(sha(live)) == live
        assert blob_exists(storage, api.account, sha(live))
    # A collected chunk is missing again, and can be uploaded and used again.
    assert api.post("/v1/chunks/missing", {"hashes": [sha(orphan), sha(kept)]}).json() == {"missing": [sha(orphan)]}
    error(api.put(f"{CQ}/items/o1", item("o1", "again.bin", orphan)), 422, "missing_chunks")
    assert put_file(api, "o1", "again.bin", orphan).status == 201
    assert api.chunk(sha(orphan)) == orphan
    assert api.get("/v1/usage").json()["usedBytes"] == len(kept) + len(second) + len(orphan)


def test_serve_collects_garbage_on_its_interval(storage, new_account, tmp_path):
    srv = ServerProcess(storage, tmp_path / "serve-gc.log", extra=["--gc-interval", "1s", "--gc-grace", "0"])
    try:
        srv.start()
        api = new_account(srv=srv)
        orphan = os.urandom(5000)
        assert api.put(f"/v1/chunks/{sha(orphan)}", orphan).status == 201
        deadline = time.time() + 20
        while api.get(f"/v1/chunks/{sha(orphan)}").status == 200 and time.time() < deadline:
            time.sleep(0.3)
        error(api.get(f"/v1/chunks/{sha(orphan)}"), 404, "not_found")
        assert api.get("/v1/usage").json()["usedBytes"] == 0
        assert not blob_exists(storage, api.account, sha(orphan))
    finally:
        srv.stop()
    assert "garbage collection" in (tmp_path / "serve-gc.log").read_text()
