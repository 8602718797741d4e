import Foundation

/// Tracks, per inode, replacements of content that did not pass through the kernel (a remote
/// version replaced the cached bytes), so the kernel's page cache never serves the old bytes.
///
/// Invalidating the kernel's pages when the change is applied is not enough: a handle opened
/// before the change still reads the old cache file by descriptor (POSIX: it keeps the bytes it
/// opened), and such a read fills the shared page cache with old bytes again. So a handle
/// remembers the epoch it was opened in; a read through an older handle marks the inode, and
/// opens of it ask the kernel to drop its pages (`keep_cache` off) for a few seconds — not just
/// the next one, because the order in which the kernel, old handles and new opens act around a
/// replacement is not fully under our control. After that quiet period pages are kept again.
/// Sendable: `epochs` and `mustDrop` are guarded by `lock`.
final class PageCacheEpochs: @unchecked Sendable {
  private let lock = NSLock()
  private var epochs: [Int64: UInt64] = [:]
  /// Inodes whose opens must drop cached pages, until the given monotonic time.
  private var mustDrop: [Int64: UInt64] = [:]
  private let quietNs: UInt64 = 3_000_000_000

  private func now() -> UInt64 { DispatchTime.now().uptimeNanoseconds }

  /// The content of `inode` was replaced behind the kernel's back.
  func contentReplaced(_ inode: Int64) {
    lock.withLock {
      epochs[inode, default: 0] &+= 1
      mustDrop[inode] = now() + quietNs
    }
  }

  func current(_ inode: Int64) -> UInt64 { lock.withLock { epochs[inode] ?? 0 } }

  /// A read through a handle opened in `epoch`: if that is old, its bytes may now be in the page cache.
  func noteRead(_ inode: Int64, openedIn epoch: UInt64) {
    lock.withLock { if (epochs[inode] ?? 0) != epoch { mustDrop[inode] = now() + quietNs } }
  }

  /// At open: true if the kernel may keep the pages it has of `inode`.
  func mayKeepPages(_ inode: Int64) -> Bool {
    lock.withLock {
      guard let until = mustDrop[inode] else { return true }
      if now() < until { return false }
      mustDrop[inode] = nil
      return true
    }
  }

  func forget(_ inode: Int64) {
    lock.withLock {
      epochs[inode] = nil
      mustDrop[inode] = nil
    }
  }
}
