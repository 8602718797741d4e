import Foundation
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore

/// The tree invariants and number checks of `CloudEngine` on the embedded SQLite engine, and
/// `treeProblems` over hand-made records.
final class TreeRulesTests: XCTestCase {
  var dir: URL!
  let container = try! ContainerID("iCloud.com.example.tree")

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("tree-\(UUID().uuidString)")
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  func folder(_ id: String, parent: String = WellKnownItem.documents, name: String? = nil) -> CloudItem {
    CloudItem(itemID: id, parentID: parent, name: name ?? id, kind: .directory, mode: 0o755, size: 0, mtimeNs: 1)
  }

  func expect(_ body: () async throws -> Void, _ check: (CloudError) -> Bool, line: UInt = #line) async {
    do {
      try await body()
      XCTFail("expected an error", line: line)
    } catch let e as CloudError {
      XCTAssertTrue(check(e), "\(e)", line: line)
    } catch {
      XCTFail("\(error)", line: line)
    }
  }

  func testParentsCyclesAndNames() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    await expect(
      { _ = try await cloud.putItem(self.container, self.folder("o", parent: "nope"), ifMatch: nil) },
      { if case .badParent = $0 { return true } else { return false } })
    await expect(
      { _ = try await cloud.putItem(self.container, self.folder("s", parent: "s"), ifMatch: nil) },
      { if case .cycle = $0 { return true } else { return false } })
    let x = try await cloud.putItem(container, folder("x"), ifMatch: nil)
    _ = try await cloud.putItem(container, folder("y", parent: "x"), ifMatch: nil)
    await expect(
      { _ = try await cloud.putItem(self.container, self.folder("x", parent: "y"), ifMatch: x.etag) },
      { if case .cycle = $0 { return true } else { return false } })
    await expect(
      { _ = try await cloud.putItem(self.container, self.folder("z", name: "x"), ifMatch: nil) },
      { if case .nameTaken = $0 { return true } else { return false } })
    let y = try await cloud.item(container, itemID: "y")!
    _ = try await cloud.deleteItem(container, itemID: "y", ifMatch: y.etag, deviceID: "d")
    await expect(
      { _ = try await cloud.putItem(self.container, self.folder("w", parent: "y"), ifMatch: nil) },
      { if case .badParent = $0 { return true } else { return false } })
    await expect(
      { _ = try await cloud.putItem(self.container, self.folder("../x"), ifMatch: nil) },
      { if case .invalidID = $0 { return true } else { return false } })
  }

  func testChunkLengthsAreChecked() async throws {
    let cloud = try CloudEngine.embedded(directory: dir)
    try await cloud.ensureContainer(container)
    let data = Data("hello".utf8)
    let h = Chunker.sha256Hex(data)
    try await cloud.putChunk(hash: h, data: data)
    func file(_ size: Int64, _ lengths: [Int64]) -> CloudItem {
      CloudItem(
        itemID: "f", parentID: WellKnownItem.documents, name: "f", kind: .file, mode: 0o644, size: size, mtimeNs: 1,
        chunks: lengths.map { ChunkRef(hash: h, length: $0) })
    }
    for (size, lengths) in [(Int64.max, [Int64.max, 1]), (0, [5, -5]), (3, [3]), (0, [0])] as [(Int64, [Int64])] {
      await expect(
        { _ = try await cloud.putItem(self.container, file(size, lengths), ifMatch: nil) },
        { if case .invalid = $0 { return true } else { return false } })
    }
    _ = try await cloud.putItem(container, file(10, [5, 5]), ifMatch: nil)
  }

  func testTreeProblemsFindsOrphansLoopsAndNamesakes() {
    var items = [
      CloudItem(itemID: "root", parentID: nil, name: "", kind: .directory, mode: 0, size: 0, mtimeNs: 0),
      folder("documents", parent: "root", name: "Documents"),
      folder("a"), folder("orphan", parent: "gone"), folder("c1", parent: "c2"), folder("c2", parent: "c1"),
      folder("kid", parent: "c1"), folder("dup1", name: "same"), folder("dup2", name: "same"),
    ]
    items[7].changeSeq = 1
    items[8].changeSeq = 2
    let problems = CloudEngine.treeProblems(items)
    XCTAssertEqual(
      problems.map { "\($0.kind.rawValue) \($0.itemID)" }.sorted(),
      ["cycle c1", "duplicate-name dup2", "orphan orphan"])
    XCTAssertEqual(problems.first { $0.kind == .cycle }?.members, ["c1", "c2"])
  }
}
