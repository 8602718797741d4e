import Foundation
import GRDB
import UbiqCore

/// What applying one remote change did, so the filesystem can invalidate kernel caches.
public struct RemoteApplyResult: Sendable {
  public enum Outcome: Sendable, Equatable {
    /// Our own version coming back, or nothing to do.
    case unchanged
    case created
    case updated(contentChanged: Bool)
    case deleted
    /// The parent is not known yet; retry after the rest of the batch.
    case deferred
    /// The local item has changes of its own not yet uploaded; left for conflict handling.
    case locallyModified
    /// The record breaks a rule of the cloud's tree (`CloudItem.brokenRule`): not applied.
    case refused
  }
  public var outcome: Outcome
  public var inode: Int64?
  /// (parent inode, name) entries the kernel may have cached and must forget.
  public var staleEntries: [(Int64, String)] = []
  /// The folders whose entries changed (added, removed, renamed): they get new times.
  public var foldersWithChangedEntries: Set<Int64> { Set(staleEntries.map(\.0)) }
  /// The row a `deleted` outcome removed (a handle may still hold its file open).
  public var removed: ItemRow?
  public init(
    outcome: Outcome, inode: Int64? = nil, staleEntries: [(Int64, String)] = [], removed: ItemRow? = nil
  ) {
    self.outcome = outcome
    self.inode = inode
    self.staleEntries = staleEntries
    self.removed = removed
  }
}

extension IndexStore {
  /// The change-feed position this device has applied.
  public func changeToken() throws -> Int64 { Int64(try meta("changeToken") ?? "0") ?? 0 }
  /// Moves the change-feed position to `t`, once every record up to it is applied or held.
  /// The deletes done here whose last live version is at or before `t` are forgotten: a page
  /// read from now on starts after that version, so it can no longer bring it back.
  public func setChangeToken(_ t: Int64) throws {
    try write { db in
      try db.cached("INSERT OR REPLACE INTO meta(key, value) VALUES ('changeToken', ?)").execute(arguments: [String(t)])
      try db.cached("DELETE FROM deletedHere WHERE upTo <= ?").execute(arguments: [t])
    }
  }

  /// Applies one remote item version to the index. Files whose content changed become dataless
  /// (downloaded on the next read). Never touches an item with local changes waiting to upload.
  /// `collisions` says what to do when the record's name is held by another local item.
  /// `holding`: a record that local changes block is held (see `holdRemote`) in the same
  /// transaction. A record that is applied (or found stale) releases the held records of its
  /// item that it supersedes.
  public func applyRemote(
    _ r: CloudItem, uid: UInt32, gid: UInt32, collisions: NameCollisionPolicy = .settle, holding: Bool = false
  ) throws -> RemoteApplyResult {
    try write { db in
      try self.applyRemoteHolding(db, r, uid: uid, gid: gid, collisions: collisions, holding: holding)
    }
  }

  /// `applyRemote` of several records, in order, in one transaction: a catch-up of many records
  /// writes the index once per page, not once per record. If one of them fails, none is applied
  /// and the error is thrown (the caller can then apply them one by one).
  public func applyRemote(
    _ records: [CloudItem], uid: UInt32, gid: UInt32, collisions: NameCollisionPolicy = .settle,
    holding: Bool = false
  ) throws -> [RemoteApplyResult] {
    try write { db in
      try records.map { r in
        try self.applyRemoteHolding(db, r, uid: uid, gid: gid, collisions: collisions, holding: holding)
      }
    }
  }

  /// One record of `applyRemote`, in the caller's transaction, with its held records settled.
  private func applyRemoteHolding(
    _ db: Database, _ r: CloudItem, uid: UInt32, gid: UInt32, collisions: NameCollisionPolicy, holding: Bool
  ) throws -> RemoteApplyResult {
    if r.itemID == WellKnownItem.root { return RemoteApplyResult(outcome: .unchanged) }
    // A live record that breaks a rule of the cloud's tree is refused: nothing here changes,
    // and it is remembered for `ubiqfs status` until a later record of the item replaces it.
    if !r.deleted, let broken = r.brokenRule {
      try Self.refuseRemote(db, r, broken)
      return RemoteApplyResult(outcome: .refused)
    }
    try db.cached("DELETE FROM refusedRemote WHERE itemID = ? AND changeSeq < ?").execute(arguments: [
      r.itemID, r.changeSeq,
    ])
    let result = try Self.asRemote(db) { try self.applyRemote(db, r, uid: uid, gid: gid, collisions: collisions) }
    // As a local create, unlink or rename does: a folder whose entries changed gets a new mtime
    // and ctime (tools that skip a folder whose mtime has not moved must see the change). The
    // folder is not queued: its time is this device's, as on any file system.
    let now = clock.nowNs()
    for folder in result.foldersWithChangedEntries { try Self.touchDirectory(db, folder, now) }
    switch result.outcome {
    case .locallyModified:
      if holding { try Self.holdRemote(db, r) }
    case .deferred:
      break
    default:
      try Self.releaseHeld(db, itemID: r.itemID, upTo: r.changeSeq)
    }
    return result
  }

