import Foundation
import GRDB
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore

/// Item records count against the account's quota (`MetadataCost`) on the embedded engine:
/// what a record costs, that deleting frees it, that a write past the quota is refused, and
/// that the kept sum always equals the sum over the stored records.
final class MetadataCostTests: XCTestCase {
  var dir: URL!
  let container = try! ContainerID("iCloud.com.example.cost")

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("cost-\(UUID().uuidString)")
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  func folder(_ id: String, xattrBytes: Int = 0) -> CloudItem {
    var item = CloudItem(
      itemID: id, parentID: WellKnownItem.documents, name: id, kind: .directory, mode: 0o755, size: 0, mtimeNs: 1)
    if xattrBytes > 0 { item.xattrs = ["note": Data(repeating: 0x61, count: xattrBytes)] }
    return item
  }

  /// The sum the store keeps must equal the cost recomputed from every stored record.
  func assertKeptSumMatchesRecords(_ cloud: CloudEngine, file: StaticString = #filePath, line: UInt = #line)
    async throws
  {
    let store = try XCTUnwrap(cloud.metadata as? SQLiteMetadataStore)
    let recomputed = try await store.pool.read { db in
      try Int64.fetchOne(
        db,
        sql: """
          SELECT coalesce(sum(? + length(record)), 0) FROM items WHERE account = ? AND deleted = 0
            AND itemID NOT IN ('root', 'documents')
          """, arguments: [MetadataCost.perItem, cloud.account]) ?? -1
    }
    let usage = try await cloud.usage()
    XCTAssertEqual(usage.metadataBytes, recomputed, file: file, line: line)
  }

  func testRecordsCostTheirStoredBytesPlusAFixedAmountAndDeletingFreesThem() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    let empty = try await cloud.usage()
    XCTAssertEqual(empty, Usage(usedBytes: 0, quotaBytes: 0, metadataBytes: 0), "an empty container is free")

    let a = try await cloud.putItem(container, folder("a"), ifMatch: nil)
    let one = try await cloud.usage()
    let stored = try JSONEncoder().encode(a).count
    XCTAssertGreaterThanOrEqual(one.metadataBytes ?? 0, MetadataCost.perItem + Int64(stored) - 64)
    XCTAssertLessThanOrEqual(one.metadataBytes ?? 0, MetadataCost.perItem + Int64(stored) + 64)
    XCTAssertEqual(one.usedBytes, one.metadataBytes)
    try await assertKeptSumMatchesRecords(cloud)

    // Extended attributes are metadata too: 10 KB of them cost 10 KB or more.
    let a2 = try await cloud.putItem(container, folder("a", xattrBytes: 10_000), ifMatch: a.etag)
    let grown = try await cloud.usage()
    XCTAssertGreaterThanOrEqual((grown.metadataBytes ?? 0) - (one.metadataBytes ?? 0), 10_000)
    try await assertKeptSumMatchesRecords(cloud)

    // Chunks and metadata add up.
    let data = Data("content".utf8)
    try await cloud.putChunk(hash: Chunker.sha256Hex(data), data: data)
    let withChunk = try await cloud.usage()
    XCTAssertEqual(withChunk.usedBytes, grown.usedBytes + Int64(data.count))
    XCTAssertEqual(withChunk.chunkBytes, Int64(data.count))

    _ = try await cloud.deleteItem(container, itemID: "a", ifMatch: a2.etag, deviceID: "test")
    let freed = try await cloud.usage()
    XCTAssertEqual(freed.metadataBytes, 0, "a tombstone is free")
    XCTAssertEqual(freed.usedBytes, Int64(data.count))
    try await assertKeptSumMatchesRecords(cloud)
  }

  func testAWriteThatWouldGrowMetadataPastTheQuotaIsRefusedAndChangesNothing() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    let a = try await cloud.putItem(container, folder("a"), ifMatch: nil)
    let before = try await cloud.usage()
    try await cloud.metadata.setQuota(account: cloud.account, bytes: before.usedBytes + 2_000)

    do {
      _ = try await cloud.putItem(container, folder("a", xattrBytes: 5_000), ifMatch: a.etag)
      XCTFail("5 KB of extended attributes were stored past the quota")
    } catch CloudError.quotaExceeded(let usage) {
      XCTAssertEqual(usage.usedBytes, before.usedBytes)
      XCTAssertEqual(CloudError.quotaExceeded(usage).errno, EDQUOT)
    }
    do {
      for i in 0..<10 { _ = try await cloud.putItem(container, folder("n\(i)"), ifMatch: nil) }
      XCTFail("ten new items fit in 2,000 bytes")
    } catch CloudError.quotaExceeded {}
    let current = try await cloud.item(container, itemID: "a")
    XCTAssertEqual(current?.etag, a.etag, "the refused write left the record as it was")
    let after = try await cloud.usage()
    XCTAssertLessThanOrEqual(after.usedBytes, before.usedBytes + 2_000)
    try await assertKeptSumMatchesRecords(cloud)
    // Smaller records and deletes always pass.
    _ = try await cloud.deleteItem(container, itemID: "a", ifMatch: a.etag, deviceID: "test")
    try await assertKeptSumMatchesRecords(cloud)
  }
}
