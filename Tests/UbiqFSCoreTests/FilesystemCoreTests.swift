import Foundation
import Synchronization
import Testing
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqIndex
import UbiqSync

@testable import UbiqFSCore

#if canImport(Glibc)
  import Glibc
#endif

/// The filesystem core driven in-process: the data-safety rules, each through the same calls the
/// FUSE adapter makes. Each test blocks its thread on async work (`runBlocking`), so each runs
/// on a thread of its own, off Swift's cooperative pool, which has only as many threads as cores.
@Suite(.serialized) struct FilesystemCoreTests {
  func expectErrno(_ code: Int32, _ body: () throws -> Void, sourceLocation: SourceLocation = #_sourceLocation) {
    do {
      try body()
      Issue.record("expected errno \(code), got success", sourceLocation: sourceLocation)
    } catch let e as UbiqError {
      #expect(e.errno == code, "got \(e)", sourceLocation: sourceLocation)
    } catch {
      Issue.record("expected errno \(code), got \(error)", sourceLocation: sourceLocation)
    }
  }

  @Test func eachTestRunsOffSwiftsCooperativePool() async throws {
    try await onOwnThread {
      #expect(OwnThreadExecutor.isCurrent)
    }
  }

  @Test func renameOverKeepsTheMovedFilesContentWhenEitherIsEvicted() async throws {
    try await onOwnThread {
      for evict in [["d"], ["f"], ["d", "f"]] {
        let w = try CoreWorld()
        try w.writeFile("d", Data("draft\n".utf8))
        try w.writeFile("f", Data("old\n".utf8))
        try w.drainUploads()
        for name in evict { try w.core.evict(try w.inode(name)!) }
        try w.core.rename(parent: w.documents, name: "d", newParent: w.documents, newName: "f", flags: [])
        #expect(try w.readFile("f") == Data("draft\n".utf8), "evicted: \(evict)")
        #expect(try w.inode("d") == nil)
        try w.drainUploads()
        let row = try w.index.item(try w.inode("f")!)!
        let cloudItem = try runBlocking { try await w.cloud.item(w.container, itemID: row.itemID) }
        #expect(cloudItem?.size == 6 && cloudItem?.chunks.first?.hash == Chunker.sha256Hex(Data("draft\n".utf8)))
      }
    }
  }

