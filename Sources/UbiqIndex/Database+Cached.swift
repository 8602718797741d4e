import Foundation
import GRDB
import UbiqCore

extension IndexStore {
  /// Runs a single-statement read without a transaction around it: one SQLite statement
  /// already sees one consistent snapshot. Multi-statement reads use `pool.read`.
  func readOne<T>(_ body: (Database) throws -> T) throws -> T {
    if batch?.isOpen == true { return try pool.unsafeReentrantWrite(body) }
    return try statementReaders.read(body) ?? pool.unsafeRead(body)
  }

  /// Runs a read in one transaction. While a batch is open its changes are in the writer's
  /// transaction only: the read runs there, after the change running now.
  func read<T>(_ body: (Database) throws -> T) throws -> T {
    if batch?.isOpen == true { return try pool.unsafeReentrantWrite(body) }
    return try pool.read(body)
  }

  /// Runs `body` in one write transaction, as `pool.write` does, with BEGIN IMMEDIATE and
  /// COMMIT prepared once per connection (GRDB parses them again for every transaction, which
  /// cost a tenth of a create's index time). A body that throws is rolled back; a transaction
  /// that SQLite ended by itself (disk full, I/O error) fails at its COMMIT. A body must not
  /// catch a database error and go on: after SQLite rolled back by itself, its next statements
  /// would each commit alone.
  /// An open batch commits first: a change here (the uploader's, the puller's) is its own
  /// transaction and may be followed by a request to the cloud that relies on it.
  func write<T>(_ body: (Database) throws -> T) throws -> T {
    try pool.writeWithoutTransaction { db in
      try batch?.commit(db)
      try db.cached("BEGIN IMMEDIATE TRANSACTION").execute()
      do {
        // A batch's redo log applies only on the state it began on.
        try NamespaceBatch.bumpSeq(db)
        let value = try body(db)
        try db.cached("COMMIT TRANSACTION").execute()
        return value
      } catch {
        if db.isInsideTransaction { try? db.rollback() }
        throw error
      }
    }
  }

  /// Runs `body` as one change of the open batch (`NamespaceBatch`): a namespace change or a
  /// content record of the mount, which promises no more than a WAL commit did (durable
  /// against a killed daemon, by the redo log; against a power loss only after `makeDurable`).
  /// Without batching, `write`. A body that throws is undone; the rest of the batch stays.
  func batchedWrite<T>(_ body: (Database) throws -> T) throws -> T {
    guard let batch else { return try write(body) }
    return try pool.writeWithoutTransaction { db in try batch.run(db, body) }
  }

  /// `batchedWrite` for a change that frees room or takes none (a removal, a rename, a
  /// truncation, a mode or a time): if the disk is full, the space reserve is given back and the
  /// change tried once more, so that a full disk can be emptied through the mount, as on ext4.
  func batchedWriteFreeingRoom<T>(_ body: (Database) throws -> T) throws -> T {
    do {
      return try batchedWrite(body)
    } catch let error as DatabaseError where error.resultCode == .SQLITE_FULL {
      guard let reserve, reserve.release() else { throw error }
      return try batchedWrite(body)
    }
  }

  /// Inserts `row` into `items` with a statement prepared once per connection (GRDB's record
  /// insert builds its SQL for every call), and sets its `id` to the new inode.
  static func insertItem(_ db: Database, _ row: inout ItemRow) throws {
    try db.cached(insertItemSQL).execute(arguments: StatementArguments(row.databaseValues))
    row.id = db.lastInsertedRowID
  }

  /// Writes every column of `row` over the row with its `id`; throws if there is none.
  static func updateItem(_ db: Database, _ row: ItemRow) throws {
    guard let id = row.id else { throw UbiqError.io("an item row without an inode cannot be updated") }
    // Every column but the first, `id`: rewriting the rowid would delete and insert the row.
    var arguments = StatementArguments(row.databaseValues.dropFirst())
    arguments += [id]
    try db.cached(updateItemSQL).execute(arguments: arguments)
    if db.changesCount == 0 {
      throw RecordError.recordNotFound(databaseTableName: "items", key: ["id": id.databaseValue])
    }
  }

  private static let insertItemSQL =
    "INSERT INTO items(\(ItemRow.columnNames.joined(separator: ", "))) VALUES ("
    + Array(repeating: "?", count: ItemRow.columnNames.count).joined(separator: ", ") + ")"

  private static let updateItemSQL =
    "UPDATE items SET \(ItemRow.columnNames.dropFirst().map { "\($0) = ?" }.joined(separator: ", ")) WHERE id = ?"
}

/// Read-only connections for the single-statement reads of every lookup, getattr and readdir
/// (`IndexStore.readOne`); each read takes the connection with the fewest reads running on it
/// (in turn among equals), so a slow read holds up no other while a connection is free. GRDB's
/// pool asks each read for the schema version (one more statement, a fifth of a getattr); this
/// index's schema changes only when it is opened (its migrations), and SQLite prepares a
/// statement again by itself if it ever does.
final class StatementReaders: @unchecked Sendable {
  static let count = 4
  private let queues: [DatabaseQueue]
  private let lock = NSLock()
  /// Where the search for the least used connection starts (guarded by `lock`).
  private var next = 0
  /// Reads running or waiting on each connection (guarded by `lock`).
  private var running: [Int]

  init(queues: [DatabaseQueue]) {
    self.queues = queues
    running = Array(repeating: 0, count: queues.count)
  }

  /// `body` on the least used connection, or nil when there are none (a read-only index).
  func read<T>(_ body: (Database) throws -> T) throws -> T? {
    if queues.isEmpty { return nil }
    let chosen = lock.withLock {
      var best = next
      for k in 1..<queues.count {
        let i = (next + k) % queues.count
        if running[i] < running[best] { best = i }
      }
      running[best] += 1
      next = (best + 1) % queues.count
      return best
    }
    defer { lock.withLock { running[chosen] -= 1 } }
    return try queues[chosen].unsafeRead(body)
  }
}