  func applyRemote(
    _ db: Database, _ r: CloudItem, uid: UInt32, gid: UInt32, collisions: NameCollisionPolicy
  ) throws -> RemoteApplyResult {
    // Deleted here, delete not yet done in the cloud: do not bring it back.
    let deleteQueued =
      try Bool.fetchOne(db.cached("SELECT 1 FROM uploadQueue WHERE deleteItemID = ?"), arguments: [r.itemID]) == true
    let local = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE itemID = ?"), arguments: [r.itemID])
    let view = try local.map { row in
      // A record the row has seen (often this device's own upload coming back) is decided by
      // its etag alone: the lookups below are skipped.
      let seen = RemotePlanner.hasSeen(r, localEtag: row.etag)
      let hasChildren =
        try !seen && r.deleted
        && Bool.fetchOne(db.cached("SELECT 1 FROM items WHERE parent = ? LIMIT 1"), arguments: [row.id!]) == true
      return RemotePlanner.LocalView(
        etag: row.etag, isDirectory: row.isDirectory,
        // Changes queued, or written through a handle and not recorded yet.
        changedHere: try !seen
          && (Bool.fetchOne(db.cached("SELECT 1 FROM uploadQueue WHERE item = ?"), arguments: [row.id!]) == true
            || Bool.fetchOne(db.cached("SELECT 1 FROM dirtyContent WHERE item = ?"), arguments: [row.id!]) == true),
        hasChildren: hasChildren, changedBelow: try hasChildren && Self.changedBelow(db, row.id!))
    }
    // Deleted here and in the cloud: a page read before the delete was done may still hold the
    // version it removed.
    let deletedHere =
      local == nil && !r.deleted
      ? try Int64.fetchOne(db.cached("SELECT upTo FROM deletedHere WHERE itemID = ?"), arguments: [r.itemID]) : nil
    let decision = RemotePlanner.decide(r, local: view, deleteQueued: deleteQueued, deletedHere: deletedHere)
    switch (decision, local?.id) {
    case (.holdBack, _):
      return RemoteApplyResult(outcome: .locallyModified, inode: local?.id)
    case (.keepFolderAndUploadIt, let id?):
      // Local children not deleted remotely: keep the directory (nothing is lost) and put it back.
      try db.execute(sql: "UPDATE items SET etag = ?, revision = revision + 1 WHERE id = ?", arguments: [r.etag, id])
      try self.enqueue(db, id)
      return RemoteApplyResult(outcome: .unchanged, inode: id)
    case (.delete, let id?):
      try db.cached("DELETE FROM items WHERE id = ?").execute(arguments: [id])
      return RemoteApplyResult(
        outcome: .deleted, inode: id, staleEntries: local.flatMap { row in row.parent.map { [($0, row.name)] } } ?? [],
        removed: local)
    case (.waitForChildren, _):
      return RemoteApplyResult(outcome: .deferred, inode: local?.id)
    case (.apply, _):
      return try self.applyRecord(db, r, to: local, uid: uid, gid: gid, collisions: collisions)
    case (.alreadyApplied, _), (.keepFolderAndUploadIt, nil), (.delete, nil):
      return RemoteApplyResult(outcome: .unchanged, inode: local?.id)
    }
  }

