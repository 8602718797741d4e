import Foundation
import GRDB
import UbiqCloudAPI
import UbiqCore
import UbiqSQLite

/// Why the key-value store changed (the reasons of NSUbiquitousKeyValueStore's
/// didChangeExternallyNotification).
public enum KVChangeReason: String, Codable, Sendable {
  case serverChange = "server_change"
  case initialSync = "initial_sync"
  case quotaViolation = "quota_violation"
  case accountChange = "account_change"
}

/// One change notification, as `ubiqfs kv watch` prints it (one JSON line).
public struct KVNotification: Codable, Sendable, Equatable {
  public var reason: KVChangeReason
  public var keys: [String]
  public var container: String
  public var time: String
  /// A human-readable detail (the server's message for a quota violation).
  public var message: String?
  public init(reason: KVChangeReason, keys: [String], container: String, time: String, message: String? = nil) {
    self.reason = reason
    self.keys = keys
    self.container = container
    self.time = time
    self.message = message
  }
}

/// The local copy of one account + container key-value store: `kv.sqlite` in the container's
/// state folder. `entries` mirrors the server (tombstones included), `pending` holds local
/// writes the server has not acknowledged yet (the visible value is pending over entries),
/// `notifications` is a durable change log `kv watch` tails. Readable and writable offline.
/// Sendable: nothing mutable besides the database, whose pool serializes access.
public final class KVMirror: @unchecked Sendable {
  public let db: DatabaseQueue
  public let container: ContainerID
  public let limits: KVLimits

  /// Opens (creating) the mirror at `path`.
  public init(path: URL, container: ContainerID, limits: KVLimits = .standard) throws {
    try FileManager.default.createDirectory(at: path.deletingLastPathComponent(), withIntermediateDirectories: true)
    var config = Configuration()
    config.busyMode = .timeout(10)
    db = try DatabaseQueue(path: path.path, configuration: config)
    self.container = container
    self.limits = limits
    var m = DatabaseMigrator()
    m.registerMigration("v1") { db in
      try db.execute(
        sql: """
          CREATE TABLE meta(name TEXT PRIMARY KEY, value TEXT NOT NULL);
          CREATE TABLE entries(key TEXT PRIMARY KEY, value TEXT, timestamp INTEGER NOT NULL,
                               device TEXT NOT NULL, seq INTEGER NOT NULL);
          CREATE TABLE pending(key TEXT PRIMARY KEY, value TEXT, timestamp INTEGER NOT NULL);
          CREATE TABLE notifications(seq INTEGER PRIMARY KEY AUTOINCREMENT, json TEXT NOT NULL);
          """)
    }
    try m.migrateAmongProcesses(db)
  }

  // MARK: meta

  func meta(_ db: Database, _ name: String) throws -> String? {
    try String.fetchOne(db, sql: "SELECT value FROM meta WHERE name = ?", arguments: [name])
  }
  func setMeta(_ db: Database, _ name: String, _ value: String) throws {
    try db.execute(sql: "INSERT OR REPLACE INTO meta(name, value) VALUES (?, ?)", arguments: [name, value])
  }

  /// The change token of the last pull; nil before the first sync.
  public func token() throws -> Int64? { try db.read { try meta($0, "token").flatMap { Int64($0) } } }

  /// This mirror's writer id (created on first use; `suggested` when given).
  public func device(suggested: String? = nil) throws -> String {
    try db.write { db in
      if let d = try meta(db, "device") { return d }
      let d = suggested ?? "kv-" + UUID().uuidString.prefix(8).lowercased()
      try setMeta(db, "device", d)
      return d
    }
  }

  // MARK: values

  static func encode(_ v: JSONValue?) throws -> String? {
    try v.map { String(decoding: try $0.jsonData(), as: UTF8.self) }
  }
  static func decode(_ s: String?) -> JSONValue? {
    s.flatMap { try? JSONDecoder().decode(JSONValue.self, from: Data($0.utf8)) }
  }

  /// The visible store: acknowledged entries overlaid with pending local writes, removals hidden.
  public func all() throws -> [String: JSONValue] {
    try db.read { try Self.visible($0) }
  }

