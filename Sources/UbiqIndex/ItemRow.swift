import Foundation
import GRDB
import UbiqCore

/// Whether an item's content is present in the local cache.
public enum ContentState: Int, Codable, Sendable {
  /// Metadata only; content must be downloaded before reading ("dataless").
  case dataless = 0
  /// The whole content is in the cache file.
  case cached = 1
}

/// One item of the local index. `id` is the inode number the mount reports, stable for the
/// item's lifetime on this device; `itemID` is its identity in the cloud.
public struct ItemRow: Codable, FetchableRecord, Equatable, Sendable {
  public var id: Int64?
  public var itemID: String
  public var parent: Int64?
  public var name: String
  public var kind: ItemKind
  public var mode: UInt32
  public var uid: UInt32
  public var gid: UInt32
  public var size: Int64
  public var mtimeNs: Int64
  public var ctimeNs: Int64
  public var atimeNs: Int64
  public var symlinkTarget: String?
  /// Etag of the cloud version this item is based on (nil: never uploaded).
  public var etag: String?
  /// Chunk manifest (JSON) of the cloud version `etag` names.
  public var chunks: String?
  public var content: ContentState
  /// Bumped by every local change that must reach the cloud.
  public var revision: Int64
  /// The revision the cloud last confirmed.
  public var syncedRevision: Int64
  public var pinned: Bool
  public var excluded: Bool
  public var lastUsedNs: Int64
  /// The cloud record (JSON) this item's local state is based on, for three-way merges.
  public var base: String?
  /// Unresolved conflict versions (JSON array of `ConflictVersion`).
  public var conflicts: String?

  public var inode: UInt64 { UInt64(id ?? 0) }
  public var isDirectory: Bool { kind == .directory }

  public init(
    id: Int64? = nil, itemID: String, parent: Int64?, name: String, kind: ItemKind, mode: UInt32, uid: UInt32 = 0,
    gid: UInt32 = 0, size: Int64 = 0, mtimeNs: Int64, symlinkTarget: String? = nil, etag: String? = nil,
    content: ContentState = .cached
  ) {
    self.id = id
    self.itemID = itemID
    self.parent = parent
    self.name = name
    self.kind = kind
    self.mode = mode
    self.uid = uid
    self.gid = gid
    self.size = size
    self.mtimeNs = mtimeNs
    self.ctimeNs = mtimeNs
    self.atimeNs = mtimeNs
    self.symlinkTarget = symlinkTarget
    self.etag = etag
    self.chunks = nil
    self.content = content
    self.revision = 0
    self.syncedRevision = 0
    self.pinned = false
    self.excluded = false
    self.lastUsedNs = mtimeNs
    self.base = nil
    self.conflicts = nil
  }

  public var baseItem: CloudItem? {
    guard let base, let d = base.data(using: .utf8) else { return nil }
    return try? RecordJSON.decodeStored(d)
  }

  public var conflictList: [ConflictVersion] {
    guard let conflicts, let d = conflicts.data(using: .utf8) else { return [] }
    return (try? JSONDecoder().decode([ConflictVersion].self, from: d)) ?? []
  }

  /// The conflict versions of two rows that become one (one file renamed over another, a
  /// commit adopted by the row that replaced its item), each version once: nil when none.
  static func combinedConflicts(_ a: [ConflictVersion], _ b: [ConflictVersion]) -> String? {
    var seen = Set<String>()
    let all = (a + b).filter { seen.insert($0.versionID).inserted }
    return all.isEmpty ? nil : json(all)
  }

  /// A cloud record (a row's base) as JSON (`RecordJSON`); no reader compares its text.
  static func json(_ item: CloudItem) -> String? {
    String(decoding: RecordJSON.encode(item), as: UTF8.self)
  }

