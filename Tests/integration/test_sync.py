"""What reaches the embedded cloud: content, metadata, deletes, local-only items."""

from __future__ import annotations

import base64
import os
import random
import stat
import time

from helpers import read_file, sha256, sha256_file, write_file

MiB = 1 << 20


def live_names(ubiq) -> set[str]:
    return {i["name"] for i in ubiq.cloud_items(include_deleted=False)}


def assert_cloud_matches_local(ubiq, path) -> dict:
    """The cloud's latest version of a local file has the same bytes, size, mode and mtime."""
    item = ubiq.cloud_item_for(path)
    assert item is not None, f"{path} is not in the cloud"
    assert not item["deleted"], f"{path} is deleted in the cloud"
    st = os.lstat(path)
    assert item["name"] == os.path.basename(path)
    assert item["size"] == st.st_size
    assert item["mode"] & 0o7777 == stat.S_IMODE(st.st_mode)
    assert item["mtimeNs"] == st.st_mtime_ns
    assert sha256(ubiq.cloud_content(item["itemID"])) == sha256_file(path)
    assert ubiq.xattr(path, "user.ubiq.etag") == item["etag"]
    return item


def test_uploaded_content_equals_local_content(ubiq):
    rng = random.Random(1)
    (ubiq.docs / "dir" / "sub").mkdir(parents=True)
    files = {
        "empty.txt": b"",
        "one.txt": b"1",
        "text.txt": b"hello cloud\n" * 5000,
        "dir/random-64k.bin": rng.randbytes(64 * 1024),
        "dir/sub/random-5m.bin": rng.randbytes(5 * MiB + 123),
        "dir/sub/zeros.bin": bytes(3 * MiB),
    }
    for rel, data in files.items():
        write_file(ubiq.docs / rel, data)
    ubiq.sync()
    for rel, data in files.items():
        item = assert_cloud_matches_local(ubiq, ubiq.docs / rel)
        assert sha256(ubiq.cloud_content(item["itemID"])) == sha256(data)
        assert ubiq.xattr(ubiq.docs / rel, "user.ubiq.uploaded") == "1"
    # Directory structure: parents are the directories' items.
    dir_id = ubiq.item_id(ubiq.docs / "dir")
    sub_id = ubiq.item_id(ubiq.docs / "dir" / "sub")
    assert ubiq.cloud_item(dir_id)["parentID"] == "documents"
    assert ubiq.cloud_item(dir_id)["kind"] == 2
    assert ubiq.cloud_item(sub_id)["parentID"] == dir_id
    assert ubiq.cloud_item_for(ubiq.docs / "dir" / "sub" / "zeros.bin")["parentID"] == sub_id


def test_new_versions_replace_old_ones_in_the_cloud(ubiq):
    p = ubiq.docs / "doc.txt"
    write_file(p, "v1\n")
    ubiq.sync()
    item_id = ubiq.item_id(p)
    etag1 = ubiq.cloud_item(item_id)["etag"]
    write_file(p, "v2 is longer\n")
    ubiq.sync()
    assert ubiq.cloud_content(item_id) == b"v2 is longer\n"
    write_file(p, "appended\n", mode="ab")
    ubiq.sync()
    assert ubiq.cloud_content(item_id) == b"v2 is longer\nappended\n"
    os.truncate(p, 3)
    ubiq.sync()
    assert ubiq.cloud_content(item_id) == b"v2 "
    assert ubiq.item_id(p) == item_id
    assert ubiq.cloud_item(item_id)["etag"] != etag1
    assert_cloud_matches_local(ubiq, p)


def test_metadata_reaches_the_cloud(ubiq):
    p = ubiq.docs / "meta.txt"
    write_file(p, "m")
    os.chmod(p, 0o640)
    os.utime(p, ns=(1_300_000_000_000_000_000, 1_200_000_000_123_456_789))
    os.setxattr(p, "user.color", b"red")
    os.setxattr(p, "user.binary", b"\x00\xff\x10")
    os.symlink("meta.txt", ubiq.docs / "link")
    ubiq.sync()
    item = assert_cloud_matches_local(ubiq, p)
    assert item["mode"] & 0o7777 == 0o640
    assert item["mtimeNs"] == 1_200_000_000_123_456_789
    xattrs = {k.removeprefix("user."): base64.b64decode(v) for k, v in item["xattrs"].items()}
    assert xattrs == {"color": b"red", "binary": b"\x00\xff\x10"}
    # (user.* xattrs cannot be read on symlinks, so find the link's record by name.)
    links = [i for i in ubiq.cloud_items(include_deleted=False) if i["name"] == "link"]
    assert len(links) == 1
    assert links[0]["kind"] == 3 and links[0]["symlinkTarget"] == "meta.txt"
    assert links[0]["parentID"] == "documents"
    # Removing an xattr and renaming are new versions too.
    os.removexattr(p, "user.color")
    os.rename(p, ubiq.docs / "renamed.txt")
    ubiq.sync()
    item = ubiq.cloud_item(item["itemID"])
    assert item["name"] == "renamed.txt"
    assert {k.removeprefix("user.") for k in item["xattrs"]} == {"binary"}


