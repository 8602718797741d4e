import Foundation
import UbiqCloudAPI
import UbiqCore

/// Chunk bytes, addressed by (account, SHA-256). Folder on disk or an S3 bucket.
public protocol BlobStore: Sendable {
  func contains(account: String, hash: String) async throws -> Bool
  func put(account: String, hash: String, data: Data) async throws
  func get(account: String, hash: String, range: Range<Int64>?) async throws -> Data
  /// Removes a chunk's bytes (nothing if they are gone already).
  func delete(account: String, hash: String) async throws
}

/// Item records, change sequences, chunk bookkeeping and quotas. SQLite or PostgreSQL.
/// Every method is one atomic transaction, so several server processes may share one store.
public protocol MetadataStore: Sendable {
  func ensureAccount(_ account: String) async throws
  /// Creates the container with `seed` if it does not exist; refuses a new one with
  /// `CloudError.limitExceeded` when the account has `maxContainers` already.
  func ensureContainer(account: String, container: String, seed: [CloudItem], maxContainers: Int) async throws
  /// The container identifiers of an account, sorted.
  func containers(account: String) async throws -> [String]
  func item(account: String, container: String, itemID: String) async throws -> CloudItem?
  /// The current records (tombstones included) of those of `itemIDs` that exist, by item id.
  func items(account: String, container: String, itemIDs: [String]) async throws -> [String: CloudItem]
  /// Stores `item` with a new change sequence number and etag if the current etag matches
  /// `ifMatch` (`CommitRule`: nil for a new item, or to delete a tombstone again; a live version
  /// over a tombstone needs the tombstone's etag). For a live `item`, `rule` is
  /// called with the item's `TreeSnapshot`, read in the same transaction, and its error aborts
  /// the write. Every hash in `chunks` (the chunks the record refers to) must be a live chunk of
  /// the account, else `CloudError.missingChunks`; the write marks them used, so a collection
  /// pass that began earlier leaves them. Returns the stored record.
  func commit(
    account: String, container: String, item: CloudItem, ifMatch: String?, chunks: Set<String>, rule: TreeRule?
  ) async throws -> CloudItem
  /// Stores `writes` in order in one transaction, each as `commit` would. The first write
  /// refused with a `CloudError` stops the batch: the writes before it are stored, it and the
  /// ones after it are not, and its error is returned. Any other error throws, storing nothing.
  func commitAll(account: String, container: String, writes: [ItemWrite]) async throws -> ItemBatchResults
  /// The records changed after `since`, in change order, as stored: at most `limit`, and past
  /// the first no more than `maxBytes` of stored record bytes (`StoredChangePage.page`).
  /// Throws `notFound` for a container that does not exist.
  func storedChanges(account: String, container: String, since: Int64, limit: Int, maxBytes: Int) async throws
    -> StoredChangePage
  /// The newest change sequence number of a container; `notFound` for one that does not exist.
  func lastChange(account: String, container: String) async throws -> Int64
  /// Which of `hashes` are live chunks of the account (recorded and not doomed).
  func knownChunks(account: String, hashes: [String]) async throws -> Set<String>
  /// Marks live chunks used at `now` (seconds since the epoch), where their last use is more
  /// than a minute older: a collection pass leaves chunks used within its grace period.
  func touchChunks(account: String, hashes: [String], now: Int64) async throws
  /// True if the chunk is doomed: a collection pass is deleting its bytes. It cannot be stored
  /// again until the pass has forgotten it.
  func isChunkDoomed(account: String, hash: String) async throws -> Bool
  /// The size of a chunk recorded for the account (nil if the account has no such chunk).
  func chunkSize(account: String, hash: String) async throws -> Int64?
  /// The recorded sizes of those of `hashes` the account holds.
  func chunkSizes(account: String, hashes: [String]) async throws -> [String: Int64]
  /// Records a stored chunk, used at `now`, and charges it to the quota; throws
  /// `CloudError.quotaExceeded` (and records nothing) if it does not fit, and
  /// `CloudError.unavailable` if the chunk is doomed.
  func recordChunk(account: String, hash: String, size: Int64, now: Int64) async throws
  /// The first step of a collection pass: in one transaction, dooms every live chunk of the
  /// account that no item record (of any container, conflict versions included) refers to and
  /// that was last used before `unusedBefore` (seconds since the epoch). Returns every doomed
  /// chunk of the account, those of an interrupted earlier pass included.
  func doomUnreferencedChunks(account: String, unusedBefore: Int64) async throws -> [String]
  /// The last step of a collection pass, once the doomed chunks' bytes are deleted: forgets
  /// those of `hashes` that are still doomed and takes their sizes off the account's usage.
  /// Returns the bytes freed.
  func forgetDoomedChunks(account: String, hashes: [String]) async throws -> Int64
  func usage(account: String) async throws -> Usage
  func setQuota(account: String, bytes: Int64) async throws
}

