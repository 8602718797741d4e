#!/usr/bin/env python3
"""The index's own floor for namespace operations: the statements one create and one unlink run
(`IndexStore.create`, `IndexStore.remove`), with the real schema and its triggers, in WAL mode
with synchronous=NORMAL as the daemon runs it, without FUSE and without the daemon. With
--batch K, K operations share one transaction: what a group commit would cost per operation.

    bench/index_floor.py [--files 10000] [--batch 1 --batch 16 ...] [--rounds 3] [--root /var/tmp]

The schema is taken from the index of a fresh mount of the release build ($UBIQFS_BIN), so it is
the one the daemon creates. Python's sqlite3 adds a few microseconds per statement: the figures
are an upper bound of SQLite's part, close enough to tell what one transaction per operation
allows against the FUSE limit's rates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from common import BIN

FILE, DIRECTORY = 1, 2


def daemon_schema(root: Path) -> list[str]:
    """The CREATE statements of the index a fresh mount makes (tables, indexes, triggers)."""
    state, mnt = root / "state", root / "mnt"
    mnt.mkdir(parents=True)
    env = dict(os.environ, UBIQFS_STATE_DIR=str(state), UBIQFS_CLOUD_DIR=str(root / "cloud"))
    subprocess.run([BIN, "mount", "iCloud.default", mnt], env=env, check=True, capture_output=True)
    subprocess.run([BIN, "unmount", mnt], env=env, check=True, capture_output=True)
    index = next(state.rglob("index.sqlite"))
    db = sqlite3.connect(index)
    rows = db.execute(
        "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%' "
        "AND name != 'grdb_migrations' ORDER BY CASE type WHEN 'table' THEN 0 WHEN 'index' THEN 1 ELSE 2 END"
    ).fetchall()
    db.close()
    return [r[0] for r in rows]


def open_index(path: Path, schema: list[str]) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.create_function("ubiq_reversed", 1, lambda s: None if s is None else s[::-1], deterministic=True)
    for pragma in ("journal_mode = WAL", "synchronous = NORMAL", "wal_autocheckpoint = 8000", "foreign_keys = ON"):
        db.execute(f"PRAGMA {pragma}")
    for statement in schema:
        db.execute(statement)
    db.execute("INSERT INTO eventOrigin VALUES (0)")
    return db


def insert(db: sqlite3.Connection, item_id: str, parent: int | None, name: str, kind: int) -> int:
    return db.execute(
        "INSERT INTO items(itemID, parent, name, kind, mode, uid, gid, size, mtimeNs, ctimeNs, atimeNs, content, "
        "revision) VALUES (?, ?, ?, ?, 420, 0, 0, 0, 1, 1, 1, 0, 1)", (item_id, parent, name, kind)).lastrowid


def measure(path: Path, schema: list[str], files: int, batch: int) -> tuple[float, float]:
    """Microseconds per create and per unlink of `files` files in one folder."""
    db = open_index(path, schema)
    db.execute("BEGIN")
    insert(db, "root", None, "", DIRECTORY)
    docs = insert(db, "documents", 1, "Documents", DIRECTORY)
    folder = insert(db, uuid.uuid4().hex, docs, "d", DIRECTORY)
    db.execute("COMMIT")

    def run(step) -> float:
        t0 = time.perf_counter()
        for i in range(files):
            if i % batch == 0:
                db.execute("BEGIN IMMEDIATE")
            step(i)
            if i % batch == batch - 1 or i == files - 1:
                db.execute("COMMIT")
        return 1e6 * (time.perf_counter() - t0) / files

    def create(i: int):
        db.execute("SELECT kind, name FROM items WHERE id = ?", (folder,)).fetchone()
        db.execute("SELECT id FROM items WHERE parent = ? AND name = ?", (folder, f"f{i}")).fetchone()
        inode = insert(db, uuid.uuid4().hex, folder, f"f{i}", FILE)
        db.execute("UPDATE items SET mtimeNs = ?, ctimeNs = ? WHERE id = ?", (i, i, folder))
        db.execute("INSERT INTO uploadQueue(item, enqueuedNs, nextAttemptNs) VALUES (?, ?, ?)", (inode, i, i))

    def unlink(i: int):
        row = db.execute("SELECT id, itemID FROM items WHERE parent = ? AND name = ?", (folder, f"f{i}")).fetchone()
        db.execute("SELECT attempts > 0 OR commitSent FROM uploadQueue WHERE item = ?", (row[0],)).fetchone()
        db.execute("SELECT parent, name FROM items WHERE id = ?", (folder,)).fetchone()
        db.execute("DELETE FROM items WHERE id = ?", (row[0],))
        db.execute("INSERT INTO uploadQueue(deleteItemID, enqueuedNs, nextAttemptNs) VALUES (?, ?, ?)", (row[1], i, i))
        db.execute("UPDATE items SET mtimeNs = ?, ctimeNs = ? WHERE id = ?", (i, i, folder))

    per_create = run(create)
    per_unlink = run(unlink)
    db.close()
    return per_create, per_unlink


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--batch", type=int, action="append", help="operations per transaction (default: 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", type=Path, default=Path("/var/tmp"))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ubiq-floor-", dir=args.root))
    try:
        schema = daemon_schema(root)
        for batch in args.batch or [1]:
            creates, unlinks = [], []
            for r in range(args.rounds):
                path = root / f"index-{batch}-{r}.sqlite"
                c, u = measure(path, schema, args.files, max(1, batch))
                creates.append(c)
                unlinks.append(u)
            c, u = statistics.median(creates), statistics.median(unlinks)
            print(f"{batch} per transaction: create {c:.0f} us ({1e6 / c:.0f}/s), unlink {u:.0f} us "
                  f"({1e6 / u:.0f}/s); medians of {args.rounds} rounds of {args.files} files", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