def test_move_between_directories_in_the_cloud(ubiq):
    (ubiq.docs / "a").mkdir()
    (ubiq.docs / "b").mkdir()
    write_file(ubiq.docs / "a" / "f.txt", "f")
    ubiq.sync()
    item_id = ubiq.item_id(ubiq.docs / "a" / "f.txt")
    os.rename(ubiq.docs / "a" / "f.txt", ubiq.docs / "b" / "g.txt")
    os.rename(ubiq.docs / "a", ubiq.docs / "b" / "a-moved")
    ubiq.sync()
    assert ubiq.item_id(ubiq.docs / "b" / "g.txt") == item_id
    item = ubiq.cloud_item(item_id)
    assert item["name"] == "g.txt" and item["parentID"] == ubiq.item_id(ubiq.docs / "b")
    assert ubiq.cloud_item_for(ubiq.docs / "b" / "a-moved")["parentID"] == ubiq.item_id(ubiq.docs / "b")


def test_deleting_a_file_deletes_it_in_the_cloud(ubiq):
    keep, gone = ubiq.docs / "keep.txt", ubiq.docs / "gone.txt"
    write_file(keep, "keep")
    write_file(gone, "gone")
    ubiq.sync()
    gone_id = ubiq.item_id(gone)
    assert not ubiq.cloud_item(gone_id)["deleted"]
    os.unlink(gone)
    ubiq.sync()
    record = ubiq.cloud_item(gone_id)
    assert record is not None and record["deleted"] is True
    assert record["chunks"] == []
    assert live_names(ubiq) >= {"keep.txt"}
    assert "gone.txt" not in live_names(ubiq)
    assert ubiq.status()[0]["queue"]["pendingDeletes"] == 0


def test_deleting_a_tree_deletes_it_in_the_cloud(ubiq):
    top = ubiq.docs / "tree"
    ids = []
    for d in ["x", "x/y", "z"]:
        (top / d).mkdir(parents=True)
        write_file(top / d / "f.txt", d)
    ubiq.sync()
    for p in [top, *top.rglob("*")]:
        ids.append(ubiq.item_id(p))
    os.system(f"rm -rf '{top}'")
    assert not top.exists()
    ubiq.sync()
    for item_id in ids:
        assert ubiq.cloud_item(item_id)["deleted"] is True, item_id
    assert live_names(ubiq) == {"", "Documents"}


def test_deleted_before_upload_never_reaches_the_cloud(ubiq):
    ubiq.remount("--upload-delay-ms", "600000")
    write_file(ubiq.docs / "temp.txt", "short-lived")
    os.unlink(ubiq.docs / "temp.txt")
    ubiq.remount()
    ubiq.sync()
    assert "temp.txt" not in {i["name"] for i in ubiq.cloud_items()}


def test_nosync_items_never_reach_the_cloud(ubiq):
    write_file(ubiq.docs / "cache.nosync", "local only")
    (ubiq.docs / "build.nosync" / "obj").mkdir(parents=True)
    write_file(ubiq.docs / "build.nosync" / "obj" / "a.o", os.urandom(5000))
    write_file(ubiq.docs / "normal.txt", "synced")
    ubiq.sync()
    assert ubiq.xattr(ubiq.docs / "cache.nosync", "user.ubiq.excluded") == "1"
    assert ubiq.xattr(ubiq.docs / "build.nosync" / "obj" / "a.o", "user.ubiq.excluded") == "1"
    assert ubiq.xattr(ubiq.docs / "normal.txt", "user.ubiq.excluded") == "0"
    all_names = {i["name"] for i in ubiq.cloud_items()}
    assert "normal.txt" in all_names
    assert not all_names & {"cache.nosync", "build.nosync", "obj", "a.o"}, all_names
    for p in [ubiq.docs / "cache.nosync", ubiq.docs / "build.nosync" / "obj" / "a.o"]:
        assert ubiq.cloud_item_for(p) is None
    # Still fully usable locally, and nothing is pending.
    assert read_file(ubiq.docs / "cache.nosync") == b"local only"
    q = ubiq.status()[0]["queue"]
    assert (q["pendingItems"], q["pendingDeletes"]) == (0, 0)
    # Edits to local-only items stay local.
    write_file(ubiq.docs / "cache.nosync", "edited")
    ubiq.sync()
    assert "cache.nosync" not in {i["name"] for i in ubiq.cloud_items()}


