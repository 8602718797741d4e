import Foundation
import Hummingbird
import Logging
import UbiqCloud

/// The per-request context: Hummingbird's core storage plus the authenticated token (set by
/// `AuthMiddleware` on every `/v1` route).
public struct UbiqRequestContext: RequestContext {
  public var coreContext: CoreRequestContextStorage
  public var identity: TokenRecord?
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
}

/// Resolves `Authorization: Bearer <token>` to an account via the token's SHA-256. Missing,
/// malformed, unknown and revoked tokens get 401; nothing is cached, so a revocation is effective on
/// every server process at once.
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
    guard let record = try await accounts.token(hash: BearerToken.hash(String(parts[1]))) else {
      metrics.authFailures.increment()
      throw APIError.unauthorized("unknown or revoked token")
    }
    var context = context
    context.identity = record
    context.logger[metadataKey: "account"] = "\(record.account)"
    return try await next(request, context)
  }
}
