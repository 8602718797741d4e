import Foundation
import GRDB
import UbiqCloudAPI
import UbiqCore
import UbiqSQLite

/// The embedded cloud's metadata: accounts and their tokens, containers, item records (JSON)
/// with their change sequence, chunk bookkeeping, the key-value store. SQLite in WAL mode;
/// safe for several processes at once.
/// Sendable: nothing mutable besides the database, whose pool serializes access.
public final class SQLiteMetadataStore: ServerMetadataStore, @unchecked Sendable {
  let pool: DatabasePool
  static let decoder = JSONDecoder()

  public init(path: String) throws {
    var config = Configuration()
    config.busyMode = .timeout(10)
    // Every commit backs a reply to a client (an upload is acknowledged after it): FULL syncs
    // the WAL at each commit, so an acknowledged change survives a power loss. Set again on the
    // writer after the pool opens: entering WAL mode sets NORMAL there.
    config.prepareDatabase { db in try db.execute(sql: "PRAGMA synchronous = FULL") }
    pool = try DatabasePool.openAmongProcesses(path: path, configuration: config)
    try pool.writeWithoutTransaction { db in try db.execute(sql: "PRAGMA synchronous = FULL") }
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
    migrator.registerMigration("v2-accounts-kv") { db in
      try db.execute(
        sql: """
          CREATE TABLE tokens(id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, account TEXT NOT NULL,
                              device TEXT NOT NULL, createdAt INTEGER NOT NULL, revoked INTEGER NOT NULL DEFAULT 0);
          CREATE INDEX tokens_by_account ON tokens(account);
          ALTER TABLE containers ADD COLUMN kvSeq INTEGER NOT NULL DEFAULT 0;
          CREATE TABLE kv(account TEXT NOT NULL, container TEXT NOT NULL, key TEXT NOT NULL,
                          value TEXT, timestamp INTEGER NOT NULL, device TEXT NOT NULL, seq INTEGER NOT NULL,
                          cost INTEGER NOT NULL, PRIMARY KEY(account, container, key));
          CREATE INDEX kv_by_seq ON kv(account, container, seq);
          """)
    }
    migrator.registerMigration("v3-item-place") { db in
      // Each record's place, so a commit finds a live namesake through an index.
      try db.execute(
        sql: """
          ALTER TABLE items ADD COLUMN parentID TEXT;
          ALTER TABLE items ADD COLUMN name TEXT;
          CREATE INDEX items_by_parent ON items(account, container, parentID, name);
          """)
      let rows = try Row.fetchAll(db, sql: "SELECT rowid, record FROM items")
      for row in rows {
        let item = try RecordJSON.decodeStored(row["record"] as Data)
        try db.execute(
          sql: "UPDATE items SET parentID = ?, name = ? WHERE rowid = ?",
          arguments: [item.parentID, item.name, row["rowid"] as Int64])
      }
    }
    migrator.registerMigration("v4-token-scopes") { db in
      // Tokens from before scopes become device tokens: nothing old can manage devices until
      // the admin CLI issues an account token.
      try db.execute(
        sql: """
          ALTER TABLE tokens ADD COLUMN scope TEXT NOT NULL DEFAULT 'device';
          ALTER TABLE tokens ADD COLUMN expiresAt INTEGER;
          """)
    }
    migrator.registerMigration("v5-chunk-collection") { db in
      // When each chunk was last uploaded, asked about or committed (seconds since the epoch;
      // chunks from before count as used now), and whether a collection pass is deleting it.
      try db.execute(
        sql: """
          ALTER TABLE chunks ADD COLUMN lastUsed INTEGER NOT NULL DEFAULT 0;
          ALTER TABLE chunks ADD COLUMN doomed INTEGER NOT NULL DEFAULT 0;
          UPDATE chunks SET lastUsed = CAST(strftime('%s', 'now') AS INTEGER);
          """)
    }
    migrator.registerMigration("v6-live-item-count") { db in
      // Live items per container, kept by every commit, for the items-per-container limit.
      try db.execute(
        sql: """
          ALTER TABLE containers ADD COLUMN liveItems INTEGER NOT NULL DEFAULT 0;
          UPDATE containers SET liveItems = (SELECT count(*) FROM items i WHERE i.account = containers.account
            AND i.container = containers.container AND i.deleted = 0);
          """)
    }
    migrator.registerMigration("v7-metadata-cost") { db in
      // What the account's live records cost against its quota (`MetadataCost`), kept by every
      // commit.
      try db.execute(
        sql: """
          ALTER TABLE accounts ADD COLUMN metadataBytes INTEGER NOT NULL DEFAULT 0;
          UPDATE accounts SET metadataBytes = (SELECT coalesce(sum(? + length(i.record)), 0) FROM items i
            WHERE i.account = accounts.name AND i.deleted = 0 AND i.itemID NOT IN (?, ?));
          """, arguments: [MetadataCost.perItem, WellKnownItem.root, WellKnownItem.documents])
    }
    try migrator.migrateAmongProcesses(pool)
  }

