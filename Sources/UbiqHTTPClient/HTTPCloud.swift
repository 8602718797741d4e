import AsyncHTTPClient
import Foundation
import NIOCore
import NIOHTTP1
import UbiqCloudAPI
import UbiqCore

/// `CloudService` over the HTTP API of `ubiqfs serve` (docs/protocol.md), for one signed-in
/// account. Every request is bounded (2 s connect, 30 s request, long-polls their timeout
/// plus 15 s), so an unreachable server surfaces as `CloudError.unavailable`, never a hang.
/// Sendable: `unbatched` is guarded by `lock`; otherwise immutable after init, and requests
/// share nothing but the thread-safe HTTP client.
public final class HTTPCloud: CloudService, @unchecked Sendable {
  public let api: APIClient
  private let lock = NSLock()
  /// The batch routes the server answered 404 to (it has none): their requests go one by one.
  private var unbatched: Set<String> = []

  public init(api: APIClient) { self.api = api }

  func containerPath(_ c: ContainerID) -> String { "/v1/containers/\(APIClient.segment(c.rawValue))" }

  public func ensureContainer(_ container: ContainerID) async throws {
    _ = try await api.send(.PUT, containerPath(container))
  }

  struct MissingRequest: Codable { var hashes: [String] }
  struct MissingResponse: Codable { var missing: [String] }

  public func missingChunks(_ hashes: [String]) async throws -> Set<String> {
    var missing = Set<String>()
    // Keep each request small (the server bounds JSON bodies).
    for start in stride(from: 0, to: hashes.count, by: 10_000) {
      let slice = Array(hashes[start..<min(start + 10_000, hashes.count)])
      let r = try await api.send(.POST, "/v1/chunks/missing", body: try api.encode(MissingRequest(hashes: slice)))
      missing.formUnion(try api.json(MissingResponse.self, r.body).missing)
    }
    return missing
  }

  public func putChunk(hash: String, data: Data) async throws {
    _ = try await api.send(
      .PUT, "/v1/chunks/\(APIClient.segment(hash))", body: data, contentType: "application/octet-stream",
      timeout: .seconds(60))
  }

  public func getChunk(hash: String, range: Range<Int64>?) async throws -> Data {
    var headers: [(String, String)] = []
    if let range {
      if range.isEmpty { return Data() }
      headers.append(("Range", "bytes=\(range.lowerBound)-\(range.upperBound - 1)"))
    }
    let r = try await api.send(
      .GET, "/v1/chunks/\(APIClient.segment(hash))", headers: headers, timeout: .seconds(60), accept: [416])
    return r.status == 416 ? Data() : r.body
  }

  func itemPath(_ c: ContainerID, _ id: String) -> String { containerPath(c) + "/items/\(APIClient.segment(id))" }

  public func putItem(_ container: ContainerID, _ item: CloudItem, ifMatch: String?) async throws -> CloudItem {
    let headers = ifMatch.map { [("If-Match", "\"\($0)\"")] } ?? []
    let r = try await api.send(.PUT, itemPath(container, item.itemID), body: try api.encode(item), headers: headers)
    return try api.json(CloudItem.self, r.body)
  }

  /// The answer to a batch of versions or deletes.
  struct BatchResponse: Decodable, JSONReadable {
    var committed: [CloudItem]
    var refused: Refused?

    static func read(from reader: inout JSONReader) throws -> BatchResponse {
      var committed: [CloudItem]?
      var refused: Refused?
      try reader.object { r, key in
        switch key {
        case "committed": committed = try r.array { try CloudItem.read(from: &$0) }
        case "refused": refused = try r.null() ? nil : JSONDecoder().decode(Refused.self, from: r.rawValue())
        default: try r.skipValue()
        }
      }
      guard let committed else { throw JSONReader.Failure.missing(field: "committed") }
      return BatchResponse(committed: committed, refused: refused)
    }
  }
  /// A refused version: an error body with the status a single PUT would have answered.
  struct Refused: Codable {
    var status: Int
    var error: String
    var code: String
    var current: CloudItem?
    var missing: [String]?
    var usage: Usage?
    var blockingItem: String?
  }

  public func putItems(_ container: ContainerID, _ puts: [ItemPut]) async throws -> ItemBatchResults {
    try await batch(
      containerPath(container) + "/items", query: [], body: ItemPut.batchJSON(puts), sent: puts.map(\.item.itemID),
      what: "stored versions", oneByOne: { try await putItemsOneByOne(container, puts) })
  }

  public func deleteItems(_ container: ContainerID, _ deletes: [ItemDelete], deviceID: String) async throws
    -> ItemBatchResults
  {
    try await batch(
      containerPath(container) + "/deletes", query: [("device", deviceID)], body: ItemDelete.batchJSON(deletes),
      sent: deletes.map(\.itemID), what: "deletes done", tombstones: true,
      oneByOne: { try await deleteItemsOneByOne(container, deletes, deviceID: deviceID) })
  }

