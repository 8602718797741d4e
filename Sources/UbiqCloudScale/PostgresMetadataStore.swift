import Foundation
import Logging
import NIOSSL
import PostgresNIO
import UbiqCloud
import UbiqCloudAPI
import UbiqCore

/// The scale-out metadata engine: the same tables and rules as `SQLiteMetadataStore` in
/// PostgreSQL, so any number of `ubiqfs serve` processes can share one database. Commits lock
/// the container row (`SELECT ... FOR UPDATE`), which makes each container's change sequence
/// gap-free and committed in order; quota charges lock the account row.
/// Sendable: immutable after init; the PostgreSQL client pool is thread-safe.
public final class PostgresMetadataStore: ServerMetadataStore, @unchecked Sendable {
  /// Run this (it is a ServiceLifecycle service) for as long as the store is used.
  public let client: PostgresClient
  /// The pool's and the queries' logger.
  let log: Logger
  /// The store's own messages (a schema update waiting on running servers).
  let messages: Logger
  static let encoder = JSONEncoder()
  static let decoder = JSONDecoder()

  /// `logger` takes the pool's and the queries' messages; `messages` the store's own (by
  /// default `logger` too).
  public init(url: String, logger: Logger = Logger(label: "ubiqfs.postgres"), messages: Logger? = nil) throws {
    client = PostgresClient(configuration: try Self.configuration(url: url), backgroundLogger: logger)
    log = logger
    self.messages = messages ?? logger
  }

  /// Where and how to connect, parsed from
  /// `postgres://user:password@host:port/database[?sslmode=MODE][&sslrootcert=FILE]`;
  /// `?host=/run/postgresql` selects a Unix socket folder. The modes are libpq's: `disable`
  /// (plain text), `prefer` (default: TLS if the server offers it, unverified), `require` (TLS,
  /// unverified unless `sslrootcert` is given, then like `verify-ca`), `verify-ca` (the chain
  /// must verify against `sslrootcert` or the system roots), `verify-full` (the chain and the
  /// host name must verify; the mode for production).
  struct Settings {
    enum Mode { case disable, prefer, require }
    var host: String
    var port: Int
    var socketPath: String?
    var user: String
    var password: String?
    var database: String
    var mode: Mode
    var tls: TLSConfiguration

    init(url: String) throws {
      guard let c = URLComponents(string: url), c.scheme == "postgres" || c.scheme == "postgresql" else {
        throw CloudError.invalid("bad PostgreSQL URL '\(url)' (want postgres://user:password@host:port/database)")
      }
      let params = Dictionary(
        (c.queryItems ?? []).map { ($0.name, $0.value ?? "") }, uniquingKeysWith: { $1 })
      user = c.percentEncodedUser.flatMap { $0.removingPercentEncoding } ?? "postgres"
      password = c.percentEncodedPassword.flatMap { $0.removingPercentEncoding }
      database = c.path.hasPrefix("/") && c.path.count > 1 ? String(c.path.dropFirst()) : user
      host = c.host ?? "127.0.0.1"
      port = c.port ?? 5432
      if let socketDir = params["host"], socketDir.hasPrefix("/") { socketPath = "\(socketDir)/.s.PGSQL.\(port)" }
      tls = TLSConfiguration.makeClientConfiguration()
      let root = params["sslrootcert"].flatMap { $0.isEmpty ? nil : $0 }
      if let root {
        let roots: [NIOSSLCertificate]
        do { roots = try NIOSSLCertificate.fromPEMFile(root) } catch {
          throw CloudError.invalid("cannot read the PostgreSQL root certificate \(root): \(error)")
        }
        guard !roots.isEmpty else { throw CloudError.invalid("no certificate in \(root)") }
        tls.trustRoots = .certificates(roots)
      }
      switch params["sslmode"] ?? "prefer" {
      case "disable": mode = .disable
      case "prefer":
        mode = .prefer
        tls.certificateVerification = .none
      case "require":
        mode = .require
        tls.certificateVerification = root == nil ? .none : .noHostnameVerification
      case "verify-ca":
        mode = .require
        tls.certificateVerification = .noHostnameVerification
      case "verify-full":
        mode = .require
        tls.certificateVerification = .fullVerification
      case let other:
        throw CloudError.invalid(
          "unknown PostgreSQL sslmode '\(other)' (want disable, prefer, require, verify-ca or verify-full)")
      }
    }

    /// One connection's configuration (for `probe`).
    func connection() throws -> PostgresConnection.Configuration {
      var config: PostgresConnection.Configuration
      if let socketPath {
        config = .init(unixSocketPath: socketPath, username: user, password: password, database: database)
      } else {
        let t: PostgresConnection.Configuration.TLS
        switch mode {
        case .disable: t = .disable
        case .prefer: t = .prefer(try NIOSSLContext(configuration: tls))
        case .require: t = .require(try NIOSSLContext(configuration: tls))
        }
        config = .init(host: host, port: port, username: user, password: password, database: database, tls: t)
      }
      config.options.connectTimeout = .seconds(5)
      return config
    }
  }

  /// Opens and closes one connection, so a server that is down, refuses TLS or presents a
  /// certificate that does not verify is reported at once with the reason (the pool would
  /// retry quietly).
  public static func probe(url: String, logger: Logger) async throws {
    let settings = try Settings(url: url)
    do {
      let conn = try await PostgresConnection.connect(configuration: try settings.connection(), id: 0, logger: logger)
      try await conn.close()
    } catch let e as CloudError {
      throw e
    } catch {
      let target = settings.socketPath ?? "\(settings.host):\(settings.port)"
      var reason = String(describing: error)
      if let e = error as? PSQLError {
        if let underlying = e.underlying {
          reason = String(describing: underlying)
          if underlying is NIOSSLError || underlying is BoringSSLError {
            reason = "TLS failed, check --postgres-sslmode and --postgres-ca: \(reason)"
          }
        } else if let message = e.serverInfo?[.message] {
          reason = message
        } else {
          reason = "\(e.code)"
        }
      }
      reason = reason.replacingOccurrences(of: "\n", with: " ")
      throw CloudError.unavailable("PostgreSQL at \(target): \(reason)")
    }
  }

