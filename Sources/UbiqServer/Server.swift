import Foundation
import Hummingbird
import HummingbirdCore
import HummingbirdTLS
import Logging
import NIOCore
import NIOSSL
import ServiceLifecycle
import UbiqCloud
import UbiqCloudAPI
import UbiqCore

/// What `ubiqfs serve` runs with.
public struct ServeOptions: Sendable {
  public var host: String
  public var port: Int
  public var storage: StorageConfig
  public var limits = ServerLimits()
  /// Serve HTTPS with this certificate chain and private key (PEM files); nil: plain HTTP.
  public var tls: TLSFiles?
  /// When unreferenced chunks are collected.
  public var collection = CollectionSchedule()

  public init(host: String, port: Int, storage: StorageConfig) {
    self.host = host
    self.port = port
    self.storage = storage
  }
}

/// The PEM files `serve --tls-cert --tls-key` names.
public struct TLSFiles: Sendable {
  public var certificateChain: String
  public var privateKey: String

  public init(certificateChain: String, privateKey: String) {
    self.certificateChain = certificateChain
    self.privateKey = privateKey
  }

  /// Reads both files; an unreadable or malformed file is `CloudError.invalid` naming it.
  public func configuration() throws -> TLSConfiguration {
    let chain: [NIOSSLCertificate]
    do { chain = try NIOSSLCertificate.fromPEMFile(certificateChain) } catch {
      throw CloudError.invalid("cannot read the certificate chain \(certificateChain): \(error)")
    }
    guard !chain.isEmpty else { throw CloudError.invalid("no certificate in \(certificateChain)") }
    let key: NIOSSLPrivateKey
    do { key = try NIOSSLPrivateKey(file: privateKey, format: .pem) } catch {
      throw CloudError.invalid("cannot read the private key \(privateKey): \(error)")
    }
    return TLSConfiguration.makeServerConfiguration(
      certificateChain: chain.map { .certificate($0) }, privateKey: .privateKey(key))
  }
}

/// `ubiqfs serve`: opens the storage engine, serves the HTTP API and `/metrics`, and shuts
/// down gracefully on SIGTERM/SIGINT (long-polls are released, in-flight requests finish,
/// then the engine is closed). Keeps no state of its own beyond the engine.
public enum UbiqServer {
  public static func run(_ options: ServeOptions, logger: Logger) async throws {
    // TLS files are read before the storage is opened, so a bad file fails at once.
    let http1 = HTTP1Channel.Configuration(idleTimeout: .seconds(options.limits.idleTimeoutSeconds))
    let server: HTTPServerBuilder =
      try options.tls.map { try .tls(.http1(configuration: http1), tlsConfiguration: $0.configuration()) }
      ?? .http1(configuration: http1)
    let scheme = options.tls == nil ? "http" : "https"
    let metrics = ServerMetrics()
    metrics.bootstrap()
    let openFiles = ServerLimits.raiseOpenFilesLimit()
    let connections = ServerLimits.connectionsServed(openFiles: openFiles)
    logger.info("storage: \(options.storage.summary)")
    logger.info("open files: \(openFiles); clients served at once: \(connections)")
    try await Backend.with(options.storage, logger: logger) { backend in
      let hub = ChangeHub(pollInterval: .milliseconds(options.limits.pollIntervalMs), logger: logger) {
        account, container in
        try await backend.metadata.lastChange(account: account, container: container)
      }
      let router = makeRouter(backend: backend, hub: hub, metrics: metrics, limits: options.limits)
      let app = Application(
        router: router,
        server: server,
        configuration: .init(
          address: .hostname(options.host, port: options.port), serverName: "ubiqfs",
          availableConnectionsDelegate: MaximumAvailableConnections(connections, logger: logger)),
        onServerRunning: { channel in
          let addr = channel.localAddress.map { "\($0.ipAddress ?? options.host):\($0.port ?? options.port)" }
          logger.notice("listening on \(scheme)://\(addr ?? "\(options.host):\(options.port)")")
        },
        logger: logger)
      // Shut down in reverse order: the hub releases long-polls first, then the HTTP server drains.
      let collector = ChunkCollector(backend: backend, schedule: options.collection, logger: logger)
      let group = ServiceGroup(
        services: [app, hub, collector], gracefulShutdownSignals: [.sigterm, .sigint], logger: logger)
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
