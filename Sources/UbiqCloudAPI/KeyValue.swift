import Foundation
import UbiqCore

/// A property-list-like JSON value stored in the key-value store.
public enum JSONValue: Codable, Sendable, Equatable {
  case null
  case bool(Bool)
  case int(Int64)
  case double(Double)
  case string(String)
  case array([JSONValue])
  case object([String: JSONValue])

  public init(from decoder: Decoder) throws {
    let c = try decoder.singleValueContainer()
    if c.decodeNil() {
      self = .null
    } else if let b = try? c.decode(Bool.self) {
      self = .bool(b)
    } else if let i = try? c.decode(Int64.self) {
      self = .int(i)
    } else if let d = try? c.decode(Double.self) {
      self = .double(d)
    } else if let s = try? c.decode(String.self) {
      self = .string(s)
    } else if let a = try? c.decode([JSONValue].self) {
      self = .array(a)
    } else {
      self = .object(try c.decode([String: JSONValue].self))
    }
  }

  public func encode(to encoder: Encoder) throws {
    var c = encoder.singleValueContainer()
    switch self {
    case .null: try c.encodeNil()
    case .bool(let b): try c.encode(b)
    case .int(let i): try c.encode(i)
    case .double(let d): try c.encode(d)
    case .string(let s): try c.encode(s)
    case .array(let a): try c.encode(a)
    case .object(let o): try c.encode(o)
    }
  }

  /// The deepest a stored value nests (an array or object is one level): the answers that carry
  /// it wrap it in a few more levels, within the 512 a JSON reader takes.
  public static let maxDepth = 500

  /// How deep the value nests: 0 for a scalar, 1 for an array or object of scalars.
  public var depth: Int {
    var deepest = 0
    var stack: [(JSONValue, Int)] = [(self, 0)]
    while let (value, above) = stack.popLast() {
      switch value {
      case .array(let a):
        deepest = max(deepest, above + 1)
        stack += a.map { ($0, above + 1) }
      case .object(let o):
        deepest = max(deepest, above + 1)
        stack += o.values.map { ($0, above + 1) }
      default: break
      }
    }
    return deepest
  }

  /// The canonical JSON text of the value (sorted keys); its size counts against the limits.
  public func jsonData() throws -> Data {
    let e = JSONEncoder()
    e.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
    return try e.encode(self)
  }
}

/// One key of a container's key-value store, as stored (a removed key is a tombstone so an
/// older write cannot bring it back).
public struct KVEntry: Codable, Sendable, Equatable {
  public var key: String
  /// nil for a removed key.
  public var value: JSONValue?
  /// The writer's clock, nanoseconds since the Unix epoch; the newest write wins.
  public var timestamp: Int64
  public var device: String
  /// Position in the store's change sequence.
  public var seq: Int64
  public var deleted: Bool { value == nil }

  public init(key: String, value: JSONValue?, timestamp: Int64, device: String, seq: Int64) {
    self.key = key
    self.value = value
    self.timestamp = timestamp
    self.device = device
    self.seq = seq
  }

  /// True if a write stamped (timestamp, device) replaces this entry: the later timestamp
  /// wins, ties go to the greater device id, so every server decides the same way.
  public func isReplaced(byTimestamp t: Int64, device d: String) -> Bool {
    t > timestamp || (t == timestamp && d >= device)
  }

  enum CodingKeys: String, CodingKey { case key, value, timestamp, device, seq, deleted }
  public init(from decoder: Decoder) throws {
    let c = try decoder.container(keyedBy: CodingKeys.self)
    key = try c.decode(String.self, forKey: .key)
    timestamp = try c.decode(Int64.self, forKey: .timestamp)
    device = try c.decodeIfPresent(String.self, forKey: .device) ?? ""
    seq = try c.decodeIfPresent(Int64.self, forKey: .seq) ?? 0
    let deleted = try c.decodeIfPresent(Bool.self, forKey: .deleted) ?? false
    value = deleted ? nil : try c.decodeIfPresent(JSONValue.self, forKey: .value) ?? .null
  }
  public func encode(to encoder: Encoder) throws {
    var c = encoder.container(keyedBy: CodingKeys.self)
    try c.encode(key, forKey: .key)
    if let value { try c.encode(value, forKey: .value) }
    try c.encode(timestamp, forKey: .timestamp)
    try c.encode(device, forKey: .device)
    try c.encode(seq, forKey: .seq)
    try c.encode(deleted, forKey: .deleted)
  }
}

