import Foundation
import UbiqCore

/// A file of `bytes` kept in the state folder so that what frees room (removing, renaming,
/// truncating) can still be recorded when the folder's disk is full: a full ext4 lets a user
/// delete a file, and the mount must too, or space taken through the mount could not be given
/// back through it. When an index transaction of such a change finds the disk full, the reserve
/// is released and the transaction tried again; the reserve is made again once the disk has
/// room (`keep`). Owns that one file; safe to use from any thread (one lock).
public final class SpaceReserve: @unchecked Sendable {
  public let path: String
  public let bytes: Int64
  /// The reserve is made only while the disk has this much room besides: it never fills a disk.
  public var roomNeeded: Int64 { bytes * 4 }
  private let lock = NSLock()

  /// The reserve of the state folder `folder` (its `space-reserve` file).
  public init(folder: String, bytes: Int64 = 4 << 20) {
    self.path = folder + "/space-reserve"
    self.bytes = bytes
  }

  /// Room the disk has for new blocks, or nil if it cannot be read.
  func freeBytes() -> Int64? {
    var sv = statvfs()
    guard statvfs((path as NSString).deletingLastPathComponent, &sv) == 0 else { return nil }
    return Int64(sv.f_bavail) * Int64(sv.f_frsize)
  }

  /// Makes the reserve if it is missing and the disk has room for it. Returns whether it is there.
  @discardableResult
  public func keep() -> Bool {
    lock.withLock {
      var st = stat()
      if stat(path, &st) == 0 && Int64(st.st_blocks) * 512 >= bytes { return true }
      guard let free = freeBytes(), free >= roomNeeded else { return false }
      let fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0o600)
      guard fd >= 0 else { return false }
      defer { close(fd) }
      guard posix_fallocate(fd, 0, off_t(bytes)) == 0, fsync(fd) == 0 else {
        unlink(path)
        return false
      }
      return true
    }
  }

  /// Releases the reserve if the disk has less room than it holds (a mount starting on a full
  /// disk: what it records at its start, and the removals that follow, need the room).
  /// Returns whether it did.
  @discardableResult
  public func releaseIfDiskIsFull() -> Bool {
    guard let free = freeBytes(), free < bytes else { return false }
    return release()
  }

  /// Gives the reserve's room back to the disk. Returns whether there was a reserve to give.
  public func release() -> Bool {
    lock.withLock { unlink(path) == 0 }
  }
}
