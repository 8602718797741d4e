import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// The attributes an unlinked file still answers `getattr` with while a handle holds it open
/// (its row is gone from the index).
public struct UnlinkedAttributes: Sendable {
  public var mode: UInt32
  public var uid: UInt32
  public var gid: UInt32
  public var mtimeNs: Int64

  public init(mode: UInt32, uid: UInt32, gid: UInt32, mtimeNs: Int64) {
    self.mode = mode
    self.uid = uid
    self.gid = gid
    self.mtimeNs = mtimeNs
  }
}

/// Everything the mount keeps in memory about one inode. What is durable (the content state
/// `dataless`/`cached`, the dirty mark, the upload queue) is in the index; a running download is
/// the `Downloader`'s `ContentStream`.
struct InodeState {
  /// Entries the kernel holds for the inode: each reply that hands it one (lookup, create,
  /// mkdir, a readdirplus entry) adds one, `forget` takes them back.
  var lookups: UInt64 = 0
  /// Open handles: their cache file descriptors (nil until a handle that created the file
  /// opens its cache file), whether they may write, and the content epoch they were opened in.
  var handles: [UInt64: (fd: Int32?, writable: Bool, epoch: UInt64)] = [:]
  /// Open handles that may write.
  var writers = 0
  /// Open handles with writes not yet recorded in the index (flush, fsync, close).
  var dirtyHandles = 0
  /// Moves before every write reaches the cache file and at every replacement of the content
  /// outside a handle (truncate): an upload snapshot taken at one generation is thrown away if
  /// it moved.
  var generation: UInt64 = 0
  /// Upload snapshots in progress: the state stays while one runs, so its generation holds.
  var snapshots = 0
  /// The time of the latest write through a handle, not yet recorded (nil: none, or a time was
  /// set explicitly after it).
  var pendingMtimeNs: Int64?
  /// Set when the file was unlinked while open: it lives on until the last close.
  var unlinked: UnlinkedAttributes?
  /// Set when the directory was removed while the kernel still held it (an open descriptor, a
  /// working directory): it answers as an empty directory with no links until forgotten.
  var removedDirectory: UnlinkedAttributes?
  /// Counts replacements of the content that did not pass through the kernel (a remote
  /// version); a handle remembers the epoch it was opened in.
  var contentEpoch: UInt64 = 0
  /// The kernel's pages may hold bytes of a replaced version: opens make it drop them (see
  /// `InodeTable.contentReplaced`).
  var pagesMayBeStale = false
  /// A drop of the kernel's pages was asked for and has not started yet (`noteRead`).
  var pageDropQueued = false

  /// Nothing refers to the inode any more: the kernel forgot it (and with it its pages), no
  /// handle is open and no snapshot runs. Its state can go; a later use starts afresh.
  var isIdle: Bool { lookups == 0 && handles.isEmpty && writers == 0 && dirtyHandles == 0 && snapshots == 0 }

  /// Everything but the kernel's lookup count is as a fresh state has it: the state is its
  /// count alone (what almost every inode the kernel knows has, after a `find` of a big tree).
  var isLookupsOnly: Bool {
    handles.isEmpty && writers == 0 && dirtyHandles == 0 && generation == 0 && snapshots == 0
      && pendingMtimeNs == nil && unlinked == nil && removedDirectory == nil && contentEpoch == 0 && !pagesMayBeStale
      && !pageDropQueued
  }
}

/// The one owner of the mount's per-inode state in memory (`InodeState`): the kernel's lookup
/// count, open handles, writers and unflushed writes, the write generation that fences upload
/// snapshots, the pending write time, unlinked-while-open attributes and the page-cache epoch.
/// A state exists while something refers to the inode and goes when it is idle (forgotten by
/// the kernel, closed) or the item is gone, so memory follows what is in use, not what was ever
/// touched.
///
/// Also the per-inode lock that orders content transitions (open, truncate, first write, flush,
/// evict, remote replacement, download completion), striped over 64 locks.
///
/// A state that is its lookup count alone is kept as that count (`lookupsOnly`, 16 bytes an
/// entry instead of a whole `InodeState`): the kernel may know a million inodes.
///
/// Sendable: `states` and `lookupsOnly` are guarded by `lock`; `stripes` are the per-inode
/// locks themselves. Lock order: an inode lock, then `lock`.
public final class InodeTable: @unchecked Sendable {
  /// Inodes whose state is more than a lookup count.
  private var states: [Int64: InodeState] = [:]
  /// Inodes whose state is a lookup count alone (`InodeState.isLookupsOnly`); never also in `states`.
  private var lookupsOnly: [Int64: UInt64] = [:]
  private let lock = NSLock()
  private let stripes = (0..<64).map { _ in NSLock() }
  public init() {}