  static func visible(_ db: Database) throws -> [String: JSONValue] {
    var out: [String: JSONValue] = [:]
    for row in try Row.fetchAll(db, sql: "SELECT key, value FROM entries") {
      if let v = decode(row["value"]) { out[row["key"]] = v }
    }
    for row in try Row.fetchAll(db, sql: "SELECT key, value FROM pending") {
      out[row["key"]] = decode(row["value"])
    }
    return out
  }

  /// The visible value of `key`.
  public func get(_ key: String) throws -> JSONValue? { try db.read { try Self.visible($0, key) } }

  static func visible(_ db: Database, _ key: String) throws -> JSONValue? {
    if let row = try Row.fetchOne(db, sql: "SELECT value FROM pending WHERE key = ?", arguments: [key]) {
      return decode(row["value"])
    }
    return decode(try String.fetchOne(db, sql: "SELECT value FROM entries WHERE key = ?", arguments: [key]))
  }

  /// Queues a local write (nil removes) stamped `timestamp` (ns since the epoch), after checking
  /// the limits against the visible store; a write over a limit throws and changes nothing.
  public func write(_ key: String, _ value: JSONValue?, timestamp: Int64) throws {
    try write([(key, value)], timestamp: timestamp)
  }

  /// Queues several writes at once: all of them, or (over a limit) none.
  public func write(_ changes: [(String, JSONValue?)], timestamp: Int64) throws {
    for (key, _) in changes { try limits.validate(key: key) }
    try db.write { db in
      var store = try Self.visible(db)
      for (key, value) in changes { store[key] = value }
      try Self.check(store, limits)
      for (key, value) in changes {
        try db.execute(
          sql: "INSERT OR REPLACE INTO pending(key, value, timestamp) VALUES (?, ?, ?)",
          arguments: [key, try Self.encode(value), timestamp])
      }
    }
  }

  /// Throws `KeyValueError.quotaViolation` when `store` is over the key count or total size.
  public static func check(_ store: [String: JSONValue], _ limits: KVLimits) throws {
    if store.count > limits.maxKeys {
      throw KeyValueError.quotaViolation("\(store.count) keys (maximum \(limits.maxKeys))")
    }
    var total: Int64 = 0
    for (k, v) in store { total += try KVLimits.cost(key: k, value: v) }
    if total > limits.maxTotalBytes {
      throw KeyValueError.quotaViolation("\(total) bytes (maximum \(limits.maxTotalBytes))")
    }
  }

  /// Local writes not acknowledged yet, oldest first.
  public func pending() throws -> [(key: String, value: JSONValue?, timestamp: Int64)] {
    try db.read { db in
      try Row.fetchAll(db, sql: "SELECT key, value, timestamp FROM pending ORDER BY timestamp").map {
        (key: $0["key"], value: Self.decode($0["value"]), timestamp: $0["timestamp"])
      }
    }
  }

  /// Stores an entry from the server when it wins by the LWW rule (or is the same write);
  /// returns true if the stored entry changed.
  @discardableResult
  func apply(_ db: Database, _ e: KVEntry) throws -> Bool {
    if let row = try Row.fetchOne(db, sql: "SELECT timestamp, device FROM entries WHERE key = ?", arguments: [e.key]) {
      let cur = KVEntry(key: e.key, value: nil, timestamp: row["timestamp"], device: row["device"], seq: 0)
      guard cur.isReplaced(byTimestamp: e.timestamp, device: e.device) else { return false }
    }
    try db.execute(
      sql: "INSERT OR REPLACE INTO entries(key, value, timestamp, device, seq) VALUES (?, ?, ?, ?, ?)",
      arguments: [e.key, try Self.encode(e.value), e.timestamp, e.device, e.seq])
    return true
  }

  /// Records an acknowledged write: stores the server's entry and drops the pending write
  /// if it is still the one that was sent.
  public func acknowledge(_ key: String, sentTimestamp: Int64, entry: KVEntry) throws {
    try db.write { db in
      let before = try Self.visible(db, key)
      try apply(db, entry)
      try db.execute(sql: "DELETE FROM pending WHERE key = ? AND timestamp = ?", arguments: [key, sentTimestamp])
      // A newer write from another device won: that is a server change for this device.
      if try Self.visible(db, key) != before { try record(db, .serverChange, keys: [key]) }
    }
  }

