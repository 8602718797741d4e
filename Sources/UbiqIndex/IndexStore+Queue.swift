import Foundation
import GRDB
import UbiqCore

/// What the upload worker needs to send one item: its row, its parent's cloud id and its xattrs,
/// read in one transaction.
public struct UploadSnapshot: Sendable {
  public var row: ItemRow
  public var parentItemID: String?
  public var xattrs: [String: Data]
  /// Bytes of the item's content were recorded without an fsync of its cache file.
  public var contentUnsynced = false
  /// Every change of the row's revision not yet in the cloud is a name this device's sync chose
  /// to settle a name collision (`noteAutomaticRename`).
  public var automaticRename = false
  /// The item and revision the snapshot shows.
  public var identity: ItemIdentity { ItemIdentity(itemID: row.itemID, revision: row.revision) }
}

/// Which cloud item a local item is, at which local revision.
public struct ItemIdentity: Sendable, Equatable {
  public var itemID: String
  public var revision: Int64
  public init(itemID: String, revision: Int64) {
    self.itemID = itemID
    self.revision = revision
  }
}

/// A version the cloud stored for a queue entry (`IndexStore.markUploaded`): the entry, the
/// item and the revision the version was made from, and the cloud's record of it.
public struct UploadRecord: Sendable {
  public var seq: Int64
  public var inode: Int64
  public var itemID: String
  public var revision: Int64
  public var result: CloudItem
  /// The row already took `result` (a merge, `adoptMerged`).
  public var adopted = false
  /// `result` is the cloud's content under the item's new place.
  public var placeOnly = false
  public init(
    seq: Int64, inode: Int64, itemID: String, revision: Int64, result: CloudItem, adopted: Bool = false,
    placeOnly: Bool = false
  ) {
    self.seq = seq
    self.inode = inode
    self.itemID = itemID
    self.revision = revision
    self.result = result
    self.adopted = adopted
    self.placeOnly = placeOnly
  }
}

extension IndexStore {
  /// Queue entries due now, oldest first.
  public func dueQueue(now: Int64, limit: Int) throws -> [QueueEntry] {
    try read { db in
      try QueueEntry.fetchAll(
        db, sql: "SELECT * FROM uploadQueue WHERE nextAttemptNs <= ? ORDER BY seq LIMIT ?", arguments: [now, limit])
    }
  }

  /// When the next queue entry becomes due (nil: queue empty).
  public func nextDueNs() throws -> Int64? {
    try read { db in try Int64.fetchOne(db.cached("SELECT min(nextAttemptNs) FROM uploadQueue")) }
  }

  /// The cloud identifier and local revision of each of `inodes` that exists, read at one
  /// moment: enough to tell whether snapshots taken earlier are still the items' state.
  public func identities(_ inodes: [Int64]) throws -> [Int64: ItemIdentity] {
    try read { db in
      var found: [Int64: ItemIdentity] = [:]
      for inode in inodes {
        if let row = try Row.fetchOne(db.cached("SELECT itemID, revision FROM items WHERE id = ?"), arguments: [inode])
        {
          found[inode] = ItemIdentity(itemID: row["itemID"], revision: row["revision"])
        }
      }
      return found
    }
  }

  public func uploadSnapshot(_ inode: Int64) throws -> UploadSnapshot? {
    try read { db in try Self.uploadSnapshot(db, inode) }
  }

  /// The upload snapshots of those of `inodes` that exist, all read at one moment.
  public func uploadSnapshots(_ inodes: [Int64]) throws -> [Int64: UploadSnapshot] {
    try read { db in
      var found: [Int64: UploadSnapshot] = [:]
      for inode in inodes { found[inode] = try Self.uploadSnapshot(db, inode) }
      return found
    }
  }