  /// The pool's configuration for a URL (see `Settings`).
  public static func configuration(url: String) throws -> PostgresClient.Configuration {
    let settings = try Settings(url: url)
    var config: PostgresClient.Configuration
    if let socketPath = settings.socketPath {
      config = .init(
        unixSocketPath: socketPath, username: settings.user, password: settings.password, database: settings.database)
    } else {
      let tls: PostgresClient.Configuration.TLS
      switch settings.mode {
      case .disable: tls = .disable
      case .prefer: tls = .prefer(settings.tls)
      case .require: tls = .require(settings.tls)
      }
      config = .init(
        host: settings.host, port: settings.port, username: settings.user, password: settings.password,
        database: settings.database, tls: tls)
    }
    config.options.connectTimeout = .seconds(5)
    config.options.maximumConnections = 16
    return config
  }

  // MARK: plumbing

  /// Runs `body` in a transaction on one pooled connection; the body's own errors are rethrown
  /// unchanged (after ROLLBACK), so typed `CloudError`s reach the caller.
  func transaction<T>(_ body: (PostgresConnection) async throws -> T) async throws -> T {
    try await mapErrors { try await unmappedTransaction(body) }
  }

  /// `transaction` with PostgreSQL's errors as they are (`PSQLError`, with its SQLSTATE).
  func unmappedTransaction<T>(_ body: (PostgresConnection) async throws -> T) async throws -> T {
    try await client.withConnection { conn in
      try await conn.query("BEGIN", logger: log)
      do {
        let value = try await body(conn)
        try await conn.query("COMMIT", logger: log)
        return value
      } catch {
        _ = try? await conn.query("ROLLBACK", logger: log)
        throw error
      }
    }
  }

  func read<T>(_ body: (PostgresConnection) async throws -> T) async throws -> T {
    try await mapErrors { try await client.withConnection { try await body($0) } }
  }

  func mapErrors<T>(_ body: () async throws -> T) async throws -> T {
    do {
      return try await body()
    } catch {
      throw Self.mapped(error)
    }
  }

  /// `error` as the metadata store reports it: typed errors unchanged, PostgreSQL's as
  /// `CloudError.unavailable`.
  static func mapped(_ error: Error) -> Error {
    switch error {
    case is CloudError, is KeyValueError, is CancellationError: return error
    case let e as PSQLError: return CloudError.unavailable("PostgreSQL: \(String(reflecting: e))")
    default: return CloudError.unavailable("PostgreSQL: \(error)")
    }
  }

  /// Creates or updates the schema if needed. A database that records this build's schema
  /// (`schemaDigest`) gets no DDL at all: `ALTER TABLE` waits for every transaction on its
  /// table and blocks those that come after it, so a server started next to running ones must
  /// not issue it. An update is serialized by an advisory lock (several servers may start at
  /// once), waits at most a few seconds for each table lock, and is tried again when it loses a
  /// deadlock or that wait to the running servers' transactions.
  public func migrate() async throws {
    if try await recordedSchemaDigest() == Self.schemaDigest { return }
    var attempt = 0
    while true {
      do {
        try await unmappedTransaction { conn in
          try await conn.query("SET LOCAL lock_timeout = '5s'", logger: log)
          try await conn.query("SELECT pg_advisory_xact_lock(7400105)", logger: log)
          for statement in Self.schema {
            try await conn.query(PostgresQuery(unsafeSQL: statement), logger: log)
          }
          try await conn.query(
            """
            INSERT INTO schema_version(id, digest) VALUES (1, \(Self.schemaDigest))
            ON CONFLICT (id) DO UPDATE SET digest = EXCLUDED.digest
            """, logger: log)
        }
        return
      } catch let e as PSQLError where Self.lostToOtherTransactions(e) && attempt < 12 {
        attempt += 1
        messages.warning("schema update waited on running servers (\(e.serverInfo?[.sqlState] ?? "")); trying again")
        try await Task.sleep(nanoseconds: UInt64(attempt) * 250_000_000)
      } catch {
        throw Self.mapped(error)
      }
    }
  }

  /// The schema digest the database records, nil before any was recorded.
  func recordedSchemaDigest() async throws -> String? {
    try await read { conn in
      let exists = try await Self.first(
        conn.query("SELECT to_regclass('schema_version') IS NOT NULL", logger: log), Bool.self)
      guard exists == true else { return nil }
      return try await Self.first(
        conn.query("SELECT digest FROM schema_version WHERE id = 1", logger: log), String.self)
    }
  }

  /// A deadlock the server broke by aborting this transaction, or a lock not granted within
  /// `lock_timeout`: the statement lost to other transactions and may be tried again.
  static func lostToOtherTransactions(_ e: PSQLError) -> Bool {
    guard let state = e.serverInfo?[.sqlState] else { return false }
    return state == "40P01" || state == "55P03"
  }

  /// The digest of `schema`: what a database that has it records in `schema_version`.
  static let schemaDigest = Chunker.sha256Hex(Data(schema.joined(separator: ";\n").utf8))

