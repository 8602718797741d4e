import Foundation
import Hummingbird
import NIOCore
import NIOFoundationCompat
import UbiqCloud
import UbiqCloudAPI
import UbiqCore

/// The `/v1` HTTP API (docs/protocol.md): every handler authenticates through
/// `AuthMiddleware`, binds a `CloudEngine` to the token's account and calls it. Accounts only
/// ever reach their own containers, items and chunks because the account comes from the
/// token, never from the request.
struct APIRoutes: Sendable {
  let backend: Backend
  let hub: ChangeHub
  let metrics: ServerMetrics
  let limits: ServerLimits
  let longPolls = LongPollCounter()

  typealias Ctx = UbiqRequestContext
  typealias H = HTTPHelpers

  func engine(_ context: Ctx) throws -> CloudEngine {
    let engine = backend.engine(account: try context.requireIdentity().account)
    engine.limits = limits.cloud
    return engine
  }

  func register(on router: Router<Ctx>) {
    let v1 = router.group("v1").add(middleware: AuthMiddleware(accounts: backend.metadata, metrics: metrics))
    // Account and devices.
    v1.get("account", use: account)
    v1.get("usage", use: usage)
    v1.get("devices", use: devices)
    v1.post("devices", use: addDevice)
    v1.delete("devices/:id", use: revokeDevice)
    // A parameter, not the literal `current`, so `DELETE devices/current` still reaches
    // `revokeDevice` (the router prefers literal segments).
    v1.post("devices/:id/rotate", use: rotateDevice)
    // Containers and items.
    v1.get("containers", use: containers)
    v1.put("containers/:container", use: ensureContainer)
    v1.get("containers/:container/items/:item", use: getItem)
    v1.put("containers/:container/items/:item", use: putItem)
    v1.post("containers/:container/items", use: putItems)
    v1.delete("containers/:container/items/:item", use: deleteItem)
    v1.post("containers/:container/deletes", use: deleteItems)
    v1.get("containers/:container/changes", use: changes)
    v1.get("containers/:container/changes/wait", use: waitForChanges)
    // Chunks.
    v1.post("chunks/missing", use: missingChunks)
    v1.put("chunks/:hash", use: putChunk)
    v1.get("chunks/:hash", use: getChunk)
    v1.head("chunks/:hash", use: headChunk)
    // Key-value store.
    v1.get("containers/:container/kv", use: kvList)
    v1.put("containers/:container/kv/:key", use: kvPut)
    v1.delete("containers/:container/kv/:key", use: kvDelete)
  }

  // MARK: account

  struct AccountInfo: Encodable {
    var account: String
    var device: String
    var tokenID: String
    var usage: Usage
  }

  @Sendable func account(_ request: Request, context: Ctx) async throws -> Response {
    let id = try context.requireIdentity()
    let usage = try await engine(context).usage()
    return try H.response(AccountInfo(account: id.account, device: id.device, tokenID: id.id, usage: usage))
  }

  @Sendable func usage(_ request: Request, context: Ctx) async throws -> Response {
    try H.response(try await engine(context).usage())
  }

  struct DeviceList: Encodable { var devices: [TokenRecord] }
  struct NewDeviceRequest: Decodable {
    var name: String
    /// Seconds from now; absent: the token never expires.
    var expiresIn: Int64?
  }
  struct NewDevice: Encodable {
    var token: String
    var device: TokenRecord
  }

  @Sendable func devices(_ request: Request, context: Ctx) async throws -> Response {
    let id = try context.requireIdentity()
    return try H.response(DeviceList(devices: try await backend.metadata.tokens(account: id.account)))
  }

  /// Mints a device token; only an account token may.
  @Sendable func addDevice(_ request: Request, context: Ctx) async throws -> Response {
    let id = try context.requireAccountScope("mint tokens")
    let body = try H.json(NewDeviceRequest.self, try await H.body(request, limit: 64 << 10))
    let (token, record) = try await backend.issueToken(
      account: id.account, device: body.name, scope: .device, expiresIn: body.expiresIn)
    return try H.response(NewDevice(token: token, device: record), status: .created)
  }

  /// Swaps the calling token (`current` or its own id) for a new one (same id, device, scope
  /// and expiry).
  @Sendable func rotateDevice(_ request: Request, context: Ctx) async throws -> Response {
    let id = try context.requireIdentity()
    let target = try H.param(context, "id")
    guard target == "current" || target == id.id else {
      throw APIError(.forbidden, "insufficient_scope", "a token can only rotate itself (use 'current')")
    }
    guard let hash = context.tokenHash else { throw APIError.unauthorized("missing bearer token") }
    let (token, record) = try await backend.rotateToken(id, oldHash: hash)
    return try H.response(NewDevice(token: token, device: record))
  }

