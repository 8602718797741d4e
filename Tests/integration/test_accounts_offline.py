"""Against a real server (UBIQFS_TEST_CLOUD=server|server-scale): the cloud going away and
coming back (offline writes queue and drain, evicted reads fail fast, both devices' offline
edits converge) and account identity (identity token, sign-out drains, unmounts and removes
local data, another account never sees it)."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest

import conftest
from conftest import CLOUD_MODE, Ubiq
from helpers import sha256, sha256_file
from test_conflicts import DELAY, pair, read, settle  # noqa: F401  (pair is a fixture)
from test_devices_and_content import wait_for

pytestmark = pytest.mark.skipif(
    CLOUD_MODE == "embedded",
    reason="needs a server that can be stopped and accounts to switch; runs with UBIQFS_TEST_CLOUD=server|server-scale",
)


def servers_of(u: Ubiq):
    return conftest._cloud_account(u.cloud_key).servers


class Offline:
    """Stops every server process of the devices' accounts (each once); restarts them on exit."""

    def __init__(self, *devices: Ubiq):
        seen: dict[int, object] = {}
        for u in devices:
            for s in servers_of(u):
                seen[id(s)] = s
        self.servers = list(seen.values())

    def __enter__(self):
        for s in self.servers:
            s.stop()
        return self

    def __exit__(self, *exc):
        for s in self.servers:
            s.start()


def test_offline_writes_queue_evicted_reads_fail_fast_then_drain(ubiq):
    cached = ubiq.docs / "cached.txt"
    cached.write_text("still here\n")
    big = ubiq.docs / "big.bin"
    data = os.urandom(2 * 1024 * 1024)
    big.write_bytes(data)
    ubiq.sync()
    ubiq.run("evict", big)
    with Offline(ubiq):
        # The mount stays read-write; the change waits in the queue with a visible error.
        (ubiq.docs / "offline.txt").write_text("written offline\n")
        os.mkdir(ubiq.docs / "offline-dir")
        assert cached.read_text() == "still here\n"
        wait_for(lambda: ubiq.status()[0]["queue"]["failing"], timeout=20, what="upload error while offline")
        err = ubiq.status()[0]["queue"]["failing"][0]["error"]
        assert "unavailable" in err or "unreachable" in err, err
        # An evicted file cannot be read: a clear errno after a bounded wait, no hang.
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            read(big)
        assert e.value.errno == errno.EHOSTUNREACH
        assert time.monotonic() - t0 < 30
        assert os.stat(big).st_size == len(data)  # metadata still local
    ubiq.sync(timeout=60)
    item = ubiq.cloud_item_for(ubiq.docs / "offline.txt")
    assert item is not None and not item["deleted"]
    assert ubiq.cloud_content(item["itemID"]) == b"written offline\n"
    assert sha256_file(big) == sha256(data)


def test_offline_edits_on_both_devices_converge(pair):
    a, b = pair
    (a.docs / "shared.txt").write_text("base\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "shared.txt").exists(), what="shared.txt on b")
    with Offline(a, b):
        (a.docs / "shared.txt").write_text("A offline\n")
        (a.docs / "only-a.txt").write_text("a\n")
        time.sleep(0.05)
        (b.docs / "shared.txt").write_text("B offline, later\n")
        (b.docs / "only-b.txt").write_text("b\n")
        time.sleep(2)
    settle(a, b, rounds=3)
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == ["only-a.txt", "only-b.txt", "shared.txt"],
                 timeout=20, what=f"all files on {u.root.name}")
        wait_for(lambda: read(u.docs / "shared.txt") == b"B offline, later\n", what=f"winner on {u.root.name}")
        wait_for(lambda: Ubiq.xattr(u.docs / "shared.txt", "user.ubiq.conflicts") == "1", what="conflict kept")


def account_status(u: Ubiq) -> dict:
    return json.loads(u.run("account", "status", "--json").stdout)


