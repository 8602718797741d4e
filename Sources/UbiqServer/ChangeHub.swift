import Foundation
import Logging
import ServiceLifecycle

/// The push channel's waiting room. Long-poll requests wait here until their container's
/// change sequence passes their token. Commits made by this process wake waiters at once;
/// commits made by other server processes over the same database are seen by one shared
/// poll per waited-on container every `pollInterval`. On graceful shutdown every waiter is
/// released (answering "no change") so in-flight long-polls do not hold the shutdown up.
public actor ChangeHub: Service {
  struct Key: Hashable, Sendable {
    var account: String
    var container: String
  }
  struct Waiter {
    var since: Int64
    var continuation: CheckedContinuation<Int64?, Never>
  }

  private var waiters: [Key: [UInt64: Waiter]] = [:]
  private var nextID: UInt64 = 0
  /// Registered ids not parked yet; an id released before it parks is dropped from here.
  private var pending: Set<UInt64> = []
  private var closed = false
  let pollInterval: Duration
  let lastChange: @Sendable (String, String) async throws -> Int64
  let log: Logger

  public init(
    pollInterval: Duration, logger: Logger, lastChange: @escaping @Sendable (String, String) async throws -> Int64
  ) {
    self.pollInterval = pollInterval
    self.lastChange = lastChange
    self.log = logger
  }

  public var waiting: Int { waiters.values.reduce(0) { $0 + $1.count } }

  /// Waits until the container's sequence passes `since` (returns true and the new token)
  /// or `timeout` passes (false and the current token).
  public nonisolated func wait(account: String, container: String, since: Int64, timeout: Duration) async throws
    -> (changed: Bool, token: Int64)
  {
    let current = try await lastChange(account, container)
    if current > since || timeout <= .zero { return (current > since, current) }
    let key = Key(account: account, container: container)
    let id = await register()
    let token: Int64? = await withTaskGroup(of: Int64?.self) { group in
      group.addTask { await self.park(key, id, since) }
      group.addTask {
        try? await Task.sleep(for: timeout)
        return nil
      }
      let first = await group.next() ?? nil
      await self.release(key, id)
      group.cancelAll()
      while let more = await group.next() { _ = more }
      return first
    }
    if let token { return (true, token) }
    return (false, (try? await lastChange(account, container)) ?? current)
  }

  private func register() -> UInt64 {
    nextID += 1
    pending.insert(nextID)
    return nextID
  }

  private func park(_ key: Key, _ id: UInt64, _ since: Int64) async -> Int64? {
    guard pending.remove(id) != nil, !closed else { return nil }
    return await withCheckedContinuation { cont in
      waiters[key, default: [:]][id] = Waiter(since: since, continuation: cont)
    }
  }

  /// Resumes a waiter that is still parked (timeout, cancellation) with "no change".
  private func release(_ key: Key, _ id: UInt64) {
    pending.remove(id)
    if let w = waiters[key]?.removeValue(forKey: id) { w.continuation.resume(returning: nil) }
    if waiters[key]?.isEmpty == true { waiters[key] = nil }
  }

  /// A commit on this process moved the container to `seq`.
  public func notify(account: String, container: String, seq: Int64) {
    fire(Key(account: account, container: container), seq)
  }

  private func fire(_ key: Key, _ seq: Int64) {
    guard var list = waiters[key] else { return }
    for (id, w) in list where seq > w.since {
      w.continuation.resume(returning: seq)
      list[id] = nil
    }
    waiters[key] = list.isEmpty ? nil : list
  }

  private func closeAll() {
    closed = true
    for (_, list) in waiters { for (_, w) in list { w.continuation.resume(returning: nil) } }
    waiters = [:]
  }

  /// Polls the store for changes made by other processes while anyone waits.
  public func run() async throws {
    await withGracefulShutdownHandler {
      while !Task.isCancelled && !closed {
        try? await Task.sleep(for: pollInterval)
        for key in Array(waiters.keys) {
          do {
            let seq = try await lastChange(key.account, key.container)
            fire(key, seq)
          } catch {
            log.warning("change poll for \(key.container) failed: \(error)")
          }
        }
      }
    } onGracefulShutdown: {
      Task { await self.closeAll() }
    }
    closeAll()
  }
}