  /// `pool.write`, where a writer held by another process for longer than the busy timeout
  /// (another `ubiqfs serve` on the same data folder committing a big batch) is
  /// `CloudError.unavailable`: a passing condition the client retries, not a failure.
  func writeOrUnavailable<T: Sendable>(_ body: @Sendable (Database) throws -> T) async throws -> T {
    try await Self.unavailableWhenBusy { try await pool.write(body) }
  }

  /// `pool.read`, with a busy database as `writeOrUnavailable` has it.
  func readOrUnavailable<T: Sendable>(_ body: @Sendable (Database) throws -> T) async throws -> T {
    try await Self.unavailableWhenBusy { try await pool.read(body) }
  }

  /// `access`, with SQLITE_BUSY thrown as `CloudError.unavailable`.
  private static func unavailableWhenBusy<T>(_ access: () async throws -> T) async throws -> T {
    do {
      return try await access()
    } catch let error as DatabaseError where error.resultCode == .SQLITE_BUSY {
      throw CloudError.unavailable("the cloud's database is busy; retry in a moment")
    }
  }

  /// Synchronous `ensureAccount`, for setting up the embedded engine outside async code.
  public func ensureAccountSync(_ account: String) throws {
    try pool.write { db in
      try db.execute(sql: "INSERT OR IGNORE INTO accounts(name) VALUES (?)", arguments: [account])
    }
  }

  // MARK: MetadataStore

  public func ensureAccount(_ account: String) async throws {
    try await writeOrUnavailable { db in
      try db.execute(sql: "INSERT OR IGNORE INTO accounts(name) VALUES (?)", arguments: [account])
    }
  }

  public func ensureContainer(account: String, container: String, seed: [CloudItem], maxContainers: Int)
    async throws
  {
    try await writeOrUnavailable { db in
      if try Self.containerExists(db, account, container) { return }
      let count =
        try Int.fetchOne(db, sql: "SELECT count(*) FROM containers WHERE account = ?", arguments: [account]) ?? 0
      if count >= maxContainers {
        throw CloudError.limitExceeded("the account has \(count) containers, the most it may have")
      }
      try db.execute(
        sql: "INSERT INTO containers(account, container, liveItems) VALUES (?, ?, ?)",
        arguments: [account, container, seed.filter { !$0.deleted }.count])
      for item in seed { _ = try Self.store(db, account, container, item) }
    }
  }

  public func containers(account: String) async throws -> [String] {
    try await readOrUnavailable { db in
      try String.fetchAll(
        db, sql: "SELECT container FROM containers WHERE account = ? ORDER BY container", arguments: [account])
    }
  }

  static func containerExists(_ db: Database, _ account: String, _ container: String) throws -> Bool {
    try Bool.fetchOne(
      db.cached("SELECT 1 FROM containers WHERE account = ? AND container = ?"), arguments: [account, container])
      == true
  }

  public func item(account: String, container: String, itemID: String) async throws -> CloudItem? {
    try await readOrUnavailable { db in
      try Data.fetchOne(
        db, sql: "SELECT record FROM items WHERE account = ? AND container = ? AND itemID = ?",
        arguments: [account, container, itemID]
      ).map { try RecordJSON.decodeStored($0) }
    }
  }

  public func items(account: String, container: String, itemIDs: [String]) async throws -> [String: CloudItem] {
    try await readOrUnavailable { db in
      var found: [String: CloudItem] = [:]
      try Self.inSlices(itemIDs) { _, padded, marks in
        for data in try Data.fetchAll(
          db.cached("SELECT record FROM items WHERE account = ? AND container = ? AND itemID IN (\(marks))"),
          arguments: StatementArguments([account, container] + padded))
        {
          let item = try RecordJSON.decodeStored(data)
          found[item.itemID] = item
        }
      }
      return found
    }
  }

  public func commit(
    account: String, container: String, item: CloudItem, ifMatch: String?, chunks: Set<String>, rule: TreeRule?
  ) async throws -> CloudItem {
    try await writeOrUnavailable { db in
      guard var counters = try CommitCounters.read(db, account, container) else {
        throw CloudError.notFound("container \(container)")
      }
      let before = counters
      var reads = TransactionReads()
      let stored = try Self.commitOne(
        db, account, container, ItemWrite(item: item, ifMatch: ifMatch, chunks: chunks, rule: rule),
        reads: &reads, counters: &counters)
      try counters.save(db, account, container, over: before)
      return stored
    }
  }