  struct Revoked: Encodable { var revoked: String }

  /// Revokes a token of the account: any with an account token, only itself with a device token.
  @Sendable func revokeDevice(_ request: Request, context: Ctx) async throws -> Response {
    let id = try context.requireIdentity()
    var target = try H.param(context, "id")
    if target == "current" { target = id.id }
    if target != id.id { _ = try context.requireAccountScope("revoke other tokens") }
    guard try await backend.metadata.revokeToken(account: id.account, id: target) else {
      throw APIError(.notFound, "not_found", "no live token \(target) in this account")
    }
    return try H.response(Revoked(revoked: target))
  }

  // MARK: containers and items

  struct ContainerList: Encodable { var containers: [String] }
  struct ContainerInfo: Encodable {
    var container: String
    var token: Int64
  }

  @Sendable func containers(_ request: Request, context: Ctx) async throws -> Response {
    try H.response(ContainerList(containers: try await engine(context).containers()))
  }

  @Sendable func ensureContainer(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let e = try engine(context)
    try await e.ensureContainer(c)
    return try H.response(ContainerInfo(container: c.rawValue, token: try await e.lastChange(c)))
  }

  static func etagHeader(_ item: CloudItem) -> HTTPFields { [.eTag: "\"\(item.etag)\""] }

  @Sendable func getItem(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let itemID = try H.itemID(context)
    guard let item = try await engine(context).item(c, itemID: itemID) else {
      throw APIError(.notFound, "not_found", "no item \(itemID) in \(c)")
    }
    return try H.response(item, headers: Self.etagHeader(item))
  }

  @Sendable func putItem(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let itemID = try H.itemID(context)
    let item = try H.json(CloudItem.self, try await H.body(request, limit: limits.maxJSONBytes))
    guard item.itemID == itemID else {
      throw APIError.badRequest("invalid", "the body's itemID '\(item.itemID)' does not match the path")
    }
    do { try ItemName.validateInCloud(item.name) } catch let e as UbiqError {
      if case .nameTooLong = e { throw APIError.badRequest("name_too_long", e.description) }
      throw APIError.badRequest("invalid_name", e.description)
    }
    let ifMatch = H.ifMatch(request)
    let stored: CloudItem
    do {
      stored = try await engine(context).putItem(c, item, ifMatch: ifMatch)
    } catch let e as CloudError {
      if case .conflict = e { metrics.conflicts.increment() }
      throw e
    }
    metrics.commits.increment()
    await hub.notify(account: try context.requireIdentity().account, container: c.rawValue, seq: stored.changeSeq)
    return try H.response(stored, status: ifMatch == nil ? .created : .ok, headers: Self.etagHeader(stored))
  }

  /// The body of `POST .../items`: item versions, committed in order in one transaction.
  struct PutItemsRequest: Decodable, JSONReadable {
    var puts: [ItemPut]

    static func read(from reader: inout JSONReader) throws -> PutItemsRequest {
      var puts: [ItemPut]?
      try reader.object { r, key in
        if key == "puts" { puts = try r.array { try ItemPut.read(from: &$0) } } else { try r.skipValue() }
      }
      guard let puts else { throw JSONReader.Failure.missing(field: "puts") }
      return PutItemsRequest(puts: puts)
    }
  }

  @Sendable func putItems(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let body = try H.json(PutItemsRequest.self, try await H.body(request, limit: limits.maxJSONBytes))
    let results = try await engine(context).putItems(c, body.puts)
    return try await batchAnswer(results, container: c, context: context)
  }

  /// The body of `POST .../deletes`: deletes, carried out in order in one transaction.
  struct DeleteItemsRequest: Decodable {
    var deletes: [ItemDelete]
  }

  @Sendable func deleteItems(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let body = try H.json(DeleteItemsRequest.self, try await H.body(request, limit: limits.maxJSONBytes))
    let identity = try context.requireIdentity()
    let device = request.uri.queryParameters.get("device") ?? identity.device
    let results = try await engine(context).deleteItems(c, body.deletes, deviceID: device)
    return try await batchAnswer(results, container: c, context: context)
  }