/// One page of a container's change feed with each record's JSON as the store holds it (the
/// `CloudItem` JSON that `RecordJSON` or `JSONEncoder` wrote, which `JSONDecoder` reads back):
/// the server sends it without decoding and encoding each record again.
public struct StoredChangePage: Sendable {
  public var records: [Data]
  /// Pass this as `since` to continue.
  public var token: Int64
  public var hasMore: Bool

  /// A page from stored rows in change order (`limit + 1` of them read, to know if more
  /// follow): up to `limit` records, cut before the record that takes the stored bytes past
  /// `maxBytes` (but never before the first, so a page always moves on).
  public static func page(of rows: [(seq: Int64, record: Data)], since: Int64, limit: Int, maxBytes: Int)
    -> StoredChangePage
  {
    var records: [Data] = []
    var token = since
    var bytes = 0
    for row in rows.prefix(limit) {
      bytes += row.record.count
      if bytes > maxBytes && !records.isEmpty { return StoredChangePage(records: records, token: token, hasMore: true) }
      records.append(row.record)
      token = row.seq
    }
    return StoredChangePage(records: records, token: token, hasMore: rows.count > limit)
  }

  /// The page with its records decoded.
  public func decoded() throws -> ChangeBatch {
    ChangeBatch(items: try records.map { try RecordJSON.decodeStored($0) }, token: token, hasMore: hasMore)
  }

