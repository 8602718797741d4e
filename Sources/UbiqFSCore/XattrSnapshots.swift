import Foundation

/// Remembers, for a few seconds, the value whose size a caller just asked for (`getxattr` or
/// `listxattr` with size 0), so that the follow-up call with a buffer of that size gets the same
/// bytes even if a computed status value (`percent_uploaded` 0 → 100, a newly assigned `etag`)
/// has grown in between. Without it, `rsync -X` and `getfattr` see a spurious ERANGE.
/// Sendable: `entries` is guarded by `lock`.
final class XattrSnapshots: @unchecked Sendable {
  private struct Key: Hashable {
    let inode: UInt64
    let name: String
  }
  private struct Entry {
    let value: Data
    let taken: Date
  }
  private let lock = NSLock()
  private var entries: [Key: Entry] = [:]
  private let lifetime: TimeInterval = 10
  private let capacity = 4096

  /// Records `value` as the answer to a size query for (`inode`, `name`).
  func remember(_ inode: UInt64, _ name: String, _ value: Data) {
    lock.withLock {
      if entries.count >= capacity { prune(now: Date()) }
      if entries.count >= capacity { entries.removeAll(keepingCapacity: true) }
      entries[Key(inode: inode, name: name)] = Entry(value: value, taken: Date())
    }
  }

  /// The bytes to answer a call with a `size`-byte buffer: a recent snapshot that fits (taken
  /// by the size query this call follows: the caller expects exactly that length, and
  /// `rsync -X` fails when a value shrank in between), else `current` if it fits, else nil
  /// (ERANGE).
  func fitting(_ inode: UInt64, _ name: String, current: Data, size: Int) -> Data? {
    lock.withLock {
      let key = Key(inode: inode, name: name)
      let snapshot = entries.removeValue(forKey: key)
      if let s = snapshot, Date().timeIntervalSince(s.taken) < lifetime, s.value.count <= size { return s.value }
      return current.count <= size ? current : nil
    }
  }

  private func prune(now: Date) {
    entries = entries.filter { now.timeIntervalSince($0.value.taken) < lifetime }
  }
}
