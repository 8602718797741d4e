import Foundation
import Logging
import ServiceLifecycle
import UbiqCloud
import UbiqCloudAPI

/// How `ubiqfs serve` collects garbage: how often, and how long an unreferenced chunk is kept.
public struct CollectionSchedule: Sendable {
  /// Seconds between passes; nil: no passes (`ubiqfs server gc` still runs one).
  public var interval: Int64?
  /// Seconds a chunk no item refers to is kept after its last use (upload, a missing-chunks
  /// query that found it, a commit that referred to it): covers uploads in flight.
  public var grace: Int64

  /// Seconds from the server's start to its first pass: soon, so that a server restarted more
  /// often than `interval` still collects.
  public var firstPassAfter: Int64

  public init(interval: Int64? = 6 * 3600, grace: Int64 = 24 * 3600, firstPassAfter: Int64 = 60) {
    self.interval = interval
    self.grace = grace
    self.firstPassAfter = firstPassAfter
  }
}

/// The server's garbage collector: a first pass `schedule.firstPassAfter` seconds after the
/// start, then one every `schedule.interval` seconds, each over every account (`CloudEngine.collectGarbage`). Owns nothing but its loop; several server processes
/// over one database may each run one (passes are idempotent). Stops on graceful shutdown.
public struct ChunkCollector: Service {
  let backend: Backend
  let schedule: CollectionSchedule
  let log: Logger

  public init(backend: Backend, schedule: CollectionSchedule, logger: Logger) {
    self.backend = backend
    self.schedule = schedule
    self.log = logger
  }

  public func run() async throws {
    guard let interval = schedule.interval else {
      // A service that returns would stop the group: wait for the shutdown instead.
      try? await gracefulShutdown()
      return
    }
    await cancelWhenGracefulShutdown {
      var wait = min(self.schedule.firstPassAfter, interval)
      while !Task.isCancelled {
        do { try await Task.sleep(for: .seconds(wait)) } catch { return }
        await self.pass()
        wait = interval
      }
    }
  }

  /// One pass over every account; a failing account is logged and the next one tried.
  func pass() async {
    let accounts: [String]
    do { accounts = try await backend.metadata.accounts() } catch {
      log.warning("garbage collection: cannot list accounts: \(error)")
      return
    }
    for account in accounts {
      do {
        let collected = try await backend.engine(account: account).collectGarbage(grace: schedule.grace)
        if collected.chunks > 0 {
          log.info("garbage collection: \(account): \(collected.chunks) chunks, \(collected.bytes) bytes freed")
        }
        if let failure = collected.failure {
          log.warning(
            "garbage collection of \(account): \(collected.undeleted) chunks not deleted (the next pass retries): \(failure)"
          )
        }
      } catch {
        log.warning("garbage collection of \(account) failed (the next pass retries): \(error)")
      }
    }
  }
}