  public func commitAll(account: String, container: String, writes: [ItemWrite]) async throws -> ItemBatchResults {
    try await writeOrUnavailable { db in
      guard var counters = try CommitCounters.read(db, account, container) else {
        throw CloudError.notFound("container \(container)")
      }
      let before = counters
      var committed: [CloudItem] = []
      var refused: CloudError?
      // The batch's items mostly share their ancestors: each is read and decoded once, and
      // each folder's ancestry is walked once.
      var reads = TransactionReads()
      for write in writes {
        do {
          // A write refused part way (the quota is checked after the record is stored) leaves
          // nothing: its savepoint is rolled back, and the counters take only what is stored.
          var stored: CloudItem?
          try db.inSavepoint {
            stored = try Self.commitOne(db, account, container, write, reads: &reads, counters: &counters)
            return .commit
          }
          if let stored {
            committed.append(stored)
            reads.records[stored.itemID] = stored
            reads.ancestries.written(stored.itemID)
          }
        } catch let error as CloudError {
          refused = error
          break
        }
      }
      try counters.save(db, account, container, over: before)
      return ItemBatchResults(committed: committed, refused: refused)
    }
  }

  /// The counters a commit transaction changes, of its container (the last change sequence
  /// number, the live items) and of its account (the usage): read once when the transaction
  /// starts, kept here while its writes are made, written back once (`save`).
  struct CommitCounters {
    var lastSeq: Int64
    var liveItems: Int64
    var usage: Usage

    /// Nil when the container does not exist.
    static func read(_ db: Database, _ account: String, _ container: String) throws -> CommitCounters? {
      guard
        let row = try Row.fetchOne(
          db.cached("SELECT lastSeq, liveItems FROM containers WHERE account = ? AND container = ?"),
          arguments: [account, container])
      else { return nil }
      return CommitCounters(lastSeq: row["lastSeq"], liveItems: row["liveItems"], usage: try usageRow(db, account))
    }

    /// Writes what changed since `before`.
    func save(_ db: Database, _ account: String, _ container: String, over before: CommitCounters) throws {
      if lastSeq != before.lastSeq || liveItems != before.liveItems {
        try db.cached("UPDATE containers SET lastSeq = ?, liveItems = ? WHERE account = ? AND container = ?")
          .execute(arguments: [lastSeq, liveItems, account, container])
      }
      let charge = (usage.metadataBytes ?? 0) - (before.usage.metadataBytes ?? 0)
      if charge != 0 {
        try db.cached("UPDATE accounts SET metadataBytes = metadataBytes + ? WHERE name = ?")
          .execute(arguments: [charge, account])
      }
    }

    /// Adds `charge` (what a commit changed in the cost of the records) to the metadata bytes;
    /// refuses growth past the quota.
    mutating func chargeMetadata(_ charge: Int64) throws {
      if charge > 0 { guard usage.admits(charge) else { throw CloudError.quotaExceeded(usage) } }
      let (metadata, overflow) = (usage.metadataBytes ?? 0).addingReportingOverflow(charge)
      let (used, usedOverflow) = usage.usedBytes.addingReportingOverflow(charge)
      guard !overflow, !usedOverflow else { throw CloudError.quotaExceeded(usage) }
      usage.metadataBytes = metadata
      usage.usedBytes = used
    }
  }

  /// What a commit transaction has read of the container's tree, kept while its writes are
  /// made: records by item id, and ancestries (`AncestryCache`). The caller notes each
  /// stored write in both.
  struct TransactionReads {
    var records: [String: CloudItem] = [:]
    var ancestries = AncestryCache()
  }

  /// One write of a commit, inside its transaction, in a container known to exist. `reads`:
  /// what this transaction already read, and it adds what it reads. `counters` take the
  /// write only when it is stored.
  static func commitOne(
    _ db: Database, _ account: String, _ container: String, _ write: ItemWrite,
    reads: inout TransactionReads, counters: inout CommitCounters
  ) throws -> CloudItem {
    let item = write.item
    let current = try Self.storedRecord(db, account, container, item.itemID)
    try CommitRule.check(current: current?.item, ifMatch: write.ifMatch, writing: item)
    let delta = Int64(item.deleted ? 0 : 1) - Int64(current.map { $0.item.deleted ? 0 : 1 } ?? 0)
    var next = counters
    if let rule = write.rule {
      var tree = try Self.treeSnapshot(db, account, container, item, current: current?.item, reads: &reads)
      tree.addsLiveItem = delta > 0
      tree.liveItems = next.liveItems
      try rule(tree)
    }
    try Self.useChunks(db, account, write.chunks, now: Clock.nowSeconds())
    next.liveItems += delta
    next.lastSeq += 1
    let stored = try Self.write(db, account, container, item, seq: next.lastSeq)
    try next.chargeMetadata(MetadataCost.charge(before: current, after: stored))
    counters = next
    return stored.item
  }

