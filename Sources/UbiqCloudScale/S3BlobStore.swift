import AsyncHTTPClient
import Foundation
import NIOCore
import NIOHTTP1
import UbiqCloud
import UbiqCloudAPI
import UbiqCore

/// Where an S3-compatible object store is and how to sign for it.
public struct S3Config: Sendable {
  /// e.g. `http://127.0.0.1:8333`, `https://s3.eu-central-1.amazonaws.com` or, behind a
  /// proxy that serves S3 under a path, `https://proxy.example/s3`.
  public var endpoint: String
  public var bucket: String
  public var accessKey: String
  public var secretKey: String
  public var region: String
  /// Prepended to every object key (e.g. `ubiqfs/`).
  public var keyPrefix: String
  /// The session token of temporary credentials, sent as `x-amz-security-token`.
  public var sessionToken: String?
  public var retry: S3RetryPolicy

  public init(
    endpoint: String, bucket: String, accessKey: String, secretKey: String, region: String = "us-east-1",
    keyPrefix: String = "", sessionToken: String? = nil, retry: S3RetryPolicy = S3RetryPolicy()
  ) {
    self.endpoint = endpoint.hasSuffix("/") ? String(endpoint.dropLast()) : endpoint
    self.bucket = bucket
    self.accessKey = accessKey
    self.secretKey = secretKey
    self.region = region
    self.keyPrefix = keyPrefix
    self.sessionToken = sessionToken
    self.retry = retry
  }
}

/// An S3 endpoint URL taken apart: `origin` (scheme, host, port) is where requests go,
/// `host` the `Host` header they are sent and signed with (the port only when it is not the
/// scheme's default, as HTTP clients send it), `basePath` the already-encoded path every
/// request path starts with ("" or e.g. `/s3`, no trailing slash).
public struct S3Endpoint: Sendable, Equatable {
  public var origin: String
  public var host: String
  public var basePath: String

  public init(_ endpoint: String) throws {
    guard let c = URLComponents(string: endpoint), let scheme = c.scheme?.lowercased(),
      scheme == "http" || scheme == "https", var name = c.percentEncodedHost, !name.isEmpty,
      c.query == nil, c.fragment == nil, c.user == nil
    else { throw CloudError.invalid("bad S3 endpoint '\(endpoint)' (want http(s)://host[:port][/path])") }
    if name.contains(":") && !name.hasPrefix("[") { name = "[\(name)]" }
    let defaultPort = scheme == "https" ? 443 : 80
    let host = c.port.map { $0 == defaultPort ? name : "\(name):\($0)" } ?? name
    self.host = host
    self.origin = "\(scheme)://\(host)"
    var path = c.percentEncodedPath
    while path.hasSuffix("/") { path.removeLast() }
    self.basePath = path
  }
}

/// Chunks as S3 objects `<prefix><account>/<hh>/<hash>` in one bucket, path-style URLs under
/// the endpoint's base path, every request SigV4-signed with the chunk's SHA-256 as the
/// payload hash. Requests that fail with 500, 502, 503 (SlowDown), 504, a timeout or a
/// connection error are tried again as `config.retry` says.
/// Sendable: immutable after init; requests share nothing but the thread-safe HTTP client.
public final class S3BlobStore: BlobStore, @unchecked Sendable {
  let config: S3Config
  let signer: SigV4Signer
  let http: HTTPClient
  let endpoint: S3Endpoint
  let timeout: TimeAmount

  public init(config: S3Config, http: HTTPClient, timeout: TimeAmount = .seconds(60)) throws {
    self.endpoint = try S3Endpoint(config.endpoint)
    self.config = config
    self.signer = SigV4Signer(
      accessKey: config.accessKey, secretKey: config.secretKey, region: config.region,
      sessionToken: config.sessionToken)
    self.http = http
    self.timeout = timeout
  }

  func objectPath(_ account: String, _ hash: String) -> String {
    let key = "\(config.keyPrefix)\(account)/\(hash.prefix(2))/\(hash)"
    return "/" + SigV4Signer.uriEncode(config.bucket, slash: true) + "/" + SigV4Signer.uriEncode(key, slash: false)
  }

  /// The signed request for `path` (bucket and key, encoded) under the endpoint's base path.
  /// `Host` is set explicitly so that what is sent is what was signed.
  func prepare(
    _ method: HTTPMethod, path: String, body: Data? = nil, payloadHash: String? = nil, extra: [String: String] = [:],
    date: Date = Date()
  ) -> HTTPClientRequest {
    let fullPath = endpoint.basePath + path
    var req = HTTPClientRequest(url: endpoint.origin + fullPath)
    req.method = method
    var toSign = extra
    toSign["host"] = endpoint.host
    let hash = payloadHash ?? SigV4Signer.sha256Hex(body ?? Data())
    req.headers.add(name: "host", value: endpoint.host)
    for (k, v) in signer.sign(method: method.rawValue, path: fullPath, headers: toSign, payloadHash: hash, date: date) {
      req.headers.add(name: k, value: v)
    }
    for (k, v) in extra { req.headers.add(name: k, value: v) }
    if let body {
      req.body = .bytes(ByteBuffer(data: body))
      req.headers.add(name: "Content-Length", value: String(body.count))
    }
    return req
  }