  /// The page as the change feed's JSON answer, `{"items": [...], "token": N, "hasMore": bool}`,
  /// with the records as stored.
  public func json() -> Data {
    var out: [UInt8] = Array(#"{"items":"#.utf8)
    out.reserveCapacity(records.reduce(64) { $0 + $1.count + 1 })
    RecordJSON.writeArray(records, into: &out) { record, out in out.append(contentsOf: record) }
    out.append(contentsOf: #","token":\#(token),"hasMore":\#(hasMore)}"#.utf8)
    return Data(out)
  }
}

/// What item records cost against an account's quota, besides their chunks: every live record
/// costs `perItem` bytes (its index entries and change-feed row) plus the bytes of the record
/// as stored (name, symlink target, extended attributes, chunk list, conflict versions).
/// Tombstones cost nothing, so deleting always frees, and neither do a container's root and
/// Documents folders (`free`), so an empty container costs nothing. Both metadata stores keep
/// each account's sum up to date in the transaction of every write and refuse a write that
/// grows it past the quota.
public enum MetadataCost {
  public static let perItem: Int64 = 512
  /// The items every container has from its creation.
  public static let free: Set<String> = [WellKnownItem.root, WellKnownItem.documents]

  /// The cost of a live record stored in `bytes` bytes; nil (no live record) costs nothing.
  public static func of(storedBytes bytes: Int64?) -> Int64 {
    guard let bytes else { return 0 }
    return perItem + bytes
  }

  /// The stored bytes that count for `record`: nil (no cost) for no record, a tombstone, or an
  /// item every container has.
  public static func countedBytes(of record: StoredRecord?) -> Int64? {
    guard let record, !record.item.deleted, !free.contains(record.item.itemID) else { return nil }
    return record.bytes
  }

  /// What replacing the record `before` (nil: none) by `after` adds to the account's usage
  /// (negative: frees).
  public static func charge(before: StoredRecord?, after: StoredRecord?) -> Int64 {
    of(storedBytes: countedBytes(of: after)) - of(storedBytes: countedBytes(of: before))
  }
}

/// An item's record as a store holds it, with the length of its stored JSON (what the record
/// costs against the quota, `MetadataCost`).
public struct StoredRecord: Sendable {
  public var item: CloudItem
  public var bytes: Int64

  public init(item: CloudItem, bytes: Int64) {
    self.item = item
    self.bytes = bytes
  }
}

/// What one garbage-collection pass removed from an account.
public struct CollectedChunks: Codable, Sendable, Equatable {
  /// Chunks deleted and forgotten.
  public var chunks: Int
  /// Their bytes, taken off the account's usage.
  public var bytes: Int64
  /// Doomed chunks whose bytes could not be deleted: they stay doomed (not storable) until a
  /// later pass deletes them.
  public var undeleted: Int
  /// The first delete failure, when `undeleted` is not zero.
  public var failure: String?

  public init(chunks: Int, bytes: Int64, undeleted: Int = 0, failure: String? = nil) {
    self.chunks = chunks
    self.bytes = bytes
    self.undeleted = undeleted
    self.failure = failure
  }
}

/// The part of a container's tree a commit's rule needs, read inside the commit's
/// transaction: the new parent's ancestry and a live namesake.
public struct TreeSnapshot: Sendable {
  /// The new parent, its parent, and so on: up to the root, a missing record, a repeated id,
  /// or the written item itself (included and last, so a would-be cycle shows), at most
  /// `TreeSnapshot.maxDepth` records.
  public var ancestors: [CloudItem]
  /// The walk of `ancestors` stopped at an id it had met before: the ancestry is a loop.
  public var ancestorsLoop: Bool = false
  /// A live item, other than the written one, with the same parent and name.
  public var namesake: CloudItem?
  /// For a delete: a live item whose parent is the deleted one.
  public var liveChild: CloudItem?
  /// For a folder that moves: how many levels of live items it holds (1: items, none in
  /// folders), counted no further than the depth the move would leave room for plus one; 0
  /// otherwise.
  public var heightBelow: Int = 0
  /// Live items in the container before this write.
  public var liveItems: Int64
  /// Whether the write adds a live item (a new one, or one brought back from a tombstone).
  public var addsLiveItem: Bool
  public init(
    ancestors: [CloudItem], namesake: CloudItem?, liveChild: CloudItem? = nil, liveItems: Int64 = 0,
    addsLiveItem: Bool = false
  ) {
    self.ancestors = ancestors
    self.namesake = namesake
    self.liveChild = liveChild
    self.liveItems = liveItems
    self.addsLiveItem = addsLiveItem
  }
  /// The deepest ancestry an engine reads; deeper trees are refused as cycles.
  public static let maxDepth = 4096
}

/// The ancestries one commit transaction has read (`TreeSnapshot.ancestors`), by the folder
/// they start at. The items of a batch mostly share their folders: a folder thousands of
/// levels deep is walked once per transaction, not once per item, and a folder whose own
/// folder was walked costs one more record. An ancestry is forgotten when the transaction
/// writes an item on it, or the missing item it ended at.
public struct AncestryCache: Sendable {
  /// A walk from a folder: the records met, and whether it stopped at an id met before.
  public struct Ancestry: Sendable {
    public var chain: [CloudItem]
    public var loops: Bool

    public init(chain: [CloudItem], loops: Bool) {
      self.chain = chain
      self.loops = loops
    }
  }

  private var walks: [String: Ancestry] = [:]
  /// Every item id on a remembered ancestry, and the missing ids they ended at.
  private var involved: Set<String> = []

  public init() {}

  /// The ancestry of a write of `itemID` into `parentID`, if the walk from `parentID` is
  /// remembered: cut after `itemID` when the written item is on it (a move below itself).
  public func ancestry(of itemID: String, under parentID: String) -> Ancestry? {
    walks[parentID].map { cut($0, after: itemID) }
  }

  /// The walk from `parent`'s id, when the walk from its own folder is remembered and does
  /// not meet `parent` (a loop): `parent` and that walk, at most `TreeSnapshot.maxDepth`.
  public func extending(_ parent: CloudItem) -> Ancestry? {
    guard let up = parent.parentID, let above = walks[up], !involved.contains(parent.itemID) else { return nil }
    return Ancestry(chain: [parent] + above.chain.prefix(TreeSnapshot.maxDepth - 1), loops: above.loops)
  }

  /// Remembers `walk`, from `parentID` (every id it visited in `visited`, the missing one it
  /// ended at included), and returns the ancestry of a write of `itemID`.
  public mutating func remember(
    _ walk: Ancestry, under parentID: String, visited: some Sequence<String>, for itemID: String
  ) -> Ancestry {
    walks[parentID] = walk
    involved.formUnion(visited)
    involved.insert(parentID)
    return cut(walk, after: itemID)
  }

  /// Walks up from `parentID` over `record` (nil: no such record): to the root, a missing
  /// record, an id met before (a loop) or `TreeSnapshot.maxDepth` records; remembers the walk
  /// and returns the ancestry of a write of `itemID`.
  public mutating func walk(from parentID: String, for itemID: String, record: (String) throws -> CloudItem?)
    rethrows -> Ancestry
  {
    var chain: [CloudItem] = []
    var seen = Set<String>()
    var next: String? = parentID
    while let id = next, chain.count < TreeSnapshot.maxDepth, seen.insert(id).inserted, let parent = try record(id) {
      chain.append(parent)
      next = parent.parentID
    }
    // Stopped at an id met before (not at one that is missing): a loop.
    let loops = next.map { id in chain.count < TreeSnapshot.maxDepth && chain.contains { $0.itemID == id } } ?? false
    return remember(Ancestry(chain: chain, loops: loops), under: parentID, visited: seen, for: itemID)
  }

  /// The transaction stored a version of `itemID`: every ancestry that went through it, or
  /// ended where it was missing, is read again.
  public mutating func written(_ itemID: String) {
    guard involved.contains(itemID) else { return }
    walks = [:]
    involved = []
  }

  /// `walk` up to and including `itemID`, when it holds it.
  func cut(_ walk: Ancestry, after itemID: String) -> Ancestry {
    guard involved.contains(itemID), let i = walk.chain.firstIndex(where: { $0.itemID == itemID }) else {
      return walk
    }
    return Ancestry(chain: Array(walk.chain[...i]), loops: false)
  }
}

/// One write of `MetadataStore.commitAll`: the arguments of one `commit`.
public struct ItemWrite: Sendable {
  public var item: CloudItem
  public var ifMatch: String?
  public var chunks: Set<String>
  public var rule: TreeRule?
  public init(item: CloudItem, ifMatch: String?, chunks: Set<String>, rule: TreeRule?) {
    self.item = item
    self.ifMatch = ifMatch
    self.chunks = chunks
    self.rule = rule
  }
}

/// A check of a commit against the tree, run by the engine inside the commit's transaction.
public typealias TreeRule = @Sendable (TreeSnapshot) throws -> Void

/// Accounts and their devices' bearer tokens (stored as SHA-256 hashes, revocable).
/// Implemented by both metadata engines, next to `MetadataStore`.
public protocol AccountStore: Sendable {
  /// Creates an account; throws `CloudError.exists` if the name is taken.
  func createAccount(_ account: String, quotaBytes: Int64) async throws
  func accountExists(_ account: String) async throws -> Bool
  func accounts() async throws -> [String]
  /// Stores a new token (by its hash) for a device of an account.
  func addToken(_ record: TokenRecord, tokenHash: String) async throws
  /// The live (not revoked) token whose SHA-256 is `tokenHash` (expired ones too: the caller
  /// checks `expiresAt` against its clock).
  func token(hash tokenHash: String) async throws -> TokenRecord?
  func tokens(account: String) async throws -> [TokenRecord]
  /// Revokes one token of an account by id; false if there is no such live token.
  func revokeToken(account: String, id: String) async throws -> Bool
  /// Revokes every live token of an account (of one device if given); returns how many.
  func revokeTokens(account: String, device: String?) async throws -> Int
  /// Replaces the hash of a live token (found by id and its current hash) in one statement, so
  /// the old token stops working the moment the new one does; false if no such live token.
  func rotateToken(account: String, id: String, oldHash: String, newHash: String) async throws -> Bool
}

/// The per-account, per-container key-value store's storage. Limits are enforced inside
/// the write's transaction so concurrent writers on several servers cannot overrun them.
public protocol KeyValueStorage: Sendable {
  /// Entries changed after `since` (0: every live entry), and the newest change token.
  func kvEntries(account: String, container: String, since: Int64) async throws -> KVSnapshot
  /// Applies a set (value non-nil) or remove (value nil) if it wins by (timestamp, device);
  /// otherwise leaves the stored entry and reports it.
  func kvWrite(account: String, container: String, write: KVWrite, limits: KVLimits) async throws -> KVWriteResult
}

/// Everything a server needs from its metadata engine.
public typealias ServerMetadataStore = MetadataStore & AccountStore & KeyValueStorage
