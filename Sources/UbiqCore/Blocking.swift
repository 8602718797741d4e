import Foundation

/// Runs async work from synchronous code and waits for it. Only for threads outside Swift's
/// cooperative pool (the main thread, FUSE worker threads), never from inside a Task.
public func runBlocking<T>(_ body: @escaping @Sendable () async throws -> T) throws -> T {
  let sem = DispatchSemaphore(value: 0)
  nonisolated(unsafe) var result: Result<T, Error>!
  Task.detached {
    do { result = .success(try await body()) } catch { result = .failure(error) }
    sem.signal()
  }
  sem.wait()
  return try result.get()
}
