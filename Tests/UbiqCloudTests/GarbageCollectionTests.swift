import Foundation
import GRDB
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore

/// Chunk garbage collection on the embedded engine: what a pass deletes, what it must keep,
/// and how uploads meet a pass in progress.
final class GarbageCollectionTests: XCTestCase {
  var dir: URL!
  let container = try! ContainerID("iCloud.com.example.gc")

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("gc-\(UUID().uuidString)")
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  func hash(_ text: String) -> String { Chunker.sha256Hex(Data(text.utf8)) }

  func put(_ cloud: CloudEngine, _ text: String) async throws {
    try await cloud.putChunk(hash: hash(text), data: Data(text.utf8))
  }

  func file(_ id: String, _ text: String, conflicts: [String] = []) -> CloudItem {
    var item = CloudItem(
      itemID: id, parentID: WellKnownItem.documents, name: "\(id).txt", kind: .file, mode: 0o644,
      size: Int64(text.utf8.count), mtimeNs: 1, chunks: [ChunkRef(hash: hash(text), length: Int64(text.utf8.count))])
    if !conflicts.isEmpty {
      item.conflicts = conflicts.map {
        ConflictVersion(
          versionID: "v-\(hash($0).prefix(8))", deviceID: "other", mtimeNs: 1, size: Int64($0.utf8.count),
          chunks: [ChunkRef(hash: hash($0), length: Int64($0.utf8.count))])
      }
    }
    return item
  }

  /// Makes every chunk of the cloud look last used two hours ago.
  func ageChunks(_ cloud: CloudEngine) throws {
    let store = try XCTUnwrap(cloud.metadata as? SQLiteMetadataStore)
    try store.pool.write { db in try db.execute(sql: "UPDATE chunks SET lastUsed = lastUsed - 7200") }
  }

  func blobExists(_ text: String) -> Bool {
    let h = hash(text)
    return FileManager.default.fileExists(
      atPath: dir.appendingPathComponent("blobs/local/\(h.prefix(2))/\(h)").path)
  }

  func testAPassDeletesUnreferencedChunksPastTheirGraceAndKeepsEveryReferencedOne() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    for text in ["current", "orphan", "replaced", "newer", "their version"] { try await put(cloud, text) }
    _ = try await cloud.putItem(container, file("a", "current"), ifMatch: nil)
    let c1 = try await cloud.putItem(container, file("c", "replaced"), ifMatch: nil)
    _ = try await cloud.putItem(container, file("c", "newer", conflicts: ["their version"]), ifMatch: c1.etag)
    let before = try await cloud.usage().usedBytes
    try ageChunks(cloud)

    let collected = try await cloud.collectGarbage(grace: 3600)

