import Foundation
import Testing
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqIndex

@testable import UbiqFSCore
@testable import UbiqSync

/// A cloud whose `item` lookups can be made to fail (`UploadWorker.learnWhereTheNameHolderWent`).
final class ItemLookupFails: CloudService, @unchecked Sendable {
  let inner: CloudService
  let lock = NSLock()
  var failItem = false
  init(_ inner: CloudService) { self.inner = inner }
  func ensureContainer(_ c: ContainerID) async throws { try await inner.ensureContainer(c) }
  func missingChunks(_ h: [String]) async throws -> Set<String> { try await inner.missingChunks(h) }
  func putChunk(hash: String, data: Data) async throws { try await inner.putChunk(hash: hash, data: data) }
  func getChunk(hash: String, range: Range<Int64>?) async throws -> Data {
    try await inner.getChunk(hash: hash, range: range)
  }
  func putItem(_ c: ContainerID, _ item: CloudItem, ifMatch: String?) async throws -> CloudItem {
    try await inner.putItem(c, item, ifMatch: ifMatch)
  }
  func putItems(_ c: ContainerID, _ puts: [ItemPut]) async throws -> ItemBatchResults {
    try await inner.putItems(c, puts)
  }
  func deleteItem(_ c: ContainerID, itemID: String, ifMatch: String?, deviceID: String) async throws -> CloudItem {
    try await inner.deleteItem(c, itemID: itemID, ifMatch: ifMatch, deviceID: deviceID)
  }
  func deleteItems(_ c: ContainerID, _ d: [ItemDelete], deviceID: String) async throws -> ItemBatchResults {
    try await inner.deleteItems(c, d, deviceID: deviceID)
  }
  func item(_ c: ContainerID, itemID: String) async throws -> CloudItem? {
    if lock.withLock({ failItem }) { throw CloudError.unavailable("review: lookup fails") }
    return try await inner.item(c, itemID: itemID)
  }
  func changes(_ c: ContainerID, since: Int64, limit: Int) async throws -> ChangeBatch {
    try await inner.changes(c, since: since, limit: limit)
  }
  func usage() async throws -> Usage { try await inner.usage() }
  func waitForChanges(_ c: ContainerID, since: Int64, timeoutMs: Int) async throws -> Bool {
    try await inner.waitForChanges(c, since: since, timeoutMs: timeoutMs)
  }
}

/// A device holds a name the cloud gave another item after this device's item left it there
/// (names swapped or rotated elsewhere), while this device changed the holder: every device
/// must end with the other device's places and this device's changes, with no "name 2".
@Suite(.serialized) struct NameHolderTests {
  static func tree(_ w: CoreWorld, _ path: String = "") throws -> [String] {
    var out: [String] = []
    for name in try w.listing(path) where name != "." && name != ".." {
      let p = path.isEmpty ? name : path + "/" + name
      let inode = try w.inode(p)!
      if try w.core.getattr(inode).kind == .directory {
        let mode = String(try w.core.getattr(inode).mode & 0o777, radix: 8)
        out.append(p + "/ (\(mode))")
        out += try tree(w, p)
      } else {
        out.append(p + " = " + (String(data: try w.readFile(p), encoding: .utf8) ?? "?"))
      }
    }
    return out.sorted()
  }

  static func settle(_ ws: [CoreWorld]) throws {
    for _ in 0..<4 {
      for w in ws {
        try w.drainUploads()
        try w.pull()
      }
    }
  }

  static func rename(_ w: CoreWorld, _ from: String, _ to: String) throws {
    let (p, n) = try w.parentAndName(from)
    let (q, m) = try w.parentAndName(to)
    try w.core.rename(parent: p, name: n, newParent: q, newName: m, flags: [])
  }

  /// Files `names` (each holding its name in capitals) made on `a`, uploaded and pulled by `b`.
  static func synced(_ a: CoreWorld, _ b: CoreWorld, _ names: [String]) throws {
    for n in names { try a.writeFile(n, Data(n.uppercased().utf8)) }
    try a.drainUploads()
    try b.pull()
  }