  @Test func exchangeOfFilesSwapsContentsAndKeepsEachPathsCloudItem() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      try w.writeFile("d", Data("draft\n".utf8))
      try w.writeFile("f", Data("old\n".utf8))
      try w.drainUploads()
      let idAtF = try w.index.item(try w.inode("f")!)!.itemID
      try w.core.evict(try w.inode("d")!)
      try w.core.rename(parent: w.documents, name: "d", newParent: w.documents, newName: "f", flags: .exchange)
      #expect(try w.readFile("f") == Data("draft\n".utf8))
      #expect(try w.readFile("d") == Data("old\n".utf8))
      #expect(try w.index.item(try w.inode("f")!)!.itemID == idAtF)
      try w.drainUploads()
      let atF = try runBlocking { try await w.cloud.item(w.container, itemID: idAtF) }
      #expect(atF?.name == "f" && atF?.size == 6)
    }
  }

  @Test func exchangeRefusesADirectoryBelowItself() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let dir = try w.core.mkdir(parent: w.documents, name: "dir", mode: 0o755, caller: .current)
      _ = try w.core.mkdir(parent: dir.inode, name: "sub", mode: 0o755, caller: .current)
      expectErrno(EINVAL) {
        try w.core.rename(parent: dir.inode, name: "sub", newParent: w.documents, newName: "dir", flags: .exchange)
      }
      expectErrno(ENOENT) {
        try w.core.rename(parent: w.documents, name: "dir", newParent: w.documents, newName: "nope", flags: .exchange)
      }
    }
  }

  @Test func timesBefore1970AndTheLimitsOfNanoseconds() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let ino = try w.writeFile("t", Data("x".utf8))
      let a = try w.core.setattr(ino, AttributeUpdate(atime: .at(-1_500_000_000), mtime: .at(-14_182_939_500_000_000)))
      #expect(a.atimeNs == -1_500_000_000 && a.mtimeNs == -14_182_939_500_000_000)
      let ts = FileTime.timespec(-1_500_000_000)
      #expect(ts.tv_sec == -2 && ts.tv_nsec == 500_000_000)
      #expect(try FileTime.nanoseconds(ts) == -1_500_000_000)
      // 2300-01-01 does not fit 64-bit nanoseconds: EOVERFLOW, never a trap.
      expectErrno(EOVERFLOW) { _ = try FileTime.nanoseconds(timespec(tv_sec: 10_413_792_000, tv_nsec: 0)) }
      expectErrno(EOVERFLOW) { _ = try FileTime.nanoseconds(timespec(tv_sec: Int.min, tv_nsec: 0)) }
      expectErrno(EINVAL) { _ = try FileTime.nanoseconds(timespec(tv_sec: 0, tv_nsec: 1_000_000_000)) }
    }
  }

  @Test func sizesPastTheLimitGetEFBIG() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let ino = try w.writeFile("big", Data("x".utf8))
      expectErrno(EFBIG) { _ = try w.core.setattr(ino, AttributeUpdate(size: FilesystemCore.maxFileSize + 1)) }
      expectErrno(EINVAL) { _ = try w.core.setattr(ino, AttributeUpdate(size: -1)) }
      let h = try w.core.open(ino, flags: O_WRONLY, caller: .current).handle
      defer { w.core.release(h) }
      expectErrno(EFBIG) { _ = try Data("y".utf8).withUnsafeBytes { try w.core.write(h, $0, offset: Int64.max - 1) } }
    }
  }

  @Test func truncateWhileDownloadingLetsNoOldByteIn() async throws {
    try await onOwnThread {
      let gate = GatedCloud()
      let w = try CoreWorld(cloud: gate)
      let old = Data((0..<(6 << 20)).map { UInt8(truncatingIfNeeded: $0 &* 7) })
      let ino = try w.writeFile("big", old)
      try w.drainUploads()
      try w.core.evict(ino)
      gate.hold()
      // A reader starts the download, then the file is replaced whole (O_TRUNC) and rewritten.
      let reader = try w.core.open(ino, flags: O_RDONLY, caller: .current).handle
      let writer = try w.core.open(ino, flags: O_WRONLY | O_TRUNC, caller: .current).handle
      _ = try Data("NEW\n".utf8).withUnsafeBytes { try w.core.write(writer, $0, offset: 0) }
      try w.core.flush(writer)
      gate.release()
      // Old chunks arriving now must not land in the cache file.
      Thread.sleep(forTimeInterval: 0.3)
      #expect(try w.core.read(reader, offset: 0, size: 100) == Data("NEW\n".utf8))
      w.core.release(reader)
      w.core.release(writer)
      #expect(try w.readFile("big") == Data("NEW\n".utf8))
      #expect(try w.core.getattr(ino).size == 4)
    }
  }

  @Test func unflushedWritesOfAnOpenHandleSurviveACrash() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let data = Data(repeating: 0x5a, count: 300_000)
      let (a, opened) = try w.core.create(parent: w.documents, name: "open.bin", mode: 0o644, caller: .current)
      _ = try data.withUnsafeBytes { try w.core.write(opened.handle, $0, offset: 0) }
      // The writes are not flushed (the upload waits for them). The daemon dies.
      try w.crashAndRestart()
      #expect(try w.core.getattr(a.inode).size == 300_000)
      try w.drainUploads()
      let row = try w.index.item(a.inode)!
      #expect(row.revision == row.syncedRevision)
      let item = try runBlocking { try await w.cloud.item(w.container, itemID: row.itemID) }
      #expect(item?.size == 300_000)
      #expect(try w.readFile("open.bin") == data)
    }
  }

  /// A file created open for writing costs the index one write (its insert) until something is
  /// written: no dirty mark, nothing recorded at the close, and the empty file is uploaded. Its
  /// first write leaves the dirty mark, so a crash after it still finds and uploads the bytes.
  @Test func aCreatedFileIsMarkedDirtyOnlyByItsFirstWrite() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let (empty, touched) = try w.core.create(parent: w.documents, name: "empty", mode: 0o644, caller: .current)
      #expect(try w.index.dirtyContentItems().isEmpty, "the create marked the file dirty")
      let revision = try w.index.item(empty.inode)!.revision
      w.core.release(touched.handle)
      #expect(try w.index.item(empty.inode)!.revision == revision, "a close with nothing written made a revision")
      try w.drainUploads()
      let row = try w.index.item(empty.inode)!
      #expect(row.revision == row.syncedRevision)
      #expect(try runBlocking { try await w.cloud.item(w.container, itemID: row.itemID) }?.size == 0)

      let (a, opened) = try w.core.create(parent: w.documents, name: "written", mode: 0o644, caller: .current)
      _ = try Data("first\n".utf8).withUnsafeBytes { try w.core.write(opened.handle, $0, offset: 0) }
      #expect(try w.index.dirtyContentItems() == [a.inode], "the first write left no dirty mark")
      try w.crashAndRestart()
      try w.drainUploads()
      #expect(try w.readFile("written") == Data("first\n".utf8))
      let written = try w.index.item(a.inode)!
      #expect(try runBlocking { try await w.cloud.item(w.container, itemID: written.itemID) }?.size == 6)
      #expect(try w.index.dirtyContentItems().isEmpty)
    }
  }

  /// An empty file needs no cache file: a file created and closed unwritten, or made by mknod,
  /// has none until something needs one. The creating handle then shares the cache file any
  /// other handle made: it reads what they wrote, and its own writes land beside theirs.
  @Test func anEmptyFileGetsItsCacheFileOnlyWhenSomethingNeedsIt() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let (touched, h) = try w.core.create(parent: w.documents, name: "touched", mode: 0o644, caller: .current)
      w.core.release(h.handle)
      let node = try w.core.mknod(parent: w.documents, name: "node", mode: S_IFREG | 0o644, caller: .current)
      #expect(!w.core.cache.exists(touched.inode), "a file closed unwritten has a cache file")
      #expect(!w.core.cache.exists(node.inode), "mknod made a cache file")
      #expect(try w.core.getattr(touched.inode).size == 0)
      #expect(try w.readFile("touched") == Data())
      #expect(try w.readFile("node") == Data())

      // Two handles: the creator's, with no cache file yet, and another writer's.
      let (shared, creator) = try w.core.create(parent: w.documents, name: "shared", mode: 0o644, caller: .current)
      let other = try w.core.open(shared.inode, flags: O_RDWR, caller: .current).handle
      _ = try Data("x".utf8).withUnsafeBytes { try w.core.write(other, $0, offset: 0) }
      #expect(try w.core.read(creator.handle, offset: 0, size: 10) == Data("x".utf8))
      _ = try Data("y".utf8).withUnsafeBytes { try w.core.write(creator.handle, $0, offset: 1) }
      #expect(try w.core.getattr(shared.inode).size == 2)
      w.core.release(other)
      w.core.release(creator.handle)
      #expect(try w.readFile("shared") == Data("xy".utf8))

      // fsync and ftruncate through a creating handle that wrote nothing.
      let (synced, s) = try w.core.create(parent: w.documents, name: "synced", mode: 0o644, caller: .current)
      try w.core.fsync(s.handle, dataOnly: false)
      w.core.release(s.handle)
      let (grown, g) = try w.core.create(parent: w.documents, name: "grown", mode: 0o644, caller: .current)
      var update = AttributeUpdate()
      update.size = 3
      _ = try w.core.setattr(grown.inode, update, handle: g.handle)
      w.core.release(g.handle)
      #expect(try w.readFile("grown") == Data(count: 3))

      try w.core.unlink(parent: w.documents, name: "touched")
      try w.drainUploads()
      for (name, inode, size) in [("node", node.inode, 0), ("shared", shared.inode, 2), ("synced", synced.inode, 0)] {
        let row = try w.index.item(inode)!
        #expect(row.revision == row.syncedRevision, "\(name) uploaded")
        let item = try runBlocking { try await w.cloud.item(w.container, itemID: row.itemID) }
        #expect(item?.size == Int64(size), "\(name): the cloud has what the mount shows")
      }
      #expect(try w.index.item(touched.inode) == nil)
    }
  }

  /// The creating handle holds a new file from its insert on: an upload pass that runs right
  /// after the insert's commit (before `create` returns) leaves the file for the creator's
  /// flush, so the empty file between the create and the writes never reaches the cloud.
  @Test func anUploadRightAfterTheInsertWaitsForTheCreator() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      var passes = 0
      w.core.onQueued = {
        passes += 1
        try? w.drainUploadsOnce()
      }
      let (a, opened) = try w.core.create(parent: w.documents, name: "new", mode: 0o644, caller: .current)
      w.core.onQueued = {}
      #expect(passes == 1, "an upload pass ran inside the create")
      let id = try w.index.item(a.inode)!.itemID
      let cloud = w.cloud
      let container = w.container
      #expect(try runBlocking { try await cloud.item(container, itemID: id) } == nil, "the new file went up empty")
      _ = try Data("content".utf8).withUnsafeBytes { try w.core.write(opened.handle, $0, offset: 0) }
      w.core.release(opened.handle)
      try w.drainUploads()
      #expect(try runBlocking { try await cloud.item(container, itemID: id) }?.size == 7)
    }
  }

  /// A cache file left under a new file's inode number (a power loss rolled the index back past
  /// an insert whose file's name survived, and the mount's sweep missed it) is not the new
  /// file's content: the new file starts empty.
  @Test func aNewFileNeverShowsAStaleCacheFilesBytes() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let first = try w.writeFile("first", Data("1".utf8))
      for (i, name) in ["created", "made"].enumerated() {
        let next = first + 1 + Int64(i)
        #expect(FileManager.default.createFile(atPath: w.core.cache.path(next), contents: Data("stale bytes".utf8)))
        let inode: Int64
        if name == "created" {
          let (a, opened) = try w.core.create(parent: w.documents, name: name, mode: 0o644, caller: .current)
          _ = try Data("x".utf8).withUnsafeBytes { try w.core.write(opened.handle, $0, offset: 0) }
          w.core.release(opened.handle)
          inode = a.inode
        } else {
          inode = try w.core.mknod(parent: w.documents, name: name, mode: S_IFREG | 0o644, caller: .current).inode
        }
        #expect(inode == next, "the test's guess of the next inode number")
        #expect(try w.readFile(name) == (name == "created" ? Data("x".utf8) : Data()), "\(name)")
      }
      try w.drainUploads()
      let row = try w.index.item(first + 1)!
      #expect(try runBlocking { try await w.cloud.item(w.container, itemID: row.itemID) }?.size == 1)
    }
  }

  /// A power loss can keep the index commit of a close (any later synced commit makes it
  /// durable) and lose the cache file's bytes, which nobody fsync'ed: here the cache file is cut
  /// back to what such a loss leaves. After the restart the file shows what its cache file holds
  /// (size and bytes agree) and that is uploaded, never the recorded size over other bytes.
  @Test func contentClosedWithoutFsyncFollowsItsCacheFileAfterAPowerLoss() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let kept = try w.writeFile("kept", Data("durable\n".utf8))
      try w.drainUploads()
      let ino = try w.writeFile("f", Data(repeating: 0x61, count: 100_000))
      let edit = try w.core.open(kept, flags: O_WRONLY | O_APPEND, caller: .current).handle
      _ = try Data("more\n".utf8).withUnsafeBytes { try w.core.write(edit, $0, offset: 8) }
      w.core.release(edit)
      // The power loss: the unsynced bytes are gone, the index commits stay.
      #expect(truncate(w.core.cache.path(ino), 0) == 0)
      #expect(truncate(w.core.cache.path(kept), 8) == 0)
      try w.crashAndRestart()
      #expect(try w.core.getattr(ino).size == 0)
      #expect(try w.readFile("f") == Data())
      #expect(try w.core.getattr(kept).size == 8)
      #expect(try w.readFile("kept") == Data("durable\n".utf8))
      try w.drainUploads()
      for (name, i) in [("f", ino), ("kept", kept)] {
        let row = try w.index.item(i)!
        #expect(row.revision == row.syncedRevision, "\(name) uploaded")
        let item = try runBlocking { try await w.cloud.item(w.container, itemID: row.itemID) }
        #expect(item?.size == row.size, "\(name): the cloud has what the mount shows")
      }
    }
  }

  /// fsync makes the cache file durable and says so in the index: the next mount finds nothing
  /// to re-record; an upload does the same for a file closed without fsync.
  @Test func fsyncAndUploadLeaveNoUnsyncedMark() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let (a, opened) = try w.core.create(parent: w.documents, name: "synced", mode: 0o644, caller: .current)
      _ = try Data("bytes\n".utf8).withUnsafeBytes { try w.core.write(opened.handle, $0, offset: 0) }
      try w.core.fsync(opened.handle, dataOnly: true)
      w.core.release(opened.handle)
      let closed = try w.writeFile("closed", Data("closed\n".utf8))
      #expect(try w.index.unsyncedContentItems() == [closed])
      try w.drainUploads()
      #expect(try w.index.unsyncedContentItems() == [])
      let revision = try w.index.item(a.inode)!.revision
      try w.crashAndRestart()
      #expect(try w.index.item(a.inode)!.revision == revision, "nothing re-recorded at mount")
      #expect(try w.readFile("synced") == Data("bytes\n".utf8))
    }
  }

  /// An fsync commits the index once: the handle's writes are recorded and the unsynced mark
  /// is cleared in the one transaction that the fsync then makes durable (an append followed by
  /// an fdatasync, again and again, is what databases and logs do). The batch's timer is set
  /// far off here: it may commit between the two when the cache file's fdatasync is slow.
  @Test func anFsyncCommitsTheIndexOnce() async throws {
    let commits = Mutex(0)
    let counting = Mutex(false)
    try await onOwnThread {
      let w = try CoreWorld(
        statementObserver: { sql in
          if counting.withLock({ $0 }), sql.uppercased().hasPrefix("COMMIT") { commits.withLock { $0 += 1 } }
        }, batching: NamespaceBatchPolicy(maxDelayNs: 60_000_000_000))
      let (a, opened) = try w.core.create(parent: w.documents, name: "log", mode: 0o644, caller: .current)
      try w.index.commitBatch()
      for round in 0..<3 {
        let line = Data("line \(round)\n".utf8)
        _ = try line.withUnsafeBytes { try w.core.write(opened.handle, $0, offset: Int64(round * line.count)) }
        commits.withLock { $0 = 0 }
        counting.withLock { $0 = true }
        try w.core.fsync(opened.handle, dataOnly: true)
        counting.withLock { $0 = false }
        #expect(commits.withLock { $0 } == 1, "round \(round): commits of the index during the fsync")
        #expect(try w.index.unsyncedContentItems() == [], "round \(round)")
      }
      w.core.release(opened.handle)
      try w.crashAndRestart()
      #expect(try w.readFile("log") == Data("line 0\nline 1\nline 2\n".utf8))
      #expect(try w.index.item(a.inode)!.size == 21)
    }
  }

  @Test func aLostCacheFileWithPendingChangesIsAnErrorNeverAnEmptyUpload() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let ino = try w.writeFile("f", Data("uploaded\n".utf8))
      try w.drainUploads()
      try w.writeFile("f", Data("local edit\n".utf8))
      unlink(w.core.cache.path(ino))
      expectErrno(EIO) { _ = try w.core.open(ino, flags: O_RDONLY, caller: .current) }
      try? w.drainUploads()
      let row = try w.index.item(ino)!
      let item = try runBlocking { try await w.cloud.item(w.container, itemID: row.itemID) }
      #expect(item?.size == 9, "the cloud keeps the last good version")
    }
  }

  /// Log rotation: a file a process keeps writing is renamed, and a new file takes its name.
  /// The rename reaches the cloud at once (with the content the cloud has); the new file's
  /// upload does not wait for the writer, and the written bytes follow at the writer's flush.
  @Test func aRenameOfAFileAWriterHoldsReachesTheCloudBeforeItsFlush() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let logFile = try w.writeFile("app.log", Data("line 1\n".utf8))
      try w.drainUploads()
      let itemID = try w.index.item(logFile)!.itemID
      let h = try w.core.open(logFile, flags: O_WRONLY | O_APPEND, caller: .current).handle
      _ = try Data("line 2\n".utf8).withUnsafeBytes { try w.core.write(h, $0, offset: 7) }
      try w.core.rename(parent: w.documents, name: "app.log", newParent: w.documents, newName: "app.log.1", flags: [])
      let fresh = try w.writeFile("app.log", Data("new\n".utf8))
      try w.drainUploads()
      let rotated = try runBlocking { try await w.cloud.item(w.container, itemID: itemID) }
      #expect(rotated?.name == "app.log.1" && rotated?.size == 7, "\(String(describing: rotated))")
      let freshRow = try w.index.item(fresh)!
      #expect(freshRow.revision == freshRow.syncedRevision)
      #expect(try w.index.queueEntry(forInode: fresh) == nil)
      let freshItem = try runBlocking { try await w.cloud.item(w.container, itemID: freshRow.itemID) }
      #expect(freshItem?.name == "app.log" && freshItem?.size == 4)
      #expect(try FileContentTests.state(w, fresh) == "cached")
      #expect(try FileContentTests.state(w, logFile) == "dirty")
      w.core.release(h)
      try w.drainUploads()
      let written = try runBlocking { try await w.cloud.item(w.container, itemID: itemID) }
      #expect(written?.name == "app.log.1" && written?.size == 14)
      let row = try w.index.item(logFile)!
      #expect(row.revision == row.syncedRevision)
      #expect(try w.readFile("app.log.1") == Data("line 1\nline 2\n".utf8))
    }
  }

  @Test func evictRefusesOpenAndUnflushedFiles() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let ino = try w.writeFile("f", Data("x\n".utf8))
      try w.drainUploads()
      let h = try w.core.open(ino, flags: O_RDWR, caller: .current).handle
      expectErrno(EBUSY) { try w.core.evict(ino) }
      w.core.release(h)
      try w.core.evict(ino)
      #expect(try w.core.getattr(ino).blocks == 0)
      #expect(try w.readFile("f") == Data("x\n".utf8))
    }
  }

  @Test func unlinkedOpenFilesStayUsableUntilTheLastClose() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let ino = try w.writeFile("f", Data("keep\n".utf8))
      let h = try w.core.open(ino, flags: O_RDWR, caller: .current).handle
      try w.core.unlink(parent: w.documents, name: "f")
      #expect(try w.core.read(h, offset: 0, size: 5) == Data("keep\n".utf8))
      _ = try Data("more\n".utf8).withUnsafeBytes { try w.core.write(h, $0, offset: 5) }
      #expect(try w.core.read(h, offset: 0, size: 10) == Data("keep\nmore\n".utf8))
      #expect(try w.core.getattr(ino).linkCount == 0)
      w.core.release(h)
      expectErrno(ENOENT) { _ = try w.core.getattr(ino) }
      // The cache file goes once the delete is durable.
      try w.core.removeForgottenContent()
      #expect(!w.core.cache.exists(ino))
    }
  }

  /// An atomic save (fsync'ed temp renamed over a file) replaces a file whose changes are not
  /// uploaded yet. Until the rename is durable a power loss can bring the replaced file back, so
  /// its cache file stays until then; a crash before that leaves it to the sweep at mount.
  @Test func aReplacedFilesCacheFileStaysUntilTheReplacementIsDurable() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let old = try w.writeFile("doc", Data("version 1\n".utf8))
      let tmp = try w.writeFile("doc.tmp", Data("version 2\n".utf8))
      try w.core.rename(parent: w.documents, name: "doc.tmp", newParent: w.documents, newName: "doc", flags: [])
      #expect(w.core.cache.exists(old), "the replaced file's bytes wait for the rename to be durable")
      try w.core.fsyncDirectory(w.documents)
      #expect(!w.core.cache.exists(old))
      #expect(try w.readFile("doc") == Data("version 2\n".utf8))

      let third = try w.writeFile("doc.tmp", Data("version 3\n".utf8))
      try w.core.rename(parent: w.documents, name: "doc.tmp", newParent: w.documents, newName: "doc", flags: [])
      #expect(w.core.cache.exists(tmp))
      try w.crashAndRestart()
      #expect(!w.core.cache.exists(tmp), "swept at mount: its row is gone")
      #expect(w.core.cache.exists(third))
      #expect(try w.readFile("doc") == Data("version 3\n".utf8))
    }
  }

  @Test func directoryLinkCountCountsSubdirectories() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let a = try w.core.mkdir(parent: w.documents, name: "a", mode: 0o755, caller: .current)
      let b = try w.core.mkdir(parent: w.documents, name: "b", mode: 0o755, caller: .current)
      _ = try w.core.mkdir(parent: b.inode, name: "sub", mode: 0o755, caller: .current)
      #expect(try w.core.getattr(a.inode).linkCount == 2)
      #expect(try w.core.getattr(b.inode).linkCount == 3)
      try w.core.rename(parent: b.inode, name: "sub", newParent: a.inode, newName: "sub", flags: [])
      #expect(try w.core.getattr(a.inode).linkCount == 3)
      #expect(try w.core.getattr(b.inode).linkCount == 2)
      #expect(try w.core.lookup(parent: w.documents, name: "a")?.linkCount == 3)
      #expect(try w.core.lookup(parent: w.documents, name: "b")?.linkCount == 2)
    }
  }
}