  /// The JSON the index stores (chunk manifests, conflicts). Keys are sorted: the encoder on
  /// Linux orders them differently from one encoding to the next, and manifests are compared
  /// as text.
  static func json<T: Encodable>(_ v: T) -> String? {
    (try? jsonEncoder.encode(v)).flatMap { String(data: $0, encoding: .utf8) }
  }

  private static let jsonEncoder: JSONEncoder = {
    let e = JSONEncoder()
    e.outputFormatting = .sortedKeys
    return e
  }()

  public var chunkList: [ChunkRef] { Self.chunkList(chunks) }

  /// The chunks a manifest lists ([] for none or an unreadable one).
  public static func chunkList(_ manifest: String?) -> [ChunkRef] {
    guard let manifest, let data = manifest.data(using: .utf8) else { return [] }
    return (try? JSONDecoder().decode([ChunkRef].self, from: data)) ?? []
  }
}

/// A pending upload (or cloud delete) in the durable queue.
public struct QueueEntry: Codable, FetchableRecord, Sendable, Equatable {
  public var seq: Int64
  /// Inode to upload (nil for a delete).
  public var item: Int64?
  /// Cloud item to delete (nil for an upload).
  public var deleteItemID: String?
  public var deleteEtag: String?
  /// A delete without an etag whose item's upload was attempted: the cloud may have it.
  public var deleteMaybeInCloud: Bool
  /// A delete of a file that had unresolved conflict versions.
  public var deleteKeepsVersions: Bool
  /// A user's delete: where they saw the item (`ItemPlace` as JSON).
  public var deleteSeenPlace: String?
  /// A user's delete: where they saw the item.
  public var deletedPlace: ItemPlace? { deleteSeenPlace.flatMap(ItemPlace.init(json:)) }
  /// `unansweredPlaces` as a JSON array of `ItemPlace`.
  public var sentPlaces: String?
  /// The places and modes of the item in the commits of it sent since its last stored one
  /// (`IndexStore.noteSent`): a version of this device's own in the cloud at such a place or
  /// mode may be one of them, stored with its reply lost, so a local place or mode that
  /// differs from it is newer than that version. Empty once a commit of the item is stored.
  public var unansweredPlaces: [ItemPlace] {
    ItemPlace.list(json: sentPlaces)
  }
  public var enqueuedNs: Int64
  public var attempts: Int
  public var nextAttemptNs: Int64
  public var lastError: String?
  public var lastErrno: Int32?
}

/// A change refused because it would make files local-only whose bytes are only in the cloud
/// (dataless): their cloud items leave with the change, and the bytes with them. The caller
/// downloads `inodes` and tries again.
public struct ContentOnlyInTheCloud: Error, Sendable {
  public var inodes: [Int64]
}

/// Where an item was, as this device saw or sent it: its folder's item id, its name, its mode
/// and its extended attributes. A user's delete remembers it: a newer version of the item that
/// this device wrote, which the delete meets in the cloud, is the one the user deleted only if
/// it is still so (another device's rename, mode or attribute change, merged into it, wins over
/// the delete). A commit sent with no answer yet remembers it too
/// (`QueueEntry.unansweredPlaces`).
public struct ItemPlace: Codable, Sendable, Equatable {
  public var parentID: String
  public var name: String
  public var mode: UInt32
  /// `digest` of the item's extended attributes; nil when not known.
  public var xattrs: String?

  public init(parentID: String, name: String, mode: UInt32, xattrs: [String: Data]? = nil) {
    self.parentID = parentID
    self.name = name
    self.mode = mode
    self.xattrs = xattrs.map(Self.digest)
  }

  /// A digest of a set of extended attributes: equal for equal sets.
  public static func digest(_ xattrs: [String: Data]) -> String {
    var bytes = Data()
    for (name, value) in xattrs.sorted(by: { $0.key < $1.key }) {
      for part in [Data(name.utf8), value] {
        withUnsafeBytes(of: UInt64(part.count).littleEndian) { bytes.append(contentsOf: $0) }
        bytes.append(part)
      }
    }
    return Chunker.sha256Hex(bytes)
  }

