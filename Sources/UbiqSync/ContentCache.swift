import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// The local content cache: one file per inode under `<state>/content/`. Owns the naming and the
/// creation/removal of those files; the filesystem reads and writes them through file descriptors.
/// Sendable: `namesChanged` is guarded by `lock`; a file's name changes only under its inode lock.
public final class ContentCache: @unchecked Sendable {
  public let directory: String

  public init(directory: String) throws {
    self.directory = directory
    try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
  }

  public func path(_ inode: Int64) -> String { "\(directory)/\(inode)" }

  /// Names created or removed since the folder was last fsync'ed.
  private var namesChanged = true
  private let lock = NSLock()

  /// Opens (creating if asked) the cache file of `inode` read-write.
  public func open(_ inode: Int64, create: Bool) throws -> Int32 {
    let fd = Glibc.open(path(inode), O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0o600)
    if fd < 0 { throw UbiqError.io("cache file for inode \(inode): \(String(cString: strerror(errno)))") }
    if create { lock.withLock { namesChanged = true } }
    return fd
  }

  public func exists(_ inode: Int64) -> Bool { access(path(inode), F_OK) == 0 }

  public func remove(_ inode: Int64) {
    unlink(path(inode))
    lock.withLock { namesChanged = true }
  }

  /// Makes the folder's entries durable (a new cache file's name survives a power loss), if
  /// any changed since the last call. Called before an index commit that relies on them is made
  /// durable or refers to a new cache file's bytes.
  public func syncDirectory() throws {
    guard lock.withLock({ namesChanged }) else { return }
    lock.withLock { namesChanged = false }
    do {
      try Self.fsyncDirectory(directory)
    } catch {
      lock.withLock { namesChanged = true }
      throw error
    }
  }

  /// fsync of a directory: its entries (created, renamed, removed names) become durable.
  public static func fsyncDirectory(_ path: String) throws {
    let fd = Glibc.open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    guard fd >= 0 else { throw UbiqError.posix(errno, "open of \(path) to fsync it") }
    defer { close(fd) }
    if Glibc.fsync(fd) != 0 { throw UbiqError.posix(errno, "fsync of \(path)") }
  }

  /// Bytes the cache file really occupies on disk.
  public func allocatedBytes(_ inode: Int64) -> Int64 {
    var st = stat()
    guard stat(path(inode), &st) == 0 else { return 0 }
    return Int64(st.st_blocks) * 512
  }
}

/// Coordinates writers and the uploader for each inode so that an upload always sends a
/// consistent snapshot: the state of the file as of a close/fsync, never a torn mix.
/// Writers bump a generation and mark the inode unflushed; flush/fsync clears the mark.
/// The uploader reads only when nothing is unflushed and discards its read if the generation
/// moved meanwhile.
/// Sendable: `states` is guarded by `lock`; `stripes` are the per-inode locks themselves.
public final class WriteCoordinator: @unchecked Sendable {
  struct State {
    var generation: UInt64 = 0
    /// Open handles with writes not yet closed or fsynced.
    var dirtyHandles = 0
    /// Open handles that may write.
    var writers = 0
  }
  private let stripes = (0..<64).map { _ in NSLock() }

  /// Serializes opening a file against replacing its content with a remote version.
  public func withInodeLock<T>(_ inode: Int64, _ body: () throws -> T) rethrows -> T {
    try stripes[Int(UInt64(bitPattern: inode) % 64)].withLock(body)
  }

  public func noteWriterOpened(_ inode: Int64) { lock.withLock { states[inode, default: State()].writers += 1 } }
  public func noteWriterClosed(_ inode: Int64) {
    lock.withLock { if let s = states[inode], s.writers > 0 { states[inode]!.writers -= 1 } }
  }
  /// True while a handle that may write is open, or writes are unflushed.
  public func isBusy(_ inode: Int64) -> Bool {
    lock.withLock { (states[inode]?.writers ?? 0) > 0 || (states[inode]?.dirtyHandles ?? 0) > 0 }
  }
  private var states: [Int64: State] = [:]
  private let lock = NSLock()

  public init() {}

  /// A write through a handle; `handleWasClean` is true for its first write since its last flush.
  public func noteWrite(_ inode: Int64, handleWasClean: Bool) {
    lock.withLock {
      states[inode, default: State()].generation &+= 1
      if handleWasClean { states[inode]!.dirtyHandles += 1 }
    }
  }

  /// Open handles of `inode` holding writes not yet recorded in the index.
  public func dirtyHandleCount(_ inode: Int64) -> Int { lock.withLock { states[inode]?.dirtyHandles ?? 0 } }

  /// A dirty handle was flushed (close/fsync) and its content recorded in the index.
  public func noteFlushed(_ inode: Int64) {
    lock.withLock {
      if let s = states[inode], s.dirtyHandles > 0 { states[inode]!.dirtyHandles -= 1 }
    }
  }

  /// A complete content change outside any handle (truncate).
  public func noteReplaced(_ inode: Int64) {
    lock.withLock { states[inode, default: State()].generation &+= 1 }
  }

  /// Starts a snapshot read; nil while the file has writes not yet closed or fsynced.
  public func beginSnapshot(_ inode: Int64) -> UInt64? {
    lock.withLock {
      let s = states[inode] ?? State()
      return s.dirtyHandles > 0 ? nil : s.generation
    }
  }

  /// True if no write happened since `beginSnapshot` returned `token`.
  public func isSnapshotIntact(_ inode: Int64, _ token: UInt64) -> Bool {
    lock.withLock {
      let s = states[inode] ?? State()
      return s.dirtyHandles == 0 && s.generation == token
    }
  }

  public func forget(_ inode: Int64) {
    lock.withLock { if states[inode]?.writers ?? 0 == 0 { states.removeValue(forKey: inode) } }
  }
}
