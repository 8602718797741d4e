import Foundation
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore

final class CloudEngineTests: XCTestCase {
  var dir: URL!
  let container = try! ContainerID("iCloud.com.example.tests")

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("cloud-\(UUID().uuidString)")
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  func file(_ id: String, _ data: Data, parent: String = WellKnownItem.documents) -> CloudItem {
    CloudItem(
      itemID: id, parentID: parent, name: "\(id).txt", kind: .file, mode: 0o644, size: Int64(data.count), mtimeNs: 1,
      chunks: data.isEmpty ? [] : [ChunkRef(hash: Chunker.sha256Hex(data), length: Int64(data.count))])
  }

  func testEtagsAndIfMatch() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    let data = Data("v1".utf8)
    try await cloud.putChunk(hash: Chunker.sha256Hex(data), data: data)
    let v1 = try await cloud.putItem(container, file("a", data), ifMatch: nil)
    // Creating it again without an etag is a conflict carrying the server's record.
    do {
      _ = try await cloud.putItem(container, file("a", data), ifMatch: nil)
      XCTFail("expected conflict")
    } catch CloudError.conflict(let current) { XCTAssertEqual(current.etag, v1.etag) }
    let v2 = try await cloud.putItem(container, file("a", data), ifMatch: v1.etag)
    XCTAssertNotEqual(v1.etag, v2.etag)
    do {
      _ = try await cloud.putItem(container, file("a", data), ifMatch: v1.etag)
      XCTFail("expected conflict on stale etag")
    } catch CloudError.conflict(let current) { XCTAssertEqual(current.etag, v2.etag) }
    let feed = try await cloud.changes(container, since: 0, limit: 100)
    XCTAssertEqual(feed.items.map(\.itemID), [WellKnownItem.root, WellKnownItem.documents, "a"])
    let del = try await cloud.deleteItem(container, itemID: "a", ifMatch: v2.etag, deviceID: "t")
    XCTAssertTrue(del.deleted)
    let after = try await cloud.changes(container, since: feed.token, limit: 100)
    XCTAssertEqual(after.items.map(\.deleted), [true])
  }

  /// A version's settled name (`settledNameOf`) is stored, read back (one record, the change
  /// feed, a refused write's answer) and kept on that version only: a write that does not send
  /// it, or sends another etag than the one it is based on, and a tombstone have none.
  func testASettledNameIsKeptOnTheVersionItWasSentWithOnly() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    let data = Data("v1".utf8)
    try await cloud.putChunk(hash: Chunker.sha256Hex(data), data: data)
    let v1 = try await cloud.putItem(container, file("a", data), ifMatch: nil)
    var renamed = file("a", data)
    renamed.name = "a 2.txt"
    renamed.settledNameOf = v1.etag
    let v2 = try await cloud.putItem(container, renamed, ifMatch: v1.etag)
    XCTAssertEqual(v2.settledNameOf, v1.etag)
    let read = try await cloud.item(container, itemID: "a")
    XCTAssertEqual(read?.settledNameOf, v1.etag)
    let feed = try await cloud.changes(container, since: 0, limit: 100)
    XCTAssertEqual(feed.items.first { $0.itemID == "a" }?.settledNameOf, v1.etag)
    do {
      _ = try await cloud.deleteItem(container, itemID: "a", ifMatch: v1.etag, deviceID: "t")
      XCTFail("expected conflict")
    } catch CloudError.conflict(let current) { XCTAssertEqual(current.settledNameOf, v1.etag) }
    // Not sent: not inherited from the version before.
    let v3 = try await cloud.putItem(container, file("a", data), ifMatch: v2.etag)
    XCTAssertNil(v3.settledNameOf)
    let reread = try await cloud.item(container, itemID: "a")
    XCTAssertNil(reread?.settledNameOf)
    // Sent with another etag than the write's own base: dropped.
    var stale = file("a", data)
    stale.settledNameOf = v1.etag
    let v4 = try await cloud.putItem(container, stale, ifMatch: v3.etag)
    XCTAssertNil(v4.settledNameOf)
    // In a batch.
    var batched = file("a", data)
    batched.settledNameOf = v4.etag
    let v5 = try await cloud.putItems(container, [ItemPut(item: batched, ifMatch: v4.etag)]).committed.first
    XCTAssertEqual(v5?.settledNameOf, v4.etag)
    let batchedRead = try await cloud.item(container, itemID: "a")
    XCTAssertEqual(batchedRead?.settledNameOf, v4.etag)
    let gone = try await cloud.deleteItem(container, itemID: "a", ifMatch: v5?.etag, deviceID: "t")
    XCTAssertNil(gone.settledNameOf)
  }

  /// The change feed as stored (what `ubiqfs serve` sends without decoding it): pages cut by
  /// count and by bytes as the decoded feed is, and its JSON reads back as the same batch.
  func testTheStoredChangeFeedReadsAsTheDecodedOne() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    var item = file("q", Data())
    item.name = "quote \" back\\slash \u{1} é 😀"
    item.xattrs = ["user.tag": Data([0, 255, 47])]
    item.conflicts = [ConflictVersion(versionID: "v1", deviceID: "d\"", mtimeNs: -1, size: 0, chunks: [])]
    _ = try await cloud.putItem(container, item, ifMatch: nil)
    for i in 0..<5 { _ = try await cloud.putItem(container, file("f\(i)", Data()), ifMatch: nil) }
    var since: Int64 = 0
    var pages = 0
    while true {
      let stored = try await cloud.storedChanges(container, since: since, limit: 3)
      let decoded = try await cloud.changes(container, since: since, limit: 3)
      let sent = try JSONDecoder().decode(ChangeBatch.self, from: stored.json())
      XCTAssertEqual(sent.items, decoded.items)
      XCTAssertEqual(sent.token, decoded.token)
      XCTAssertEqual(sent.hasMore, decoded.hasMore)
      XCTAssertLessThanOrEqual(sent.items.count, 3)
      pages += 1
      since = sent.token
      if !sent.hasMore { break }
    }
    XCTAssertEqual(pages, 3)
    let all = try await cloud.changes(container, since: 0, limit: 100)
    XCTAssertEqual(all.items.first { $0.itemID == "q" }?.name, item.name)
    // A page past its byte budget ends before the record that would pass it, never before the
    // first record.
    let rows: [(seq: Int64, record: Data)] = (1...4).map { ($0, Data(repeating: 0x20, count: 100)) }
    let cut = StoredChangePage.page(of: rows, since: 0, limit: 3, maxBytes: 250)
    XCTAssertEqual(cut.records.count, 2)
    XCTAssertEqual(cut.token, 2)
    XCTAssertTrue(cut.hasMore)
    XCTAssertEqual(StoredChangePage.page(of: rows, since: 0, limit: 3, maxBytes: 10).records.count, 1)
    let end = StoredChangePage.page(of: Array(rows.prefix(2)), since: 0, limit: 3, maxBytes: 1000)
    XCTAssertEqual(end.records.count, 2)
    XCTAssertFalse(end.hasMore)
  }

  func testChunksAreVerifiedAndRequired() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    let data = Data("payload".utf8)
    do {
      try await cloud.putChunk(hash: Chunker.sha256Hex(Data("other".utf8)), data: data)
      XCTFail("expected hash mismatch")
    } catch CloudError.hashMismatch {}
    do {
      _ = try await cloud.putItem(container, file("b", data), ifMatch: nil)
      XCTFail("expected missing chunks")
    } catch CloudError.missingChunks(let missing) { XCTAssertEqual(missing, [Chunker.sha256Hex(data)]) }
    let missing = try await cloud.missingChunks([Chunker.sha256Hex(data)])
    XCTAssertEqual(missing, [Chunker.sha256Hex(data)])
  }

  func testQuotaAndAccountIsolation() async throws {
    let alice = try CloudEngine.embedded(directory: dir, account: "alice")
    let bob = try CloudEngine.embedded(directory: dir, account: "bob")
    try await alice.setQuota(bytes: 10)
    let small = Data("12345".utf8)
    try await alice.putChunk(hash: Chunker.sha256Hex(small), data: small)
    let big = Data("1234567890".utf8)
    do {
      try await alice.putChunk(hash: Chunker.sha256Hex(big), data: big)
      XCTFail("expected quota error")
    } catch CloudError.quotaExceeded(let u) {
      XCTAssertEqual(u.usedBytes, 5)
      XCTAssertEqual(CloudError.quotaExceeded(u).errno, EDQUOT)
    }
    // Bob cannot read Alice's chunk by guessing its hash.
    do {
      _ = try await bob.getChunk(hash: Chunker.sha256Hex(small), range: nil)
      XCTFail("expected not found")
    } catch CloudError.notFound {}
    let got = try await alice.getChunk(hash: Chunker.sha256Hex(small), range: 1..<3)
    XCTAssertEqual(got, Data("23".utf8))
  }
}
