"""Resource limits on both engines: unreferenced chunks are garbage-collected (`ubiqfs server gc`,
and every --gc-interval inside `serve`) without touching a chunk any item still refers to;
item records count against the quota; containers per account, items per container, long-polls
per token and the bytes of a change page are bounded, each with a clear error."""

from __future__ import annotations

import base64
import http.client
import json
import os
import threading
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
    assert api.chunk_bytes() == sum(map(len, (kept, first, second, orphan, deleted)))

    # With the default grace (24 h) nothing just used goes.
    assert gc(storage, "24h")[api.account] == {"account": api.account, "chunks": 0, "bytes": 0, "undeleted": 0}
    time.sleep(1.1)  # grace 0 keeps what was used within the current second
    freed = gc(storage)[api.account]

    assert freed == {"account": api.account, "chunks": 3, "bytes": len(first) + len(orphan) + len(deleted),
                     "undeleted": 0}
    assert api.chunk_bytes() == len(kept) + len(second)
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
    assert api.chunk_bytes() == len(kept) + len(second) + len(orphan)


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
        assert api.get("/v1/usage").json()["usedBytes"] == 0  # no item: no metadata either
        assert not blob_exists(storage, api.account, sha(orphan))
    finally:
        srv.stop()
    assert "garbage collection" in (tmp_path / "serve-gc.log").read_text()


def test_item_records_count_against_the_quota_and_deleting_frees_them(new_account):
    api = new_account(quota="40K")
    api.ensure_container(C)
    assert api.get("/v1/usage").json() == {"usedBytes": 0, "quotaBytes": 40 * 1024, "metadataBytes": 0}
    note = {"note": base64.b64encode(os.urandom(15_000)).decode()}  # 15 KB of extended attributes
    r = api.put(f"{CQ}/items/m1", folder("m1") | {"xattrs": note})
    assert r.status == 201, r
    first = r.json()
    usage = api.get("/v1/usage").json()
    # 512 bytes per item plus the record as stored (the attribute is base64 in the record).
    assert 512 + 20_000 <= usage["metadataBytes"] <= 512 + 21_000, usage
    assert usage["usedBytes"] == usage["metadataBytes"]
    # A second one does not fit: refused like a chunk past the quota, nothing stored.
    body = error(api.put(f"{CQ}/items/m2", folder("m2") | {"xattrs": note}), 507, "quota_exceeded")
    assert body["errno"] == "EDQUOT" and body["usage"] == usage, body
    assert api.get(f"{CQ}/items/m2").status == 404
    # Deleting frees the record's cost (a tombstone is free); then it fits.
    assert api.delete(f"{CQ}/items/m1?device=dev-test", headers={"If-Match": f'"{first["etag"]}"'}).status == 200
    assert api.get("/v1/usage").json()["metadataBytes"] == 0
    assert api.put(f"{CQ}/items/m2", folder("m2") | {"xattrs": note}).status == 201


def folder(item_id: str) -> dict:
    return item(item_id, item_id, kind=2) | {"mode": 0o755}


def test_containers_items_and_change_pages_are_limited(storage, new_account, tmp_path):
    srv = ServerProcess(storage, tmp_path / "serve-limits.log",
                        extra=["--max-containers", "2", "--max-items-per-container", "5", "--max-change-page", "1K"])
    try:
        srv.start()
        api = new_account(srv=srv)
        api.ensure_container(C)
        api.ensure_container("iCloud.com.example.second")
        body = error(api.put(f"/v1/containers/{api.q('iCloud.com.example.third')}"), 507, "limit_exceeded")
        assert body["errno"] == "EDQUOT" and "containers" in body["error"], body
        api.ensure_container(C)  # an existing one is no new one
        # Root and Documents count: three more fit.
        etags = {}
        for name in ("a", "b", "c"):
            r = api.put(f"{CQ}/items/{name}", folder(name))
            assert r.status == 201, r
            etags[name] = r.json()["etag"]
        body = error(api.put(f"{CQ}/items/d", folder("d")), 507, "limit_exceeded")
        assert "items" in body["error"], body
        renamed = folder("a") | {"name": "a2"}
        r = api.put(f"{CQ}/items/a", renamed, headers={"If-Match": f'"{etags["a"]}"'})
        assert r.status == 200, r  # a change adds no item
        assert api.delete(f"{CQ}/items/b?device=dev-test", headers={"If-Match": f'"{etags["b"]}"'}).status == 200
        assert api.put(f"{CQ}/items/d", folder("d")).status == 201
        # 1 KiB pages: several, in order, nothing lost, each at least one record.
        since, pages, seen = 0, 0, {}
        while True:
            page = api.get(f"{CQ}/changes?since={since}&limit=1000").json()
            pages += 1
            assert page["items"], page
            seen.update({i["itemID"]: i["changeSeq"] for i in page["items"]})
            since = page["token"]
            if not page["hasMore"]:
                break
        assert pages > 1
        assert set(seen) == {"root", "documents", "a", "b", "c", "d"} and since == max(seen.values())
    finally:
        srv.stop()


def test_long_polls_per_token_are_limited(storage, new_account, tmp_path):
    srv = ServerProcess(storage, tmp_path / "serve-polls.log", extra=["--max-long-polls-per-token", "2"])
    try:
        srv.start()
        api = new_account(srv=srv)
        api.ensure_container(C)
        token = api.get(f"{CQ}/changes?since=0").json()["token"]
        wait = f"{CQ}/changes/wait?since={token}&timeout=4000"
        results: list = []

        def poll():
            results.append(api.get(wait, timeout=30).status)

        waiting = [threading.Thread(target=poll) for _ in range(2)]
        for t in waiting:
            t.start()
        time.sleep(1.0)  # both are parked
        started = time.time()
        error(api.get(wait), 429, "too_many_requests")
        assert time.time() - started < 2, "the third long-poll was refused at once"
        # Another device of the account has its own allowance.
        other = api.with_token(api.post("/v1/devices", {"name": "tablet"}).json()["token"])
        assert other.get(f"{CQ}/changes/wait?since={token}&timeout=100").status == 200
        for t in waiting:
            t.join(timeout=30)
        assert results == [200, 200]
        # Once they are answered, the token may wait again.
        assert api.get(f"{CQ}/changes/wait?since={token}&timeout=100").status == 200
    finally:
        srv.stop()
