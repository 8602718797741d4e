import Foundation
import GRDB
import UbiqCore
import UbiqSQLite

/// The client's SQLite index for one container on this device: every item's metadata (rowid =
/// inode), user xattrs, the durable upload queue and small key/value facts (device id, change
/// token). Every namespace change is all or nothing (a savepoint of the mount's batch, or its own
/// transaction), so a crash never leaves half a rename.
/// Sendable: the database pool serializes access; `uploadDelayNs` is set before use.
public final class IndexStore: @unchecked Sendable {
  public let pool: any DatabaseWriter
  public static let rootInode: Int64 = 1
  /// WAL frames after which a commit checkpoints the index.
  static let checkpointFrames = 8_000
  /// Deeper than any path the kernel can form (PATH_MAX / 2): ancestor walks stop here.
  static let maxDepth = 2048
  /// Uploads wait this long after the last change, so that temp files renamed or deleted quickly
  /// (editor saves, sqlite journals) never travel.
  public var uploadDelayNs: Int64 = 1_000_000_000
  /// The time every change recorded here is stamped with, and queue due times are counted in.
  public let clock: WallClock
  /// Where the ids of this device, of new items and of conflict versions come from.
  public let identifiers: IdentifierSource
  /// The connections of `readOne`.
  let statementReaders: StatementReaders
  /// The open transaction the mount's changes share, nil where each commits by itself.
  let batch: NamespaceBatch?
  /// Room kept aside in the index's folder for removals, renames and attribute changes on a
  /// full disk (`batchedWriteFreeingRoom`); nil for a read-only index.
  public let reserve: SpaceReserve?
  /// Whether `makeDurable` has synced the folder that holds the WAL's directory entry
  /// (guarded by `walDirectoryLock`).
  private var walDirectorySynced = false
  private let walDirectoryLock = NSLock()

  /// `statementObserver` is handed the SQL of every statement run (tests check query plans).
  /// `batching`: the namespace and content-record changes of the mount share write transactions
  /// (`batchedWrite`, `NamespaceBatch`), and a redo log a crash left is replayed here; only the
  /// index of the mount's daemon batches (nil: every change commits by itself).
  public init(
    path: String, readOnly: Bool = false, clock: WallClock = .system, identifiers: IdentifierSource = .random,
    batching: NamespaceBatchPolicy? = nil, statementObserver: (@Sendable (String) -> Void)? = nil
  ) throws {
    self.clock = clock
    self.identifiers = identifiers
    let capture = StatementCapture(observer: statementObserver)
    func configuration(readOnly: Bool) -> Configuration {
      var config = Configuration()
      // A lock another connection holds is tried again every millisecond for 10 s (SQLite's
      // own wait backs off to 100 ms between tries, and the mount's batches leave the write
      // lock free for moments only).
      config.busyMode = .callback { tries in
        usleep(1_000)
        return tries < 10_000
      }
      config.readonly = readOnly
      // A batch's transaction stays open between the writer's accesses.
      config.allowsUnsafeTransactions = !readOnly && batching != nil
      config.prepareDatabase { db in
        db.add(function: Self.reversedNameFunction)
        if !readOnly {
          try db.cached("PRAGMA synchronous = NORMAL").execute()
          // A checkpoint after every 8,000 WAL frames (32 MiB), not SQLite's 1,000: the pages
          // a burst of namespace changes keeps writing (the folder's row, the queue's and the
          // indexes' last leaves) are copied once per checkpoint, and its fsync of the database
          // file comes an eighth as often.
          try db.execute(sql: "PRAGMA wal_autocheckpoint = \(Self.checkpointFrames)")
          // A batch's changes run in savepoints, whose journal of the pages they change would
          // otherwise spill into a temporary file (a write per page).
          try db.execute(sql: "PRAGMA temp_store = MEMORY")
        }
        // The pool's readers are read-only whatever the configuration says: only the writer
        // captures a change's statements (and reports them to the observer too).
        if batching != nil && !db.configuration.readonly {
          try capture.install(on: db)
        } else if let statementObserver {
          db.trace(options: .statement) { event in
            if case .statement(let statement) = event { statementObserver(statement.sql) }
          }
        }
      }
      return config
    }
    // Another process's index (the CLI's beside a mount) reads what the mount answered.
    if batching == nil { RedoLog.waitForOpenBatch(path: path + "-redo") }
    reserve = readOnly ? nil : SpaceReserve(folder: (path as NSString).deletingLastPathComponent)
    if readOnly {
      pool = try DatabaseQueue(path: path, configuration: configuration(readOnly: true))
      statementReaders = StatementReaders(queues: [])
      batch = nil
    } else {
      pool = try DatabasePool.openAmongProcesses(path: path, configuration: configuration(readOnly: false))
      try Self.migrator.migrateAmongProcesses(pool)
      statementReaders = StatementReaders(
        queues: try (0..<StatementReaders.count).map { _ in
          try DatabaseQueue(path: path, configuration: configuration(readOnly: true))
        })
      if let batching {
        batch = try NamespaceBatch.open(pool: pool, databasePath: path, policy: batching, capture: capture)
      } else {
        batch = nil
      }
    }
    try Self.checkItemColumns(pool)
    if let batch {
      // The batch, not the index, is held weakly: a dropped index's batch commits nothing more.
      let pool = self.pool
      batch.scheduleCommit = { [weak batch] afterNs in
        DispatchQueue.global().asyncAfter(deadline: .now() + .nanoseconds(Int(afterNs))) { [weak batch] in
          guard let batch else { return }
          try? pool.writeWithoutTransaction { db in try batch.scheduledCommit(db) }
        }
      }
    }
  }

  /// Commits the changes of the open batch, if any.
  public func commitBatch() throws {
    guard let batch, batch.isOpen else { return }
    try pool.writeWithoutTransaction { db in try batch.commit(db) }
  }

  /// `ItemRow` decodes rows of `items` by position: the table's columns must start with
  /// `ItemRow.columnNames`, in that order.
  static func checkItemColumns(_ reader: any DatabaseReader) throws {
    let columns = try reader.read { db in try db.columns(in: "items").map(\.name) }
    guard columns.starts(with: ItemRow.columnNames) else {
      throw UbiqError.io("the index's items table has columns \(columns), not \(ItemRow.columnNames) first")
    }
  }

  /// `ubiq_reversed(name)`: the name with its Unicode scalars in reverse order (SQLite's GLOB
  /// and its text order work on code points, so a glob ending in literal text is, reversed, a
  /// prefix search). Registered on every connection; the index `items_by_reversed_name` uses it.
  static let reversedNameFunction = DatabaseFunction("ubiq_reversed", argumentCount: 1, pure: true) { values in
    String.fromDatabaseValue(values[0]).map(reversedScalars)
  }

  /// `s` with its Unicode scalars in reverse order.
  static func reversedScalars(_ s: String) -> String {
    var reversed = String.UnicodeScalarView()
    reversed.append(contentsOf: s.unicodeScalars.reversed())
    return String(reversed)
  }