  /// Runs `body` under the inode's lock: content transitions of one inode never interleave.
  public func withInodeLock<T>(_ inode: Int64, _ body: () throws -> T) rethrows -> T {
    try stripes[Int(UInt64(bitPattern: inode) % 64)].withLock(body)
  }

  /// Applies `change` to the inode's state (created if absent) and drops it if it is then idle.
  private func update<T>(_ inode: Int64, _ change: (inout InodeState) -> T) -> T {
    lock.withLock {
      let full = states[inode]
      var state = full ?? InodeState(lookups: lookupsOnly[inode] ?? 0)
      let result = change(&state)
      if state.isIdle {
        if full != nil { states[inode] = nil } else { lookupsOnly[inode] = nil }
      } else if state.isLookupsOnly {
        lookupsOnly[inode] = state.lookups
        if full != nil { states[inode] = nil }
      } else {
        states[inode] = state
        if full == nil { lookupsOnly[inode] = nil }
      }
      return result
    }
  }

  /// Reads the inode's state (a fresh one if absent).
  private func read<T>(_ inode: Int64, _ body: (InodeState) -> T) -> T {
    lock.withLock { body(states[inode] ?? InodeState(lookups: lookupsOnly[inode] ?? 0)) }
  }

  // MARK: - the kernel's references

  /// A reply handed the kernel `count` entries of the inode.
  public func noteLookup(_ inode: Int64, count: UInt64 = 1) {
    update(inode) { $0.lookups &+= count }
  }

  /// The kernel forgot `count` of its entries of the inode (FUSE forget). Returns the entries
  /// it forgot beyond those it was handed: 0 unless a reply that hands one out went uncounted.
  @discardableResult
  public func forget(_ inode: Int64, count: UInt64) -> UInt64 {
    update(inode) {
      let known = min($0.lookups, count)
      $0.lookups -= known
      return count - known
    }
  }

  // MARK: - handles

  /// A handle was opened; returns the content epoch it is opened in.
  public func opened(_ inode: Int64, handle: UInt64, fd: Int32?, writable: Bool) -> UInt64 {
    update(inode) {
      $0.handles[handle] = (fd, writable, $0.contentEpoch)
      if writable { $0.writers += 1 }
      return $0.contentEpoch
    }
  }

  /// A handle opened without a descriptor (`opened` with nil) opened its cache file.
  public func descriptorOpened(_ inode: Int64, handle: UInt64, fd: Int32) {
    update(inode) { $0.handles[handle]?.fd = fd }
  }

  /// A handle was closed (its descriptor is closed after this returns, so `openFileState`
  /// never reads a reused descriptor number). `wasDirty`: it still held writes that could not
  /// be recorded. Returns the attributes it was unlinked with if this was the last handle of
  /// an unlinked file (its content can go), else nil.
  public func closed(_ inode: Int64, handle: UInt64, writable: Bool, wasDirty: Bool) -> UnlinkedAttributes? {
    update(inode) {
      guard $0.handles.removeValue(forKey: handle) != nil else { return nil }
      if writable { $0.writers = max(0, $0.writers - 1) }
      if wasDirty { $0.dirtyHandles = max(0, $0.dirtyHandles - 1) }
      guard $0.handles.isEmpty, let unlinked = $0.unlinked else { return nil }
      $0.unlinked = nil
      return unlinked
    }
  }

  /// True while a handle of the inode is open.
  public func isOpen(_ inode: Int64) -> Bool { read(inode) { !$0.handles.isEmpty } }