  /// Runs `body` on `values` in slices of at most 500 (SQLite bounds the number of parameters
  /// of one statement). Each slice comes with `padded`: the slice with its first value repeated
  /// up to one of a few lengths, and `marks`, its `?,?,...` placeholders. A statement with an
  /// `IN (marks)` list then has few texts, each prepared once per connection (`db.cached`);
  /// an IN list is a set, so the repeats select and change nothing more.
  static func inSlices(
    _ values: [String], _ body: (_ slice: ArraySlice<String>, _ padded: [String], _ marks: String) throws -> Void
  ) rethrows {
    for start in stride(from: 0, to: values.count, by: 500) {
      let slice = values[start..<min(start + 500, values.count)]
      let length = inListLengths.first { $0 >= slice.count } ?? slice.count
      let padded = Array(slice) + Array(repeating: slice[start], count: length - slice.count)
      try body(slice, padded, inListMarks[length] ?? Array(repeating: "?", count: length).joined(separator: ","))
    }
  }

  /// The lengths `inSlices` pads to, and their placeholders.
  static let inListLengths = [1, 2, 4, 8, 16, 32, 64, 128, 256, 500]
  static let inListMarks = Dictionary(
    uniqueKeysWithValues: inListLengths.map { ($0, Array(repeating: "?", count: $0).joined(separator: ",")) })

  /// Marks a commit's chunks used, inside its transaction; throws `missingChunks` for any that
  /// is not a live chunk of the account.
  static func useChunks(_ db: Database, _ account: String, _ chunks: Set<String>, now: Int64) throws {
    var missing: [String] = []
    try inSlices(Array(chunks)) { slice, padded, marks in
      try db.cached("UPDATE chunks SET lastUsed = ? WHERE account = ? AND doomed = 0 AND hash IN (\(marks))")
        .execute(arguments: StatementArguments([now as (any DatabaseValueConvertible)?, account] + padded))
      if db.changesCount != slice.count {
        let live = try String.fetchAll(
          db.cached("SELECT hash FROM chunks WHERE account = ? AND doomed = 0 AND hash IN (\(marks))"),
          arguments: StatementArguments([account] + padded))
        missing += Set(slice).subtracting(live)
      }
    }
    if !missing.isEmpty { throw CloudError.missingChunks(missing.sorted()) }
  }

  static func record(_ db: Database, _ account: String, _ container: String, _ itemID: String) throws -> CloudItem? {
    try storedRecord(db, account, container, itemID)?.item
  }

  static func storedRecord(_ db: Database, _ account: String, _ container: String, _ itemID: String) throws
    -> StoredRecord?
  {
    try Data.fetchOne(
      db.cached("SELECT record FROM items WHERE account = ? AND container = ? AND itemID = ?"),
      arguments: [account, container, itemID]
    ).map { StoredRecord(item: try RecordJSON.decodeStored($0), bytes: Int64($0.count)) }
  }

  /// The written item's `TreeSnapshot`, inside the commit's transaction. `current`: the
  /// stored version it replaces.
  static func treeSnapshot(
    _ db: Database, _ account: String, _ container: String, _ item: CloudItem, current: CloudItem?,
    reads: inout TransactionReads
  ) throws -> TreeSnapshot {
    if item.deleted {
      let child = try Data.fetchOne(
        db.cached(
          "SELECT record FROM items WHERE account = ? AND container = ? AND parentID = ? AND deleted = 0 LIMIT 1"),
        arguments: [account, container, item.itemID]
      ).map { try RecordJSON.decodeStored($0) }
      return TreeSnapshot(ancestors: [], namesake: nil, liveChild: child)
    }
    func read(_ id: String) throws -> CloudItem? {
      if let known = reads.records[id] { return known }
      let found = try record(db, account, container, id)
      reads.records[id] = found
      return found
    }
    // The ancestry of `item` were it in `parentID`: the walk up from there.
    func walkUp(from parentID: String?) throws -> AncestryCache.Ancestry {
      guard let parentID else { return AncestryCache.Ancestry(chain: [], loops: false) }
      if let known = reads.ancestries.ancestry(of: item.itemID, under: parentID) { return known }
      if let parent = try read(parentID), let extended = reads.ancestries.extending(parent) {
        return reads.ancestries.remember(extended, under: parentID, visited: [parentID], for: item.itemID)
      }
      return try reads.ancestries.walk(from: parentID, for: item.itemID, record: read)
    }
    let ancestry = try walkUp(from: item.parentID)
    let namesake = try Data.fetchOne(
      db.cached(
        """
        SELECT record FROM items WHERE account = ? AND container = ? AND parentID = ? AND name = ?
        AND deleted = 0 AND itemID <> ? LIMIT 1
        """), arguments: [account, container, item.parentID, item.name, item.itemID]
    ).map { try RecordJSON.decodeStored($0) }
    var tree = TreeSnapshot(ancestors: ancestry.chain, namesake: namesake)
    tree.ancestorsLoop = ancestry.loops
    // A folder that moves deeper: how deep its items go (a move that does not deepen it
    // leaves them where the limit already held them, and costs no walk of its contents).
    if item.kind == .directory, let current, !current.deleted, current.parentID != item.parentID,
      try ancestry.chain.count > walkUp(from: current.parentID).chain.count
    {
      tree.heightBelow = try heightBelow(
        db, account, container, item.itemID, atMost: TreeSnapshot.maxDepth - ancestry.chain.count + 1)
    }
    return tree
  }