  /// Makes the local row of `r.itemID` (or a new row) match the cloud record `r`: parent, name
  /// (resolving name collisions), attributes, xattrs, content state, base and conflicts.
  /// `localChunks`: what the cache holds if it differs from the row's manifest (after a merge).
  /// `base` and `syncedRevision`: what the cloud has and the local revision it holds, when not
  /// `r` and the row's revision (a merge adopted with newer local changes kept on top).
  func applyRecord(
    _ db: Database, _ r: CloudItem, to local: ItemRow?, uid: UInt32, gid: UInt32, localChunks: [ChunkRef]? = nil,
    collisions: NameCollisionPolicy = .settle, base: CloudItem? = nil, syncedRevision: Int64? = nil
  ) throws -> RemoteApplyResult {
    guard let parentItemID = r.parentID,
      let parent = try Int64.fetchOne(db.cached("SELECT id FROM items WHERE itemID = ?"), arguments: [parentItemID])
    else { return RemoteApplyResult(outcome: .deferred) }
    var stale: [(Int64, String)] = []
    if let local, local.isDirectory, local.parent != parent {
      // A folder moving below one of its own descendants here: a move made on this device and
      // not yet in the cloud crossed it. The cloud took the other move first, so this one is undone.
      guard try undoCrossedMoves(db, of: local.id!, into: parent, stale: &stale) else {
        return RemoteApplyResult(outcome: .deferred)
      }
    }
    // Two items want one name: the one that reached the cloud later (or not yet) yields and
    // becomes "name 2.ext". Every device applies the same rule, so all converge. One exception:
    // a record this device committed for an item it no longer has (replaced or deleted here,
    // the delete lost to a crash) never takes a name from a local item; it yields, and its new
    // name goes to the cloud, so the other devices follow.
    let ownDevice = try String.fetchOne(db.cached("SELECT value FROM meta WHERE key = 'deviceID'"))
    let ownOrphan = local == nil && ownDevice == r.deviceID
    var name = r.name
    var renamedHere = false
    // A holder that follows its held record, placed once the record has taken the name.
    var following: (row: ItemRow, record: CloudItem)?
    if let otherID = try Self.childID(db, parent, name), otherID != local?.id,
      var other = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [otherID])
    {
      let otherQueued =
        try Bool.fetchOne(db.cached("SELECT 1 FROM uploadQueue WHERE item = ?"), arguments: [otherID]) == true
      let later = try Self.heldRecord(db, of: other)
      let holder = RemotePlanner.NameHolder(
        itemID: other.itemID, unchanged: other.etag != nil && other.revision == other.syncedRevision && !otherQueued,
        changeSeq: other.etag.flatMap { Int64($0) },
        placeFromCloud: Self.isWhereItsCloudVersionPutIt(other, parentID: parentItemID),
        laterInCloud: later.flatMap { later in
          if later.deleted { return .deleted }
          // A temporary name is no place to go: the item is on its way to another.
          if ItemName.isAside(later.name, itemID: later.itemID) { return nil }
          return later.parentID != parentItemID || !ItemName.same(later.name, name) ? .moved : nil
        })
      let outcome = RemotePlanner.settleName(record: r, holder: holder, policy: collisions, ownOrphan: ownOrphan)
      switch outcome {
      case .deferRecord:
        return RemoteApplyResult(outcome: .deferred)
      case .parkHolder:
        // The holder's own record is in this pull and takes it elsewhere (two items swapped
        // names): it waits under a temporary local name until its record is applied.
        try db.execute(
          sql: "UPDATE items SET name = ? WHERE id = ?", arguments: [Self.parkedName(other.itemID), otherID])
        stale += [(parent, other.name)]
      case .holderFollowsItsRecord:
        // Parked while the record takes the name, then placed where its held record puts it
        // (`laterInCloud` is `.moved`: there is one).
        guard let later else { return RemoteApplyResult(outcome: .deferred) }
        try db.execute(
          sql: "UPDATE items SET name = ? WHERE id = ?", arguments: [Self.parkedName(other.itemID), otherID])
        other.name = Self.parkedName(other.itemID)
        following = (other, later)
        stale += [(parent, r.name)]
      case .holderYields, .holderStepsAside:
        let moved = try settleUnderFreeName(db, otherID, in: parent, from: other.name)
        if outcome == .holderStepsAside { try Self.rebasePlace(db, other, parentID: parentItemID, name: moved) }
        stale += [(parent, other.name), (parent, moved)]
      case .recordYields:
        name = try Self.freeName(db, parent, r.name, except: local?.id)
        renamedHere = true
      }
    }
    let manifest = ItemRow.json(r.chunks)
    let conflicts = r.conflicts.flatMap { $0.isEmpty ? nil : ItemRow.json($0) }
    if var row = local {
      let contentChanged = row.kind == .file && (localChunks ?? row.chunkList) != r.chunks
      if row.parent != parent || row.name != name {
        if let p = row.parent { stale.append((p, row.name)) }
        stale.append((parent, name))
      }
      row.parent = parent
      row.name = name
      row.mode = r.mode
      row.mtimeNs = r.mtimeNs
      row.ctimeNs = self.clock.nowNs()
      row.size = r.size
      row.symlinkTarget = r.symlinkTarget
      row.etag = r.etag
      row.chunks = manifest
      row.base = ItemRow.json(base ?? r)
      row.conflicts = conflicts
      if contentChanged { row.content = r.size == 0 ? .cached : .dataless }
      row.syncedRevision = syncedRevision ?? row.revision
      // A name changed here to resolve a collision goes to the cloud, so every device agrees.
      if renamedHere { row.revision += 1 }
      try Self.updateItem(db, row)
      try Self.replaceXattrs(db, row.id!, r.xattrs)
      if renamedHere {
        try Self.noteAutomaticRename(db, row.id!)
        try self.enqueue(db, row.id!)
      }
      if let following, let placed = try placeParked(db, following.row, as: following.record, rebasing: true) {
        stale += placed.staleEntries
      }
      return RemoteApplyResult(outcome: .updated(contentChanged: contentChanged), inode: row.id, staleEntries: stale)
    }
    var row = ItemRow(
      itemID: r.itemID, parent: parent, name: name, kind: r.kind, mode: r.mode, uid: uid, gid: gid, size: r.size,
      mtimeNs: r.mtimeNs, symlinkTarget: r.symlinkTarget, etag: r.etag,
      content: (r.kind == .file && r.size > 0) ? .dataless : .cached)
    row.chunks = manifest
    row.base = ItemRow.json(r)
    row.conflicts = conflicts
    if renamedHere { row.revision = 1 }
    try Self.insertItem(db, &row)
    try Self.replaceXattrs(db, row.id!, r.xattrs)
    if renamedHere {
      try Self.noteAutomaticRename(db, row.id!)
      try self.enqueue(db, row.id!)
    }
    if let following, let placed = try placeParked(db, following.row, as: following.record, rebasing: true) {
      stale += placed.staleEntries
    }
    return RemoteApplyResult(outcome: .created, inode: row.id, staleEntries: stale + [(parent, name)])
  }

  /// Makes room for folder `dir` to move into `parent` when `parent` is below `dir` here: the
  /// planner's moves (`RemotePlanner.undoCrossedMoves`) are carried out, each folder back where
  /// the cloud has it (under a free name if that name is taken here), as a new local revision
  /// that is uploaded. False if the loop remains (nothing local to undo).
  func undoCrossedMoves(_ db: Database, of dir: Int64, into parent: Int64, stale: inout [(Int64, String)])
    throws -> Bool
  {
    let plan = try RemotePlanner.undoCrossedMoves(
      of: dir, into: parent, maxDepth: Self.maxDepth,
      parentHere: { try Self.parent(db, of: $0) },
      parentInCloud: { try Self.placeInCloud(db, of: $0)?.parent })
    guard let plan else { return false }
    return try moveBack(db, plan, stale: &stale)
  }

  /// Undoes this device's move of folder `inode` (queue entry `seq`), which the cloud refused
  /// as a cycle: another device's move crossed it and the cloud took that one first
  /// (`RemotePlanner.undoRefusedMove`). The folder goes back where the cloud has it, each
  /// move a new local revision that is uploaded. Nil when there is nothing to undo yet (the
  /// entry is retried, and the pull brings what the cloud knows); else the entries the kernel
  /// must forget.
  public func undoRefusedMove(seq: Int64, inode: Int64) throws -> RemoteApplyResult? {
    try write { db in
      // Done or replaced since it was refused: nothing to undo.
      guard
        try Bool.fetchOne(db.cached("SELECT 1 FROM uploadQueue WHERE seq = ? AND item = ?"), arguments: [seq, inode])
          == true
      else { return nil }
      let plan = try RemotePlanner.undoRefusedMove(
        of: inode, maxDepth: Self.maxDepth, parentHere: { try Self.parent(db, of: $0) },
        parentInCloud: { try Self.placeInCloud(db, of: $0)?.parent },
        movedHere: { folder in
          // Queued, not refused as a cycle itself, and here in another folder than its base's.
          try Bool.fetchOne(
            db.cached(
              """
              SELECT 1 FROM uploadQueue q JOIN items i ON i.id = q.item
              WHERE q.item = ? AND q.lastErrno IS NOT ?
                AND \(Self.movedHereSQL)
              """), arguments: [folder, EINVAL]) == true
        })
      guard let plan else { return nil }
      var stale: [(Int64, String)] = []
      // All or nothing: a folder that cannot go back rolls back the ones moved before it.
      guard try moveBack(db, plan, stale: &stale) else {
        throw UbiqError.io("cannot put folder \(inode) back where the cloud has it")
      }
      return RemoteApplyResult(outcome: .updated(contentChanged: false), inode: inode, staleEntries: stale)
    }
  }

  /// Moves each folder of `plan` back to its parent in the cloud, under its name there (or a
  /// free one if another item holds it here), as a new local revision that is uploaded. A
  /// temporary name the folder took in the cloud while this device moved it (`ItemName.aside`)
  /// is no user's: the folder takes back the name it moved under. False if a folder is gone or
  /// has no place in the cloud.
  func moveBack(_ db: Database, _ plan: [(folder: Int64, backTo: Int64)], stale: inout [(Int64, String)]) throws
    -> Bool
  {
    for (folder, back) in plan {
      guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [folder]),
        var name = try Self.placeInCloud(db, of: folder)?.name
      else { return false }
      name = ItemName.withoutAside(name, itemID: row.itemID) ?? name
      if let holder = try Self.childID(db, back, name), holder != folder {
        name = try Self.freeName(db, back, name)
      }
      let wasLocalOnly = try Self.isLocalOnly(db, folder)
      try db.execute(
        sql: "UPDATE items SET parent = ?, name = ?, ctimeNs = ?, revision = revision + 1 WHERE id = ?",
        arguments: [back, name, self.clock.nowNs(), folder])
      try enqueueMoved(db, folder, wasLocalOnly: wasLocalOnly)
      if let p = row.parent { stale.append((p, row.name)) }
      stale.append((back, name))
    }
    return true
  }

  /// Where the cloud last said item `inode` is (its parent's local id and its name): its held
  /// record when one waits for the local change to finish (newer than the base), else its base.
  /// Nil if it was never in the cloud or that parent is not here.
  static func placeInCloud(_ db: Database, of inode: Int64) throws -> (parent: Int64, name: String)? {
    guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]) else {
      return nil
    }
    var place = row.baseItem
    if let data = try Data.fetchOne(
      db.cached("SELECT record FROM heldRemote WHERE itemID = ?"), arguments: [row.itemID]),
      let held = try? RecordJSON.decodeStored(data), !held.deleted
    {
      place = held
    }
    guard let place, let parentID = place.parentID,
      let parent = try Int64.fetchOne(db.cached("SELECT id FROM items WHERE itemID = ?"), arguments: [parentID])
    else { return nil }
    return (parent, place.name)
  }

  /// The item here that holds the place the cloud gave `record` although the cloud can have
  /// given it only after that item left (its place here is its cloud version's, which is
  /// older than `record`), when no newer record of it is held: where it went is not known here
  /// yet. Nil if there is none.
  public func staleNameHolder(of record: CloudItem) throws -> (itemID: String, changeSeq: Int64)? {
    try readOne { db in
      guard let parentID = record.parentID,
        let parent = try Int64.fetchOne(db.cached("SELECT id FROM items WHERE itemID = ?"), arguments: [parentID]),
        let id = try Self.childID(db, parent, record.name),
        let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [id]),
        row.itemID != record.itemID, let seq = row.etag.flatMap({ Int64($0) }), seq < record.changeSeq,
        Self.isWhereItsCloudVersionPutIt(row, parentID: parentID), try Self.heldRecord(db, of: row) == nil
      else { return nil }
      return (row.itemID, seq)
    }
  }

  /// Whether `row`, in the folder with item id `parentID`, is where its cloud version (its
  /// base) put it: no rename or move made here.
  static func isWhereItsCloudVersionPutIt(_ row: ItemRow, parentID: String) -> Bool {
    row.baseItem.map { !$0.deleted && $0.parentID == parentID && ItemName.same($0.name, row.name) } ?? false
  }

  /// Makes the place of `row`'s base (its last cloud version) `parentID`/`name`: a place sync
  /// gave the item for the cloud's sake (it left its name there), which the merge of its own
  /// changes with its cloud version must not take for the user's move; the cloud's place wins
  /// there.
  static func rebasePlace(_ db: Database, _ row: ItemRow, parentID: String, name: String) throws {
    guard let id = row.id, var base = row.baseItem else { return }
    base.parentID = parentID
    base.name = name
    try db.execute(sql: "UPDATE items SET base = ? WHERE id = ?", arguments: [ItemRow.json(base), id])
  }

  /// Gives item `id` in folder `parent` the first free "name 2.ext" made from `name`, as a local
  /// revision that goes to the cloud, noted as a name sync chose (`noteAutomaticRename`).
  /// Returns the new name.
  func settleUnderFreeName(_ db: Database, _ id: Int64, in parent: Int64, from name: String) throws -> String {
    let free = try Self.freeName(db, parent, name)
    try db.execute(
      sql: "UPDATE items SET name = ?, ctimeNs = ?, revision = revision + 1 WHERE id = ?",
      arguments: [free, self.clock.nowNs(), id])
    try Self.noteAutomaticRename(db, id)
    try self.enqueue(db, id)
    return free
  }

  /// The held record of `row`'s item that is newer than its version here, if there is one.
  static func heldRecord(_ db: Database, of row: ItemRow) throws -> CloudItem? {
    guard
      let data = try Data.fetchOne(
        db.cached("SELECT record FROM heldRemote WHERE itemID = ? AND changeSeq > ?"),
        arguments: [row.itemID, row.etag.flatMap { Int64($0) } ?? 0]),
      let held = try? RecordJSON.decodeStored(data)
    else { return nil }
    return held
  }

  /// What applying a remote record does when its name is held by another local item.
  public enum NameCollisionPolicy: Sendable {
    /// The item that reached the cloud later yields and becomes "name 2.ext"; every device
    /// applies the same rule.
    case settle
    /// Defer the record (`.deferred`) if the holder has no local changes: the holder's own
    /// record may come later in the same pull.
    case deferUnchangedHolders
    /// Holders among these item ids (their records are in this pull) step aside under a
    /// temporary local name; others are settled.
    case moveAsideHolders(Set<String>)
  }

  /// The temporary local name of an item that stepped aside for another record of a pull
  /// (`NameCollisionPolicy.moveAsideHolders`) until its own record moves it.
  static func parkedName(_ itemID: String) -> String { "\u{1}moving \(itemID)" }

  /// Gives a visible place back to each item of `records` (the records of the items a pull
  /// let step aside) that is still under its temporary name because its record did not apply
  /// in that pull (the file was opened for writing in between, and its record is held; or the
  /// record waits for a later page). A file goes where its record puts it, if that folder is
  /// here and the name is free there: the record, applied later, finds it in place. Otherwise
  /// the item takes back the name it had, or "name 2.ext" if that is taken, which goes to the
  /// cloud like any name the naming rule changes. Idempotent; items not parked are left alone.
  public func unpark(_ records: [CloudItem]) throws -> [RemoteApplyResult] {
    guard !records.isEmpty else { return [] }
    return try write { db in
      try records.compactMap { r in
        guard
          let row = try ItemRow.fetchOne(
            db.cached("SELECT * FROM items WHERE itemID = ? AND name = ?"),
            arguments: [r.itemID, Self.parkedName(r.itemID)])
        else { return nil }
        return try placeParked(db, row, as: r)
      }
    }
  }

  /// Gives parked item `row` the place its record `r` has, if that folder is here and the name
  /// is free there (a folder only within its own folder: a rename cannot close a loop), or
  /// else the name it had, or "name 2.ext" if that is taken (a name the naming rule changes,
  /// which goes to the cloud). `rebasing`: the place is the cloud's, not the user's, also for
  /// the merge of the row's own changes (`rebasePlace`). Nil if the row has no place to go
  /// back to.
  func placeParked(_ db: Database, _ row: ItemRow, as r: CloudItem, rebasing: Bool = false) throws
    -> RemoteApplyResult?
  {
    guard let id = row.id, let parent = row.parent, let had = row.baseItem?.name else { return nil }
    func isFree(_ folder: Int64, _ name: String) throws -> Bool {
      try Self.childID(db, folder, name).map { $0 == id } ?? true
    }
    if !r.deleted, let folderID = r.parentID,
      let folder = try Int64.fetchOne(db.cached("SELECT id FROM items WHERE itemID = ?"), arguments: [folderID]),
      row.kind != .directory || folder == parent, try isFree(folder, r.name)
    {
      try db.execute(sql: "UPDATE items SET parent = ?, name = ? WHERE id = ?", arguments: [folder, r.name, id])
      if rebasing { try Self.rebasePlace(db, row, parentID: folderID, name: r.name) }
      return RemoteApplyResult(
        outcome: .updated(contentChanged: false), inode: id, staleEntries: [(parent, row.name), (folder, r.name)])
    }
    var name = had
    if try isFree(parent, had) {
      try db.execute(sql: "UPDATE items SET name = ? WHERE id = ?", arguments: [had, id])
    } else {
      name = try settleUnderFreeName(db, id, in: parent, from: had)
    }
    if rebasing, let parentID = row.baseItem?.parentID { try Self.rebasePlace(db, row, parentID: parentID, name: name) }
    return RemoteApplyResult(
      outcome: .updated(contentChanged: false), inode: id, staleEntries: [(parent, row.name), (parent, name)])
  }

  /// Whether an item below folder `id` changed here: queued (made, moved here, edited, renamed),
  /// written through a handle and not recorded yet, or local-only (never in the cloud, so no
  /// record of the cloud's will take it out). A chain deeper than `maxDepth` counts as changed
  /// (the folder is kept).
  static func changedBelow(_ db: Database, _ id: Int64) throws -> Bool {
    let rows = try Row.fetchCursor(
      db.cached(
        """
        WITH RECURSIVE below(id, depth) AS (
          SELECT id, 1 FROM items WHERE parent = ?
          UNION ALL SELECT i.id, b.depth + 1 FROM items i JOIN below b ON i.parent = b.id WHERE b.depth <= ?)
        SELECT b.depth, i.name, i.excluded,
          EXISTS(SELECT 1 FROM uploadQueue q WHERE q.item = b.id)
            OR EXISTS(SELECT 1 FROM dirtyContent c WHERE c.item = b.id)
        FROM below b JOIN items i ON i.id = b.id
        """), arguments: [id, Self.maxDepth])
    while let row = try rows.next() {
      // By position: depth, name, excluded, changed.
      if (row[0] as Int) > Self.maxDepth || ItemName.isNoSync(row[1]) || (row[2] as Bool) || (row[3] as Bool) {
        return true
      }
    }
    return false
  }

  /// Notes that item `id`'s newest revision is a name this device's sync chose to settle a
  /// name collision, if every change of it not yet in the cloud is such a name (none is the
  /// user's): it then does not win over a delete made elsewhere (`yieldToDelete`).
  static func noteAutomaticRename(_ db: Database, _ id: Int64) throws {
    try db.cached(
      """
      INSERT OR REPLACE INTO automaticRenames(item, revision)
      SELECT id, revision FROM items WHERE id = ? AND (
        syncedRevision = revision - 1
        OR EXISTS(SELECT 1 FROM automaticRenames a WHERE a.item = items.id AND a.revision = items.revision - 1))
      """
    ).execute(arguments: [id])
  }

  /// Whether revision `revision` of item `inode` only gives the cloud a name this device's sync
  /// chose, with every change before it in the cloud or such a name too (`noteAutomaticRename`).
  static func isAutomaticRename(_ db: Database, _ inode: Int64, revision: Int64) throws -> Bool {
    try Int64.fetchOne(db.cached("SELECT revision FROM automaticRenames WHERE item = ?"), arguments: [inode])
      == revision
  }

  /// What a commit that met its item's tombstone does (`yieldToDelete`).
  public enum DeleteVerdict: Sendable {
    /// The item went here too.
    case deleted(RemoteApplyResult)
    /// A user's change here wins over the delete: merge and commit it.
    case changedHere
    /// Try again later: the file is open for writing, or the folder still holds items whose
    /// tombstones have not come yet.
    case wait
  }

  /// The uploader's commit of item `inode` (queue entry `seq`) met the item's tombstone: another
  /// device deleted it. If every change here not yet in the cloud is a name this device's sync
  /// chose (`noteAutomaticRename`) and no bytes written through a handle wait to be recorded,
  /// the delete wins: the item goes here too, with its queue entry and its held records, and
  /// the tombstone's change sequence is remembered, so a live record of it read before does not
  /// bring it back. A folder that still holds items waits for their tombstones, unless one of
  /// them changed here (then the folder is kept, as for a remote delete).
  public func yieldToDelete(seq: Int64, inode: Int64, tombstone: CloudItem) throws -> DeleteVerdict {
    guard tombstone.deleted else { return .changedHere }
    return try write { db in
      guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]),
        row.itemID == tombstone.itemID,
        try Self.isAutomaticRename(db, inode, revision: row.revision),
        try Bool.fetchOne(db.cached("SELECT 1 FROM dirtyContent WHERE item = ?"), arguments: [inode]) != true
      else { return .changedHere }
      if try Bool.fetchOne(db.cached("SELECT 1 FROM items WHERE parent = ? LIMIT 1"), arguments: [inode]) == true {
        return try Self.changedBelow(db, inode) ? .changedHere : .wait
      }
      try db.cached("DELETE FROM uploadQueue WHERE seq = ?").execute(arguments: [seq])
      try db.cached("DELETE FROM items WHERE id = ?").execute(arguments: [inode])
      try Self.deleteDone(db, itemID: row.itemID, tombstone: tombstone.changeSeq)
      return .deleted(
        RemoteApplyResult(
          outcome: .deleted, inode: inode, staleEntries: row.parent.map { [($0, row.name)] } ?? [], removed: row))
    }
  }

  /// "name 2.ext", "name 3.ext", ...: the first that is free in `parent`.
  static func freeName(_ db: Database, _ parent: Int64, _ name: String, except: Int64? = nil) throws -> String {
    var n = 2
    var candidate = ItemName.numbered(name, n)
    while let other = try childID(db, parent, candidate), other != except {
      n += 1
      candidate = ItemName.numbered(name, n)
    }
    return candidate
  }

  /// After the uploader merged a conflict and committed `merged`, makes the local row match it
  /// (the row keeps its revision, so a newer local change still uploads; its base becomes
  /// `merged`, what the cloud has). What the user changed here since `snapshot` (the state the
  /// merge started from) is newer than the merge and stays, as a local change still to upload:
  /// a rename or move (the row stays where it is, and the merged record's name takes no name
  /// here), a mode, the xattrs changed (over the merged set), and content saved again (size
  /// and mtime). `keepingPlace`: the commit parked the item under a temporary name; the row
  /// keeps its own parent and name. `keepingContent`: the file is open for writing. Local
  /// content kept over a merge that took the other side's makes the merged content a conflict
  /// version, credited to the device that wrote it (`contentAuthor`), and the local content is
  /// uploaded again on top.
  public func adoptMerged(
    _ inode: Int64, _ merged: CloudItem, localChunks: [ChunkRef], since snapshot: UploadSnapshot,
    keepingPlace: Bool = false, keepingContent: Bool = false
  ) throws -> RemoteApplyResult {
    try write { db in
      guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]),
        row.itemID == merged.itemID
      else {
        return RemoteApplyResult(outcome: .unchanged)
      }
      let before = snapshot.row
      let changedHere = row.revision != before.revision
      var adopted = merged
      // A place the user chose: not a temporary name a pull parked the item under, nor a name
      // this device's sync chose to settle a collision (the merged record settles it again).
      let movedHere =
        try changedHere && (row.parent != before.parent || !ItemName.same(row.name, before.name))
        && row.name != Self.parkedName(row.itemID) && !Self.isAutomaticRename(db, inode, revision: row.revision)
      if keepingPlace || movedHere, let parent = row.parent,
        let parentID = try String.fetchOne(db.cached("SELECT itemID FROM items WHERE id = ?"), arguments: [parent])
      {
        adopted.parentID = parentID
        adopted.name = row.name
      }
      if changedHere && row.mode != before.mode { adopted.mode = row.mode }
      if changedHere {
        let xattrsHere = try Self.xattrs(db, of: inode)
        for key in Set(xattrsHere.keys).union(snapshot.xattrs.keys) where xattrsHere[key] != snapshot.xattrs[key] {
          adopted.xattrs[key] = xattrsHere[key]
        }
      }
      let saved = row.kind == .file && (row.size != before.size || row.mtimeNs != before.mtimeNs)
      let keepContent = (keepingContent || saved) && row.kind == .file && merged.chunks != localChunks
      if keepContent {
        var conflicts = (merged.conflicts ?? []).filter { $0.chunks != localChunks }
        conflicts.append(
          ConflictVersion(
            versionID: "v\(merged.etag)", deviceID: merged.contentAuthor, mtimeNs: merged.mtimeNs,
            size: merged.size,
            chunks: merged.chunks))
        adopted.conflicts = conflicts
        adopted.chunks = localChunks
      }
      if keepContent || saved {
        adopted.size = row.size
        adopted.mtimeNs = row.mtimeNs
      }
      let result = try self.applyRecord(
        db, adopted, to: row, uid: row.uid, gid: row.gid, localChunks: localChunks, base: merged,
        syncedRevision: before.revision)
      if adopted != merged {
        // The cloud does not have this state yet: it is a local revision to upload.
        try db.execute(sql: "UPDATE items SET revision = revision + 1 WHERE id = ?", arguments: [inode])
        try self.enqueue(db, inode)
      }
      return result
    }
  }

  /// The cloud's version of the root or Documents, which the cloud and a fresh index each make
  /// under the same id, becomes the row's, as a pull would apply it (its mode, time and
  /// extended attributes, and the version as the base), unless the row already has a version
  /// or a change of its own. With the etag alone, the pull would take the record for one this
  /// device has applied.
  public func adoptWellKnown(_ record: CloudItem) throws {
    try write { db in
      guard
        let row = try ItemRow.fetchOne(
          db.cached("SELECT * FROM items WHERE itemID = ? AND etag IS NULL AND revision = syncedRevision"),
          arguments: [record.itemID]), row.kind == record.kind, !record.deleted
      else { return }
      try db.execute(
        sql: "UPDATE items SET etag = ?, base = ?, mode = ?, mtimeNs = ?, ctimeNs = ? WHERE id = ?",
        arguments: [record.etag, ItemRow.json(record), record.mode, record.mtimeNs, record.mtimeNs, row.id!])
      try Self.replaceXattrs(db, row.id!, record.xattrs)
    }
  }

  static func replaceXattrs(_ db: Database, _ inode: Int64, _ x: [String: Data]) throws {
    try db.cached("DELETE FROM xattrs WHERE item = ?").execute(arguments: [inode])
    for (k, v) in x {
      try db.cached("INSERT INTO xattrs(item, name, value) VALUES (?, ?, ?)").execute(arguments: [inode, k, v])
    }
  }

  /// Marks a file's content as present in the cache after a download of chunk manifest
  /// `manifest`; false (nothing changed) if the item's content changed meanwhile.
  public func markCached(_ inode: Int64, manifest: String?) throws -> Bool {
    try write { db in
      // The same chunks, however their manifest's text is written.
      guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]),
        row.chunks == manifest || row.chunkList == ItemRow.chunkList(manifest)
      else { return false }
      try db.execute(
        sql: "UPDATE items SET content = ?, lastUsedNs = ? WHERE id = ?",
        arguments: [ContentState.cached.rawValue, self.clock.nowNs(), inode])
      return true
    }
  }

  /// Drops a file's local content if it is safely in the cloud: uploaded (no queue entry,
  /// synced revision) and not pinned. Returns false if it must stay.
  public func markEvicted(_ inode: Int64) throws -> Bool {
    try write { db in
      guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]),
        row.kind == .file, row.etag != nil, !row.pinned,
        row.revision == row.syncedRevision,
        try Bool.fetchOne(db.cached("SELECT 1 FROM uploadQueue WHERE item = ?"), arguments: [inode]) != true,
        try Bool.fetchOne(db.cached("SELECT 1 FROM dirtyContent WHERE item = ?"), arguments: [inode]) != true
      else { return false }
      if row.size == 0 { return true }
      try db.execute(
        sql: "UPDATE items SET content = ? WHERE id = ?", arguments: [ContentState.dataless.rawValue, inode])
      return true
    }
  }
}

