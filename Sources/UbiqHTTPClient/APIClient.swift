import AsyncHTTPClient
import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import NIOSSL
import UbiqCloudAPI
import UbiqCore

/// Where a `ubiqfs serve` is and which bearer token to send. Owns request building, the
/// timeouts every request is bounded by, and the mapping of HTTP errors back to `CloudError`.
/// `https://` servers must present a certificate that verifies against the system's roots, or
/// against `caCertificatePEM` when given (then only against it); the token is sent over plain
/// `http://` only to a loopback address, unless `allowInsecureHTTP`.
public struct APIClient: Sendable {
  public let baseURL: String
  public let token: String
  /// The CA certificate(s), PEM, that a private server's certificate is verified against.
  public let caCertificatePEM: String?
  /// Bound for ordinary requests (connect is bounded separately by the shared client: 2 s).
  public var requestTimeout: TimeAmount = .seconds(30)
  let http: HTTPClient

  public init(baseURL: String, token: String, caCertificatePEM: String? = nil, allowInsecureHTTP: Bool = false)
    throws
  {
    var base = baseURL.trimmingCharacters(in: .whitespaces)
    while base.hasSuffix("/") { base.removeLast() }
    guard let url = URL(string: base), url.scheme == "http" || url.scheme == "https", let host = url.host,
      !host.isEmpty
    else {
      throw CloudError.invalid("server URL '\(baseURL)' must look like https://host:port")
    }
    if url.scheme == "http", !allowInsecureHTTP, !Self.isLoopback(host) {
      throw CloudError.invalid(
        "refusing to send the token over plain http:// to \(host), which is not loopback; "
          + "use https:// (or pass --insecure-http on a network you trust)")
    }
    self.baseURL = base
    self.token = token
    self.caCertificatePEM = caCertificatePEM
    self.http = try Self.client(caCertificatePEM: caCertificatePEM)
  }

  /// True for `localhost`, 127.0.0.0/8 and ::1 (traffic that never leaves the machine).
  public static func isLoopback(_ host: String) -> Bool {
    var h = host.lowercased()
    if h.hasPrefix("[") && h.hasSuffix("]") { h = String(h.dropFirst().dropLast()) }
    if h == "localhost" || h == "::1" || h == "0:0:0:0:0:0:0:1" { return true }
    let parts = h.split(separator: ".", omittingEmptySubsequences: false)
    return parts.count == 4 && parts[0] == "127" && parts.allSatisfy { UInt8($0) != nil }
  }

  /// Process-wide HTTP clients, one per trust root (nil: the system's): 2 s connect timeout,
  /// connections kept alive. Never shut down (they live as long as the process).
  static let clients = NIOLockedValueBox<[String: HTTPClient]>([:])

  static func client(caCertificatePEM: String?) throws -> HTTPClient {
    var tls = TLSConfiguration.makeClientConfiguration()
    if let pem = caCertificatePEM {
      let certificates: [NIOSSLCertificate]
      do { certificates = try NIOSSLCertificate.fromPEMBytes(Array(pem.utf8)) } catch {
        throw CloudError.invalid("the CA certificate is not a PEM certificate: \(error)")
      }
      guard !certificates.isEmpty else { throw CloudError.invalid("the CA certificate file holds no certificate") }
      tls.trustRoots = .certificates(certificates)
    }
    return clients.withLockedValue { clients in
      if let c = clients[caCertificatePEM ?? ""] { return c }
      var config = HTTPClient.Configuration(
        tlsConfiguration: tls, timeout: .init(connect: .seconds(2), read: .seconds(90)),
        connectionPool: .init(idleTimeout: .seconds(20), concurrentHTTP1ConnectionsPerHostSoftLimit: 16))
      config.httpVersion = .http1Only
      config.decompression = .disabled
      let c = HTTPClient(eventLoopGroupProvider: .singleton, configuration: config)
      clients[caCertificatePEM ?? ""] = c
      return c
    }
  }

  static let encoder = JSONEncoder()
  static let decoder = JSONDecoder()

  /// Percent-encodes one path segment (RFC 3986 unreserved characters stay as they are).
  public static func segment(_ s: String) -> String {
    var allowed = CharacterSet.alphanumerics.intersection(
      CharacterSet(charactersIn: Unicode.Scalar(0)..<Unicode.Scalar(128)))
    allowed.insert(charactersIn: "-._~")
    return s.addingPercentEncoding(withAllowedCharacters: allowed) ?? s
  }

