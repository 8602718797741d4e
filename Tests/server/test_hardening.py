"""What the server refuses from clients (docs/protocol.md, "Tree invariants" and "Identifiers
and numbers"), on both engines: tree invariants checked inside the commit, range-checked
numbers, the one identifier format, malformed tokens, and a fuzz-ish sweep that must only
ever produce JSON 2xx/4xx answers while the server keeps serving. Also `ubiqfs server check`."""

from __future__ import annotations

import base64
import os
import json
import random
import sqlite3
import socket
import subprocess
import time
import urllib.parse

import pytest
from test_api import C, CQ, error, item, put_file, sha
from ubiqstack import Api, EmbeddedStorage, PostgresCluster, ServerProcess, create_account, run_cli

INT64_MAX = 2**63 - 1


def folder(item_id: str, name: str, parent: str = "documents") -> dict:
    return item(item_id, name, kind=2, parent=parent)


def put(api: Api, rec: dict, if_match: str | None = None):
    headers = {"If-Match": f'"{if_match}"'} if if_match else {}
    return api.put(f"{CQ}/items/{Api.q(rec['itemID'])}", rec, headers=headers)


# ---------------------------------------------------------------------------- tree invariants


def test_parent_must_exist_be_a_live_directory(api):
    api.ensure_container(C)
    error(put(api, folder("d-orphan", "orphan", parent="no-such-item")), 409, "bad_parent")
    assert put_file(api, "f1", "file.txt", b"data").status == 201
    error(put(api, folder("d-under-file", "x", parent="f1")), 409, "bad_parent")
    d = put(api, folder("d1", "dir")).json()
    assert api.delete(f"{CQ}/items/d1", headers={"If-Match": f'"{d["etag"]}"'}).status == 200
    error(put(api, folder("d-under-tombstone", "x", parent="d1")), 409, "bad_parent")
    # The container root and Documents are directories: children are fine.
    assert put(api, folder("top", "top", parent="root")).status == 201
    # Nothing refused was stored.
    for bad in ("d-orphan", "d-under-file", "d-under-tombstone"):
        error(api.get(f"{CQ}/items/{bad}"), 404, "not_found")


def test_cycles_are_refused(api):
    api.ensure_container(C)
    error(put(api, folder("self", "self", parent="self")), 409, "cycle")
    x = put(api, folder("x", "x")).json()
    y = put(api, folder("y", "y", parent="x")).json()
    z = put(api, folder("z", "z", parent="y")).json()
    # Moving x under y (y is under x) or under z (two levels down) would make a cycle.
    error(put(api, folder("x", "x", parent="y"), if_match=x["etag"]), 409, "cycle")
    error(put(api, folder("x", "x", parent="z"), if_match=x["etag"]), 409, "cycle")
    error(put(api, folder("x", "x", parent="x"), if_match=x["etag"]), 409, "cycle")
    # Documents cannot move at all (so never under one of its descendants).
    docs = api.get(f"{CQ}/items/documents").json()
    error(put(api, dict(docs, parentID="x"), if_match=docs["etag"]), 400, "invalid")
    assert api.get(f"{CQ}/items/x").json()["parentID"] == "documents"
    # A legal move still works.
    assert put(api, folder("z", "z", parent="x"), if_match=z["etag"]).status == 200
    assert y["parentID"] == "x"


def test_one_live_name_per_parent(api):
    api.ensure_container(C)
    a = put(api, folder("a", "same")).json()
    error(put(api, folder("b", "same")), 409, "name_taken")
    # Another folder may use the name; a deleted item frees it.
    assert put(api, folder("c", "same", parent="a")).status == 201
    # Renaming an item to its own name is not a clash.
    a = put(api, dict(folder("a", "same"), mode=0o700), if_match=a["etag"]).json()
    assert api.delete(f"{CQ}/items/c", headers={"If-Match": '"%s"' % api.get(f"{CQ}/items/c").json()["etag"]}).status == 200
    assert api.delete(f"{CQ}/items/a", headers={"If-Match": f'"{a["etag"]}"'}).status == 200
    assert put(api, folder("b", "same")).status == 201


def _deep_chain(api: Api, prefix: str, depth: int, parent: str = "documents") -> list[str]:
    """Folders prefix1 .. prefix<depth>, each in the one before (the first in `parent`), made
    with batches of versions; returns their ids, top first."""
    ids = [f"{prefix}{n}" for n in range(1, depth + 1)]
    parents = [parent] + ids[:-1]
    for start in range(0, depth, 1000):
        puts = [{"item": folder(i, i, parent=p)} for i, p in zip(ids[start:start + 1000], parents[start:start + 1000])]
        body = api.post(f"{CQ}/items", {"puts": puts}).json()
        assert body.get("refused") is None and len(body["committed"]) == len(puts), body.get("refused")
    return ids


