import Foundation

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
  public init() {}
}