extension FilesystemCoreTests {
  @Test func anotherDeviceAppliesSwappedNamesWithoutRenamingEitherAside() async throws {
    try await onOwnThread {
      let cloudDir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("shared-\(UUID().uuidString)")
      defer { try? FileManager.default.removeItem(at: cloudDir) }
      let cloud = try CloudEngine.embedded(directory: cloudDir)
      let a = try CoreWorld(cloud: cloud)
      let b = try CoreWorld(cloud: cloud)
      for name in ["a", "b"] {
        let dir = try a.core.mkdir(parent: a.documents, name: name, mode: 0o755, caller: .current)
        try a.writeFile("\(name)/inside.txt", Data("was \(name)\n".utf8))
        _ = dir
      }
      try a.drainUploads()
      try b.pull()
      // mv a t; mv b a; mv t b, and the same once more as an exchange.
      let docs = a.documents
      try a.core.rename(parent: docs, name: "a", newParent: docs, newName: "t", flags: [])
      try a.core.rename(parent: docs, name: "b", newParent: docs, newName: "a", flags: [])
      try a.core.rename(parent: docs, name: "t", newParent: docs, newName: "b", flags: [])
      try a.drainUploads()
      // Device b gets both records in one pull.
      try b.pull()
      #expect(try b.readFile("a/inside.txt") == Data("was b\n".utf8))
      #expect(try b.readFile("b/inside.txt") == Data("was a\n".utf8))
      var names: [String] = []
      try b.core.readdir(b.documents, offset: 2) { e in
        names.append(e.name)
        return true
      }
      #expect(names.sorted() == ["a", "b"])
      #expect(try b.index.dueQueue(now: Int64.max / 2, limit: 10).isEmpty, "nothing renamed here to upload")
    }
  }
}

