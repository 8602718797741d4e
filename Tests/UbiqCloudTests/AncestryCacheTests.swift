import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore

/// `AncestryCache`: the walks a commit transaction remembers, what it answers from them and
/// when it forgets them.
final class AncestryCacheTests: XCTestCase {
  func folder(_ id: String, parent: String) -> CloudItem {
    CloudItem(itemID: id, parentID: parent, name: id, kind: .directory, mode: 0o755, size: 0, mtimeNs: 1)
  }

  /// c in b in a in the root: the walk from c.
  var walk: AncestryCache.Ancestry {
    AncestryCache.Ancestry(
      chain: [folder("c", parent: "b"), folder("b", parent: "a"), folder("a", parent: WellKnownItem.root)],
      loops: false)
  }

  func testAWalkIsAnsweredAgainAndCutWhereTheWrittenItemIsOnIt() {
    var cache = AncestryCache()
    XCTAssertNil(cache.ancestry(of: "x", under: "c"))
    let first = cache.remember(walk, under: "c", visited: ["c", "b", "a"], for: "x")
    XCTAssertEqual(first.chain.map(\.itemID), ["c", "b", "a"])
    XCTAssertEqual(cache.ancestry(of: "y", under: "c")?.chain.map(\.itemID), ["c", "b", "a"])
    // b moving into c: the walk ends at b, as a walk that stops at the written item does.
    let cut = cache.ancestry(of: "b", under: "c")
    XCTAssertEqual(cut?.chain.map(\.itemID), ["c", "b"])
    XCTAssertEqual(cut?.loops, false)
  }

  func testAFolderInARememberedFolderExtendsItsWalkUnlessItIsOnIt() {
    var cache = AncestryCache()
    _ = cache.remember(walk, under: "c", visited: ["c", "b", "a"], for: "x")
    XCTAssertEqual(cache.extending(folder("d", parent: "c"))?.chain.map(\.itemID), ["d", "c", "b", "a"])
    // A record of b that says it is in c: b is on c's walk, a loop; no shortcut.
    XCTAssertNil(cache.extending(folder("b", parent: "c")))
    XCTAssertNil(cache.extending(folder("d", parent: "elsewhere")))
  }

  func testAWalkStopsAtTheRootAMissingRecordOrALoopAndIsRemembered() {
    var records = Dictionary(uniqueKeysWithValues: walk.chain.map { ($0.itemID, $0) })
    var cache = AncestryCache()
    let toRoot = cache.walk(from: "c", for: "x") { records[$0] }
    XCTAssertEqual(toRoot.chain.map(\.itemID), ["c", "b", "a"])
    XCTAssertFalse(toRoot.loops)
    XCTAssertEqual(cache.ancestry(of: "y", under: "c")?.chain.map(\.itemID), ["c", "b", "a"])
    let missing = cache.walk(from: "e", for: "x") { $0 == "e" ? self.folder("e", parent: "gone") : nil }
    XCTAssertEqual(missing.chain.map(\.itemID), ["e"])
    XCTAssertFalse(missing.loops)
    // a in c: c, b, a, then c again.
    records["a"] = folder("a", parent: "c")
    var fresh = AncestryCache()
    let loop = fresh.walk(from: "c", for: "x") { records[$0] }
    XCTAssertEqual(loop.chain.map(\.itemID), ["c", "b", "a"])
    XCTAssertTrue(loop.loops)
  }

  func testWritingAnItemOnAWalkOrWhereOneEndedForgetsTheWalks() {
    var cache = AncestryCache()
    _ = cache.remember(walk, under: "c", visited: ["c", "b", "a"], for: "x")
    cache.written("new-file")
    XCTAssertNotNil(cache.ancestry(of: "x", under: "c"))
    cache.written("b")
    XCTAssertNil(cache.ancestry(of: "x", under: "c"))
    // A walk that ended at a missing folder: creating that folder changes the walk.
    _ = cache.remember(
      AncestryCache.Ancestry(chain: [folder("e", parent: "missing")], loops: false), under: "e",
      visited: ["e", "missing"], for: "x")
    cache.written("missing")
    XCTAssertNil(cache.ancestry(of: "x", under: "e"))
  }
}