  static let schema = [
    "CREATE TABLE IF NOT EXISTS schema_version(id INT PRIMARY KEY CHECK (id = 1), digest TEXT NOT NULL)",
    """
    CREATE TABLE IF NOT EXISTS accounts(name TEXT PRIMARY KEY, quota_bytes BIGINT NOT NULL DEFAULT 0,
      used_bytes BIGINT NOT NULL DEFAULT 0)
    """,
    """
    CREATE TABLE IF NOT EXISTS containers(account TEXT NOT NULL, container TEXT NOT NULL,
      last_seq BIGINT NOT NULL DEFAULT 0, kv_seq BIGINT NOT NULL DEFAULT 0, PRIMARY KEY(account, container))
    """,
    """
    CREATE TABLE IF NOT EXISTS items(account TEXT NOT NULL, container TEXT NOT NULL, item_id TEXT NOT NULL,
      change_seq BIGINT NOT NULL, etag TEXT NOT NULL, deleted BOOLEAN NOT NULL, record TEXT NOT NULL,
      PRIMARY KEY(account, container, item_id))
    """,
    "CREATE INDEX IF NOT EXISTS items_by_seq ON items(account, container, change_seq)",
    """
    CREATE TABLE IF NOT EXISTS chunks(account TEXT NOT NULL, hash TEXT NOT NULL, size BIGINT NOT NULL,
      PRIMARY KEY(account, hash))
    """,
    """
    CREATE TABLE IF NOT EXISTS tokens(id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, account TEXT NOT NULL,
      device TEXT NOT NULL, created_at BIGINT NOT NULL, revoked BOOLEAN NOT NULL DEFAULT FALSE)
    """,
    "CREATE INDEX IF NOT EXISTS tokens_by_account ON tokens(account)",
    // Tokens from before scopes become device tokens: nothing old can manage devices until the
    // admin CLI issues an account token.
    "ALTER TABLE tokens ADD COLUMN IF NOT EXISTS scope TEXT NOT NULL DEFAULT 'device'",
    "ALTER TABLE tokens ADD COLUMN IF NOT EXISTS expires_at BIGINT",
    """
    CREATE TABLE IF NOT EXISTS kv(account TEXT NOT NULL, container TEXT NOT NULL, key TEXT NOT NULL,
      value TEXT, timestamp BIGINT NOT NULL, device TEXT NOT NULL, seq BIGINT NOT NULL, cost BIGINT NOT NULL,
      PRIMARY KEY(account, container, key))
    """,
    "CREATE INDEX IF NOT EXISTS kv_by_seq ON kv(account, container, seq)",
    // Each record's place, so a commit finds a live namesake through an index.
    "ALTER TABLE items ADD COLUMN IF NOT EXISTS parent_id TEXT",
    "ALTER TABLE items ADD COLUMN IF NOT EXISTS name TEXT",
    """
    UPDATE items SET parent_id = record::jsonb->>'parentID', name = record::jsonb->>'name' WHERE name IS NULL
    """,
    "CREATE INDEX IF NOT EXISTS items_by_parent ON items(account, container, parent_id, name)",
    // When each chunk was last uploaded, asked about or committed (seconds since the epoch;
    // chunks from before count as used now), and whether a collection pass is deleting it.
    "ALTER TABLE chunks ADD COLUMN IF NOT EXISTS last_used BIGINT NOT NULL DEFAULT extract(epoch FROM now())::BIGINT",
    "ALTER TABLE chunks ADD COLUMN IF NOT EXISTS doomed BOOLEAN NOT NULL DEFAULT FALSE",
    // Live items per container, kept by every commit, for the items-per-container limit.
    "ALTER TABLE containers ADD COLUMN IF NOT EXISTS live_items BIGINT",
    """
    UPDATE containers c SET live_items = (SELECT count(*) FROM items i WHERE i.account = c.account
      AND i.container = c.container AND NOT i.deleted) WHERE live_items IS NULL
    """,
    // What the account's live records cost against its quota (`MetadataCost`), kept by every
    // commit.
    "ALTER TABLE accounts ADD COLUMN IF NOT EXISTS metadata_bytes BIGINT",
    """
    UPDATE accounts a SET metadata_bytes = (SELECT coalesce(sum(\(MetadataCost.perItem) + octet_length(i.record)), 0)
      FROM items i WHERE i.account = a.name AND NOT i.deleted
        AND i.item_id NOT IN ('\(WellKnownItem.root)', '\(WellKnownItem.documents)')) WHERE metadata_bytes IS NULL
    """,
    "ALTER TABLE accounts ALTER COLUMN metadata_bytes SET DEFAULT 0",
    "ALTER TABLE accounts ALTER COLUMN metadata_bytes SET NOT NULL",
  ]

  static func first<T: PostgresDecodable & Sendable>(_ rows: PostgresRowSequence, _ type: T.Type) async throws -> T? {
    for try await value in rows.decode(T.self) { return value }
    return nil
  }

  // MARK: MetadataStore

  public func ensureAccount(_ account: String) async throws {
    _ = try await read { conn in
      try await conn.query(
        "INSERT INTO accounts(name) VALUES (\(account)) ON CONFLICT (name) DO NOTHING", logger: log)
    }
  }

  public func ensureContainer(account: String, container: String, seed: [CloudItem], maxContainers: Int)
    async throws
  {
    try await transaction { conn in
      let exists = try await Self.first(
        try await conn.query(
          "SELECT 1::INT4 FROM containers WHERE account = \(account) AND container = \(container)", logger: log),
        Int32.self)
      if exists != nil { return }
      // The account row lock serializes container creation, so the count holds.
      _ = try await self.usageRow(conn, account, lock: true)
      let count =
        try await Self.first(
          try await conn.query("SELECT count(*) FROM containers WHERE account = \(account)", logger: log),
          Int64.self) ?? 0
      if count >= Int64(maxContainers) {
        throw CloudError.limitExceeded("the account has \(count) containers, the most it may have")
      }
      let live = Int64(seed.filter { !$0.deleted }.count)
      let inserted = try await Self.first(
        try await conn.query(
          """
          INSERT INTO containers(account, container, live_items) VALUES (\(account), \(container), \(live))
          ON CONFLICT (account, container) DO NOTHING RETURNING 1
          """, logger: log), Int32.self)
      guard inserted != nil else { return }
      for item in seed { _ = try await self.store(conn, account, container, item) }
    }
  }

  public func containers(account: String) async throws -> [String] {
    try await read { conn in
      var out: [String] = []
      for try await c in try await conn.query(
        "SELECT container FROM containers WHERE account = \(account) ORDER BY container", logger: log
      ).decode(String.self) {
        out.append(c)
      }
      return out
    }
  }

