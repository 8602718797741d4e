import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// The local content cache: one file per inode under `<state>/content/`. Owns the naming and the
/// creation/removal of those files; the filesystem reads and writes them through file descriptors.
/// Sendable: `namesChanged` is guarded by `lock`; `syncLock` orders the folder's fsyncs; a file's
/// name changes only under its inode lock.
public final class ContentCache: @unchecked Sendable {
  public let directory: String
  /// Makes the folder's entries durable: `Durability.fsyncDirectory` (tests slow it down).
  let syncFolder: @Sendable (String) throws -> Void

  public convenience init(directory: String) throws {
    try self.init(directory: directory, syncFolder: Durability.fsyncDirectory)
  }

  init(directory: String, syncFolder: @escaping @Sendable (String) throws -> Void) throws {
    self.directory = directory
    self.syncFolder = syncFolder
    try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
  }

  public func path(_ inode: Int64) -> String { "\(directory)/\(inode)" }

  /// Names created or removed since the folder's last fsync began.
  private var namesChanged = true
  private let lock = NSLock()
  /// Held across a folder fsync, so a caller that finds nothing changed since the last fsync
  /// began also finds that fsync finished.
  private let syncLock = NSLock()

  /// Opens (creating if asked) the cache file of `inode` read-write.
  public func open(_ inode: Int64, create: Bool) throws -> Int32 {
    let fd = Glibc.open(path(inode), O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0o600)
    if fd < 0 { throw UbiqError.io("cache file for inode \(inode): \(String(cString: strerror(errno)))") }
    if create { lock.withLock { namesChanged = true } }
    return fd
  }

  public func exists(_ inode: Int64) -> Bool { access(path(inode), F_OK) == 0 }

  /// What stands for the content of a file the index says is cached.
  public enum CachedContent: Equatable, Sendable {
    /// The cache file.
    case file
    /// An empty file without a cache file: its content is known without one (an empty file
    /// that arrived from the cloud, or was made here and never written, gets its cache file
    /// only when something opens it or writes to it).
    case emptyWithoutFile
    /// The cache file of a non-empty file is gone (a crash, a hand removal).
    case missing
  }

  /// The one rule for a cached file's content on disk: a missing cache file is an empty file's
  /// content when the file is empty, and lost content otherwise.
  public func cachedContent(_ inode: Int64, size: Int64) -> CachedContent {
    if exists(inode) { return .file }
    return size == 0 ? .emptyWithoutFile : .missing
  }

  /// Removes the cache file of `inode`, if there is one (an empty file may have none).
  public func remove(_ inode: Int64) {
    guard unlink(path(inode)) == 0 else { return }
    lock.withLock { namesChanged = true }
  }

  /// Makes the folder's entries durable (a new cache file's name survives a power loss), if
  /// any changed since the last call. Called before an index commit that relies on them is made
  /// durable or refers to a new cache file's bytes.
  public func syncDirectory() throws {
    try syncLock.withLock {
      let changed = lock.withLock {
        defer { namesChanged = false }
        return namesChanged
      }
      guard changed else { return }
      do {
        try syncFolder(directory)
      } catch {
        lock.withLock { namesChanged = true }
        throw error
      }
    }
  }

  /// Bytes the cache file really occupies on disk.
  public func allocatedBytes(_ inode: Int64) -> Int64 {
    var st = stat()
    guard stat(path(inode), &st) == 0 else { return 0 }
    return Int64(st.st_blocks) * 512
  }
}
