import Foundation
import GRDB
import UbiqCore

extension IndexStore {
  /// This device's side of `SyncAudit.compare`: every item with its folder's cloud id and its
  /// path, what is queued, held or refused, and the change token, read in one transaction.
  public func auditSnapshot() throws -> SyncAudit.LocalSnapshot {
    try read { db in
      let token = Int64(try String.fetchOne(db, sql: "SELECT value FROM meta WHERE key = 'changeToken'") ?? "0") ?? 0
      let queued = Set(try Int64.fetchAll(db, sql: "SELECT item FROM uploadQueue WHERE item IS NOT NULL"))
      let dirty = Set(try Int64.fetchAll(db, sql: "SELECT item FROM dirtyContent"))
      let queuedDeletes = Set(
        try String.fetchAll(db, sql: "SELECT deleteItemID FROM uploadQueue WHERE deleteItemID IS NOT NULL"))
      let heldBack = Set(
        try String.fetchAll(db, sql: "SELECT itemID FROM heldRemote UNION SELECT itemID FROM refusedRemote"))
      var items: [Int64: SyncAudit.LocalItem] = [:]
      var parents: [Int64: Int64] = [:]
      var excluded = Set<Int64>()
      let rows = try Row.fetchCursor(
        db,
        sql: """
          SELECT id, itemID, parent, name, kind, mode, size, symlinkTarget, etag, excluded
          FROM items
          """)
      while let row = try rows.next() {
        // By position, as selected.
        let id: Int64 = row[0]
        parents[id] = row[2]
        if row[9] { excluded.insert(id) }
        items[id] = SyncAudit.LocalItem(
          itemID: row[1], parentID: nil, name: row[3], kind: ItemKind(rawValue: row[4]) ?? .file, mode: row[5],
          size: row[6], symlinkTarget: row[7], etag: row[8],
          changedHere: queued.contains(id) || dirty.contains(id), path: "")
      }
      // Paths and local-only subtrees, each folder worked out once (at most 4,096 levels).
      var paths: [Int64: String] = [Self.rootInode: ""]
      var localOnly: [Int64: Bool] = [Self.rootInode: false]
      func resolve(_ id: Int64) -> (path: String, localOnly: Bool) {
        var chain: [Int64] = []
        var cur: Int64? = id
        while let c = cur, paths[c] == nil, items[c] != nil, chain.count < 4096 {
          chain.append(c)
          cur = parents[c]
        }
        var path = cur.flatMap { paths[$0] } ?? "?"
        var only = cur.flatMap { localOnly[$0] } ?? false
        for c in chain.reversed() {
          let name = items[c]!.name
          path = path.isEmpty ? name : path + "/" + name
          only = only || excluded.contains(c) || ItemName.isNoSync(name)
          paths[c] = path
          localOnly[c] = only
        }
        return (paths[id] ?? path, localOnly[id] ?? only)
      }
      var byItemID: [String: SyncAudit.LocalItem] = [:]
      var localOnlyIDs = Set<String>()
      for (id, var item) in items {
        let (path, only) = resolve(id)
        if only {
          localOnlyIDs.insert(item.itemID)
          continue
        }
        item.path = path
        item.parentID = parents[id].flatMap { items[$0]?.itemID }
        byItemID[item.itemID] = item
      }
      return SyncAudit.LocalSnapshot(
        token: token, items: byItemID, queuedDeletes: queuedDeletes, heldBack: heldBack, localOnly: localOnlyIDs)
    }
  }

  /// How many times the mount has read the change feed again from its start to its end
  /// (`ChangePuller.pullEverythingAgain`), over the index's life: `ubiqfs check --repair`
  /// waits for the count to grow.
  public func feedReadsFromStart() throws -> Int { Int(try meta("feedReadsFromStart") ?? "0") ?? 0 }

  /// Counts a read of the whole change feed from its start (`feedReadsFromStart`).
  public func noteFeedReadFromStart() throws {
    try write { db in
      try db.execute(
        sql: """
          INSERT INTO meta(key, value) VALUES ('feedReadsFromStart', '1')
          ON CONFLICT(key) DO UPDATE SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT)
          """)
    }
  }

  /// The etag a row has while a repair of `ubiqfs check` merges it with the cloud's version
  /// (`queueRepairUploads`): no version of the cloud has it, so the upload meets the cloud's
  /// current version and merges with it, with no base.
  public static let mergeWithCloudEtag = "merge-with-cloud"

  /// Queues the upload of each item as it is here (a repair of `ubiqfs check`): a new
  /// revision, so the uploader sends it. `asNew`: the cloud has no version of it, so the row
  /// forgets the one it was based on and is sent as a first upload. `merging`: the row and the
  /// cloud's version of it differ under one etag; it forgets its base, and its upload merges
  /// with the cloud's version (`mergeWithCloudEtag`). Returns how many were queued (items no
  /// longer here, the root, Documents' own etag, or local-only items are skipped).
  @discardableResult
  public func queueRepairUploads(_ itemIDs: [String], asNew: Set<String> = [], merging: Set<String> = []) throws
    -> Int
  {
    try write { db in
      var queued = 0
      for itemID in itemIDs where itemID != WellKnownItem.root {
        guard let id = try Int64.fetchOne(db.cached("SELECT id FROM items WHERE itemID = ?"), arguments: [itemID]),
          try !Self.isLocalOnly(db, id)
        else { continue }
        if asNew.contains(itemID) && itemID != WellKnownItem.documents {
          try db.cached("UPDATE items SET etag = NULL, base = NULL WHERE id = ?").execute(arguments: [id])
        } else if merging.contains(itemID) {
          try db.cached("UPDATE items SET etag = ?, base = NULL WHERE id = ?").execute(arguments: [
            Self.mergeWithCloudEtag, id,
          ])
        }
        try db.cached("UPDATE items SET revision = revision + 1 WHERE id = ?").execute(arguments: [id])
        try enqueue(db, id)
        queued += 1
      }
      return queued
    }
  }
}
