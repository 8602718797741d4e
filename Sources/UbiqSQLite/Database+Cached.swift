import GRDB

extension Database {
  /// A prepared statement from this connection's cache. Statements that run on every request
  /// (a FUSE operation, a commit) cost more to compile (SQLite's parser plus GRDB's
  /// authorizer) than to run.
  public func cached(_ sql: String) throws -> Statement { try cachedStatement(sql: sql) }
}
