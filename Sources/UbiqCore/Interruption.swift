import Foundation

/// The cancellation of one filesystem request by its caller: the kernel forwards a signal that
/// interrupted the system call (FUSE_INTERRUPT). Waits that honour it end with
/// `UbiqError.interrupted` (EINTR). Owns a flag and the wake-ups of the waits that watch it,
/// both guarded by `lock`.
public final class Interruption: @unchecked Sendable {
  private let lock = NSLock()
  private var fired = false
  private var wakeUps: [Int: @Sendable () -> Void] = [:]
  private var nextKey = 0

  public init() {}

  public var isInterrupted: Bool { lock.withLock { fired } }

  /// Marks the request interrupted and wakes every wait that watches it.
  public func interrupt() {
    let wake = lock.withLock { () -> [@Sendable () -> Void] in
      if fired { return [] }
      fired = true
      defer { wakeUps = [:] }
      return Array(wakeUps.values)
    }
    for w in wake { w() }
  }

  /// Runs `body` (a wait) with `wake` called if the request is interrupted meanwhile, or at once
  /// if it already was. `wake` must make the wait look at `isInterrupted` again.
  public func watching<T>(wake: @escaping @Sendable () -> Void, _ body: () throws -> T) rethrows -> T {
    let key = lock.withLock { () -> Int? in
      if fired { return nil }
      nextKey += 1
      wakeUps[nextKey] = wake
      return nextKey
    }
    if key == nil { wake() }
    defer { if let key { _ = lock.withLock { wakeUps.removeValue(forKey: key) } } }
    return try body()
  }
}