def test_a_very_deep_folder_is_walked_once_per_batch_and_bounds_what_moves_into_it(server, new_account):
    """An item is at most 4,096 levels down (counting the container root and Documents).

    The items of a batch mostly share their folder: its ancestry, thousands of levels deep,
    is read once for the batch, not once per item. A thousand files in a folder 4,000 levels
    down cost the server little more than a thousand files in Documents; before, each item
    walked the 4,000 levels again and the batch held the store's writer for seconds.

    A move of a folder is refused when an item inside it would end up deeper than the limit,
    not only when the folder itself would: otherwise one move makes a tree no commit could
    have made, whose deepest items every client then refuses."""
    api = new_account()
    api.ensure_container(C)
    a = _deep_chain(api, "a", 4000)

    def cpu_of_batch(parent: str, prefix: str) -> float:
        puts = [{"item": item(f"{prefix}{n}", f"{prefix}{n}.txt", parent=parent)} for n in range(1000)]
        before = _cpu_seconds(server.pid)
        body = api.post(f"{CQ}/items", {"puts": puts}).json()
        assert body.get("refused") is None and len(body["committed"]) == 1000, body.get("refused")
        return _cpu_seconds(server.pid) - before

    cpu_of_batch("documents", "warm")
    shallow = min(cpu_of_batch("documents", f"s{r}-") for r in range(2))
    deep = min(cpu_of_batch(a[-1], f"x{r}-") for r in range(2))
    assert deep < 3 * shallow + 0.5, f"1,000 files 4,000 levels down: {deep:.2f} s, in Documents: {shallow:.2f} s"

    # a4000 has 4,001 records above it: a folder moved into it is 4,002 levels down, so what
    # it holds may go 94 levels further, no more.
    _deep_chain(api, "b", 200)
    for top, height in (("b1", 199), ("b105", 95)):
        rec = api.get(f"{CQ}/items/{top}").json()
        body = error(put(api, dict(rec, parentID=a[-1]), if_match=rec["etag"]), 409, "cycle")
        assert "deeper" in body["error"], (height, body)
        assert api.get(f"{CQ}/items/{top}").json()["parentID"] == rec["parentID"]
    # Exactly at the limit: b200, the deepest, ends 4,096 levels down.
    rec = api.get(f"{CQ}/items/b106").json()
    assert put(api, dict(rec, parentID=a[-1]), if_match=rec["etag"]).status == 200
    error(put(api, folder("b201", "b201", parent="b200")), 409, "cycle")
    # A batch that moves one is refused the same way, after the versions before it.
    rec = api.get(f"{CQ}/items/b1").json()
    body = api.post(f"{CQ}/items", {"puts": [{"item": folder("ok-move", "ok")},
                                            {"item": dict(rec, parentID=a[-1]), "ifMatch": rec["etag"]}]}).json()
    assert [i["itemID"] for i in body["committed"]] == ["ok-move"]
    assert (body["refused"]["status"], body["refused"]["code"]) == (409, "cycle"), body


def test_a_folder_with_live_items_is_not_deleted(api):
    api.ensure_container(C)
    d = put(api, folder("nd", "nonempty")).json()
    sub = put(api, folder("nd-sub", "sub", parent="nd")).json()
    assert api.put(f"/v1/chunks/{sha(b'inside')}", b"inside").status in (200, 201)
    assert put(api, item("nd-file", "f.txt", b"inside", parent="nd-sub")).status == 201
    body = error(api.delete(f"{CQ}/items/nd", headers={"If-Match": f'"{d["etag"]}"'}), 409, "not_empty")
    assert body["blockingItem"] == "nd-sub", body
    body = error(api.delete(f"{CQ}/items/nd-sub", headers={"If-Match": f'"{sub["etag"]}"'}), 409, "not_empty")
    assert body["blockingItem"] == "nd-file", body
    # Nothing was deleted; once the contents are gone (rm -r order), the folders go too.
    assert not api.get(f"{CQ}/items/nd").json()["deleted"]
    f = api.get(f"{CQ}/items/nd-file").json()
    assert api.delete(f"{CQ}/items/nd-file", headers={"If-Match": f'"{f["etag"]}"'}).status == 200
    assert api.delete(f"{CQ}/items/nd-sub", headers={"If-Match": f'"{sub["etag"]}"'}).status == 200
    assert api.delete(f"{CQ}/items/nd", headers={"If-Match": f'"{d["etag"]}"'}).status == 200


