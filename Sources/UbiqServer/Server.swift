import Foundation
import Hummingbird
import Logging
import NIOCore
import ServiceLifecycle
import UbiqCloud
import UbiqCore

/// What `ubiqfs serve` runs with.
public struct ServeOptions: Sendable {
  public var host: String
  public var port: Int
  public var storage: StorageConfig
  public var limits = ServerLimits()

  public init(host: String, port: Int, storage: StorageConfig) {
    self.host = host
    self.port = port
    self.storage = storage
  }
}

/// `ubiqfs serve`: opens the storage engine, serves the HTTP API and `/metrics`, and shuts
/// down gracefully on SIGTERM/SIGINT (long-polls are released, in-flight requests finish,
/// then the engine is closed). Keeps no state of its own beyond the engine.
public enum UbiqServer {
  public static func run(_ options: ServeOptions, logger: Logger) async throws {
    let metrics = ServerMetrics()
    metrics.bootstrap()
    logger.info("storage: \(options.storage.summary)")
    try await Backend.with(options.storage, logger: logger) { backend in
      let hub = ChangeHub(pollInterval: .milliseconds(options.limits.pollIntervalMs), logger: logger) {
        account, container in
        try await backend.metadata.lastChange(account: account, container: container)
      }
      let router = makeRouter(backend: backend, hub: hub, metrics: metrics, limits: options.limits)
      let app = Application(
        router: router,
        configuration: .init(address: .hostname(options.host, port: options.port), serverName: "ubiqfs"),
        onServerRunning: { channel in
          let addr = channel.localAddress.map { "\($0.ipAddress ?? options.host):\($0.port ?? options.port)" }
          logger.notice("listening on http://\(addr ?? "\(options.host):\(options.port)")")
        },
        logger: logger)
      // Shut down in reverse order: the hub releases long-polls first, then the HTTP server drains.
      let group = ServiceGroup(services: [app, hub], gracefulShutdownSignals: [.sigterm, .sigint], logger: logger)
      try await group.run()
    }
    logger.info("stopped")
  }

  /// The whole HTTP surface: `/healthz`, `/metrics` (no auth) and the `/v1` API.
  public static func makeRouter(backend: Backend, hub: ChangeHub, metrics: ServerMetrics, limits: ServerLimits)
    -> Router<UbiqRequestContext>
  {
    let router = Router(context: UbiqRequestContext.self)
    router.add(middleware: ErrorMiddleware())
    router.add(middleware: MetricsMiddleware())
    router.get("healthz") { _, _ in
      Response(
        status: .ok, headers: [.contentType: "text/plain"], body: .init(byteBuffer: ByteBuffer(string: "ok\n")))
    }
    router.get("metrics") { _, _ in
      Response(
        status: .ok, headers: [.contentType: "text/plain; version=0.0.4; charset=utf-8"],
        body: .init(byteBuffer: ByteBuffer(string: metrics.render())))
    }
    APIRoutes(backend: backend, hub: hub, metrics: metrics, limits: limits).register(on: router)
    return router
  }
}
