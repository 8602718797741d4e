import Foundation
import UbiqCore

/// One page of a container's change feed: the newest state of every item changed after the
/// token the caller passed, in change order.
public struct ChangeBatch: Codable, Sendable {
  public var items: [CloudItem]
  /// Pass this as `since` to continue.
  public var token: Int64
  public var hasMore: Bool
  /// Records of the page read from JSON that are no item version (`JSONReadable`): not part of
  /// the wire format.
  public var unreadable: [UnreadableRecord] = []

  enum CodingKeys: String, CodingKey { case items, token, hasMore }

  public init(items: [CloudItem], token: Int64, hasMore: Bool, unreadable: [UnreadableRecord] = []) {
    self.items = items
    self.token = token
    self.hasMore = hasMore
    self.unreadable = unreadable
  }
}

/// A record of a change page that is valid JSON but no item version (a field missing or of
/// the wrong type), which only a cloud that checks nothing could send: a device refuses it
/// alone, and the rest of the page applies.
public struct UnreadableRecord: Sendable, Equatable {
  /// The record's item id and change sequence, where they could be read.
  public var itemID: String?
  public var changeSeq: Int64?
  /// Why it could not be read.
  public var error: String

  /// What can be read of `raw`, a JSON value that `CloudItem.read` refused with `error`.
  init(_ raw: Data, error: Error) {
    self.error = "\(error)"
    var itemID: String?
    var changeSeq: Int64?
    _ = try? JSONReader.read(raw) { r in
      try r.object { r, key in
        switch key {
        case "itemID": itemID = try? r.string(field: key)
        case "changeSeq": changeSeq = try? r.integer(field: key)
        default: try r.skipValue()
        }
      }
    }
    self.itemID = itemID
    self.changeSeq = changeSeq
  }
}

/// Storage use of one account.
public struct Usage: Codable, Sendable, Equatable {
  /// What the quota is compared with: chunk bytes plus `metadataBytes`.
  public var usedBytes: Int64
  /// 0 means unlimited.
  public var quotaBytes: Int64
  /// The part of `usedBytes` that item records cost (`MetadataCost`); nil from a server that
  /// does not count it.
  public var metadataBytes: Int64?

  public init(usedBytes: Int64, quotaBytes: Int64, metadataBytes: Int64? = nil) {
    self.usedBytes = usedBytes
    self.quotaBytes = quotaBytes
    self.metadataBytes = metadataBytes
  }

  /// The bytes of stored chunks.
  public var chunkBytes: Int64 { usedBytes - (metadataBytes ?? 0) }

  /// True if `more` bytes fit within the quota (always for nothing more, or no quota).
  public func admits(_ more: Int64) -> Bool {
    guard more > 0, quotaBytes > 0 else { return true }
    let (total, overflow) = usedBytes.addingReportingOverflow(more)
    return !overflow && total <= quotaBytes
  }
}

/// What the client's sync engine needs from a cloud, for one signed-in account. Implemented
/// in-process by `CloudEngine` (the embedded default) and over HTTP by the `ubiqfs serve` client.
public protocol CloudService: Sendable {
  /// Creates the container (with its `Documents/` directory) if it does not exist yet.
  func ensureContainer(_ container: ContainerID) async throws
  /// The subset of `hashes` this account's chunk store does not hold.
  func missingChunks(_ hashes: [String]) async throws -> Set<String>
  /// Stores one chunk after verifying that `data` hashes to `hash`.
  func putChunk(hash: String, data: Data) async throws
  /// Reads a chunk (or a byte range of it).
  func getChunk(hash: String, range: Range<Int64>?) async throws -> Data
  /// Writes an item version. `ifMatch` is the etag the change is based on (nil for a new item).
  /// Throws `CloudError.conflict` with the server's record on a stale etag.
  func putItem(_ container: ContainerID, _ item: CloudItem, ifMatch: String?) async throws -> CloudItem
  /// Writes item versions in order, each as `putItem` would (If-Match its own etag), in one
  /// transaction: the first one refused stops the batch. The versions before it are stored, and
  /// take consecutive change sequence numbers; it and the ones after it are not. Throws (with
  /// nothing stored) only for a failure of the whole request. At most `ItemPut.maxPerBatch`.
  func putItems(_ container: ContainerID, _ puts: [ItemPut]) async throws -> ItemBatchResults
  /// Deletes an item (leaves a tombstone in the change feed).
  func deleteItem(_ container: ContainerID, itemID: String, ifMatch: String?, deviceID: String) async throws
    -> CloudItem
  /// Deletes items in order, each as `deleteItem` would with its If-Match, in one transaction:
  /// the first delete refused stops the batch. The deletes before it are done (their tombstones
  /// are `committed`; an item that was already deleted gives its existing tombstone); it and the
  /// ones after it are not. Throws (with nothing deleted) only for a failure of the whole
  /// request. At most `ItemDelete.maxPerBatch`.
  func deleteItems(_ container: ContainerID, _ deletes: [ItemDelete], deviceID: String) async throws
    -> ItemBatchResults
  /// The current record of one item, tombstones included.
  func item(_ container: ContainerID, itemID: String) async throws -> CloudItem?
  /// Changes after `since` (0 = from the beginning).
  func changes(_ container: ContainerID, since: Int64, limit: Int) async throws -> ChangeBatch
  func usage() async throws -> Usage
  /// Waits until the container's change feed moves past `since` (true) or `timeoutMs` passes
  /// (false). The push channel: over HTTP a long-poll, in-process a cheap local check.
  func waitForChanges(_ container: ContainerID, since: Int64, timeoutMs: Int) async throws -> Bool
}