def test_an_items_kind_never_changes_and_documents_stays_a_folder(api):
    """A live item keeps its kind: a folder rewritten as a file or a symlink would leave its
    items under a non-folder (and Documents so would refuse every new item); a file rewritten
    as a folder is refused the same way. Documents is a folder in every write, a batch's too.
    Nothing is stored, and the tree still takes new items."""
    api.ensure_container(C)
    f = put(api, folder("kc", "kindchange")).json()
    assert api.put(f"/v1/chunks/{sha(b'inside')}", b"inside").status in (200, 201)
    assert put(api, item("kc-file", "f.txt", b"inside", parent="kc")).status == 201
    error(put(api, dict(item("kc", "kindchange"), size=0, chunks=[]), if_match=f["etag"]), 400, "invalid")
    link = item("kc", "kindchange", kind=3, symlinkTarget="/etc", mode=0o777)
    error(put(api, link, if_match=f["etag"]), 400, "invalid")
    g = api.get(f"{CQ}/items/kc-file").json()
    error(put(api, folder("kc-file", "f.txt", parent="kc"), if_match=g["etag"]), 400, "invalid")
    docs = api.get(f"{CQ}/items/documents").json()
    as_link = dict(item("documents", "Documents", kind=3, symlinkTarget="/etc", mode=0o777), parentID="root")
    error(put(api, as_link, if_match=docs["etag"]), 400, "invalid")
    batch = api.post(f"{CQ}/items", {"puts": [{"item": as_link, "ifMatch": docs["etag"]}]})
    assert batch.status == 200 and batch.json()["committed"] == [], batch.json()
    assert batch.json()["refused"]["code"] == "invalid", batch.json()
    assert api.get(f"{CQ}/items/kc").json()["kind"] == 2
    assert api.get(f"{CQ}/items/kc-file").json()["kind"] == 1
    assert api.get(f"{CQ}/items/documents").json()["kind"] == 2
    assert put(api, item("kc-new", "new.txt", b"inside")).status == 201


# ---------------------------------------------------------------------------- numbers


def test_chunk_lengths_are_range_checked(server, api):
    api.ensure_container(C)
    data = b"hello"
    assert api.put(f"/v1/chunks/{sha(data)}", data).status == 201
    h = sha(data)
    # Lengths that overflow Int64 when added.
    rec = dict(item("big", "big.bin"), size=INT64_MAX, chunks=[{"hash": h, "length": INT64_MAX}, {"hash": h, "length": 1}])
    error(put(api, rec), 400, "invalid")
    rec = dict(item("big", "big.bin"), size=0, chunks=[{"hash": h, "length": INT64_MAX}, {"hash": h, "length": 1}])
    error(put(api, rec), 400, "invalid")
    # Negative and zero lengths that add up to the size.
    error(put(api, dict(item("neg", "neg.bin"), size=0, chunks=[{"hash": h, "length": 5}, {"hash": h, "length": -5}])), 400, "invalid")
    error(put(api, dict(item("zero", "zero.bin"), size=0, chunks=[{"hash": h, "length": 0}])), 400, "invalid")
    # A length that is not the stored chunk's size.
    error(put(api, dict(item("lie", "lie.bin"), size=3, chunks=[{"hash": h, "length": 3}])), 400, "invalid")
    # The same rules for conflict versions.
    good = item("good", "good.bin", data)
    bad_conflict = {"versionID": "v1", "deviceID": "d", "mtimeNs": 1, "size": 0, "chunks": [{"hash": h, "length": 5}, {"hash": h, "length": -5}]}
    error(put(api, dict(good, conflicts=[bad_conflict])), 400, "invalid")
    assert put(api, good).status == 201
    # Negative sizes and numbers that do not fit the field's type.
    error(put(api, dict(item("ns", "ns.bin"), size=-1)), 400, "invalid")
    error(put(api, dict(item("huge", "huge.bin"), size=2**64)), 400, "bad_json")
    error(put(api, dict(item("mode", "mode.bin"), mode=-1)), 400, "bad_json")
    assert api.get("/v1/usage").status == 200
    assert server.proc.poll() is None


# ---------------------------------------------------------------------------- identifiers


@pytest.mark.parametrize("raw", ["..", ".", "%2Fetc%2Fpasswd", "a%00b", "a%2Fb", "a%20b", "%C3%A9", "x" * 129, ".hidden"])
def test_bad_item_ids_are_refused(api, raw):
    api.ensure_container(C)
    decoded = urllib.parse.unquote(raw)
    r = api.put(f"{CQ}/items/{raw}", folder(decoded, "n"))
    error(r, 400, "invalid_id")
    error(api.get(f"{CQ}/items/{raw}"), 400, "invalid_id")
    error(api.delete(f"{CQ}/items/{raw}"), 400, "invalid_id")


def test_good_item_ids_are_accepted(api):
    api.ensure_container(C)
    for i, good in enumerate(["5ebf733f-c243-47ea-aa1f-488dd914aa1e", "A_b.c-9", "x" * 128]):
        assert put(api, folder(good, f"n{i}")).status == 201


