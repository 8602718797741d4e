import Foundation
import UbiqCloud
import UbiqCloudAPI

/// Bounds on what one request may send or ask for.
public struct ServerLimits: Sendable {
  /// A chunk body (the chunker's maximum is 4 MiB).
  public var maxChunkBytes = 8 << 20
  /// Item records, missing-chunk queries, device requests.
  public var maxJSONBytes = 16 << 20
  /// Key-value writes (the whole store is at most 1 MiB).
  public var maxKVBodyBytes = 2 << 20
  /// Longest long-poll a client may ask for.
  public var maxWaitMs = 60_000
  /// How often waiting long-polls look for commits made by other server processes.
  public var pollIntervalMs = 200
  /// Long-polls one token may have waiting at once; one more gets 429 `too_many_requests`.
  public var maxLongPollsPerToken = 8
  /// Seconds a connection may send nothing (no request, or a request part way) before it is
  /// closed. A request being answered (a long-poll) is not idle. Longer than the client's idle
  /// pool time (20 s), so a client never sends on a connection the server is closing.
  public var idleTimeoutSeconds: Int64 = 30
  /// What one account may hold (containers, items) and the size of a change page.
  public var cloud = CloudLimits()
  public init() {}
}

/// The long-polls waiting per token, for `ServerLimits.maxLongPollsPerToken`.
/// Sendable: `waiting` is guarded by `lock`.
final class LongPollCounter: @unchecked Sendable {
  private let lock = NSLock()
  private var waiting: [String: Int] = [:]

  /// Counts one more long-poll of `token`, unless it has `limit` already (false).
  func enter(_ token: String, limit: Int) -> Bool {
    lock.withLock {
      let n = waiting[token, default: 0]
      if n >= limit { return false }
      waiting[token] = n + 1
      return true
    }
  }

  func leave(_ token: String) {
    lock.withLock {
      let n = waiting[token, default: 1] - 1
      waiting[token] = n > 0 ? n : nil
    }
  }
}