/// Names are byte-exact on every device and in the cloud: a rename that changes only the case
/// is an ordinary rename, and a concurrent file with the new name makes the later one "F 2";
/// two names that differ only in Unicode normalization are two files everywhere.
@Test func caseAndNormalizationOnlyRenamesConvergeAsOrdinaryNames() async throws {
  try await onOwnThread {
    let (a, b, _) = try CoreWorld.pair()
    _ = try a.writeFile("f", Data("from a\n".utf8))
    try a.drainUploads()
    try b.pull()
    // a: mv f F; b: edits f and creates F, before it sees the rename.
    try a.core.rename(parent: a.documents, name: "f", newParent: a.documents, newName: "F", flags: [])
    _ = try b.writeFile("f", Data("edited on b\n".utf8))
    _ = try b.writeFile("F", Data("new F on b\n".utf8))
    try a.drainUploads()
    try b.drainUploads()
    try a.pull()
    try b.pull()
    try a.drainUploads()
    try b.drainUploads()
    try a.pull()
    try b.pull()
    // The NFC and the NFD spelling of "é", one on each device.
    let nfc = "caf\u{e9}"
    let nfd = "cafe\u{301}"
    _ = try a.writeFile(nfc, Data("nfc\n".utf8))
    _ = try b.writeFile(nfd, Data("nfd\n".utf8))
    for _ in 0..<2 {
      try a.drainUploads()
      try b.drainUploads()
      try a.pull()
      try b.pull()
    }
    // Keyed by the names' bytes: Swift's String equality would take the two spellings as one.
    func listing(_ w: CoreWorld) throws -> [[UInt8]: String] {
      var names: [String] = []
      try w.core.readdir(w.documents, offset: 2) { e in
        names.append(e.name)
        return true
      }
      return try Dictionary(
        uniqueKeysWithValues: names.map { (Array($0.utf8), String(decoding: try w.readFile($0), as: UTF8.self)) })
    }
    let seen = try listing(a)
    #expect(seen == (try listing(b)))
    #expect(seen.count == 4)
    // The renamed file keeps b's edit; b's new F takes the other name.
    #expect(Set(seen.values) == ["edited on b\n", "new F on b\n", "nfc\n", "nfd\n"])
    #expect(seen[Array("F".utf8)] == "edited on b\n" || seen[Array("F 2".utf8)] == "edited on b\n")
    #expect(seen[Array(nfc.utf8)] == "nfc\n")
    #expect(seen[Array(nfd.utf8)] == "nfd\n")
    #expect(seen[Array("f".utf8)] == nil)
  }
}