  /// The answer to a batch: `{"committed": [records], "refused": error body}`. Counts the
  /// commits and tells the change hub of the newest.
  func batchAnswer(_ results: ItemBatchResults, container c: ContainerID, context: Ctx) async throws -> Response {
    metrics.commits.increment(by: Int64(results.committed.count))
    var refused: APIError.Body?
    if let error = results.refused {
      if case .conflict = error { metrics.conflicts.increment() }
      let api = APIError.from(cloud: error)
      refused = api.bodyFields(status: Int(api.status.code))
    }
    if let newest = results.committed.map(\.changeSeq).max() {
      await hub.notify(account: try context.requireIdentity().account, container: c.rawValue, seq: newest)
    }
    // The records are written by RecordJSON (the batch's answer is most of a drain's JSON).
    var answer: [UInt8] = Array(#"{"committed":"#.utf8)
    RecordJSON.writeArray(results.committed, into: &answer)
    if let refused {
      answer.append(contentsOf: #","refused":"#.utf8)
      answer.append(contentsOf: try H.encoder.encode(refused))
    }
    answer.append(UInt8(ascii: "}"))
    return H.response(json: Data(answer))
  }

  @Sendable func deleteItem(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let itemID = try H.itemID(context)
    let identity = try context.requireIdentity()
    let device = request.uri.queryParameters.get("device") ?? identity.device
    let stored: CloudItem
    do {
      stored = try await engine(context).deleteItem(c, itemID: itemID, ifMatch: H.ifMatch(request), deviceID: device)
    } catch let e as CloudError {
      if case .conflict = e { metrics.conflicts.increment() }
      throw e
    }
    metrics.commits.increment()
    await hub.notify(account: identity.account, container: c.rawValue, seq: stored.changeSeq)
    return try H.response(stored, headers: Self.etagHeader(stored))
  }

  @Sendable func changes(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let since = try H.intQuery(request, "since", default: 0, range: 0...Int64.max)
    let limit = try H.intQuery(request, "limit", default: 1000, range: 1...100_000)
    // The records go out as stored, without being decoded and encoded again.
    return H.response(json: try await engine(context).storedChanges(c, since: since, limit: Int(limit)).json())
  }

  struct WaitResult: Encodable {
    var changed: Bool
    var token: Int64
  }

  @Sendable func waitForChanges(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let since = try H.intQuery(request, "since", default: 0, range: 0...Int64.max)
    let timeout = try H.intQuery(request, "timeout", default: 25_000, range: 0...Int64(limits.maxWaitMs))
    let identity = try context.requireIdentity()
    guard longPolls.enter(identity.id, limit: limits.maxLongPollsPerToken) else {
      throw APIError(
        .tooManyRequests, "too_many_requests",
        "this token has \(limits.maxLongPollsPerToken) long-polls waiting already, the most it may have")
    }
    defer { longPolls.leave(identity.id) }
    metrics.longPolls.increment()
    defer { metrics.longPolls.decrement() }
    let r = try await hub.wait(
      account: identity.account, container: c.rawValue, since: since, timeout: .milliseconds(timeout))
    return try H.response(WaitResult(changed: r.changed, token: r.token))
  }

  // MARK: chunks

  struct MissingRequest: Decodable { var hashes: [String] }
  struct MissingResponse: Encodable { var missing: [String] }

  @Sendable func missingChunks(_ request: Request, context: Ctx) async throws -> Response {
    let body = try H.json(MissingRequest.self, try await H.body(request, limit: limits.maxJSONBytes))
    for h in body.hashes where !Chunker.isValidHash(h) {
      throw APIError.badRequest("invalid_hash", "'\(h.prefix(80))' is not a lower-case SHA-256 hex digest")
    }
    let missing = try await engine(context).missingChunks(body.hashes)
    // Keep the caller's order.
    var seen = Set<String>()
    let ordered = body.hashes.filter { missing.contains($0) && seen.insert($0).inserted }
    return try H.response(MissingResponse(missing: ordered))
  }

  static func hash(_ context: Ctx) throws -> String {
    let h = try H.param(context, "hash")
    guard Chunker.isValidHash(h) else {
      throw APIError.badRequest("invalid_hash", "'\(h.prefix(80))' is not a lower-case SHA-256 hex digest")
    }
    return h
  }

  struct StoredChunk: Encodable {
    var hash: String
    var size: Int
  }

  @Sendable func putChunk(_ request: Request, context: Ctx) async throws -> Response {
    let hash = try Self.hash(context)
    let data = try await H.body(request, limit: limits.maxChunkBytes)
    do {
      try await engine(context).putChunk(hash: hash, data: data)
    } catch let e as CloudError {
      if case .quotaExceeded = e { metrics.quotaRejections.increment() }
      throw e
    }
    metrics.chunkBytesIn.increment(by: data.count)
    return try H.response(StoredChunk(hash: hash, size: data.count), status: .created)
  }

  /// Parses a single `bytes=` range against a size: nil for no/ignored header, or a range
  /// (possibly unsatisfiable: lower >= size).
  static func byteRange(_ header: String?, size: Int64) throws -> Range<Int64>? {
    guard let header = header?.trimmingCharacters(in: .whitespaces), !header.isEmpty else { return nil }
    guard header.hasPrefix("bytes="), !header.contains(",") else {
      throw APIError(.rangeNotSatisfiable, "bad_range", "only a single 'bytes=' range is supported")
    }
    let spec = header.dropFirst(6)
    let parts = spec.split(separator: "-", maxSplits: 1, omittingEmptySubsequences: false)
    guard parts.count == 2 else { throw APIError(.rangeNotSatisfiable, "bad_range", "bad Range '\(header)'") }
    if parts[0].isEmpty {
      guard let n = Int64(parts[1]), n > 0 else {
        throw APIError(.rangeNotSatisfiable, "bad_range", "bad Range '\(header)'")
      }
      return max(0, size - n)..<size
    }
    guard let first = Int64(parts[0]), first >= 0 else {
      throw APIError(.rangeNotSatisfiable, "bad_range", "bad Range '\(header)'")
    }
    var last = size - 1
    if !parts[1].isEmpty {
      guard let l = Int64(parts[1]), l >= first else {
        throw APIError(.rangeNotSatisfiable, "bad_range", "bad Range '\(header)'")
      }
      last = min(l, size - 1)
    }
    return first..<max(first, last + 1)
  }

  @Sendable func getChunk(_ request: Request, context: Ctx) async throws -> Response {
    let hash = try Self.hash(context)
    let e = try engine(context)
    let size = try await e.chunkSize(hash: hash)
    var headers: HTTPFields = [
      .contentType: "application/octet-stream", .acceptRanges: "bytes", .eTag: "\"\(hash)\"",
    ]
    guard let range = try Self.byteRange(request.headers[.range], size: size) else {
      let data = try await e.getChunk(hash: hash, range: nil)
      metrics.chunkBytesOut.increment(by: data.count)
      return Response(status: .ok, headers: headers, body: .init(byteBuffer: ByteBuffer(data: data)))
    }
    if range.lowerBound >= size {
      headers[.contentRange] = "bytes */\(size)"
      var err = APIError(.rangeNotSatisfiable, "bad_range", "range starts past the chunk's \(size) bytes").response()
      err.headers[.contentRange] = "bytes */\(size)"
      return err
    }
    let data = try await e.getChunk(hash: hash, range: range)
    metrics.chunkBytesOut.increment(by: data.count)
    headers[.contentRange] = "bytes \(range.lowerBound)-\(range.upperBound - 1)/\(size)"
    return Response(status: .partialContent, headers: headers, body: .init(byteBuffer: ByteBuffer(data: data)))
  }

  @Sendable func headChunk(_ request: Request, context: Ctx) async throws -> Response {
    let hash = try Self.hash(context)
    let size = try await engine(context).chunkSize(hash: hash)
    return Response(
      status: .ok,
      headers: [
        .contentType: "application/octet-stream", .contentLength: String(size), .acceptRanges: "bytes",
        .eTag: "\"\(hash)\"",
      ])
  }

  // MARK: key-value store

  @Sendable func kvList(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let since = try H.intQuery(request, "since", default: 0, range: 0...Int64.max)
    return try H.response(try await engine(context).kvEntries(c, since: since))
  }

  struct KVPutBody: Decodable {
    var value: JSONValue
    var timestamp: Int64?
    var device: String?

    enum CodingKeys: String, CodingKey { case value, timestamp, device }
    init(from decoder: Decoder) throws {
      let c = try decoder.container(keyedBy: CodingKeys.self)
      guard c.contains(.value) else {
        throw DecodingError.keyNotFound(CodingKeys.value, .init(codingPath: [], debugDescription: "value"))
      }
      value = try c.decodeIfPresent(JSONValue.self, forKey: .value) ?? .null
      timestamp = try c.decodeIfPresent(Int64.self, forKey: .timestamp)
      device = try c.decodeIfPresent(String.self, forKey: .device)
    }
  }

  @Sendable func kvPut(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let key = try H.param(context, "key")
    let identity = try context.requireIdentity()
    let body = try H.json(KVPutBody.self, try await H.body(request, limit: limits.maxKVBodyBytes))
    let write = KVWrite(
      key: key, value: body.value, timestamp: body.timestamp ?? Clock.nowNs(), device: body.device ?? identity.id)
    return try H.response(try await engine(context).kvWrite(c, write))
  }

  @Sendable func kvDelete(_ request: Request, context: Ctx) async throws -> Response {
    let c = try H.container(context)
    let key = try H.param(context, "key")
    let identity = try context.requireIdentity()
    let ts = try H.intQuery(request, "timestamp", default: Clock.nowNs(), range: 0...Int64.max)
    let device = request.uri.queryParameters.get("device") ?? identity.id
    return try H.response(
      try await engine(context).kvWrite(c, KVWrite(key: key, value: nil, timestamp: ts, device: device)))
  }
}