def test_device_ids_are_length_checked_and_the_content_author_round_trips(api):
    api.ensure_container(C)
    error(put(api, dict(folder("dev1", "dev1"), deviceID="d" * 129)), 400, "invalid")
    error(put(api, dict(item("dev2", "dev2.bin"), contentDeviceID="d" * 129)), 400, "invalid")
    data = b"a conflict version"
    assert api.put(f"/v1/chunks/{sha(data)}", data).status in (200, 201)
    version = {"versionID": "v1", "deviceID": "d" * 129, "mtimeNs": 1, "size": len(data),
               "chunks": [{"hash": sha(data), "length": len(data)}]}
    error(put(api, dict(item("dev4", "dev4.bin"), conflicts=[version])), 400, "invalid")
    assert put(api, dict(item("dev4", "dev4.bin"), conflicts=[dict(version, deviceID="d" * 128)])).status == 201
    # A device's name has no control character, DEL included, and no line separator: it is the
    # device id of the token's writes that name none (a delete's `?device=`).
    for name in ("a\x7f", "a\x01", "a\u0085", "a\u2028"):
        error(api.post("/v1/devices", {"name": name}), 400, "invalid")
    stored = put(api, dict(item("dev3", "dev3.bin"), deviceID="device-a", contentDeviceID="device-b")).json()
    assert stored["contentDeviceID"] == "device-b"
    assert api.get(f"{CQ}/items/dev3").json()["contentDeviceID"] == "device-b"
    # A delete is this device's own: the tombstone names no other author.
    gone = api.delete(f"{CQ}/items/dev3", headers={"If-Match": f'"{stored["etag"]}"'}).json()
    assert gone["deleted"] and gone.get("contentDeviceID") is None


def test_device_ids_with_a_control_character_are_refused_everywhere(api):
    """A device id names a writer in records, key-value entries, logs and `ubiqfs status`: like
    a device's name it has no control character. A NUL in one was stored by the embedded
    engine and made PostgreSQL fail (a 503 that a client retries for ever); a newline would
    split a log line. Every way in is a 400 and stores nothing."""
    api.ensure_container(C)
    for bad in ("a\u0000b", "a\nb", "a\x7f", "a\u2028b"):
        error(put(api, dict(folder("cd1", "cd1"), deviceID=bad)), 400, "invalid")
        error(put(api, dict(item("cd2", "cd2.bin"), contentDeviceID=bad)), 400, "invalid")
        error(api.put(f"{CQ}/kv/cd-key", {"value": 1, "device": bad}), 400, "invalid")
        error(api.delete(f"{CQ}/items/cd-never?device={urllib.parse.quote(bad)}"), 400, "invalid")
        body = api.post(f"{CQ}/deletes?device={urllib.parse.quote(bad)}", {"deletes": [{"itemID": "cd-never", "ifMatch": "1"}]})
        error(body, 400, "invalid")
    for gone in ("cd1", "cd2", "cd-never"):
        error(api.get(f"{CQ}/items/{gone}"), 404, "not_found")
    assert not any(e["key"] == "cd-key" for e in api.get(f"{CQ}/kv").json()["entries"])


def test_bad_parent_ids_are_refused(api):
    api.ensure_container(C)
    error(put(api, folder("p1", "p1", parent="../documents")), 400, "invalid_id")


def test_symlink_targets_and_extended_attributes_a_mount_cannot_show_are_refused(api):
    """The limits a Linux mount has are the cloud's: a symlink target of at most 4095 bytes, an
    extended attribute name of at most 255 bytes, a value of at most 64 KiB, at most 60 KiB of
    names in all (listxattr's buffer is 64 KiB, and the mount adds its own). A record past one is
    a 400, never stored; at the limit it is fine."""
    api.ensure_container(C)
    b64 = lambda n: base64.b64encode(b"v" * n).decode()  # noqa: E731
    link = lambda target: item("l1", "l", kind=3, symlinkTarget=target, mode=0o777)  # noqa: E731
    error(put(api, link("t" * 4096)), 400, "invalid")
    error(put(api, dict(folder("x1", "x"), xattrs={"user." + "n" * 251: b64(1)})), 400, "invalid")
    error(put(api, dict(folder("x1", "x"), xattrs={"user.big": b64(65537)})), 400, "invalid")
    many = {f"user.attribute-{i:05d}-" + "p" * 20: b64(1) for i in range(2200)}
    error(put(api, dict(folder("x1", "x"), xattrs=many)), 400, "invalid")
    for bad in ("l1", "x1"):
        error(api.get(f"{CQ}/items/{bad}"), 404, "not_found")
    assert put(api, link("t" * 4095)).status == 201
    assert put(api, dict(folder("x2", "x2"), xattrs={"user." + "n" * 250: b64(65536)})).status == 201