/// A size query and the read that follows it agree on the value, whether it grew or shrank in
/// between (`rsync -X` compares the two lengths).
@Test func xattrSnapshotsAnswerTheSizeThatWasAskedFor() async throws {
  try await onOwnThread {
    let snapshots = XattrSnapshots()
    snapshots.remember(7, "user.ubiq.percent_uploaded", Data("42".utf8))
    #expect(snapshots.fitting(7, "user.ubiq.percent_uploaded", current: Data("7".utf8), size: 2) == Data("42".utf8))
    snapshots.remember(7, "user.ubiq.percent_uploaded", Data("9".utf8))
    #expect(snapshots.fitting(7, "user.ubiq.percent_uploaded", current: Data("100".utf8), size: 1) == Data("9".utf8))
    // Without a size query first, the current value if it fits.
    #expect(snapshots.fitting(7, "user.ubiq.percent_uploaded", current: Data("100".utf8), size: 8) == Data("100".utf8))
    #expect(snapshots.fitting(7, "user.ubiq.percent_uploaded", current: Data("100".utf8), size: 2) == nil)
  }
}

/// The embedded cloud with a switch in front of chunk downloads: while held, `getChunk` waits,
/// so a test can act while a download is in flight. `afterChanges` runs once a page of the
/// change feed is read and before it is handed over, and `beforePut` before a version is
/// committed, so a test can act between the two. `loseReplies`: that many of the next puts and
/// deletes are carried out and their replies lost (the client sees the network fail).
/// `rewritePage`: what a device reads of each page of the change feed.
final class GatedCloud: CloudService, @unchecked Sendable {
  let inner: CloudService
  private let lock = NSCondition()
  private var held = false
  private var changesHook: (@Sendable () throws -> Void)?
  private var putHook: (@Sendable () throws -> Void)?
  private var pageHook: (@Sendable (ChangeBatch) throws -> ChangeBatch)?
  private var repliesToLose = 0
  private var lax = false

