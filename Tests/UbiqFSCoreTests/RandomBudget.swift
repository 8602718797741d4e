import Foundation
import Testing

/// How much of one randomized test runs: at most `cases` sequences, and no new sequence after
/// `seconds` of wall time, so CI spends a fixed time on it whatever the machine's speed, while
/// `scripts/soak.sh` lifts the time limit and sets the count. Once a sequence has failed, every
/// later one runs, so the checker's shrinking of a failure is never cut short. Owns the clock,
/// the counts and the failure flag of its test.
final class RandomBudget: @unchecked Sendable {
  let cases: Int
  let seconds: Double
  /// When the first sequence started; the time budget counts from there.
  private var started: ContinuousClock.Instant?
  private let lock = NSLock()
  private var ran = 0
  private var failed = false

  /// `cases` and `seconds` come from the environment variables named, or the defaults.
  init(
    cases casesVariable: String, default defaultCases: Int, seconds secondsVariable: String,
    default defaultSeconds: Double
  ) {
    let env = ProcessInfo.processInfo.environment
    cases = env[casesVariable].flatMap { Int($0) } ?? defaultCases
    seconds = env[secondsVariable].flatMap { Double($0) } ?? defaultSeconds
  }

  private init(cases: Int, seconds: Double) {
    self.cases = cases
    self.seconds = seconds
  }

  /// A new budget for another test: shares of this one's cases (at least `minimum`) and time.
  func share(cases caseShare: Double, seconds secondsShare: Double, atLeast minimum: Int) -> RandomBudget {
    RandomBudget(cases: max(minimum, Int(Double(cases) * caseShare)), seconds: seconds * secondsShare)
  }

  /// Whether the next sequence runs (counting it when it does).
  func startSequence() -> Bool {
    lock.withLock {
      let now = ContinuousClock.now
      if started == nil { started = now }
      let elapsed = now - started!
      guard failed || elapsed < .seconds(seconds) else { return false }
      ran += 1
      return true
    }
  }

  func recordFailure() { lock.withLock { failed = true } }

  /// What ran, for the test's log: the count, the time and whether the time ran out.
  var summary: String {
    lock.withLock {
      let elapsed = started.map { ContinuousClock.now - $0 } ?? .zero
      let out = ran < cases && !failed ? ", stopped by the time budget" : ""
      return "\(ran) of \(cases) sequences in \(elapsed.formatted(.units(allowed: [.seconds])))\(out)"
    }
  }
}
