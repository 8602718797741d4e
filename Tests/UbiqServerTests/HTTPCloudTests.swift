import Foundation
import Hummingbird
import Logging
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore
@testable import UbiqHTTPClient
@testable import UbiqServer

/// HTTPCloud and HTTPKeyValue against the real router served in-process on a loopback port
/// (embedded engine): every CloudService call, and the mapping of HTTP errors back to the
/// typed errors the engine throws.
final class HTTPCloudTests: XCTestCase {
  let container = try! ContainerID("iCloud.com.example.http")
  var dir: URL!

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("httpcloud-\(UUID().uuidString)")
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  /// Runs the server for the duration of `body`, which gets its base URL and the backend.
  func withServer(
    limits: ServerLimits = ServerLimits(), _ body: @escaping @Sendable (String, Backend) async throws -> Void
  ) async throws {
    var log = Logger(label: "test")
    log.logLevel = .warning
    let logger = log
    try await Backend.with(.embedded(directory: dir), logger: logger) { backend in
      let hub = ChangeHub(pollInterval: .milliseconds(100), logger: logger) { a, c in
        try await backend.metadata.lastChange(account: a, container: c)
      }
      let router = UbiqServer.makeRouter(backend: backend, hub: hub, metrics: ServerMetrics(), limits: limits)
      let (ports, portSink) = AsyncStream.makeStream(of: Int.self)
      let app = Application(
        router: router, configuration: .init(address: .hostname("127.0.0.1", port: 0)),
        onServerRunning: { portSink.yield($0.localAddress?.port ?? 0) }, logger: logger)
      try await withThrowingTaskGroup(of: Void.self) { group in
        group.addTask { try await app.run() }
        group.addTask { try await hub.run() }
        var it = ports.makeAsyncIterator()
        guard let port = await it.next() else { throw CloudError.unavailable("server did not start") }
        do {
          try await body("http://127.0.0.1:\(port)", backend)
        } catch {
          group.cancelAll()
          throw error
        }
        group.cancelAll()
      }
    }
  }

  static func file(_ id: String, _ data: Data) -> CloudItem {
    CloudItem(
      itemID: id, parentID: WellKnownItem.documents, name: "\(id).txt", kind: .file, mode: 0o644,
      size: Int64(data.count), mtimeNs: 1, chunks: [ChunkRef(hash: Chunker.sha256Hex(data), length: Int64(data.count))],
      deviceID: "test")
  }