  /// Stores versions that break a rule of the cloud's tree, as a cloud that checks nothing
  /// would.
  var checksNothing: Bool {
    get { lock.withLock { lax } }
    set { lock.withLock { lax = newValue } }
  }

  var loseReplies: Int {
    get { lock.withLock { repliesToLose } }
    set { lock.withLock { repliesToLose = newValue } }
  }

  /// Throws as a lost reply would, if one is still to be lost.
  private func replyLost() throws {
    let lost = lock.withLock { () -> Bool in
      guard repliesToLose > 0 else { return false }
      repliesToLose -= 1
      return true
    }
    if lost { throw CloudError.unavailable("simulated: reply lost") }
  }

  var afterChanges: (@Sendable () throws -> Void)? {
    get { lock.withLock { changesHook } }
    set { lock.withLock { changesHook = newValue } }
  }

  var rewritePage: (@Sendable (ChangeBatch) throws -> ChangeBatch)? {
    get { lock.withLock { pageHook } }
    set { lock.withLock { pageHook = newValue } }
  }

  var beforePut: (@Sendable () throws -> Void)? {
    get { lock.withLock { putHook } }
    set { lock.withLock { putHook = newValue } }
  }

  init() {
    let dir = CoreWorld.temporaryFolder("gated")
    inner = try! CloudEngine.embedded(directory: dir)
  }