  public func item(account: String, container: String, itemID: String) async throws -> CloudItem? {
    try await read { conn in
      try await Self.first(
        try await conn.query(
          "SELECT record FROM items WHERE account = \(account) AND container = \(container) AND item_id = \(itemID)",
          logger: log), String.self
      ).map { try RecordJSON.decodeStored(Data($0.utf8)) }
    }
  }

  public func items(account: String, container: String, itemIDs: [String]) async throws -> [String: CloudItem] {
    if itemIDs.isEmpty { return [:] }
    return try await read { conn in
      var found: [String: CloudItem] = [:]
      for batch in stride(from: 0, to: itemIDs.count, by: 1000) {
        let slice = Array(itemIDs[batch..<min(batch + 1000, itemIDs.count)])
        for try await record in try await conn.query(
          """
          SELECT record FROM items WHERE account = \(account) AND container = \(container) AND item_id = ANY(\(slice))
          """, logger: log
        ).decode(String.self) {
          let item = try RecordJSON.decodeStored(Data(record.utf8))
          found[item.itemID] = item
        }
      }
      return found
    }
  }

  public func commit(
    account: String, container: String, item: CloudItem, ifMatch: String?, chunks: Set<String>, rule: TreeRule?
  ) async throws -> CloudItem {
    try await transaction { conn in
      try await lockContainer(conn, account, container)
      var ancestries = AncestryCache()
      return try await commitOne(
        conn, account, container, ItemWrite(item: item, ifMatch: ifMatch, chunks: chunks, rule: rule),
        ancestries: &ancestries)
    }
  }

  public func commitAll(account: String, container: String, writes: [ItemWrite]) async throws -> ItemBatchResults {
    try await transaction { conn in
      try await lockContainer(conn, account, container)
      var committed: [CloudItem] = []
      // The batch's items mostly share their folders: each folder's ancestry is walked once.
      var ancestries = AncestryCache()
      for write in writes {
        // A write refused part way (the quota is checked after the record is stored) leaves
        // nothing: its savepoint is rolled back.
        try await conn.query("SAVEPOINT item_write", logger: log)
        do {
          let stored = try await commitOne(conn, account, container, write, ancestries: &ancestries)
          committed.append(stored)
          ancestries.written(stored.itemID)
          try await conn.query("RELEASE SAVEPOINT item_write", logger: log)
        } catch let error as CloudError {
          try await conn.query("ROLLBACK TO SAVEPOINT item_write", logger: log)
          return ItemBatchResults(committed: committed, refused: error)
        }
      }
      return ItemBatchResults(committed: committed, refused: nil)
    }
  }

  /// Locks the container's row for the transaction; `notFound` if there is no such container.
  /// The lock serializes commits per container: sequence numbers are handed out and committed
  /// in order, so a change feed reader never skips one.
  func lockContainer(_ conn: PostgresConnection, _ account: String, _ container: String) async throws {
    guard
      try await Self.first(
        try await conn.query(
          "SELECT last_seq FROM containers WHERE account = \(account) AND container = \(container) FOR UPDATE",
          logger: log), Int64.self) != nil
    else { throw CloudError.notFound("container \(container)") }
  }

  /// One write of a commit, inside its transaction, with the container's row locked.
  /// `ancestries`: what the transaction has walked of the tree; the caller notes each stored
  /// write in it.
  func commitOne(
    _ conn: PostgresConnection, _ account: String, _ container: String, _ write: ItemWrite,
    ancestries: inout AncestryCache
  ) async throws -> CloudItem {
    let item = write.item
    let current = try await storedRecord(conn, account, container, item.itemID)
    try CommitRule.check(current: current?.item, ifMatch: write.ifMatch, writing: item)
    let delta = Int64(item.deleted ? 0 : 1) - Int64(current.map { $0.item.deleted ? 0 : 1 } ?? 0)
    if let rule = write.rule {
      var tree = try await self.treeSnapshot(
        conn, account, container, item, current: current?.item, ancestries: &ancestries)
      tree.addsLiveItem = delta > 0
      tree.liveItems =
        try await Self.first(
          try await conn.query(
            "SELECT live_items FROM containers WHERE account = \(account) AND container = \(container)",
            logger: log), Int64.self) ?? 0
      try rule(tree)
    }
    try await self.useChunks(conn, account, write.chunks, now: Clock.nowSeconds())
    if delta != 0 {
      try await conn.query(
        """
        UPDATE containers SET live_items = live_items + \(delta) WHERE account = \(account)
        AND container = \(container)
        """, logger: log)
    }
    let stored = try await self.store(conn, account, container, item)
    try await self.chargeMetadata(conn, account, MetadataCost.charge(before: current, after: stored))
    return stored.item
  }

  /// Adds `charge` (what a commit changed in the cost of the records) to the account's
  /// metadata bytes; refuses growth past the quota.
  func chargeMetadata(_ conn: PostgresConnection, _ account: String, _ charge: Int64) async throws {
    if charge > 0 {
      let usage = try await usageRow(conn, account, lock: true)
      guard usage.admits(charge) else { throw CloudError.quotaExceeded(usage) }
    }
    if charge != 0 {
      try await conn.query(
        "UPDATE accounts SET metadata_bytes = metadata_bytes + \(charge) WHERE name = \(account)", logger: log)
    }
  }

  /// Marks a commit's chunks used, inside its transaction (the row locks make a concurrent
  /// collection pass skip them, or make this commit see them doomed); throws `missingChunks`
  /// for any that is not a live chunk of the account.
  func useChunks(_ conn: PostgresConnection, _ account: String, _ chunks: Set<String>, now: Int64) async throws {
    let hashes = chunks.sorted()
    var live = Set<String>()
    for batch in stride(from: 0, to: hashes.count, by: 1000) {
      let slice = Array(hashes[batch..<min(batch + 1000, hashes.count)])
      for try await h in try await conn.query(
        """
        UPDATE chunks SET last_used = \(now) WHERE account = \(account) AND NOT doomed AND hash = ANY(\(slice))
        RETURNING hash
        """, logger: log
      ).decode(String.self) {
        live.insert(h)
      }
    }
    let missing = chunks.subtracting(live)
    if !missing.isEmpty { throw CloudError.missingChunks(missing.sorted()) }
  }

