import GRDB

extension IndexStore {
  /// Runs a single-statement read without GRDB's BEGIN/COMMIT around it: one SQLite statement
  /// already sees one consistent snapshot. Multi-statement reads use `pool.read`.
  func readOne<T>(_ body: (Database) throws -> T) throws -> T { try pool.unsafeRead(body) }
}