  func hold() { lock.withLock { held = true } }
  func release() {
    lock.withLock {
      held = false
      lock.broadcast()
    }
  }

  func getChunk(hash: String, range: Range<Int64>?) async throws -> Data {
    while lock.withLock({ held }) { try await Task.sleep(nanoseconds: 5_000_000) }
    return try await inner.getChunk(hash: hash, range: range)
  }

  func ensureContainer(_ container: ContainerID) async throws { try await inner.ensureContainer(container) }
  func missingChunks(_ hashes: [String]) async throws -> Set<String> { try await inner.missingChunks(hashes) }
  func putChunk(hash: String, data: Data) async throws { try await inner.putChunk(hash: hash, data: data) }
  func putItem(_ container: ContainerID, _ item: CloudItem, ifMatch: String?) async throws -> CloudItem {
    try beforePut?()
    let stored: CloudItem
    if checksNothing, item.brokenRule != nil, let engine = inner as? CloudEngine {
      stored = try await engine.commitUnchecked(item, in: container, ifMatch: ifMatch)
    } else {
      stored = try await inner.putItem(container, item, ifMatch: ifMatch)
    }
    try replyLost()
    return stored
  }
  func deleteItem(_ container: ContainerID, itemID: String, ifMatch: String?, deviceID: String) async throws
    -> CloudItem
  {
    let tombstone = try await inner.deleteItem(container, itemID: itemID, ifMatch: ifMatch, deviceID: deviceID)
    try replyLost()
    return tombstone
  }
  func item(_ container: ContainerID, itemID: String) async throws -> CloudItem? {
    try await inner.item(container, itemID: itemID)
  }
  func changes(_ container: ContainerID, since: Int64, limit: Int) async throws -> ChangeBatch {
    let batch = try await inner.changes(container, since: since, limit: limit)
    try afterChanges?()
    return try rewritePage?(batch) ?? batch
  }
  func usage() async throws -> Usage { try await inner.usage() }
  func waitForChanges(_ container: ContainerID, since: Int64, timeoutMs: Int) async throws -> Bool {
    try await inner.waitForChanges(container, since: since, timeoutMs: timeoutMs)
  }
}