  /// Whether `xattrs` are the attributes noted here (any, when none are).
  public func hasXattrs(_ xattrs: [String: Data]) -> Bool {
    self.xattrs.map { $0 == Self.digest(xattrs) } ?? true
  }

  init?(json: String) {
    guard let place = try? JSONDecoder().decode(Self.self, from: Data(json.utf8)) else { return nil }
    self = place
  }

  /// This place as the JSON `init?(json:)` reads, written without `JSONEncoder` (every
  /// removal of a file writes one).
  var json: String {
    var out: [UInt8] = []
    out.reserveCapacity(112 + name.utf8.count)
    out.append(contentsOf: "{\"mode\":\(mode),\"name\":".utf8)
    RecordJSON.writeString(name, into: &out)
    out.append(contentsOf: ",\"parentID\":".utf8)
    RecordJSON.writeString(parentID, into: &out)
    if let xattrs {
      out.append(contentsOf: ",\"xattrs\":".utf8)
      RecordJSON.writeString(xattrs, into: &out)
    }
    out.append(UInt8(ascii: "}"))
    return String(decoding: out, as: UTF8.self)
  }

  /// `places` as the JSON array `list(json:)` reads.
  static func json(_ places: [ItemPlace]) -> String {
    "[" + places.map(\.json).joined(separator: ",") + "]"
  }

  /// The places of a JSON array (`QueueEntry.sentPlaces`); none for nil or unreadable JSON.
  static func list(json: String?) -> [ItemPlace] {
    json.flatMap { try? JSONDecoder().decode([ItemPlace].self, from: Data($0.utf8)) } ?? []
  }

  /// Whether `version` is where (and as) the user saw the item. A temporary name the item took
  /// in the cloud while it moved (`ItemName.aside`) is no user's place: the user saw it at the
  /// name it moved to, so such a version is as they saw it if its mode is.
  public func matches(_ version: CloudItem) -> Bool {
    guard version.mode == mode, hasXattrs(version.xattrs) else { return false }
    return (version.parentID == parentID && version.name == name)
      || ItemName.isAside(version.name, itemID: version.itemID)
  }
}

/// Attribute changes requested through setattr.
public struct AttributeChanges: Sendable {
  public var mode: UInt32?
  public var uid: UInt32?
  public var gid: UInt32?
  public var size: Int64?
  public var atimeNs: Int64?
  public var mtimeNs: Int64?
  public init(
    mode: UInt32? = nil, uid: UInt32? = nil, gid: UInt32? = nil, size: Int64? = nil, atimeNs: Int64? = nil,
    mtimeNs: Int64? = nil
  ) {
    self.mode = mode
    self.uid = uid
    self.gid = gid
    self.size = size
    self.atimeNs = atimeNs
    self.mtimeNs = mtimeNs
  }
  /// True if the change may need uploading (permissions, size, mtime); atime and ownership stay
  /// local. A mode set to what it is uploads nothing (`IndexStore.setAttributes`).
  public var syncs: Bool { mode != nil || size != nil || mtimeNs != nil }
}

/// A summary of the upload queue for `ubiqfs status`.
public struct QueueSummary: Sendable, Codable {
  public var pendingItems: Int
  public var pendingDeletes: Int
  public var pendingBytes: Int64
  public var failing: [FailingUpload]
  /// Changes from the cloud held back because their folder is missing here (and in the cloud's
  /// feed so far): applied as soon as it arrives.
  public var waitingForParent: Int = 0
  /// Files here whose newer version from the cloud waits (the first 50): for their changes here
  /// to be uploaded (and merged with it), or, for a smaller version, for the processes reading
  /// them here to close them.
  public var waitingForFiles: [String] = []
  /// Changes from the cloud refused because they break a rule of the cloud's tree (the first 50).
  public var refusedRecords: [RefusedRecord] = []
}

