import Foundation
import Testing
import UbiqCore
import UbiqSync

@testable import UbiqFSCore

#if canImport(Glibc)
  import Glibc
#endif

/// The per-inode state in memory (`InodeTable`): it lives exactly as long as something refers to
/// the inode, and its going never loses what a writer, an upload snapshot or the page cache
/// relies on.
@Suite(.serialized) struct InodeTableTests {
  @Test func aStateGoesWhenTheKernelForgetsTheInodeAndItsLastHandleCloses() async throws {
    try await onOwnThread { try Self.stateGoesWhenTheKernelForgetsTheInode() }
  }

  static func stateGoesWhenTheKernelForgetsTheInode() throws {
    let w = try CoreWorld()
    let (a, opened) = try w.core.create(parent: w.documents, name: "f", mode: 0o644, caller: .current)
    w.core.entriesHanded(a.inode)
    _ = try Data("hello".utf8).withUnsafeBytes { try w.core.write(opened.handle, $0, offset: 0) }
    w.core.release(opened.handle)
    try checkThat(w.core.inodes.count == 1, "the kernel still holds an entry")
    w.core.entriesHanded(a.inode, count: 2)
    w.core.forget(a.inode, count: 2)
    try checkThat(w.core.inodes.count == 1, "two entries handed and forgotten, one left")
    w.core.forget(a.inode, count: 1)
    try checkThat(w.core.inodes.count == 0, "forgotten and closed")
    try checkThat(try w.readFile("f") == Data("hello".utf8), "the content")
    try checkThat(w.core.inodes.count == 0, "a closed handle leaves nothing behind")
  }