  static var migrator: DatabaseMigrator {
    var m = DatabaseMigrator()
    m.registerMigration("v1") { db in
      try db.execute(
        sql: """
          CREATE TABLE items(
            id INTEGER PRIMARY KEY AUTOINCREMENT, itemID TEXT NOT NULL UNIQUE, parent INTEGER, name TEXT NOT NULL,
            kind INTEGER NOT NULL, mode INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
            size INTEGER NOT NULL, mtimeNs INTEGER NOT NULL, ctimeNs INTEGER NOT NULL, atimeNs INTEGER NOT NULL,
            symlinkTarget TEXT, etag TEXT, chunks TEXT, content INTEGER NOT NULL,
            revision INTEGER NOT NULL DEFAULT 0, syncedRevision INTEGER NOT NULL DEFAULT 0,
            pinned INTEGER NOT NULL DEFAULT 0, excluded INTEGER NOT NULL DEFAULT 0,
            lastUsedNs INTEGER NOT NULL DEFAULT 0,
            UNIQUE(parent, name));
          CREATE INDEX items_by_name ON items(name);
          CREATE TABLE xattrs(item INTEGER NOT NULL REFERENCES items(id) ON DELETE CASCADE, name TEXT NOT NULL,
            value BLOB NOT NULL, PRIMARY KEY(item, name));
          CREATE TABLE uploadQueue(
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            item INTEGER UNIQUE REFERENCES items(id) ON DELETE CASCADE,
            deleteItemID TEXT UNIQUE, deleteEtag TEXT,
            enqueuedNs INTEGER NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
            nextAttemptNs INTEGER NOT NULL DEFAULT 0, lastError TEXT, lastErrno INTEGER);
          CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
          """)
    }
    m.registerMigration("v2-conflicts") { db in
      try db.execute(sql: "ALTER TABLE items ADD COLUMN base TEXT")
      try db.execute(sql: "ALTER TABLE items ADD COLUMN conflicts TEXT")
    }
    // Files written through a handle since their last flush: the cache file may hold bytes the
    // items row does not describe yet. Found and recorded at the next mount after a crash.
    m.registerMigration("v3-dirty-content") { db in
      try db.execute(
        sql: "CREATE TABLE dirtyContent(item INTEGER PRIMARY KEY REFERENCES items(id) ON DELETE CASCADE)")
    }
    m.registerMigration("v4-held-remote") { db in
      // Remote records not applied yet because the item had local changes, newest per item.
      try db.execute(
        sql: "CREATE TABLE heldRemote(itemID TEXT PRIMARY KEY, changeSeq INTEGER NOT NULL, record BLOB NOT NULL)")
    }
    m.registerMigration("v5-delete-maybe-in-cloud") { db in
      // A delete of an item with no confirmed upload whose upload was attempted: the cloud may
      // have it (the attempt's reply was lost).
      try db.execute(sql: "ALTER TABLE uploadQueue ADD COLUMN deleteMaybeInCloud INTEGER NOT NULL DEFAULT 0")
    }
    // Files whose recorded revision's bytes may still be only in the page cache (recorded at
    // close without an fsync): a power loss can keep the record and lose the bytes. Cleared by
    // an fdatasync of the cache file (fsync on the mount, the uploader); re-checked at mount.
    m.registerMigration("v6-unsynced-content") { db in
      try db.execute(
        sql: """
          CREATE TABLE unsyncedContent(
            item INTEGER PRIMARY KEY REFERENCES items(id) ON DELETE CASCADE, revision INTEGER NOT NULL)
          """)
    }
    // The change log `ubiqfs watch` follows: written by triggers in the transaction of each
    // change (so nothing is missed or reported twice), the latest 10,000 to 11,000 kept.
    m.registerMigration("v7-events") { db in try db.execute(sql: ChangeEvent.schema) }
    // An item with no confirmed upload whose commit may have been sent: set, durably, before
    // the uploader sends it. A commit can reach the cloud while a crash or a power loss takes
    // every trace of it from the index; a later delete must then ask the cloud.
    m.registerMigration("v8-commit-sent") { db in
      try db.execute(sql: "ALTER TABLE uploadQueue ADD COLUMN commitSent INTEGER NOT NULL DEFAULT 0")
    }
    // A folder's subfolders, for its link count on every getattr: read from this index alone,
    // not from every entry of the folder.
    m.registerMigration("v9-children-by-kind") { db in
      try db.execute(sql: "CREATE INDEX items_by_parent_kind ON items(parent, kind)")
    }
    // A delete of a file that had unresolved conflict versions: the uploader keeps the
    // versions other devices wrote instead of deleting them with the file.
    m.registerMigration("v10-delete-keeps-versions") { db in
      try db.execute(sql: "ALTER TABLE uploadQueue ADD COLUMN deleteKeepsVersions INTEGER NOT NULL DEFAULT 0")
    }
    // Pinned files, found at mount without reading every row (a pinned file left dataless by
    // a crash is fetched again).
    m.registerMigration("v11-pinned") { db in
      try db.execute(sql: "CREATE INDEX items_pinned ON items(kind, content) WHERE pinned = 1")
    }
    // Names read backwards: `ubiqfs find '*.txt'` reads only the names that end so.
    m.registerMigration("v12-reversed-names") { db in
      try db.execute(sql: "CREATE INDEX items_by_reversed_name ON items(ubiq_reversed(name))")
    }
    // A folder's entries in inode order, readdir's cursor: each batch is a range of this index,
    // not a sort of every entry. A folder's subfolders alone, for its link count on every
    // getattr: only folders are in `items_subfolders`, so a file's create or delete writes
    // `items_by_parent` and not this one.
    m.registerMigration("v13-children-in-order") { db in
      try db.execute(
        sql: """
          DROP INDEX items_by_parent_kind;
          CREATE INDEX items_by_parent ON items(parent);
          CREATE INDEX items_subfolders ON items(parent, kind) WHERE kind = \(ItemKind.directory.rawValue);
          """)
    }
    // Items this device deleted and the cloud deleted too (or whose tombstone an automatic
    // rename's commit met), with the change sequence of the item's tombstone, until the change
    // feed has passed it (`RemotePlanner.decide`'s `deletedHere`).
    m.registerMigration("v14-deleted-here") { db in
      try db.execute(sql: "CREATE TABLE deletedHere(itemID TEXT PRIMARY KEY, upTo INTEGER NOT NULL)")
    }
    // Items whose newest local revision only gives the cloud a name this device's sync chose
    // to settle a name collision ("name 2"), not a user's change: such a revision does not win
    // over a delete made elsewhere (`yieldToDelete`).
    m.registerMigration("v15-automatic-renames") { db in
      try db.execute(
        sql: """
          CREATE TABLE automaticRenames(
            item INTEGER PRIMARY KEY REFERENCES items(id) ON DELETE CASCADE, revision INTEGER NOT NULL)
          """)
    }
    // Where the user saw an item they deleted, and its mode (`ItemPlace`, JSON): a newer
    // version of this device's own that the delete meets is the one they deleted only if it
    // is still there so.
    m.registerMigration("v16-delete-seen-place") { db in
      try db.execute(sql: "ALTER TABLE uploadQueue ADD COLUMN deleteSeenPlace TEXT")
    }
    // The revision an item with no confirmed upload had when its entry was first marked as
    // possibly in the cloud (`markCommitsSent`): the base of a merge whose first commit's reply
    // was lost.
    m.registerMigration("v17-commit-sent-revision") { db in
      try db.execute(sql: "ALTER TABLE uploadQueue ADD COLUMN commitSentRevision INTEGER")
    }
    // Where an item was in the commits of it sent since its last stored one (`noteSent`,
    // `QueueEntry.unansweredPlaces`).
    m.registerMigration("v18-sent-places") { db in
      try db.execute(sql: "ALTER TABLE uploadQueue ADD COLUMN sentPlaces TEXT")
    }
    // Records from the cloud that break a rule of the cloud's tree (`CloudItem.brokenRule`),
    // newest per item, until a later record of the item replaces them (`ubiqfs status`).
    m.registerMigration("v19-refused-remote") { db in
      try db.execute(
        sql: """
          CREATE TABLE refusedRemote(
            itemID TEXT PRIMARY KEY, changeSeq INTEGER NOT NULL, name TEXT NOT NULL, reason TEXT NOT NULL)
          """)
    }
    // The tree's rules, kept by the index itself: a bug that would break one makes its
    // transaction fail (an error where it happened) instead of storing an item no path
    // reaches. Every item but the root has a folder that exists and is a folder, a folder
    // with items cannot be deleted, and a move cannot put a folder below itself.
    m.registerMigration("v20-tree-rules") { db in
      try db.execute(
        sql: """
          CREATE TRIGGER items_parent_exists BEFORE INSERT ON items
          WHEN NEW.parent IS NOT NULL
            AND NOT EXISTS (SELECT 1 FROM items WHERE id = NEW.parent AND kind = \(ItemKind.directory.rawValue))
          BEGIN SELECT RAISE(ABORT, 'tree rule: an item''s folder must exist'); END;
          CREATE TRIGGER items_moved_parent_exists BEFORE UPDATE OF parent ON items
          WHEN NEW.parent IS NOT OLD.parent AND NEW.parent IS NOT NULL
            AND NOT EXISTS (SELECT 1 FROM items WHERE id = NEW.parent AND kind = \(ItemKind.directory.rawValue))
          BEGIN SELECT RAISE(ABORT, 'tree rule: an item''s folder must exist'); END;
          CREATE TRIGGER items_no_cycle BEFORE UPDATE OF parent ON items
          WHEN NEW.parent IS NOT OLD.parent AND NEW.kind = \(ItemKind.directory.rawValue) AND EXISTS (
            WITH RECURSIVE above(id, depth) AS (
              SELECT NEW.parent, 0
              UNION ALL
              SELECT items.parent, above.depth + 1 FROM items JOIN above ON items.id = above.id
              WHERE items.parent IS NOT NULL AND above.depth < 4096)
            SELECT 1 FROM above WHERE id = NEW.id)
          BEGIN SELECT RAISE(ABORT, 'tree rule: a folder cannot be moved below itself'); END;
          CREATE TRIGGER items_folder_empty_when_deleted BEFORE DELETE ON items
          WHEN OLD.kind = \(ItemKind.directory.rawValue) AND EXISTS (SELECT 1 FROM items WHERE parent = OLD.id)
          BEGIN SELECT RAISE(ABORT, 'tree rule: a folder with items cannot be deleted'); END;
          """)
    }
    // Since when an entry has waited without an attempt: its changes in quick succession go as
    // one, but not past `maxCoalescingNs` after this (`enqueue`).
    // (An entry queued before it has none: it counts from its `enqueuedNs`.)
    m.registerMigration("v21-waiting-since") { db in
      try db.execute(sql: "ALTER TABLE uploadQueue ADD COLUMN waitingSinceNs INTEGER")
    }
    return m
  }

