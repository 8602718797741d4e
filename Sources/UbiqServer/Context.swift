import Foundation
import Hummingbird
import Logging
import UbiqCloud
import UbiqCloudAPI

/// The per-request context: Hummingbird's core storage plus the authenticated token (set by
/// `AuthMiddleware` on every `/v1` route).
public struct UbiqRequestContext: RequestContext {
  public var coreContext: CoreRequestContextStorage
  public var identity: TokenRecord?
  /// The SHA-256 of the bearer token of the request (set with `identity`).
  public var tokenHash: String?
  /// Bodies are read by the handlers themselves with route-specific limits.
  public var maxUploadSize: Int { 16 << 20 }

  public init(source: Source) {
    coreContext = .init(source: source)
  }

  /// The authenticated token (only nil on unauthenticated routes).
  func requireIdentity() throws -> TokenRecord {
    guard let identity else { throw APIError.unauthorized("missing bearer token") }
    return identity
  }

  /// The authenticated token, which must be an account token (managing devices).
  func requireAccountScope(_ action: String) throws -> TokenRecord {
    let id = try requireIdentity()
    guard id.scope == .account else {
      throw APIError(
        .forbidden, "insufficient_scope",
        "a device token cannot \(action); use an account token (from 'ubiqfs server token create')")
    }
    return id
  }
}

/// Resolves `Authorization: Bearer <token>` to an account via the token's SHA-256. Missing,
/// malformed, unknown, revoked and rotated-away tokens get 401 `unauthorized`, expired ones 401
/// `token_expired`; nothing is cached, so a revocation is effective on every server process at
/// once.
struct AuthMiddleware: RouterMiddleware {
  typealias Context = UbiqRequestContext
  let accounts: AccountStore
  let metrics: ServerMetrics

  func handle(
    _ request: Request, context: UbiqRequestContext,
    next: (Request, UbiqRequestContext) async throws -> Response
  ) async throws -> Response {
    guard let header = request.headers[.authorization] else {
      metrics.authFailures.increment()
      throw APIError.unauthorized("missing bearer token")
    }
    let parts = header.split(separator: " ", maxSplits: 1)
    guard parts.count == 2, parts[0].lowercased() == "bearer", BearerToken.isWellFormed(parts[1]) else {
      metrics.authFailures.increment()
      throw APIError.unauthorized("the Authorization header must be 'Bearer ubq_<64 hex digits>'")
    }
    let hash = BearerToken.hash(String(parts[1]))
    guard let record = try await accounts.token(hash: hash) else {
      metrics.authFailures.increment()
      throw APIError.unauthorized("unknown or revoked token")
    }
    if record.isExpired(now: Int64(Date().timeIntervalSince1970)) {
      metrics.authFailures.increment()
      throw APIError(.unauthorized, "token_expired", "the token expired; sign in again with an account token")
    }
    var context = context
    context.identity = record
    context.tokenHash = hash
    context.logger[metadataKey: "account"] = "\(record.account)"
    return try await next(request, context)
  }
}