def test_folders_and_symlinks_with_content_are_refused(api):
    """Only a file has content: a folder with a size, chunks or conflict versions, or a symlink
    with chunks, is a 400, never stored (a mount would show a folder's size as its st_size).
    Chunks the account stored are used, so the refusal is the kind's, not the chunks'."""
    api.ensure_container(C)
    data = b"content"
    assert api.put(f"/v1/chunks/{sha(data)}", data).status in (200, 201)
    chunks = [{"hash": sha(data), "length": len(data)}]
    version = {"versionID": "v1", "deviceID": "dev-test", "mtimeNs": 1, "size": len(data), "chunks": chunks}
    error(put(api, dict(folder("x1", "x"), size=4096)), 400, "invalid")
    error(put(api, dict(folder("x1", "x"), size=len(data), chunks=chunks)), 400, "invalid")
    error(put(api, dict(folder("x1", "x"), conflicts=[version])), 400, "invalid")
    link = item("l1", "l", kind=3, symlinkTarget="target", mode=0o777)
    error(put(api, dict(link, size=len(data), chunks=chunks)), 400, "invalid")
    for bad in ("x1", "l1"):
        error(api.get(f"{CQ}/items/{bad}"), 404, "not_found")
    assert put(api, folder("x1", "x")).status == 201
    assert put(api, link).status == 201