  /// How many levels of live items `itemID` holds once it moves, counted no further than
  /// `atMost` levels. It is not below itself any more: a loop of parents through it (a repair
  /// moves one of its members) ends there.
  static func heightBelow(_ db: Database, _ account: String, _ container: String, _ itemID: String, atMost: Int)
    throws -> Int
  {
    try Int.fetchOne(
      db.cached(
        """
        WITH RECURSIVE below(itemID, depth) AS (
          SELECT itemID, 1 FROM items WHERE account = ?1 AND container = ?2 AND parentID = ?3 AND deleted = 0
          UNION ALL
          SELECT i.itemID, b.depth + 1 FROM below b JOIN items i
            ON i.account = ?1 AND i.container = ?2 AND i.parentID = b.itemID AND i.deleted = 0 AND i.itemID <> ?3
          WHERE b.depth < ?4)
        SELECT COALESCE(MAX(depth), 0) FROM below
        """), arguments: [account, container, itemID, max(atMost, 1)]) ?? 0
  }

  /// Writes `item` with the container's next change sequence number as its etag; returns the
  /// record as stored.
  static func store(_ db: Database, _ account: String, _ container: String, _ item: CloudItem) throws
    -> StoredRecord
  {
    try db.cached("UPDATE containers SET lastSeq = lastSeq + 1 WHERE account = ? AND container = ?")
      .execute(arguments: [account, container])
    let seq =
      try Int64.fetchOne(
        db.cached("SELECT lastSeq FROM containers WHERE account = ? AND container = ?"),
        arguments: [account, container]) ?? 0
    return try write(db, account, container, item, seq: seq)
  }

  /// Writes `item` as change `seq` (also its etag); returns the record as stored.
  static func write(_ db: Database, _ account: String, _ container: String, _ item: CloudItem, seq: Int64) throws
    -> StoredRecord
  {
    var record = item
    record.changeSeq = seq
    record.etag = String(seq)
    let encoded = RecordJSON.encode(record)
    try db.cached(
      """
      INSERT INTO items(account, container, itemID, changeSeq, etag, deleted, record, parentID, name)
      VALUES (?,?,?,?,?,?,?,?,?)
      ON CONFLICT(account, container, itemID) DO UPDATE SET changeSeq = excluded.changeSeq,
        etag = excluded.etag, deleted = excluded.deleted, record = excluded.record, parentID = excluded.parentID,
        name = excluded.name
      """
    ).execute(
      arguments: [
        account, container, record.itemID, seq, record.etag, record.deleted, encoded, record.parentID, record.name,
      ])
    return StoredRecord(item: record, bytes: Int64(encoded.count))
  }

  public func storedChanges(account: String, container: String, since: Int64, limit: Int, maxBytes: Int)
    async throws -> StoredChangePage
  {
    try await readOrUnavailable { db in
      guard try Self.containerExists(db, account, container) else {
        throw CloudError.notFound("container \(container)")
      }
      let rows = try Row.fetchAll(
        db.cached(
          """
          SELECT changeSeq, record FROM items WHERE account = ? AND container = ? AND changeSeq > ?
          ORDER BY changeSeq LIMIT ?
          """), arguments: [account, container, since, limit + 1]
      ).map { (seq: $0["changeSeq"] as Int64, record: $0["record"] as Data) }
      return StoredChangePage.page(of: rows, since: since, limit: limit, maxBytes: maxBytes)
    }
  }

  public func lastChange(account: String, container: String) async throws -> Int64 {
    try await readOrUnavailable { db in
      guard
        let seq = try Int64.fetchOne(
          db.cached("SELECT lastSeq FROM containers WHERE account = ? AND container = ?"),
          arguments: [account, container])
      else { throw CloudError.notFound("container \(container)") }
      return seq
    }
  }

  public func knownChunks(account: String, hashes: [String]) async throws -> Set<String> {
    if hashes.isEmpty { return [] }
    return try await readOrUnavailable { db in
      var found = Set<String>()
      try Self.inSlices(hashes) { _, padded, marks in
        let got = try String.fetchAll(
          db.cached("SELECT hash FROM chunks WHERE account = ? AND doomed = 0 AND hash IN (\(marks))"),
          arguments: StatementArguments([account] + padded))
        found.formUnion(got)
      }
      return found
    }
  }

  public func chunkSizes(account: String, hashes: [String]) async throws -> [String: Int64] {
    if hashes.isEmpty { return [:] }
    return try await readOrUnavailable { db in
      var found: [String: Int64] = [:]
      try Self.inSlices(hashes) { _, padded, marks in
        for row in try Row.fetchAll(
          db.cached("SELECT hash, size FROM chunks WHERE account = ? AND doomed = 0 AND hash IN (\(marks))"),
          arguments: StatementArguments([account] + padded))
        {
          found[row["hash"]] = row["size"]
        }
      }
      return found
    }
  }

