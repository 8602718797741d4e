import Foundation

/// The kind of a synced item.
public enum ItemKind: Int, Codable, Sendable {
  case file = 1
  case directory = 2
  case symlink = 3
}

/// A validated ubiquity container identifier such as `iCloud.com.example.notes` or
/// `TEAMID.com.example.notes`.
public struct ContainerID: Hashable, Codable, Sendable, CustomStringConvertible {
  public let rawValue: String
  public static let defaultContainer = ContainerID(unchecked: "iCloud.default")

  public init(_ raw: String) throws {
    let allowed = CharacterSet(charactersIn: "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")
    guard !raw.isEmpty, raw.utf8.count <= 255, raw.unicodeScalars.allSatisfy({ allowed.contains($0) }),
      raw.contains("."), !raw.hasPrefix("."), !raw.hasSuffix("."), !raw.contains("..")
    else {
      throw UbiqError.invalidArgument(
        "container identifier '\(raw)' must look like iCloud.com.example.app (letters, digits, '.', '-', '_')")
    }
    rawValue = raw
  }

  init(unchecked: String) { rawValue = unchecked }
  public var description: String { rawValue }
}

/// Well-known cloud item identifiers every device agrees on.
public enum WellKnownItem {
  /// The container root (never shown by name).
  public static let root = "root"
  /// `Documents/`, the user-visible surface of a container.
  public static let documents = "documents"
}

/// Rules for a single path component, shared by the client and the server.
public enum ItemName {
  public static let maxBytes = 255

  /// Whether two names are the same name: byte for byte, as the filesystem, the index and the
  /// cloud compare them. Swift's `==` on strings takes canonically equivalent spellings (the
  /// NFC and NFD forms of "café") as equal; they are two names.
  public static func same(_ a: String, _ b: String) -> Bool { a.utf8.elementsEqual(b.utf8) }

  /// Throws a typed error for a name the filesystem or the cloud must refuse.
  public static func validate(_ name: String) throws {
    if name.isEmpty { throw UbiqError.invalidArgument("empty name") }
    if name.utf8.count > maxBytes { throw UbiqError.nameTooLong("\(name.utf8.count) bytes (maximum \(maxBytes))") }
    if name == "." || name == ".." { throw UbiqError.invalidArgument("'\(name)' is not a valid name") }
    if name.utf8.contains(0x2F) || name.utf8.contains(0) {
      throw UbiqError.invalidArgument("a name may not contain '/' or NUL")
    }
  }

  /// Items whose name ends in `.nosync` stay on this device.
  public static func isNoSync(_ name: String) -> Bool { name.hasSuffix(".nosync") }

  /// "name 2.ext", "name 3.ext", ... for de-duplicating names, within the 255-byte limit: a
  /// name too long for its number gives up whole characters at the end of its stem (of the
  /// name, when the extension alone leaves no room). Every device computes the same name.
  public static func numbered(_ name: String, _ n: Int) -> String {
    let number = " \(n)"
    var stem = Substring(name)
    var ext = Substring("")
    if let dot = name.lastIndex(of: "."), dot != name.startIndex,
      name[dot...].utf8.count + number.utf8.count < maxBytes
    {
      stem = name[..<dot]
      ext = name[dot...]
    }
    while !stem.isEmpty && stem.utf8.count + number.utf8.count + ext.utf8.count > maxBytes { stem.removeLast() }
    return "\(stem)\(number)\(ext)"
  }

  /// The temporary name an item takes in the cloud while the name it moves to is still held
  /// by an item that is moving away: "name (moving 1a2b3c4d)", within the 255-byte limit.
  public static func aside(_ name: String, itemID: String) -> String {
    let suffix = asideSuffix(itemID)
    var base = name
    while base.utf8.count + suffix.utf8.count > maxBytes { base.removeLast() }
    return base + suffix
  }

  /// Whether `name` is a temporary name item `itemID` took while moving (`aside`).
  public static func isAside(_ name: String, itemID: String) -> Bool {
    name.hasSuffix(asideSuffix(itemID))
  }

  /// The name item `itemID` moved under, if `name` is its temporary name (`aside`; cut to fit,
  /// if the name was long). Nil for any other name.
  public static func withoutAside(_ name: String, itemID: String) -> String? {
    let suffix = asideSuffix(itemID)
    guard name.hasSuffix(suffix), name.utf8.count > suffix.utf8.count else { return nil }
    return String(name.dropLast(suffix.count))
  }

  private static func asideSuffix(_ itemID: String) -> String { " (moving \(itemID.prefix(8)))" }
}

/// One content-defined chunk of a file version: its SHA-256 (lower-case hex) and length.
public struct ChunkRef: Codable, Hashable, Sendable {
  public var hash: String
  public var length: Int64
  public init(hash: String, length: Int64) {
    self.hash = hash
    self.length = length
  }
}