  static func uploadSnapshot(_ db: Database, _ inode: Int64) throws -> UploadSnapshot? {
    guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]) else {
      return nil
    }
    let parentID = try row.parent.flatMap {
      try String.fetchOne(db.cached("SELECT itemID FROM items WHERE id = ?"), arguments: [$0])
    }
    let x = try Self.xattrs(db, of: inode)
    let unsynced =
      try Bool.fetchOne(db.cached("SELECT 1 FROM unsyncedContent WHERE item = ?"), arguments: [inode]) ?? false
    let automatic = try Self.isAutomaticRename(db, inode, revision: row.revision)
    return UploadSnapshot(
      row: row, parentItemID: parentID, xattrs: x, contentUnsynced: unsynced, automaticRename: automatic)
  }

  /// Records a successful upload of `revision` of `itemID` from inode `inode`. If the item changed
  /// meanwhile the entry stays queued; if it was deleted or re-identified meanwhile, the version
  /// just created is queued for deletion.
  /// `adopted`: the row already took `result` (a merge, `adoptMerged`), possibly keeping newer
  /// local content on top; only the queue entry and the held records are settled here.
  /// `placeOnly`: `result` is the cloud's content under the item's new place (its writer has not
  /// flushed yet): the row takes it as its base, and the entry stays queued for the content.
  public func markUploaded(
    seq: Int64, inode: Int64, itemID: String, revision: Int64, result: CloudItem, adopted: Bool = false,
    placeOnly: Bool = false
  ) throws {
    try write { db in
      try self.recordUpload(
        db,
        UploadRecord(
          seq: seq, inode: inode, itemID: itemID, revision: revision, result: result, adopted: adopted,
          placeOnly: placeOnly))
    }
  }

  /// Records the uploads of a batch committed in the cloud, each as `markUploaded`, in one
  /// transaction.
  public func markUploaded(_ uploads: [UploadRecord]) throws {
    if uploads.isEmpty { return }
    try write { db in
      for upload in uploads { try self.recordUpload(db, upload) }
    }
  }

  /// `markUploaded` inside a transaction.
  func recordUpload(_ db: Database, _ upload: UploadRecord) throws {
    let (seq, inode, itemID, revision, result) = (
      upload.seq, upload.inode, upload.itemID, upload.revision, upload.result
    )
    let (adopted, placeOnly) = (upload.adopted, upload.placeOnly)
    let manifest = ItemRow.json(result.chunks)
    guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]),
      row.itemID == itemID
    else {
      try db.cached("DELETE FROM uploadQueue WHERE seq = ?").execute(arguments: [seq])
      if let heir = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE itemID = ?"), arguments: [itemID]) {
        // Replaced while uploading by a file renamed over it, which took over its identity (an
        // atomic save): the version just created is the cloud's current one, and the heir's
        // own change goes on top of it. The version's conflict versions stay with the heir.
        // Not on top of a merge (`adopted`): it carries changes of other devices that the user
        // had not seen when they saved (the content, when only the mode changed here), so the
        // heir stays on the version they saw and its commit merges with the cloud's.
        if !adopted, (heir.baseItem?.changeSeq ?? -1) < result.changeSeq {
          try db.execute(
            sql: "UPDATE items SET etag = ?, base = ?, chunks = ?, conflicts = ? WHERE id = ?",
            arguments: [
              result.etag, ItemRow.json(result), heir.content == .cached && !placeOnly ? manifest : heir.chunks,
              ItemRow.combinedConflicts(heir.conflictList, result.conflicts ?? []), heir.id,
            ])
        }
        return
      }
      // Deleted while uploading: the version just created must go too, keeping the versions
      // of other devices it may carry (a merge's). A merge (`adopted`) also carries changes
      // of other devices that the user had not seen when they deleted the item (its content,
      // when only its mode changed here): the delete stays on the version they saw, its etag
      // and place, and meets the merge in the cloud as a change made elsewhere, which wins.
      try self.enqueueDelete(
        db,
        CloudDelete(
          itemID: itemID, etag: adopted ? nil : result.etag, keepsVersions: !(result.conflicts ?? []).isEmpty,
          seen: adopted
            ? nil
            : result.parentID.map {
              ItemPlace(parentID: $0, name: result.name, mode: result.mode, xattrs: result.xattrs)
            }))
      return
    }
    if placeOnly {
      try db.execute(
        sql: "UPDATE items SET etag = ?, base = ? WHERE id = ?",
        arguments: [result.etag, ItemRow.json(result), inode])
    } else if !adopted {
      try db.cached(
        "UPDATE items SET etag = ?, chunks = ?, base = ?, conflicts = ?, syncedRevision = ? WHERE id = ?"
      ).execute(
        arguments: [
          result.etag, manifest, ItemRow.json(result),
          result.conflicts.flatMap { $0.isEmpty ? nil : ItemRow.json($0) },
          revision, inode,
        ])
    }
    // Held records of the item that this version supersedes (a merge took them in).
    try Self.releaseHeld(db, itemID: itemID, upTo: result.changeSeq)
    if row.revision == revision && !placeOnly {
      try db.cached("DELETE FROM uploadQueue WHERE seq = ?").execute(arguments: [seq])
    } else {
      // The stored version is now the base: no earlier commit of the entry is unanswered. The
      // changes made since wait from now.
      try db.cached(
        """
        UPDATE uploadQueue SET attempts = 0, lastError = NULL, lastErrno = NULL, sentPlaces = NULL,
          waitingSinceNs = ?
        WHERE seq = ?
        """
      )
      .execute(arguments: [self.clock.nowNs(), seq])
    }
  }

  /// How many places `noteSent` keeps per entry (the latest).
  static let maxSentPlaces = 8

  /// Notes, before commits are sent, where each item is in the version sent, and its mode
  /// (`QueueEntry.unansweredPlaces`): the local side of the commit, not a merge's place or mode
  /// taken from the cloud. The uploader notes every commit before it is sent (`UploadWorker.noteSent`).
  /// Not synced on its own: a note a power loss takes only leaves the merge or delete without it.
  public func noteSent(_ sent: [(seq: Int64, place: ItemPlace)]) throws {
    if sent.isEmpty { return }
    try write { db in
      for (seq, place) in sent {
        guard
          let entry = try QueueEntry.fetchOne(db.cached("SELECT * FROM uploadQueue WHERE seq = ?"), arguments: [seq])
        else { continue }
        guard let places = Self.sentPlaces(entry.sentPlaces, adding: place) else { continue }
        try db.cached("UPDATE uploadQueue SET sentPlaces = ? WHERE seq = ?").execute(arguments: [places, seq])
      }
    }
  }

  /// An entry's `sentPlaces` with `place` noted too (the latest `maxSentPlaces` kept); nil when
  /// `place` is noted already.
  static func sentPlaces(_ sentPlaces: String?, adding place: ItemPlace) -> String? {
    var places = ItemPlace.list(json: sentPlaces)
    if places.contains(place) { return nil }
    places.append(place)
    return ItemPlace.json(Array(places.suffix(maxSentPlaces)))
  }

  /// SQL condition on the items row `i`: it is in another folder here than in its base (the
  /// cloud's version this device last saw), so a queued change of it moves it there.
  static let movedHereSQL = "json_extract(i.base, '$.parentID') IS NOT (SELECT itemID FROM items WHERE id = i.parent)"

  /// Whether an entry other than `seq` will take item `itemID` out of folder `folderItemID`,
  /// which the cloud has it in: its delete, or a change of an item this device put there or
  /// knew there (the folder's delete is queued, so the item is elsewhere here: the change moves
  /// it out), or a change that moves or renames the item here (a place changed here wins the
  /// merge with the cloud's version, `ConflictMerge.merge`, unless it is only a name this
  /// device's sync chose). `placedHere`: the cloud's version of the item is this device's own,
  /// which may be a commit whose answer never came (no base here, or an older one). An item
  /// another device put into the folder and that this device changes in place otherwise (an
  /// edit, a chmod) stays there, and the folder comes back for it. `rm -r` deletes in the order
  /// of this device's tree, and the cloud may still have an item moved here inside a folder
  /// deleted before it, so the place in the queue does not
  /// matter. An entry the cloud refused as invalid (`EINVAL`: a move into a cycle) takes nothing
  /// out: only a pull settles it, by putting the item back, which may need the folder itself.
  public func hasQueuedEntry(
    takingOut itemID: String, of folderItemID: String, placedHere: Bool, besides seq: Int64
  ) throws -> Bool {
    try read { db in
      try Bool.fetchOne(
        db.cached(
          """
          SELECT 1 FROM uploadQueue WHERE deleteItemID = ?1 AND seq != ?2 AND lastErrno IS NOT ?3
          UNION ALL
          SELECT 1 FROM items i JOIN uploadQueue q ON q.item = i.id
          WHERE i.itemID = ?1 AND q.seq != ?2 AND q.lastErrno IS NOT ?3
            AND (?5 OR json_extract(i.base, '$.parentID') = ?4
              OR \(Self.movedHereSQL)
              OR (json_extract(i.base, '$.name') IS NOT i.name
                AND NOT EXISTS(SELECT 1 FROM automaticRenames a WHERE a.item = i.id AND a.revision = i.revision)))
          LIMIT 1
          """), arguments: [itemID, seq, EINVAL, folderItemID, placedHere]) == true
    }
  }

  /// Finishes a queued delete: the cloud deleted the item (its held records go with it, and
  /// the change sequence of its `tombstone` is remembered: see `deleteDone`), or refused
  /// because the item changed there (`restoring`: the cloud's record, held so that the next
  /// pull brings it back). One transaction, so no pull sees the entry gone without the held
  /// record or the remembered delete in place.
  public func finishDelete(seq: Int64, itemID: String, tombstone: Int64?, restoring current: CloudItem?) throws {
    try write { db in
      try db.cached("DELETE FROM uploadQueue WHERE seq = ?").execute(arguments: [seq])
      if let current {
        try Self.holdRemote(db, current)
      } else {
        try Self.deleteDone(db, itemID: itemID, tombstone: tombstone)
      }
    }
  }

  /// Records deletes the cloud carried out (each as `finishDelete` with nothing to restore),
  /// in one transaction: each entry (by its queue sequence number) leaves the queue.
  public func finishDeletes(_ done: [(seq: Int64, itemID: String, tombstone: Int64)]) throws {
    if done.isEmpty { return }
    try write { db in
      for (seq, itemID, tombstone) in done {
        try db.cached("DELETE FROM uploadQueue WHERE seq = ?").execute(arguments: [seq])
        try Self.deleteDone(db, itemID: itemID, tombstone: tombstone)
      }
    }
  }

  /// The cloud deleted `itemID` for this device. `tombstone`: the change sequence of the
  /// item's tombstone (nil: the cloud keeps none), remembered until the change feed passes
  /// it: every live version of the item is older, so a page read before the delete cannot
  /// bring the item back (`RemotePlanner.decide`).
  static func deleteDone(_ db: Database, itemID: String, tombstone: Int64?) throws {
    try releaseHeld(db, itemID: itemID)
    guard let upTo = tombstone else { return }
    try db.cached(
      """
      INSERT INTO deletedHere(itemID, upTo) VALUES (?, ?)
      ON CONFLICT(itemID) DO UPDATE SET upTo = max(upTo, excluded.upTo)
      """
    ).execute(arguments: [itemID, upTo])
  }

  public func markDone(seq: Int64) throws {
    try write { db in try db.cached("DELETE FROM uploadQueue WHERE seq = ?").execute(arguments: [seq]) }
  }

  /// Records a failed attempt of the entry as it was queued at `triedAsOf` (its `enqueuedNs`
  /// when the attempt read it); the entry is retried with exponential backoff (1 s doubling to
  /// at most `maxBackoffNs`) and is never dropped. An entry re-armed since by a new change
  /// holds a version nobody has tried: the attempt is counted, and the error and the backoff
  /// are not its. Returns false then.
  @discardableResult
  public func markFailed(
    seq: Int64, error: String, errno: Int32, triedAsOf: Int64, maxBackoffNs: Int64 = 60_000_000_000
  ) throws -> Bool {
    try write { db in
      guard
        let row = try Row.fetchOne(
          db.cached("SELECT attempts, enqueuedNs FROM uploadQueue WHERE seq = ?"), arguments: [seq])
      else { return false }
      guard (row["enqueuedNs"] as Int64) == triedAsOf else {
        try db.cached("UPDATE uploadQueue SET attempts = attempts + 1 WHERE seq = ?").execute(arguments: [seq])
        return false
      }
      let attempts: Int = row["attempts"]
      let backoff = min(maxBackoffNs, Int64(1_000_000_000) << Int64(min(max(attempts, 0), 20)))
      let now = self.clock.nowNs()
      try db.execute(
        sql: """
          UPDATE uploadQueue SET attempts = attempts + 1, lastError = ?, lastErrno = ?, nextAttemptNs = ?,
            waitingSinceNs = ?
          WHERE seq = ?
          """, arguments: [error, errno, now + backoff, now, seq])
      return true
    }
  }

  /// Postpones an entry without counting a failure (e.g. the file is being written).
  public func postpone(seq: Int64, byNs: Int64) throws {
    try write { db in
      try db.execute(
        sql: "UPDATE uploadQueue SET nextAttemptNs = ? WHERE seq = ?", arguments: [self.clock.nowNs() + byNs, seq])
    }
  }

  /// Makes every waiting entry due now (the cloud came back, or the user asked to sync).
  public func retryAllNow() throws {
    let now = self.clock.nowNs()
    try write { db in
      try db.execute(sql: "UPDATE uploadQueue SET nextAttemptNs = ? WHERE nextAttemptNs > ?", arguments: [now, now])
    }
  }

  public func queueSummary() throws -> QueueSummary {
    try read { db in
      let items = try Int.fetchOne(db.cached("SELECT count(*) FROM uploadQueue WHERE item IS NOT NULL")) ?? 0
      let deletes = try Int.fetchOne(db.cached("SELECT count(*) FROM uploadQueue WHERE deleteItemID IS NOT NULL")) ?? 0
      let bytes =
        try Int64.fetchOne(
          db, sql: "SELECT COALESCE(sum(i.size), 0) FROM uploadQueue q JOIN items i ON i.id = q.item WHERE i.kind = 1")
        ?? 0
      var failing: [FailingUpload] = []
      for e in try QueueEntry.fetchAll(
        db, sql: "SELECT * FROM uploadQueue WHERE lastError IS NOT NULL ORDER BY seq LIMIT 50")
      {
        let path = try e.item.flatMap { try Self.path(db, $0) } ?? "(deleted item \(e.deleteItemID ?? "?"))"
        failing.append(
          FailingUpload(
            path: path, attempts: e.attempts, error: e.lastError ?? "", errno: e.lastErrno ?? 0,
            nextAttemptNs: e.nextAttemptNs))
      }
      var waiting = 0
      var waitingForFiles: [String] = []
      for data in try Data.fetchAll(db, sql: "SELECT record FROM heldRemote") {
        guard let r = try? JSONDecoder().decode(CloudItem.self, from: data), !r.deleted, let parent = r.parentID
        else { continue }
        if try Bool.fetchOne(db.cached("SELECT 1 FROM items WHERE itemID = ?"), arguments: [parent]) != true {
          waiting += 1
        } else if waitingForFiles.count < 50,
          let id = try Int64.fetchOne(db.cached("SELECT id FROM items WHERE itemID = ?"), arguments: [r.itemID]),
          let path = try Self.path(db, id)
        {
          waitingForFiles.append(path)
        }
      }
      let refused = try Row.fetchAll(
        db, sql: "SELECT itemID, name, reason FROM refusedRemote ORDER BY changeSeq LIMIT 50"
      ).map { RefusedRecord(itemID: $0["itemID"], name: $0["name"], reason: $0["reason"]) }
      return QueueSummary(
        pendingItems: items, pendingDeletes: deletes, pendingBytes: bytes, failing: failing, waitingForParent: waiting,
        waitingForFiles: waitingForFiles.sorted(), refusedRecords: refused)
    }
  }

  /// The queue entry of an item, if it has one.
  public func queueEntry(forInode inode: Int64) throws -> QueueEntry? {
    try readOne { db in
      try QueueEntry.fetchOne(db.cached("SELECT * FROM uploadQueue WHERE item = ?"), arguments: [inode])
    }
  }

  /// Number of queued uploads at or below `inode` (deletes count everywhere, since their
  /// place in the tree is gone).
  public func pendingCount(under inode: Int64) throws -> Int {
    try read { db in
      try Int.fetchOne(
        db,
        sql: """
          WITH RECURSIVE sub(id) AS (SELECT ? UNION ALL SELECT items.id FROM items JOIN sub ON items.parent = sub.id)
          SELECT (SELECT count(*) FROM uploadQueue WHERE item IN (SELECT id FROM sub))
               + (SELECT count(*) FROM uploadQueue WHERE deleteItemID IS NOT NULL)
          """, arguments: [inode]) ?? 0
    }
  }

  /// Items whose name matches a glob (`*`, `?`, `[...]`), with their container-relative paths,
  /// at most `limit`. A glob that starts with literal text reads the names that start so (the
  /// name index); one that only ends with literal text (`*.txt`) reads the names that end so
  /// (the reversed-name index); any other reads every name.
  public func find(glob: String, limit: Int) throws -> [(path: String, row: ItemRow)] {
    try read { db in
      let rows: [ItemRow]
      if let range = Self.reversedNameBounds(matching: glob) {
        rows = try ItemRow.fetchAll(
          db,
          sql: """
            SELECT * FROM items WHERE ubiq_reversed(name) >= ? AND ubiq_reversed(name) < ?
              AND name GLOB ? AND id != ? LIMIT ?
            """,
          arguments: [range.lowerBound, range.upperBound, glob, Self.rootInode, limit])
      } else {
        rows = try ItemRow.fetchAll(
          db, sql: "SELECT * FROM items WHERE name GLOB ? AND id != ? ORDER BY id LIMIT ?",
          arguments: [glob, Self.rootInode, limit])
      }
      return try rows.compactMap { r in try Self.path(db, r.id!).map { ($0, r) } }
    }
  }

  /// Why `glob` is no pattern (a class `[...]` without its `]`, which matches nothing), or nil.
  /// As in SQLite's GLOB, a `]` first in a class (after `[` or `[^`) is one of its characters.
  public static func globProblem(_ glob: String) -> String? {
    var scalars = glob.unicodeScalars.makeIterator()
    while let c = scalars.next() {
      guard c == "[" else { continue }
      var next = scalars.next()
      if next == "^" { next = scalars.next() }
      if next == "]" { next = scalars.next() }
      while let n = next, n != "]" { next = scalars.next() }
      if next == nil { return "'[' without its ']' (a ']' first in a class, '[]]', is a literal one)" }
    }
    return nil
  }

  /// For a glob that starts with a wildcard and ends with literal text (no `[...]` class):
  /// the bounds of the reversed names that end with that text. Nil for any other glob. SQLite
  /// compares the bounds by code point; Swift compares strings by canonical equivalence, which
  /// may order them otherwise, so they are no Swift `Range`.
  static func reversedNameBounds(matching glob: String) -> (lowerBound: String, upperBound: String)? {
    let wildcards: Set<Unicode.Scalar> = ["*", "?"]
    let scalars = Array(glob.unicodeScalars)
    guard let first = scalars.first, wildcards.contains(first), !scalars.contains("["), !scalars.contains("]")
    else { return nil }
    let suffix = scalars.reversed().prefix { !wildcards.contains($0) }
    guard let last = suffix.last, let next = Self.scalar(after: last) else { return nil }
    var lower = String.UnicodeScalarView()
    lower.append(contentsOf: suffix)
    var upper = String.UnicodeScalarView()
    upper.append(contentsOf: suffix.dropLast())
    upper.append(next)
    return (String(lower), String(upper))
  }

  /// The next Unicode scalar in code point order (past the surrogate gap); nil after the last.
  private static func scalar(after s: Unicode.Scalar) -> Unicode.Scalar? {
    var v = s.value + 1
    if v == 0xD800 { v = 0xE000 }
    return Unicode.Scalar(v)
  }
}