  /// The ancestry of a write of `itemID` into `parentID` (`TreeSnapshot.ancestors`), from
  /// what the transaction remembers when it can.
  func ancestry(
    _ conn: PostgresConnection, _ account: String, _ container: String, of itemID: String, under parentID: String?,
    _ ancestries: inout AncestryCache
  ) async throws -> AncestryCache.Ancestry {
    guard let parentID else { return AncestryCache.Ancestry(chain: [], loops: false) }
    if let known = ancestries.ancestry(of: itemID, under: parentID) { return known }
    if let parent = try await record(conn, account, container, parentID), let extended = ancestries.extending(parent) {
      return ancestries.remember(extended, under: parentID, visited: [parentID], for: itemID)
    }
    // The records come in one query; the walk over them stops where it would over the table.
    let above = try await ancestryRecords(conn, account, container, from: parentID)
    return ancestries.walk(from: parentID, for: itemID) { above[$0] }
  }

  /// The records on the walk up from `itemID` (it included) by item id: the records of its
  /// parent, that one's parent and so on, at most `TreeSnapshot.maxDepth` steps, in one query.
  func ancestryRecords(_ conn: PostgresConnection, _ account: String, _ container: String, from itemID: String)
    async throws -> [String: CloudItem]
  {
    var found: [String: CloudItem] = [:]
    for try await record in try await conn.query(
      """
      WITH RECURSIVE up(item_id, parent_id, record, depth) AS (
        SELECT item_id, parent_id, record, 1 FROM items
        WHERE account = \(account) AND container = \(container) AND item_id = \(itemID)
        UNION ALL
        SELECT i.item_id, i.parent_id, i.record, u.depth + 1 FROM up u JOIN items i
          ON i.account = \(account) AND i.container = \(container) AND i.item_id = u.parent_id
        WHERE u.depth < \(TreeSnapshot.maxDepth))
      SELECT DISTINCT ON (item_id) record FROM up
      """, logger: log
    ).decode(String.self) {
      let item = try RecordJSON.decodeStored(Data(record.utf8))
      found[item.itemID] = item
    }
    return found
  }

  func record(_ conn: PostgresConnection, _ account: String, _ container: String, _ itemID: String) async throws
    -> CloudItem?
  {
    try await storedRecord(conn, account, container, itemID)?.item
  }

  func storedRecord(_ conn: PostgresConnection, _ account: String, _ container: String, _ itemID: String)
    async throws -> StoredRecord?
  {
    try await Self.first(
      try await conn.query(
        "SELECT record FROM items WHERE account = \(account) AND container = \(container) AND item_id = \(itemID)",
        logger: log), String.self
    ).map {
      StoredRecord(item: try RecordJSON.decodeStored(Data($0.utf8)), bytes: Int64($0.utf8.count))
    }
  }

  /// The written item's `TreeSnapshot`, inside the commit's transaction. `current`: the
  /// stored version it replaces.
  func treeSnapshot(
    _ conn: PostgresConnection, _ account: String, _ container: String, _ item: CloudItem, current: CloudItem?,
    ancestries: inout AncestryCache
  ) async throws -> TreeSnapshot {
    if item.deleted {
      let child = try await Self.first(
        try await conn.query(
          """
          SELECT record FROM items WHERE account = \(account) AND container = \(container)
          AND parent_id = \(item.itemID) AND NOT deleted LIMIT 1
          """, logger: log), String.self
      ).map { try RecordJSON.decodeStored(Data($0.utf8)) }
      return TreeSnapshot(ancestors: [], namesake: nil, liveChild: child)
    }
    let ancestry = try await self.ancestry(conn, account, container, of: item.itemID, under: item.parentID, &ancestries)
    var namesake: CloudItem? = nil
    if let parentID = item.parentID {
      namesake = try await Self.first(
        try await conn.query(
          """
          SELECT record FROM items WHERE account = \(account) AND container = \(container)
          AND parent_id = \(parentID) AND name = \(item.name) AND NOT deleted AND item_id <> \(item.itemID) LIMIT 1
          """, logger: log), String.self
      ).map { try RecordJSON.decodeStored(Data($0.utf8)) }
    }
    var tree = TreeSnapshot(ancestors: ancestry.chain, namesake: namesake)
    tree.ancestorsLoop = ancestry.loops
    // A folder that moves deeper: how deep its items go, not counting itself (a loop of
    // parents through it, which a repair breaks by moving it, ends there). A move that does
    // not deepen it leaves them where the limit already held them, and costs no walk of its
    // contents.
    if item.kind == .directory, let current, !current.deleted, current.parentID != item.parentID,
      try await ancestry.chain.count
        > self.ancestry(conn, account, container, of: item.itemID, under: current.parentID, &ancestries).chain.count
    {
      let atMost = max(TreeSnapshot.maxDepth - ancestry.chain.count + 1, 1)
      tree.heightBelow =
        try await Self.first(
          try await conn.query(
            """
            WITH RECURSIVE below(item_id, depth) AS (
              SELECT item_id, 1 FROM items WHERE account = \(account) AND container = \(container)
                AND parent_id = \(item.itemID) AND NOT deleted
              UNION ALL
              SELECT i.item_id, b.depth + 1 FROM below b JOIN items i
                ON i.account = \(account) AND i.container = \(container) AND i.parent_id = b.item_id AND NOT i.deleted
                AND i.item_id <> \(item.itemID)
              WHERE b.depth < \(atMost))
            SELECT COALESCE(MAX(depth), 0) FROM below
            """, logger: log), Int.self) ?? 0
    }
    return tree
  }

