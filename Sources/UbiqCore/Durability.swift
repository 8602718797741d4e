import Foundation

#if canImport(Glibc)
  import Glibc
#endif

/// The one way a folder's entries are made durable, for every layer that creates, renames or
/// removes names it must not lose to a power loss (the content cache, the index's WAL, the
/// embedded cloud's blobs). Owns no state.
public enum Durability {
  /// fsync of a directory: its entries (created, renamed, removed names) become durable.
  public static func fsyncDirectory(_ path: String) throws {
    let fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    guard fd >= 0 else { throw UbiqError.posix(errno, "open of \(path) to fsync it") }
    defer { close(fd) }
    if fsync(fd) != 0 { throw UbiqError.posix(errno, "fsync of \(path)") }
  }
}