  // MARK: - facts

  public func meta(_ key: String) throws -> String? {
    try read { db in try String.fetchOne(db.cached("SELECT value FROM meta WHERE key = ?"), arguments: [key]) }
  }

  public func setMeta(_ key: String, _ value: String) throws {
    try write { db in
      try db.cached("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)").execute(arguments: [key, value])
    }
  }

  /// This device's stable identifier, created on first use.
  public func deviceID() throws -> String {
    if let d = try meta("deviceID") { return d }
    let d = identifiers.next()
    try setMeta("deviceID", d)
    return d
  }

  /// Creates the root (inode 1) and `Documents/` on a fresh index.
  public func bootstrap(uid: UInt32, gid: UInt32) throws {
    try write { db in
      if try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [Self.rootInode]) != nil {
        return
      }
      let now = self.clock.nowNs()
      var root = ItemRow(
        id: Self.rootInode, itemID: WellKnownItem.root, parent: nil, name: "", kind: .directory, mode: 0o755,
        uid: uid, gid: gid, mtimeNs: now)
      try Self.insertItem(db, &root)
      var docs = ItemRow(
        itemID: WellKnownItem.documents, parent: Self.rootInode, name: "Documents", kind: .directory, mode: 0o755,
        uid: uid, gid: gid, mtimeNs: now)
      try Self.insertItem(db, &docs)
    }
  }

  // MARK: - reads

  public func item(_ inode: Int64) throws -> ItemRow? {
    try readOne { db in try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]) }
  }

  public func item(itemID: String) throws -> ItemRow? {
    try readOne { db in
      try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE itemID = ?"), arguments: [itemID])
    }
  }

  /// The inode and etag of the item with `itemID`, if it is here: what tells the echo of this
  /// device's own version from a change, without reading the whole row.
  public func etag(itemID: String) throws -> (inode: Int64, etag: String?)? {
    try readOne { db in
      try Row.fetchOne(db.cached("SELECT id, etag FROM items WHERE itemID = ?"), arguments: [itemID])
        .map { ($0["id"], $0["etag"]) }
    }
  }

  /// The local item and etag of each of `itemIDs` that is here, read in one transaction.
  public func etags(itemIDs: [String]) throws -> [String: (inode: Int64, etag: String?)] {
    try read { db in
      var found: [String: (inode: Int64, etag: String?)] = [:]
      let statement = try db.cached("SELECT id, etag FROM items WHERE itemID = ?")
      for itemID in itemIDs {
        if let row = try Row.fetchOne(statement, arguments: [itemID]) { found[itemID] = (row["id"], row["etag"]) }
      }
      return found
    }
  }

  /// Children with inode greater than `after`, in inode order (a stable readdir cursor).
  public func children(of parent: Int64, after: Int64, limit: Int) throws -> [ItemRow] {
    try readOne { db in
      try ItemRow.fetchAll(
        db.cached("SELECT * FROM items WHERE parent = ? AND id > ? ORDER BY id LIMIT ?"),
        arguments: [parent, after, limit])
    }
  }

  /// Path of an item relative to the container root ("Documents/a.txt").
  public func path(of inode: Int64) throws -> String? {
    try read { db in try Self.path(db, inode) }
  }

  static func path(_ db: Database, _ inode: Int64) throws -> String? {
    var parts: [String] = []
    var cur: Int64? = inode
    while let c = cur, c != rootInode {
      guard let row = try Row.fetchOne(db.cached("SELECT parent, name FROM items WHERE id = ?"), arguments: [c])
      else { return nil }
      parts.append(row["name"])
      cur = row["parent"]
      if parts.count > 4096 { return nil }
    }
    return parts.reversed().joined(separator: "/")
  }

  /// True if the item or one of its ancestors is excluded from sync (`.nosync` or
  /// `user.ubiq.excluded`).
  static func isLocalOnly(_ db: Database, _ inode: Int64) throws -> Bool {
    // The item and its ancestors below the root, nearest first, in one statement (every
    // create and recorded write asks): SQLite yields each row as the recursion reaches it,
    // and the walk stops at the first excluded one.
    let chain = try Row.fetchCursor(
      db.cached(
        """
        WITH RECURSIVE up(id, parent, name, excluded, depth) AS (
          SELECT id, parent, name, excluded, 0 FROM items WHERE id = ? AND id <> \(rootInode)
          UNION ALL
          SELECT i.id, i.parent, i.name, i.excluded, up.depth + 1 FROM items i JOIN up ON i.id = up.parent
          WHERE i.id <> \(rootInode) AND up.depth < 4095)
        SELECT name, excluded FROM up
        """), arguments: [inode])
    while let row = try chain.next() {
      // By position: SELECT name, excluded.
      if ItemName.isNoSync(row[0]) || (row[1] as Bool) { return true }
    }
    return false
  }

  public func isLocalOnly(_ inode: Int64) throws -> Bool {
    try read { db in try Self.isLocalOnly(db, inode) }
  }

  /// Makes every commit made so far durable, by any connection or process. Called where a
  /// caller was promised durability (fsync, fsyncdir, `sync --wait`), before the first write to
  /// a file whose content is durable, and before a commit is sent. The index runs with
  /// synchronous=NORMAL, so ordinary commits reach the WAL without an fsync. This is an
  /// fdatasync of the WAL file, without holding the writer, so namespace changes go on
  /// meanwhile. It covers every commit: a commit's frames are written to the WAL before it
  /// returns and stay there until a checkpoint has copied them into the database file and
  /// synced that file (with synchronous=NORMAL a checkpoint syncs the WAL before copying and
  /// the database file after; the WAL is reused only once everything in it was copied). The
  /// WAL's directory entry is synced once (SQLite would sync it at its first synced commit).
  /// Where there is no WAL file (an index no connection holds open in WAL mode), a commit with
  /// synchronous=FULL does it.
  public func makeDurable() throws {
    try commitBatch()
    let wal = pool.path + "-wal"
    let fd = open(wal, O_RDONLY | O_CLOEXEC)
    guard fd >= 0 else {
      if errno == ENOENT { return try pool.writeWithoutTransaction { db in try Self.syncedCommit(db) } }
      throw UbiqError.posix(errno, "open of the index's WAL")
    }
    defer { close(fd) }
    if fdatasync(fd) != 0 { throw UbiqError.posix(errno, "fdatasync of the index's WAL") }
    if !walDirectoryLock.withLock({ walDirectorySynced }) {
      try Durability.fsyncDirectory((pool.path as NSString).deletingLastPathComponent)
      walDirectoryLock.withLock { walDirectorySynced = true }
    }
  }

  /// Commits one small change with synchronous=FULL: its fsync of the WAL covers every earlier
  /// commit.
  static func syncedCommit(_ db: Database) throws {
    try db.execute(sql: "PRAGMA synchronous = FULL")
    defer { try? db.execute(sql: "PRAGMA synchronous = NORMAL") }
    try db.inTransaction {
      // A value that changes: an UPDATE that writes identical bytes leaves no WAL frame to sync.
      try db.execute(
        sql: """
          INSERT INTO meta(key, value) VALUES ('durableSeq', '1')
          ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1
          """)
      return .commit
    }
  }

  /// The row of `inode` with, for a directory, the count of directories directly below it (0
  /// for anything else): what a getattr answers, in one read. The kernel asks for a folder's
  /// attributes again after every create or unlink in it.
  public func itemWithSubdirectoryCount(_ inode: Int64) throws -> (row: ItemRow, subdirectories: Int)? {
    try rowWithSubdirectoryCount(where: "i.id = ?", [inode])
  }

  /// The child `name` of `parent`, with its subdirectory count as `itemWithSubdirectoryCount`
  /// gives it: what a lookup answers, in one read.
  public func childWithSubdirectoryCount(
    of parent: Int64, named name: String
  ) throws -> (row: ItemRow, subdirectories: Int)? {
    try rowWithSubdirectoryCount(where: "i.parent = ? AND i.name = ?", [parent, name])
  }

  /// The row of `items i` that `condition` selects, and its subdirectory count.
  private func rowWithSubdirectoryCount(
    where condition: String, _ arguments: StatementArguments
  ) throws -> (row: ItemRow, subdirectories: Int)? {
    let dir = ItemKind.directory.rawValue
    return try readOne { db in
      let rows = try Row.fetchCursor(
        db.cached(
          """
          SELECT i.*, CASE WHEN i.kind = \(dir) THEN
            (SELECT count(*) FROM items WHERE parent = i.id AND kind = \(dir)) ELSE 0 END AS subdirectories
          FROM items i WHERE \(condition)
          """), arguments: arguments)
      // Decoded in place, while the cursor (and the statement's row) lives: no copy of the row.
      return try withExtendedLifetime(rows) {
        // The count is the last column: `items` may have columns after `ItemRow`'s.
        try rows.next().map { (try ItemRow(row: $0), $0[$0.count - 1]) }
      }
    }
  }

  /// Directories directly below `inode` (a directory's link count is 2 plus this).
  public func subdirectoryCount(_ inode: Int64) throws -> Int {
    try readOne { db in
      try Int.fetchOne(
        db.cached("SELECT count(*) FROM items WHERE parent = ? AND kind = \(ItemKind.directory.rawValue)"),
        arguments: [inode]) ?? 0
    }
  }

  /// The errno for a failure of the index's storage: ENOSPC when its disk is full, EIO for other
  /// I/O failures; nil for errors that are not storage failures.
  public static func storageErrno(_ error: Error) -> Int32? {
    guard let e = error as? DatabaseError else { return nil }
    switch e.resultCode {
    case .SQLITE_FULL: return ENOSPC
    case .SQLITE_IOERR, .SQLITE_CORRUPT, .SQLITE_CANTOPEN, .SQLITE_READONLY: return EIO
    default: return nil
    }
  }

  /// Is `ancestor` the item itself or one of its ancestors?
  public func isDescendant(_ inode: Int64, of ancestor: Int64) throws -> Bool {
    try read { db in
      var cur: Int64? = inode
      var depth = 0
      while let c = cur, depth <= Self.maxDepth {
        if c == ancestor { return true }
        cur = try Self.parent(db, of: c)
        depth += 1
      }
      return false
    }
  }

  // MARK: - namespace changes

  /// Creates an item under `parent`. Throws `.exists`, `.notFound`, `.notDirectory`.
  /// `inserted` runs with the new inode inside the insert's transaction, before anything can
  /// read the row or its queue entry (it must not touch the index); if the transaction then
  /// fails, the caller undoes what it did.
  public func create(
    parent: Int64, name: String, kind: ItemKind, mode: UInt32, uid: UInt32, gid: UInt32,
    symlinkTarget: String? = nil, inserted: (Int64) -> Void = { _ in }
  ) throws -> ItemRow {
    try ItemName.validate(name)
    return try batchedWrite { db in
      guard
        let p = try Row.fetchOne(
          db.cached("SELECT kind, name, mode, gid FROM items WHERE id = ?"), arguments: [parent])
      else {
        throw UbiqError.notFound("parent \(parent)")
      }
      guard ItemKind(rawValue: p["kind"]) == .directory else { throw UbiqError.notDirectory(p["name"]) }
      if try Self.childID(db, parent, name) != nil { throw UbiqError.exists(name) }
      // As on ext4: in a folder with the set-group-id bit, a new item takes the folder's group,
      // and a new folder the bit too.
      var (mode, gid) = (mode, gid)
      if (p["mode"] as UInt32) & UInt32(S_ISGID) != 0 {
        gid = p["gid"]
        if kind == .directory { mode |= UInt32(S_ISGID) }
      }
      let now = self.clock.nowNs()
      var row = ItemRow(
        itemID: identifiers.next(), parent: parent, name: name, kind: kind, mode: mode, uid: uid, gid: gid,
        size: Int64(symlinkTarget?.utf8.count ?? 0), mtimeNs: now, symlinkTarget: symlinkTarget)
      row.revision = 1
      try Self.insertItem(db, &row)
      try Self.touchDirectory(db, parent, now)
      try self.enqueue(db, row.id!)
      inserted(row.id!)
      return row
    }
  }

  static func childID(_ db: Database, _ parent: Int64, _ name: String) throws -> Int64? {
    try Int64.fetchOne(db.cached("SELECT id FROM items WHERE parent = ? AND name = ?"), arguments: [parent, name])
  }

  static func touchDirectory(_ db: Database, _ inode: Int64, _ now: Int64) throws {
    try db.cached("UPDATE items SET mtimeNs = ?, ctimeNs = ? WHERE id = ?").execute(arguments: [now, now, inode])
  }

  /// Removes `name` from `parent`. `directory` selects rmdir semantics. Returns the removed row.
  public func remove(parent: Int64, name: String, directory: Bool) throws -> ItemRow {
    try batchedWriteFreeingRoom { db in
      guard
        let row = try ItemRow.fetchOne(
          db.cached("SELECT * FROM items WHERE parent = ? AND name = ?"), arguments: [parent, name]),
        let id = row.id
      else {
        throw UbiqError.notFound(name)
      }
      if directory {
        guard row.isDirectory else { throw UbiqError.notDirectory(name) }
        if try Int.fetchOne(db.cached("SELECT count(*) FROM items WHERE parent = ?"), arguments: [id])! > 0 {
          throw UbiqError.notEmpty(name)
        }
        if row.itemID == WellKnownItem.documents { throw UbiqError.notPermitted("Documents cannot be removed") }
      } else if row.isDirectory {
        throw UbiqError.isDirectory(name)
      }
      if try !self.passIdentityToANewFileAtItsCloudPlace(db, row) {
        try self.deleteRow(db, row)
      }
      try Self.touchDirectory(db, parent, self.clock.nowNs())
      return row
    }
  }

  /// Removes file `row` by handing its cloud identity to the file that now holds its place in
  /// the cloud (its base's folder and name), if that file is new here (not confirmed in the
  /// cloud) and `row` is in that folder: an editor's save that keeps the old file as a backup beside it
  /// until the new one is written (`mv f f~`, write f, `rm f~`). The new file becomes the next version of the removed one's item, as a
  /// file renamed over it does: the cloud gets a new version of f, not a delete of f and a new
  /// item, and an edit of f made meanwhile elsewhere meets it as an edit (a conflict version,
  /// nothing deleted). The new file's upload waits from when the removed one's changes began
  /// to wait, so a file saved so again and again is uploaded within `maxCoalescingNs`. Returns
  /// false, having changed nothing, for any other removal.
  func passIdentityToANewFileAtItsCloudPlace(_ db: Database, _ row: ItemRow) throws -> Bool {
    guard let id = row.id, let etag = row.etag, let base = Self.renamedBase(of: row),
      let heir = try Self.newFileAtTheCloudPlace(db, of: row, base: base), let heirID = heir.id,
      try !Self.isLocalOnly(db, heirID)
    else { return false }
    let removal = try Self.removal(db, of: row)
    // A first commit of the new file may have been sent (its reply lost, or the commit still
    // on its way): the item it would have made goes, as for a file renamed over another.
    if try Self.uploadAttempted(db, heir) {
      var heirRemoval = try Self.removal(db, of: heir)
      heirRemoval.keepsVersions = false
      try enqueueDelete(db, heirRemoval)
      try db.cached("UPDATE uploadQueue SET commitSent = 0, attempts = 0 WHERE item = ?").execute(arguments: [heirID])
    }
    let waitingSince = try Self.earliestWaiting(db, of: id, heirID)
    try db.cached("DELETE FROM items WHERE id = ?").execute(arguments: [id])
    try db.execute(
      sql:
        "UPDATE items SET itemID = ?, etag = ?, chunks = ?, base = ?, conflicts = ?, syncedRevision = 0 WHERE id = ?",
      arguments: [
        row.itemID, etag, heir.content == .cached ? row.chunks : heir.chunks, row.base,
        ItemRow.combinedConflicts(row.conflictList, heir.conflictList), heirID,
      ])
    try enqueue(db, heirID)
    // The places of the removed file's commits with no answer yet, and the place it had: a
    // commit of it there may be on its way unnoted (the uploader notes a commit after it
    // checked the row). A version of this device's own at one of them is no other device's
    // change, and the new file's place wins over it.
    let sent = removal.seen.flatMap { Self.sentPlaces(removal.sentPlaces, adding: $0) } ?? removal.sentPlaces
    try db.cached("UPDATE uploadQueue SET sentPlaces = ? WHERE item = ?").execute(arguments: [sent, heirID])
    if let waitingSince { try inheritWaiting(db, heirID, since: waitingSince) }
    return true
  }

  /// The file that holds the place the cloud version of `row` has, in the same folder as `row`,
  /// if it is new here (not confirmed in the cloud), and `row` moved away from that place less than
  /// twice `maxCoalescingNs` ago (`ctimeNs`): an editor's save that keeps the old file as a
  /// backup is writing it (`passIdentityToANewFileAtItsCloudPlace`). Nil otherwise.
  public func unsentFileAtTheCloudPlace(of row: ItemRow) throws -> Int64? {
    guard self.clock.nowNs() - row.ctimeNs < 2 * maxCoalescingNs, let base = Self.renamedBase(of: row) else {
      return nil
    }
    return try read { db in try Self.newFileAtTheCloudPlace(db, of: row, base: base)?.id }
  }

  /// The cloud version of `row`, a file in the cloud that has another name here (read without
  /// the database: the cheap half of `newFileAtTheCloudPlace`).
  static func renamedBase(of row: ItemRow) -> CloudItem? {
    guard row.kind == .file, row.etag != nil, let base = row.baseItem, !base.deleted, base.itemID == row.itemID,
      !ItemName.same(base.name, row.name)
    else { return nil }
    return base
  }

  /// The file, new here (not confirmed in the cloud), that holds the place `base` (the cloud
  /// version of `row`, `renamedBase`) has, when that place is in `row`'s folder: the new file
  /// of a save that keeps the old one as a backup beside it.
  static func newFileAtTheCloudPlace(_ db: Database, of row: ItemRow, base: CloudItem) throws -> ItemRow? {
    guard let baseParentID = base.parentID,
      let baseParent = try Int64.fetchOne(
        db.cached("SELECT id FROM items WHERE itemID = ?"), arguments: [baseParentID]),
      row.parent == baseParent, let holderID = try Self.childID(db, baseParent, base.name),
      let holder = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [holderID]),
      holder.kind == .file, holder.etag == nil, holder.base == nil
    else { return nil }
    return holder
  }

  /// Deletes a row and queues its cloud delete. The delete is queued even when the item has no
  /// etag yet: its first upload may be in flight, and until the delete is done the pending entry
  /// also stops the change feed from bringing the item back.
  func deleteRow(_ db: Database, _ row: ItemRow) throws {
    let delete = try Self.removal(db, of: row)
    try db.cached("DELETE FROM items WHERE id = ?").execute(arguments: [row.id!])
    if row.itemID != WellKnownItem.root && row.itemID != WellKnownItem.documents {
      try enqueueDelete(db, delete)
    }
  }

  /// A cloud delete to queue (`enqueueDelete`): the item, the etag it is deleted on, and what
  /// the uploader needs to tell this device's own newer versions from other devices' changes
  /// when the delete meets one in the cloud.
  struct CloudDelete {
    var itemID: String
    /// Nil: not known to be in the cloud.
    var etag: String?
    /// An attempt of the item's first upload may have reached the cloud (its reply was lost).
    var maybeInCloud = false
    /// The file had unresolved conflict versions (see `UploadWorker`).
    var keepsVersions = false
    /// Where and as the user saw the item when they deleted it (nil: not a user's delete).
    var seen: ItemPlace?
    /// The item's upload entry's `sentPlaces` (`QueueEntry.unansweredPlaces`, as JSON).
    var sentPlaces: String?
  }

  /// The cloud delete of a user's removal of `row`: read before the row and its upload entry
  /// go (its extended attributes and its entry go with the row). `seenAs`: the row where the
  /// user saw it, when it has moved since (the move that made it local-only).
  static func removal(_ db: Database, of row: ItemRow, seenAs: ItemRow? = nil) throws -> CloudDelete {
    CloudDelete(
      itemID: row.itemID, etag: row.etag, maybeInCloud: try uploadAttempted(db, row),
      keepsVersions: !row.conflictList.isEmpty, seen: try place(db, of: seenAs ?? row),
      sentPlaces: try sentPlaces(db, of: row.id))
  }

  /// Whether an item with no confirmed upload had an upload attempted: it may still have reached
  /// the cloud (the attempt's reply was lost). Read before its row and queue entry go.
  static func uploadAttempted(_ db: Database, _ row: ItemRow) throws -> Bool {
    guard row.etag == nil, let id = row.id else { return false }
    return try Bool.fetchOne(
      db.cached("SELECT attempts > 0 OR commitSent FROM uploadQueue WHERE item = ?"), arguments: [id]) ?? false
  }

  /// Marks the entries of items with no confirmed upload as possibly in the cloud, durably, before
  /// their commits are sent, with the revision each item has then (`revisionMarkedSent`): one
  /// commit and one sync of the index for the whole batch, the sync outside the writer (nothing
  /// if every item has been in the cloud).
  public func markCommitsSent(items: [Int64]) throws {
    if items.isEmpty { return }
    let marks = Array(repeating: "?", count: items.count).joined(separator: ",")
    let counts = try read { db in
      try Row.fetchOne(
        db,
        sql: """
          SELECT count(*), count(*) FILTER (WHERE q.commitSent = 0) FROM uploadQueue q JOIN items i ON i.id = q.item
          WHERE q.item IN (\(marks)) AND i.etag IS NULL
          """, arguments: StatementArguments(items))
    }
    // By position: the first uploads, those of them not marked yet.
    let (firstUploads, unmarked): (Int, Int) = counts.map { ($0[0], $0[1]) } ?? (0, 0)
    if unmarked > 0 {
      try write { db in
        try db.execute(
          sql: """
            UPDATE uploadQueue SET commitSent = 1,
              commitSentRevision = (SELECT revision FROM items WHERE id = uploadQueue.item)
            WHERE item IN (\(marks)) AND commitSent = 0 AND (SELECT etag FROM items WHERE id = uploadQueue.item) IS NULL
            """, arguments: StatementArguments(items))
      }
    }
    // Marks made earlier count too: their sync may have failed.
    if firstUploads > 0 { try makeDurable() }
  }

  /// The revision the item of queue entry `seq` had when the entry was marked as possibly in
  /// the cloud, before its first commit was sent (nil: not marked, or marked before revisions
  /// were). Every commit of the item sent since came from this revision or a later one.
  public func revisionMarkedSent(seq: Int64) throws -> Int64? {
    try read { db in
      try Int64.fetchOne(db.cached("SELECT commitSentRevision FROM uploadQueue WHERE seq = ?"), arguments: [seq])
    }
  }

  /// Queues a cloud delete, or merges it into one queued for the item. A nil etag means "not
  /// known to be in the cloud": an upload that completes later fills it in (`markUploaded`);
  /// still nil when processed, the uploader asks the cloud if `maybeInCloud` and otherwise has
  /// nothing to do.
  func enqueueDelete(_ db: Database, _ delete: CloudDelete) throws {
    let now = self.clock.nowNs()
    try db.cached(
      """
      INSERT INTO uploadQueue(deleteItemID, deleteEtag, enqueuedNs, nextAttemptNs, deleteMaybeInCloud,
        deleteKeepsVersions, deleteSeenPlace, sentPlaces)
      VALUES (?, ?, ?, ?, ?, ?, ?, ?)
      ON CONFLICT(deleteItemID) DO UPDATE SET deleteEtag = COALESCE(excluded.deleteEtag, deleteEtag),
        deleteMaybeInCloud = max(deleteMaybeInCloud, excluded.deleteMaybeInCloud),
        deleteKeepsVersions = max(deleteKeepsVersions, excluded.deleteKeepsVersions),
        deleteSeenPlace = COALESCE(excluded.deleteSeenPlace, deleteSeenPlace),
        sentPlaces = COALESCE(excluded.sentPlaces, sentPlaces)
      """
    ).execute(arguments: [
      delete.itemID, delete.etag, now, now + uploadDelayNs, delete.maybeInCloud, delete.keepsVersions,
      delete.seen?.json, delete.sentPlaces,
    ])
  }

  /// The `sentPlaces` of the upload entry of row `id` (`QueueEntry.unansweredPlaces`, as JSON).
  static func sentPlaces(_ db: Database, of id: Int64?) throws -> String? {
    guard let id else { return nil }
    return try String.fetchOne(db.cached("SELECT sentPlaces FROM uploadQueue WHERE item = ?"), arguments: [id])
  }

  /// Where row `row` is here, as a delete remembers it.
  static func place(_ db: Database, of row: ItemRow) throws -> ItemPlace? {
    guard let parent = row.parent,
      let parentID = try String.fetchOne(db.cached("SELECT itemID FROM items WHERE id = ?"), arguments: [parent])
    else { return nil }
    return ItemPlace(parentID: parentID, name: row.name, mode: row.mode, xattrs: try Self.xattrs(db, of: row.id!))
  }

  /// Queues (or re-arms) the upload of an item, unless it is local-only. A re-armed entry
  /// sends a version nobody has tried yet: the error of the last attempt goes with it (an entry
  /// still marked `EINVAL` would count as a move the cloud refused). A re-armed entry waits the
  /// upload delay again, so changes in quick succession go as one, but never past
  /// `maxCoalescingNs` after it began to wait (`waitingSinceNs`: queued, or last tried): a log
  /// closed every 200 ms is uploaded every few seconds, not once it stops. A folder not yet in
  /// the cloud keeps the time it was due, so it goes before the items made in it since (rsync
  /// sets a folder's times after filling it), which the cloud refuses until it is there.
  func enqueue(_ db: Database, _ inode: Int64) throws {
    if try Self.isLocalOnly(db, inode) { return }
    let now = self.clock.nowNs()
    try db.cached(
      """
      INSERT INTO uploadQueue(item, enqueuedNs, nextAttemptNs, waitingSinceNs) VALUES (?, ?, ?, ?)
      ON CONFLICT(item) DO UPDATE SET enqueuedNs = excluded.enqueuedNs,
        nextAttemptNs = CASE WHEN (SELECT kind = 2 AND etag IS NULL FROM items WHERE id = excluded.item)
          THEN min(nextAttemptNs, excluded.nextAttemptNs)
          ELSE min(excluded.nextAttemptNs, coalesce(waitingSinceNs, enqueuedNs) + ?) END,
        lastError = NULL, lastErrno = NULL
      """
    ).execute(arguments: [inode, now, now + uploadDelayNs, now, maxCoalescingNs])
  }

  /// The longest a changed item's upload waits for its changes to stop: the upload delay, and
  /// at least 5 s.
  var maxCoalescingNs: Int64 { max(uploadDelayNs, 5_000_000_000) }

  /// Queues every item of a subtree (used when an item stops being local-only).
  func enqueueSubtree(_ db: Database, _ inode: Int64) throws {
    var stack = [inode]
    while let cur = stack.popLast() {
      try db.cached("UPDATE items SET revision = revision + 1 WHERE id = ?").execute(arguments: [cur])
      try enqueue(db, cur)
      stack += try Int64.fetchAll(db.cached("SELECT id FROM items WHERE parent = ?"), arguments: [cur])
    }
  }

  /// Forgets the cloud identity of a subtree that became local-only, and deletes it in the cloud.
  /// Each item's delete is queued as a removal's is (`deleteRow`): it asks the cloud for a first
  /// commit whose answer never came, and remembers where the user saw the item (`before`: the
  /// subtree's top as it was before the move that made it local-only; nil: where it is) and
  /// the places its unanswered commits were sent with, so a version of this device's own that
  /// reached the cloud goes too. Throws `ContentOnlyInTheCloud` (and changes nothing) while a
  /// file of the subtree has bytes only in the cloud: its cloud item would take them with it.
  func detachSubtree(_ db: Database, _ inode: Int64, before: ItemRow? = nil) throws {
    var rows: [ItemRow] = []
    var stack = [inode]
    while let cur = stack.popLast() {
      if let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [cur]) {
        rows.append(row)
      }
      stack += try Int64.fetchAll(db.cached("SELECT id FROM items WHERE parent = ?"), arguments: [cur])
    }
    let dataless = rows.filter { $0.kind == .file && $0.content == .dataless && $0.size > 0 }.compactMap(\.id)
    if !dataless.isEmpty { throw ContentOnlyInTheCloud(inodes: dataless) }
    // Every place is read under the folders' cloud identities, before any of them is replaced;
    // the items' deletes are queued before their folders'.
    for row in rows.reversed() {
      try enqueueDelete(db, try Self.removal(db, of: row, seenAs: row.id == inode ? before : nil))
    }
    for row in rows {
      try db.execute(
        sql: "UPDATE items SET etag = NULL, itemID = ? WHERE id = ?", arguments: [identifiers.next(), row.id])
      try db.cached("DELETE FROM uploadQueue WHERE item = ?").execute(arguments: [row.id])
    }
  }

  public enum RenameMode: Sendable { case replace, noReplace, exchange }

  /// Result of a rename: the moved item and, if one was replaced, the row that disappeared.
  public struct RenameResult: Sendable {
    public var moved: ItemRow
    public var replaced: ItemRow?
  }

  /// Renames/moves an item. Replacing a regular file with another keeps the replaced item's
  /// cloud identity (an editor's atomic save becomes a new version of the same item).
  public func rename(
    parent: Int64, name: String, newParent: Int64, newName: String, mode: RenameMode
  ) throws -> RenameResult {
    try ItemName.validate(newName)
    return try batchedWriteFreeingRoom { db in
      guard let srcID = try Self.childID(db, parent, name),
        var src = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [srcID])
      else {
        throw UbiqError.notFound(name)
      }
      guard let np = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [newParent]) else {
        throw UbiqError.notFound("target directory")
      }
      guard np.isDirectory else { throw UbiqError.notDirectory(np.name) }
      if src.itemID == WellKnownItem.documents { throw UbiqError.notPermitted("Documents cannot be moved") }
      let dstID = try Self.childID(db, newParent, newName)
      // The kernel's order of checks: a taken name under RENAME_NOREPLACE, a missing name under
      // RENAME_EXCHANGE, then a directory moving below itself.
      if mode == .noReplace && dstID != nil { throw UbiqError.exists(newName) }
      if mode == .exchange && dstID == nil { throw UbiqError.notFound(newName) }
      if src.isDirectory { try Self.refuseMoveBelowItself(db, srcID, into: newParent) }
      let now = self.clock.nowNs()
      let wasLocalOnly = try Self.isLocalOnly(db, srcID)
      var replaced: ItemRow? = nil
      var inheritedSentPlaces: String? = nil
      var inheritedWaitingSinceNs: Int64? = nil
      if dstID == srcID { return RenameResult(moved: src, replaced: nil) }
      if let dstID, let dst = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [dstID]) {
        switch mode {
        case .noReplace:
          throw UbiqError.exists(newName)
        case .exchange:
          return try exchange(db, src: src, dst: dst, now: now)
        case .replace:
          if dst.isDirectory && !src.isDirectory { throw UbiqError.isDirectory(newName) }
          if !dst.isDirectory && src.isDirectory { throw UbiqError.notDirectory(newName) }
          if dst.isDirectory {
            if try Int.fetchOne(db.cached("SELECT count(*) FROM items WHERE parent = ?"), arguments: [dstID])! > 0 {
              throw UbiqError.notEmpty(newName)
            }
            if dst.itemID == WellKnownItem.documents { throw UbiqError.notPermitted("Documents cannot be replaced") }
          }
          // Read before the replaced row goes (its attributes and its queue entry go with it).
          let dstRemoval = try Self.removal(db, of: dst)
          if dst.kind == .file && src.kind == .file {
            inheritedWaitingSinceNs = try Self.earliestWaiting(db, of: dstID, srcID)
          }
          try db.cached("DELETE FROM items WHERE id = ?").execute(arguments: [dstID])
          replaced = dst
          if dst.kind == .file && src.kind == .file, let dstEtag = dst.etag {
            // Identity transfer: the moved file becomes the next version of the replaced item.
            // Its content stays its own: a dataless source keeps the chunk list its bytes are
            // downloaded (and uploaded) from; a cached one is uploaded from its cache file.
            // Both files' conflict versions stay with it: the source's item is deleted.
            var srcRemoval = try Self.removal(db, of: src)
            srcRemoval.keepsVersions = false
            try self.enqueueDelete(db, srcRemoval)
            try db.cached("DELETE FROM uploadQueue WHERE item = ?").execute(arguments: [srcID])
            src.itemID = dst.itemID
            src.etag = dstEtag
            inheritedSentPlaces = dstRemoval.sentPlaces
            if src.content == .cached { src.chunks = dst.chunks }
            src.syncedRevision = 0
            try db.execute(
              sql: """
                UPDATE items SET itemID = ?, etag = ?, chunks = ?, base = ?, conflicts = ?, syncedRevision = 0
                WHERE id = ?
                """,
              arguments: [
                src.itemID, dstEtag, src.chunks, dst.base,
                ItemRow.combinedConflicts(dst.conflictList, src.conflictList), srcID,
              ])
          } else {
            try self.enqueueDelete(db, dstRemoval)
          }
        }
      }
      try db.execute(
        sql: "UPDATE items SET parent = ?, name = ?, ctimeNs = ?, revision = revision + 1 WHERE id = ?",
        arguments: [newParent, newName, now, srcID])
      try Self.touchDirectory(db, parent, now)
      if newParent != parent { try Self.touchDirectory(db, newParent, now) }
      try self.enqueueMoved(db, srcID, wasLocalOnly: wasLocalOnly, before: src)
      // The identity taken over comes with the places its unanswered commits were sent with.
      if let inheritedSentPlaces {
        try db.cached("UPDATE uploadQueue SET sentPlaces = ? WHERE item = ?").execute(
          arguments: [inheritedSentPlaces, srcID])
      }
      // A file renamed over another takes the time the changes of either began to wait: a file
      // saved atomically again and again (a new file renamed over it each time) is uploaded
      // within `maxCoalescingNs`, as one written again and again is.
      if let inheritedWaitingSinceNs { try inheritWaiting(db, srcID, since: inheritedWaitingSinceNs) }
      return RenameResult(
        moved: try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [srcID])!,
        replaced: replaced)
    }
  }

  /// RENAME_EXCHANGE of `src` and `dst`: the same checks as a plain rename, applied to both
  /// directions (neither is Documents; a directory never lands below itself).
  ///
  /// Two files swap their cloud identities along with their names: the cloud item at each path
  /// stays where it is and gets the other file's content as its next version, so no state of
  /// the cloud ever has both at one name. Each file keeps its own content (a dataless one keeps
  /// the chunk list its bytes come from). Anything else is two moves.
  func exchange(_ db: Database, src: ItemRow, dst: ItemRow, now: Int64) throws -> RenameResult {
    let srcID = src.id!
    let dstID = dst.id!
    if dst.itemID == WellKnownItem.documents { throw UbiqError.notPermitted("Documents cannot be moved") }
    for (moving, into) in [(src, dst.parent), (dst, src.parent)] where moving.isDirectory {
      try Self.refuseMoveBelowItself(db, moving.id!, into: into)
    }
    let wasLocalOnly = [try Self.isLocalOnly(db, srcID), try Self.isLocalOnly(db, dstID)]
    // Swap the two places through a temporary name (the (parent, name) pair is unique).
    try db.execute(sql: "UPDATE items SET name = ? WHERE id = ?", arguments: ["\u{1}swap\(srcID)", dstID])
    try db.execute(
      sql: "UPDATE items SET name = ?, parent = ?, ctimeNs = ?, revision = revision + 1 WHERE id = ?",
      arguments: [dst.name, dst.parent, now, srcID])
    try db.execute(
      sql: "UPDATE items SET name = ?, parent = ?, ctimeNs = ?, revision = revision + 1 WHERE id = ?",
      arguments: [src.name, src.parent, now, dstID])
    let nowLocalOnly = [try Self.isLocalOnly(db, srcID), try Self.isLocalOnly(db, dstID)]
    // Of each row, whether the identity it takes may be in the cloud already (see below).
    var sentIdentity = [false, false]
    var sentPlaces: [String?] = [nil, nil]
    var waitingSince: Int64? = nil
    if src.kind == .file && dst.kind == .file && wasLocalOnly == [false, false] && nowLocalOnly == [false, false] {
      // Identity swap; the unique itemID goes through a temporary value.
      func identity(of row: ItemRow, for other: ItemRow) -> [DatabaseValueConvertible?] {
        // The chunk list describes the content of a dataless file: it stays with the file.
        [row.itemID, row.etag, other.content == .dataless ? other.chunks : row.chunks, row.base, row.conflicts]
      }
      let sql =
        "UPDATE items SET itemID = ?, etag = ?, chunks = ?, base = ?, conflicts = ?, syncedRevision = 0 WHERE id = ?"
      try db.execute(sql: "UPDATE items SET itemID = ? WHERE id = ?", arguments: ["\u{1}swap\(srcID)", srcID])
      try db.execute(sql: sql, arguments: StatementArguments(identity(of: src, for: dst) + [dstID]))
      try db.execute(sql: sql, arguments: StatementArguments(identity(of: dst, for: src) + [srcID]))
      // An identity whose first commit may have reached the cloud keeps that mark on its new row
      // (a delete then asks the cloud), without a revision: those commits came from the other
      // row, so no version of this one is the base of a merge with what the cloud has.
      sentIdentity = [try Self.uploadAttempted(db, dst), try Self.uploadAttempted(db, src)]
      // So do the places its unanswered commits were sent with (`QueueEntry.unansweredPlaces`).
      sentPlaces = [try Self.sentPlaces(db, of: dstID), try Self.sentPlaces(db, of: srcID)]
      // And the earlier time the changes of either began to wait: a file saved again and again
      // by exchanging a new file with it is uploaded within `maxCoalescingNs`.
      waitingSince = try Self.earliestWaiting(db, of: srcID, dstID)
      try db.cached("DELETE FROM uploadQueue WHERE item IN (?, ?)").execute(arguments: [srcID, dstID])
    }
    try Self.touchDirectory(db, src.parent!, now)
    if dst.parent != src.parent { try Self.touchDirectory(db, dst.parent!, now) }
    for (i, id) in [srcID, dstID].enumerated() {
      try self.enqueueMoved(db, id, wasLocalOnly: wasLocalOnly[i], before: i == 0 ? src : dst)
      if sentIdentity[i] {
        try db.cached("UPDATE uploadQueue SET commitSent = 1 WHERE item = ?").execute(arguments: [id])
      }
      if let places = sentPlaces[i] {
        try db.cached("UPDATE uploadQueue SET sentPlaces = ? WHERE item = ?").execute(arguments: [places, id])
      }
      if let waitingSince { try inheritWaiting(db, id, since: waitingSince) }
    }
    return RenameResult(
      moved: try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [srcID])!,
      replaced: nil)
  }

  /// The earliest time the upload entries of rows `a` and `b` began to wait (nil: neither is
  /// queued).
  static func earliestWaiting(_ db: Database, of a: Int64, _ b: Int64) throws -> Int64? {
    try Int64.fetchOne(
      db.cached("SELECT min(coalesce(waitingSinceNs, enqueuedNs)) FROM uploadQueue WHERE item IN (?, ?)"),
      arguments: [a, b])
  }

  /// Makes the upload entry of `id` wait at most `maxCoalescingNs` from `since` (or from its
  /// own start, if earlier): the changes of a file that took another's identity began to wait
  /// when that one's did.
  func inheritWaiting(_ db: Database, _ id: Int64, since: Int64) throws {
    try db.cached(
      """
      UPDATE uploadQueue SET waitingSinceNs = min(coalesce(waitingSinceNs, enqueuedNs), ?1),
        nextAttemptNs = min(nextAttemptNs, ?1 + ?2) WHERE item = ?3
      """
    ).execute(arguments: [since, maxCoalescingNs, id])
  }

  /// Queues what a move of `id` changes in the cloud: the item itself, or, if it stopped being
  /// local-only, its whole subtree; if it became local-only, its subtree leaves the cloud
  /// (`before`: the item's row before the move).
  func enqueueMoved(_ db: Database, _ id: Int64, wasLocalOnly: Bool, before: ItemRow? = nil) throws {
    let nowLocalOnly = try Self.isLocalOnly(db, id)
    if wasLocalOnly && !nowLocalOnly {
      try enqueueSubtree(db, id)
    } else if !wasLocalOnly && nowLocalOnly {
      try detachSubtree(db, id, before: before)
    } else {
      try enqueue(db, id)
      try letAMoveAwayWait(db, id)
    }
  }

  /// A synced item moved away from the place its cloud version has waits the upload delay
  /// even once its changes have waited `maxCoalescingNs` (but no longer than twice that): an
  /// editor's save that keeps the old file as a backup renames it away and removes it a moment
  /// later, and the new file takes its identity (`passIdentityToANewFileAtItsCloudPlace`) only
  /// if the rename has not been committed meanwhile.
  func letAMoveAwayWait(_ db: Database, _ id: Int64) throws {
    guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [id]),
      row.etag != nil, let base = row.baseItem, let parent = row.parent,
      let parentID = try String.fetchOne(db.cached("SELECT itemID FROM items WHERE id = ?"), arguments: [parent]),
      base.parentID != parentID || base.name != row.name
    else { return }
    try db.cached(
      """
      UPDATE uploadQueue SET nextAttemptNs = max(nextAttemptNs, min(?1, coalesce(waitingSinceNs, enqueuedNs) + ?2))
      WHERE item = ?3
      """
    ).execute(arguments: [self.clock.nowNs() + uploadDelayNs, 2 * maxCoalescingNs, id])
  }

  /// The parent of item `id` here (nil for the root or a missing item).
  static func parent(_ db: Database, of id: Int64) throws -> Int64? {
    try Int64.fetchOne(db.cached("SELECT parent FROM items WHERE id = ?"), arguments: [id])
  }

  /// Throws EINVAL if directory `dir` is `start` or one of its ancestors (a move of `dir` into
  /// `start` would put it below itself); EIO if the chain is longer than any real tree.
  static func refuseMoveBelowItself(_ db: Database, _ dir: Int64, into start: Int64?) throws {
    var cur = start
    var depth = 0
    while let c = cur {
      if c == dir { throw UbiqError.invalidArgument("cannot move a directory into itself") }
      depth += 1
      // A chain longer than any real tree means the index holds a cycle: refuse, never spin.
      if depth > maxDepth { throw UbiqError.io("the folders above the target form a cycle") }
      cur = try Self.parent(db, of: c)
    }
  }

  /// Applies setattr changes. Content size changes are the caller's job on the cache file.
  public func setAttributes(_ inode: Int64, _ c: AttributeChanges) throws -> ItemRow {
    try batchedWriteFreeingRoom { db in
      guard var row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]) else {
        throw UbiqError.notFound("inode \(inode)")
      }
      let now = self.clock.nowNs()
      // A mode set to what it is (`tar x` sets every file's) is no change to upload.
      let syncs = c.size != nil || c.mtimeNs != nil || c.mode.map { $0 & 0o7777 != row.mode } == true
      if let m = c.mode { row.mode = m & 0o7777 }
      if let u = c.uid { row.uid = u }
      if let g = c.gid { row.gid = g }
      if let s = c.size {
        row.size = s
        row.mtimeNs = now
      }
      if let a = c.atimeNs { row.atimeNs = a }
      if let m = c.mtimeNs { row.mtimeNs = m }
      row.ctimeNs = now
      if syncs { row.revision += 1 }
      // Only the attribute columns: a statement that sets the name or the parent, even to
      // the same value, rewrites every index on them (a chmod or chown of each file is half
      // of what `tar x` asks of the index).
      try db.cached(
        """
        UPDATE items SET mode = ?, uid = ?, gid = ?, size = ?, mtimeNs = ?, atimeNs = ?, ctimeNs = ?,
          revision = ? WHERE id = ?
        """
      ).execute(arguments: [
        row.mode, row.uid, row.gid, row.size, row.mtimeNs, row.atimeNs, row.ctimeNs, row.revision, inode,
      ])
      if syncs { try self.enqueue(db, inode) }
      return row
    }
  }

  /// Records new local content (after close/fsync of a written file): size, mtime, and a new
  /// revision queued for upload.
  /// `mtimeNs` nil keeps the stored mtime (it was set explicitly after the last write).
  /// `clean`: no handle holds writes beyond this state any more, so the dirty mark goes in the
  /// same transaction.
  /// `synced`: the cache file was fdatasync'ed after its last write. Otherwise the new revision
  /// is marked unsynced in the same transaction: if a power loss keeps this commit but not the
  /// cache file's bytes, the next mount re-records the file from what its cache file holds.
  public func recordContentChange(
    _ inode: Int64, size: Int64, mtimeNs: Int64?, clean: Bool = false, synced: Bool = false
  ) throws {
    let now = self.clock.nowNs()
    try batchedWrite { db in
      try db.cached(
        """
        UPDATE items SET size = ?, mtimeNs = COALESCE(?, mtimeNs), ctimeNs = ?, content = ?,
          revision = revision + 1, lastUsedNs = ? WHERE id = ?
        """
      ).execute(arguments: [size, mtimeNs, now, ContentState.cached.rawValue, now, inode])
      if db.changesCount > 0 {
        try self.enqueue(db, inode)
        if synced {
          try db.cached("DELETE FROM unsyncedContent WHERE item = ?").execute(arguments: [inode])
        } else {
          try db.cached(
            "INSERT OR REPLACE INTO unsyncedContent(item, revision) SELECT id, revision FROM items WHERE id = ?"
          ).execute(arguments: [inode])
        }
      }
      if clean { try db.cached("DELETE FROM dirtyContent WHERE item = ?").execute(arguments: [inode]) }
    }
  }

  /// Records, before the first write through a clean handle is acknowledged, that the cache file
  /// of `inode` is about to hold bytes the index does not describe. When the file had no mark
  /// of either kind (its cache file is durable and described by the index) and has content,
  /// the mark is made durable before the write: otherwise a power loss could keep the write's
  /// bytes in the cache file but lose the mark, leaving an index that describes (and may call
  /// uploaded) other bytes than the file holds.
  public func markContentDirty(_ inode: Int64) throws {
    var needsSync = false
    try batchedWrite { db in
      // An unlinked file that is still open has no row: nothing to recover for it.
      let marked =
        try Bool.fetchOne(
          db.cached(
            """
            SELECT EXISTS(SELECT 1 FROM dirtyContent WHERE item = ?)
              OR EXISTS(SELECT 1 FROM unsyncedContent WHERE item = ?)
            """), arguments: [inode, inode]) ?? false
      try db.cached("INSERT OR IGNORE INTO dirtyContent(item) SELECT id FROM items WHERE id = ?")
        .execute(arguments: [inode])
      let inserted = db.changesCount > 0
      let hasContent =
        try Bool.fetchOne(
          db.cached("SELECT size > 0 OR etag IS NOT NULL FROM items WHERE id = ?"), arguments: [inode]) ?? false
      needsSync = inserted && !marked && hasContent
    }
    if needsSync { try makeDurable() }
  }

  /// Files whose handles had unrecorded writes when the daemon stopped (a crash).
  public func dirtyContentItems() throws -> [Int64] {
    try read { db in try Int64.fetchAll(db, sql: "SELECT item FROM dirtyContent ORDER BY item") }
  }

  /// Files whose recorded content may not be durable in their cache file yet.
  public func unsyncedContentItems() throws -> [Int64] {
    try read { db in try Int64.fetchAll(db, sql: "SELECT item FROM unsyncedContent ORDER BY item") }
  }

  /// Drops a dirty mark without recording anything (the cache file is gone).
  public func clearContentDirty(_ inode: Int64) throws {
    try write { db in
      try db.cached("DELETE FROM dirtyContent WHERE item = ?").execute(arguments: [inode])
    }
  }

  /// The cache file of `inode` was fdatasync'ed after revision `revision` was recorded: its
  /// bytes up to that revision are durable. A change of the open batch: an fsync then commits
  /// it with the handle's record, in one transaction; lost to a power loss, the mark only makes
  /// the next mount check the file again.
  public func clearContentUnsynced(_ inode: Int64, upTo revision: Int64) throws {
    try batchedWrite { db in
      try db.cached("DELETE FROM unsyncedContent WHERE item = ? AND revision <= ?")
        .execute(arguments: [inode, revision])
    }
  }

  // MARK: - user xattrs

  public func xattr(_ inode: Int64, _ name: String) throws -> Data? {
    try readOne { db in
      try Data.fetchOne(db.cached("SELECT value FROM xattrs WHERE item = ? AND name = ?"), arguments: [inode, name])
    }
  }

  public func xattrNames(_ inode: Int64) throws -> [String] {
    try readOne { db in
      try String.fetchAll(db.cached("SELECT name FROM xattrs WHERE item = ? ORDER BY name"), arguments: [inode])
    }
  }

  public func allXattrs(_ inode: Int64) throws -> [String: Data] {
    try readOne { db in try Self.xattrs(db, of: inode) }
  }

  /// The extended attributes stored for item `inode`.
  static func xattrs(_ db: Database, of inode: Int64) throws -> [String: Data] {
    var out: [String: Data] = [:]
    for row in try Row.fetchAll(db.cached("SELECT name, value FROM xattrs WHERE item = ?"), arguments: [inode]) {
      out[row["name"]] = row["value"]
    }
    return out
  }

  public enum XattrMode: Sendable { case any, create, replace }

  public func setXattr(_ inode: Int64, _ name: String, _ value: Data, mode: XattrMode) throws {
    try batchedWrite { db in
      let exists =
        try Bool.fetchOne(db.cached("SELECT 1 FROM xattrs WHERE item = ? AND name = ?"), arguments: [inode, name])
        ?? false
      if mode == .create && exists { throw UbiqError.exists(name) }
      if mode == .replace && !exists { throw UbiqError.noData(name) }
      // As on ext4, an attribute that no longer fits gives ENOSPC; here the bound is what
      // listxattr can answer (and the cloud takes).
      if !exists {
        let namesBytes =
          try Int.fetchOne(
            db.cached("SELECT coalesce(sum(length(CAST(name AS BLOB)) + 1), 0) FROM xattrs WHERE item = ?"),
            arguments: [inode]) ?? 0
        if namesBytes + name.utf8.count + 1 > CloudItem.maxXattrNamesBytes {
          throw UbiqError.noSpace("extended attribute names longer than 60 KiB in all")
        }
      }
      try db.execute(
        sql: "INSERT OR REPLACE INTO xattrs(item, name, value) VALUES (?, ?, ?)", arguments: [inode, name, value])
      try db.execute(
        sql: "UPDATE items SET ctimeNs = ?, revision = revision + 1 WHERE id = ?",
        arguments: [self.clock.nowNs(), inode])
      try self.enqueue(db, inode)
    }
  }

  public func removeXattr(_ inode: Int64, _ name: String) throws {
    try batchedWrite { db in
      try db.cached("DELETE FROM xattrs WHERE item = ? AND name = ?").execute(arguments: [inode, name])
      if db.changesCount == 0 { throw UbiqError.noData(name) }
      try db.execute(
        sql: "UPDATE items SET ctimeNs = ?, revision = revision + 1 WHERE id = ?",
        arguments: [self.clock.nowNs(), inode])
      try self.enqueue(db, inode)
    }
  }

  /// Sets or clears the explicit `user.ubiq.excluded` flag.
  public func setExcluded(_ inode: Int64, _ excluded: Bool) throws {
    try write { db in
      let before = try Self.isLocalOnly(db, inode)
      try db.cached("UPDATE items SET excluded = ? WHERE id = ?").execute(arguments: [excluded, inode])
      let after = try Self.isLocalOnly(db, inode)
      if before && !after { try self.enqueueSubtree(db, inode) }
      if !before && after { try self.detachSubtree(db, inode) }
    }
  }

  /// Pinned files whose content is not here (a crash stopped their download).
  public func pinnedDatalessFiles() throws -> [Int64] {
    try read { db in
      try Int64.fetchAll(
        db, sql: "SELECT id FROM items WHERE pinned = 1 AND kind = 1 AND content = 0")
    }
  }

  public func setPinned(_ inode: Int64, _ pinned: Bool) throws {
    try write { db in
      try db.cached("UPDATE items SET pinned = ? WHERE id = ?").execute(arguments: [pinned, inode])
    }
  }
}