def test_renaming_into_and_out_of_nosync(ubiq):
    p = ubiq.docs / "data.txt"
    write_file(p, "was synced")
    ubiq.sync()
    old_id = ubiq.item_id(p)
    # Becoming local-only removes it from the cloud (not from this device).
    os.rename(p, ubiq.docs / "data.txt.nosync")
    ubiq.sync()
    assert ubiq.cloud_item(old_id)["deleted"] is True
    assert read_file(ubiq.docs / "data.txt.nosync") == b"was synced"
    assert "data.txt.nosync" not in live_names(ubiq)
    # Leaving .nosync uploads it again, content included.
    write_file(ubiq.docs / "later.nosync", "now synced")
    os.rename(ubiq.docs / "later.nosync", ubiq.docs / "later.txt")
    ubiq.sync()
    assert_cloud_matches_local(ubiq, ubiq.docs / "later.txt")


def test_excluded_xattr_keeps_items_local(ubiq):
    p = ubiq.docs / "private.txt"
    write_file(p, "secret")
    ubiq.sync()
    item_id = ubiq.item_id(p)
    os.setxattr(p, "user.ubiq.excluded", b"1")
    ubiq.sync()
    assert ubiq.xattr(p, "user.ubiq.excluded") == "1"
    assert ubiq.cloud_item(item_id)["deleted"] is True
    write_file(p, "secret 2")
    ubiq.sync()
    assert "private.txt" not in live_names(ubiq)
    os.setxattr(p, "user.ubiq.excluded", b"0")
    ubiq.sync()
    assert_cloud_matches_local(ubiq, p)


def test_editor_style_saves_do_not_leave_temp_items(ubiq):
    p = ubiq.docs / "page.html"
    write_file(p, "<p>1</p>")
    ubiq.sync()
    item_id = ubiq.item_id(p)
    for i in range(2, 12):
        tmp = ubiq.docs / f".page.html.tmp{i}"
        write_file(tmp, f"<p>{i}</p>")
        os.rename(tmp, p)
    ubiq.sync()
    assert ubiq.item_id(p) == item_id
    assert ubiq.cloud_content(item_id) == b"<p>11</p>"
    assert {i["name"] for i in ubiq.cloud_items(include_deleted=False)} == {"", "Documents", "page.html"}


def test_unlinked_file_does_not_reappear_while_its_upload_is_in_flight(ubiq):
    """rm must make a name disappear at once, even if the file was being uploaded."""
    d = ubiq.docs / "churn"
    d.mkdir()
    reappeared = []
    for k in range(40):
        p = d / f"f{k}.bin"
        write_file(p, os.urandom(200_000))
        time.sleep(0.08 + (k % 10) * 0.01)  # around the upload delay: the upload is in flight
        os.unlink(p)
        deadline = time.time() + 0.6
        while time.time() < deadline:
            if p.name in os.listdir(d):
                reappeared.append(p.name)
                break
            time.sleep(0.02)
    assert reappeared == [], f"unlinked files listed again afterwards: {reappeared}"
    ubiq.sync()
    assert os.listdir(d) == []


def test_delete_and_recreate_while_uploading_syncs(ubiq):
    """rm + create of the same name, racing the upload of the old file: the new files must
    all reach the cloud (no stuck uploads, no 'name 2' copies)."""
    d = ubiq.docs / "recreate"
    d.mkdir()
    expected = {}
    for k in range(40):
        p = d / f"g{k}.txt"
        write_file(p, os.urandom(200_000))
        time.sleep(0.08 + (k % 10) * 0.01)
        os.unlink(p)
        expected[p.name] = f"new {k}\n".encode()
        write_file(p, expected[p.name])
    ubiq.sync()
    assert sorted(os.listdir(d)) == sorted(expected)
    for name, data in expected.items():
        assert read_file(d / name) == data
        assert ubiq.cloud_content(ubiq.item_id(d / name)) == data
    q = ubiq.status()[0]["queue"]
    assert q["failing"] == [] and q["pendingItems"] == 0