/// One item version of a batch (`CloudService.putItems`).
public struct ItemPut: Codable, Sendable {
  public var item: CloudItem
  /// The etag the version is based on (nil for a new item).
  public var ifMatch: String?
  public init(item: CloudItem, ifMatch: String?) {
    self.item = item
    self.ifMatch = ifMatch
  }
  /// The most versions one batch may hold.
  public static let maxPerBatch = 1000

  /// The body of a batch request, `{"puts": [{"item", "ifMatch"}]}`, with the records written
  /// by `RecordJSON`.
  public static func batchJSON(_ puts: [ItemPut]) -> Data {
    RecordJSON.object(key: "puts", array: puts, bytesEach: 400) { put, out in
      out.append(contentsOf: #"{"item":"#.utf8)
      RecordJSON.write(put.item, into: &out)
      if let etag = put.ifMatch {
        out.append(contentsOf: #","ifMatch":"#.utf8)
        RecordJSON.writeString(etag, into: &out)
      }
      out.append(UInt8(ascii: "}"))
    }
  }
}

/// One delete of a batch (`CloudService.deleteItems`): always based on a known version.
public struct ItemDelete: Codable, Sendable, Equatable {
  public var itemID: String
  /// The etag of the version the delete is based on.
  public var ifMatch: String
  public init(itemID: String, ifMatch: String) {
    self.itemID = itemID
    self.ifMatch = ifMatch
  }
  /// The most deletes one batch may hold.
  public static let maxPerBatch = 1000

  /// The body of a batch request, `{"deletes": [{"itemID", "ifMatch"}]}`.
  public static func batchJSON(_ deletes: [ItemDelete]) -> Data {
    RecordJSON.object(key: "deletes", array: deletes, bytesEach: 80) { delete, out in
      out.append(contentsOf: #"{"itemID":"#.utf8)
      RecordJSON.writeString(delete.itemID, into: &out)
      out.append(contentsOf: #","ifMatch":"#.utf8)
      RecordJSON.writeString(delete.ifMatch, into: &out)
      out.append(UInt8(ascii: "}"))
    }
  }
}

/// What a batch of item versions or deletes did: the stored records (tombstones for deletes)
/// of the ones before the first one refused, in order, and why that one was refused (nil: every
/// one was stored).
public struct ItemBatchResults: Sendable {
  public var committed: [CloudItem]
  public var refused: CloudError?
  public init(committed: [CloudItem], refused: CloudError?) {
    self.committed = committed
    self.refused = refused
  }
}

extension CloudService {
  /// A cloud with no batch of its own commits one version after another.
  public func putItems(_ container: ContainerID, _ puts: [ItemPut]) async throws -> ItemBatchResults {
    try await putItemsOneByOne(container, puts)
  }

  /// One `putItem` after another: not one transaction, so a failure of a request after the
  /// first version leaves the ones before it stored, and is reported as the next one's refusal.
  public func putItemsOneByOne(_ container: ContainerID, _ puts: [ItemPut]) async throws -> ItemBatchResults {
    try await Self.oneByOne(puts) { put in try await putItem(container, put.item, ifMatch: put.ifMatch) }
  }

  /// A cloud with no batch of its own deletes one item after another.
  public func deleteItems(_ container: ContainerID, _ deletes: [ItemDelete], deviceID: String) async throws
    -> ItemBatchResults
  {
    try await deleteItemsOneByOne(container, deletes, deviceID: deviceID)
  }

  /// One `deleteItem` after another, reported as `putItemsOneByOne` reports its versions.
  public func deleteItemsOneByOne(_ container: ContainerID, _ deletes: [ItemDelete], deviceID: String) async throws
    -> ItemBatchResults
  {
    try await Self.oneByOne(deletes) { delete in
      try await deleteItem(container, itemID: delete.itemID, ifMatch: delete.ifMatch, deviceID: deviceID)
    }
  }

  /// Sends `requests` one after another until one is refused: a `CloudError` is that one's
  /// refusal; any other failure throws when nothing was stored yet, else is reported as the
  /// refusal of the next one.
  static func oneByOne<Request>(_ requests: [Request], _ send: (Request) async throws -> CloudItem) async throws
    -> ItemBatchResults
  {
    var committed: [CloudItem] = []
    for request in requests {
      do {
        committed.append(try await send(request))
      } catch let error as CloudError {
        return ItemBatchResults(committed: committed, refused: error)
      } catch {
        if committed.isEmpty { throw error }
        return ItemBatchResults(committed: committed, refused: .unavailable("\(error)"))
      }
    }
    return ItemBatchResults(committed: committed, refused: nil)
  }
}

/// Failures specific to the cloud protocol.
public enum CloudError: Error, CustomStringConvertible, Sendable {
  /// The write was based on a stale etag; `current` is the server's record.
  case conflict(current: CloudItem)
  case missingChunks([String])
  case hashMismatch(String)
  case quotaExceeded(Usage)
  case notFound(String)
  case invalid(String)
  case unavailable(String)
  /// An account (or another named thing) that must be new already exists.
  case exists(String)
  /// The bearer token is missing, unknown or revoked.
  case unauthorized(String)
  /// An identifier (item id, parent id, version id) that does not have the one format.
  case invalidID(String)
  /// The parent of a live item is missing, a tombstone, or not a directory.
  case badParent(String)
  /// The write would make an item its own ancestor.
  case cycle(String)
  /// Another live item of the same parent already has the name.
  case nameTaken(String)
  /// A folder that still has live items cannot be deleted; `blockingItemID` names one of them
  /// (nil from a cloud that does not say).
  case notEmpty(String, blockingItemID: String? = nil)
  /// A limit of the service (containers per account, items per container) would be exceeded.
  case limitExceeded(String)

  /// How `unauthorized` begins its description (what a failed upload records as its error).
  public static let notSignedIn = "not signed in"

  public var description: String {
    switch self {
    case .conflict(let c): return "conflict: server has etag \(c.etag) for \(c.itemID)"
    case .missingChunks(let h): return "missing chunks: \(h.prefix(3).joined(separator: ", "))"
    case .hashMismatch(let h): return "chunk data does not match hash \(h)"
    case .quotaExceeded(let u): return "quota exceeded: \(u.usedBytes) of \(u.quotaBytes) bytes used (EDQUOT)"
    case .notFound(let m): return "not found: \(m)"
    case .invalid(let m): return "invalid request: \(m)"
    case .unavailable(let m): return "cloud unavailable: \(m)"
    case .exists(let m): return "already exists: \(m)"
    case .unauthorized(let m): return "\(Self.notSignedIn): \(m)"
    case .invalidID(let m): return "invalid identifier: \(m)"
    case .badParent(let m): return "bad parent: \(m)"
    case .cycle(let m): return "cycle: \(m)"
    case .nameTaken(let m): return "name taken: \(m)"
    case .notEmpty(let m, _): return "not empty: \(m)"
    case .limitExceeded(let m): return "limit exceeded: \(m) (EDQUOT)"
    }
  }

  /// The errno an operation blocked by this error reports on the mount.
  public var errno: Int32 {
    switch self {
    case .quotaExceeded, .limitExceeded: return EDQUOT
    case .unavailable: return EHOSTUNREACH
    case .notFound: return ENOENT
    case .conflict: return EBUSY
    case .exists: return EEXIST
    case .unauthorized: return EACCES
    case .invalidID: return EINVAL
    case .badParent: return ENOENT
    case .cycle: return EINVAL
    case .nameTaken: return EEXIST
    case .notEmpty: return ENOTEMPTY
    default: return EIO
    }
  }
}

extension ChangeBatch: JSONReadable {
  public static func read(from reader: inout JSONReader) throws -> ChangeBatch {
    var items: [CloudItem]?
    var unreadable: [UnreadableRecord] = []
    var token: Int64?
    var hasMore: Bool?
    try reader.object { r, key in
      switch key {
      case "items":
        // Each record alone: one that is no item version does not make the page unreadable.
        var read: [CloudItem] = []
        try r.forEachElement { r in
          let raw = try r.rawValue()
          do {
            read.append(try JSONReader.read(raw) { try CloudItem.read(from: &$0) })
          } catch {
            unreadable.append(UnreadableRecord(raw, error: error))
          }
        }
        items = read
      case "token": token = try r.integer(field: key)
      case "hasMore": hasMore = try r.bool(field: key)
      default: try r.skipValue()
      }
    }
    guard let items else { throw JSONReader.Failure.missing(field: "items") }
    guard let token else { throw JSONReader.Failure.missing(field: "token") }
    guard let hasMore else { throw JSONReader.Failure.missing(field: "hasMore") }
    return ChangeBatch(items: items, token: token, hasMore: hasMore, unreadable: unreadable)
  }
}

extension ItemPut: JSONReadable {
  public static func read(from reader: inout JSONReader) throws -> ItemPut {
    var item: CloudItem?
    var ifMatch: String?
    try reader.object { r, key in
      switch key {
      case "item": item = try CloudItem.read(from: &r)
      case "ifMatch": ifMatch = try r.optionalString(field: key)
      default: try r.skipValue()
      }
    }
    guard let item else { throw JSONReader.Failure.missing(field: "item") }
    return ItemPut(item: item, ifMatch: ifMatch)
  }
}
