import Foundation
import Hummingbird
import Logging
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqHTTPClient
import UbiqServer

/// `ubiqfs serve`'s router over an embedded backend in a folder of its own, served in this
/// process on a loopback port until `stop`. Owns the server's tasks and the backend's lifetime.
final class LoopbackServer: @unchecked Sendable {
  let url: String
  let backend: Backend
  private let stopSignal: AsyncStream<Void>.Continuation
  /// Signalled when the server and its backend are closed; nil once `stop` has waited for it.
  private var stopped: DispatchSemaphore?

  private init(url: String, backend: Backend, stopSignal: AsyncStream<Void>.Continuation, stopped: DispatchSemaphore) {
    self.url = url
    self.backend = backend
    self.stopSignal = stopSignal
    self.stopped = stopped
  }

  /// Starts the server and waits until it listens. Call from a thread outside Swift's pool.
  static func start(directory: URL) throws -> LoopbackServer {
    var log = Logger(label: "loopback-server")
    log.logLevel = .critical
    let logger = log
    let (ready, readySink) = AsyncStream.makeStream(of: Result<(Int, Backend), Error>.self)
    let (stop, stopSink) = AsyncStream.makeStream(of: Void.self)
    let done = DispatchSemaphore(value: 0)
    Task.detached {
      defer { done.signal() }
      do {
        try await Backend.with(.embedded(directory: directory), logger: logger) { backend in
          let hub = ChangeHub(pollInterval: .milliseconds(100), logger: logger) { a, c in
            try await backend.metadata.lastChange(account: a, container: c)
          }
          let router = UbiqServer.makeRouter(
            backend: backend, hub: hub, metrics: ServerMetrics(), limits: ServerLimits())
          let app = Application(
            router: router, configuration: .init(address: .hostname("127.0.0.1", port: 0)),
            onServerRunning: { readySink.yield(.success(($0.localAddress?.port ?? 0, backend))) }, logger: logger)
          try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await app.run() }
            group.addTask { try await hub.run() }
            for await _ in stop { break }
            group.cancelAll()
          }
        }
      } catch {
        readySink.yield(.failure(error))
      }
      readySink.finish()
    }
    let first = try runBlocking { () -> Result<(Int, Backend), Error>? in
      var it = ready.makeAsyncIterator()
      return await it.next()
    }
    guard case .success(let (port, backend))? = first else {
      stopSink.finish()
      done.wait()
      if case .failure(let error)? = first { throw error }
      throw CloudError.unavailable("the loopback server did not start")
    }
    return LoopbackServer(url: "http://127.0.0.1:\(port)", backend: backend, stopSignal: stopSink, stopped: done)
  }

  /// A new device of `account` (created with a setup token if it does not exist): its cloud.
  func device(of account: String, named name: String) throws -> CloudService {
    let url = self.url
    let backend = self.backend
    return try runBlocking {
      let setup: String
      if try await backend.metadata.accountExists(account) {
        setup = try await backend.issueToken(account: account, device: "setup", scope: .account).0
      } else {
        setup = try await backend.createAccount(account, quotaBytes: 0, device: "setup").0
      }
      let issued = try await AccountAPI(api: try APIClient(baseURL: url, token: setup)).registerDevice(name: name)
      return HTTPCloud(api: try APIClient(baseURL: url, token: issued.token))
    }
  }

  /// Stops serving and closes the backend; returns when both are done.
  func stop() {
    stopSignal.yield()
    stopSignal.finish()
    stopped?.wait()
    stopped = nil
  }

  deinit { stop() }
}