def test_identity_token_signout_and_account_isolation(ubiq):
    import ubiqstack

    first = account_status(ubiq)
    assert first["signedIn"] and len(first["identityToken"]) == 32
    (ubiq.docs / "private.txt").write_text("account one only\n")
    # Signing out waits for the upload, unmounts, removes this account's local data.
    ubiq.run("account", "logout", timeout=180)
    assert str(ubiq.mnt) not in conftest.ubiq_mounts()
    assert not (ubiq.state / "accounts" / first["account"]).exists()
    item = ubiq.cloud_item("documents")
    assert item is not None  # the cloud still has the account's data...
    names = {i["name"] for i in ubiq.cloud_items(include_deleted=False)}
    assert "private.txt" in names  # ...including the upload that finished before sign-out

    acct = conftest._cloud_account(ubiq.cloud_key)
    other = f"other{os.getpid()}{int(time.time())}"
    token = ubiqstack.create_account(acct.storage, other)
    ubiq.run("account", "login", "--server", acct.servers[0].url, "--token", token, "--device", "dev-other")
    second = account_status(ubiq)
    assert second["account"] == other and second["identityToken"] != first["identityToken"]
    ubiq.run("mount", ubiq.container, ubiq.mnt, "--upload-delay-ms", "100")
    try:
        assert os.listdir(ubiq.docs) == []
        assert ubiq.run("find", "private*", check=False).returncode != 0
    finally:
        ubiq.run("unmount", ubiq.mnt)
    ubiq.run("account", "logout")
    # Back to the first account: same identity as before, its data comes back from the cloud.
    ubiq.account = acct.name
    ubiq.mount()
    assert account_status(ubiq)["identityToken"] == first["identityToken"]
    wait_for(lambda: (ubiq.docs / "private.txt").exists(), what="first account's data")
    assert read(ubiq.docs / "private.txt") == b"account one only\n"


def test_signout_refuses_while_uploads_pending_unless_discard(ubiq):
    ubiq.unmount()
    ubiq.mount("--upload-delay-ms", "600000")
    (ubiq.docs / "unsent.txt").write_text("not uploaded yet\n")
    cp = ubiq.run("account", "logout", "--timeout", "1", check=False)
    assert cp.returncode != 0 and "pending" in cp.stderr and cp.stderr.startswith("ubiqfs:")
    assert str(ubiq.mnt) in conftest.ubiq_mounts()  # nothing happened
    assert read(ubiq.docs / "unsent.txt") == b"not uploaded yet\n"
    ubiq.run("account", "logout", "--discard")
    assert str(ubiq.mnt) not in conftest.ubiq_mounts()
    assert not (ubiq.state / "accounts").exists() or not any((ubiq.state / "accounts").iterdir())


def test_sync_wait_stops_with_one_line_when_the_server_signed_the_device_out(ubiq):
    """A revoked token is no network error: `sync --wait` says at once that the device must sign
    in again, instead of waiting for its timeout; the change stays queued here, nothing lost."""
    import ubiqstack

    (ubiq.docs / "before.txt").write_text("before\n")
    ubiq.sync()
    acct = conftest._cloud_account(ubiq.cloud_key)
    ubiqstack.run_cli(
        "server", "token", "revoke", acct.name, "--device", f"dev-{ubiq.root.name}", *acct.storage.args(),
        env_extra=acct.storage.env(),
    )
    (ubiq.docs / "after.txt").write_text("after\n")
    started = time.time()
    cp = ubiq.run("sync", "--wait", "--timeout", "60", check=False)
    assert cp.returncode != 0 and time.time() - started < 30, cp
    last = cp.stderr.strip().splitlines()[-1]
    assert last.startswith("ubiqfs:") and "not signed in" in last and "account login" in last, cp.stderr
    assert (ubiq.docs / "after.txt").read_text() == "after\n"
    assert ubiq.xattr(ubiq.docs / "after.txt", "user.ubiq.uploaded") == "0"
    assert "not signed in" in ubiq.xattr(ubiq.docs / "after.txt", "user.ubiq.upload_error")


