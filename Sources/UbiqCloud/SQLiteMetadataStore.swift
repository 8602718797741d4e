import Foundation
import GRDB
import UbiqCore

/// The embedded cloud's metadata: accounts, containers, item records (JSON) with their change
/// sequence, chunk bookkeeping. SQLite in WAL mode; safe for several processes at once.
public final class SQLiteMetadataStore: MetadataStore, @unchecked Sendable {
  let pool: DatabasePool
  static let encoder = JSONEncoder()
  static let decoder = JSONDecoder()

  public init(path: String) throws {
    var config = Configuration()
    config.busyMode = .timeout(10)
    pool = try DatabasePool(path: path, configuration: config)
    var migrator = DatabaseMigrator()
    migrator.registerMigration("v1") { db in
      try db.execute(
        sql: """
          CREATE TABLE accounts(name TEXT PRIMARY KEY, quotaBytes INTEGER NOT NULL DEFAULT 0,
                                usedBytes INTEGER NOT NULL DEFAULT 0);
          CREATE TABLE containers(account TEXT NOT NULL, container TEXT NOT NULL,
                                  lastSeq INTEGER NOT NULL DEFAULT 0, PRIMARY KEY(account, container));
          CREATE TABLE items(account TEXT NOT NULL, container TEXT NOT NULL, itemID TEXT NOT NULL,
                             changeSeq INTEGER NOT NULL, etag TEXT NOT NULL, deleted INTEGER NOT NULL,
                             record BLOB NOT NULL, PRIMARY KEY(account, container, itemID));
          CREATE INDEX items_by_seq ON items(account, container, changeSeq);
          CREATE TABLE chunks(account TEXT NOT NULL, hash TEXT NOT NULL, size INTEGER NOT NULL,
                              PRIMARY KEY(account, hash));
          """)
    }
    try migrator.migrate(pool)
  }

  public func ensureAccount(_ account: String) throws {
    try pool.write { db in
      try db.execute(sql: "INSERT OR IGNORE INTO accounts(name) VALUES (?)", arguments: [account])
    }
  }

  public func ensureContainer(account: String, container: String, seed: [CloudItem]) throws {
    try pool.write { db in
      let exists = try Bool.fetchOne(
        db, sql: "SELECT 1 FROM containers WHERE account = ? AND container = ?", arguments: [account, container])
      if exists == true { return }
      try db.execute(
        sql: "INSERT INTO containers(account, container) VALUES (?, ?)", arguments: [account, container])
      for item in seed { _ = try Self.store(db, account, container, item) }
    }
  }

  public func item(account: String, container: String, itemID: String) throws -> CloudItem? {
    try pool.read { db in
      try Data.fetchOne(
        db, sql: "SELECT record FROM items WHERE account = ? AND container = ? AND itemID = ?",
        arguments: [account, container, itemID]
      ).map { try Self.decoder.decode(CloudItem.self, from: $0) }
    }
  }

  public func commit(account: String, container: String, item: CloudItem, ifMatch: String?) throws -> CloudItem {
    try pool.write { db in
      guard
        try Bool.fetchOne(
          db, sql: "SELECT 1 FROM containers WHERE account = ? AND container = ?", arguments: [account, container])
          == true
      else { throw CloudError.notFound("container \(container)") }
      let current = try Data.fetchOne(
        db, sql: "SELECT record FROM items WHERE account = ? AND container = ? AND itemID = ?",
        arguments: [account, container, item.itemID]
      ).map { try Self.decoder.decode(CloudItem.self, from: $0) }
      if let current {
        let live = !current.deleted
        if ifMatch != current.etag && (live || ifMatch != nil) { throw CloudError.conflict(current: current) }
      } else if ifMatch != nil {
        throw CloudError.notFound("item \(item.itemID)")
      }
      return try Self.store(db, account, container, item)
    }
  }