  /// The inodes with open handles.
  public func openInodes() -> Set<Int64> {
    lock.withLock { Set(states.compactMap { $0.value.handles.isEmpty ? nil : $0.key }) }
  }

  /// The size of an open file's content and its latest unrecorded write time; nil if it is
  /// not open. The size is the cache file's as a writer's descriptor sees it (writes not yet
  /// recorded count), nil with no writer (the index's is right then). Readers do not count:
  /// one may hold an older cache file (a download superseded since, a version replaced
  /// remotely), whose size is not the file's. `anyHandle`: with no writer, a reader's
  /// descriptor answers (an unlinked file, which has no index row). The fstat runs under the
  /// table's lock: a handle leaves the table before its descriptor is closed, so the
  /// descriptor cannot be closed (and its number reused) meanwhile.
  public func openFileState(_ inode: Int64, anyHandle: Bool = false) -> (size: Int64?, pendingMtimeNs: Int64?)? {
    lock.withLock {
      guard let state = states[inode], !state.handles.isEmpty else { return nil }
      let handles = state.handles.values
      let withFile = handles.first { $0.writable && $0.fd != nil } ?? (anyHandle ? handles.first { $0.fd != nil } : nil)
      let fd = withFile?.fd
      var st = stat()
      let size = fd.flatMap { fstat($0, &st) == 0 ? Int64(st.st_size) : nil }
      return (size, state.pendingMtimeNs)
    }
  }

  /// Marks an open file as unlinked; false if no handle holds it (its content can go now).
  public func markUnlinked(_ inode: Int64, _ attributes: UnlinkedAttributes) -> Bool {
    lock.withLock {
      guard var state = states[inode], !state.handles.isEmpty else { return false }
      state.unlinked = attributes
      states[inode] = state
      return true
    }
  }

  /// The attributes of an unlinked file that is still open.
  public func unlinkedAttributes(_ inode: Int64) -> UnlinkedAttributes? { read(inode) { $0.unlinked } }

  /// Notes that directory `inode` was removed with `attributes`, if the kernel still holds an
  /// entry of it; its state then lives until the kernel forgets it.
  public func directoryRemoved(_ inode: Int64, _ attributes: UnlinkedAttributes) {
    update(inode) { if $0.lookups > 0 { $0.removedDirectory = attributes } }
  }

  /// The attributes of a removed directory the kernel still holds (nil: not such a one).
  public func removedDirectoryAttributes(_ inode: Int64) -> UnlinkedAttributes? {
    read(inode) { $0.removedDirectory }
  }

  /// Changes the attributes of a removed directory the kernel still holds (fchmod on it).
  public func changeRemovedDirectory(_ inode: Int64, _ change: (inout UnlinkedAttributes) -> Void) {
    update(inode) { state in
      guard var a = state.removedDirectory else { return }
      change(&a)
      state.removedDirectory = a
    }
  }

  /// The item is gone for good (inodes are never reused) and no handle holds it: its state
  /// goes, but for the kernel's entries, which stay counted until it forgets them.
  public func itemGone(_ inode: Int64) {
    lock.withLock {
      guard let state = states[inode], state.handles.isEmpty else { return }
      states[inode] = nil
      if state.lookups > 0 { lookupsOnly[inode] = state.lookups }
    }
  }

  // MARK: - writes and upload snapshots

  /// Called before a write through a handle reaches the cache file; `handleWasClean` is true
  /// for the handle's first write since its last flush.
  public func beginWrite(_ inode: Int64, handleWasClean: Bool) {
    update(inode) {
      $0.generation &+= 1
      if handleWasClean { $0.dirtyHandles += 1 }
    }
  }

  /// A write through a handle ended at `mtimeNs`.
  public func noteWritten(_ inode: Int64, mtimeNs: Int64) {
    update(inode) { if !$0.handles.isEmpty { $0.pendingMtimeNs = mtimeNs } }
  }

  /// Takes the time of the latest unrecorded write (nil: none, or set explicitly since).
  public func takePendingMtime(_ inode: Int64) -> Int64? {
    update(inode) { state in
      defer { state.pendingMtimeNs = nil }
      return state.pendingMtimeNs
    }
  }