/// The key-value store of a container as of a change token.
public struct KVSnapshot: Codable, Sendable, Equatable {
  /// With `since` = 0 every live key; otherwise every key changed after `since`, removals included.
  public var entries: [KVEntry]
  /// Pass this as `since` to get only later changes.
  public var token: Int64
  public var usedBytes: Int64
  public var keyCount: Int
  public init(entries: [KVEntry], token: Int64, usedBytes: Int64, keyCount: Int) {
    self.entries = entries
    self.token = token
    self.usedBytes = usedBytes
    self.keyCount = keyCount
  }
}

/// One write to the key-value store (a remove when `value` is nil).
public struct KVWrite: Codable, Sendable, Equatable {
  public var key: String
  public var value: JSONValue?
  public var timestamp: Int64
  public var device: String
  public init(key: String, value: JSONValue?, timestamp: Int64, device: String) {
    self.key = key
    self.value = value
    self.timestamp = timestamp
    self.device = device
  }
}

/// What a write did: `applied` false means a newer write already won; `entry` is the stored one.
public struct KVWriteResult: Codable, Sendable, Equatable {
  public var applied: Bool
  public var entry: KVEntry
  public var token: Int64
  public init(applied: Bool, entry: KVEntry, token: Int64) {
    self.applied = applied
    self.entry = entry
    self.token = token
  }
}

/// The key-value store's limits (those of NSUbiquitousKeyValueStore).
public struct KVLimits: Sendable, Equatable {
  public var maxKeyBytes = 64
  public var maxKeys = 1024
  /// Keys plus JSON values of every live entry.
  public var maxTotalBytes: Int64 = 1024 * 1024
  public init() {}
  public static let standard = KVLimits()

  /// Bytes an entry counts against `maxTotalBytes`.
  public static func cost(key: String, value: JSONValue?) throws -> Int64 {
    guard let value else { return 0 }
    return Int64(key.utf8.count + (try value.jsonData().count))
  }

  /// Checks a key's own rules (the store checks the totals).
  public func validate(key: String) throws {
    if key.isEmpty { throw KeyValueError.invalidKey("empty key") }
    if key.utf8.count > maxKeyBytes {
      throw KeyValueError.invalidKey("key is \(key.utf8.count) bytes (maximum \(maxKeyBytes))")
    }
    if key.utf8.contains(0) { throw KeyValueError.invalidKey("a key may not contain NUL") }
  }
}

/// Failures of the key-value store.
public enum KeyValueError: Error, CustomStringConvertible, Sendable, Equatable {
  case invalidKey(String)
  /// The write would exceed the store's limits (NSUbiquitousKeyValueStoreQuotaViolationChange).
  case quotaViolation(String)

  public var description: String {
    switch self {
    case .invalidKey(let m): return "invalid key: \(m)"
    case .quotaViolation(let m): return "key-value store quota exceeded: \(m)"
    }
  }
}

/// The key-value store of one signed-in account, per container. Implemented in-process by
/// `CloudEngine` and over HTTP by `HTTPKeyValue`; `KVSync` (UbiqKV) is its client.
public protocol KeyValueService: Sendable {
  /// Entries changed after `since` (0: all live entries) and the newest change token.
  func kvEntries(_ container: ContainerID, since: Int64) async throws -> KVSnapshot
  /// Sets (value non-nil) or removes (nil) a key, stamped with the writer's clock.
  func kvWrite(_ container: ContainerID, _ write: KVWrite) async throws -> KVWriteResult
}