  /// Drops a pending write the server rejected (the visible value falls back to the server's)
  /// and records a quota_violation notification.
  public func reject(_ key: String, sentTimestamp: Int64, message: String) throws {
    try db.write { db in
      try db.execute(sql: "DELETE FROM pending WHERE key = ? AND timestamp = ?", arguments: [key, sentTimestamp])
      try record(db, .quotaViolation, keys: [key], message: message)
    }
  }

  /// Applies a pulled snapshot with the LWW rule and records `initial_sync` (first pull) or
  /// `server_change` (visible values changed). Returns the changed keys.
  @discardableResult
  public func applyPull(_ snap: KVSnapshot) throws -> [String] {
    // Nothing new: no write, so a mount that pulls every second does not write (and sync) the
    // store's file every second.
    if snap.entries.isEmpty, try token() == snap.token { return [] }
    return try db.write { db in
      let initial = try meta(db, "token") == nil
      let before = try Self.visible(db)
      for e in snap.entries { try apply(db, e) }
      let after = try Self.visible(db)
      let changed = Set(before.keys).union(after.keys).filter { before[$0] != after[$0] }.sorted()
      try setMeta(db, "token", String(snap.token))
      if initial {
        try record(db, .initialSync, keys: after.keys.sorted())
      } else if !changed.isEmpty {
        try record(db, .serverChange, keys: changed)
      }
      return changed
    }
  }

  // MARK: notifications

  func record(_ db: Database, _ reason: KVChangeReason, keys: [String], message: String? = nil) throws {
    let n = KVNotification(
      reason: reason, keys: keys, container: container.rawValue,
      time: ISO8601DateFormatter().string(from: Date()), message: message)
    let enc = JSONEncoder()
    enc.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
    try db.execute(
      sql: "INSERT INTO notifications(json) VALUES (?)", arguments: [String(decoding: try enc.encode(n), as: UTF8.self)]
    )
  }

  /// Appends a notification to the log.
  public func record(_ reason: KVChangeReason, keys: [String], message: String? = nil) throws {
    try db.write { try record($0, reason, keys: keys, message: message) }
  }

  /// The newest notification's sequence number (0 when none).
  public func lastNotificationSeq() throws -> Int64 {
    try db.read { try Int64.fetchOne($0, sql: "SELECT MAX(seq) FROM notifications") ?? 0 }
  }

  /// Notifications after `seq`, oldest first, as (seq, JSON line).
  public func notifications(after seq: Int64) throws -> [(seq: Int64, json: String)] {
    try db.read { db in
      try Row.fetchAll(db, sql: "SELECT seq, json FROM notifications WHERE seq > ? ORDER BY seq", arguments: [seq])
        .map { (seq: $0["seq"], json: $0["json"]) }
    }
  }
}

/// Synchronises a `KVMirror` with the cloud: pushes pending writes (the server decides LWW),
/// then pulls changes since the mirror's token.
public struct KVSync: Sendable {
  public let mirror: KVMirror
  public let service: KeyValueService
  public let device: String
  public init(mirror: KVMirror, service: KeyValueService, device: String) {
    self.mirror = mirror
    self.service = service
    self.device = device
  }

  /// One round. Throws when the cloud is unreachable (pending writes stay queued).
  public func run() async throws {
    for p in try mirror.pending() {
      let w = KVWrite(key: p.key, value: p.value, timestamp: p.timestamp, device: device)
      do {
        let r = try await service.kvWrite(mirror.container, w)
        try mirror.acknowledge(p.key, sentTimestamp: p.timestamp, entry: r.entry)
      } catch let e as KeyValueError {
        try mirror.reject(p.key, sentTimestamp: p.timestamp, message: e.description)
      }
    }
    let snap = try await service.kvEntries(mirror.container, since: try mirror.token() ?? 0)
    try mirror.applyPull(snap)
  }
}