  func testCloudServiceOverHTTP() async throws {
    let c = container
    let f: @Sendable (String, Data) -> CloudItem = { Self.file($0, $1) }
    try await withServer { url, backend in
      let (setupToken, _) = try await backend.createAccount("alice", quotaBytes: 1000, device: "setup")
      // Login: a device token replaces the setup token.
      let issued = try await AccountAPI(api: try APIClient(baseURL: url, token: setupToken)).registerDevice(
        name: "laptop")
      let api = try APIClient(baseURL: url, token: issued.token)
      let info = try await AccountAPI(api: api).accountInfo()
      XCTAssertEqual(info.account, "alice")
      XCTAssertEqual(info.device, "laptop")
      let cloud = HTTPCloud(api: api)
      try await cloud.ensureContainer(c)
      let data = Data("hello over http".utf8)
      let h = Chunker.sha256Hex(data)
      let missing = try await cloud.missingChunks([h])
      XCTAssertEqual(missing, [h])
      try await cloud.putChunk(hash: h, data: data)
      let none = try await cloud.missingChunks([h])
      XCTAssertEqual(none, [])
      let part = try await cloud.getChunk(hash: h, range: 6..<10)
      XCTAssertEqual(String(decoding: part, as: UTF8.self), "over")
      do {
        try await cloud.putChunk(hash: h, data: Data("tampered".utf8))
        XCTFail("expected hash mismatch")
      } catch CloudError.hashMismatch {}
      let v1 = try await cloud.putItem(c, f("a", data), ifMatch: nil)
      let v2 = try await cloud.putItem(c, f("a", data), ifMatch: v1.etag)
      do {
        _ = try await cloud.putItem(c, f("a", data), ifMatch: v1.etag)
        XCTFail("expected conflict")
      } catch CloudError.conflict(let current) {
        XCTAssertEqual(current.etag, v2.etag)
        XCTAssertEqual(current.chunks.first?.hash, h)
      }
      do {
        _ = try await cloud.putItem(c, f("b", Data("never sent".utf8)), ifMatch: nil)
        XCTFail("expected missing chunks")
      } catch CloudError.missingChunks(let hashes) {
        XCTAssertEqual(hashes, [Chunker.sha256Hex(Data("never sent".utf8))])
      }
      let unknown = try await cloud.item(c, itemID: "nope")
      XCTAssertNil(unknown)
      let got = try await cloud.item(c, itemID: "a")
      XCTAssertEqual(got?.etag, v2.etag)
      let feed = try await cloud.changes(c, since: 0, limit: 100)
      XCTAssertEqual(feed.items.map(\.itemID), [WellKnownItem.root, WellKnownItem.documents, "a"])
      // The push channel: a write wakes a waiting long-poll well under a second.
      let waiter = Task { try await cloud.waitForChanges(c, since: feed.token, timeoutMs: 20_000) }
      try await Task.sleep(for: .milliseconds(200))
      let start = ContinuousClock.now
      _ = try await cloud.deleteItem(c, itemID: "a", ifMatch: v2.etag, deviceID: "test")
      let woke = try await waiter.value
      XCTAssertTrue(woke)
      XCTAssertLessThan(ContinuousClock.now - start, .milliseconds(700))
      let idle = try await cloud.waitForChanges(c, since: feed.token + 1, timeoutMs: 100)
      XCTAssertFalse(idle)
      // Quota: 507 comes back as quotaExceeded with the account's usage.
      let big = Data(repeating: 7, count: 2000)
      do {
        try await cloud.putChunk(hash: Chunker.sha256Hex(big), data: big)
        XCTFail("expected quota error")
      } catch CloudError.quotaExceeded(let usage) {
        XCTAssertEqual(usage, Usage(usedBytes: Int64(data.count), quotaBytes: 1000, metadataBytes: 0))
        XCTAssertEqual(CloudError.quotaExceeded(usage).errno, EDQUOT)
      }
      let usage = try await cloud.usage()
      XCTAssertEqual(usage.usedBytes, Int64(data.count))
      // Revoking the device token: the next call is unauthorized.
      try await AccountAPI(api: api).revoke(tokenID: "current")
      do {
        _ = try await cloud.usage()
        XCTFail("expected unauthorized")
      } catch CloudError.unauthorized {}
    }
  }

  /// A version's settled name (`settledNameOf`) crosses the wire both ways: one put, a batch,
  /// one record, the change feed, and the answer of a refused delete.
  func testASettledNameCrossesTheWire() async throws {
    let c = container
    let f: @Sendable (String, Data) -> CloudItem = { Self.file($0, $1) }
    try await withServer { url, backend in
      let (token, _) = try await backend.createAccount("alice", quotaBytes: 1000, device: "laptop")
      let cloud = HTTPCloud(api: try APIClient(baseURL: url, token: token))
      try await cloud.ensureContainer(c)
      let data = Data("settled".utf8)
      try await cloud.putChunk(hash: Chunker.sha256Hex(data), data: data)
      let v1 = try await cloud.putItem(c, f("a", data), ifMatch: nil)
      var renamed = f("a", data)
      renamed.name = "a 2.txt"
      renamed.settledNameOf = v1.etag
      let v2 = try await cloud.putItem(c, renamed, ifMatch: v1.etag)
      XCTAssertEqual(v2.settledNameOf, v1.etag)
      let read = try await cloud.item(c, itemID: "a")
      XCTAssertEqual(read?.settledNameOf, v1.etag)
      do {
        _ = try await cloud.deleteItem(c, itemID: "a", ifMatch: v1.etag, deviceID: "laptop")
        XCTFail("expected conflict")
      } catch CloudError.conflict(let current) { XCTAssertEqual(current.settledNameOf, v1.etag) }
      renamed.name = "a 3.txt"
      renamed.settledNameOf = v2.etag
      let v3 = try await cloud.putItems(c, [ItemPut(item: renamed, ifMatch: v2.etag)]).committed.first
      XCTAssertEqual(v3?.settledNameOf, v2.etag)
      let feed = try await cloud.changes(c, since: 0, limit: 100)
      XCTAssertEqual(feed.items.first { $0.itemID == "a" }?.settledNameOf, v2.etag)
      let v4 = try await cloud.putItem(c, f("a", data), ifMatch: v3?.etag)
      XCTAssertNil(v4.settledNameOf)
    }
  }