  /// `mv f e; mv g f; mv e g` on `w`.
  static func swapFG(_ w: CoreWorld) throws {
    try rename(w, "f", "e")
    try rename(w, "g", "f")
    try rename(w, "e", "g")
  }

  /// `mv a t; mv b a; mv c b; mv t c` on `w`.
  static func rotateABC(_ w: CoreWorld) throws {
    try rename(w, "a", "t")
    try rename(w, "b", "a")
    try rename(w, "c", "b")
    try rename(w, "t", "c")
  }

  /// Both devices settle and show `expected`.
  static func expectBoth(_ a: CoreWorld, _ b: CoreWorld, _ expected: [String]) throws {
    try settle([a, b])
    #expect(try tree(a) == expected)
    #expect(try tree(b) == expected)
  }

  /// The holder on B has a local edit; A moves it into a new folder whose record comes after the
  /// record that takes its name (the folder changed again).
  @Test func holderWithEditFollowsIntoAFolderNotHereYet() async throws {
    try await onOwnThread {
      let (a, b, _) = try CoreWorld.pair()
      try Self.synced(a, b, ["f", "g"])
      try b.writeFile("f", Data("F-edited-on-b".utf8))
      _ = try a.core.mkdir(parent: a.documents, name: "d", mode: 0o755, caller: .current)
      try Self.rename(a, "f", "d/f")
      try Self.rename(a, "g", "f")
      try a.drainUploads()
      _ = try a.core.setattr(try a.inode("d")!, AttributeUpdate(mode: 0o700))
      try a.drainUploads()
      try b.pull()
      try Self.expectBoth(a, b, ["d/ (700)", "d/f = F-edited-on-b", "f = G"])
    }
  }

  /// Another device's temporary name ("g (moving …)") is followed by a holder with a local edit.
  @Test func holderWithEditFollowsAnAsideName() async throws {
    try await onOwnThread {
      let (a, b, _) = try CoreWorld.pair()
      try Self.synced(a, b, ["f", "g"])
      try b.writeFile("f", Data("F-edited-on-b".utf8))
      try Self.swapFG(a)
      try a.drainUploadsOnce()
      try b.pull()
      try Self.expectBoth(a, b, ["f = G", "g = F-edited-on-b"])
    }
  }

  /// mv a t; mv b a; mv c b; mv t c on A while B edits all three.
  @Test func rotationOfThreeWhileTheOtherEditsAll() async throws {
    try await onOwnThread {
      let (a, b, _) = try CoreWorld.pair()
      try Self.synced(a, b, ["a", "b", "c"])
      try Self.rotateABC(a)
      try a.drainUploads()
      for n in ["a", "b", "c"] { try b.writeFile(n, Data((n.uppercased() + "-edited").utf8)) }
      try b.drainUploads()
      try Self.expectBoth(a, b, ["a = B-edited", "b = C-edited", "c = A-edited"])
    }
  }

  /// The same rotation, B edits only one of them and pulls.
  @Test func rotationOfThreeWhileTheOtherEditsOneAndPulls() async throws {
    try await onOwnThread {
      let (a, b, _) = try CoreWorld.pair()
      try Self.synced(a, b, ["a", "b", "c"])
      try Self.rotateABC(a)
      try a.drainUploads()
      try b.writeFile("a", Data("A-edited".utf8))
      try b.pull()
      try Self.expectBoth(a, b, ["a = B", "b = C", "c = A-edited"])
    }
  }

  /// A folder holder changed on B (chmod) that A moved into another folder, its name taken.
  @Test func folderHolderWithChmodMovedIntoAnotherFolder() async throws {
    try await onOwnThread {
      let (a, b, _) = try CoreWorld.pair()
      _ = try a.core.mkdir(parent: a.documents, name: "d", mode: 0o755, caller: .current)
      _ = try a.core.mkdir(parent: a.documents, name: "x", mode: 0o755, caller: .current)
      try a.writeFile("g", Data("G".utf8))
      try a.drainUploads()
      try b.pull()
      _ = try b.core.setattr(try b.inode("d")!, AttributeUpdate(mode: 0o700))
      try Self.rename(a, "d", "x/d")
      try Self.rename(a, "g", "d")
      try a.drainUploads()
      try b.pull()
      try Self.expectBoth(a, b, ["d = G", "x/ (755)", "x/d/ (700)"])
    }
  }

