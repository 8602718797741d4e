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

  public func acquire(_ bytes: Int) async {
    guard bytesPerSecond > 0 else { return }
    let cost = UInt64(Double(bytes) / Double(bytesPerSecond) * 1e9)
    let wait: UInt64 = lock.withLock {
      let now = Clock.monotonicNs()
      let start = max(now, nextFreeNs)
      nextFreeNs = start + cost
      return start > now ? start - now : 0
    }
    if wait > 0 { try? await Task.sleep(nanoseconds: wait) }
  }
}