@pytest.mark.parametrize("edited", [["a.txt", "b.txt"], ["b.txt"]])
def test_names_swapped_on_one_device_while_the_other_edits_stay_swapped(pair, edited):
    """A swaps two names (mv a t; mv b a; mv t b) while the server is down; B, which has not
    seen that, appends to one or both. Once the server is back, both devices show the swap,
    with B's lines in the files they went to, and no "a 2"/"b 2"."""
    a, b = pair
    (a.docs / "a.txt").write_text("first\n")
    (a.docs / "b.txt").write_text("second\n")
    settle(a, b)
    wait_for(lambda: (b.docs / "b.txt").exists(), what="a.txt and b.txt on b")
    # B downloads both (an evicted file cannot be opened while the cloud is away).
    assert read(b.docs / "a.txt") == b"first\n" and read(b.docs / "b.txt") == b"second\n"
    with Offline(a, b):
        os.rename(a.docs / "a.txt", a.docs / "t.txt")
        os.rename(a.docs / "b.txt", a.docs / "a.txt")
        os.rename(a.docs / "t.txt", a.docs / "b.txt")
        for name in edited:
            with open(b.docs / name, "a") as f:
                f.write(f"B's line in {name}\n")
        time.sleep(2)
    settle(a, b, rounds=3)
    # The file that was b.txt is a.txt now, and the other way round; B's line went with the file.
    expected = {
        "a.txt": b"second\n" + (b"B's line in b.txt\n" if "b.txt" in edited else b""),
        "b.txt": b"first\n" + (b"B's line in a.txt\n" if "a.txt" in edited else b""),
    }
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == ["a.txt", "b.txt"], timeout=20,
                 what=f"the two names on {u.root.name}: {sorted(os.listdir(u.docs))}")
        for name, data in expected.items():
            wait_for(lambda: read(u.docs / name) == data, timeout=20,
                     what=f"{name} on {u.root.name}: {read(u.docs / name)!r}")
    assert a.item_id(a.docs / "a.txt") == b.item_id(b.docs / "a.txt")


def test_names_rotated_on_one_device_while_the_other_edits_one_offline_stay_rotated(pair):
    """A rotates three names (a->b, b->c, c->a) while the server is down; B, offline too, appends
    to b, and comes back only after A's rotation is in the cloud. Every device shows the
    rotation, B's line went with its file, and no "x 2" appears."""
    a, b = pair
    for name in ("a", "b", "c"):
        (a.docs / name).write_text(f"{name}\n")
    settle(a, b)
    wait_for(lambda: sorted(os.listdir(b.docs)) == ["a", "b", "c"], what="a, b and c on b")
    assert read(b.docs / "b") == b"b\n"  # downloaded: an evicted file cannot be opened offline
    with Offline(a, b):
        os.rename(a.docs / "a", a.docs / "t")
        os.rename(a.docs / "c", a.docs / "a")
        os.rename(a.docs / "b", a.docs / "c")
        os.rename(a.docs / "t", a.docs / "b")
        with open(b.docs / "b", "a") as f:
            f.write("B's line\n")
        b.unmount()
    a.sync(timeout=60)
    b.mount(*DELAY)
    settle(a, b, rounds=3)
    expected = {"a": b"c\n", "b": b"a\n", "c": b"b\nB's line\n"}
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == ["a", "b", "c"], timeout=20,
                 what=f"the three names on {u.root.name}: {sorted(os.listdir(u.docs))}")
        for name, data in expected.items():
            wait_for(lambda: read(u.docs / name) == data, timeout=20,
                     what=f"{name} on {u.root.name}: {read(u.docs / name)!r}")


def test_a_rename_made_offline_onto_a_name_made_meanwhile_elsewhere_yields(pair):
    """B renames draft.txt to report.txt while the server is down and unmounts; A then makes its
    own report.txt, which reaches the cloud first. B comes back and reads the feed before it
    commits: A's report.txt keeps its name (and its cloud version: B's sync never renames it),
    B's renamed file becomes "report 2.txt" on both devices, both contents kept."""
    a, b = pair
    (b.docs / "draft.txt").write_text("B's draft\n")
    settle(a, b)
    wait_for(lambda: (a.docs / "draft.txt").exists(), what="draft.txt on a")
    # B's upload waits a minute: its rename must not reach the cloud before B comes back.
    b.unmount()
    b.mount("--upload-delay-ms", "60000")
    with Offline(a, b):
        os.rename(b.docs / "draft.txt", b.docs / "report.txt")
        b.unmount()
    (a.docs / "report.txt").write_text("A's report\n")
    a.sync(timeout=60)
    etag = a.xattr(a.docs / "report.txt", "user.ubiq.etag")
    b.mount(*DELAY)
    settle(a, b, rounds=3)
    expected = {"report 2.txt": b"B's draft\n", "report.txt": b"A's report\n"}
    for u in (a, b):
        wait_for(lambda: sorted(os.listdir(u.docs)) == sorted(expected), timeout=20,
                 what=f"two names on {u.root.name}: {sorted(os.listdir(u.docs))}")
        for name, data in expected.items():
            assert read(u.docs / name) == data, (u.root.name, name)
    assert a.xattr(a.docs / "report.txt", "user.ubiq.etag") == etag, "A's report.txt was renamed and back"
    assert a.item_id(a.docs / "report 2.txt") == b.item_id(b.docs / "report 2.txt")