  public func chunkSize(account: String, hash: String) async throws -> Int64? {
    try await readOrUnavailable { db in
      try Int64.fetchOne(
        db.cached("SELECT size FROM chunks WHERE account = ? AND hash = ? AND doomed = 0"), arguments: [account, hash])
    }
  }

  public func recordChunk(account: String, hash: String, size: Int64, now: Int64) async throws {
    try await writeOrUnavailable { db in
      let usage = try Self.usageRow(db, account)
      if let doomed = try Bool.fetchOne(
        db.cached("SELECT doomed FROM chunks WHERE account = ? AND hash = ?"), arguments: [account, hash])
      {
        if doomed { throw CloudError.unavailable("chunk \(hash) is being garbage-collected; retry in a moment") }
        try db.cached("UPDATE chunks SET lastUsed = ? WHERE account = ? AND hash = ?")
          .execute(arguments: [now, account, hash])
        return
      }
      guard usage.admits(size) else { throw CloudError.quotaExceeded(usage) }
      try db.cached("INSERT INTO chunks(account, hash, size, lastUsed) VALUES (?,?,?,?)")
        .execute(arguments: [account, hash, size, now])
      try db.cached("UPDATE accounts SET usedBytes = usedBytes + ? WHERE name = ?").execute(arguments: [size, account])
    }
  }

  public func touchChunks(account: String, hashes: [String], now: Int64) async throws {
    if hashes.isEmpty { return }
    try await writeOrUnavailable { db in
      try Self.inSlices(hashes) { _, padded, marks in
        try db.cached(
          "UPDATE chunks SET lastUsed = ? WHERE account = ? AND doomed = 0 AND lastUsed < ? AND hash IN (\(marks))"
        ).execute(
          arguments: StatementArguments(
            [now as (any DatabaseValueConvertible)?, account, now - 60]
              + padded.map { $0 as (any DatabaseValueConvertible)? }))
      }
    }
  }

  public func isChunkDoomed(account: String, hash: String) async throws -> Bool {
    try await readOrUnavailable { db in
      try Bool.fetchOne(
        db.cached("SELECT doomed FROM chunks WHERE account = ? AND hash = ?"), arguments: [account, hash]) == true
    }
  }

  public func doomUnreferencedChunks(account: String, unusedBefore: Int64) async throws -> [String] {
    try await writeOrUnavailable { db in
      // One write transaction: no commit can slip in between reading the references and
      // dooming. Records are read only when some chunk is old enough to go.
      let stale = try String.fetchAll(
        db, sql: "SELECT hash FROM chunks WHERE account = ? AND doomed = 0 AND lastUsed < ?",
        arguments: [account, unusedBefore])
      if !stale.isEmpty {
        var referenced = Set<String>()
        let records = try Data.fetchCursor(
          db, sql: "SELECT record FROM items WHERE account = ?", arguments: [account])
        while let data = try records.next() {
          referenced.formUnion(CloudEngine.referencedChunks(try RecordJSON.decodeStored(data)))
        }
        for hash in stale where !referenced.contains(hash) {
          try db.execute(
            sql: "UPDATE chunks SET doomed = 1 WHERE account = ? AND hash = ?", arguments: [account, hash])
        }
      }
      return try String.fetchAll(
        db, sql: "SELECT hash FROM chunks WHERE account = ? AND doomed = 1 ORDER BY hash", arguments: [account])
    }
  }

  public func forgetDoomedChunks(account: String, hashes: [String]) async throws -> Int64 {
    try await writeOrUnavailable { db in
      var freed: Int64 = 0
      for hash in hashes {
        guard
          let size = try Int64.fetchOne(
            db, sql: "SELECT size FROM chunks WHERE account = ? AND hash = ? AND doomed = 1",
            arguments: [account, hash])
        else { continue }
        try db.execute(sql: "DELETE FROM chunks WHERE account = ? AND hash = ?", arguments: [account, hash])
        freed += size
      }
      try db.execute(
        sql: "UPDATE accounts SET usedBytes = max(0, usedBytes - ?) WHERE name = ?", arguments: [freed, account])
      return freed
    }
  }

  /// The account's usage: chunk bytes plus metadata bytes, and its quota.
  static func usageRow(_ db: Database, _ account: String) throws -> Usage {
    guard
      let row = try Row.fetchOne(
        db.cached("SELECT usedBytes, quotaBytes, metadataBytes FROM accounts WHERE name = ?"), arguments: [account])
    else { throw CloudError.notFound("account \(account)") }
    let chunks: Int64 = row["usedBytes"]
    let metadata: Int64 = row["metadataBytes"]
    let (used, overflow) = chunks.addingReportingOverflow(metadata)
    return Usage(usedBytes: overflow ? .max : used, quotaBytes: row["quotaBytes"], metadataBytes: metadata)
  }

