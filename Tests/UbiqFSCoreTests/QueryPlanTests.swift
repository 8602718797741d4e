import Foundation
import GRDB
import Synchronization
import Testing
import UbiqCore

@testable import UbiqFSCore
@testable import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// Every statement the index runs on the filesystem's and the sync engine's paths uses an index:
/// `EXPLAIN QUERY PLAN` of each shows no full scan of `items`, `uploadQueue` or `xattrs`. The
/// statements are the ones really run, traced while a workload goes through the core, the
/// uploader and the puller; queries that read a whole table on purpose are listed with why.
@Suite struct QueryPlanTests {
  /// Whole-table reads by design (maintenance and status, not per-operation paths).
  static let fullScansAllowed = [
    "SUM(SIZE)": "cachedBytes: the cache budget's total, once per eviction pass",
    "FROM ITEMS WHERE NAME GLOB": "ubiqfs find",
    "ORDER BY LASTUSEDNS": "eviction candidates, once per eviction pass",
    "SELECT * FROM UPLOADQUEUE WHERE NEXTATTEMPTNS <=": "the due queue: read once per uploader pass",
    "SELECT MIN(NEXTATTEMPTNS) FROM UPLOADQUEUE": "when the next entry is due: once per uploader pass",
    "SELECT COUNT(*) FROM UPLOADQUEUE": "status",
    "COALESCE(SUM(I.SIZE), 0) FROM UPLOADQUEUE": "status",
    "FROM UPLOADQUEUE WHERE LASTERROR IS NOT NULL": "status",
    "SELECT RECORD FROM HELDREMOTE": "held records: a small table, read once per pull",
    "FROM DIRTYCONTENT": "crash recovery at mount",
  ]