  /// Sends a batch of versions or deletes of the items `sent` and checks its answer: the
  /// records of the ones done, in order (tombstones for deletes), then the refusal if one was
  /// refused. A server without batches answers 404; it (or one that lacks the container, which a
  /// single request then says) gets them one by one.
  private func batch(
    _ path: String, query: [(String, String)], body: Data, sent: [String], what: String, tombstones: Bool = false,
    oneByOne: () async throws -> ItemBatchResults
  ) async throws -> ItemBatchResults {
    let count = sent.count
    if lock.withLock({ unbatched.contains(path) }) { return try await oneByOne() }
    let r: (status: Int, headers: HTTPHeaders, body: Data)
    do {
      r = try await api.send(.POST, path, query: query, body: body)
    } catch CloudError.notFound {
      let results = try await oneByOne()
      if !results.committed.isEmpty { lock.withLock { _ = unbatched.insert(path) } }
      return results
    }
    let answer = try api.json(BatchResponse.self, r.body)
    guard answer.refused == nil ? answer.committed.count == count : answer.committed.count < count else {
      throw CloudError.unavailable("the server answered \(answer.committed.count) \(what) to a batch of \(count)")
    }
    for (record, itemID) in zip(answer.committed, sent)
    where record.itemID != itemID || (tombstones && !record.deleted) {
      throw CloudError.unavailable("the server answered a record of \(record.itemID) for \(itemID) in a batch")
    }
    var refused: CloudError?
    if let body = answer.refused {
      switch APIClient.error(status: body.status, body: try api.encode(body)) {
      case let error as CloudError: refused = error
      case let error: refused = .unavailable("\(error)")
      }
    }
    return ItemBatchResults(committed: answer.committed, refused: refused)
  }

  public func deleteItem(_ container: ContainerID, itemID: String, ifMatch: String?, deviceID: String) async throws
    -> CloudItem
  {
    let headers = ifMatch.map { [("If-Match", "\"\($0)\"")] } ?? []
    let r = try await api.send(
      .DELETE, itemPath(container, itemID), query: [("device", deviceID)], headers: headers)
    return try api.json(CloudItem.self, r.body)
  }

  public func item(_ container: ContainerID, itemID: String) async throws -> CloudItem? {
    do {
      let r = try await api.send(.GET, itemPath(container, itemID))
      return try api.json(CloudItem.self, r.body)
    } catch CloudError.notFound {
      return nil
    }
  }

  public func changes(_ container: ContainerID, since: Int64, limit: Int) async throws -> ChangeBatch {
    let r = try await api.send(
      .GET, containerPath(container) + "/changes", query: [("since", String(since)), ("limit", String(limit))])
    return try api.json(ChangeBatch.self, r.body)
  }

  public func usage() async throws -> Usage {
    try api.json(Usage.self, try await api.send(.GET, "/v1/usage").body)
  }

  struct WaitResponse: Codable {
    var changed: Bool
    var token: Int64
  }

  public func waitForChanges(_ container: ContainerID, since: Int64, timeoutMs: Int) async throws -> Bool {
    let ms = max(0, min(timeoutMs, 60_000))
    let r = try await api.send(
      .GET, containerPath(container) + "/changes/wait", query: [("since", String(since)), ("timeout", String(ms))],
      timeout: .milliseconds(Int64(ms) + 15_000))
    return try api.json(WaitResponse.self, r.body).changed
  }

  /// The account's containers.
  public func containers() async throws -> [String] {
    struct List: Codable { var containers: [String] }
    return try api.json(List.self, try await api.send(.GET, "/v1/containers").body).containers
  }
}

/// `KeyValueService` over the HTTP API (the per-container key-value store).
/// Sendable: immutable after init.
public final class HTTPKeyValue: KeyValueService, @unchecked Sendable {
  public let api: APIClient
  public init(api: APIClient) { self.api = api }

  func kvPath(_ c: ContainerID) -> String { "/v1/containers/\(APIClient.segment(c.rawValue))/kv" }

  public func kvEntries(_ container: ContainerID, since: Int64) async throws -> KVSnapshot {
    let r = try await api.send(.GET, kvPath(container), query: [("since", String(since))])
    return try api.json(KVSnapshot.self, r.body)
  }

  struct PutBody: Codable {
    var value: JSONValue
    var timestamp: Int64
    var device: String
  }

  public func kvWrite(_ container: ContainerID, _ write: KVWrite) async throws -> KVWriteResult {
    let path = kvPath(container) + "/" + APIClient.segment(write.key)
    let r: (status: Int, headers: HTTPHeaders, body: Data)
    if let value = write.value {
      r = try await api.send(
        .PUT, path, body: try api.encode(PutBody(value: value, timestamp: write.timestamp, device: write.device)))
    } else {
      r = try await api.send(
        .DELETE, path, query: [("timestamp", String(write.timestamp)), ("device", write.device)])
    }
    return try api.json(KVWriteResult.self, r.body)
  }
}