  public func usage(account: String) async throws -> Usage {
    try await readOrUnavailable { db in try Self.usageRow(db, account) }
  }

  public func setQuota(account: String, bytes: Int64) async throws {
    try await writeOrUnavailable { db in
      _ = try Self.usageRow(db, account)
      try db.execute(sql: "UPDATE accounts SET quotaBytes = ? WHERE name = ?", arguments: [bytes, account])
    }
  }

  // MARK: AccountStore

  public func createAccount(_ account: String, quotaBytes: Int64) async throws {
    try await writeOrUnavailable { db in
      if try Bool.fetchOne(db, sql: "SELECT 1 FROM accounts WHERE name = ?", arguments: [account]) == true {
        throw CloudError.exists("account \(account)")
      }
      try db.execute(
        sql: "INSERT INTO accounts(name, quotaBytes) VALUES (?, ?)", arguments: [account, quotaBytes])
    }
  }

  public func accountExists(_ account: String) async throws -> Bool {
    try await readOrUnavailable { db in
      try Bool.fetchOne(db, sql: "SELECT 1 FROM accounts WHERE name = ?", arguments: [account]) == true
    }
  }

  public func accounts() async throws -> [String] {
    try await readOrUnavailable { db in try String.fetchAll(db, sql: "SELECT name FROM accounts ORDER BY name") }
  }

  public func addToken(_ record: TokenRecord, tokenHash: String) async throws {
    try await writeOrUnavailable { db in
      _ = try Self.usageRow(db, record.account)
      try db.execute(
        sql: """
          INSERT INTO tokens(id, hash, account, device, createdAt, revoked, scope, expiresAt)
          VALUES (?,?,?,?,?,0,?,?)
          """,
        arguments: [
          record.id, tokenHash, record.account, record.device, record.createdAt, record.scope.rawValue,
          record.expiresAt,
        ])
    }
  }

  static func tokenRecord(_ row: Row) -> TokenRecord {
    TokenRecord(
      id: row["id"], account: row["account"], device: row["device"], createdAt: row["createdAt"],
      revoked: row["revoked"], scope: TokenScope(rawValue: row["scope"]) ?? .device, expiresAt: row["expiresAt"])
  }

  public func token(hash tokenHash: String) async throws -> TokenRecord? {
    try await readOrUnavailable { db in
      try Row.fetchOne(db.cached("SELECT * FROM tokens WHERE hash = ? AND revoked = 0"), arguments: [tokenHash])
        .map(Self.tokenRecord)
    }
  }

  public func tokens(account: String) async throws -> [TokenRecord] {
    try await readOrUnavailable { db in
      try Row.fetchAll(
        db, sql: "SELECT * FROM tokens WHERE account = ? ORDER BY createdAt, id", arguments: [account]
      ).map(Self.tokenRecord)
    }
  }

  public func revokeToken(account: String, id: String) async throws -> Bool {
    try await writeOrUnavailable { db in
      try db.execute(
        sql: "UPDATE tokens SET revoked = 1 WHERE account = ? AND id = ? AND revoked = 0", arguments: [account, id])
      return db.changesCount > 0
    }
  }

  public func rotateToken(account: String, id: String, oldHash: String, newHash: String) async throws -> Bool {
    try await writeOrUnavailable { db in
      try db.execute(
        sql: "UPDATE tokens SET hash = ? WHERE account = ? AND id = ? AND hash = ? AND revoked = 0",
        arguments: [newHash, account, id, oldHash])
      return db.changesCount > 0
    }
  }

  public func revokeTokens(account: String, device: String?) async throws -> Int {
    try await writeOrUnavailable { db in
      if let device {
        try db.execute(
          sql: "UPDATE tokens SET revoked = 1 WHERE account = ? AND device = ? AND revoked = 0",
          arguments: [account, device])
      } else {
        try db.execute(sql: "UPDATE tokens SET revoked = 1 WHERE account = ? AND revoked = 0", arguments: [account])
      }
      return db.changesCount
    }
  }

  // MARK: KeyValueStorage

  static func kvEntry(_ row: Row) throws -> KVEntry {
    let text: String? = row["value"]
    let value = try text.map { try decoder.decode(JSONValue.self, from: Data($0.utf8)) }
    return KVEntry(key: row["key"], value: value, timestamp: row["timestamp"], device: row["device"], seq: row["seq"])
  }

