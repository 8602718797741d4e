import Crypto
import Foundation
import UbiqCore

/// AWS Signature Version 4 for S3-style requests (header-based, signed payload hash).
/// Owns the canonical request, the string to sign, the signing key and the `Authorization`
/// header; knows nothing about HTTP clients.
public struct SigV4Signer: Sendable {
  public var accessKey: String
  public var secretKey: String
  public var region: String
  public var service: String
  /// The session token of temporary credentials (e.g. from AWS STS): sent and signed as
  /// `x-amz-security-token`.
  public var sessionToken: String?
  /// Whether the payload hash is also sent (and signed) as `x-amz-content-sha256`, as S3
  /// requires; other services take it only in the canonical request.
  public var sendsPayloadHash: Bool

  public init(
    accessKey: String, secretKey: String, region: String, service: String = "s3", sessionToken: String? = nil,
    sendsPayloadHash: Bool = true
  ) {
    self.accessKey = accessKey
    self.secretKey = secretKey
    self.region = region
    self.service = service
    self.sessionToken = sessionToken
    self.sendsPayloadHash = sendsPayloadHash
  }

  /// The payload hash of an empty body.
  public static let emptyPayloadHash = sha256Hex(Data())

  /// Headers to add to a request: `x-amz-date`, `x-amz-content-sha256` (if `sendsPayloadHash`),
  /// `x-amz-security-token` (with a session token) and `Authorization`.
  /// `headers` are the request's other headers to sign (they must include `host`, with the port
  /// unless it is the scheme's default); `path` is the already-encoded absolute path, as sent
  /// (an endpoint's base path included), `query` the decoded query items.
  public func sign(
    method: String, path: String, query: [(String, String)] = [], headers: [String: String], payloadHash: String,
    date: Date = Date()
  ) -> [String: String] {
    sign(
      method: method, path: path, query: query, headerList: headers.map { ($0.key, $0.value) },
      payloadHash: payloadHash, date: date)
  }

  /// As `sign(method:path:query:headers:payloadHash:date:)`, with headers that may repeat a
  /// name: the values of one name are signed comma-joined in their order.
  public func sign(
    method: String, path: String, query: [(String, String)] = [], headerList: [(String, String)],
    payloadHash: String, date: Date = Date()
  ) -> [String: String] {
    let amzDate = Self.amzDate(date)
    let day = String(amzDate.prefix(8))
    var all: [String: String] = [:]
    for (k, v) in headerList {
      let name = k.lowercased()
      let value = Self.trimHeaderValue(v)
      all[name] = all[name].map { $0 + "," + value } ?? value
    }
    var added = ["x-amz-date": amzDate]
    if sendsPayloadHash { added["x-amz-content-sha256"] = payloadHash }
    if let sessionToken { added["x-amz-security-token"] = sessionToken }
    all.merge(added) { _, new in new }
    let names = all.keys.sorted()
    let canonicalHeaders = names.map { "\($0):\(all[$0]!)\n" }.joined()
    let signedHeaders = names.joined(separator: ";")
    var encoded: [(String, String)] = []
    for (k, v) in query { encoded.append((Self.uriEncode(k, slash: true), Self.uriEncode(v, slash: true))) }
    encoded.sort { (a: (String, String), b: (String, String)) -> Bool in a.0 == b.0 ? a.1 < b.1 : a.0 < b.0 }
    let canonicalQuery = encoded.map { (p: (String, String)) -> String in p.0 + "=" + p.1 }.joined(separator: "&")
    let canonicalRequest = [
      method, path.isEmpty ? "/" : path, canonicalQuery, canonicalHeaders, signedHeaders, payloadHash,
    ].joined(separator: "\n")
    let scope = "\(day)/\(region)/\(service)/aws4_request"
    let stringToSign = [
      "AWS4-HMAC-SHA256", amzDate, scope, Self.sha256Hex(Data(canonicalRequest.utf8)),
    ].joined(separator: "\n")
    let signature = Hex.lowercase(
      HMAC<SHA256>.authenticationCode(for: Data(stringToSign.utf8), using: signingKey(day: day)))
    added["Authorization"] =
      "AWS4-HMAC-SHA256 Credential=\(accessKey)/\(scope), SignedHeaders=\(signedHeaders), Signature=\(signature)"
    return added
  }

  func signingKey(day: String) -> SymmetricKey {
    func mac(_ key: SymmetricKey, _ text: String) -> SymmetricKey {
      SymmetricKey(data: Data(HMAC<SHA256>.authenticationCode(for: Data(text.utf8), using: key)))
    }
    let kDate = mac(SymmetricKey(data: Data("AWS4\(secretKey)".utf8)), day)
    return mac(mac(mac(kDate, region), service), "aws4_request")
  }

  /// `yyyyMMdd'T'HHmmss'Z'` in UTC.
  public static func amzDate(_ date: Date) -> String {
    var t = time_t(date.timeIntervalSince1970)
    var tm = tm()
    gmtime_r(&t, &tm)
    return String(
      format: "%04d%02d%02dT%02d%02d%02dZ", Int(tm.tm_year) + 1900, Int(tm.tm_mon) + 1, Int(tm.tm_mday),
      Int(tm.tm_hour), Int(tm.tm_min), Int(tm.tm_sec))
  }

  /// RFC 3986 encoding as SigV4 wants it: everything but unreserved characters, and '/'
  /// too unless `slash` is false (object keys keep their slashes).
  public static func uriEncode(_ s: String, slash: Bool) -> String {
    var out = ""
    for b in s.utf8 {
      switch b {
      case UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "a")...UInt8(ascii: "z"),
        UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "-"), UInt8(ascii: "_"), UInt8(ascii: "."),
        UInt8(ascii: "~"):
        out.append(Character(UnicodeScalar(b)))
      case UInt8(ascii: "/") where !slash:
        out.append("/")
      default:
        out += String(format: "%%%02X", b)
      }
    }
    return out
  }

  static func trimHeaderValue(_ v: String) -> String {
    v.trimmingCharacters(in: .whitespaces).split(separator: " ", omittingEmptySubsequences: true)
      .joined(separator: " ")
  }

  public static func sha256Hex(_ data: Data) -> String { Hex.lowercase(SHA256.hash(data: data)) }
}
