"""The HTTP API of `ubiqfs serve` (docs/protocol.md) on both engines: auth, items with etags,
chunks, the change feed and push channel, isolation, bad input, quota, key-value store,
several servers over one store, metrics and graceful shutdown."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import pytest
from conftest import unique
from ubiqstack import Api, create_account, run_cli

C = "iCloud.com.example.notes"
CQ = f"/v1/containers/{C}"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def item(item_id: str, name: str, data: bytes = b"", parent: str = "documents", kind: int = 1, **extra) -> dict:
    rec = {
        "itemID": item_id, "parentID": parent, "name": name, "kind": kind, "mode": 0o644, "size": len(data),
        "mtimeNs": time.time_ns(), "xattrs": {}, "chunks": [{"hash": sha(data), "length": len(data)}] if data else [],
        "etag": "", "deleted": False, "changeSeq": 0, "deviceID": "dev-test",
    }
    rec.update(extra)
    return rec


def put_file(api: Api, item_id: str, name: str, data: bytes, if_match: str | None = None, container: str = C):
    r = api.put(f"/v1/chunks/{sha(data)}", data)
    assert r.status in (200, 201), r
    headers = {"If-Match": f'"{if_match}"'} if if_match else {}
    return api.put(f"/v1/containers/{container}/items/{item_id}", item(item_id, name, data), headers=headers)


def error(r, status: int, code: str):
    assert r.status == status, r
    body = r.json()
    assert body["code"] == code, body
    assert body["error"], body
    return body


# ---------------------------------------------------------------------------- auth


def test_health_and_metrics_need_no_token(server):
    a = Api(server.url)
    assert a.get("/healthz").status == 200
    assert a.get("/v1/usage").status == 401
    r = a.get("/metrics")
    assert r.status == 200
    text = r.body.decode()
    assert "ubiq_chunk_bytes_uploaded_total" in text
    assert "http_server_request_duration" in text
    failures = [ln for ln in text.splitlines() if ln.startswith("ubiq_auth_failures_total ")]
    assert failures and float(failures[0].split()[1]) >= 1


def test_missing_bad_and_revoked_tokens_get_401(storage, server, api):
    anon = Api(server.url)
    error(anon.get("/v1/account"), 401, "unauthorized")
    assert "bearer" in anon.get("/v1/account").headers.get("www-authenticate", "").lower()
    error(anon.with_token("ubq_" + "0" * 64).get("/v1/account"), 401, "unauthorized")
    error(anon.get("/v1/account", headers={"Authorization": "Basic Zm9vOmJhcg=="}), 401, "unauthorized")
    me = api.get("/v1/account").json()
    assert me["account"] == api.account
    # A device token from the API, revoked by itself.
    r = api.post("/v1/devices", {"name": "phone"})
    assert r.status == 201, r
    phone = api.with_token(r.json()["token"])
    assert phone.get("/v1/account").json()["device"] == "phone"
    assert phone.delete("/v1/devices/current").status == 200
    error(phone.get("/v1/account"), 401, "unauthorized")
    # The admin CLI revokes every token of a device; other devices keep working.
    r = api.post("/v1/devices", {"name": "tablet"})
    tablet = api.with_token(r.json()["token"])
    assert tablet.get("/v1/usage").status == 200
    run_cli("server", "token", "revoke", api.account, "--device", "tablet", *storage.args(), env_extra=storage.env())
    error(tablet.get("/v1/usage"), 401, "unauthorized")
    assert api.get("/v1/usage").status == 200
    devices = {d["device"]: d["revoked"] for d in api.get("/v1/devices").json()["devices"]}
    assert devices == {"setup": False, "phone": True, "tablet": True}


# ---------------------------------------------------------------------------- items


def test_items_etags_if_match_and_conflicts(api):
    assert api.ensure_container(C)["token"] == 2  # root and Documents
    r = put_file(api, "n1", "note.txt", b"version 1")
    assert r.status == 201, r
    v1 = r.json()
    assert r.headers["etag"] == f'"{v1["etag"]}"'
    # Creating it again without If-Match is a conflict carrying the server record.
    body = error(put_file(api, "n1", "note.txt", b"other"), 409, "conflict")
    assert body["current"]["etag"] == v1["etag"]
    v2 = put_file(api, "n1", "note.txt", b"version 2", if_match=v1["etag"]).json()
    assert v2["etag"] != v1["etag"]
    # A stale etag: 409 with the current record (so the client can keep a conflict version).
    body = error(put_file(api, "n1", "note.txt", b"version 3", if_match=v1["etag"]), 409, "conflict")
    assert body["current"]["etag"] == v2["etag"]
    assert body["current"]["chunks"][0]["hash"] == sha(b"version 2")
    got = api.get(f"{CQ}/items/n1")
    assert got.status == 200 and got.json()["etag"] == v2["etag"]
    # An item whose chunks were never uploaded.
    body = error(api.put(f"{CQ}/items/n2", item("n2", "x.bin", b"never uploaded")), 422, "missing_chunks")
    assert body["missing"] == [sha(b"never uploaded")]
    # Delete with a stale etag conflicts; with the right one leaves a tombstone.
    error(api.delete(f"{CQ}/items/n1", headers={"If-Match": f'"{v1["etag"]}"'}), 409, "conflict")
    r = api.delete(f"{CQ}/items/n1?device=dev-test", headers={"If-Match": f'"{v2["etag"]}"'})
    assert r.status == 200 and r.json()["deleted"] is True
    feed = api.get(f"{CQ}/changes?since=2").json()
    assert [(i["itemID"], i["deleted"]) for i in feed["items"]] == [("n1", True)]
    tombstone = feed["items"][0]
    # A version with no If-Match was made before the delete (a retried or late first upload):
    # it does not bring the item back; with the tombstone's etag it does, and a delete of the
    # tombstone needs no etag.
    body = error(put_file(api, "n1", "note.txt", b"version 1"), 409, "conflict")
    assert body["current"]["etag"] == tombstone["etag"] and body["current"]["deleted"] is True
    assert api.get(f"{CQ}/items/n1").json()["deleted"] is True
    back = put_file(api, "n1", "note.txt", b"edited after all", if_match=tombstone["etag"])
    assert back.status == 200 and back.json()["deleted"] is False, back
    gone = api.delete(f"{CQ}/items/n1?device=dev-test", headers={"If-Match": f'"{back.json()["etag"]}"'})
    assert gone.status == 200
    assert api.delete(f"{CQ}/items/n1?device=dev-test").status == 200
    # The root cannot be written or deleted; unknown items are 404.
    error(api.delete(f"{CQ}/items/documents"), 400, "invalid")
    # An item the cloud has not seen: with an etag, 404; without one, its tombstone is recorded
    # (its first upload may still be on its way), and that upload, which has no etag, is refused.
    error(api.delete(f"{CQ}/items/never", headers={"If-Match": '"5"'}), 404, "not_found")
    r = api.delete(f"{CQ}/items/never?device=dev-test")
    assert r.status == 200 and r.json()["deleted"] is True and r.json()["deviceID"] == "dev-test", r
    assert api.delete(f"{CQ}/items/never?device=dev-test").json()["etag"] == r.json()["etag"]
    body = error(put_file(api, "never", "late.txt", b"sent before the delete"), 409, "conflict")
    assert body["current"]["deleted"] is True
    error(api.get(f"{CQ}/items/nope"), 404, "not_found")
    # A container that does not exist: nothing stored, no changes to read or wait for (an
    # empty feed would tell a client it is up to date with a container no one made).
    error(api.put("/v1/containers/iCloud.com.example.other/items/x", item("x", "x", b"")), 404, "not_found")
    error(api.get("/v1/containers/iCloud.com.example.other/changes?since=0"), 404, "not_found")
    error(api.get("/v1/containers/iCloud.com.example.other/changes/wait?since=0&timeout=0"), 404, "not_found")
    error(api.get("/v1/containers/iCloud.com.example.other/changes/wait?since=0&timeout=100"), 404, "not_found")


def test_a_batch_of_versions_commits_in_order_and_stops_at_the_first_refused(api):
    api.ensure_container(C)
    v1 = put_file(api, "b0", "old.txt", b"v1").json()
    put_file(api, "b0", "old.txt", b"v2", if_match=v1["etag"])
    assert api.put(f"/v1/chunks/{sha(b'new')}", b"new").status in (200, 201)
    puts = [
        {"item": item("bf", "folder", kind=2), "ifMatch": None},
        # A file in the folder the same batch creates.
        {"item": item("b1", "in-folder.txt", b"new", parent="bf")},
        # Based on a stale etag: refused, with the current record, as a PUT would be.
        {"item": item("b0", "old.txt", b"new"), "ifMatch": v1["etag"]},
        {"item": item("b2", "after.txt", b"new")},
    ]
    r = api.post(f"{CQ}/items", {"puts": puts})
    assert r.status == 200, r
    body = r.json()
    assert [i["itemID"] for i in body["committed"]] == ["bf", "b1"]
    seqs = [i["changeSeq"] for i in body["committed"]]
    assert seqs[1] == seqs[0] + 1
    refused = body["refused"]
    assert (refused["status"], refused["code"]) == (409, "conflict"), refused
    assert refused["current"]["chunks"][0]["hash"] == sha(b"v2") and refused["error"]
    # Nothing after the refused version was stored, and the refused one is unchanged.
    error(api.get(f"{CQ}/items/b2"), 404, "not_found")
    assert api.get(f"{CQ}/items/b0").json()["chunks"][0]["hash"] == sha(b"v2")
    feed = api.get(f"{CQ}/changes?since={seqs[0] - 1}").json()
    assert [i["itemID"] for i in feed["items"]] == ["bf", "b1"]
    # Every refusal a single PUT knows comes back with its status and code, after the versions
    # before it: a taken name, a missing parent, a cycle, chunks never uploaded, a bad id.
    folder_etag = body["committed"][0]["etag"]
    assert api.put(f"{CQ}/items/bc", item("bc", "child", kind=2, parent="bf")).status == 201
    cases = [
        ({"item": item("b3", "folder", kind=2)}, 409, "name_taken"),
        ({"item": item("b4", "x", kind=2, parent="nowhere")}, 409, "bad_parent"),
        ({"item": item("bf", "folder", kind=2, parent="bc"), "ifMatch": folder_etag}, 409, "cycle"),
        ({"item": item("b5", "x.bin", b"never uploaded")}, 422, "missing_chunks"),
        ({"item": item("bad id", "x", kind=2)}, 400, "invalid_id"),
        ({"item": item("b6", "a/b", kind=2)}, 400, "invalid"),
    ]
    for n, (put, status, code) in enumerate(cases):
        ok = item(f"ok{n}", f"ok{n}", kind=2)
        body = api.post(f"{CQ}/items", {"puts": [{"item": ok}, put]}).json()
        assert [i["itemID"] for i in body["committed"]] == [f"ok{n}"], (code, body)
        assert (body["refused"]["status"], body["refused"]["code"]) == (status, code), body
    # A batch with nothing refused has no refusal.
    body = api.post(f"{CQ}/items", {"puts": [{"item": item("b7", "b7", kind=2)}]}).json()
    assert [i["itemID"] for i in body["committed"]] == ["b7"] and body.get("refused") is None
    # A request that is wrong as a whole stores nothing.
    error(api.post(f"{CQ}/items", b'{"puts": [1,'), 400, "bad_json")
    error(api.post(f"{CQ}/items", {"versions": []}), 400, "bad_json")
    many = [{"item": item(f"m{i}", f"m{i}", kind=2)} for i in range(1001)]
    error(api.post(f"{CQ}/items", {"puts": many}), 400, "invalid")
    error(api.get(f"{CQ}/items/m0"), 404, "not_found")
    error(api.post("/v1/containers/iCloud.com.example.other/items", {"puts": puts[:1]}), 404, "not_found")


def test_a_batch_of_deletes_goes_in_order_and_stops_at_the_first_refused(api):
    api.ensure_container(C)
    puts = [{"item": item("df", "dfolder", kind=2)}, {"item": item("d1", "d1", parent="df")}]
    puts += [{"item": item("d2", "d2", parent="df")}, {"item": item("d3", "d3")}, {"item": item("d4", "d4")}]
    etags = {i["itemID"]: i["etag"] for i in api.post(f"{CQ}/items", {"puts": puts}).json()["committed"]}
    d4 = api.put(f"{CQ}/items/d4", item("d4", "d4", mode=0o600), headers={"If-Match": f'"{etags["d4"]}"'}).json()

    def deletes(*ids, etag=None):
        return {"deletes": [{"itemID": i, "ifMatch": etag or etags[i]} for i in ids]}

    # A folder's files, then the folder, in one batch; then a delete based on a stale etag,
    # refused as a single DELETE would be, and nothing after it.
    r = api.post(f"{CQ}/deletes?device=dev-b", deletes("d1", "d2", "df", "d4", "d3"))
    assert r.status == 200, r
    body = r.json()
    assert [(i["itemID"], i["deleted"], i["deviceID"]) for i in body["committed"]] == [
        ("d1", True, "dev-b"), ("d2", True, "dev-b"), ("df", True, "dev-b")]
    seqs = [i["changeSeq"] for i in body["committed"]]
    assert seqs == [seqs[0], seqs[0] + 1, seqs[0] + 2]
    refused = body["refused"]
    assert (refused["status"], refused["code"]) == (409, "conflict"), refused
    assert refused["current"]["etag"] == d4["etag"] and refused["current"]["deleted"] is False
    assert api.get(f"{CQ}/items/d3").json()["deleted"] is False
    feed = api.get(f"{CQ}/changes?since={seqs[0] - 1}").json()
    assert [(i["itemID"], i["deleted"]) for i in feed["items"]] == [("d1", True), ("d2", True), ("df", True)]
    # Sent again (a lost reply): what is already deleted answers its tombstone and writes nothing.
    body = api.post(f"{CQ}/deletes", deletes("d1", "d3")).json()
    assert [(i["itemID"], i["deleted"]) for i in body["committed"]] == [("d1", True), ("d3", True)]
    assert body["committed"][0]["changeSeq"] == seqs[0] and body.get("refused") is None
    # The same item twice in one batch (a client's queue that holds a repeat): the second is a
    # delete of what is deleted by then, which answers its tombstone, as a second DELETE does.
    twice = api.put(f"{CQ}/items/d5", item("d5", "d5")).json()
    body = api.post(f"{CQ}/deletes", deletes("d5", "d5", etag=twice["etag"])).json()
    assert body.get("refused") is None, body
    assert [(i["itemID"], i["deleted"]) for i in body["committed"]] == [("d5", True), ("d5", True)]
    assert body["committed"][0]["changeSeq"] == body["committed"][1]["changeSeq"]
    # Every refusal a single DELETE knows, after the deletes before it.
    assert api.put(f"{CQ}/items/ne", item("ne", "ne", kind=2)).status == 201
    child = api.put(f"{CQ}/items/nc", item("nc", "nc", parent="ne")).json()
    etags["ne"] = api.get(f"{CQ}/items/ne").json()["etag"]
    cases = [
        ("ne", etags["ne"], 409, "not_empty"),
        ("nowhere", "1", 404, "not_found"),
        ("documents", "2", 400, "invalid"),
        ("bad id", "1", 400, "invalid_id"),
    ]
    for n, (item_id, etag, status, code) in enumerate(cases):
        ok = api.put(f"{CQ}/items/ok-del{n}", item(f"ok-del{n}", f"ok-del{n}")).json()
        batch = {"deletes": [{"itemID": ok["itemID"], "ifMatch": ok["etag"]}, {"itemID": item_id, "ifMatch": etag}]}
        body = api.post(f"{CQ}/deletes", batch).json()
        assert [i["itemID"] for i in body["committed"]] == [f"ok-del{n}"], (code, body)
        assert (body["refused"]["status"], body["refused"]["code"]) == (status, code), body
        # A folder that is not empty names an item that keeps it (the client waits for its own
        # queued change of that item, or brings the folder back).
        assert body["refused"].get("blockingItem") == ("nc" if code == "not_empty" else None), body
    assert api.get(f"{CQ}/items/nc").json()["etag"] == child["etag"]
    # A request that is wrong as a whole deletes nothing.
    one = {"deletes": [{"itemID": "nc", "ifMatch": child["etag"]}]}
    error(api.post(f"{CQ}/deletes", b'{"deletes": [1,'), 400, "bad_json")
    error(api.post(f"{CQ}/deletes", {"deletes": [{"itemID": "nc"}]}), 400, "bad_json")
    error(api.post(f"{CQ}/deletes", {"deletes": [{"itemID": 7, "ifMatch": "1"}]}), 400, "bad_json")
    many = {"deletes": [{"itemID": "nc", "ifMatch": child["etag"]}] * 1001}
    error(api.post(f"{CQ}/deletes", many), 400, "invalid")
    error(api.post(f"{CQ}/deletes?device={'x' * 129}", one), 400, "invalid")
    error(api.post("/v1/containers/iCloud.com.example.other/deletes", one), 404, "not_found")
    assert api.get(f"{CQ}/items/nc").json()["deleted"] is False


def test_a_settled_name_is_stored_on_the_version_it_was_sent_with_only(api):
    """`settledNameOf` (the etag of the version a write differs from only by a name the writing
    device's sync chose) is stored and read back by each engine's metadata store: one record,
    the change feed, a refused delete's answer (single and batched), a batch of versions. It is
    kept only when it is the etag the write is based on, never carried over to a later version,
    and a tombstone has none."""
    api.ensure_container(C)
    data = b"settled"
    v1 = put_file(api, "s1", "s.txt", data).json()
    assert v1.get("settledNameOf") is None

    def put_version(name: str, if_match: str, **extra):
        r = api.put(f"{CQ}/items/s1", item("s1", name, data, **extra), headers={"If-Match": f'"{if_match}"'})
        assert r.status in (200, 201), r
        return r.json()

    v2 = put_version("s 2.txt", v1["etag"], settledNameOf=v1["etag"])
    assert v2["settledNameOf"] == v1["etag"]
    assert api.get(f"{CQ}/items/s1").json()["settledNameOf"] == v1["etag"]
    feed = api.get(f"{CQ}/changes?since=2").json()
    assert [i.get("settledNameOf") for i in feed["items"] if i["itemID"] == "s1"] == [v1["etag"]]
    body = error(api.delete(f"{CQ}/items/s1", headers={"If-Match": f'"{v1["etag"]}"'}), 409, "conflict")
    assert body["current"]["settledNameOf"] == v1["etag"]
    refused = api.post(f"{CQ}/deletes", {"deletes": [{"itemID": "s1", "ifMatch": v1["etag"]}]}).json()["refused"]
    assert refused["code"] == "conflict" and refused["current"]["settledNameOf"] == v1["etag"], refused
    # Another etag than the one the write is based on: not stored.
    v3 = put_version("s 3.txt", v2["etag"], settledNameOf=v1["etag"])
    assert v3.get("settledNameOf") is None
    assert api.get(f"{CQ}/items/s1").json().get("settledNameOf") is None
    # In a batch.
    puts = [{"item": item("s1", "s 4.txt", data, settledNameOf=v3["etag"]), "ifMatch": v3["etag"]}]
    v4 = api.post(f"{CQ}/items", {"puts": puts}).json()["committed"][0]
    assert v4["settledNameOf"] == v3["etag"]
    assert api.get(f"{CQ}/items/s1").json()["settledNameOf"] == v3["etag"]
    # A version that does not send it has none: it is not inherited.
    v5 = put_version("s 4.txt", v4["etag"])
    assert v5.get("settledNameOf") is None
    assert api.get(f"{CQ}/items/s1").json().get("settledNameOf") is None
    error(
        api.put(f"{CQ}/items/s1", item("s1", "s.txt", data, settledNameOf="x" * 129),
                headers={"If-Match": f'"{v5["etag"]}"'}), 400, "invalid")
    v6 = put_version("s 5.txt", v5["etag"], settledNameOf=v5["etag"])
    assert v6["settledNameOf"] == v5["etag"]
    gone = api.delete(f"{CQ}/items/s1?device=dev-test", headers={"If-Match": f'"{v6["etag"]}"'}).json()
    assert gone["deleted"] is True and gone.get("settledNameOf") is None
    assert api.get(f"{CQ}/items/s1").json().get("settledNameOf") is None
    feed = api.get(f"{CQ}/changes?since={v5['changeSeq']}").json()
    assert [(i["deleted"], i.get("settledNameOf")) for i in feed["items"]] == [(True, None)]


def test_a_batch_refused_by_the_quota_stores_nothing_of_the_refused_version(new_account):
    api = new_account(quota="2K")
    api.ensure_container(C)
    # Each live record costs 512 bytes plus its JSON: the third or fourth folder goes past 2K.
    puts = [{"item": item(f"q{i}", f"q{i}", kind=2)} for i in range(6)]
    body = api.post(f"{CQ}/items", {"puts": puts}).json()
    stored = [i["itemID"] for i in body["committed"]]
    assert 1 <= len(stored) < 6, body
    assert (body["refused"]["status"], body["refused"]["code"]) == (507, "quota_exceeded"), body
    usage = api.get("/v1/usage").json()
    assert usage["metadataBytes"] <= 2 * 1024, usage
    feed = api.get(f"{CQ}/changes?since=2").json()
    assert [i["itemID"] for i in feed["items"]] == stored
    error(api.get(f"{CQ}/items/q{len(stored)}"), 404, "not_found")


def test_change_feed_pages_and_tokens(api):
    api.ensure_container(C)
    for i in range(7):
        assert api.put(f"{CQ}/items/d{i}", item(f"d{i}", f"dir{i}", kind=2)).status == 201
    seen, since, pages = [], 0, 0
    while True:
        page = api.get(f"{CQ}/changes?since={since}&limit=3").json()
        seen += [i["itemID"] for i in page["items"]]
        since, pages = page["token"], pages + 1
        if not page["hasMore"]:
            break
    assert seen == ["root", "documents"] + [f"d{i}" for i in range(7)]
    assert pages == 3 and since == 9
    assert api.get(f"{CQ}/changes?since=9").json() == {"items": [], "token": 9, "hasMore": False}
    assert sorted(api.get("/v1/containers").json()["containers"]) == [C]


# ---------------------------------------------------------------------------- chunks


def test_chunks_hash_verification_range_and_missing(api):
    data = os.urandom(200_000)
    h = sha(data)
    assert api.post("/v1/chunks/missing", {"hashes": [h, sha(b"x")]}).json() == {"missing": [h, sha(b"x")]}
    error(api.put(f"/v1/chunks/{h}", data[:-1] + b"\0"), 422, "hash_mismatch")
    error(api.put(f"/v1/chunks/{h.upper()}", data), 400, "invalid_hash")
    error(api.put("/v1/chunks/abc", data), 400, "invalid_hash")
    assert api.put(f"/v1/chunks/{h}", data).status == 201
    assert api.put(f"/v1/chunks/{h}", data).status == 201  # idempotent
    assert api.post("/v1/chunks/missing", {"hashes": [h, sha(b"x")]}).json() == {"missing": [sha(b"x")]}
    assert api.get(f"/v1/chunks/{h}").body == data
    r = api.get(f"/v1/chunks/{h}", headers={"Range": "bytes=1000-1999"})
    assert r.status == 206 and r.body == data[1000:2000]
    assert r.headers["content-range"] == f"bytes 1000-1999/{len(data)}"
    r = api.get(f"/v1/chunks/{h}", headers={"Range": "bytes=199990-"})
    assert r.status == 206 and r.body == data[199990:]
    r = api.get(f"/v1/chunks/{h}", headers={"Range": "bytes=-5"})
    assert r.status == 206 and r.body == data[-5:]
    r = api.get(f"/v1/chunks/{h}", headers={"Range": "bytes=150000-999999"})
    assert r.status == 206 and r.body == data[150000:]
    r = api.get(f"/v1/chunks/{h}", headers={"Range": f"bytes={len(data)}-"})
    assert r.status == 416 and r.headers["content-range"] == f"bytes */{len(data)}"
    r = api.request("HEAD", f"/v1/chunks/{h}")
    assert r.status == 200 and r.headers["content-length"] == str(len(data))
    error(api.get(f"/v1/chunks/{sha(b'unknown')}"), 404, "not_found")
    assert api.chunk_bytes() == len(data)


# ---------------------------------------------------------------------------- isolation


def test_accounts_never_see_each_other(new_account):
    alice, bob = new_account(), new_account()
    alice.ensure_container(C)
    secret = b"alice's secret " + os.urandom(64)
    assert put_file(alice, "s1", "secret.txt", secret).status == 201
    h = sha(secret)
    # Bob knows the container id, the item id and the hash: he still gets nothing.
    error(bob.get(f"/v1/chunks/{h}"), 404, "not_found")
    assert bob.request("HEAD", f"/v1/chunks/{h}").status == 404
    error(bob.get(f"/v1/chunks/{h}", headers={"Range": "bytes=0-3"}), 404, "not_found")
    assert bob.post("/v1/chunks/missing", {"hashes": [h]}).json() == {"missing": [h]}
    error(bob.get(f"{CQ}/items/s1"), 404, "not_found")
    error(bob.get(f"{CQ}/changes?since=0"), 404, "not_found")
    assert bob.get("/v1/containers").json() == {"containers": []}
    # Bob's container with the same identifier is his own, empty one.
    bob.ensure_container(C)
    assert {i["itemID"] for i in bob.all_items(C)} == {"root", "documents"}
    # Referencing Alice's chunk in Bob's item is refused: he must upload the bytes himself.
    error(bob.put(f"{CQ}/items/s1", item("s1", "stolen.txt", secret)), 422, "missing_chunks")
    # Bob cannot revoke Alice's tokens either.
    alice_tokens = alice.get("/v1/devices").json()["devices"]
    error(bob.delete(f"/v1/devices/{alice_tokens[0]['id']}"), 404, "not_found")
    assert alice.get("/v1/account").status == 200
    # After uploading the same bytes himself he has his own copy and usage.
    assert put_file(bob, "b1", "copy.txt", secret).status == 201
    assert bob.get(f"/v1/chunks/{h}").body == secret
    assert bob.chunk_bytes() == len(secret)
    assert {i["itemID"] for i in alice.all_items(C)} == {"root", "documents", "s1"}


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "name,code",
    [
        ("a/b", "invalid_name"),
        ("a\u0000b", "invalid_name"),
        (".", "invalid_name"),
        ("..", "invalid_name"),
        ("", "invalid_name"),
        ("kept.nosync", "invalid_name"),
        ("x" * 256, "name_too_long"),
        ("é" * 128, "name_too_long"),
    ],
)
def test_bad_names_are_rejected(api, name, code):
    api.ensure_container(C)
    body = error(api.put(f"{CQ}/items/bad", item("bad", name, kind=2)), 400, code)
    assert "name" in body["error"] or "'" in body["error"]


def test_bad_input_gets_clear_errors(api):
    api.ensure_container(C)
    ok_name = "x" * 255
    assert api.put(f"{CQ}/items/long", item("long", ok_name, kind=2)).status == 201
    # Invalid UTF-8 in a name (raw bytes) and an unpaired surrogate escape.
    raw = json.dumps(item("u1", "PLACEHOLDER", kind=2)).encode().replace(b"PLACEHOLDER", b"bad\xff\xfename")
    error(api.put(f"{CQ}/items/u1", raw), 400, "invalid_utf8")
    esc = json.dumps(item("u2", "PLACEHOLDER", kind=2)).replace("PLACEHOLDER", "bad\\udc80")
    error(api.put(f"{CQ}/items/u2", esc), 400, "invalid_utf8")
    # Malformed JSON, wrong types, missing fields, mismatched ids.
    error(api.put(f"{CQ}/items/j1", b'{"itemID": "j1",'), 400, "bad_json")
    error(api.put(f"{CQ}/items/j1", {"itemID": "j1"}), 400, "bad_json")
    error(api.put(f"{CQ}/items/j1", dict(item("j1", "a", kind=2), size="big")), 400, "bad_json")
    error(api.put(f"{CQ}/items/j1", item("other", "a", kind=2)), 400, "invalid")
    error(api.post("/v1/chunks/missing", b"[1,2"), 400, "bad_json")
    # Bad container identifiers and query parameters.
    error(api.put("/v1/containers/not-a-container"), 400, "invalid_container")
    error(api.put("/v1/containers/iCloud..x"), 400, "invalid_container")
    error(api.get(f"{CQ}/changes?since=-1"), 400, "bad_request")
    error(api.get(f"{CQ}/changes?since=abc"), 400, "bad_request")
    error(api.get(f"{CQ}/changes/wait?since=0&timeout=999999999"), 400, "bad_request")
    error(api.get("/v1/containers/%ff%fe/items/x"), 400, "invalid_utf8")
    # Unknown routes.
    error(api.get("/v1/nothing-here"), 404, "not_found")


def test_request_bodies_are_bounded(api):
    big = os.urandom(9 * 1024 * 1024)
    error(api.put(f"/v1/chunks/{sha(big)}", big), 413, "too_large")
    huge = json.dumps({"hashes": ["0" * 64] * 300_000}).encode()  # ~20 MB
    error(api.post("/v1/chunks/missing", huge), 413, "too_large")
    api.ensure_container(C)
    error(api.put(f"{CQ}/kv/k", json.dumps({"value": "v" * (3 << 20), "timestamp": 1}).encode()), 413, "too_large")
    # The server still answers normally afterwards.
    assert api.get("/v1/usage").status == 200


# ---------------------------------------------------------------------------- quota


def test_quota_exceeded_is_507_with_edquot(new_account):
    api = new_account(quota="100K")
    a, b = os.urandom(60 * 1024), os.urandom(60 * 1024)
    assert api.put(f"/v1/chunks/{sha(a)}", a).status == 201
    body = error(api.put(f"/v1/chunks/{sha(b)}", b), 507, "quota_exceeded")
    assert body["errno"] == "EDQUOT"
    assert body["usage"] == {"usedBytes": len(a), "quotaBytes": 100 * 1024, "metadataBytes": 0}
    assert "EDQUOT" in body["error"]
    # Nothing was charged or stored for the refused chunk.
    assert api.get("/v1/usage").json()["usedBytes"] == len(a)
    error(api.get(f"/v1/chunks/{sha(b)}"), 404, "not_found")
    # Re-uploading a chunk the account already holds costs nothing.
    assert api.put(f"/v1/chunks/{sha(a)}", a).status == 201


# ---------------------------------------------------------------------------- push channel


def _wait_in_thread(api: Api, since: int, timeout_ms: int):
    out = {}

    def run():
        t0 = time.monotonic()
        out["r"] = api.get(f"{CQ}/changes/wait?since={since}&timeout={timeout_ms}", timeout=timeout_ms / 1000 + 10)
        out["t"] = time.monotonic() - t0

    th = threading.Thread(target=run)
    th.start()
    return th, out


def test_long_poll_returns_fast_on_change_and_on_timeout(api):
    token = api.ensure_container(C)["token"]
    r = api.get(f"{CQ}/changes/wait?since={token}&timeout=300")
    assert r.json() == {"changed": False, "token": token}
    assert api.get(f"{CQ}/changes/wait?since=0&timeout=5000").json() == {"changed": True, "token": token}
    th, out = _wait_in_thread(api, token, 20000)
    time.sleep(0.5)
    t_write = time.monotonic()
    assert api.put(f"{CQ}/items/w1", item("w1", "w", kind=2)).status == 201
    th.join(25)
    assert out["r"].json() == {"changed": True, "token": token + 1}
    latency = time.monotonic() - t_write
    assert latency < 0.5, f"woke {latency:.3f}s after the write"


# ---------------------------------------------------------------------------- several servers


def test_two_servers_serve_one_account_consistently(storage, start_server, server):
    other = start_server()
    name = unique()
    token = create_account(storage, name)
    one, two = Api(server.url, token), Api(other.url, token)
    one.ensure_container(C)
    two.ensure_container(C)  # idempotent across servers
    # The push channel on server two learns of a write made through server one.
    base = two.get(f"{CQ}/changes?since=0").json()["token"]
    th, out = _wait_in_thread(two, base, 20000)
    time.sleep(0.3)
    t_write = time.monotonic()
    data = os.urandom(300_000)
    v1 = put_file(one, "f1", "shared.bin", data).json()
    th.join(25)
    assert out["r"].json()["changed"] is True
    assert time.monotonic() - t_write < 1.0
    # Reads through server two see the write (record, feed and chunk bytes).
    assert two.get(f"{CQ}/items/f1").json()["etag"] == v1["etag"]
    assert [i["itemID"] for i in two.get(f"{CQ}/changes?since={base}").json()["items"]] == ["f1"]
    assert two.get(f"/v1/chunks/{sha(data)}").body == data
    # If-Match is enforced across servers: of two writers on the same etag exactly one wins.
    results = {}

    def write(api, label):
        results[label] = put_file(api, "f1", "shared.bin", label.encode() * 10, if_match=v1["etag"])

    ts = [threading.Thread(target=write, args=(a, l)) for a, l in ((one, "one"), (two, "two"))]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    statuses = sorted(r.status for r in results.values())
    assert statuses == [200, 409], results
    # A token revoked via one server is refused by the other at once.
    dev = one.post("/v1/devices", {"name": "gone"}).json()
    gone = Api(other.url, dev["token"])
    assert gone.get("/v1/usage").status == 200
    assert one.with_token(dev["token"]).delete("/v1/devices/current").status == 200
    assert gone.get("/v1/usage").status == 401


def test_concurrent_commits_get_a_gapless_ordered_feed(storage, start_server, server):
    other = start_server()
    token = create_account(storage, unique())
    apis = [Api(server.url, token), Api(other.url, token)]
    base = apis[0].ensure_container(C)["token"]
    n_threads, per_thread = 6, 15
    errors = []

    def worker(k):
        api = apis[k % 2]
        for i in range(per_thread):
            r = api.put(f"{CQ}/items/t{k}-{i}", item(f"t{k}-{i}", f"n{k}-{i}", kind=2))
            if r.status != 201:
                errors.append(r)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert not errors, errors[:3]
    feed = apis[1].get(f"{CQ}/changes?since={base}&limit=5000").json()
    seqs = [i["changeSeq"] for i in feed["items"]]
    assert seqs == list(range(base + 1, base + 1 + n_threads * per_thread))


# ---------------------------------------------------------------------------- key-value store


def test_key_value_store(api):
    api.ensure_container(C)
    kv = f"{CQ}/kv"
    assert api.get(kv).json() == {"entries": [], "token": 0, "usedBytes": 0, "keyCount": 0}
    r = api.put(f"{kv}/theme", {"value": {"dark": True, "size": 12}, "timestamp": 100, "device": "a"})
    assert r.status == 200 and r.json()["applied"] is True
    # An older write loses (last writer by timestamp wins) and learns the winner.
    r = api.put(f"{kv}/theme", {"value": "light", "timestamp": 50, "device": "b"}).json()
    assert r["applied"] is False and r["entry"]["value"] == {"dark": True, "size": 12}
    # Keys with '/' and non-ASCII characters travel percent-encoded.
    key = "a/b é"
    assert api.put(f"{kv}/{Api.q(key)}", {"value": [1, 2.5, None], "timestamp": 1}).json()["applied"]
    snap = api.get(kv).json()
    assert {e["key"]: e["value"] for e in snap["entries"]} == {"theme": {"dark": True, "size": 12}, key: [1, 2.5, None]}
    token = snap["token"]
    r = api.delete(f"{kv}/theme?timestamp=200&device=a")
    assert r.json()["applied"] is True and r.json()["entry"]["deleted"] is True
    changes = api.get(f"{kv}?since={token}").json()
    assert [(e["key"], e["deleted"]) for e in changes["entries"]] == [("theme", True)]
    assert [e["key"] for e in api.get(kv).json()["entries"]] == [key]
    # An older set cannot resurrect a newer removal.
    assert api.put(f"{kv}/theme", {"value": 1, "timestamp": 150}).json()["applied"] is False
    # Limits: key length, bad body, total size, key count.
    error(api.put(f"{kv}/{'k' * 65}", {"value": 1, "timestamp": 1}), 400, "invalid_key")
    error(api.put(f"{kv}/x", {"timestamp": 1}), 400, "bad_json")
    assert api.put(f"{kv}/{'k' * 64}", {"value": 1, "timestamp": 1}).json()["applied"]
    big = "x" * (600 * 1024)
    assert api.put(f"{kv}/big1", {"value": big, "timestamp": 1}).status == 200
    body = error(api.put(f"{kv}/big2", {"value": big, "timestamp": 1}), 507, "kv_quota")
    assert body["errno"] == "EDQUOT"
    assert api.delete(f"{kv}/big1?timestamp=2").status == 200
    assert api.put(f"{kv}/big2", {"value": big, "timestamp": 1}).status == 200
    # The container of another account's identifier is not reachable.
    error(api.get("/v1/containers/iCloud.com.example.none/kv"), 404, "not_found")


def test_key_value_store_caps_key_count(api):
    api.ensure_container(C)
    live = len(api.get(f"{CQ}/kv").json()["entries"])
    for i in range(1024 - live):
        assert api.put(f"{CQ}/kv/k{i}", {"value": i, "timestamp": 1}).status == 200
    error(api.put(f"{CQ}/kv/one-more", {"value": 1, "timestamp": 1}), 507, "kv_quota")
    assert api.get(f"{CQ}/kv").json()["keyCount"] == 1024


# ---------------------------------------------------------------------------- lifecycle


def test_graceful_shutdown_releases_long_polls(server, api):
    token = api.ensure_container(C)["token"]
    th, out = _wait_in_thread(api, token, 30000)
    time.sleep(0.5)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(timeout=15)
    th.join(15)
    assert rc == 0
    assert out["r"].json() == {"changed": False, "token": token}
    assert time.monotonic() - t0 < 5
