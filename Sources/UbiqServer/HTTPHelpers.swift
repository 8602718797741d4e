import Foundation
import Hummingbird
import NIOCore
import NIOFoundationCompat
import UbiqCloud
import UbiqCloudAPI
import UbiqCore

/// Request/response plumbing shared by the routes: bounded body reading, strict JSON and
/// UTF-8 decoding, path and query parameters, JSON responses.
enum HTTPHelpers {
  static let encoder: JSONEncoder = {
    let e = JSONEncoder()
    e.outputFormatting = [.withoutEscapingSlashes]
    return e
  }()
  static let decoder = JSONDecoder()

  /// Reads the whole body, refusing (413) anything above `limit` before and while reading.
  static func body(_ request: Request, limit: Int) async throws -> Data {
    if let length = request.headers[.contentLength].flatMap({ Int($0) }), length > limit {
      throw APIError.tooLarge(limit)
    }
    do {
      return Data(buffer: try await request.body.collect(upTo: limit))
    } catch is NIOTooManyBytesError {
      throw APIError.tooLarge(limit)
    }
  }

  /// Decodes a JSON body; invalid UTF-8 and malformed JSON are 400s with their own codes.
  static func json<T: Decodable>(_ type: T.Type, _ data: Data) throws -> T {
    guard String(validating: data, as: UTF8.self) != nil else {
      throw APIError.badRequest("invalid_utf8", "the request body is not valid UTF-8")
    }
    if containsLoneSurrogateEscape(data) {
      throw APIError.badRequest("invalid_utf8", "the request body escapes an unpaired UTF-16 surrogate")
    }
    if data.starts(with: [0xEF, 0xBB, 0xBF]) {
      throw APIError.badRequest("bad_json", "the request body starts with a byte-order mark")
    }
    if let readable = T.self as? JSONReadable.Type {
      // The reader refuses a key twice in one object itself.
      do {
        guard let value = try JSONReader.read(data, { try readable.read(from: &$0) }) as? T else {
          throw APIError.badRequest("bad_json", "the request body is not valid JSON for \(T.self)")
        }
        return value
      } catch JSONReader.Failure.invalidUTF8 {
        throw APIError.badRequest("invalid_utf8", "the request body escapes an unpaired UTF-16 surrogate")
      } catch let failure as JSONReader.Failure {
        throw APIError.badRequest("bad_json", failure.description)
      }
    }
    if let key = duplicateKey(data) {
      throw APIError.badRequest("bad_json", "the key '\(key.prefix(80))' appears twice in one object")
    }
    do {
      return try decoder.decode(T.self, from: data)
    } catch let DecodingError.keyNotFound(key, _) {
      throw APIError.badRequest("bad_json", "missing field '\(key.stringValue)'")
    } catch let DecodingError.typeMismatch(_, ctx) {
      throw APIError.badRequest(
        "bad_json", "wrong type at '\(ctx.codingPath.map(\.stringValue).joined(separator: "."))'")
    } catch let DecodingError.valueNotFound(_, ctx) {
      throw APIError.badRequest(
        "bad_json", "missing value at '\(ctx.codingPath.map(\.stringValue).joined(separator: "."))'")
    } catch {
      throw APIError.badRequest("bad_json", "the request body is not valid JSON for \(T.self)")
    }
  }

  /// The first key that appears twice in one JSON object, if any (JSON leaves the meaning of
  /// duplicates open, so they are refused). One pass with an explicit stack, so nesting depth
  /// costs no recursion; text that is not JSON yields nil and is left to the decoder.
  static func duplicateKey(_ data: Data) -> String? {
    let bytes = [UInt8](data)
    // One entry per open object (its keys so far) or array (nil).
    var stack: [Set<[UInt8]>?] = []
    var expectKey = false
    var i = 0
    while i < bytes.count {
      switch bytes[i] {
      case UInt8(ascii: "{"):
        stack.append([])
        expectKey = true
      case UInt8(ascii: "["):
        stack.append(nil)
        expectKey = false
      case UInt8(ascii: "}"), UInt8(ascii: "]"):
        if !stack.isEmpty { stack.removeLast() }
        expectKey = false
      case UInt8(ascii: ","):
        expectKey = stack.last.map { $0 != nil } ?? false
      case UInt8(ascii: "\""):
        var j = i + 1
        var escaped = false
        while j < bytes.count && bytes[j] != UInt8(ascii: "\"") {
          if bytes[j] == UInt8(ascii: "\\") {
            escaped = true
            j += 1
          }
          j += 1
        }
        guard j < bytes.count else { return nil }
        if expectKey, !stack.isEmpty, stack[stack.count - 1] != nil {
          var key = Array(bytes[(i + 1)..<j])
          if escaped {
            guard let decoded = try? decoder.decode(String.self, from: Data(bytes[i...j])) else { return nil }
            key = Array(decoded.utf8)
          }
          if !stack[stack.count - 1]!.insert(key).inserted { return String(decoding: key, as: UTF8.self) }
          expectKey = false
        }
        i = j
      default:
        break
      }
      i += 1
    }
    return nil
  }

