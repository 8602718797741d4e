import Foundation
import GRDB

extension DatabaseMigrator {
  /// Applies the unapplied migrations to a database that other processes may be opening at the
  /// same moment (a server and the admin CLI on one new storage folder, a daemon and the CLI on
  /// one index).
  ///
  /// GRDB reads which migrations are applied before it runs them, outside their transactions:
  /// another process can apply one in between. Each migration's transaction also records its
  /// identifier, so the loser's transaction fails and is rolled back and no migration is ever
  /// applied twice; this reads the applied ones again and goes on. It gives up (rethrows) when a
  /// failure came with no new migration applied by anyone, which is a migration's own error.
  public func migrateAmongProcesses(_ writer: any DatabaseWriter) throws {
    var applied = try writer.read { try appliedIdentifiers($0) }
    while true {
      do {
        try migrate(writer)
        return
      } catch {
        let now = try writer.read { try appliedIdentifiers($0) }
        guard now.count > applied.count else { throw error }
        applied = now
      }
    }
  }
}

extension DatabasePool {
  /// Opens a pool on a database that other processes may be opening at the same moment. A new
  /// database is switched to WAL on its first open, which takes a lock SQLite does not wait for
  /// (the busy timeout does not apply): the loser gets SQLITE_BUSY. The open is retried, after
  /// a short random pause, for up to `patienceSeconds`.
  public static func openAmongProcesses(
    path: String, configuration: Configuration, patienceSeconds: Double = 10
  ) throws -> DatabasePool {
    var waited = 0.0
    while true {
      do {
        return try DatabasePool(path: path, configuration: configuration)
      } catch let error as DatabaseError where error.resultCode == .SQLITE_BUSY && waited < patienceSeconds {
        let pause = Double.random(in: 0.005...0.05)
        usleep(UInt32(pause * 1_000_000))
        waited += pause
      }
    }
  }
}