  /// A time was set explicitly (or the content replaced): earlier writes' time no longer counts.
  public func clearPendingMtime(_ inode: Int64) { update(inode) { $0.pendingMtimeNs = nil } }

  /// Open handles of `inode` holding writes not yet recorded in the index.
  public func dirtyHandleCount(_ inode: Int64) -> Int { read(inode) { $0.dirtyHandles } }

  /// A dirty handle's writes were recorded in the index (flush, fsync).
  public func noteFlushed(_ inode: Int64) {
    update(inode) { $0.dirtyHandles = max(0, $0.dirtyHandles - 1) }
  }

  /// The content was replaced outside any handle (truncate).
  public func noteReplaced(_ inode: Int64) { update(inode) { $0.generation &+= 1 } }

  /// True while a handle that may write is open, or writes are unflushed.
  public func isBusy(_ inode: Int64) -> Bool { read(inode) { $0.writers > 0 || $0.dirtyHandles > 0 } }

  /// Starts an upload snapshot: nil while the file has writes not yet closed or fsynced, else
  /// the generation to check with `isSnapshotIntact`. Every non-nil start is ended with
  /// `endSnapshot`.
  public func beginSnapshot(_ inode: Int64) -> UInt64? {
    update(inode) {
      guard $0.dirtyHandles == 0 else { return nil }
      $0.snapshots += 1
      return $0.generation
    }
  }

  /// True if no write happened since `beginSnapshot` returned `token`.
  public func isSnapshotIntact(_ inode: Int64, _ token: UInt64) -> Bool {
    read(inode) { $0.dirtyHandles == 0 && $0.generation == token }
  }

  public func endSnapshot(_ inode: Int64) { update(inode) { $0.snapshots = max(0, $0.snapshots - 1) } }

  // MARK: - the kernel's page cache

  /// The content was replaced behind the kernel's back (a remote version replaced the cached
  /// bytes), so the page cache must never serve the old bytes.
  ///
  /// Invalidating the kernel's pages when the change is applied is not enough: a handle opened
  /// before the change still reads the old cache file by descriptor (POSIX: it keeps the bytes
  /// it opened), and each of its reads fills the shared page cache with old bytes again, for
  /// as long as it reads. So a handle remembers the epoch it was opened in. A read through an
  /// older handle asks for the kernel's pages to be dropped once it is answered (`noteRead`),
  /// and opens ask the kernel to drop them (`keep_cache` off) until one comes after the last
  /// older handle is closed (`mayKeepPages`): however long after its last read that is, the
  /// open finds no old page. A state the kernel forgot has no pages to drop, so it may go.
  public func contentReplaced(_ inode: Int64) {
    update(inode) {
      $0.contentEpoch &+= 1
      if $0.lookups > 0 || !$0.handles.isEmpty { $0.pagesMayBeStale = true }
    }
  }

  /// A read through a handle opened in `epoch` was answered. True if that is an older epoch
  /// (the answer may have put old bytes in the page cache) and no drop of the kernel's pages is
  /// queued yet: the caller drops them, outside the request, and calls `pageDropStarting` first.
  @discardableResult
  public func noteRead(_ inode: Int64, openedIn epoch: UInt64) -> Bool {
    update(inode) {
      guard $0.contentEpoch != epoch else { return false }
      $0.pagesMayBeStale = true
      if $0.pageDropQueued { return false }
      $0.pageDropQueued = true
      return true
    }
  }

  /// A drop asked for by `noteRead` starts: a read answered from now on asks again.
  public func pageDropStarting(_ inode: Int64) { update(inode) { $0.pageDropQueued = false } }

  /// At open: true if the kernel may keep the pages it has of `inode`. While they may hold old
  /// bytes, every open drops them; the first open after the last older handle is closed is the
  /// last one that must.
  public func mayKeepPages(_ inode: Int64) -> Bool {
    update(inode) {
      guard $0.pagesMayBeStale else { return true }
      let epoch = $0.contentEpoch
      if !$0.handles.values.contains(where: { $0.epoch != epoch }) { $0.pagesMayBeStale = false }
      return false
    }
  }

  /// How many inodes have state (for tests and status).
  public var count: Int { lock.withLock { states.count + lookupsOnly.count } }
}