  @Test func hotQueriesUseIndexes() async throws {
    let seen = Mutex<Set<String>>([])
    try await onOwnThread {
      let a = try CoreWorld(statementObserver: { sql in seen.withLock { _ = $0.insert(sql) } })
      let b = try CoreWorld(cloud: a.cloud)
      let docs = a.documents
      _ = try a.core.mkdir(parent: docs, name: "d", mode: 0o755, caller: .current)
      for i in 0..<5 { try a.writeFile("d/f\(i)", Data("content \(i)\n".utf8)) }
      try a.core.setxattr(try #require(try a.inode("d/f0")), name: "user.tag", value: Data("x".utf8), flags: [])
      try a.drainUploads()
      try b.writeFile("from-b", Data("b\n".utf8))
      try b.drainUploads()
      try a.pull()
      _ = try a.readFile("from-b")
      try a.core.readdir(try #require(try a.inode("d")), offset: 0) { _ in true }
      _ = try a.core.getattr(try #require(try a.inode("d/f1")))
      try a.core.rename(parent: docs, name: "d", newParent: docs, newName: "e", flags: [])
      let e = try #require(try a.inode("e"))
      try a.core.unlink(parent: e, name: "f2")
      try a.writeFile("e/f3", Data("changed\n".utf8))
      try a.drainUploads()
      try a.crashAndRestart()
      try a.pull()
      _ = try a.index.queueSummary()
    }
    let statements = seen.withLock { $0 }
    #expect(statements.count > 20, "the workload ran the index's statements")
    // The core blocks on async work inside: on a thread of its own, never on one of the few
    // threads of Swift's cooperative pool (other suites run meanwhile).
    let scans = Mutex<[String]>([])
    try await onOwnThread {
      let found = try Self.fullScans(statements)
      scans.withLock { $0 = found }
    }
    let found = scans.withLock { $0 }
    #expect(found.isEmpty, "full scans on a hot path:\n\(found.joined(separator: "\n"))")
  }

  /// A folder's link count (2 + its subfolders) is computed on every getattr of the folder,
  /// which the kernel asks for after each create in it: counting must read the folder's
  /// subfolders only, from an index, never every entry of a folder of 100,000 files.
  @Test func aFoldersLinkCountReadsItsSubfoldersOnly() async throws {
    let found = try await Self.plans(ofStatementsContaining: "COUNT(*) FROM ITEMS WHERE PARENT") { world in
      _ = try world.core.getattr(world.documents)
    }
    #expect(!found.isEmpty, "getattr of a folder counts its subfolders")
    for plan in found {
      #expect(plan.contains("USING COVERING INDEX items_subfolders (parent=? AND kind=?)"), "\(plan)")
    }
  }

  /// readdir reads a folder in batches, each from where the last one ended: every batch must
  /// come in inode order straight from an index of the folder's entries. A sort of every entry
  /// per batch makes listing a folder of 100,000 entries quadratic, and a walk of the rows by
  /// inode reads every item after the cursor, of any folder.
  @Test func aFoldersListingReadsItsEntriesInOrderFromAnIndex() async throws {
    let found = try await Self.plans(ofStatementsContaining: "FROM ITEMS WHERE PARENT = ? AND ID >") { w in
      for i in 0..<5 { try w.writeFile("f\(i)", Data()) }
      var names: [String] = []
      try w.core.readdir(w.documents, offset: 0, batch: 16) {
        names.append($0.name)
        return true
      }
      try checkThat(names.count == 7, "the listing has . .. and five files: \(names)")
    }
    #expect(!found.isEmpty, "readdir reads the folder's entries after a cursor")
    for plan in found {
      #expect(plan.contains("USING INDEX items_by_parent (parent=? AND rowid>?)"), "\(plan)")
      #expect(!plan.contains("TEMP B-TREE"), "\(plan)")
    }
  }

  /// Each statement `workload` runs on a fresh device whose text contains `fragment` (compared
  /// upper-cased), with its plan: "SQL -> step; step".
  static func plans(
    ofStatementsContaining fragment: String, after workload: @escaping @Sendable (CoreWorld) throws -> Void
  ) async throws -> [String] {
    let statements = Mutex<Set<String>>([])
    let plans = Mutex<[String]>([])
    try await onOwnThread {
      let world = try CoreWorld(statementObserver: { sql in statements.withLock { _ = $0.insert(sql) } })
      try workload(world)
      let matching = statements.withLock { $0 }.filter { $0.uppercased().contains(fragment) }
      let found = try matching.map { "\($0) -> \(try Self.plan(of: $0, in: world).joined(separator: "; "))" }
      plans.withLock { $0 = found }
    }
    return plans.withLock { $0 }
  }

  /// The statements (with their plan step) whose plan scans a whole table it should search.
  /// `ubiqfs find '*.txt'` reads the names that end so from the reversed-name index, not every
  /// row (a glob with no match over 1M items took 130-180 ms as a scan), and finds exactly what
  /// a scan of every name finds, for names in either Unicode normalization.
  @Test func aGlobEndingInLiteralTextReadsOnlyTheNamesThatEndSo() async throws {
    let statements = Mutex<Set<String>>([])
    try await onOwnThread {
      let w = try CoreWorld(statementObserver: { sql in statements.withLock { _ = $0.insert(sql) } })
      for name in [
        "a.txt", "b.txt", "note99.txt", "x99.txt.bak", "cafe\u{301}.txt", "caf\u{e9}.txt", "README", "t", "x\u{30A}A",
      ] {
        try w.writeFile(name, Data())
      }
      _ = try w.core.mkdir(parent: w.documents, name: "sub", mode: 0o755, caller: .current)
      try w.writeFile("sub/deep99.txt", Data())
      let globs = [
        "*.txt", "*99.txt", "*e\u{301}.txt", "*\u{e9}.txt", "*\u{301}.txt", "*?.txt", "*.nomatch", "*t", "?.txt", "*",
        "a*", "*[0-9].txt", "*\u{10FFFF}", "*\u{D7FF}",
        // Canonically, "A\u{30A}" is "\u{C5}" and sorts after "A\u{30B}"; SQLite compares code points.
        "*\u{30A}A",
      ]
      for glob in globs {
        let found = try w.index.find(glob: glob, limit: 100).map { String($0.path.split(separator: "/").last ?? "") }
        let scanned = try w.index.read { db in
          try String.fetchAll(db, sql: "SELECT name FROM items WHERE name GLOB ? AND id != 1", arguments: [glob])
        }
        try checkThat(
          found.sorted() == scanned.sorted(), "\(glob): found \(found.sorted()), a scan finds \(scanned.sorted())")
      }
      let reversed = statements.withLock { $0 }.filter { $0.uppercased().contains("UBIQ_REVERSED(NAME) >=") }
      try checkThat(!reversed.isEmpty, "a glob ending in literal text was searched by its reversed name")
      for sql in reversed {
        let plan = try Self.plan(of: sql, in: w)
        try checkThat(
          plan.contains { $0.contains("USING INDEX items_by_reversed_name") }, "\(sql) -> \(plan)")
      }
    }
  }

  static func fullScans(_ statements: Set<String>) throws -> [String] {
    let world = try CoreWorld()
    var scans: [String] = []
    for sql in statements.sorted() {
      let upper = sql.uppercased()
      guard upper.hasPrefix("SELECT") || upper.hasPrefix("UPDATE") || upper.hasPrefix("DELETE"),
        !upper.contains("SQLITE_"), !upper.contains("PRAGMA")
      else { continue }
      if fullScansAllowed.keys.contains(where: { upper.contains($0) }) { continue }
      for step in try plan(of: sql, in: world)
      where step.hasPrefix("SCAN items") || step.hasPrefix("SCAN uploadQueue") || step.hasPrefix("SCAN xattrs") {
        scans.append("\(sql)\n    -> \(step)")
      }
    }
    return scans
  }

  /// The steps of `EXPLAIN QUERY PLAN` for `sql`, with NULL for each parameter.
  static func plan(of sql: String, in world: CoreWorld) throws -> [String] {
    let placeholders = sql.filter { $0 == "?" }.count
    return try world.index.read { db in
      try Row.fetchAll(
        db, sql: "EXPLAIN QUERY PLAN " + sql,
        arguments: StatementArguments(Array(repeating: DatabaseValue.null, count: placeholders))
      ).map { $0["detail"] as String }
    }
  }
}