extension IndexStore {
  /// A cached file whose cache file is gone: if its content is safely in the cloud (uploaded,
  /// nothing queued), marks it dataless so the next open downloads it again. Returns false if
  /// the cloud does not have the current content.
  public func markContentMissing(_ inode: Int64) throws -> Bool {
    try write { db in
      guard let row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]),
        row.kind == .file, row.etag != nil, row.size > 0, row.revision == row.syncedRevision,
        try Bool.fetchOne(db.cached("SELECT 1 FROM uploadQueue WHERE item = ?"), arguments: [inode]) != true,
        try Bool.fetchOne(db.cached("SELECT 1 FROM dirtyContent WHERE item = ?"), arguments: [inode]) != true
      else { return false }
      try db.cached("UPDATE items SET content = ? WHERE id = ?").execute(arguments: [
        ContentState.dataless.rawValue, inode,
      ])
      return true
    }
  }

  /// Bytes of file content currently held in the cache (by the index's account).
  public func cachedBytes() throws -> Int64 {
    try read { db in
      try Int64.fetchOne(db.cached("SELECT COALESCE(sum(size), 0) FROM items WHERE kind = 1 AND content = 1")) ?? 0
    }
  }

  /// Least-recently-used files that could be evicted: cached, uploaded exactly, not pinned.
  public func evictionCandidates(limit: Int) throws -> [ItemRow] {
    try read { db in
      try ItemRow.fetchAll(
        db,
        sql: """
          SELECT * FROM items WHERE kind = 1 AND content = 1 AND size > 0 AND pinned = 0 AND etag IS NOT NULL
            AND revision = syncedRevision AND id NOT IN (SELECT item FROM uploadQueue WHERE item IS NOT NULL)
            AND id NOT IN (SELECT item FROM dirtyContent)
          ORDER BY lastUsedNs LIMIT ?
          """, arguments: [limit])
    }
  }

  /// Records when files were last used (for LRU eviction), in one transaction.
  public func recordUse(_ uses: [Int64: Int64]) throws {
    guard !uses.isEmpty else { return }
    try write { db in
      for (inode, ns) in uses {
        try db.cached("UPDATE items SET lastUsedNs = ? WHERE id = ?").execute(arguments: [ns, inode])
      }
    }
  }
}

