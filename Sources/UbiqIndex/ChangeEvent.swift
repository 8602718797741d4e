import Foundation
import GRDB
import UbiqCore

/// One change of an item as `ubiqfs watch` reports it, local or remote: a row of the index's
/// `events` table, which triggers on `items` fill in the transaction of each change.
public struct ChangeEvent: Sendable, Equatable {
  public enum Kind: String, Sendable, CaseIterable {
    case created, modified, deleted, renamed, downloaded, evicted, uploaded, conflict
  }

  /// Increases by one per event; `ubiqfs watch --since SEQ` resumes after it.
  public var seq: Int64
  public var timeNs: Int64
  public var kind: Kind
  public var inode: Int64
  public var itemID: String
  public var isDirectory: Bool
  /// The item's folder and name after the change (before it, for `deleted`).
  public var parent: Int64?
  public var name: String
  /// Where a `renamed` item was before.
  public var oldParent: Int64?
  public var oldName: String?
  /// The change came from the cloud (another device), not from this mount.
  public var remote: Bool

  public init(
    seq: Int64, timeNs: Int64, kind: Kind, inode: Int64, itemID: String, isDirectory: Bool, parent: Int64?,
    name: String, oldParent: Int64? = nil, oldName: String? = nil, remote: Bool
  ) {
    self.seq = seq
    self.timeNs = timeNs
    self.kind = kind
    self.inode = inode
    self.itemID = itemID
    self.isDirectory = isDirectory
    self.parent = parent
    self.name = name
    self.oldParent = oldParent
    self.oldName = oldName
    self.remote = remote
  }

  /// The table, the flag that tells remote changes apart (set by `applyRemote` inside its
  /// transaction) and the triggers. Times are those of the commit, in nanoseconds (ms precision).
  static let schema = """
    CREATE TABLE events(
      seq INTEGER PRIMARY KEY AUTOINCREMENT, timeNs INTEGER NOT NULL, kind TEXT NOT NULL,
      item INTEGER NOT NULL, itemID TEXT NOT NULL, isDirectory INTEGER NOT NULL,
      parent INTEGER, name TEXT NOT NULL, oldParent INTEGER, oldName TEXT, remote INTEGER NOT NULL);
    CREATE TABLE eventOrigin(remote INTEGER NOT NULL);
    INSERT INTO eventOrigin VALUES (0);
    CREATE TRIGGER eventsTrim AFTER INSERT ON events WHEN NEW.seq % 1000 = 0 BEGIN
      DELETE FROM events WHERE seq <= NEW.seq - 10000;
    END;
    CREATE TRIGGER eventCreated AFTER INSERT ON items WHEN NEW.parent IS NOT NULL BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, remote)
      VALUES (\(now), 'created', NEW.id, NEW.itemID, NEW.kind = 2, NEW.parent, NEW.name, \(origin));
    END;
    CREATE TRIGGER eventDeleted AFTER DELETE ON items BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, remote)
      VALUES (\(now), 'deleted', OLD.id, OLD.itemID, OLD.kind = 2, OLD.parent, OLD.name, \(origin));
    END;
    CREATE TRIGGER eventRenamed AFTER UPDATE OF parent, name ON items
    WHEN OLD.parent IS NOT NEW.parent OR OLD.name IS NOT NEW.name BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, oldParent, oldName, remote)
      VALUES (\(now), 'renamed', NEW.id, NEW.itemID, NEW.kind = 2, NEW.parent, NEW.name, OLD.parent, OLD.name,
        \(origin));
    END;
    CREATE TRIGGER eventModified AFTER UPDATE OF size, mtimeNs, chunks ON items
    WHEN NEW.kind = 1 AND (OLD.size IS NOT NEW.size OR OLD.mtimeNs IS NOT NEW.mtimeNs
      OR (\(origin) = 1 AND OLD.chunks IS NOT NEW.chunks)) BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, remote)
      VALUES (\(now), 'modified', NEW.id, NEW.itemID, 0, NEW.parent, NEW.name, \(origin));
    END;
    CREATE TRIGGER eventDownloaded AFTER UPDATE OF content ON items
    WHEN OLD.content = 0 AND NEW.content = 1 AND OLD.revision = NEW.revision AND OLD.etag IS NEW.etag BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, remote)
      VALUES (\(now), 'downloaded', NEW.id, NEW.itemID, 0, NEW.parent, NEW.name, 0);
    END;
    CREATE TRIGGER eventEvicted AFTER UPDATE OF content ON items
    WHEN OLD.content = 1 AND NEW.content = 0 AND OLD.revision = NEW.revision AND OLD.etag IS NEW.etag BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, remote)
      VALUES (\(now), 'evicted', NEW.id, NEW.itemID, 0, NEW.parent, NEW.name, 0);
    END;
    CREATE TRIGGER eventUploaded AFTER UPDATE OF syncedRevision ON items
    WHEN \(origin) = 0 AND NEW.syncedRevision > OLD.syncedRevision AND NEW.syncedRevision = NEW.revision BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, remote)
      VALUES (\(now), 'uploaded', NEW.id, NEW.itemID, NEW.kind = 2, NEW.parent, NEW.name, 0);
    END;
    CREATE TRIGGER eventConflict AFTER UPDATE OF conflicts ON items
    WHEN json_array_length(ifnull(NEW.conflicts, '[]')) > json_array_length(ifnull(OLD.conflicts, '[]')) BEGIN
      INSERT INTO events(timeNs, kind, item, itemID, isDirectory, parent, name, remote)
      VALUES (\(now), 'conflict', NEW.id, NEW.itemID, 0, NEW.parent, NEW.name, \(origin));
    END;
    """

  private static let now = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) * 1000000"
  private static let origin = "(SELECT remote FROM eventOrigin)"

  init(row: Row) {
    seq = row["seq"]
    timeNs = row["timeNs"]
    kind = Kind(rawValue: row["kind"]) ?? .modified
    inode = row["item"]
    itemID = row["itemID"]
    isDirectory = row["isDirectory"]
    parent = row["parent"]
    name = row["name"]
    oldParent = row["oldParent"]
    oldName = row["oldName"]
    remote = row["remote"]
  }
}

extension IndexStore {
  /// Events after `seq`, oldest first.
  public func events(after seq: Int64, limit: Int) throws -> [ChangeEvent] {
    try read { db in
      try Row.fetchAll(
        db.cached("SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?"), arguments: [seq, limit]
      ).map(ChangeEvent.init)
    }
  }

  /// The newest event's number (0 if there is none).
  public func lastEventSeq() throws -> Int64 {
    try read { db in try Int64.fetchOne(db.cached("SELECT max(seq) FROM events")) ?? 0 }
  }

  /// The oldest event still kept (events before it were trimmed).
  public func firstEventSeq() throws -> Int64? {
    try read { db in try Int64.fetchOne(db.cached("SELECT min(seq) FROM events")) }
  }

  /// Runs `body` in the current write transaction with its changes marked as remote.
  static func asRemote<T>(_ db: Database, _ body: () throws -> T) throws -> T {
    try db.cached("UPDATE eventOrigin SET remote = 1").execute()
    defer { if db.isInsideTransaction { _ = try? db.cached("UPDATE eventOrigin SET remote = 0").execute() } }
    return try body()
  }
}