/// A rename that changes only a name's Unicode normalization (NFC "café" to NFD) is a rename
/// like any other, also when it meets an edit made elsewhere: names are compared byte for byte,
/// so the merge keeps the new spelling and the edit, on both devices.
@Test func aNormalizationOnlyRenameSurvivesAnEditElsewhere() async throws {
  try await onOwnThread {
    let (a, b, _) = try CoreWorld.pair()
    let nfc = "caf\u{e9}"
    let nfd = "cafe\u{301}"
    _ = try a.writeFile(nfc, Data("v1\n".utf8))
    try a.drainUploads()
    try b.pull()
    try b.core.rename(parent: b.documents, name: nfc, newParent: b.documents, newName: nfd, flags: [])
    _ = try a.writeFile(nfc, Data("edited on a\n".utf8))
    try a.drainUploads()
    for _ in 0..<2 {
      try b.drainUploads()
      try a.pull()
      try b.pull()
      try a.drainUploads()
    }
    for w in [a, b] {
      var names: [[UInt8]] = []
      try w.core.readdir(w.documents, offset: 2) { e in
        names.append(Array(e.name.utf8))
        return true
      }
      #expect(names == [Array(nfd.utf8)], "\(names)")
      #expect(try w.readFile(nfd) == Data("edited on a\n".utf8))
    }
  }
}