  static func store(_ db: Database, _ account: String, _ container: String, _ item: CloudItem) throws -> CloudItem {
    try db.execute(
      sql: "UPDATE containers SET lastSeq = lastSeq + 1 WHERE account = ? AND container = ?",
      arguments: [account, container])
    let seq =
      try Int64.fetchOne(
        db, sql: "SELECT lastSeq FROM containers WHERE account = ? AND container = ?",
        arguments: [account, container]) ?? 0
    var record = item
    record.changeSeq = seq
    record.etag = String(seq)
    try db.execute(
      sql: """
        INSERT INTO items(account, container, itemID, changeSeq, etag, deleted, record) VALUES (?,?,?,?,?,?,?)
        ON CONFLICT(account, container, itemID) DO UPDATE SET changeSeq = excluded.changeSeq,
          etag = excluded.etag, deleted = excluded.deleted, record = excluded.record
        """,
      arguments: [account, container, record.itemID, seq, record.etag, record.deleted, try encoder.encode(record)])
    return record
  }

  public func changes(account: String, container: String, since: Int64, limit: Int) throws -> ChangeBatch {
    try pool.read { db in
      let rows = try Row.fetchAll(
        db,
        sql: """
          SELECT changeSeq, record FROM items WHERE account = ? AND container = ? AND changeSeq > ?
          ORDER BY changeSeq LIMIT ?
          """, arguments: [account, container, since, limit + 1])
      let page = rows.prefix(limit)
      let items = try page.map { try Self.decoder.decode(CloudItem.self, from: $0["record"] as Data) }
      let last: Int64 = page.last?["changeSeq"] ?? since
      return ChangeBatch(items: items, token: last, hasMore: rows.count > limit)
    }
  }

  public func lastChange(account: String, container: String) throws -> Int64 {
    try pool.read { db in
      try Int64.fetchOne(
        db, sql: "SELECT lastSeq FROM containers WHERE account = ? AND container = ?",
        arguments: [account, container]) ?? 0
    }
  }

  public func knownChunks(account: String, hashes: [String]) throws -> Set<String> {
    if hashes.isEmpty { return [] }
    return try pool.read { db in
      var found = Set<String>()
      for batch in stride(from: 0, to: hashes.count, by: 500) {
        let slice = Array(hashes[batch..<min(batch + 500, hashes.count)])
        let marks = Array(repeating: "?", count: slice.count).joined(separator: ",")
        let got = try String.fetchAll(
          db, sql: "SELECT hash FROM chunks WHERE account = ? AND hash IN (\(marks))",
          arguments: StatementArguments([account] + slice))
        found.formUnion(got)
      }
      return found
    }
  }

  public func recordChunk(account: String, hash: String, size: Int64) throws {
    try pool.write { db in
      let (used, quota) = try Self.usageRow(db, account)
      if try Bool.fetchOne(
        db, sql: "SELECT 1 FROM chunks WHERE account = ? AND hash = ?", arguments: [account, hash]) == true
      {
        return
      }
      if quota > 0 && used + size > quota {
        throw CloudError.quotaExceeded(Usage(usedBytes: used, quotaBytes: quota))
      }
      try db.execute(
        sql: "INSERT INTO chunks(account, hash, size) VALUES (?,?,?)", arguments: [account, hash, size])
      try db.execute(
        sql: "UPDATE accounts SET usedBytes = usedBytes + ? WHERE name = ?", arguments: [size, account])
    }
  }

  static func usageRow(_ db: Database, _ account: String) throws -> (Int64, Int64) {
    guard
      let row = try Row.fetchOne(
        db, sql: "SELECT usedBytes, quotaBytes FROM accounts WHERE name = ?", arguments: [account])
    else { throw CloudError.notFound("account \(account)") }
    return (row["usedBytes"], row["quotaBytes"])
  }

  public func usage(account: String) throws -> Usage {
    try pool.read { db in
      let (u, q) = try Self.usageRow(db, account)
      return Usage(usedBytes: u, quotaBytes: q)
    }
  }

  public func setQuota(account: String, bytes: Int64) throws {
    try pool.write { db in
      try db.execute(sql: "UPDATE accounts SET quotaBytes = ? WHERE name = ?", arguments: [bytes, account])
    }
  }
}