  /// Writes `item` with the container's next change sequence number as its etag; returns the
  /// record as stored.
  func store(_ conn: PostgresConnection, _ account: String, _ container: String, _ item: CloudItem) async throws
    -> StoredRecord
  {
    guard
      let seq = try await Self.first(
        try await conn.query(
          """
          UPDATE containers SET last_seq = last_seq + 1 WHERE account = \(account) AND container = \(container)
          RETURNING last_seq
          """, logger: log), Int64.self)
    else { throw CloudError.notFound("container \(container)") }
    var record = item
    record.changeSeq = seq
    record.etag = String(seq)
    let json = String(decoding: try Self.encoder.encode(record), as: UTF8.self)
    try await conn.query(
      """
      INSERT INTO items(account, container, item_id, change_seq, etag, deleted, record, parent_id, name)
      VALUES (\(account), \(container), \(record.itemID), \(seq), \(record.etag), \(record.deleted), \(json),
        \(record.parentID), \(record.name))
      ON CONFLICT (account, container, item_id) DO UPDATE SET change_seq = EXCLUDED.change_seq,
        etag = EXCLUDED.etag, deleted = EXCLUDED.deleted, record = EXCLUDED.record, parent_id = EXCLUDED.parent_id,
        name = EXCLUDED.name
      """, logger: log)
    return StoredRecord(item: record, bytes: Int64(json.utf8.count))
  }

  public func storedChanges(account: String, container: String, since: Int64, limit: Int, maxBytes: Int)
    async throws -> StoredChangePage
  {
    try await read { conn in
      _ = try await lastSeq(conn, account, container)
      var rows: [(seq: Int64, record: Data)] = []
      for try await (seq, record) in try await conn.query(
        """
        SELECT change_seq, record FROM items WHERE account = \(account) AND container = \(container)
        AND change_seq > \(since) ORDER BY change_seq LIMIT \(Int64(limit + 1))
        """, logger: log
      ).decode((Int64, String).self) {
        rows.append((seq, Data(record.utf8)))
      }
      return StoredChangePage.page(of: rows, since: since, limit: limit, maxBytes: maxBytes)
    }
  }

  public func lastChange(account: String, container: String) async throws -> Int64 {
    try await read { conn in try await lastSeq(conn, account, container) }
  }

  /// The container's last change sequence number; `notFound` when there is no such container.
  func lastSeq(_ conn: PostgresConnection, _ account: String, _ container: String) async throws -> Int64 {
    guard
      let seq = try await Self.first(
        try await conn.query(
          "SELECT last_seq FROM containers WHERE account = \(account) AND container = \(container)", logger: log),
        Int64.self)
    else { throw CloudError.notFound("container \(container)") }
    return seq
  }

  public func knownChunks(account: String, hashes: [String]) async throws -> Set<String> {
    if hashes.isEmpty { return [] }
    return try await read { conn in
      var found = Set<String>()
      for batch in stride(from: 0, to: hashes.count, by: 1000) {
        let slice = Array(hashes[batch..<min(batch + 1000, hashes.count)])
        for try await h in try await conn.query(
          "SELECT hash FROM chunks WHERE account = \(account) AND NOT doomed AND hash = ANY(\(slice))", logger: log
        ).decode(String.self) {
          found.insert(h)
        }
      }
      return found
    }
  }

  public func chunkSizes(account: String, hashes: [String]) async throws -> [String: Int64] {
    if hashes.isEmpty { return [:] }
    return try await read { conn in
      var found: [String: Int64] = [:]
      for batch in stride(from: 0, to: hashes.count, by: 1000) {
        let slice = Array(hashes[batch..<min(batch + 1000, hashes.count)])
        for try await (h, size) in try await conn.query(
          "SELECT hash, size FROM chunks WHERE account = \(account) AND NOT doomed AND hash = ANY(\(slice))",
          logger: log
        ).decode((String, Int64).self) {
          found[h] = size
        }
      }
      return found
    }
  }

  public func chunkSize(account: String, hash: String) async throws -> Int64? {
    try await read { conn in
      try await Self.first(
        try await conn.query(
          "SELECT size FROM chunks WHERE account = \(account) AND hash = \(hash) AND NOT doomed", logger: log),
        Int64.self)
    }
  }

  public func recordChunk(account: String, hash: String, size: Int64, now: Int64) async throws {
    try await transaction { conn in
      let usage = try await self.usageRow(conn, account, lock: true)
      if let doomed = try await Self.first(
        try await conn.query(
          "SELECT doomed FROM chunks WHERE account = \(account) AND hash = \(hash) FOR UPDATE", logger: log),
        Bool.self)
      {
        if doomed { throw CloudError.unavailable("chunk \(hash) is being garbage-collected; retry in a moment") }
        try await conn.query(
          "UPDATE chunks SET last_used = \(now) WHERE account = \(account) AND hash = \(hash)", logger: log)
        return
      }
      guard usage.admits(size) else { throw CloudError.quotaExceeded(usage) }
      try await conn.query(
        "INSERT INTO chunks(account, hash, size, last_used) VALUES (\(account), \(hash), \(size), \(now))",
        logger: log)
      try await conn.query(
        "UPDATE accounts SET used_bytes = used_bytes + \(size) WHERE name = \(account)", logger: log)
    }
  }

  public func touchChunks(account: String, hashes: [String], now: Int64) async throws {
    if hashes.isEmpty { return }
    try await transaction { conn in
      for batch in stride(from: 0, to: hashes.count, by: 1000) {
        let slice = Array(hashes[batch..<min(batch + 1000, hashes.count)])
        try await conn.query(
          """
          UPDATE chunks SET last_used = \(now) WHERE account = \(account) AND NOT doomed
          AND last_used < \(now - 60) AND hash = ANY(\(slice))
          """, logger: log)
      }
    }
  }

  public func isChunkDoomed(account: String, hash: String) async throws -> Bool {
    try await read { conn in
      try await Self.first(
        try await conn.query(
          "SELECT doomed FROM chunks WHERE account = \(account) AND hash = \(hash)", logger: log), Bool.self)
        == true
    }
  }