extension IndexStore {
  /// Resolves an item's conflicts: keeps the current version (nil) or the conflict version
  /// `versionID` (which becomes the current content, dataless until read) and drops the rest.
  /// Returns true if the content changed (the cache file must go).
  public func resolveConflicts(_ inode: Int64, keep versionID: String?) throws -> Bool {
    try write { db in
      guard var row = try ItemRow.fetchOne(db.cached("SELECT * FROM items WHERE id = ?"), arguments: [inode]) else {
        throw UbiqError.notFound("inode \(inode)")
      }
      let versions = row.conflictList
      if versions.isEmpty && versionID == nil { return false }
      var contentChanged = false
      if let versionID, versionID != "current" {
        guard let v = versions.first(where: { $0.versionID == versionID }) else {
          throw UbiqError.notFound("no conflict version \(versionID) (see ubiqfs versions)")
        }
        if try Bool.fetchOne(db.cached("SELECT 1 FROM uploadQueue WHERE item = ?"), arguments: [inode]) == true,
          row.content == .cached
        {
          throw UbiqError.busy("local changes are still uploading; try again when uploaded")
        }
        row.chunks = ItemRow.json(v.chunks)
        row.size = v.size
        row.mtimeNs = v.mtimeNs
        row.content = v.size == 0 ? .cached : .dataless
        contentChanged = true
      }
      row.conflicts = nil
      row.ctimeNs = self.clock.nowNs()
      row.revision += 1
      try Self.updateItem(db, row)
      try self.enqueue(db, inode)
      return contentChanged
    }
  }
}

