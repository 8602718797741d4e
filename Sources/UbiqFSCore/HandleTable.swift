import Foundation
import UbiqCore
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// One open file handle: the cache file descriptor the kernel's requests go to.
final class OpenFile {
  let inode: Int64
  let writable: Bool
  /// The handle's number in the `HandleTable` (set when it is added).
  var number: UInt64 = 0
  /// The cache file's descriptor, or nil until a request needs it: the handle that creates a
  /// file opens the cache file at its first write (or read, or fsync), so an empty file
  /// closed unwritten never gets one. Set once, under the inode lock; read under
  /// `descriptorLock` from any thread.
  var fd: Int32? { descriptorLock.withLock { descriptor } }
  private var descriptor: Int32?
  private let descriptorLock = NSLock()
  /// Written since the last flush/fsync (or, with `createdUnwritten`, created and not flushed).
  var dirty = false
  /// The handle created the file and has written nothing yet: it holds the file as a writer,
  /// with no dirty mark in the index and nothing to record at its flush.
  var createdUnwritten = false
  /// Set while the content is still arriving from the cloud (read-only opens of evicted files).
  /// Set at open, never changed afterwards.
  var stream: ContentStream?
  /// The inode's content epoch when this handle was opened (`InodeTable.contentReplaced`).
  var epoch: UInt64 = 0
  /// How far the download may fetch ahead of this handle's reads; guarded by `readAheadLock`.
  private var readAhead: ReadAheadWindow
  private let readAheadLock = NSLock()

  init(inode: Int64, fd: Int32?, writable: Bool, epoch: UInt64 = 0, readAhead: ReadAheadWindow = ReadAheadWindow()) {
    self.inode = inode
    self.descriptor = fd
    self.writable = writable
    self.epoch = epoch
    self.readAhead = readAhead
  }

  /// Gives the handle its cache file descriptor (it had none). Under the inode lock.
  func setDescriptor(_ fd: Int32) { descriptorLock.withLock { descriptor = fd } }

  /// Records a read through this handle; returns the offset the download may fetch up to.
  func fetchLimit(afterReadAt offset: Int64, length: Int) -> Int64 {
    readAheadLock.withLock { readAhead.fetchLimit(afterReadAt: offset, length: length) }
  }

  /// Orders writes through this handle against recording them (flush, fsync, close): writes run
  /// side by side, a recording waits until none is in flight and holds new ones off until it
  /// has read the size and cleared `dirty`, so no write can land unrecorded between the two.
  private let gate = NSCondition()
  private var writesInFlight = 0
  private var recording = false

  func withWrite<T>(_ body: () throws -> T) rethrows -> T {
    gate.withLock {
      while recording { gate.wait() }
      writesInFlight += 1
    }
    defer {
      gate.withLock {
        writesInFlight -= 1
        if writesInFlight == 0 { gate.broadcast() }
      }
    }
    return try body()
  }

  func withWritesQuiesced<T>(_ body: () throws -> T) rethrows -> T {
    gate.withLock {
      while writesInFlight > 0 || recording { gate.wait() }
      recording = true
    }
    defer {
      gate.withLock {
        recording = false
        gate.broadcast()
      }
    }
    return try body()
  }
}

/// The open handles of the mount, by handle number, and last-use times not yet written to the
/// index. Per-inode state (open counts, writers, unlinked-while-open) is the `InodeTable`'s.
/// Sendable: `handles`, `nextHandle` and `uses` are guarded by `lock`.
final class HandleTable: @unchecked Sendable {
  private var handles: [UInt64: OpenFile] = [:]
  private var nextHandle: UInt64 = 1
  private let lock = NSLock()

  func add(_ f: OpenFile) -> UInt64 {
    lock.withLock {
      let h = nextHandle
      nextHandle += 1
      f.number = h
      handles[h] = f
      return h
    }
  }

  func get(_ h: UInt64) -> OpenFile? { lock.withLock { handles[h] } }

  /// Takes a handle out of the table (nil if it is not there).
  func remove(_ h: UInt64) -> OpenFile? { lock.withLock { handles.removeValue(forKey: h) } }

  var count: Int { lock.withLock { handles.count } }

  /// Last-use times not yet written to the index (flushed in batches, off the hot path).
  private var uses: [Int64: Int64] = [:]
  func noteUse(_ inode: Int64) { lock.withLock { uses[inode] = Clock.nowNs() } }
  func takeUses() -> [Int64: Int64] {
    lock.withLock {
      defer { uses = [:] }
      return uses
    }
  }
}
