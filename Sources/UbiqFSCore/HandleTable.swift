import Foundation
import UbiqCore
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// One open file handle: the cache file descriptor the kernel's requests go to.
final class OpenFile {
  let inode: Int64
  let fd: Int32
  let writable: Bool
  /// Written since the last flush/fsync.
  var dirty = false
  /// Set while the content is still arriving from the cloud (read-only opens of evicted files).
  /// Set at open, never changed afterwards.
  var stream: ContentStream?
  /// The inode's `PageCacheEpochs` epoch when this handle was opened.
  var epoch: UInt64 = 0
  /// How far the download may fetch ahead of this handle's reads; guarded by `readAheadLock`.
  private var readAhead: ReadAheadWindow
  private let readAheadLock = NSLock()

  init(inode: Int64, fd: Int32, writable: Bool, epoch: UInt64 = 0, readAhead: ReadAheadWindow = ReadAheadWindow()) {
    self.inode = inode
    self.fd = fd
    self.writable = writable
    self.epoch = epoch
    self.readAhead = readAhead
  }

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

/// Live state of inodes that have open handles: how many, the latest write time, whether the
/// item was unlinked while open (its cache file then goes with the last release).
struct LiveInode {
  var openCount = 0
  var pendingMtimeNs: Int64?
  var unlinked = false
  /// A descriptor of the cache file, for fstat while the file is open.
  var anyFD: Int32 = -1
  /// Attributes to answer getattr with after an unlink (the row is gone).
  var orphan: ItemSnapshot?
}

/// A copy of the attributes of a row that no longer exists (open-unlinked file).
struct ItemSnapshot {
  var mode: UInt32
  var uid: UInt32
  var gid: UInt32
  var mtimeNs: Int64
}

/// The handle table and per-inode live state, shared by all FUSE worker threads.
/// Sendable: `handles`, `live`, `nextHandle` and `uses` are guarded by `lock`.
final class HandleTable: @unchecked Sendable {
  private var handles: [UInt64: OpenFile] = [:]
  private var live: [Int64: LiveInode] = [:]
  private var nextHandle: UInt64 = 1
  private let lock = NSLock()

  func add(_ f: OpenFile) -> UInt64 {
    lock.withLock {
      let h = nextHandle
      nextHandle += 1
      handles[h] = f
      live[f.inode, default: LiveInode()].openCount += 1
      if live[f.inode]!.anyFD < 0 { live[f.inode]!.anyFD = f.fd }
      return h
    }
  }

  func get(_ h: UInt64) -> OpenFile? { lock.withLock { handles[h] } }

  /// Removes a handle; returns it and whether it was the inode's last one (and whether the
  /// inode was unlinked meanwhile).
  func remove(_ h: UInt64) -> (file: OpenFile, last: Bool, unlinked: Bool)? {
    lock.withLock {
      guard let f = handles.removeValue(forKey: h) else { return nil }
      var l = live[f.inode] ?? LiveInode()
      l.openCount -= 1
      if l.openCount <= 0 {
        live[f.inode] = nil
        return (f, true, l.unlinked)
      }
      if l.anyFD == f.fd {
        l.anyFD = handles.values.first(where: { $0.inode == f.inode })?.fd ?? -1
      }
      live[f.inode] = l
      return (f, false, l.unlinked)
    }
  }

  func liveState(_ inode: Int64) -> LiveInode? { lock.withLock { live[inode] } }

  /// The size of an open file's cache file and its latest write time; nil if it is not open.
  /// The fstat runs under the table's lock: a handle leaves the table before its descriptor is
  /// closed, so the descriptor cannot be closed (and its number reused) meanwhile.
  func openFileState(_ inode: Int64) -> (size: Int64?, pendingMtimeNs: Int64?)? {
    lock.withLock {
      guard let l = live[inode] else { return nil }
      var st = stat()
      let size = l.anyFD >= 0 && fstat(l.anyFD, &st) == 0 ? Int64(st.st_size) : nil
      return (size, l.pendingMtimeNs)
    }
  }

  func noteWrite(_ inode: Int64, mtimeNs: Int64) {
    lock.withLock { live[inode]?.pendingMtimeNs = mtimeNs }
  }

  func takePendingMtime(_ inode: Int64) -> Int64? {
    lock.withLock {
      let m = live[inode]?.pendingMtimeNs
      live[inode]?.pendingMtimeNs = nil
      return m
    }
  }

  func setPendingMtime(_ inode: Int64, _ m: Int64?) { lock.withLock { live[inode]?.pendingMtimeNs = m } }

  /// Marks an open inode as unlinked; false if it has no open handle.
  func markUnlinked(_ inode: Int64, orphan: ItemSnapshot) -> Bool {
    lock.withLock {
      guard live[inode] != nil else { return false }
      live[inode]!.unlinked = true
      live[inode]!.orphan = orphan
      return true
    }
  }

  var openHandleCount: Int { lock.withLock { handles.count } }

  /// Last-use times not yet written to the index (flushed in batches, off the hot path).
  private var uses: [Int64: Int64] = [:]
  func noteUse(_ inode: Int64) { lock.withLock { uses[inode] = Clock.nowNs() } }
  func takeUses() -> [Int64: Int64] {
    lock.withLock {
      defer { uses = [:] }
      return uses
    }
  }

  func openInodes() -> Set<Int64> { lock.withLock { Set(live.keys) } }
}