  public func kvEntries(account: String, container: String, since: Int64) async throws -> KVSnapshot {
    try await readOrUnavailable { db in
      guard
        let head = try Row.fetchOne(
          db, sql: "SELECT kvSeq FROM containers WHERE account = ? AND container = ?",
          arguments: [account, container])
      else { throw CloudError.notFound("container \(container)") }
      let rows = try Row.fetchAll(
        db,
        sql: """
          SELECT * FROM kv WHERE account = ? AND container = ? AND seq > ? \(since == 0 ? "AND value IS NOT NULL" : "")
          ORDER BY seq
          """, arguments: [account, container, since])
      let totals = try Row.fetchOne(
        db,
        sql:
          "SELECT COALESCE(SUM(cost), 0) AS used, COUNT(*) AS n FROM kv WHERE account = ? AND container = ? AND value IS NOT NULL",
        arguments: [account, container])!
      return KVSnapshot(
        entries: try rows.map(Self.kvEntry), token: head["kvSeq"], usedBytes: totals["used"], keyCount: totals["n"])
    }
  }

  public func kvWrite(account: String, container: String, write: KVWrite, limits: KVLimits) async throws
    -> KVWriteResult
  {
    let cost = try KVLimits.cost(key: write.key, value: write.value)
    let text = try write.value.map { String(decoding: try $0.jsonData(), as: UTF8.self) }
    return try await writeOrUnavailable { db in
      guard try Self.containerExists(db, account, container) else {
        throw CloudError.notFound("container \(container)")
      }
      let current = try Row.fetchOne(
        db, sql: "SELECT * FROM kv WHERE account = ? AND container = ? AND key = ?",
        arguments: [account, container, write.key])
      let currentEntry = try current.map(Self.kvEntry)
      let kvSeq: Int64 =
        try Int64.fetchOne(
          db, sql: "SELECT kvSeq FROM containers WHERE account = ? AND container = ?", arguments: [account, container])
        ?? 0
      if let currentEntry, !currentEntry.isReplaced(byTimestamp: write.timestamp, device: write.device) {
        return KVWriteResult(applied: false, entry: currentEntry, token: kvSeq)
      }
      if write.value != nil {
        let totals = try Row.fetchOne(
          db,
          sql: """
            SELECT COALESCE(SUM(cost), 0) AS used, COUNT(*) AS n FROM kv
            WHERE account = ? AND container = ? AND value IS NOT NULL AND key <> ?
            """, arguments: [account, container, write.key])!
        try KVQuota.check(
          otherBytes: totals["used"], otherKeys: totals["n"], cost: cost, limits: limits)
      }
      let seq = kvSeq + 1
      try db.execute(
        sql: "UPDATE containers SET kvSeq = ? WHERE account = ? AND container = ?",
        arguments: [seq, account, container])
      try db.execute(
        sql: """
          INSERT INTO kv(account, container, key, value, timestamp, device, seq, cost) VALUES (?,?,?,?,?,?,?,?)
          ON CONFLICT(account, container, key) DO UPDATE SET value = excluded.value,
            timestamp = excluded.timestamp, device = excluded.device, seq = excluded.seq, cost = excluded.cost
          """,
        arguments: [account, container, write.key, text, write.timestamp, write.device, seq, cost])
      return KVWriteResult(
        applied: true,
        entry: KVEntry(key: write.key, value: write.value, timestamp: write.timestamp, device: write.device, seq: seq),
        token: seq)
    }
  }
}

/// The If-Match rule every metadata engine applies inside its commit transaction.
public enum CommitRule {
  /// A live item needs its current etag, and so does a tombstone that a live version is to
  /// replace: a version sent with no etag was made before the delete it meets (a first upload
  /// retried after its reply was lost, or one the network held back and delivered after the
  /// delete), and must not bring the item back unseen; the client that meant it merges and
  /// sends it again with the tombstone's etag. A delete of a tombstone needs no etag (or its
  /// own). A missing item needs none; an etag for an item that never existed is `notFound`.
  /// A live item keeps its kind: a folder rewritten as a file would leave its items under a
  /// non-folder, and no client turns one item into another kind (a file saved over a folder's
  /// name is a new item).
  public static func check(current: CloudItem?, ifMatch: String?, writing item: CloudItem) throws {
    if let current {
      let etagNeeded = !current.deleted || !item.deleted
      if ifMatch != current.etag && (etagNeeded || ifMatch != nil) {
        throw CloudError.conflict(current: current)
      }
      if !current.deleted && !item.deleted && current.kind != item.kind {
        throw CloudError.invalid("item \(item.itemID) is a \(current.kind): an item's kind does not change")
      }
    } else if ifMatch != nil {
      throw CloudError.notFound("item \(item.itemID)")
    }
  }
}

/// The key-value store's totals rule, shared by the engines.
public enum KVQuota {
  public static func check(otherBytes: Int64, otherKeys: Int, cost: Int64, limits: KVLimits) throws {
    if otherKeys + 1 > limits.maxKeys {
      throw KeyValueError.quotaViolation("the store already holds \(otherKeys) keys (maximum \(limits.maxKeys))")
    }
    let (total, overflow) = otherBytes.addingReportingOverflow(cost)
    if overflow || total > limits.maxTotalBytes {
      throw KeyValueError.quotaViolation(
        "\(otherBytes) + \(cost) bytes exceeds the store's \(limits.maxTotalBytes) bytes")
    }
  }
}