  /// Containers per account and items per container come back as `limitExceeded` (EDQUOT on
  /// the mount); a change page stops at its byte limit and the next one carries on.
  func testLimitsOverHTTP() async throws {
    var limits = ServerLimits()
    limits.cloud.maxContainersPerAccount = 1
    limits.cloud.maxItemsPerContainer = 4  // root, Documents and two more
    limits.cloud.maxChangePageBytes = 600
    let c = container
    try await withServer(limits: limits) { url, backend in
      let (token, _) = try await backend.createAccount("carol", quotaBytes: 0, device: "setup")
      let cloud = HTTPCloud(api: try APIClient(baseURL: url, token: token))
      try await cloud.ensureContainer(c)
      try await cloud.ensureContainer(c)  // an existing container is no new one
      do {
        try await cloud.ensureContainer(try ContainerID("iCloud.com.example.second"))
        XCTFail("a second container was created")
      } catch CloudError.limitExceeded(let why) {
        XCTAssertTrue(why.contains("containers"), why)
        XCTAssertEqual(CloudError.limitExceeded(why).errno, EDQUOT)
      }
      let dir: @Sendable (String) -> CloudItem = {
        CloudItem(
          itemID: $0, parentID: WellKnownItem.documents, name: $0, kind: .directory, mode: 0o755, size: 0, mtimeNs: 1)
      }
      let a = try await cloud.putItem(c, dir("a"), ifMatch: nil)
      _ = try await cloud.putItem(c, dir("b"), ifMatch: nil)
      do {
        _ = try await cloud.putItem(c, dir("c"), ifMatch: nil)
        XCTFail("a fifth item was stored")
      } catch CloudError.limitExceeded(let why) { XCTAssertTrue(why.contains("items"), why) }
      // Changing an item adds none; deleting one makes room.
      var renamed = dir("a")
      renamed.name = "a2"
      let a2 = try await cloud.putItem(c, renamed, ifMatch: a.etag)
      _ = try await cloud.deleteItem(c, itemID: "a", ifMatch: a2.etag, deviceID: "test")
      _ = try await cloud.putItem(c, dir("c"), ifMatch: nil)
      // 600 bytes hold a few records: the feed comes in several pages, nothing lost.
      var since: Int64 = 0
      var pages = 0
      var seen: [String: Int64] = [:]
      while true {
        let page = try await cloud.changes(c, since: since, limit: 1000)
        pages += 1
        XCTAssertFalse(page.items.isEmpty)
        for item in page.items { seen[item.itemID] = item.changeSeq }
        since = page.token
        if !page.hasMore { break }
      }
      XCTAssertGreaterThan(pages, 1)
      XCTAssertEqual(Set(seen.keys), ["root", "documents", "a", "b", "c"])
      XCTAssertEqual(since, seen.values.max())
    }
  }

  func testKeyValueOverHTTP() async throws {
    let c = container
    try await withServer { url, backend in
      let (token, _) = try await backend.createAccount("bob", quotaBytes: 0, device: "setup")
      let api = try APIClient(baseURL: url, token: token)
      try await HTTPCloud(api: api).ensureContainer(c)
      let kv = HTTPKeyValue(api: api)
      let w = try await kv.kvWrite(c, KVWrite(key: "a/b", value: .object(["n": .int(1)]), timestamp: 10, device: "d"))
      XCTAssertTrue(w.applied)
      let old = try await kv.kvWrite(c, KVWrite(key: "a/b", value: .bool(false), timestamp: 5, device: "d"))
      XCTAssertFalse(old.applied)
      XCTAssertEqual(old.entry.value, .object(["n": .int(1)]))
      let snap = try await kv.kvEntries(c, since: 0)
      XCTAssertEqual(snap.entries.map(\.key), ["a/b"])
      let removed = try await kv.kvWrite(c, KVWrite(key: "a/b", value: nil, timestamp: 11, device: "d"))
      XCTAssertTrue(removed.entry.deleted)
      do {
        _ = try await kv.kvWrite(
          c, KVWrite(key: String(repeating: "k", count: 65), value: .null, timestamp: 1, device: "d"))
        XCTFail("expected invalid key")
      } catch KeyValueError.invalidKey {}
      let big = JSONValue.string(String(repeating: "x", count: 700_000))
      _ = try await kv.kvWrite(c, KVWrite(key: "big1", value: big, timestamp: 1, device: "d"))
      do {
        _ = try await kv.kvWrite(c, KVWrite(key: "big2", value: big, timestamp: 1, device: "d"))
        XCTFail("expected quota violation")
      } catch KeyValueError.quotaViolation {}
    }
  }

