import Foundation
import GRDB
import Synchronization
import Testing

@testable import UbiqCore
@testable import UbiqIndex

/// The index's write transactions (`IndexStore.write`) and its row statements
/// (`insertItem`, `updateItem`): all or nothing, and rows written as they are read back.
@Suite struct IndexWriteTests {
  static func openIndex() throws -> (IndexStore, URL) {
    let dir = FileManager.default.temporaryDirectory.appendingPathComponent("index-write-\(UUID().uuidString)")
    try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
    let index = try IndexStore(path: dir.appendingPathComponent("index.sqlite").path)
    try index.bootstrap(uid: 0, gid: 0)
    return (index, dir)
  }

  static func documents(_ index: IndexStore) throws -> Int64 {
    try #require(try index.item(itemID: WellKnownItem.documents)?.id)
  }

  static func names(_ index: IndexStore) throws -> [String] {
    try index.children(of: documents(index), after: 0, limit: 100).map(\.name).sorted()
  }

  @Test func aBodyThatThrowsLeavesNothing() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    struct Failure: Error {}
    #expect(throws: Failure.self) {
      try index.write { db in
        var row = ItemRow(itemID: "a", parent: docs, name: "a", kind: .file, mode: 0o644, mtimeNs: 1)
        try IndexStore.insertItem(db, &row)
        throw Failure()
      }
    }
    #expect(try Self.names(index) == [])
    // The connection is usable afterwards, and a body that returns commits.
    _ = try index.create(parent: docs, name: "b", kind: .file, mode: 0o644, uid: 0, gid: 0)
    #expect(try Self.names(index) == ["b"])
  }

  @Test func aTransactionSQLiteEndedIsNotReportedAsCommitted() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    #expect(throws: DatabaseError.self) {
      try index.write { db in
        var row = ItemRow(itemID: "a", parent: docs, name: "a", kind: .file, mode: 0o644, mtimeNs: 1)
        try IndexStore.insertItem(db, &row)
        try db.execute(sql: "ROLLBACK")
      }
    }
    #expect(try Self.names(index) == [])
  }

  /// The tree's rules hold in the index whatever code writes it: an item whose folder does not
  /// exist (or is a file), a folder deleted with items in it, a folder moved below itself:
  /// each statement fails, and the tree stays as it was.
  @Test func theIndexRefusesAnItemNoPathReaches() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let x = try index.create(parent: docs, name: "x", kind: .directory, mode: 0o755, uid: 0, gid: 0).id!
    let y = try index.create(parent: x, name: "y", kind: .directory, mode: 0o755, uid: 0, gid: 0).id!
    let f = try index.create(parent: y, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0).id!
    func refused(_ sql: String, _ arguments: StatementArguments) {
      #expect(throws: DatabaseError.self, "\(sql) \(arguments)") {
        try index.write { db in try db.execute(sql: sql, arguments: arguments) }
      }
    }
    for parent in [Int64(999_999), f] {
      refused(
        "INSERT INTO items(itemID, parent, name, kind, mode, uid, gid, size, mtimeNs, ctimeNs, atimeNs, content) "
          + "VALUES ('orphan', ?, 'o', 1, 420, 0, 0, 0, 0, 0, 0, 1)", [parent])
      refused("UPDATE items SET parent = ? WHERE id = ?", [parent, y])
    }
    refused("DELETE FROM items WHERE id = ?", [x])
    refused("UPDATE items SET parent = ? WHERE id = ?", [y, x])
    refused("UPDATE items SET parent = ? WHERE id = ?", [x, x])
    #expect(try index.item(y)?.parent == x)
    #expect(try index.item(x)?.parent == docs)
    #expect(try index.item(itemID: "orphan") == nil)
    // What the rules allow still goes: a move up, a file's delete, then the empty folders'.
    try index.write { db in
      try db.execute(sql: "UPDATE items SET parent = ? WHERE id = ?", arguments: [docs, y])
      try db.execute(sql: "DELETE FROM items WHERE id IN (?, ?)", arguments: [f, x])
    }
    #expect(try Self.names(index) == ["y"])
  }

  @Test func aRowWrittenIsTheRowReadBack() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    var row = ItemRow(
      itemID: "i", parent: docs, name: "é x", kind: .symlink, mode: 0o777, uid: 7, gid: 8, size: 3, mtimeNs: -5,
      symlinkTarget: "t/u", etag: "e1", content: .dataless)
    row.ctimeNs = Int64.min
    row.atimeNs = Int64.max
    row.chunks = "[]"
    row.revision = 4
    row.syncedRevision = 2
    row.pinned = true
    row.excluded = true
    row.lastUsedNs = 9
    row.base = "{}"
    row.conflicts = "[1]"
    try index.write { db in try IndexStore.insertItem(db, &row) }
    #expect(row.id != nil)
    #expect(try index.item(row.id!) == row)
    row.name = "renamed"
    row.etag = nil
    row.pinned = false
    try index.write { db in try IndexStore.updateItem(db, row) }
    #expect(try index.item(row.id!) == row)
  }

  /// A setattr changes the attributes it sets and the change time, nothing else (the row read
  /// back is the row it returns); a mode set to what it is (`tar x` sets every file's) is no
  /// new revision and queues no upload, another mode does.
  @Test func aModeSetToWhatItIsIsNoChangeToUpload() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let file = try #require(try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let entry = try #require(try index.queueEntry(forInode: file))
    let row = try #require(try index.item(file))
    var stored = CloudItem(
      itemID: row.itemID, parentID: try #require(try index.item(docs)).itemID, name: "f", kind: .file,
      mode: 0o644, size: 0, mtimeNs: 0, etag: "1", deviceID: "device-a")
    stored.changeSeq = 1
    try index.markUploaded(seq: entry.seq, inode: file, itemID: row.itemID, revision: row.revision, result: stored)
    #expect(try index.queueEntry(forInode: file) == nil)
    let uploaded = try #require(try index.item(file))

    let same = try index.setAttributes(file, AttributeChanges(mode: 0o100644, uid: 7, gid: 8))
    #expect(try index.item(file) == same)
    #expect(same.revision == uploaded.revision && same.mode == 0o644 && same.uid == 7 && same.gid == 8)
    #expect(same.ctimeNs >= uploaded.ctimeNs && same.mtimeNs == uploaded.mtimeNs)
    #expect(try index.queueEntry(forInode: file) == nil, "nothing to upload")

    let other = try index.setAttributes(file, AttributeChanges(mode: 0o600, mtimeNs: 42))
    #expect(try index.item(file) == other)
    #expect(other.revision == uploaded.revision + 1 && other.mode == 0o600 && other.mtimeNs == 42)
    #expect(other.name == "f" && other.parent == docs && other.etag == "1")
    #expect(try index.queueEntry(forInode: file) != nil)
  }

  /// An item is local-only when it or any folder above it (the root aside) has a `.nosync`
  /// name or is excluded, however deep; a new item there queues no upload.
  @Test func anItemBelowANoSyncOrExcludedFolderIsLocalOnlyAtAnyDepth() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    func folder(_ name: String, in parent: Int64) throws -> Int64 {
      try #require(try index.create(parent: parent, name: name, kind: .directory, mode: 0o755, uid: 0, gid: 0).id)
    }
    var deep = try folder("a", in: docs)
    let top = deep
    for k in 0..<300 { deep = try folder("d\(k)", in: deep) }
    #expect(try !index.isLocalOnly(deep) && !index.isLocalOnly(docs) && !index.isLocalOnly(IndexStore.rootInode))
    let below = try folder("x.nosync", in: deep)
    let inside = try folder("y", in: below)
    #expect(try index.isLocalOnly(below) && index.isLocalOnly(inside) && !index.isLocalOnly(deep))
    #expect(try index.queueEntry(forInode: inside) == nil, "nothing below a .nosync folder is queued")
    #expect(try !index.isLocalOnly(try folder("x.nosync.not", in: deep)))
    try index.setExcluded(top, true)
    #expect(try index.isLocalOnly(deep) && index.isLocalOnly(top) && !index.isLocalOnly(docs))
  }

  @Test func theWriterCheckpointsAfterItsOwnFrameCountNotSQLitesDefault() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let frames = try index.pool.write { db in try Int.fetchOne(db, sql: "PRAGMA wal_autocheckpoint") }
    #expect(frames == IndexStore.checkpointFrames)
    #expect(IndexStore.checkpointFrames > 1000)
  }

  /// Whether `work` finishes (within 10 s) while another thread is inside `hold`'s region:
  /// `hold` runs on a thread of its own and calls `inside` from the region, which returns once
  /// the check is done.
  static func finishes(
    _ work: @escaping @Sendable () -> Void, whileHolding hold: @escaping @Sendable (_ inside: () -> Void) -> Void
  ) -> Bool {
    let holding = DispatchSemaphore(value: 0)
    let release = DispatchSemaphore(value: 0)
    Thread {
      hold {
        holding.signal()
        release.wait()
      }
    }.start()
    holding.wait()
    let done = DispatchSemaphore(value: 0)
    Thread {
      work()
      done.signal()
    }.start()
    let finished = done.wait(timeout: .now() + 10) == .success
    release.signal()
    if !finished { done.wait() }
    return finished
  }

  /// An fsync (`makeDurable`) does not wait for the writer: namespace changes go on while the
  /// WAL is synced, and a long write transaction does not hold up an fsync. (That what it
  /// syncs survives a power loss is checked on LazyFS: Tests/integration/test_power_loss.py.)
  @Test func makingTheIndexDurableDoesNotWaitForTheWriter() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    try index.write { db in try db.execute(sql: "INSERT INTO meta(key, value) VALUES ('k', 'v')") }
    let finished = Self.finishes(
      { try? index.makeDurable() }, whileHolding: { inside in try? index.write { _ in inside() } })
    #expect(finished, "makeDurable waited for the write transaction")
  }

  /// A slow read (a readdir of a big folder) holds up no getattr or lookup while another
  /// connection is free: with one read held, as many reads as there are connections finish.
  @Test func aHeldReadHoldsUpNoOtherReadWhileAConnectionIsFree() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let finished = Self.finishes(
      {
        for _ in 0..<StatementReaders.count {
          _ = try? index.readOne { db in try Int.fetchOne(db, sql: "SELECT 1") }
        }
      }, whileHolding: { inside in _ = try? index.readOne { _ in inside() } })
    #expect(finished, "a read waited for the held one")
  }

  /// Before a batch is sent, the entries of items the cloud has never confirmed are marked as
  /// possibly in the cloud (a later delete then asks the cloud); items with an etag are not.
  @Test func aBatchMarksOnlyItemsTheCloudHasNeverConfirmed() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let new = try #require(try index.create(parent: docs, name: "new", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let known = try #require(
      try index.create(parent: docs, name: "known", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    try index.write { db in try db.execute(sql: "UPDATE items SET etag = '5' WHERE id = ?", arguments: [known]) }
    func marked() throws -> [Int64] {
      try index.pool.read { db in
        try Int64.fetchAll(db, sql: "SELECT item FROM uploadQueue WHERE commitSent = 1 ORDER BY item")
      }
    }
    #expect(try marked() == [])
    let entry = try #require(try index.queueEntry(forInode: new))
    let revision = try #require(try index.item(new)?.revision)
    #expect(try index.revisionMarkedSent(seq: entry.seq) == nil)
    try index.markCommitsSent(items: [new, known])
    #expect(try marked() == [new])
    #expect(try index.revisionMarkedSent(seq: entry.seq) == revision, "the revision the first commit is sent from")
    // A change after the mark leaves the mark as it was: later commits come from a newer revision.
    _ = try index.setAttributes(new, AttributeChanges(mode: 0o600))
    #expect(try index.item(new)?.revision != revision)
    try index.markCommitsSent(items: [new, known])
    #expect(try marked() == [new])
    #expect(try index.revisionMarkedSent(seq: entry.seq) == revision)
  }

  /// Two files exchanged (RENAME_EXCHANGE) swap their cloud identities. The row that takes an
  /// identity whose first commit may have reached the cloud takes that mark too (a later delete
  /// asks the cloud), with no revision: what was sent came from the other row, so no version of
  /// this one is the base of a merge with it.
  @Test func anExchangeCarriesTheMarkOfAFirstCommitSentWithTheIdentity() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let a = try #require(try index.create(parent: docs, name: "a", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let b = try #require(try index.create(parent: docs, name: "b", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    try index.markCommitsSent(items: [a])
    let sentItemID = try #require(try index.item(a)?.itemID)
    _ = try index.rename(parent: docs, name: "a", newParent: docs, newName: "b", mode: .exchange)
    #expect(try index.item(b)?.itemID == sentItemID, "the identities were swapped")
    func mark(_ inode: Int64) throws -> (sent: Bool, revision: Int64?) {
      let entry = try #require(try index.queueEntry(forInode: inode))
      let sent = try index.pool.read { db in
        try Bool.fetchOne(db, sql: "SELECT commitSent FROM uploadQueue WHERE seq = ?", arguments: [entry.seq])
      }
      return (sent == true, try index.revisionMarkedSent(seq: entry.seq))
    }
    try index.markCommitsSent(items: [a, b])
    let taken = try mark(b)
    #expect(taken.sent && taken.revision == nil, "the row with the sent identity: \(taken)")
    let other = try mark(a)
    let revision = try index.item(a)?.revision
    #expect(other.sent && other.revision == revision, "the other row is marked afresh: \(other)")
  }

  /// A queue entry the cloud refused as invalid (`EINVAL`: a move into a cycle) takes nothing
  /// out of a folder. A new local change re-arms the entry with a version nobody has refused
  /// yet: it takes the item out again, and its old error no longer shows.
  @Test func aNewLocalChangeClearsTheErrorOfTheVersionTheCloudRefused() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let folder = try #require(
      try index.create(parent: docs, name: "f", kind: .directory, mode: 0o755, uid: 0, gid: 0).id)
    let file = try #require(try index.create(parent: folder, name: "x", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let folderID = try #require(try index.item(folder)?.itemID)
    let fileID = try #require(try index.item(file)?.itemID)
    // The cloud has x in f, as this device last saw it.
    try index.write { db in
      try db.execute(
        sql: "UPDATE items SET etag = '1', base = json_object('parentID', ?) WHERE id = ?", arguments: [folderID, file])
      try db.execute(sql: "DELETE FROM uploadQueue")
    }
    _ = try index.rename(parent: folder, name: "x", newParent: docs, newName: "x", mode: .replace)
    let entry = try #require(try index.queueEntry(forInode: file))
    try index.markFailed(seq: entry.seq, error: "the move makes a cycle", errno: EINVAL, triedAsOf: entry.enqueuedNs)
    #expect(
      try !index.hasQueuedEntry(takingOut: fileID, of: folderID, placedHere: false, besides: -1),
      "a refused move takes nothing out")
    _ = try index.rename(parent: docs, name: "x", newParent: docs, newName: "y", mode: .replace)
    let rearmed = try #require(try index.queueEntry(forInode: file))
    #expect(rearmed.seq == entry.seq && rearmed.lastError == nil && rearmed.lastErrno == nil, "\(rearmed)")
    #expect(try index.hasQueuedEntry(takingOut: fileID, of: folderID, placedHere: false, besides: -1))
    // The answer to an attempt of the old version, arriving after the re-arm, is no answer
    // about the new one.
    #expect(try !index.markFailed(seq: entry.seq, error: "a late cycle", errno: EINVAL, triedAsOf: entry.enqueuedNs))
    let after = try #require(try index.queueEntry(forInode: file))
    #expect(after.lastErrno == nil && after.attempts == entry.attempts + 2, "\(after)")
    #expect(try index.hasQueuedEntry(takingOut: fileID, of: folderID, placedHere: false, besides: -1))
    #expect(try index.markFailed(seq: entry.seq, error: "a cycle", errno: EINVAL, triedAsOf: after.enqueuedNs))
    #expect(try index.queueEntry(forInode: file)?.lastErrno == EINVAL)
  }

  /// The places and modes of the commits sent since an entry's last stored one are kept, each
  /// once, the latest few (`noteSent`); a stored commit of the entry clears them. A delete of
  /// the item takes them with it (a version of this device's own at such a place is no other
  /// device's change), and so does the file that takes over the item's identity by a rename
  /// over it.
  @Test func anEntryKeepsThePlacesOfItsUnansweredCommits() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let file = try #require(try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let documentsID = try #require(try index.item(docs)?.itemID)
    let entry = try #require(try index.queueEntry(forInode: file))
    #expect(entry.unansweredPlaces.isEmpty)
    let atD = ItemPlace(parentID: documentsID, name: "d", mode: 0o644)
    let atE = ItemPlace(parentID: documentsID, name: "e", mode: 0o600)
    try index.noteSent([(entry.seq, atD)])
    try index.noteSent([(entry.seq, atE), (entry.seq, atD)])
    #expect(try index.queueEntry(forInode: file)?.unansweredPlaces == [atD, atE])
    for i in 0..<20 {
      try index.noteSent([(entry.seq, ItemPlace(parentID: documentsID, name: "n\(i)", mode: 0o644))])
    }
    let kept = try #require(try index.queueEntry(forInode: file)).unansweredPlaces
    #expect(kept.count == IndexStore.maxSentPlaces && kept.last?.name == "n19", "the latest are kept: \(kept)")
    // A commit is stored: the entry stays queued (the item changed since), answered.
    let row = try #require(try index.item(file))
    var stored = CloudItem(
      itemID: row.itemID, parentID: documentsID, name: "f", kind: .file, mode: 0o644, size: 0, mtimeNs: 0, etag: "1",
      deviceID: "device-a")
    stored.changeSeq = 1
    _ = try index.setAttributes(file, AttributeChanges(mode: 0o600))
    try index.markUploaded(seq: entry.seq, inode: file, itemID: row.itemID, revision: row.revision, result: stored)
    let answered = try #require(try index.queueEntry(forInode: file))
    #expect(answered.unansweredPlaces.isEmpty, "\(answered)")
    // Sent again, then deleted: the delete keeps the note.
    try index.noteSent([(entry.seq, atD)])
    _ = try index.remove(parent: docs, name: "f", directory: false)
    let delete = try index.pool.read { db in
      try QueueEntry.fetchOne(db, sql: "SELECT * FROM uploadQueue WHERE deleteItemID = ?", arguments: [row.itemID])
    }
    #expect(delete?.unansweredPlaces == [atD], "\(String(describing: delete))")

    // A file renamed over a synced one takes over its identity and its notes.
    let old = try #require(try index.create(parent: docs, name: "old", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let new = try #require(try index.create(parent: docs, name: "new", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    try index.write { db in try db.execute(sql: "UPDATE items SET etag = '7' WHERE id = ?", arguments: [old]) }
    let oldID = try #require(try index.item(old)?.itemID)
    try index.noteSent([(try #require(try index.queueEntry(forInode: old)).seq, atE)])
    _ = try index.rename(parent: docs, name: "new", newParent: docs, newName: "old", mode: .replace)
    #expect(try index.item(new)?.itemID == oldID, "the identity was taken over")
    #expect(try index.queueEntry(forInode: new)?.unansweredPlaces == [atE])

    // Two synced files exchanged (RENAME_EXCHANGE) swap their identities and their notes.
    let x = try #require(try index.create(parent: docs, name: "x", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let y = try #require(try index.create(parent: docs, name: "y", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    try index.write { db in try db.execute(sql: "UPDATE items SET etag = '8' WHERE id IN (?, ?)", arguments: [x, y]) }
    try index.noteSent([(try #require(try index.queueEntry(forInode: x)).seq, atD)])
    _ = try index.rename(parent: docs, name: "x", newParent: docs, newName: "y", mode: .exchange)
    #expect(try index.queueEntry(forInode: y)?.unansweredPlaces == [atD], "x's identity is y's now")
    #expect(try index.queueEntry(forInode: x)?.unansweredPlaces == [])
  }

  /// A file saved vim-style again and again (`mv f f~`, a new f, `rm f~`, every 0.45 s, the
  /// new file written in 50 ms) by a device whose uploader commits whatever is due every 50 ms:
  /// each new f takes the identity of the one removed, with the time its changes began to
  /// wait, so f is uploaded within `maxCoalescingNs` of the first save and again while the
  /// saves go on; the backup's rename is never due before its removal (the deadline passed,
  /// a move away from the cloud's place still waits a moment for what follows it), so the
  /// cloud never has f at f~; and no delete of f is ever queued.
  @Test func aFileSavedWithABackupAgainAndAgainIsUploadedWhileTheSavesGoOn() throws {
    let dir = FileManager.default.temporaryDirectory.appendingPathComponent("index-write-\(UUID().uuidString)")
    try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
    defer { try? FileManager.default.removeItem(at: dir) }
    let time = Mutex<Int64>(1_000_000_000_000)
    let index = try IndexStore(
      path: dir.appendingPathComponent("index.sqlite").path, clock: WallClock { time.withLock { $0 } })
    try index.bootstrap(uid: 0, gid: 0)
    index.uploadDelayNs = 1_000_000_000
    let docs = try Self.documents(index)
    let documentsID = try #require(try index.item(docs)?.itemID)
    let file = try #require(try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    let itemID = try #require(try index.item(file)?.itemID)
    var etag = 0
    var uploads: [(atNs: Int64, name: String)] = []
    /// What the uploader does with every entry due now: commits the row as it is.
    func commitDue() throws {
      let now = time.withLock { $0 }
      for entry in try index.dueQueue(now: now, limit: 10) {
        if let deleted = entry.deleteItemID {
          Issue.record("a delete is due: \(entry)")
          try index.finishDelete(seq: entry.seq, itemID: deleted, tombstone: 1, restoring: nil)
        }
        guard let inode = entry.item, let row = try index.item(inode) else { continue }
        etag += 1
        var stored = CloudItem(
          itemID: row.itemID, parentID: documentsID, name: row.name, kind: .file, mode: 0o644, size: 0, mtimeNs: 0,
          etag: "\(etag)", deviceID: "device-a")
        stored.changeSeq = Int64(etag)
        try index.markUploaded(seq: entry.seq, inode: inode, itemID: row.itemID, revision: row.revision, result: stored)
        if row.itemID == itemID { uploads.append((now, row.name)) }
      }
    }
    func wait(_ ns: Int64) throws {
      for _ in 0..<(ns / 50_000_000) {
        time.withLock { $0 += 50_000_000 }
        try commitDue()
      }
    }
    try wait(1_000_000_000)
    let pending = try index.queueSummary().pendingItems
    #expect(uploads.count == 1 && pending == 0)
    let start = time.withLock { $0 }
    for _ in 0..<40 {
      _ = try index.rename(parent: docs, name: "f", newParent: docs, newName: "f~", mode: .replace)
      try wait(50_000_000)
      _ = try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0)
      _ = try index.remove(parent: docs, name: "f~", directory: false)
      #expect(try index.queueSummary().pendingDeletes == 0, "a delete was queued")
      try wait(400_000_000)
    }
    let during = uploads.dropFirst()
    #expect(!during.contains { $0.name != "f" }, "f was uploaded under another name: \(during)")
    var last = start
    for upload in during {
      #expect(upload.atNs - last <= index.maxCoalescingNs + 500_000_000, "no upload for \(upload.atNs - last) ns")
      last = upload.atNs
    }
    #expect(time.withLock { $0 } - last <= index.maxCoalescingNs + 500_000_000, "uploads: \(during.count)")
  }

  /// A removed backup hands the new file its identity with the places its commits may have
  /// been sent with, the one it had included (a commit of it there may be on its way unnoted);
  /// a file moved into another folder and removed there hands nothing over: a new file made
  /// where it was is a new item, and the moved one is deleted.
  @Test func aRemovedBackupHandsItsPlacesToTheNewFileAndOnlyBesideIt() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let documentsID = try #require(try index.item(docs)?.itemID)
    let archive = try #require(
      try index.create(parent: docs, name: "archive", kind: .directory, mode: 0o755, uid: 0, gid: 0).id)
    func synced(_ name: String) throws -> ItemRow {
      let id = try #require(try index.create(parent: docs, name: name, kind: .file, mode: 0o644, uid: 0, gid: 0).id)
      let row = try #require(try index.item(id))
      var stored = CloudItem(
        itemID: row.itemID, parentID: documentsID, name: name, kind: .file, mode: 0o644, size: 0, mtimeNs: 0,
        etag: "1", deviceID: "device-a")
      stored.changeSeq = 1
      let entry = try #require(try index.queueEntry(forInode: id))
      try index.markUploaded(seq: entry.seq, inode: id, itemID: row.itemID, revision: row.revision, result: stored)
      return row
    }
    func row(_ name: String) throws -> ItemRow? {
      try index.children(of: docs, after: 0, limit: 100).first { $0.name == name }
    }
    func deletes() throws -> [String] {
      try index.pool.read { db in
        try String.fetchAll(db, sql: "SELECT deleteItemID FROM uploadQueue WHERE deleteItemID IS NOT NULL")
      }
    }
    let f = try synced("f")
    _ = try index.rename(parent: docs, name: "f", newParent: docs, newName: "f~", mode: .replace)
    _ = try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0)
    _ = try index.remove(parent: docs, name: "f~", directory: false)
    let heir = try #require(try row("f"))
    #expect(heir.itemID == f.itemID)
    let heirInode = try #require(heir.id)
    let places = try #require(try index.queueEntry(forInode: heirInode)).unansweredPlaces
    #expect(places.contains { $0.parentID == documentsID && $0.name == "f~" && $0.mode == 0o644 }, "\(places)")
    #expect(try deletes() == [])

    let g = try synced("g")
    _ = try index.rename(parent: docs, name: "g", newParent: archive, newName: "g", mode: .replace)
    _ = try index.create(parent: docs, name: "g", kind: .file, mode: 0o644, uid: 0, gid: 0)
    _ = try index.remove(parent: archive, name: "g", directory: false)
    #expect(try row("g")?.itemID != g.itemID, "a file removed in another folder handed its identity over")
    #expect(try deletes() == [g.itemID])
  }

  /// A place written as JSON (as a queued delete keeps it) reads back as itself, whatever its
  /// name holds.
  @Test func aPlaceWrittenAsJSONReadsBackAsItself() throws {
    for name in ["f", "a \"quoted\" \\ name", "tab\tnew\nline\u{1}", "é ü 日本", "x\u{7f}"] {
      for xattrs: [String: Data]? in [nil, [:], ["user.k": Data([0, 255])]] {
        let place = ItemPlace(parentID: "p\"1", name: name, mode: 0o4755, xattrs: xattrs)
        #expect(ItemPlace(json: place.json) == place, "\(place.json)")
        #expect(ItemPlace.list(json: ItemPlace.json([place, place])) == [place, place])
        #expect(ItemPlace.list(json: ItemPlace.json([])) == [])
      }
    }
  }

  /// Every delete a user's removal queues remembers the item as they saw it, its extended
  /// attributes included: an unlink, a rename over a file (the replaced file's delete, and the
  /// source's when it takes over the replaced file's identity), a move under a `.nosync` name.
  @Test func aQueuedDeleteRemembersTheAttributesTheUserSaw() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let docs = try Self.documents(index)
    let documentsID = try #require(try index.item(docs)?.itemID)
    let tag = ["user.tag": Data("red".utf8)]
    func file(_ name: String, etag: String? = nil) throws -> ItemRow {
      let id = try #require(try index.create(parent: docs, name: name, kind: .file, mode: 0o644, uid: 0, gid: 0).id)
      try index.setXattr(id, "user.tag", Data("red".utf8), mode: .any)
      if let etag {
        try index.write { db in try db.execute(sql: "UPDATE items SET etag = ? WHERE id = ?", arguments: [etag, id]) }
      }
      return try #require(try index.item(id))
    }
    func seen(_ row: ItemRow) throws -> ItemPlace? {
      try index.pool.read { db in
        try QueueEntry.fetchOne(db, sql: "SELECT * FROM uploadQueue WHERE deleteItemID = ?", arguments: [row.itemID])
      }?.deletedPlace
    }
    let unlinked = try file("unlinked")
    _ = try index.remove(parent: docs, name: "unlinked", directory: false)
    #expect(try seen(unlinked) == ItemPlace(parentID: documentsID, name: "unlinked", mode: 0o644, xattrs: tag))
    // A replaced file that was never confirmed in the cloud is deleted.
    let replaced = try file("replaced")
    _ = try file("over")
    _ = try index.rename(parent: docs, name: "over", newParent: docs, newName: "replaced", mode: .replace)
    #expect(try seen(replaced) == ItemPlace(parentID: documentsID, name: "replaced", mode: 0o644, xattrs: tag))
    // A source that takes over a synced file's identity leaves its own behind.
    _ = try file("synced", etag: "7")
    let source = try file("source", etag: "8")
    _ = try index.rename(parent: docs, name: "source", newParent: docs, newName: "synced", mode: .replace)
    #expect(try seen(source) == ItemPlace(parentID: documentsID, name: "source", mode: 0o644, xattrs: tag))
    // Moved under a `.nosync` name: local-only, its cloud item goes.
    let kept = try #require(
      try index.create(parent: docs, name: "kept.nosync", kind: .directory, mode: 0o755, uid: 0, gid: 0).id)
    let moved = try file("moved", etag: "9")
    _ = try index.rename(parent: docs, name: "moved", newParent: kept, newName: "moved", mode: .replace)
    #expect(try seen(moved) == ItemPlace(parentID: documentsID, name: "moved", mode: 0o644, xattrs: tag))
  }

  /// A user's delete meets a newer version of this device's own: it is the version they deleted
  /// where it is where they saw it, or at a temporary name it took while it moved, with their mode.
  @Test func anItemPlaceMatchesTheUsersPlaceOrATemporaryNameOnItsWay() {
    let seen = ItemPlace(parentID: "folder-d", name: "f", mode: 0o644)
    var version = CloudItem(
      itemID: "0000000f-0000-4000-8000-00000000000f", parentID: "folder-d", name: "f", kind: .file, mode: 0o644,
      size: 0, mtimeNs: 1, deviceID: "device-a")
    #expect(seen.matches(version))
    version.name = "g"
    #expect(!seen.matches(version), "renamed")
    version.parentID = "folder-e"
    version.name = ItemName.aside("f", itemID: version.itemID)
    #expect(seen.matches(version), "on its way, at a temporary name")
    version.mode = 0o600
    #expect(!seen.matches(version), "another mode")
    version.mode = 0o644
    version.name = ItemName.aside("f", itemID: "00000010-0000-4000-8000-000000000010")
    #expect(!seen.matches(version), "another item's temporary name")
  }

  @Test func aFoldersLinkCountIsRightWhenItemsHasColumnsAfterItemRows() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    // A later release's column, in an index this build opens.
    try index.pool.write { db in try db.execute(sql: "ALTER TABLE items ADD COLUMN later INTEGER DEFAULT 7") }
    let reopened = try IndexStore(path: dir.appendingPathComponent("index.sqlite").path)
    let docs = try Self.documents(reopened)
    let folder = try reopened.create(parent: docs, name: "d", kind: .directory, mode: 0o755, uid: 0, gid: 0)
    _ = try reopened.create(parent: folder.id!, name: "sub", kind: .directory, mode: 0o755, uid: 0, gid: 0)
    _ = try reopened.create(parent: folder.id!, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0)
    #expect(try reopened.itemWithSubdirectoryCount(folder.id!)?.subdirectories == 1)
    #expect(try reopened.childWithSubdirectoryCount(of: docs, named: "d")?.subdirectories == 1)
    var row = try #require(try reopened.item(folder.id!))
    row.mode = 0o700
    try reopened.write { db in try IndexStore.updateItem(db, row) }
    #expect(try reopened.item(folder.id!) == row)
  }

  @Test func anUpdateOfAMissingRowFails() throws {
    let (index, dir) = try Self.openIndex()
    defer { try? FileManager.default.removeItem(at: dir) }
    let row = ItemRow(
      id: 999, itemID: "gone", parent: IndexStore.rootInode, name: "gone", kind: .file, mode: 0o644, mtimeNs: 1)
    #expect(throws: RecordError.self) { try index.write { db in try IndexStore.updateItem(db, row) } }
  }
}
