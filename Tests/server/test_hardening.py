"""What the server refuses from clients (docs/protocol.md, "Identifiers and numbers"), on
both engines: range-checked numbers, the one identifier format, strict JSON, malformed
tokens, and a fuzz-ish sweep that must only ever produce JSON 2xx/4xx answers while the
server keeps serving."""

from __future__ import annotations

import json
import random
import urllib.parse

import pytest
from test_api import C, CQ, error, item, sha
from ubiqstack import Api

INT64_MAX = 2**63 - 1


def folder(item_id: str, name: str, parent: str = "documents") -> dict:
    return item(item_id, name, kind=2, parent=parent)


def put(api: Api, rec: dict, if_match: str | None = None):
    headers = {"If-Match": f'"{if_match}"'} if if_match else {}
    return api.put(f"{CQ}/items/{Api.q(rec['itemID'])}", rec, headers=headers)


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


def test_bad_parent_ids_are_refused(api):
    api.ensure_container(C)
    error(put(api, folder("p1", "p1", parent="../documents")), 400, "invalid_id")


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
