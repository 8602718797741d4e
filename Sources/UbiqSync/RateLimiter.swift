import Foundation
import UbiqCore

/// A bandwidth cap shared by all transfers of one kind (e.g. downloads): callers ask before
/// moving `bytes` and are delayed so the average stays at `bytesPerSecond`.
/// Sendable: `nextFreeNs` is guarded by `lock`.
public final class RateLimiter: @unchecked Sendable {
  public let bytesPerSecond: Int64
  private let lock = NSLock()
  private var nextFreeNs: UInt64 = 0

  public init(bytesPerSecond: Int64) { self.bytesPerSecond = bytesPerSecond }

  /// Books the link for `bytes` and returns the monotonic time the transfer may start: now if
  /// the link is free, else when the transfers booked before have had their share. A transfer
  /// pays for itself in the wait of the next one (the first after a quiet spell goes at once).
  public func reserve(_ bytes: Int) -> UInt64 {
    let now = Clock.monotonicNs()
    guard bytesPerSecond > 0 else { return now }
    let cost = UInt64(min(Double(UInt64.max / 2), max(0, Double(bytes)) / Double(bytesPerSecond) * 1e9))
    return lock.withLock {
      let start = max(now, nextFreeNs)
      nextFreeNs = start.addingReportingOverflow(cost).overflow ? UInt64.max : start + cost
      return start
    }
  }

  /// Waits until a transfer of `bytes` may start (`reserve`).
  public func acquire(_ bytes: Int) async {
    let start = reserve(bytes)
    let now = Clock.monotonicNs()
    if start > now { try? await Task.sleep(nanoseconds: start - now) }
  }
}
