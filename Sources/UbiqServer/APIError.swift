import Foundation
import Hummingbird
import NIOCore
import NIOHTTP1
import UbiqCloud
import UbiqCloudAPI
import UbiqCore

/// An HTTP error with a machine-readable code; every error response is
/// `{"error": message, "code": code, ...}` (see docs/protocol.md).
public struct APIError: Error, Sendable {
  public var status: HTTPResponse.Status
  public var code: String
  public var message: String
  public var current: CloudItem? = nil
  public var missing: [String]? = nil
  public var usage: Usage? = nil
  public var errno: String? = nil
  /// The live item that keeps a folder from being deleted (`not_empty`).
  public var blockingItem: String? = nil

  public init(_ status: HTTPResponse.Status, _ code: String, _ message: String) {
    self.status = status
    self.code = code
    self.message = message
  }

  static func badRequest(_ code: String, _ message: String) -> APIError { APIError(.badRequest, code, message) }
  static func unauthorized(_ message: String) -> APIError { APIError(.unauthorized, "unauthorized", message) }
  static func tooLarge(_ limit: Int) -> APIError {
    APIError(.contentTooLarge, "too_large", "request body exceeds \(limit) bytes")
  }

  struct Body: Encodable {
    var error: String
    var code: String
    var current: CloudItem?
    var missing: [String]?
    var usage: Usage?
    var errno: String?
    var blockingItem: String?
    /// The HTTP status, where the error is part of a 200 answer (a refused version of a batch).
    var status: Int?
  }

  /// The fields of the error's JSON body; `status` for an error reported inside an answer.
  func bodyFields(status: Int? = nil) -> Body {
    Body(
      error: message, code: code, current: current, missing: missing, usage: usage, errno: errno,
      blockingItem: blockingItem, status: status)
  }

  /// The JSON body of the error response.
  func body() -> Data {
    (try? HTTPHelpers.encoder.encode(bodyFields())) ?? Data("{\"error\":\"\",\"code\":\"\(code)\"}".utf8)
  }

  func response() -> Response {
    var headers: HTTPFields = [.contentType: "application/json; charset=utf-8"]
    if status == .unauthorized { headers[.wwwAuthenticate] = "Bearer realm=\"ubiqfs\"" }
    // A passing condition (a busy database, a chunk being collected): ask again in a second.
    if status == .serviceUnavailable { headers[.retryAfter] = "1" }
    return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: body())))
  }

  /// The API error for anything a handler or the engine threw.
  static func from(_ error: Error) -> APIError? {
    switch error {
    case let e as APIError: return e
    case let e as CloudError: return from(cloud: e)
    case let e as KeyValueError:
      switch e {
      case .invalidKey(let m): return .badRequest("invalid_key", "invalid key: \(m)")
      case .quotaViolation:
        var api = APIError(.insufficientStorage507, "kv_quota", e.description)
        api.errno = "EDQUOT"
        return api
      }
    case let e as UbiqError:
      switch e {
      case .nameTooLong: return .badRequest("name_too_long", e.description)
      case .invalidArgument: return .badRequest("invalid", e.description)
      default: return nil
      }
    case is NIOTooManyBytesError: return APIError(.contentTooLarge, "too_large", "request body too large")
    // A body the HTTP parser refused part way (a chunk size that is not hexadecimal, say).
    case let e as HTTPParserError: return .badRequest("bad_request", "malformed HTTP request: \(e)")
    case let e as HTTPError:
      let code: String
      switch e.status {
      case .notFound: code = "not_found"
      case .methodNotAllowed: code = "method_not_allowed"
      case .contentTooLarge: code = "too_large"
      case .badRequest: code = "bad_request"
      default: code = "http_\(e.status.code)"
      }
      return APIError(e.status, code, e.body ?? e.status.reasonPhrase)
    default: return nil
    }
  }

  static func from(cloud e: CloudError) -> APIError {
    switch e {
    case .conflict(let current):
      var api = APIError(.conflict, "conflict", e.description)
      api.current = current
      return api
    case .missingChunks(let hashes):
      var api = APIError(.unprocessableContent, "missing_chunks", e.description)
      api.missing = hashes
      return api
    case .hashMismatch: return APIError(.unprocessableContent, "hash_mismatch", e.description)
    case .quotaExceeded(let usage):
      var api = APIError(.insufficientStorage507, "quota_exceeded", e.description)
      api.usage = usage
      api.errno = "EDQUOT"
      return api
    case .notFound: return APIError(.notFound, "not_found", e.description)
    case .invalid: return .badRequest("invalid", e.description)
    case .unavailable: return APIError(.serviceUnavailable, "unavailable", e.description)
    case .exists: return APIError(.conflict, "exists", e.description)
    case .unauthorized: return .unauthorized(e.description)
    case .invalidID: return .badRequest("invalid_id", e.description)
    case .badParent: return APIError(.conflict, "bad_parent", e.description)
    case .cycle: return APIError(.conflict, "cycle", e.description)
    case .nameTaken: return APIError(.conflict, "name_taken", e.description)
    case .notEmpty(_, let blockingItemID):
      var api = APIError(.conflict, "not_empty", e.description)
      api.blockingItem = blockingItemID
      return api
    case .limitExceeded:
      var api = APIError(.insufficientStorage507, "limit_exceeded", e.description)
      api.errno = "EDQUOT"
      return api
    }
  }
}

/// Turns every error into a JSON error response (unknown ones into a logged 500).
struct ErrorMiddleware<Context: RequestContext>: RouterMiddleware {
  func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws
    -> Response
  {
    do {
      return try await next(request, context)
    } catch {
      if let api = APIError.from(error) { return api.response() }
      context.logger.error(
        "\(UnknownErrorLog.line(method: "\(request.method)", path: request.uri.path, error: error))")
      return APIError(.internalServerError, "internal", "internal server error").response()
    }
  }
}

/// The log line of an error no answer describes (a bug: the client gets a bare 500): one
/// line, at most `maxBytes` of the error's text, so whatever the error holds (a request's
/// body, a whole query) cannot flood the log.
enum UnknownErrorLog {
  static let maxBytes = 1_000

  static func line(method: String, path: String, error: any Error) -> String {
    let text = String(reflecting: error)
    let bytes = text.utf8.count
    var kept = bytes <= maxBytes ? text : String(decoding: text.utf8.prefix(maxBytes), as: UTF8.self)
    kept = String(
      String.UnicodeScalarView(
        kept.unicodeScalars.map { $0.properties.generalCategory == .control || $0.properties.isWhitespace ? " " : $0 }))
    let place = "\(method) \(String(decoding: path.utf8.prefix(200), as: UTF8.self))"
    return bytes <= maxBytes ? "\(place): \(kept)" : "\(place): \(kept)… (\(bytes) bytes in all)"
  }
}

extension HTTPResponse.Status {
  /// 507: the account's quota (or the key-value store's limits) would be exceeded.
  static let insufficientStorage507 = HTTPResponse.Status(code: 507, reasonPhrase: "Insufficient Storage")
}