/// A version of a file kept after a conflict (NSFileVersion's unresolved conflict version):
/// the content that lost the tie-break, still readable until resolved.
public struct ConflictVersion: Codable, Equatable, Sendable {
  /// Identifies the version for `ubiqfs versions --cat` / `resolve --keep`.
  public var versionID: String
  public var deviceID: String
  public var mtimeNs: Int64
  public var size: Int64
  public var chunks: [ChunkRef]
  public init(versionID: String, deviceID: String, mtimeNs: Int64, size: Int64, chunks: [ChunkRef]) {
    self.versionID = versionID
    self.deviceID = deviceID
    self.mtimeNs = mtimeNs
    self.size = size
    self.chunks = chunks
  }
}

/// The cloud's record of one item (file, directory or symlink) in a container.
public struct CloudItem: Codable, Equatable, Sendable {
  public var itemID: String
  public var parentID: String?
  public var name: String
  public var kind: ItemKind
  public var mode: UInt32
  public var size: Int64
  public var mtimeNs: Int64
  public var symlinkTarget: String?
  /// The user's own `user.*` extended attributes (name without the `user.` prefix kept as is).
  public var xattrs: [String: Data]
  public var chunks: [ChunkRef]
  /// Server-assigned version tag; changes on every accepted write.
  public var etag: String
  public var deleted: Bool
  /// Position of this version in the container's change sequence.
  public var changeSeq: Int64
  /// The device that wrote this version.
  public var deviceID: String
  /// The device that wrote this version's content, when it is not `deviceID`: a merge that kept
  /// another device's content, or a delete that kept another device's conflict version.
  public var contentDeviceID: String?
  /// Unresolved conflict versions (files only); nil or empty when there are none.
  public var conflicts: [ConflictVersion]?
  /// The etag of the version this one differs from only by a name that the writing device's
  /// sync chose to settle a name collision ("name 2"): no user's change, so a delete based on
  /// that version still wins over this one. Nil for any other version; the cloud keeps it only
  /// on the version it was sent with, and only when it is the etag the write was based on.
  public var settledNameOf: String?

  /// The device whose content this version carries.
  public var contentAuthor: String { contentDeviceID ?? deviceID }

  /// Makes this a version written by `device` whose content `author` wrote.
  public mutating func setWriter(_ device: String, contentAuthor author: String) {
    deviceID = device
    contentDeviceID = author == device ? nil : author
  }

  public init(
    itemID: String, parentID: String?, name: String, kind: ItemKind, mode: UInt32, size: Int64,
    mtimeNs: Int64, symlinkTarget: String? = nil, xattrs: [String: Data] = [:], chunks: [ChunkRef] = [],
    etag: String = "", deleted: Bool = false, changeSeq: Int64 = 0, deviceID: String = ""
  ) {
    self.itemID = itemID
    self.parentID = parentID
    self.name = name
    self.kind = kind
    self.mode = mode
    self.size = size
    self.mtimeNs = mtimeNs
    self.symlinkTarget = symlinkTarget
    self.xattrs = xattrs
    self.chunks = chunks
    self.etag = etag
    self.deleted = deleted
    self.changeSeq = changeSeq
    self.deviceID = deviceID
  }

  /// The tie-break between two versions of one item that both changed the content: the newest
  /// mtime wins, then the greater device id. Every device computes the same answer.
  public static func wins(mtimeNs: Int64, deviceID: String, over other: (mtimeNs: Int64, deviceID: String)) -> Bool {
    if mtimeNs != other.mtimeNs { return mtimeNs > other.mtimeNs }
    return deviceID > other.deviceID
  }
}

/// The wall clock one device reads for what it records (mtimes, ctimes, when a queued upload
/// is due): the system's, or a simulated one that a test sets and advances.
public struct WallClock: Sendable {
  private let read: @Sendable () -> Int64
  public init(_ read: @escaping @Sendable () -> Int64) { self.read = read }
  /// Nanoseconds since the Unix epoch.
  public func nowNs() -> Int64 { read() }
  public static let system = WallClock { Clock.nowNs() }
}

/// Where new identifiers come from (a device's id, an item's id, a conflict version's id):
/// random UUIDs in the product; a sequence of the simulation's own in tests, so that one seed
/// replays one run.
public struct IdentifierSource: Sendable {
  private let make: @Sendable () -> String
  /// `make` returns a new lowercase UUID-shaped identifier at each call.
  public init(_ make: @escaping @Sendable () -> String) { self.make = make }
  /// A new identifier, lowercase and shaped as a UUID.
  public func next() -> String { make() }
  public static let random = IdentifierSource { UUID().uuidString.lowercased() }
}

/// Wall-clock helpers in nanoseconds since the Unix epoch (the unit the index stores).
public enum Clock {
  public static func nowNs() -> Int64 {
    var ts = timespec()
    clock_gettime(CLOCK_REALTIME, &ts)
    return Int64(ts.tv_sec) * 1_000_000_000 + Int64(ts.tv_nsec)
  }
  /// Whole seconds since the Unix epoch.
  public static func nowSeconds() -> Int64 {
    var ts = timespec()
    clock_gettime(CLOCK_REALTIME, &ts)
    return Int64(ts.tv_sec)
  }
  public static func monotonicNs() -> UInt64 {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return UInt64(ts.tv_sec) * 1_000_000_000 + UInt64(ts.tv_nsec)
  }
}