  public func doomUnreferencedChunks(account: String, unusedBefore: Int64) async throws -> [String] {
    try await transaction { conn in
      var stale: [String] = []
      for try await h in try await conn.query(
        "SELECT hash FROM chunks WHERE account = \(account) AND NOT doomed AND last_used < \(unusedBefore)",
        logger: log
      ).decode(String.self) {
        stale.append(h)
      }
      if !stale.isEmpty {
        // References are read after the stale chunks: a commit in between touched its chunks
        // (and the UPDATE below re-reads `last_used` of every row it would doom).
        var referenced = Set<String>()
        for try await json in try await conn.query(
          "SELECT record FROM items WHERE account = \(account)", logger: log
        ).decode(String.self) {
          referenced.formUnion(
            CloudEngine.referencedChunks(try RecordJSON.decodeStored(Data(json.utf8))))
        }
        let candidates = stale.filter { !referenced.contains($0) }
        for batch in stride(from: 0, to: candidates.count, by: 1000) {
          let slice = Array(candidates[batch..<min(batch + 1000, candidates.count)])
          try await conn.query(
            """
            UPDATE chunks SET doomed = TRUE WHERE account = \(account) AND NOT doomed
            AND last_used < \(unusedBefore) AND hash = ANY(\(slice))
            """, logger: log)
        }
      }
      var doomed: [String] = []
      for try await h in try await conn.query(
        "SELECT hash FROM chunks WHERE account = \(account) AND doomed ORDER BY hash", logger: log
      ).decode(String.self) {
        doomed.append(h)
      }
      return doomed
    }
  }

  public func forgetDoomedChunks(account: String, hashes: [String]) async throws -> Int64 {
    try await transaction { conn in
      var freed: Int64 = 0
      for batch in stride(from: 0, to: hashes.count, by: 1000) {
        let slice = Array(hashes[batch..<min(batch + 1000, hashes.count)])
        for try await size in try await conn.query(
          "DELETE FROM chunks WHERE account = \(account) AND doomed AND hash = ANY(\(slice)) RETURNING size",
          logger: log
        ).decode(Int64.self) {
          freed += size
        }
      }
      try await conn.query(
        "UPDATE accounts SET used_bytes = GREATEST(0, used_bytes - \(freed)) WHERE name = \(account)", logger: log)
      return freed
    }
  }

  /// The account's usage: chunk bytes plus metadata bytes, and its quota; `lock` holds the
  /// account's row until the transaction ends.
  func usageRow(_ conn: PostgresConnection, _ account: String, lock: Bool = false) async throws -> Usage {
    let rows =
      lock
      ? try await conn.query(
        "SELECT used_bytes, quota_bytes, metadata_bytes FROM accounts WHERE name = \(account) FOR UPDATE",
        logger: log)
      : try await conn.query(
        "SELECT used_bytes, quota_bytes, metadata_bytes FROM accounts WHERE name = \(account)", logger: log)
    for try await (chunks, quota, metadata) in rows.decode((Int64, Int64, Int64?).self) {
      let (used, overflow) = chunks.addingReportingOverflow(metadata ?? 0)
      return Usage(usedBytes: overflow ? .max : used, quotaBytes: quota, metadataBytes: metadata ?? 0)
    }
    throw CloudError.notFound("account \(account)")
  }

  public func usage(account: String) async throws -> Usage {
    try await read { conn in try await self.usageRow(conn, account) }
  }

  public func setQuota(account: String, bytes: Int64) async throws {
    try await transaction { conn in
      _ = try await self.usageRow(conn, account, lock: true)
      try await conn.query("UPDATE accounts SET quota_bytes = \(bytes) WHERE name = \(account)", logger: log)
    }
  }

  // MARK: AccountStore

  public func createAccount(_ account: String, quotaBytes: Int64) async throws {
    try await read { conn in
      let inserted = try await Self.first(
        try await conn.query(
          """
          INSERT INTO accounts(name, quota_bytes) VALUES (\(account), \(quotaBytes))
          ON CONFLICT (name) DO NOTHING RETURNING 1::INT4
          """, logger: log), Int32.self)
      if inserted == nil { throw CloudError.exists("account \(account)") }
    }
  }

  public func accountExists(_ account: String) async throws -> Bool {
    try await read { conn in
      try await Self.first(
        try await conn.query("SELECT 1::INT4 FROM accounts WHERE name = \(account)", logger: log), Int32.self) != nil
    }
  }

  public func accounts() async throws -> [String] {
    try await read { conn in
      var out: [String] = []
      for try await n in try await conn.query("SELECT name FROM accounts ORDER BY name", logger: log).decode(
        String.self)
      {
        out.append(n)
      }
      return out
    }
  }

  public func addToken(_ record: TokenRecord, tokenHash: String) async throws {
    try await transaction { conn in
      _ = try await self.usageRow(conn, record.account)
      try await conn.query(
        """
        INSERT INTO tokens(id, hash, account, device, created_at, revoked, scope, expires_at)
        VALUES (\(record.id), \(tokenHash), \(record.account), \(record.device), \(record.createdAt), FALSE,
          \(record.scope.rawValue), \(record.expiresAt))
        """, logger: log)
    }
  }

  func tokenRecords(_ rows: PostgresRowSequence) async throws -> [TokenRecord] {
    var out: [TokenRecord] = []
    for try await (id, account, device, created, revoked, scope, expires) in rows.decode(
      (String, String, String, Int64, Bool, String, Int64?).self)
    {
      out.append(
        TokenRecord(
          id: id, account: account, device: device, createdAt: created, revoked: revoked,
          scope: TokenScope(rawValue: scope) ?? .device, expiresAt: expires))
    }
    return out
  }

  public func token(hash tokenHash: String) async throws -> TokenRecord? {
    try await read { conn in
      try await self.tokenRecords(
        try await conn.query(
          """
          SELECT id, account, device, created_at, revoked, scope, expires_at FROM tokens
          WHERE hash = \(tokenHash) AND NOT revoked
          """, logger: log)
      ).first
    }
  }

