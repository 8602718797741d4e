import Foundation
import GRDB
import Testing

@testable import UbiqCore
@testable import UbiqIndex

/// The mount's changes sharing a transaction (`NamespaceBatch`): read at once, undone one by
/// one, and after a crash before the commit run again from the redo log, with the same inodes.
@Suite struct NamespaceBatchTests {
  /// A batch that commits only when asked (or after a minute).
  static let slow = NamespaceBatchPolicy(maxChanges: 10_000, maxDelayNs: 60_000_000_000)

  static func folder() throws -> URL {
    let dir = FileManager.default.temporaryDirectory.appendingPathComponent("index-batch-\(UUID().uuidString)")
    try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
    return dir
  }

  static func open(_ dir: URL, _ policy: NamespaceBatchPolicy? = slow) throws -> IndexStore {
    let index = try IndexStore(path: dir.appendingPathComponent("index.sqlite").path, batching: policy)
    try index.bootstrap(uid: 0, gid: 0)
    return index
  }

  /// What a killed daemon leaves in `dir`: the files of the index (the committed transactions;
  /// the open batch's are in no file, or in WAL frames with no commit) and its redo log, copied
  /// to a new folder while no change runs.
  static func crashCopy(of index: IndexStore, in dir: URL) throws -> URL {
    let copy = try folder()
    try index.pool.writeWithoutTransaction { _ in
      for name in ["index.sqlite", "index.sqlite-wal", "index.sqlite-redo"]
      where FileManager.default.fileExists(atPath: dir.appendingPathComponent(name).path) {
        try FileManager.default.copyItem(at: dir.appendingPathComponent(name), to: copy.appendingPathComponent(name))
      }
    }
    return copy
  }

  /// Every item: inode, parent, name, mode, size, revision; and the upload queue.
  static func contents(_ index: IndexStore) throws -> [String] {
    try index.pool.unsafeReentrantWrite { db in
      try String.fetchAll(
        db,
        sql: """
          SELECT id || ' ' || ifnull(parent, '-') || ' ' || name || ' ' || mode || ' ' || size || ' ' || revision
          FROM items ORDER BY id
          """)
        + String.fetchAll(
          db,
          sql: "SELECT 'queued ' || ifnull(item, '-') || ' ' || ifnull(deleteItemID, '-') FROM uploadQueue ORDER BY seq"
        )
    }
  }