  /// Swap on A while B edits both and commits first; the uploader's lookup of the holder fails.
  @Test func swapWhileTheHolderLookupFails() async throws {
    try await onOwnThread {
      let engine = try CloudEngine.embedded(directory: CoreWorld.temporaryFolder("ubiq-cloud"))
      let failing = ItemLookupFails(engine)
      let a = try CoreWorld(cloud: engine)
      let b = try CoreWorld(cloud: failing)
      try Self.synced(a, b, ["f", "g"])
      try Self.swapFG(a)
      try a.drainUploads()
      try b.writeFile("f", Data("F-edited".utf8))
      try b.writeFile("g", Data("G-edited".utf8))
      failing.lock.withLock { failing.failItem = true }
      try b.drainUploads()
      failing.lock.withLock { failing.failItem = false }
      try Self.expectBoth(a, b, ["f = G-edited", "g = F-edited"])
    }
  }

  /// B (edit on f) pulls A's swap: f follows to g. A then moves it on (g -> h) before B uploads.
  @Test func followedPlaceIsTakenForALocalMoveByTheMerge() async throws {
    try await onOwnThread {
      let (a, b, _) = try CoreWorld.pair()
      try Self.synced(a, b, ["f", "g"])
      try b.writeFile("f", Data("F-edited-on-b".utf8))
      try Self.swapFG(a)
      try a.drainUploads()
      try b.pull()
      try a.pull()
      try Self.rename(a, "g", "h")
      try a.drainUploads()
      try b.drainUploads()
      try Self.expectBoth(a, b, ["f = G", "h = F-edited-on-b"])
    }
  }
}

/// Two items want one name, one of them by a rename on a device that has not committed it: the
/// item the cloud gave the name first keeps it on every device and is never renamed (its
/// cloud version stays the one its own device wrote), and the rename becomes "name 2", whether
/// the renaming device reads the feed before it commits (back from offline) or commits first.
@Suite(.serialized) struct RenameOntoANameTakenElsewhereTests {
  /// B renames g to f while A makes f (a new file, or a rename of h) and commits first; B then
  /// pulls before it uploads (`pullFirst`), or uploads first.
  @Test(arguments: [(true, false), (false, false), (true, true), (false, true)])
  func theRenameThatReachesTheCloudLaterYields(pullFirst: Bool, byRename: Bool) async throws {
    try await onOwnThread {
      let (a, b, cloud) = try CoreWorld.pair()
      try NameHolderTests.synced(b, a, byRename ? ["g", "h"] : ["g"])
      try NameHolderTests.rename(b, "g", "f")
      if byRename {
        try NameHolderTests.rename(a, "h", "f")
      } else {
        try a.writeFile("f", Data("F".utf8))
      }
      try a.drainUploads()
      let itemID = try #require(try a.inode("f").flatMap { try a.index.item($0)?.itemID })
      let container = a.container
      let before = try #require(try runBlocking { try await cloud.item(container, itemID: itemID) })
      // B's first pass: a pull, or a commit the cloud refuses (the name is taken there).
      if pullFirst { try b.pull() } else { try b.drainUploadsOnce() }
      for _ in 0..<4 {
        for w in [a, b] {
          try w.drainUploadsOnce()
          try w.pull()
        }
      }
      let expected = ["f 2 = G", "f = \(byRename ? "H" : "F")"]
      for w in [a, b] {
        let shown = try NameHolderTests.tree(w)
        #expect(shown == expected, "\(shown)")
        #expect(try w.index.dueQueue(now: Int64.max / 2, limit: 8).isEmpty, "the queue drained")
      }
      let after = try #require(try runBlocking { try await cloud.item(container, itemID: itemID) })
      #expect(after.etag == before.etag, "the item that had f first was not renamed: \(after)")
    }
  }
}