extension IndexStore {
  /// Keeps a remote record that could not be applied because the item has local changes (a
  /// queued delete, a handle open for writing), so it is applied once they are done instead of
  /// being passed by with the change token. Only the newest record of an item is kept.
  public func holdRemote(_ r: CloudItem) throws {
    try write { db in try Self.holdRemote(db, r) }
  }

  static func holdRemote(_ db: Database, _ r: CloudItem) throws {
    try db.execute(
      sql: """
        INSERT INTO heldRemote(itemID, changeSeq, record) VALUES (?, ?, ?)
        ON CONFLICT(itemID) DO UPDATE SET changeSeq = excluded.changeSeq, record = excluded.record
        WHERE excluded.changeSeq > heldRemote.changeSeq
        """, arguments: [r.itemID, r.changeSeq, try JSONEncoder().encode(r)])
  }

  /// Remembers a record refused for breaking `rule`, unless a later record of its item is.
  static func refuseRemote(_ db: Database, _ r: CloudItem, _ rule: BrokenItemRule) throws {
    try refuseRemote(db, RefusedRecord(itemID: r.itemID, name: r.name, reason: rule.description), at: r.changeSeq)
  }

  /// Remembers a record of the change feed that is refused (`RefusedRecord`), at change
  /// sequence `changeSeq`, unless a later record of its item is: a record that is no item
  /// version at all, which nothing here applies.
  public func refuseRemote(_ refused: RefusedRecord, at changeSeq: Int64) throws {
    try write { db in try Self.refuseRemote(db, refused, at: changeSeq) }
  }

  static func refuseRemote(_ db: Database, _ refused: RefusedRecord, at changeSeq: Int64) throws {
    try db.cached(
      """
      INSERT INTO refusedRemote(itemID, changeSeq, name, reason) VALUES (?, ?, ?, ?)
      ON CONFLICT(itemID) DO UPDATE SET changeSeq = excluded.changeSeq, name = excluded.name, reason = excluded.reason
      WHERE excluded.changeSeq > refusedRemote.changeSeq
      """
    ).execute(arguments: [refused.itemID, changeSeq, refused.name, refused.reason])
  }

  /// The held remote records, oldest change first.
  public func heldRemote() throws -> [CloudItem] {
    try read { db in
      try Data.fetchAll(db.cached("SELECT record FROM heldRemote ORDER BY changeSeq")).map {
        try RecordJSON.decodeStored($0)
      }
    }
  }

  /// Forgets the held record of `itemID` if it is not newer than `changeSeq` (nil: whatever it is).
  static func releaseHeld(_ db: Database, itemID: String, upTo changeSeq: Int64? = nil) throws {
    try db.cached("DELETE FROM heldRemote WHERE itemID = ? AND changeSeq <= ?")
      .execute(arguments: [itemID, changeSeq ?? Int64.max])
  }
}