  /// Every typed error the server sends reads the same after the client rebuilds it: the
  /// message a user sees carries its prefix once ("name taken: ...", not "name taken: name
  /// taken: ..."), the case and its errno are kept.
  func testErrorsReadTheSameOnBothSidesOfTheWire() throws {
    let item = Self.file("a", Data("x".utf8))
    let sent: [Error] = [
      CloudError.conflict(current: item), CloudError.missingChunks(["h1", "h2"]), CloudError.hashMismatch("h3"),
      CloudError.quotaExceeded(Usage(usedBytes: 5, quotaBytes: 4)), CloudError.notFound("item x"),
      CloudError.invalid("size -1"), CloudError.exists("account alice"), CloudError.unauthorized("token revoked"),
      CloudError.invalidID("item id '..'"), CloudError.badParent("parent p is a file"),
      CloudError.cycle("x would be under itself"), CloudError.nameTaken("Documents/f is item i1"),
      CloudError.notEmpty("folder d", blockingItemID: "i7"), CloudError.limitExceeded("10 items per container"),
      KeyValueError.invalidKey("empty key"), KeyValueError.quotaViolation("over 1 MiB"),
    ]
    for error in sent {
      let api = try XCTUnwrap(APIError.from(error), "\(error)")
      let received = APIClient.error(status: Int(api.status.code), body: api.body())
      XCTAssertEqual("\(received)", "\(error)")
      XCTAssertEqual(String(describing: type(of: received)), String(describing: type(of: error)))
      if let cloud = error as? CloudError {
        XCTAssertEqual((received as? CloudError)?.errno, cloud.errno, "\(error)")
      }
      if case CloudError.notEmpty(_, let blocking) = error {
        guard case CloudError.notEmpty(_, let receivedBlocking) = received else { return XCTFail("\(received)") }
        XCTAssertEqual(receivedBlocking, blocking)
      }
    }
  }

  func testUnreachableServerFailsFastAsUnavailable() async throws {
    // A port nobody listens on.
    let cloud = HTTPCloud(api: try APIClient(baseURL: "http://127.0.0.1:9", token: "ubq_x"))
    let start = ContinuousClock.now
    do {
      _ = try await cloud.usage()
      XCTFail("expected unavailable")
    } catch CloudError.unavailable {}
    XCTAssertLessThan(ContinuousClock.now - start, .seconds(3))
    XCTAssertThrowsError(try APIClient(baseURL: "ftp://x", token: "t"))
  }

  func testTokensStayOffPlainHTTPBeyondLoopback() throws {
    for url in [
      "http://127.0.0.1:8443", "http://localhost:1", "http://[::1]:8443", "http://127.3.4.5", "https://192.0.2.7:8443",
    ] {
      XCTAssertNoThrow(try APIClient(baseURL: url, token: "t"), url)
    }
    for url in ["http://192.0.2.7:8443", "http://example.com", "http://127.0.0.1.example.com", "http://[::2]:1"] {
      XCTAssertThrowsError(try APIClient(baseURL: url, token: "t"), url) { error in
        guard case CloudError.invalid(let message) = error else { return XCTFail("\(error)") }
        XCTAssertTrue(message.contains("--insecure-http"), message)
      }
      XCTAssertNoThrow(try APIClient(baseURL: url, token: "t", allowInsecureHTTP: true), url)
    }
    XCTAssertThrowsError(try APIClient(baseURL: "https://x:1", token: "t", caCertificatePEM: "not a certificate"))
  }
}
