"""Key-value store: `ubiqfs kv` on two devices sharing one cloud.

In server modes each device is signed in to the same account through its own `ubiqfs serve`
process; in the embedded mode both devices share the embedded cloud folder.
"""

import json
import subprocess
import time

import pytest

from conftest import CLOUD_MODE, UBIQFS_BIN, _cloud_account, another_device

SERVER_ONLY = pytest.mark.skipif(
    CLOUD_MODE == "embedded",
    reason="needs a server: the embedded cloud is a local folder that cannot go offline and has no accounts",
)


@pytest.fixture
def peer(ubiq, tmp_path_factory):
    """A second device of the same account (not mounted: the key-value store needs no mount)."""
    with another_device(ubiq, tmp_path_factory, "kvpeer") as d2:
        d2.ensure_cloud()
        yield d2


def kv(dev, *args, check=True):
    return dev.run("kv", *args, check=check)


def get(dev, key):
    cp = kv(dev, "get", key, check=False)
    return json.loads(cp.stdout) if cp.returncode == 0 else None


def ls(dev) -> dict:
    return json.loads(kv(dev, "ls", "--json").stdout)


def now_ns() -> int:
    return time.time_ns()


def watch(dev, count: int):
    return subprocess.Popen(
        [UBIQFS_BIN, "kv", "watch", "--count", str(count), "--interval", "0.2"],
        env=dev.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def read_line(proc, timeout=30) -> dict:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        raise AssertionError(f"kv watch printed nothing in {timeout}s; stderr: {proc.stderr.read()}")
    line = proc.stdout.readline()
    assert line, f"kv watch ended; stderr: {proc.stderr.read()}"
    return json.loads(line)


def test_values_and_propagation(ubiq, peer):
    kv(ubiq, "set", "n", "42")
    kv(ubiq, "set", "s", '"text"')
    kv(ubiq, "set", "word", "hello")  # not JSON: stored as a string
    kv(ubiq, "set", "obj", '{"a": [1, 2.5, true, null]}')
    data = ubiq.root / "blob.bin"
    data.write_bytes(b"\x00\x01binary")
    kv(ubiq, "set", "bin", "--data", data)
    assert get(peer, "n") == 42
    assert get(peer, "s") == "text"
    assert get(peer, "word") == "hello"
    assert get(peer, "obj") == {"a": [1, 2.5, True, None]}
    assert get(peer, "bin") == {"$data": "AAFiaW5hcnk="}
    kv(peer, "rm", "n")
    assert get(ubiq, "n") is None
    cp = kv(ubiq, "get", "n", check=False)
    assert cp.returncode == 1 and cp.stderr.strip() == "ubiqfs: no such key: n"
    lines = kv(ubiq, "ls").stdout.splitlines()
    assert "s\t\"text\"" in lines and len(lines) == 4
    # Shared across apps using the same container id, separate per container.
    kv(ubiq, "set", "other", "1", "--container", "iCloud.other")
    assert get(peer, "other") is None
    assert json.loads(kv(peer, "get", "other", "--container", "iCloud.other").stdout) == 1


@pytest.mark.parametrize(
    "value, why",
    [
        ("123456789012345678901234567890", "64-bit"),
        ("-99999999999999999999", "64-bit"),
        ('[1, {"n": 18446744073709551616}]', "64-bit"),
        ("[" * 600 + "]" * 600, "JSON"),
        ("[1,", "JSON"),
        ('{"a": 1', "JSON"),
        ('"unterminated', "JSON"),
    ],
)
def test_a_value_that_is_not_what_it_looks_like_is_refused_not_changed(ubiq, value, why):
    # `--` ends the options: a negative number is a value, not an option.
    cp = kv(ubiq, "set", "--", "k", value, check=False)
    assert cp.returncode != 0, cp
    err = cp.stderr.strip()
    assert err.startswith("ubiqfs:") and "\n" not in err and why in err, err
    assert get(ubiq, "k") is None
    # The largest 64-bit integers and a quoted text stay exact.
    kv(ubiq, "set", "max", "9223372036854775807")
    kv(ubiq, "set", "--", "min", "-9223372036854775808")
    kv(ubiq, "set", "text", json.dumps(value))
    assert get(ubiq, "max") == 9223372036854775807 and get(ubiq, "min") == -9223372036854775808
    assert get(ubiq, "text") == value


def test_import_refuses_an_integer_past_64_bits_and_changes_nothing(ubiq):
    f = ubiq.root / "big.json"
    f.write_text('{"ok": 1, "big": [2, 99999999999999999999], "text": "99999999999999999999"}')
    cp = kv(ubiq, "import", f, check=False)
    err = cp.stderr.strip()
    assert cp.returncode != 0 and err.startswith("ubiqfs:") and "64-bit" in err and "\n" not in err, cp
    assert get(ubiq, "ok") is None and get(ubiq, "big") is None
    # In a string, as a double, or within range, numbers are imported as written.
    f.write_text('{"text": "99999999999999999999", "d": 1.5e300, "max": 9223372036854775807}')
    kv(ubiq, "import", f)
    assert get(ubiq, "text") == "99999999999999999999" and get(ubiq, "d") == 1.5e300
    assert get(ubiq, "max") == 9223372036854775807


def test_ls_quotes_keys_a_tab_or_line_break_would_make_ambiguous(ubiq):
    kv(ubiq, "set", "a\tb", "1")
    kv(ubiq, "set", "line\nbreak", "2")
    kv(ubiq, "set", '"quoted', "3")
    kv(ubiq, "set", "plain", "4")
    lines = kv(ubiq, "ls").stdout.splitlines()
    assert lines == ['"\\"quoted"\t3', '"a\\tb"\t1', '"line\\nbreak"\t2', "plain\t4"], lines
    # Each line splits at its last tab into a key (JSON when quoted) and a JSON value.
    for line in lines:
        key, value = line.rsplit("\t", 1)
        key = json.loads(key) if key.startswith('"') else key
        assert get(ubiq, key) == json.loads(value)


def test_last_writer_by_timestamp_wins(ubiq, peer):
    # The peer's write is newer (by its clock) although it reaches the cloud first.
    kv(peer, "set", "k", '"newer"', "--timestamp", now_ns() + 3600 * 10**9)
    kv(ubiq, "set", "k", '"older"')
    assert get(ubiq, "k") == "newer"
    assert get(peer, "k") == "newer"
    # An older write arriving first loses to a newer one arriving later.
    kv(ubiq, "set", "j", '"first"', "--timestamp", now_ns() - 3600 * 10**9)
    kv(peer, "set", "j", '"second"')
    assert get(ubiq, "j") == "second"
    assert get(peer, "j") == "second"
    # A removal is a write too: an older set cannot bring the key back.
    kv(peer, "rm", "k", "--timestamp", now_ns() + 7200 * 10**9)
    kv(ubiq, "set", "k", '"again"')
    assert get(ubiq, "k") is None and get(peer, "k") is None


def test_limits(ubiq, peer):
    kv(ubiq, "set", "keep", "1")
    before = ls(ubiq)
    cp = kv(ubiq, "set", "k" * 65, "1", check=False)
    assert cp.returncode == 1 and "65 bytes (maximum 64)" in cp.stderr and "nothing changed" in cp.stderr
    kv(ubiq, "set", "é" * 32, "1")  # 64 bytes UTF-8: allowed
    big = ubiq.root / "big.bin"
    big.write_bytes(b"x" * 800_000)  # 1.07 MB as base64
    cp = kv(ubiq, "set", "big", "--data", big, check=False)
    assert cp.returncode == 1 and "quota exceeded" in cp.stderr, cp.stderr
    assert get(ubiq, "big") is None and get(peer, "big") is None
    # 1024 keys fit; the 1025th does not.
    many = {f"key{i}": i for i in range(1022)}
    f = ubiq.root / "many.json"
    f.write_text(json.dumps(many))
    kv(ubiq, "import", f)
    assert len(ls(peer)) == 1024
    cp = kv(peer, "set", "one-more", "1", check=False)
    assert cp.returncode == 1 and "1025 keys (maximum 1024)" in cp.stderr, cp.stderr
    assert get(peer, "one-more") is None and get(ubiq, "one-more") is None
    assert len(ls(ubiq)) == 1024 and before.items() <= ls(ubiq).items()
    # Replacing an existing key is not a new key.
    kv(peer, "set", "key0", '"changed"')
    assert get(ubiq, "key0") == "changed"


def test_watch_initial_sync_and_server_change(ubiq, peer):
    kv(ubiq, "set", "a", "1")
    w = watch(peer, 4)
    try:
        first = read_line(w)
        assert first["reason"] == "initial_sync" and first["keys"] == ["a"]
        assert first["container"] == "iCloud.default" and first["time"]
        kv(ubiq, "set", "b", '"x"')
        second = read_line(w)
        assert second["reason"] == "server_change" and second["keys"] == ["b"], second
        # An import is pushed key by key: a peer may see its keys in one notification or in two.
        kv(ubiq, "import", _write(ubiq, "two.json", {"c": 1, "d": 2}))
        third = read_line(w)
        assert third["reason"] == "server_change" and set(third["keys"]) <= {"c", "d"}, third
        if sorted(third["keys"]) == ["c", "d"]:
            kv(ubiq, "set", "e", "5")
            expected = ["e"]
        else:
            expected = sorted({"c", "d"} - set(third["keys"]))
        fourth = read_line(w)
        assert fourth["reason"] == "server_change" and sorted(fourth["keys"]) == expected, fourth
        assert w.wait(timeout=10) == 0  # --count 4: the fourth line ends the watch
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()


def own_server(dev):
    """The `ubiqfs serve` process this device is signed in to (its peer uses the other one)."""
    url = json.loads((dev.state / "account.json").read_text())["server"]
    acct = _cloud_account(dev.cloud_key)
    if not acct.own_servers:
        pytest.skip("server-scale servers are shared by the session; not stopped here")
    return next(s for s in acct.servers if s.url == url)


def _bytes(dev, name, data: bytes):
    p = dev.root / name
    p.write_bytes(data)
    return p


def _write(dev, name, obj):
    p = dev.root / name
    p.write_text(json.dumps(obj))
    return p


@SERVER_ONLY
def test_offline_writes_sync_later(ubiq, peer):
    kv(ubiq, "set", "seen", "1")
    assert get(ubiq, "seen") == 1
    server = own_server(ubiq)
    server.stop()
    try:
        cp = kv(ubiq, "set", "offline", '"written offline"')
        assert "saved locally" in cp.stderr
        assert get(ubiq, "offline") == "written offline"  # offline read, local copy
        assert get(ubiq, "seen") == 1
    finally:
        server.start()
    # The mount daemon (or the next kv command) pushes the queued write once the cloud is back.
    deadline = time.time() + 15
    while get(peer, "offline") is None and time.time() < deadline:
        time.sleep(0.3)
    assert get(peer, "offline") == "written offline"
    assert get(ubiq, "offline") == "written offline"


@SERVER_ONLY
def test_offline_write_over_the_server_limit_is_rejected(ubiq, peer):
    server = own_server(ubiq)
    get(ubiq, "x")  # first sync of the mirror (the mount daemon's sync may have done it)
    w = watch(ubiq, 1)
    try:
        time.sleep(0.5)  # the watch has started
        server.stop()
        try:
            # Each fits alone; together they exceed 1 MB. The peer's reaches the cloud first.
            kv(ubiq, "set", "mine", "--data", _bytes(ubiq, "mine.bin", b"m" * 450_000))  # 600 KB as base64
            kv(peer, "set", "theirs", "--data", _bytes(peer, "theirs.bin", b"t" * 450_000))
        finally:
            server.start()
        line = read_line(w, timeout=60)
        assert line["reason"] == "quota_violation" and line["keys"] == ["mine"], line
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    assert get(ubiq, "mine") is None and get(peer, "mine") is None
    assert len(get(ubiq, "theirs")["$data"]) == 600_000


@SERVER_ONLY
def test_account_change(ubiq, peer):
    import ubiqstack

    kv(ubiq, "set", "secret", '"first account"')
    ubiq.unmount()  # signing in to another account waits for unmounts
    w = watch(ubiq, 1)
    try:
        time.sleep(0.5)  # the watch has started
        acct = _cloud_account(ubiq.cloud_key)
        other = f"other{time.time_ns() % 10**8}"
        token = ubiqstack.create_account(acct.storage, other)
        ubiq.run("account", "logout")
        ubiq.run("account", "login", "--server", acct.servers[0].url, "--token", token, "--device", "dev-kv")
        line = read_line(w)
        assert line["reason"] == "account_change", line
        assert w.wait(timeout=10) == 0
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    assert get(ubiq, "secret") is None
    assert ls(ubiq) == {}
    kv(ubiq, "set", "secret", '"second account"')
    assert get(peer, "secret") == "first account"
    # Back to the first account: its values are there again.
    ubiq.run("account", "logout")
    ubiq.run("account", "login", "--server", acct.servers[1].url, "--token", acct.token, "--device", "dev-kv")
    assert get(ubiq, "secret") == "first account"
