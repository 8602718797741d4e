import GRDB

extension Database {
  /// A prepared statement from this connection's cache. The index's queries run on every FUSE
  /// request; compiling them each time (SQLite's parser plus GRDB's authorizer) cost more than
  /// running them.
  func cached(_ sql: String) throws -> Statement { try cachedStatement(sql: sql) }
}

extension IndexStore {
  /// Runs a single-statement read without GRDB's BEGIN/COMMIT around it: one SQLite statement
  /// already sees one consistent snapshot. Multi-statement reads use `pool.read`.
  func readOne<T>(_ body: (Database) throws -> T) throws -> T { try pool.unsafeRead(body) }
}
