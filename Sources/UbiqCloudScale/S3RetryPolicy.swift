/// How often and how long a failed S3 request is tried again: full-jitter exponential backoff
/// (after failed attempt n the wait is uniform in [0, min(maxDelay, baseDelay·2^(n-1))]),
/// at most `maxAttempts` attempts, and no attempt starts once `totalBudget` has passed since
/// the first one began (the time the attempts themselves take counts too).
public struct S3RetryPolicy: Sendable {
  public var maxAttempts: Int
  public var baseDelay: Duration
  public var maxDelay: Duration
  public var totalBudget: Duration

  public init(
    maxAttempts: Int = 5, baseDelay: Duration = .milliseconds(100), maxDelay: Duration = .seconds(2),
    totalBudget: Duration = .seconds(10)
  ) {
    self.maxAttempts = max(1, maxAttempts)
    self.baseDelay = baseDelay
    self.maxDelay = maxDelay
    self.totalBudget = totalBudget
  }

  /// The longest wait after failed attempt `attempt` (1-based): doubling from `baseDelay`,
  /// at most `maxDelay`.
  public func delayCeiling(afterAttempt attempt: Int) -> Duration {
    var d = baseDelay
    var n = 1
    while n < attempt && d < maxDelay {
      d = d * 2
      n += 1
    }
    return min(d, maxDelay)
  }

  /// Runs `operation` until it gives a result `isRetryable` refuses, or the attempts or the
  /// time run out; then returns that last result (or throws its error). `random` gives the
  /// jitter fraction in [0, 1]; `now` and `sleep` are the clock.
  public func run<T>(
    isRetryable: (Result<T, any Error>) -> Bool,
    random: () -> Double = { Double.random(in: 0...1) },
    now: () -> ContinuousClock.Instant = { ContinuousClock.now },
    sleep: (Duration) async throws -> Void = { try await Task.sleep(for: $0) },
    _ operation: () async throws -> T
  ) async throws -> T {
    let start = now()
    var attempt = 1
    while true {
      let result: Result<T, any Error>
      do { result = .success(try await operation()) } catch { result = .failure(error) }
      guard attempt < maxAttempts, isRetryable(result) else { return try result.get() }
      let delay = delayCeiling(afterAttempt: attempt) * min(1, max(0, random()))
      guard now() + delay - start < totalBudget else { return try result.get() }
      try await sleep(delay)
      attempt += 1
    }
  }
}