    XCTAssertEqual(collected, CollectedChunks(chunks: 2, bytes: Int64("orphan".count + "replaced".count)))
    let after = try await cloud.usage().usedBytes
    XCTAssertEqual(after, before - collected.bytes)
    for gone in ["orphan", "replaced"] {
      XCTAssertFalse(blobExists(gone), gone)
      do {
        _ = try await cloud.getChunk(hash: hash(gone), range: nil)
        XCTFail("\(gone) is still readable")
      } catch CloudError.notFound {}
    }
    for kept in ["current", "newer", "their version"] {
      let data = try await cloud.getChunk(hash: hash(kept), range: nil)
      XCTAssertEqual(data, Data(kept.utf8))
    }
    // A collected chunk is missing again: a client uploads it anew.
    let missing = try await cloud.missingChunks([hash("orphan"), hash("current")])
    XCTAssertEqual(missing, [hash("orphan")])
    try await put(cloud, "orphan")
    let usage = try await cloud.usage().usedBytes
    XCTAssertEqual(usage, after + Int64("orphan".count))
    // Nothing is left for a second pass.
    let again = try await cloud.collectGarbage(grace: 3600)
    XCTAssertEqual(again.chunks, 0)
  }

  func testChunksUsedWithinTheGracePeriodAreKept() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    try await put(cloud, "uploaded, not committed yet")
    try await put(cloud, "asked about")
    try await put(cloud, "stored again")
    try ageChunks(cloud)
    // A client about to commit asks which chunks are missing, or stores one again: both count as use.
    _ = try await cloud.missingChunks([hash("asked about")])
    try await put(cloud, "stored again")

    let collected = try await cloud.collectGarbage(grace: 3600)

    XCTAssertEqual(collected.chunks, 1)
    XCTAssertFalse(blobExists("uploaded, not committed yet"))
    XCTAssertTrue(blobExists("asked about"))
    XCTAssertTrue(blobExists("stored again"))
    _ = try await cloud.putItem(container, file("f", "asked about"), ifMatch: nil)
  }

  func testADoomedChunkCanBeNeitherStoredNorCommittedUntilThePassForgetsIt() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    try await put(cloud, "doomed")
    try ageChunks(cloud)
    // A pass that stopped after dooming (a crash, or it is deleting the bytes right now).
    let doomed = try await cloud.metadata.doomUnreferencedChunks(
      account: cloud.account, unusedBefore: Clock.nowSeconds())
    XCTAssertEqual(doomed, [hash("doomed")])

    do {
      try await put(cloud, "doomed")
      XCTFail("a doomed chunk was stored again: its bytes could be deleted after the write")
    } catch CloudError.unavailable {}
    // The commit itself checks, inside its transaction, whatever a caller checked before.
    do {
      _ = try await cloud.metadata.commit(
        account: cloud.account, container: container.rawValue, item: file("g", "doomed"), ifMatch: nil,
        chunks: [hash("doomed")], rule: nil)
      XCTFail("an item was committed with a doomed chunk")
    } catch CloudError.missingChunks(let missing) { XCTAssertEqual(missing, [hash("doomed")]) }

    // The next pass finishes the interrupted one; then the chunk can be stored and used.
    let collected = try await cloud.collectGarbage(grace: 3600)
    XCTAssertEqual(collected.chunks, 1)
    XCTAssertFalse(blobExists("doomed"))
    try await put(cloud, "doomed")
    XCTAssertTrue(blobExists("doomed"))
    _ = try await cloud.putItem(container, file("g", "doomed"), ifMatch: nil)
  }

  /// A blob store whose deletes of some hashes fail, as an S3 outage would.
  final class FailingDeletes: BlobStore, @unchecked Sendable {
    let inner: BlobStore
    let failing: Set<String>
    init(_ inner: BlobStore, failing: Set<String>) {
      self.inner = inner
      self.failing = failing
    }
    func contains(account: String, hash: String) async throws -> Bool {
      try await inner.contains(account: account, hash: hash)
    }
    func put(account: String, hash: String, data: Data) async throws {
      try await inner.put(account: account, hash: hash, data: data)
    }
    func get(account: String, hash: String, range: Range<Int64>?) async throws -> Data {
      try await inner.get(account: account, hash: hash, range: range)
    }
    func delete(account: String, hash: String) async throws {
      if failing.contains(hash) { throw CloudError.unavailable("S3 DELETE \(hash): 503 SlowDown") }
      try await inner.delete(account: account, hash: hash)
    }
  }

  func testABlobThatCannotBeDeletedStaysDoomedAndTheOthersAreCollected() async throws {
    let healthy = try CloudEngine.embedded(directory: dir)
    try await healthy.ensureContainer(container)
    for text in ["first", "stuck", "third"] { try await put(healthy, text) }
    try ageChunks(healthy)
    let flaky = CloudEngine(
      account: healthy.account, metadata: healthy.metadata,
      blobs: FailingDeletes(healthy.blobs, failing: [hash("stuck")]))

    let collected = try await flaky.collectGarbage(grace: 3600)

    XCTAssertEqual(collected.chunks, 2)
    XCTAssertEqual(collected.bytes, Int64("first".count + "third".count))
    XCTAssertEqual(collected.undeleted, 1)
    XCTAssertTrue(collected.failure?.contains("SlowDown") == true, "\(collected)")
    XCTAssertFalse(blobExists("first"))
    XCTAssertFalse(blobExists("third"))
    // The chunks whose bytes are gone can be stored again at once; the stuck one waits.
    try await put(healthy, "first")
    do {
      try await put(healthy, "stuck")
      XCTFail("a chunk whose bytes may still be deleted was stored again")
    } catch CloudError.unavailable {}
    // The next pass, with deletes working again, finishes it.
    let next = try await healthy.collectGarbage(grace: 3600)
    XCTAssertEqual(next.chunks, 1)
    XCTAssertEqual(next.undeleted, 0)
    XCTAssertNil(next.failure)
    XCTAssertFalse(blobExists("stuck"))
    try await put(healthy, "stuck")
    XCTAssertTrue(blobExists("stuck"))
  }
}
