import AsyncHTTPClient
import Foundation
import NIOCore
import NIOHTTP1
import UbiqCloud
import UbiqCore

/// Where an S3-compatible object store is and how to sign for it.
public struct S3Config: Sendable {
  /// e.g. `http://127.0.0.1:8333` or `https://s3.eu-central-1.amazonaws.com`.
  public var endpoint: String
  public var bucket: String
  public var accessKey: String
  public var secretKey: String
  public var region: String
  /// Prepended to every object key (e.g. `ubiqfs/`).
  public var keyPrefix: String

  public init(
    endpoint: String, bucket: String, accessKey: String, secretKey: String, region: String = "us-east-1",
    keyPrefix: String = ""
  ) {
    self.endpoint = endpoint.hasSuffix("/") ? String(endpoint.dropLast()) : endpoint
    self.bucket = bucket
    self.accessKey = accessKey
    self.secretKey = secretKey
    self.region = region
    self.keyPrefix = keyPrefix
  }
}

/// Chunks as S3 objects `<prefix><account>/<hh>/<hash>` in one bucket, path-style URLs, every
/// request SigV4-signed with the chunk's SHA-256 as the payload hash.
public final class S3BlobStore: BlobStore, @unchecked Sendable {
  let config: S3Config
  let signer: SigV4Signer
  let http: HTTPClient
  let host: String
  let timeout: TimeAmount

  public init(config: S3Config, http: HTTPClient, timeout: TimeAmount = .seconds(60)) throws {
    guard let url = URL(string: config.endpoint), let h = url.host, url.scheme == "http" || url.scheme == "https"
    else { throw CloudError.invalid("bad S3 endpoint '\(config.endpoint)'") }
    self.config = config
    self.signer = SigV4Signer(accessKey: config.accessKey, secretKey: config.secretKey, region: config.region)
    self.http = http
    self.host = url.port.map { "\(h):\($0)" } ?? h
    self.timeout = timeout
  }

  func objectPath(_ account: String, _ hash: String) -> String {
    let key = "\(config.keyPrefix)\(account)/\(hash.prefix(2))/\(hash)"
    return "/" + SigV4Signer.uriEncode(config.bucket, slash: true) + "/" + SigV4Signer.uriEncode(key, slash: false)
  }

  func request(
    _ method: HTTPMethod, path: String, body: Data? = nil, payloadHash: String? = nil, extra: [String: String] = [:]
  ) async throws -> (HTTPClientResponse, Data) {
    var req = HTTPClientRequest(url: config.endpoint + path)
    req.method = method
    var toSign = extra
    toSign["host"] = host
    let hash = payloadHash ?? SigV4Signer.sha256Hex(body ?? Data())
    for (k, v) in signer.sign(method: method.rawValue, path: path, headers: toSign, payloadHash: hash) {
      req.headers.add(name: k, value: v)
    }
    for (k, v) in extra { req.headers.add(name: k, value: v) }
    if let body {
      req.body = .bytes(ByteBuffer(data: body))
      req.headers.add(name: "Content-Length", value: String(body.count))
    }
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