@pytest.mark.parametrize("route", [f"{CQ}/items/x1", f"{CQ}/kv/k", "/v1/chunks/" + "a" * 64])
def test_a_malformed_chunked_body_gets_a_json_400(api, route):
    """A body sent with `Transfer-Encoding: chunked` whose chunk size is not hexadecimal is
    malformed HTTP: a JSON 400, never a 500 (which says the server has a bug)."""
    api.ensure_container(C)
    conn = api.connection(timeout=10)
    conn.putrequest("PUT", route)
    conn.putheader("Authorization", f"Bearer {api.token}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    conn.send(b"ZZZ\r\n{}\r\n0\r\n\r\n")
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status == 400, (resp.status, body)
    assert json.loads(body)["code"] == "bad_request", body
    assert api.get(f"{CQ}/items/documents").status == 200, "the server keeps serving"


def test_connections_that_send_nothing_are_closed_after_the_idle_timeout(storage, tmp_path):
    """A connection that never finishes its request (a header sent a line at a time, a body
    shorter than its Content-Length) or sends nothing is closed after `--idle-timeout`, so such
    clients cannot hold the server's connections for ever; a request being answered (a
    long-poll) is not idle, and ordinary requests are served meanwhile."""
    srv = ServerProcess(storage, tmp_path / "serve.log", extra=["--idle-timeout", "2s"]).start()
    try:
        token = create_account(storage, "idle-acct")
        api = Api(srv.url, token)
        api.ensure_container(C)
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=15)
        header = socket.create_connection(("127.0.0.1", srv.port), timeout=15)
        header.sendall(b"GET /healthz HTTP/1.1\r\n")
        body = socket.create_connection(("127.0.0.1", srv.port), timeout=15)
        body.sendall(f"PUT {CQ}/kv/k HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"va".encode())
        last = api.get(f"{CQ}/changes?since=0").json()["token"]
        waited = time.time()
        poll = api.get(f"{CQ}/changes/wait?since={last}&timeout=4000")
        assert poll.status == 200 and poll.json()["changed"] is False, poll.body
        assert time.time() - waited >= 3.5, "a long-poll of 4 s outlives the 2 s idle timeout"
        start = time.time()
        for s in (silent, header, body):
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            s.close()
        assert time.time() - start < 10, "idle connections are closed"
        assert api.get("/healthz").status == 200
    finally:
        srv.stop()


def test_a_database_busy_longer_than_the_server_waits_answers_503(tmp_path):
    """The embedded cloud's SQLite writer held by another process for longer than the server
    waits for it (a second `ubiqfs serve` on the same data folder committing a big batch) is a
    passing condition, not a failure of the server: 503 `unavailable` with a Retry-After (the
    client retries it as any unavailable cloud), never a 500; the same request succeeds once the writer is free."""
    data = tmp_path / "data"
    storage = EmbeddedStorage(data)
    srv = ServerProcess(storage, tmp_path / "serve.log").start()
    try:
        api = Api(srv.url, create_account(storage, "busy-acct"))
        api.ensure_container(C)
        holder = sqlite3.connect(data / "cloud.sqlite", isolation_level=None, timeout=30)
        holder.execute("BEGIN IMMEDIATE")
        try:
            busy = api.request("PUT", f"{CQ}/items/d-busy", folder("d-busy", "busy"), timeout=60)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        error(busy, 503, "unavailable")
        assert busy.headers.get("retry-after", "").isdigit(), busy.headers
        assert put(api, folder("d-busy", "busy")).status == 201
    finally:
        srv.stop()


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_more_clients_than_open_files_allowed_wait_without_a_busy_accept_loop(storage, tmp_path):
    """With its open-files limit low (`ulimit -n 128`) and 200 clients connected, the server
    accepts what its limit leaves room for and lets the rest wait in the listen queue: it does
    not spin on accept's EMFILE (a core busy for as long as the clients stay), and every
    client is served once others leave."""
    srv = ServerProcess(storage, tmp_path / "serve.log", open_files=128).start()
    clients = []
    try:
        assert int(open(f"/proc/{srv.pid}/limits").read().split("Max open files")[1].split()[0]) == 128
        for _ in range(200):
            clients.append(socket.create_connection(("127.0.0.1", srv.port), timeout=30))
        time.sleep(1)
        before = _cpu_seconds(srv.pid)
        time.sleep(3)
        used = _cpu_seconds(srv.pid) - before
        assert used < 0.5, f"the server used {used:.2f} s of CPU in 3 s with nothing to do"
        # Every waiting client is served once it asks (the first ones close as they go).
        for s in clients:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for s in clients:
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got[:100]
            s.close()
        assert Api(srv.url).get("/healthz").status == 200
    finally:
        for s in clients:
            s.close()
        srv.stop()


def test_malformed_bearer_tokens_get_401(server):
    anon = Api(server.url)
    for header in ["Bearer", "Bearer ", "Bearer  x", "bearer x y", "Bearer ubq_zz", "Bearer " + "a" * 5000, "Token abc",
                   "Bearer\tabc", "Bearer ubq_" + "A" * 64, "Bearer ubq_" + "0" * 63, "Bearer ubq_" + "0" * 64 + " x",
                   "Bearer \u00e9"]:
        error(anon.get("/v1/account", headers={"Authorization": header}), 401, "unauthorized")


def test_kv_value_over_the_limit_gets_the_quota_error(api):
    api.ensure_container(C)
    body = json.dumps({"value": "v" * (1 << 20), "timestamp": 1}).encode()
    got = error(api.put(f"{CQ}/kv/big", body), 507, "kv_quota")
    assert got["errno"] == "EDQUOT"
    error(api.put(f"{CQ}/kv/t", {"value": 1, "timestamp": -1}), 400, "invalid")
    error(api.put(f"{CQ}/kv/t", {"value": 1, "timestamp": 1, "device": "d" * 200}), 400, "invalid")
    assert api.put(f"{CQ}/kv/t", {"value": 1, "timestamp": 1}).status == 200


def test_a_kv_value_nested_too_deep_to_answer_is_refused(api):
    """A key-value value is nested at most 500 levels: the answers wrap it in a few more, and a
    deeper one, stored, would make every read of the container's store a 500. It is a 400, and
    nothing is stored; 500 levels are stored and read back."""
    api.ensure_container(C)
    for depth in (501, 509, 511):
        body = ('{"value":' + "[" * depth + "]" * depth + ',"timestamp":1}').encode()
        error(api.put(f"{CQ}/kv/deep", body), 400, "invalid")
    r = api.get(f"{CQ}/kv")
    assert r.status == 200 and not any(e["key"] == "deep" for e in r.json()["entries"]), r
    body = ('{"value":' + "[" * 500 + "]" * 500 + ',"timestamp":1}').encode()
    assert api.put(f"{CQ}/kv/deep", body).status == 200
    r = api.get(f"{CQ}/kv")
    assert r.status == 200 and any(e["key"] == "deep" for e in r.json()["entries"]), r


def test_json_with_a_bom_or_duplicate_keys_is_refused(api):
    api.ensure_container(C)
    body = json.dumps(folder("bom", "bom")).encode()
    error(api.put(f"{CQ}/items/bom", b"\xef\xbb\xbf" + body), 400, "bad_json")
    dup = body[:-1] + b', "parentID": "root"}'
    error(api.put(f"{CQ}/items/bom", dup), 400, "bad_json")
    nested = json.dumps(dict(folder("bom", "bom"), xattrs={"a": "eA=="})).encode().replace(b'{"a": "eA=="}', b'{"a": "eA==", "a": "eQ=="}')
    error(api.put(f"{CQ}/items/bom", nested), 400, "bad_json")
    # Equal keys in different objects are fine.
    ok = json.dumps(dict(folder("bom", "bom"), xattrs={"name": "eA=="})).encode()
    assert api.put(f"{CQ}/items/bom", ok).status == 201


# ---------------------------------------------------------------------------- fuzz


def _rand_value(rng: random.Random):
    return rng.choice(
        [None, True, -1, 0, 1, INT64_MAX, -(2**63), 2**64, 1e308, -1.5, "", "x" * 300, "..", "/etc/passwd",
         "a\u0000b", [], {}, [1, 2], {"k": "v"}, "\ud7ff", "root", "documents"]
    )


def test_fuzz_every_answer_is_json_2xx_or_4xx(server, api):
    api.ensure_container(C)
    data = b"fuzz"
    assert api.put(f"/v1/chunks/{sha(data)}", data).status == 201
    rng = random.Random(1234)
    base = item("fz", "fz.txt", data)
    requests: list[tuple[str, str, object]] = []
    # Item records with each field replaced by something odd.
    for field in list(base) + ["conflicts"]:
        for _ in range(4):
            rec = dict(base)
            rec[field] = _rand_value(rng)
            requests.append(("PUT", f"{CQ}/items/fz", rec))
    for lengths in ([INT64_MAX, 1], [5, -5], [-1], [0], [2**63], [4, 0]):
        for size in (0, len(data), INT64_MAX):
            rec = dict(base, itemID="fl", chunks=[{"hash": sha(data), "length": n} for n in lengths], size=size)
            requests.append(("PUT", f"{CQ}/items/fl", rec))
    for bad_id in ["..", "%2Fetc%2Fpasswd", "a%00b", "a%2Fb", "%ff", "%", "x" * 500]:
        requests += [
            ("PUT", f"{CQ}/items/{bad_id}", dict(base, itemID=bad_id)),
            ("GET", f"{CQ}/items/{bad_id}", None),
            ("DELETE", f"{CQ}/items/{bad_id}", None),
            ("GET", f"/v1/chunks/{bad_id}", None),
            ("PUT", f"{CQ}/kv/{bad_id}", {"value": 1, "timestamp": 1}),
            ("PUT", f"/v1/containers/{bad_id}", None),
        ]
    for q in ["since=-1", f"since={2**63}", "since=1e3", "limit=0", "limit=-5", f"limit={2**64}", "since=%00"]:
        requests.append(("GET", f"{CQ}/changes?{q}", None))
        requests.append(("GET", f"{CQ}/kv?{q}", None))
    for q in ["timestamp=-1", f"timestamp={2**64}", "timestamp=x", "device=" + "d" * 300]:
        requests.append(("DELETE", f"{CQ}/kv/k?{q}", None))
    for body in [b"", b"null", b"[]", b"{}", b'{"value": 1, "timestamp": "x"}', b'{"value": 1, "timestamp": 1e400}',
                 b'{"value": 1, "timestamp": 18446744073709551616}', b"\xef\xbb\xbf{}", b"{" * 10000]:
        requests.append(("PUT", f"{CQ}/kv/k", body))
        requests.append(("PUT", f"{CQ}/items/fz", body))
        requests.append(("POST", "/v1/chunks/missing", body))
        requests.append(("POST", "/v1/devices", body))
    for rng_header in ["bytes=0-", f"bytes={INT64_MAX}-", f"bytes=-{INT64_MAX}", f"bytes=0-{INT64_MAX}", "bytes=-0", "bytes=5-1", "bytes=a-b"]:
        requests.append(("GET", f"/v1/chunks/{sha(data)}", {"__headers": {"Range": rng_header}}))
    requests.append(("POST", "/v1/chunks/missing", {"hashes": [1, None, "x"]}))
    requests.append(("POST", "/v1/devices", {"name": "\u0000"}))
    for method, path, body in requests:
        headers = None
        if isinstance(body, dict) and "__headers" in body:
            headers, body = body["__headers"], None
        r = api.request(method, path, body, headers=headers)
        assert r.status < 500 or (r.status == 507 and r.json()["code"] in ("kv_quota", "quota_exceeded")), (method, path, body, r)
        if r.status >= 400:
            assert r.headers.get("content-type", "").startswith("application/json"), (method, path, r)
            assert r.json()["code"], (method, path, r)
        assert server.proc.poll() is None, (method, path, body)
    assert api.get("/v1/usage").status == 200


# ---------------------------------------------------------------------------- server check


def _corrupt(storage, records: list[dict], account: str) -> None:
    """Writes item records straight into the metadata store, bypassing the server's rules."""
    if storage.kind == "embedded":
        db = sqlite3.connect(storage.data / "cloud.sqlite")
        with db:
            for rec in records:
                seq = db.execute("SELECT lastSeq + 1 FROM containers WHERE account = ? AND container = ?", (account, C)).fetchone()[0]
                db.execute("UPDATE containers SET lastSeq = ? WHERE account = ? AND container = ?", (seq, account, C))
                rec = dict(rec, changeSeq=seq, etag=str(seq))
                db.execute(
                    "INSERT OR REPLACE INTO items(account, container, itemID, changeSeq, etag, deleted, record, parentID, name)"
                    " VALUES (?,?,?,?,?,?,?,?,?)",
                    (account, C, rec["itemID"], seq, rec["etag"], 0, json.dumps(rec).encode(), rec["parentID"], rec["name"]),
                )
        db.close()
        return
    psql = f"{PostgresCluster.bindir()}/psql"
    for rec in records:
        sql = f"""
        WITH s AS (UPDATE containers SET last_seq = last_seq + 1 WHERE account = '{account}' AND container = '{C}' RETURNING last_seq)
        INSERT INTO items(account, container, item_id, change_seq, etag, deleted, record, parent_id, name)
        SELECT '{account}', '{C}', '{rec["itemID"]}', s.last_seq, s.last_seq::text, false,
          '{json.dumps(rec)}', '{rec["parentID"]}', '{rec["name"]}' FROM s
        ON CONFLICT (account, container, item_id) DO UPDATE SET record = EXCLUDED.record, parent_id = EXCLUDED.parent_id
        """
        subprocess.run([psql, "-q", "-v", "ON_ERROR_STOP=1", storage.pg.url.replace("?sslmode=disable", ""), "-c", sql], check=True, capture_output=True)


def test_server_check_compares_names_byte_for_byte(storage, api):
    """Names are kept byte for byte, with no Unicode normalization: "café" in NFC and in NFD are
    two names, as on ext4 and on the mount. `server check` finds no duplicate among them, and
    a repair of another item next to them neither renames them nor numbers its new name for
    them."""
    api.ensure_container(C)
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    for item_id, name in (("nfc", nfc), ("nfd", nfd), ("nfc_", nfc + "_")):
        assert put(api, folder(item_id, name)).status == 201
    check = ["server", "check", *storage.args()]
    clean = run_cli(*check, env_extra=storage.env(), check=False)
    assert clean.returncode == 0, clean
    # A bad name whose repair ("/" becomes "_") is the NFD form of an existing NFC name.
    _corrupt(storage, [folder("bad", nfd + "/")], api.account)
    repaired = run_cli(*check, "--repair", env_extra=storage.env(), check=False)
    assert repaired.returncode == 0, repaired
    items = {i["itemID"]: i for i in api.all_items(C)}
    assert [items[i]["name"] for i in ("nfc", "nfd", "nfc_")] == [nfc, nfd, nfc + "_"], items
    assert items["bad"]["name"] == nfd + "_", items["bad"]


def test_server_check_reports_and_repairs_bad_trees(storage, api):
    api.ensure_container(C)
    assert put(api, folder("ok", "ok")).status == 201
    check = ["server", "check", *storage.args()]
    clean = run_cli(*check, env_extra=storage.env(), check=False)
    assert clean.returncode == 0, clean
    _corrupt(
        storage,
        [folder("orphan", "orphan", parent="gone"), folder("cy1", "cy1", parent="cy2"), folder("cy2", "cy2", parent="cy1"),
         folder("kid", "kid", parent="cy1"), folder("slash", "a/b"), folder("local", "k.nosync")],
        api.account,
    )
    found = run_cli(*check, env_extra=storage.env(), check=False)
    assert found.returncode != 0, found
    out = found.stdout + found.stderr
    assert "orphan" in out and "cy1" in out and "cy2" in out, out
    assert "bad-name: slash" in out and "bad-name: local" in out, out
    # --json: one object per container, the damaged one with its problems.
    found_json = run_cli(*check, "--json", env_extra=storage.env(), check=False)
    assert found_json.returncode != 0, found_json
    mine = [r for r in map(json.loads, found_json.stdout.splitlines()) if r["account"] == api.account and r["container"] == C]
    assert len(mine) == 1, found_json.stdout
    assert mine[0]["remaining"] == len(mine[0]["problems"]) > 0 and mine[0]["repaired"] == 0, mine
    assert any("orphan" in p for p in mine[0]["problems"]) and any("cy1" in p for p in mine[0]["problems"]), mine
    repaired = run_cli(*check, "--repair", "--json", env_extra=storage.env(), check=False)
    assert repaired.returncode == 0, repaired
    mine = [r for r in map(json.loads, repaired.stdout.splitlines()) if r["container"] == C and r["account"] == api.account]
    assert mine[0]["repaired"] > 0 and mine[0]["remaining"] == 0, repaired.stdout
    assert run_cli(*check, env_extra=storage.env(), check=False).returncode == 0
    # Nothing was deleted: the orphan and the cycle's members now live in Documents/lost+found;
    # the cycle's other children stay where they were.
    items = {i["itemID"]: i for i in api.all_items(C)}
    lf = [i for i in items.values() if i["name"] == "lost+found" and i["parentID"] == "documents" and not i["deleted"]]
    assert len(lf) == 1 and lf[0]["kind"] == 2
    assert items["orphan"]["parentID"] == lf[0]["itemID"] and not items["orphan"]["deleted"]
    moved = [i for i in ("cy1", "cy2") if items[i]["parentID"] == lf[0]["itemID"]]
    assert moved, items
    assert items["kid"]["parentID"] == "cy1" and not items["kid"]["deleted"]
    assert not any(i["deleted"] for i in items.values())
    # Bad names are renamed where the items are.
    assert (items["slash"]["name"], items["slash"]["parentID"]) == ("a_b", "documents"), items["slash"]
    assert (items["local"]["name"], items["local"]["parentID"]) == ("k_nosync", "documents"), items["local"]
