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

  /// Open files kept for the server's own use (databases, logs, the PostgreSQL and S3
  /// connections) whatever the number of clients.
  static let reservedOpenFiles = 64

  /// The clients served at once with `openFiles` descriptors: each takes its connection's and
  /// at most one more (a chunk file being read or written). The others wait in the listen
  /// queue until one leaves; the server never accepts a connection it has no descriptor for
  /// (accept's EMFILE would repeat at once, a core spent on nothing for as long as they wait).
  static func connectionsServed(openFiles: Int) -> Int {
    max(8, (openFiles - reservedOpenFiles) / 2)
  }

  /// Raises this process's open-files limit to its hard limit (a server is meant to serve many
  /// clients; a shell's default soft limit is often 1024) and returns the limit in force.
  static func raiseOpenFilesLimit() -> Int {
    var limit = rlimit()
    guard getrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return 1024 }
    if limit.rlim_cur < limit.rlim_max {
      var raised = limit
      raised.rlim_cur = limit.rlim_max
      if setrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &raised) == 0 { limit = raised }
    }
    return Int(clamping: min(limit.rlim_cur, rlim_t(Int.max / 4)))
  }
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