  public func tokens(account: String) async throws -> [TokenRecord] {
    try await read { conn in
      try await self.tokenRecords(
        try await conn.query(
          """
          SELECT id, account, device, created_at, revoked, scope, expires_at FROM tokens WHERE account = \(account)
          ORDER BY created_at, id
          """, logger: log))
    }
  }

  public func revokeToken(account: String, id: String) async throws -> Bool {
    try await read { conn in
      try await Self.first(
        try await conn.query(
          """
          UPDATE tokens SET revoked = TRUE WHERE account = \(account) AND id = \(id) AND NOT revoked RETURNING 1::INT4
          """, logger: log), Int32.self) != nil
    }
  }

  public func rotateToken(account: String, id: String, oldHash: String, newHash: String) async throws -> Bool {
    try await read { conn in
      try await Self.first(
        try await conn.query(
          """
          UPDATE tokens SET hash = \(newHash)
          WHERE account = \(account) AND id = \(id) AND hash = \(oldHash) AND NOT revoked RETURNING 1::INT4
          """, logger: log), Int32.self) != nil
    }
  }

  public func revokeTokens(account: String, device: String?) async throws -> Int {
    try await read { conn in
      let rows =
        if let device {
          try await conn.query(
            """
            UPDATE tokens SET revoked = TRUE WHERE account = \(account) AND device = \(device) AND NOT revoked
            RETURNING 1::INT4
            """, logger: log)
        } else {
          try await conn.query(
            "UPDATE tokens SET revoked = TRUE WHERE account = \(account) AND NOT revoked RETURNING 1::INT4",
            logger: log)
        }
      var n = 0
      for try await _ in rows.decode(Int32.self) { n += 1 }
      return n
    }
  }

  // MARK: KeyValueStorage

  func kvRows(_ rows: PostgresRowSequence) async throws -> [KVEntry] {
    var out: [KVEntry] = []
    for try await (key, value, ts, device, seq) in rows.decode((String, String?, Int64, String, Int64).self) {
      let v = try value.map { try Self.decoder.decode(JSONValue.self, from: Data($0.utf8)) }
      out.append(KVEntry(key: key, value: v, timestamp: ts, device: device, seq: seq))
    }
    return out
  }

  func kvTotals(_ conn: PostgresConnection, _ account: String, _ container: String, except key: String?) async throws
    -> (Int64, Int)
  {
    let k = key ?? ""
    for try await (used, n) in try await conn.query(
      """
      SELECT COALESCE(SUM(cost), 0)::INT8, COUNT(*)::INT8 FROM kv WHERE account = \(account)
      AND container = \(container) AND value IS NOT NULL AND key <> \(k)
      """, logger: log
    ).decode((Int64, Int64).self) {
      return (used, Int(n))
    }
    return (0, 0)
  }

  public func kvEntries(account: String, container: String, since: Int64) async throws -> KVSnapshot {
    try await transaction { conn in
      guard
        let head = try await Self.first(
          try await conn.query(
            "SELECT kv_seq FROM containers WHERE account = \(account) AND container = \(container)", logger: log),
          Int64.self)
      else { throw CloudError.notFound("container \(container)") }
      let rows =
        since == 0
        ? try await conn.query(
          """
          SELECT key, value, timestamp, device, seq FROM kv WHERE account = \(account) AND container = \(container)
          AND value IS NOT NULL ORDER BY seq
          """, logger: log)
        : try await conn.query(
          """
          SELECT key, value, timestamp, device, seq FROM kv WHERE account = \(account) AND container = \(container)
          AND seq > \(since) ORDER BY seq
          """, logger: log)
      let entries = try await self.kvRows(rows)
      let (used, n) = try await self.kvTotals(conn, account, container, except: nil)
      return KVSnapshot(entries: entries, token: head, usedBytes: used, keyCount: n)
    }
  }

  public func kvWrite(account: String, container: String, write: KVWrite, limits: KVLimits) async throws
    -> KVWriteResult
  {
    let cost = try KVLimits.cost(key: write.key, value: write.value)
    let text = try write.value.map { String(decoding: try $0.jsonData(), as: UTF8.self) }
    return try await transaction { conn in
      // The container row lock serializes writers of one store, so the totals check holds.
      guard
        let kvSeq = try await Self.first(
          try await conn.query(
            "SELECT kv_seq FROM containers WHERE account = \(account) AND container = \(container) FOR UPDATE",
            logger: log), Int64.self)
      else { throw CloudError.notFound("container \(container)") }
      let current = try await self.kvRows(
        try await conn.query(
          """
          SELECT key, value, timestamp, device, seq FROM kv WHERE account = \(account) AND container = \(container)
          AND key = \(write.key)
          """, logger: log)
      ).first
      if let current, !current.isReplaced(byTimestamp: write.timestamp, device: write.device) {
        return KVWriteResult(applied: false, entry: current, token: kvSeq)
      }
      if write.value != nil {
        let (used, n) = try await self.kvTotals(conn, account, container, except: write.key)
        try KVQuota.check(otherBytes: used, otherKeys: n, cost: cost, limits: limits)
      }
      let seq = kvSeq + 1
      try await conn.query(
        "UPDATE containers SET kv_seq = \(seq) WHERE account = \(account) AND container = \(container)", logger: log)
      try await conn.query(
        """
        INSERT INTO kv(account, container, key, value, timestamp, device, seq, cost)
        VALUES (\(account), \(container), \(write.key), \(text), \(write.timestamp), \(write.device), \(seq), \(cost))
        ON CONFLICT (account, container, key) DO UPDATE SET value = EXCLUDED.value, timestamp = EXCLUDED.timestamp,
          device = EXCLUDED.device, seq = EXCLUDED.seq, cost = EXCLUDED.cost
        """, logger: log)
      return KVWriteResult(
        applied: true,
        entry: KVEntry(key: write.key, value: write.value, timestamp: write.timestamp, device: write.device, seq: seq),
        token: seq)
    }
  }
}