/// A change from the cloud refused because it breaks a rule of the cloud's tree
/// (`CloudItem.brokenRule`): the item stays as it was here until a valid change of it comes.
public struct RefusedRecord: Sendable, Codable, Equatable {
  public var itemID: String
  public var name: String
  public var reason: String

  public init(itemID: String, name: String, reason: String) {
    self.itemID = itemID
    self.name = name
    self.reason = reason
  }
}

/// An upload that failed at least once and is waiting for its next attempt.
public struct FailingUpload: Sendable, Codable {
  public var path: String
  public var attempts: Int
  public var error: String
  public var errno: Int32
  public var nextAttemptNs: Int64
}

extension ItemRow {
  /// The columns of `items` in table order. Every query that reads rows as `ItemRow` selects
  /// `*` (or `i.*` first), so a row's first columns are these; `IndexStore` checks the table
  /// against this list when it opens the index.
  static let columnNames = [
    "id", "itemID", "parent", "name", "kind", "mode", "uid", "gid", "size", "mtimeNs", "ctimeNs", "atimeNs",
    "symlinkTarget", "etag", "chunks", "content", "revision", "syncedRevision", "pinned", "excluded",
    "lastUsedNs", "base", "conflicts",
  ]

  /// Decodes a row by column position. Written out because it runs for every lookup, getattr
  /// and readdir entry: the synthesized `Decodable` path cost more than the query itself, and
  /// a lookup by name lowercases and hashes every column's name. A row with fewer columns than
  /// `items` (a query that selects some) has its columns found by name.
  public init(row: Row) throws {
    let at: [Int]
    if row.count >= Self.columnNames.count {
      assert(zip(row.columnNames, Self.columnNames).allSatisfy { $0 == $1 }, "not a row of items: \(row)")
      at = Self.positions
    } else {
      let names = Array(row.columnNames)
      at = try Self.columnNames.map { name in
        guard let i = names.firstIndex(of: name) else { throw UbiqError.io("a row of items without \(name)") }
        return i
      }
    }
    id = row[at[0]]
    itemID = row[at[1]]
    parent = row[at[2]]
    name = row[at[3]]
    kind = ItemKind(rawValue: row[at[4]]) ?? .file
    mode = row[at[5]]
    uid = row[at[6]]
    gid = row[at[7]]
    size = row[at[8]]
    mtimeNs = row[at[9]]
    ctimeNs = row[at[10]]
    atimeNs = row[at[11]]
    symlinkTarget = row[at[12]]
    etag = row[at[13]]
    chunks = row[at[14]]
    content = ContentState(rawValue: row[at[15]]) ?? .dataless
    revision = row[at[16]]
    syncedRevision = row[at[17]]
    pinned = row[at[18]]
    excluded = row[at[19]]
    lastUsedNs = row[at[20]]
    base = row[at[21]]
    conflicts = row[at[22]]
  }

  /// The positions of a `SELECT *` row's columns.
  private static let positions = Array(columnNames.indices)

  /// Every column's value in `columnNames` order (the inverse of `init(row:)`), for
  /// `IndexStore.insertItem` and `updateItem`.
  var databaseValues: [DatabaseValue] {
    [
      id.databaseValue, itemID.databaseValue, parent.databaseValue, name.databaseValue,
      kind.rawValue.databaseValue, mode.databaseValue, uid.databaseValue, gid.databaseValue, size.databaseValue,
      mtimeNs.databaseValue, ctimeNs.databaseValue, atimeNs.databaseValue, symlinkTarget.databaseValue,
      etag.databaseValue, chunks.databaseValue, content.rawValue.databaseValue, revision.databaseValue,
      syncedRevision.databaseValue, pinned.databaseValue, excluded.databaseValue, lastUsedNs.databaseValue,
      base.databaseValue, conflicts.databaseValue,
    ]
  }
}