  /// Sends a request and returns status, headers and body; transport failures and timeouts
  /// become `CloudError.unavailable`, error statuses the matching `CloudError`.
  public func send(
    _ method: HTTPMethod, _ path: String, query: [(String, String)] = [], body: Data? = nil,
    contentType: String = "application/json", headers: [(String, String)] = [], timeout: TimeAmount? = nil,
    accept: Set<Int> = []
  ) async throws -> (status: Int, headers: HTTPHeaders, body: Data) {
    var url = baseURL + path
    if !query.isEmpty {
      url += "?" + query.map { "\(Self.segment($0.0))=\(Self.segment($0.1))" }.joined(separator: "&")
    }
    var req = HTTPClientRequest(url: url)
    req.method = method
    req.headers.add(name: "Authorization", value: "Bearer \(token)")
    req.headers.add(name: "Accept", value: "application/json")
    for (k, v) in headers { req.headers.add(name: k, value: v) }
    if let body {
      req.headers.add(name: "Content-Type", value: contentType)
      req.headers.add(name: "Content-Length", value: String(body.count))
      req.body = .bytes(ByteBuffer(data: body))
    }
    let status: Int
    let respHeaders: HTTPHeaders
    let data: Data
    do {
      let resp = try await http.execute(req, timeout: timeout ?? requestTimeout)
      status = Int(resp.status.code)
      respHeaders = resp.headers
      data = Data(buffer: try await resp.body.collect(upTo: 256 << 20))
    } catch let e as CloudError {
      throw e
    } catch is CancellationError {
      throw CancellationError()
    } catch {
      throw CloudError.unavailable("\(method.rawValue) \(baseURL)\(path): \(Self.describe(error))")
    }
    if (200..<300).contains(status) || accept.contains(status) { return (status, respHeaders, data) }
    throw Self.error(status: status, body: data)
  }

  static func describe(_ error: Error) -> String {
    if let e = error as? HTTPClientError {
      switch e {
      case .connectTimeout: return "connect timed out"
      case .readTimeout, .deadlineExceeded: return "request timed out"
      case .remoteConnectionClosed: return "the server closed the connection"
      default: return "\(e)"
      }
    }
    if error is NIOSSLError || error is BoringSSLError {
      return "TLS handshake failed, the server's certificate is not trusted "
        + "(for a private CA, sign in with --ca-cert FILE): \(error)"
    }
    return "\(error)"
  }

  /// The JSON error body every non-2xx response carries.
  public struct ErrorBody: Codable, Sendable {
    public var error: String
    public var code: String
    public var current: CloudItem?
    public var missing: [String]?
    public var usage: Usage?
    public var blockingItem: String?
  }

  /// Maps an error response back to the typed error the engine threw on the server. The
  /// response's message is that error's whole description; the rebuilt error gets the detail
  /// only, so it reads exactly as it did on the server.
  public static func error(status: Int, body: Data) -> Error {
    let parsed = try? decoder.decode(ErrorBody.self, from: body)
    let message = parsed?.error ?? String(decoding: body.prefix(300), as: UTF8.self)
    func typed<E: Error & CustomStringConvertible>(_ make: (String) -> E) -> E {
      make(detail(of: message, writtenBy: make))
    }
    switch (status, parsed?.code ?? "") {
    case (409, "conflict"):
      if let current = parsed?.current { return CloudError.conflict(current: current) }
      return typed(CloudError.invalid)
    case (409, "exists"): return typed(CloudError.exists)
    case (409, "bad_parent"): return typed(CloudError.badParent)
    case (409, "cycle"): return typed(CloudError.cycle)
    case (409, "name_taken"): return typed(CloudError.nameTaken)
    case (409, "not_empty"):
      return typed { CloudError.notEmpty($0, blockingItemID: parsed?.blockingItem) }
    case (400, "invalid_id"): return typed(CloudError.invalidID)
    case (_, "missing_chunks"): return CloudError.missingChunks(parsed?.missing ?? [])
    case (_, "hash_mismatch"): return typed(CloudError.hashMismatch)
    case (_, "kv_quota"): return typed(KeyValueError.quotaViolation)
    case (_, "invalid_key"): return typed(KeyValueError.invalidKey)
    case (507, "limit_exceeded"): return typed(CloudError.limitExceeded)
    case (507, _): return CloudError.quotaExceeded(parsed?.usage ?? Usage(usedBytes: 0, quotaBytes: 0))
    case (404, _): return typed(CloudError.notFound)
    case (401, _), (403, _): return typed(CloudError.unauthorized)
    case (400, _), (413, _), (416, _), (422, _): return typed(CloudError.invalid)
    default: return CloudError.unavailable("HTTP \(status): \(message)")
    }
  }

  /// The detail that `make(detail).description` wrapped into `message`, found by rendering
  /// `make` around a marker; a message written some other way is the detail as it is.
  static func detail<E: CustomStringConvertible>(of message: String, writtenBy make: (String) -> E) -> String {
    let marker = "\u{1}"
    let frame = make(marker).description.components(separatedBy: marker)
    guard frame.count == 2, message.utf8.count >= frame[0].utf8.count + frame[1].utf8.count,
      message.hasPrefix(frame[0]), message.hasSuffix(frame[1])
    else { return message }
    let bytes = message.utf8.dropFirst(frame[0].utf8.count).dropLast(frame[1].utf8.count)
    return String(decoding: bytes, as: UTF8.self)
  }

  /// Decodes an answer: a type `JSONReader` reads directly is read so (falling back to
  /// `JSONDecoder` for text only the generic decoder reads).
  public func json<T: Decodable>(_ type: T.Type, _ data: Data) throws -> T {
    if let readable = T.self as? JSONReadable.Type,
      let value = try? JSONReader.read(data, { try readable.read(from: &$0) }) as? T
    {
      return value
    }
    do { return try Self.decoder.decode(T.self, from: data) } catch {
      throw CloudError.unavailable("the server sent an unreadable \(T.self): \(error)")
    }
  }

  public func encode<T: Encodable>(_ value: T) throws -> Data { try Self.encoder.encode(value) }
}