  /// True if the JSON text contains `\uD800`-`\uDFFF` escapes that do not form a pair (they
  /// cannot become valid UTF-8, and decoders would silently replace them).
  static func containsLoneSurrogateEscape(_ data: Data) -> Bool {
    let bytes = [UInt8](data)
    var i = 0
    func hex4(_ at: Int) -> UInt32? {
      guard at + 4 <= bytes.count else { return nil }
      return UInt32(String(decoding: bytes[at..<at + 4], as: UTF8.self), radix: 16)
    }
    var inString = false
    while i < bytes.count {
      let b = bytes[i]
      if !inString {
        if b == UInt8(ascii: "\"") { inString = true }
        i += 1
        continue
      }
      if b == UInt8(ascii: "\"") {
        inString = false
        i += 1
      } else if b == UInt8(ascii: "\\"), i + 1 < bytes.count {
        if bytes[i + 1] == UInt8(ascii: "u"), let v = hex4(i + 2) {
          if (0xD800...0xDBFF).contains(v) {
            guard i + 7 < bytes.count, bytes[i + 6] == UInt8(ascii: "\\"),
              bytes[i + 7] == UInt8(ascii: "u"), let low = hex4(i + 8), (0xDC00...0xDFFF).contains(low)
            else { return true }
            i += 12
            continue
          }
          if (0xDC00...0xDFFF).contains(v) { return true }
          i += 6
        } else {
          i += 2
        }
      } else {
        i += 1
      }
    }
    return false
  }

  static func response<T: Encodable>(
    _ value: T, status: HTTPResponse.Status = .ok, headers: HTTPFields = [:]
  ) throws -> Response {
    response(json: try encoder.encode(value), status: status, headers: headers)
  }

  /// A response whose JSON body is already written.
  static func response(json data: Data, status: HTTPResponse.Status = .ok, headers: HTTPFields = [:]) -> Response {
    var h = headers
    h[.contentType] = "application/json; charset=utf-8"
    return Response(status: status, headers: h, body: .init(byteBuffer: ByteBuffer(data: data)))
  }

  /// A percent-decoded path parameter; invalid escapes or invalid UTF-8 are 400s.
  static func param(_ context: UbiqRequestContext, _ name: String) throws -> String {
    guard let raw = context.parameters.get(name) else {
      throw APIError.badRequest("bad_request", "missing path parameter \(name)")
    }
    guard let decoded = raw.removingPercentEncoding else {
      throw APIError.badRequest("invalid_utf8", "path parameter \(name) is not valid percent-encoded UTF-8")
    }
    return decoded
  }

  /// The `item` path parameter, which must have the identifier format (docs/protocol.md).
  static func itemID(_ context: UbiqRequestContext) throws -> String {
    let id = try param(context, "item")
    guard Identifier.isValid(id) else {
      throw APIError.badRequest("invalid_id", "item id \(Identifier.quoted(id)) is not 1-128 of A-Z a-z 0-9 . - _")
    }
    return id
  }

  static func container(_ context: UbiqRequestContext) throws -> ContainerID {
    let raw = try param(context, "container")
    do { return try ContainerID(raw) } catch let e as UbiqError {
      throw APIError.badRequest("invalid_container", e.description)
    }
  }

  static func intQuery(_ request: Request, _ name: String, default value: Int64, range: ClosedRange<Int64>) throws
    -> Int64
  {
    guard let raw = request.uri.queryParameters.get(name) else { return value }
    guard let v = Int64(raw), range.contains(v) else {
      throw APIError.badRequest("bad_request", "query parameter \(name) must be an integer in \(range)")
    }
    return v
  }

  /// `If-Match: "etag"` (quotes and a weak prefix are tolerated); nil when absent.
  static func ifMatch(_ request: Request) -> String? {
    guard var v = request.headers[.ifMatch]?.trimmingCharacters(in: .whitespaces), !v.isEmpty else { return nil }
    if v.hasPrefix("W/") { v.removeFirst(2) }
    if v.count >= 2, v.hasPrefix("\""), v.hasSuffix("\"") { v = String(v.dropFirst().dropLast()) }
    return v
  }
}
