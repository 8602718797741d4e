"""The content group: small-file copies and the upload drain, the 1 MiB delta, time to first
byte and streaming of an evicted file."""

from __future__ import annotations

import os
import time
from pathlib import Path

from common import MIB, Recorder, Sizes, Target, World, drop_caches, human_bytes, remove_tree, sh, timed


# --------------------------------------------------------------------------------------------
# content group: uploads and evicted files


def small_files_copy(src: Path, t: Target):
    """cp -r of a folder of small files, plus the upload drain; returns seconds."""
    secs = timed(lambda: (sh("cp", "-r", src, t.path / "small"), t.drain()))
    remove_tree(t.path / "small")
    t.drain()
    return secs


def write_random(path: Path, nbytes: int):
    """A file of nbytes random bytes (written 64 MiB at a time)."""
    with open(path, "wb") as fh:
        for _ in range(nbytes // (64 * MIB)):
            fh.write(os.urandom(64 * MIB))


def blob_bytes(w: World):
    """Bytes stored in the embedded cloud's blob store."""
    return sum(p.stat().st_size for p in (w.tmp / "ubiq-cloud" / "blobs").rglob("*") if p.is_file())


def ttfb(path: Path):
    """Seconds from open to the first 4 KiB read returning."""
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        fh.read(4096)
        return time.perf_counter() - t0


def read_all(path):
    """Reads a file sequentially in 1 MiB blocks, discarding the bytes."""
    sh("dd", f"if={path}", "of=/dev/null", "bs=1M", "status=none")


def content_rows(w: World, targets, sz: Sizes, rec: Recorder):
    """Upload drain (small files, one big file), delta upload, evicted TTFB and streaming."""
    big = human_bytes(sz.big_bytes)
    src = w.tmp / "small-src"
    src.mkdir()
    for i in range(sz.small_copy):
        (src / f"s{i:04}").write_bytes(os.urandom(4096))
    rec.row("cp_small", f"cp -r {sz.small_copy} small files (4 KiB) + upload drain", "s",
            {t.name: small_files_copy(src, t) for t in targets}, higher_is_better=False)

    # Upload drain of one big file: close -> everything in the cloud; ext4: cp + sync.
    data_file = w.tmp / "big.bin"
    write_random(data_file, sz.big_bytes)
    ubiq_file = w.ubiq_mnt / "Documents" / "big.bin"
    sh("cp", data_file, ubiq_file)
    t_drain = timed(w.drain_ubiq)
    t_raw = timed(lambda: (sh("cp", data_file, w.tmp / "raw-copy.bin"), os.sync()))
    rec.row("upload_drain", f"upload drain {big} after close (ext4: cp + sync)", "s",
            {"ext4": t_raw, "ubiqfs": t_drain}, higher_is_better=False)

    # 1 MiB edit inside the big file re-uploads a few chunks.
    before = blob_bytes(w)
    with open(ubiq_file, "r+b") as fh:
        fh.seek(sz.big_bytes // 2)
        fh.write(os.urandom(MIB))
    w.drain_ubiq()
    rec.row("edit_delta", f"1 MiB edit in {big}: bytes re-uploaded", "% of file",
            {"ubiqfs": 100 * (blob_bytes(w) - before) / sz.big_bytes}, higher_is_better=False)

    # Evicted file: time to first byte and streaming, against a raw cold read of the same bytes.
    w.ubiq("evict", ubiq_file)
    drop_caches()
    first = ttfb(ubiq_file)
    w.ubiq("download", ubiq_file)  # let the first download finish, then evict again
    w.ubiq("evict", ubiq_file)
    drop_caches()
    t_stream = timed(lambda: read_all(ubiq_file))
    drop_caches()
    t_raw_read = timed(lambda: read_all(data_file))
    rec.row("evicted_ttfb", "evicted file: time to first byte (open + 4 KiB read)", "ms",
            {"ubiqfs": first * 1000}, higher_is_better=False)
    rec.row("evicted_stream", f"evicted file: streaming {big} (ext4: cold read)", "MiB/s",
            {"ext4": sz.big_bytes / MIB / t_raw_read, "ubiqfs": sz.big_bytes / MIB / t_stream})
    ubiq_file.unlink()
    w.drain_ubiq()