  @Test func changesOfAnOpenBatchAreReadAtOnceAndCommittedWhenAsked() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir)
    let other = try IndexStore(path: dir.appendingPathComponent("index.sqlite").path, readOnly: true)
    let docs = try #require(try index.item(itemID: WellKnownItem.documents)?.id)
    let f = try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0)
    #expect(index.batch?.isOpen == true)
    #expect(try index.childWithSubdirectoryCount(of: docs, named: "f")?.row.id == f.id)
    #expect(try index.children(of: docs, after: 0, limit: 10).map(\.name) == ["f"])
    #expect(try other.children(of: docs, after: 0, limit: 10).isEmpty, "not committed yet")
    try index.commitBatch()
    #expect(index.batch?.isOpen == false)
    #expect(try other.children(of: docs, after: 0, limit: 10).map(\.name) == ["f"])
  }

  @Test func aBatchCommitsByItselfWhenFullAndAfterItsDelay() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir, NamespaceBatchPolicy(maxChanges: 3, maxDelayNs: 50_000_000))
    let docs = try #require(try index.item(itemID: WellKnownItem.documents)?.id)
    for n in 0..<3 { _ = try index.create(parent: docs, name: "f\(n)", kind: .file, mode: 0o644, uid: 0, gid: 0) }
    #expect(index.batch?.isOpen == false, "full after 3 changes")
    _ = try index.create(parent: docs, name: "g", kind: .file, mode: 0o644, uid: 0, gid: 0)
    #expect(index.batch?.isOpen == true)
    let deadline = Date().addingTimeInterval(10)
    while index.batch?.isOpen == true && Date() < deadline { usleep(5_000) }
    #expect(index.batch?.isOpen == false, "committed after its delay")
  }

  @Test func aChangeThatFailsIsUndoneAndTheRestOfTheBatchStays() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir)
    let docs = try #require(try index.item(itemID: WellKnownItem.documents)?.id)
    _ = try index.create(parent: docs, name: "a", kind: .file, mode: 0o644, uid: 0, gid: 0)
    #expect(throws: UbiqError.self) {
      _ = try index.create(parent: docs, name: "a", kind: .directory, mode: 0o755, uid: 0, gid: 0)
    }
    #expect(throws: UbiqError.self) { _ = try index.remove(parent: docs, name: "missing", directory: false) }
    _ = try index.create(parent: docs, name: "b", kind: .file, mode: 0o644, uid: 0, gid: 0)
    let before = try Self.contents(index)
    let copy = try Self.crashCopy(of: index, in: dir)
    defer { try? FileManager.default.removeItem(at: copy) }
    try index.commitBatch()
    #expect(try Self.contents(index) == before)
    #expect(try index.children(of: docs, after: 0, limit: 10).map(\.name).sorted() == ["a", "b"])
    let restarted = try Self.open(copy)
    #expect(try Self.contents(restarted) == before)
  }

  /// The changes a mount makes, a crash before their batch commits, and the next open: the
  /// same rows, inodes and queue as the daemon answered with.
  @Test func aCrashBeforeTheCommitLosesNoChange() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir)
    let docs = try #require(try index.item(itemID: WellKnownItem.documents)?.id)
    let folder = try index.create(parent: docs, name: "d", kind: .directory, mode: 0o755, uid: 0, gid: 0)
    try index.commitBatch()
    let committed = try Self.contents(index)
    var files: [Int64] = []
    for n in 0..<5 {
      files.append(
        try #require(try index.create(parent: folder.id!, name: "f\(n)", kind: .file, mode: 0o644, uid: 0, gid: 0).id))
    }
    _ = try index.remove(parent: folder.id!, name: "f1", directory: false)
    _ = try index.rename(parent: folder.id!, name: "f2", newParent: docs, newName: "moved", mode: .replace)
    _ = try index.setAttributes(files[3], AttributeChanges(mode: 0o600))
    try index.recordContentChange(files[4], size: 12, mtimeNs: 5)
    try index.setXattr(files[0], "user.note", Data("x'y\u{0}z".utf8), mode: .any)
    let answered = try Self.contents(index)
    #expect(answered != committed)
    let copy = try Self.crashCopy(of: index, in: dir)
    defer { try? FileManager.default.removeItem(at: copy) }
    let restarted = try Self.open(copy)
    #expect(try Self.contents(restarted) == answered)
    #expect(try restarted.xattr(files[0], "user.note") == Data("x'y\u{0}z".utf8))
    #expect(restarted.batch?.isOpen == false, "replayed and committed at the open")
    // Run once: opened again, nothing is applied twice.
    let reopened = try Self.contents(restarted)
    let copyAgain = try Self.crashCopy(of: restarted, in: copy)
    defer { try? FileManager.default.removeItem(at: copyAgain) }
    #expect(try Self.contents(try Self.open(copyAgain)) == reopened)
  }

  /// A log whose batch committed (the daemon died between the commit and emptying the log, or a
  /// power loss kept the log and lost the commit) is not run: its changes would apply twice.
  @Test func aLogOfAnotherBatchIsDropped() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir)
    let docs = try #require(try index.item(itemID: WellKnownItem.documents)?.id)
    let f = try #require(try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0).id)
    try index.commitBatch()
    try index.recordContentChange(f, size: 3, mtimeNs: 1)
    let log = try Data(contentsOf: dir.appendingPathComponent("index.sqlite-redo"))
    try index.commitBatch()
    let after = try Self.contents(index)
    let copy = try Self.crashCopy(of: index, in: dir)
    defer { try? FileManager.default.removeItem(at: copy) }
    try log.write(to: copy.appendingPathComponent("index.sqlite-redo"))
    #expect(try Self.contents(try Self.open(copy)) == after, "the revision is not bumped twice")
  }

  /// A record cut short (the daemon died while copying it) ends the log: the changes before it
  /// are run again, it is not.
  @Test func aTornRecordEndsTheLog() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir)
    let docs = try #require(try index.item(itemID: WellKnownItem.documents)?.id)
    _ = try index.create(parent: docs, name: "a", kind: .file, mode: 0o644, uid: 0, gid: 0)
    let copyWithA = try Self.crashCopy(of: index, in: dir)
    defer { try? FileManager.default.removeItem(at: copyWithA) }
    let withA = try Self.contents(index)
    _ = try index.create(parent: docs, name: "b", kind: .file, mode: 0o644, uid: 0, gid: 0)
    let copy = try Self.crashCopy(of: index, in: dir)
    defer { try? FileManager.default.removeItem(at: copy) }
    // The last record's last bytes never arrived (the log is preallocated: zeros follow it).
    let url = copy.appendingPathComponent("index.sqlite-redo")
    var log = [UInt8](try Data(contentsOf: url))
    let last = try #require(log.lastIndex { $0 != 0 })
    for k in (last - 2)...last { log[k] = 0 }
    try Data(log).write(to: url)
    #expect(try Self.contents(try Self.open(copy)) == withA)
  }

  /// An index opened while a batch is open (a command of the CLI beside the mount) waits for its
  /// commit, so it reads every change the mount answered before it was opened.
  @Test func anIndexOpenedElsewhereWaitsForTheOpenBatch() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir, NamespaceBatchPolicy(maxChanges: 10_000, maxDelayNs: 300_000_000))
    let docs = try #require(try index.item(itemID: WellKnownItem.documents)?.id)
    _ = try index.create(parent: docs, name: "f", kind: .file, mode: 0o644, uid: 0, gid: 0)
    #expect(index.batch?.isOpen == true)
    let other = try IndexStore(path: dir.appendingPathComponent("index.sqlite").path, readOnly: true)
    #expect(try other.children(of: docs, after: 0, limit: 10).map(\.name) == ["f"])
  }

  /// Only one open index of a file batches changes and replays its log (the mount's daemon); a
  /// second one (a command of the CLI) commits each change by itself.
  @Test func aSecondOpenIndexDoesNotBatch() throws {
    let dir = try Self.folder()
    defer { try? FileManager.default.removeItem(at: dir) }
    let index = try Self.open(dir)
    #expect(index.batch != nil)
    let second = try Self.open(dir)
    #expect(second.batch == nil)
  }
}