  /// Whether an attempt's outcome is worth another try: a server error S3 documents as
  /// transient (500, 502, 503 SlowDown, 504) or a transport failure (timeout, refused or
  /// dropped connection), which `send` reports as `unavailable`.
  static func isRetryable(_ result: Result<(HTTPClientResponse, Data), any Error>) -> Bool {
    switch result {
    case .success(let (resp, _)):
      return [500, 502, 503, 504].contains(resp.status.code)
    case .failure(let error):
      if case CloudError.unavailable = error { return true }
      return false
    }
  }

  /// Sends the request, retried as `config.retry` says; the last attempt's response (or
  /// error) is the result.
  func request(
    _ method: HTTPMethod, path: String, body: Data? = nil, payloadHash: String? = nil, extra: [String: String] = [:]
  ) async throws -> (HTTPClientResponse, Data) {
    try await config.retry.run(isRetryable: Self.isRetryable) {
      // Signed anew for every attempt: the signature covers the time.
      try await send(
        method, path: path, request: prepare(method, path: path, body: body, payloadHash: payloadHash, extra: extra))
    }
  }

  func send(_ method: HTTPMethod, path: String, request req: HTTPClientRequest) async throws -> (
    HTTPClientResponse, Data
  ) {
    do {
      let resp = try await http.execute(req, timeout: timeout)
      let data = Data(buffer: try await resp.body.collect(upTo: 64 << 20))
      return (resp, data)
    } catch let e as HTTPClientError {
      throw CloudError.unavailable("S3 \(method.rawValue) \(path): \(e)")
    } catch let e as NIOCore.ChannelError {
      throw CloudError.unavailable("S3 \(method.rawValue) \(path): \(e)")
    } catch let e as IOError {
      throw CloudError.unavailable("S3 \(method.rawValue) \(path): \(e)")
    }
  }

  func failure(_ what: String, _ resp: HTTPClientResponse, _ body: Data) -> CloudError {
    let text = String(decoding: body.prefix(400), as: UTF8.self)
    return .unavailable("S3 \(what): HTTP \(resp.status.code) \(text)")
  }

  /// Creates the bucket if it does not exist yet (for test set-ups and first start).
  public func ensureBucket() async throws {
    let path = "/" + SigV4Signer.uriEncode(config.bucket, slash: true)
    let (head, headBody) = try await request(.HEAD, path: path)
    if head.status == .ok { return }
    if head.status != .notFound { throw failure("HEAD bucket", head, headBody) }
    let (resp, body) = try await request(.PUT, path: path)
    if resp.status == .ok || resp.status == .conflict { return }
    throw failure("create bucket", resp, body)
  }

  public func contains(account: String, hash: String) async throws -> Bool {
    let (resp, body) = try await request(.HEAD, path: objectPath(account, hash))
    switch resp.status {
    case .ok: return true
    case .notFound: return false
    default: throw failure("HEAD \(hash)", resp, body)
    }
  }

  public func put(account: String, hash: String, data: Data) async throws {
    // Chunks are content-addressed: the chunk's hash is the payload hash S3 verifies.
    let (resp, body) = try await request(
      .PUT, path: objectPath(account, hash), body: data, payloadHash: SigV4Signer.sha256Hex(data),
      extra: ["content-type": "application/octet-stream"])
    guard resp.status == .ok else { throw failure("PUT \(hash)", resp, body) }
  }

  public func delete(account: String, hash: String) async throws {
    let (resp, body) = try await request(.DELETE, path: objectPath(account, hash))
    // S3 answers 204 whether or not the object existed; some stores answer 404 for a missing one.
    guard resp.status == .noContent || resp.status == .ok || resp.status == .notFound else {
      throw failure("DELETE \(hash)", resp, body)
    }
  }

  public func get(account: String, hash: String, range: Range<Int64>?) async throws -> Data {
    var extra: [String: String] = [:]
    if let range {
      if range.isEmpty { return Data() }
      extra["range"] = "bytes=\(range.lowerBound)-\(range.upperBound - 1)"
    }
    let (resp, body) = try await request(.GET, path: objectPath(account, hash), extra: extra)
    switch resp.status {
    case .ok, .partialContent: return body
    case .rangeNotSatisfiable: return Data()
    case .notFound: throw CloudError.notFound("chunk \(hash)")
    default: throw failure("GET \(hash)", resp, body)
    }
  }
}