  @Test func manyFilesWrittenAndClosedLeaveNoStateBehind() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      for i in 0..<200 { try w.writeFile("f\(i)", Data("\(i)".utf8)) }
      try w.drainUploads()
      try checkThat(w.core.inodes.count == 0, "\(w.core.inodes.count) states left")
    }
  }

  @Test func aWriteDuringAnUploadSnapshotIsSeenEvenIfNothingElseHoldsTheInode() {
    let inodes = InodeTable()
    guard let token = inodes.beginSnapshot(7) else {
      Issue.record("no snapshot of a file without writers")
      return
    }
    _ = inodes.opened(7, handle: 1, fd: -1, writable: true)
    inodes.beginWrite(7, handleWasClean: true)
    inodes.noteFlushed(7)
    _ = inodes.closed(7, handle: 1, writable: true, wasDirty: false)
    #expect(!inodes.isSnapshotIntact(7, token), "the snapshot read bytes a write changed")
    inodes.endSnapshot(7)
    #expect(inodes.count == 0)
    let again = inodes.beginSnapshot(7)
    #expect(again.map { inodes.isSnapshotIntact(7, $0) } == true)
    inodes.endSnapshot(7)
  }

  /// The kernel's lookup counts of many inodes are kept compactly, and a state moves between
  /// that form and the whole one without losing anything: every entry handed out is taken back
  /// by exactly its forget, whatever happened to the inode in between.
  @Test func lookupCountsSurviveEveryChangeOfTheirInodesState() {
    let inodes = InodeTable()
    for i in Int64(1)...1000 { inodes.noteLookup(i, count: UInt64(i % 3 + 1)) }
    #expect(inodes.count == 1000)
    // Inode 7: a write (its generation moves), then closed: more than a count now.
    _ = inodes.opened(7, handle: 1, fd: -1, writable: true)
    inodes.beginWrite(7, handleWasClean: true)
    inodes.noteFlushed(7)
    _ = inodes.closed(7, handle: 1, writable: true, wasDirty: false)
    // Inode 8: opened and closed: a count again. Inode 9: gone while the kernel holds it.
    _ = inodes.opened(8, handle: 2, fd: -1, writable: false)
    _ = inodes.closed(8, handle: 2, writable: false, wasDirty: false)
    inodes.itemGone(9)
    inodes.noteLookup(10)
    #expect(inodes.count == 1000)
    for i in Int64(1)...1000 {
      let handed = UInt64(i % 3 + 1) + (i == 10 ? 1 : 0)
      #expect(inodes.forget(i, count: handed) == 0, "inode \(i) kept its \(handed) entries")
    }
    #expect(inodes.count == 0)
    #expect(inodes.forget(5, count: 1) == 1, "a forget beyond the count is reported")
  }

  @Test func aSnapshotWaitsForUnrecordedWrites() {
    let inodes = InodeTable()
    _ = inodes.opened(3, handle: 1, fd: -1, writable: true)
    inodes.beginWrite(3, handleWasClean: true)
    #expect(inodes.beginSnapshot(3) == nil)
    #expect(inodes.isBusy(3))
    inodes.noteFlushed(3)
    _ = inodes.closed(3, handle: 1, writable: true, wasDirty: false)
    #expect(!inodes.isBusy(3))
    #expect(inodes.beginSnapshot(3) != nil)
    inodes.endSnapshot(3)
    #expect(inodes.count == 0)
  }

  @Test func aHandleClosedWithUnrecordedWritesNoLongerHoldsUploadsBack() {
    let inodes = InodeTable()
    _ = inodes.opened(3, handle: 1, fd: -1, writable: true)
    inodes.beginWrite(3, handleWasClean: true)
    _ = inodes.closed(3, handle: 1, writable: true, wasDirty: true)
    #expect(!inodes.isBusy(3) && inodes.dirtyHandleCount(3) == 0 && inodes.count == 0)
  }

  @Test func anUnlinkedFileLivesUntilItsLastHandleCloses() {
    let inodes = InodeTable()
    let attributes = UnlinkedAttributes(mode: 0o600, uid: 1, gid: 2, mtimeNs: 3)
    #expect(!inodes.markUnlinked(9, attributes), "nothing holds it: its content can go at once")
    _ = inodes.opened(9, handle: 1, fd: -1, writable: false)
    _ = inodes.opened(9, handle: 2, fd: -1, writable: true)
    #expect(inodes.markUnlinked(9, attributes))
    #expect(inodes.unlinkedAttributes(9)?.mtimeNs == 3)
    #expect(inodes.closed(9, handle: 1, writable: false, wasDirty: false) == nil)
    #expect(inodes.isOpen(9))
    #expect(inodes.closed(9, handle: 2, writable: true, wasDirty: false)?.mode == 0o600)
    #expect(!inodes.isOpen(9) && inodes.count == 0)
    #expect(inodes.closed(9, handle: 2, writable: true, wasDirty: false) == nil, "a second close is ignored")
  }

  @Test func pagesAreDroppedAfterARemoteReplacementWhileTheKernelHoldsTheInode() {
    let inodes = InodeTable()
    inodes.noteLookup(4)
    let epoch = inodes.opened(4, handle: 1, fd: -1, writable: false)
    #expect(inodes.mayKeepPages(4))
    inodes.contentReplaced(4)
    #expect(!inodes.mayKeepPages(4), "opens right after a replacement drop the kernel's pages")
    inodes.noteRead(4, openedIn: epoch)
    _ = inodes.closed(4, handle: 1, writable: false, wasDirty: false)
    #expect(!inodes.mayKeepPages(4))
    #expect(inodes.forget(4, count: 1) == 0)
    #expect(inodes.count == 0, "forgotten by the kernel, its pages are gone with it")
    #expect(inodes.mayKeepPages(4))
    #expect(inodes.forget(4, count: 5) == 5, "a forget past the count is reported")
    #expect(inodes.count == 0)
  }

  @Test func oldPagesAreDroppedUntilAnOpenAfterTheLastOldHandleHowEverLongThatTakes() {
    let inodes = InodeTable()
    inodes.noteLookup(4)
    let old = inodes.opened(4, handle: 1, fd: -1, writable: false)
    inodes.contentReplaced(4)
    #expect(inodes.noteRead(4, openedIn: old), "a read through the old handle asks for the pages to be dropped")
    #expect(!inodes.noteRead(4, openedIn: old), "once, until that drop starts")
    inodes.pageDropStarting(4)
    #expect(inodes.noteRead(4, openedIn: old), "a read after the drop started asks again")
    inodes.pageDropStarting(4)
    let new = inodes.opened(4, handle: 2, fd: -1, writable: false)
    #expect(!inodes.mayKeepPages(4))
    #expect(!inodes.noteRead(4, openedIn: new), "a read of the current version puts no old bytes in the cache")
    #expect(!inodes.mayKeepPages(4), "every open drops the pages while the old handle may read")
    #expect(inodes.noteRead(4, openedIn: old))
    _ = inodes.closed(4, handle: 1, writable: false, wasDirty: false)
    _ = inodes.closed(4, handle: 2, writable: false, wasDirty: false)
    // No time passes in this test: what ends the dropping is an open after the old handle is
    // closed, not a quiet period.
    #expect(!inodes.mayKeepPages(4), "the first open after the old handle's last read drops the pages")
    #expect(inodes.mayKeepPages(4), "later opens keep them")
    inodes.pageDropStarting(4)
    #expect(inodes.forget(4, count: 1) == 0)
    #expect(inodes.count == 0)
  }

  /// A file deleted while the kernel still holds entries of it: its record goes with the item,
  /// but the kernel's entries are still counted, so its later forgets are expected ones (found
  /// on real mounts: "forgot 1 more entries" after every `rm` of a listed file).
  @Test func theKernelsEntriesOfADeletedItemAreStillCounted() async throws {
    try await onOwnThread {
      let w = try CoreWorld()
      let (a, opened) = try w.core.create(parent: w.documents, name: "gone", mode: 0o644, caller: .current)
      w.core.entriesHanded(a.inode, count: 2)
      w.core.release(opened.handle)
      try w.core.unlink(parent: w.documents, name: "gone")
      try checkThat(w.core.inodes.forget(a.inode, count: 2) == 0, "forgets of a deleted item beyond its count")
      try checkThat(w.core.inodes.count == 0, "nothing left once the kernel forgot it")
    }
  }
}
