import AsyncHTTPClient
import Foundation
import Logging
import UbiqCloud
import UbiqCloudAPI
import UbiqCloudScale
import UbiqCore

/// Which storage engine a server (or an admin command) uses.
public enum StorageConfig: Sendable {
  /// SQLite metadata and a blob folder in one directory (the default).
  case embedded(directory: URL)
  /// PostgreSQL metadata and chunks in an S3-compatible bucket; any number of servers may share them.
  case scaleOut(postgresURL: String, s3: S3Config)

  public var summary: String {
    switch self {
    case .embedded(let dir): return "embedded (SQLite + blob folder in \(dir.path))"
    case .scaleOut(let url, let s3):
      let safe =
        (URLComponents(string: url).map { c -> String in
          var c = c
          if c.password != nil { c.password = "***" }
          return c.string ?? "postgres://..."
        }) ?? "postgres://..."
      return "scale-out (PostgreSQL \(safe), S3 \(s3.endpoint)/\(s3.bucket))"
    }
  }
}

/// The opened stores of one engine. Owns their lifetimes: PostgreSQL's connection pool runs
/// and the S3 HTTP client lives exactly as long as `Backend.with`'s body.
public struct Backend: Sendable {
  public let metadata: ServerMetadataStore
  public let blobs: BlobStore

  /// Opens the engine (creating the schema and bucket if needed), runs `body`, closes it.
  public static func with<T: Sendable>(
    _ config: StorageConfig, logger: Logger, _ body: @Sendable (Backend) async throws -> T
  ) async throws -> T {
    switch config {
    case .embedded(let dir):
      try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
      let meta = try SQLiteMetadataStore(path: dir.appendingPathComponent("cloud.sqlite").path)
      let blobs = try FolderBlobStore(root: dir.appendingPathComponent("blobs"))
      return try await body(Backend(metadata: meta, blobs: blobs))
    case .scaleOut(let url, let s3):
      // The pool's own chatter (e.g. a lease racing run() at start-up) stays out of the log;
      // failures still surface as errors of the queries that hit them.
      var poolLogger = logger
      poolLogger.logLevel = .error
      let store = try PostgresMetadataStore(url: url, logger: poolLogger, messages: logger)
      try await PostgresMetadataStore.probe(url: url, logger: poolLogger)
      let http = HTTPClient(
        eventLoopGroupProvider: .singleton,
        configuration: .init(timeout: .init(connect: .seconds(5), read: .seconds(60))))
      do {
        let result = try await withThrowingTaskGroup(of: Void.self) { group in
          group.addTask { await store.client.run() }
          defer { group.cancelAll() }
          try await store.migrate()
          let blobs = try S3BlobStore(config: s3, http: http)
          try await blobs.ensureBucket()
          return try await body(Backend(metadata: store, blobs: blobs))
        }
        try await http.shutdown()
        return result
      } catch {
        try? await http.shutdown()
        throw error
      }
    }
  }

  /// An engine bound to one account.
  public func engine(account: String) -> CloudEngine {
    CloudEngine(account: account, metadata: metadata, blobs: blobs)
  }

  /// The longest lifetime a token may be given (10 years), in seconds.
  public static let maxTokenLifetime: Int64 = 10 * 365 * 86400

  /// Creates an account and its first token, an account token; returns the token (shown once,
  /// stored hashed).
  public func createAccount(_ name: String, quotaBytes: Int64, device: String) async throws -> (String, TokenRecord) {
    try AccountName.validate(name)
    try await metadata.createAccount(name, quotaBytes: quotaBytes)
    return try await issueToken(account: name, device: device, scope: .account)
  }

  /// A new token for a device of an existing account, expiring `expiresIn` seconds from now
  /// (1 s to `maxTokenLifetime`) if given.
  public func issueToken(account: String, device: String, scope: TokenScope, expiresIn: Int64? = nil) async throws
    -> (String, TokenRecord)
  {
    try AccountName.validateDevice(device)
    if let expiresIn, !(1...Self.maxTokenLifetime).contains(expiresIn) {
      throw CloudError.invalid("a token's lifetime must be 1 to \(Self.maxTokenLifetime) seconds")
    }
    guard try await metadata.accountExists(account) else { throw CloudError.notFound("account \(account)") }
    let token = BearerToken.generate()
    let now = Int64(Date().timeIntervalSince1970)
    let record = TokenRecord(
      id: BearerToken.newID(), account: account, device: device, createdAt: now, scope: scope,
      expiresAt: expiresIn.map { now + $0 })
    try await metadata.addToken(record, tokenHash: BearerToken.hash(token))
    return (token, record)
  }

  /// Swaps a live token for a new one with the same id, device, scope and expiry: the old
  /// token stops working at once. Returns the new token (shown once).
  public func rotateToken(_ record: TokenRecord, oldHash: String) async throws -> (String, TokenRecord) {
    let token = BearerToken.generate()
    guard
      try await metadata.rotateToken(
        account: record.account, id: record.id, oldHash: oldHash, newHash: BearerToken.hash(token))
    else { throw CloudError.unauthorized("the token was revoked or rotated meanwhile") }
    return (token, record)
  }
}
