import Foundation
import UbiqCloudAPI
import UbiqCore

/// What one account may hold and ask for, beyond its byte quota: each refused with
/// `CloudError.limitExceeded` (HTTP 507 `limit_exceeded`), except the page size, which only
/// splits change pages.
public struct CloudLimits: Sendable, Equatable {
  public var maxContainersPerAccount = 1000
  /// Live items (files, folders, symlinks) per container; tombstones do not count.
  public var maxItemsPerContainer: Int64 = 10_000_000
  /// JSON bytes of the records of one change page.
  public var maxChangePageBytes = 8 << 20
  public init() {}
}

/// The cloud's rules (etags and If-Match, chunk hash verification, quota, container seeding,
/// identifiers and numbers, tree invariants) over a metadata store and a blob store, for one
/// account. Used in-process as the embedded
/// default cloud and by `ubiqfs serve`.
/// Sendable: `kvLimits` and `limits` are set before use; the stores guard their own state.
public final class CloudEngine: CloudService, KeyValueService, @unchecked Sendable {
  public let account: String
  let metadata: MetadataStore
  let blobs: BlobStore
  public var kvLimits = KVLimits.standard
  public var limits = CloudLimits()

  /// An engine for an existing account (the server authenticates first; the embedded
  /// engine creates its account in `embedded`). Does no I/O.
  public init(account: String, metadata: MetadataStore, blobs: BlobStore) {
    self.account = account
    self.metadata = metadata
    self.blobs = blobs
  }

  /// The embedded default: SQLite metadata and a blob folder under `directory`.
  public static func embedded(directory: URL, account: String = "local") throws -> CloudEngine {
    try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
    let meta = try SQLiteMetadataStore(path: directory.appendingPathComponent("cloud.sqlite").path)
    let blobs = try FolderBlobStore(root: directory.appendingPathComponent("blobs"))
    try meta.ensureAccountSync(account)
    return CloudEngine(account: account, metadata: meta, blobs: blobs)
  }

  public func ensureContainer(_ container: ContainerID) async throws {
    let now = Clock.nowNs()
    let seed = [
      CloudItem(
        itemID: WellKnownItem.root, parentID: nil, name: "", kind: .directory, mode: 0o755, size: 0,
        mtimeNs: now, deviceID: "cloud"),
      CloudItem(
        itemID: WellKnownItem.documents, parentID: WellKnownItem.root, name: "Documents", kind: .directory,
        mode: 0o755, size: 0, mtimeNs: now, deviceID: "cloud"),
    ]
    try await metadata.ensureContainer(
      account: account, container: container.rawValue, seed: seed, maxContainers: limits.maxContainersPerAccount)
  }

  public func missingChunks(_ hashes: [String]) async throws -> Set<String> {
    for h in hashes where !Chunker.isValidHash(h) { throw CloudError.invalid("bad chunk hash '\(h)'") }
    let known = try await metadata.knownChunks(account: account, hashes: hashes)
    // The client commits soon after: known chunks stay out of collection passes meanwhile.
    try await metadata.touchChunks(account: account, hashes: Array(known), now: Clock.nowSeconds())
    return Set(hashes).subtracting(known)
  }

  public func putChunk(hash: String, data: Data) async throws {
    guard Chunker.isValidHash(hash) else { throw CloudError.invalid("bad chunk hash '\(hash)'") }
    guard Chunker.sha256Hex(data) == hash else { throw CloudError.hashMismatch(hash) }
    let now = Clock.nowSeconds()
    if try await metadata.knownChunks(account: account, hashes: [hash]).contains(hash) {
      try await metadata.touchChunks(account: account, hashes: [hash], now: now)
      return
    }
    // A doomed chunk's bytes are being deleted: written now, they could be deleted after.
    if try await metadata.isChunkDoomed(account: account, hash: hash) {
      throw CloudError.unavailable("chunk \(hash) is being garbage-collected; retry in a moment")
    }
    let usage = try await metadata.usage(account: account)
    let (after, overflow) = usage.usedBytes.addingReportingOverflow(Int64(data.count))
    if usage.quotaBytes > 0 && (overflow || after > usage.quotaBytes) {
      throw CloudError.quotaExceeded(usage)
    }
    try await blobs.put(account: account, hash: hash, data: data)
    try await metadata.recordChunk(account: account, hash: hash, size: Int64(data.count), now: now)
  }

  /// Deletes the account's chunks that no item refers to and that were not used for `grace`
  /// seconds (uploads in flight touch theirs: see `MetadataStore.touchChunks`). Dooms them,
  /// deletes their bytes, then forgets them; an interrupted pass is finished by the next one.
  public func collectGarbage(grace: Int64) async throws -> CollectedChunks {
    guard grace >= 0 else { throw CloudError.invalid("a grace period cannot be negative") }
    let (cutoff, overflow) = Clock.nowSeconds().subtractingReportingOverflow(grace)
    let doomed = try await metadata.doomUnreferencedChunks(account: account, unusedBefore: overflow ? 0 : cutoff)
    // A chunk whose bytes could not be deleted stays doomed for the next pass; the others are
    // forgotten now, so they can be stored again at once.
    var deleted: [String] = []
    var failure: String?
    for hash in doomed {
      do {
        try await blobs.delete(account: account, hash: hash)
        deleted.append(hash)
      } catch {
        failure = failure ?? "\(error)"
      }
    }
    let bytes = try await metadata.forgetDoomedChunks(account: account, hashes: deleted)
    return CollectedChunks(
      chunks: deleted.count, bytes: bytes, undeleted: doomed.count - deleted.count, failure: failure)
  }

  /// The size of one of this account's chunks; `notFound` for a hash it never stored.
  public func chunkSize(hash: String) async throws -> Int64 {
    guard Chunker.isValidHash(hash) else { throw CloudError.invalid("bad chunk hash '\(hash)'") }
    guard let size = try await metadata.chunkSize(account: account, hash: hash) else {
      throw CloudError.notFound("chunk \(hash)")
    }
    return size
  }

  public func getChunk(hash: String, range: Range<Int64>?) async throws -> Data {
    guard Chunker.isValidHash(hash) else { throw CloudError.invalid("bad chunk hash '\(hash)'") }
    // Chunks are scoped per account: a hash this account never stored reads as not found,
    // even if another account holds the same bytes.
    guard try await metadata.knownChunks(account: account, hashes: [hash]).contains(hash) else {
      throw CloudError.notFound("chunk \(hash)")
    }
    return try await blobs.get(account: account, hash: hash, range: range)
  }

  public func putItem(_ container: ContainerID, _ item: CloudItem, ifMatch: String?) async throws -> CloudItem {
    let write = try checkedWrite(item, ifMatch: ifMatch, stored: try await storedChunkSizes(of: [item]))
    return try await metadata.commit(
      account: account, container: container.rawValue, item: write.item, ifMatch: ifMatch, chunks: write.chunks,
      rule: write.rule)
  }

  public func putItems(_ container: ContainerID, _ puts: [ItemPut]) async throws -> ItemBatchResults {
    guard puts.count <= ItemPut.maxPerBatch else {
      throw CloudError.invalid("a batch holds at most \(ItemPut.maxPerBatch) item versions, not \(puts.count)")
    }
    let stored = try await storedChunkSizes(of: puts.map(\.item))
    // The versions up to the first invalid one go to the store, which may refuse one earlier.
    var writes: [ItemWrite] = []
    var invalid: CloudError?
    for put in puts {
      do {
        writes.append(try checkedWrite(put.item, ifMatch: put.ifMatch, stored: stored))
      } catch let error as CloudError {
        invalid = error
        break
      }
    }
    var results = try await metadata.commitAll(account: account, container: container.rawValue, writes: writes)
    if results.refused == nil { results.refused = invalid }
    return results
  }

  /// The stored sizes of the account's chunks that the file versions among `items` refer to.
  func storedChunkSizes(of items: [CloudItem]) async throws -> [String: Int64] {
    var hashes = Set<String>()
    for item in items where item.kind == .file { hashes.formUnion(Self.referencedChunks(item)) }
    if hashes.isEmpty { return [:] }
    return try await metadata.chunkSizes(account: account, hashes: Array(hashes))
  }

  /// A version checked as a write of this account (identifiers, name, numbers; a file's chunks
  /// all stored, `stored` giving their sizes, and adding up to its size), with its tree rule.
  func checkedWrite(_ item: CloudItem, ifMatch: String?, stored sizes: [String: Int64]) throws -> ItemWrite {
    try validate(item)
    // Conflict versions reference chunks too: all must belong to this account.
    let referenced = Self.referencedChunks(item)
    if item.kind == .file {
      let missing = referenced.filter { sizes[$0] == nil }
      if !missing.isEmpty { throw CloudError.missingChunks(missing.sorted()) }
      try Self.checkChunks(item.chunks, size: item.size, stored: sizes, of: "item \(item.itemID)")
      for v in item.conflicts ?? [] {
        try Self.checkChunks(v.chunks, size: v.size, stored: sizes, of: "conflict version \(v.versionID)")
      }
    }
    var record = item
    record.deleted = false
    // A settled name describes this write only: it is kept when it names the version the write
    // is based on, and never carried over from an earlier version.
    if ifMatch == nil || record.settledNameOf != ifMatch { record.settledNameOf = nil }
    return ItemWrite(
      item: record, ifMatch: ifMatch, chunks: referenced,
      rule: Self.treeRule(for: record, maxLiveItems: limits.maxItemsPerContainer))
  }

  /// A file version's chunk list: every length positive and equal to the stored chunk's size,
  /// the lengths adding up (without overflow) to `size`.
  static func checkChunks(_ chunks: [ChunkRef], size: Int64, stored: [String: Int64], of what: String) throws {
    var total: Int64 = 0
    for c in chunks {
      guard c.length > 0 else { throw CloudError.invalid("\(what): chunk length \(c.length) is not positive") }
      guard stored[c.hash] == c.length else {
        throw CloudError.invalid("\(what): chunk \(c.hash) has \(stored[c.hash] ?? 0) bytes, not \(c.length)")
      }
      let (sum, overflow) = total.addingReportingOverflow(c.length)
      guard !overflow else { throw CloudError.invalid("\(what): chunk lengths add up to more than \(Int64.max)") }
      total = sum
    }
    if total != size { throw CloudError.invalid("\(what): chunk lengths add up to \(total), size is \(size)") }
  }

  /// The tree invariants of a live item, checked by the metadata engine inside the commit:
  /// its parent exists, is a directory and is not deleted; the item is not its own ancestor;
  /// neither it nor, for a folder that moves, anything it holds is deeper than
  /// `TreeSnapshot.maxDepth`; no other live item of the parent has its name.
  static func treeRule(for item: CloudItem, maxLiveItems: Int64 = .max) -> TreeRule {
    { tree in
      if tree.addsLiveItem && tree.liveItems >= maxLiveItems {
        throw CloudError.limitExceeded("the container has \(tree.liveItems) items, the most it may hold")
      }
      guard let parentID = item.parentID else { return }
      if parentID == item.itemID || tree.ancestors.last?.itemID == item.itemID {
        throw CloudError.cycle("moving \(item.itemID) under \(parentID) would make it its own ancestor")
      }
      guard let parent = tree.ancestors.first, parent.itemID == parentID else {
        throw CloudError.badParent("parent \(parentID) of \(item.itemID) does not exist")
      }
      if parent.deleted { throw CloudError.badParent("parent \(parentID) of \(item.itemID) is deleted") }
      if parent.kind != .directory {
        throw CloudError.badParent("parent \(parentID) of \(item.itemID) is not a directory")
      }
      if let last = tree.ancestors.last, last.parentID != nil,
        tree.ancestors.count >= TreeSnapshot.maxDepth || tree.ancestorsLoop
      {
        throw CloudError.cycle("the ancestors of \(parentID) loop or are deeper than \(TreeSnapshot.maxDepth)")
      }
      if tree.ancestors.count + tree.heightBelow > TreeSnapshot.maxDepth {
        throw CloudError.cycle(
          "moving \(item.itemID) under \(parentID) would put its items deeper than \(TreeSnapshot.maxDepth) levels")
      }
      if let other = tree.namesake {
        throw CloudError.nameTaken("'\(item.name)' in \(parentID) is item \(other.itemID)")
      }
    }
  }

  public func deleteItem(_ container: ContainerID, itemID: String, ifMatch: String?, deviceID: String) async throws
    -> CloudItem
  {
    if let refusal = Self.deleteRefusal(itemID: itemID) { throw refusal }
    if let problem = DeviceIDRule.problem(deviceID) { throw CloudError.invalid(problem) }
    guard let current = try await metadata.item(account: account, container: container.rawValue, itemID: itemID) else {
      guard ifMatch == nil else { throw CloudError.notFound("item \(itemID)") }
      // An item this cloud has not seen, deleted without an etag: a device deletes an item
      // whose first upload may still be on its way. The tombstone is recorded, and such an
      // upload, which carries no etag, cannot pass it (`CommitRule`).
      let never = CloudItem(
        itemID: itemID, parentID: WellKnownItem.documents, name: itemID, kind: .file, mode: 0o600, size: 0,
        mtimeNs: Clock.nowNs(), deleted: true, deviceID: deviceID)
      return try await metadata.commit(
        account: account, container: container.rawValue, item: never, ifMatch: nil, chunks: [],
        rule: Self.deleteRule)
    }
    if current.deleted { return current }
    let gone = Self.tombstone(of: current, by: deviceID)
    return try await metadata.commit(
      account: account, container: container.rawValue, item: gone, ifMatch: ifMatch,
      chunks: Self.referencedChunks(gone), rule: Self.deleteRule)
  }

  public func deleteItems(_ container: ContainerID, _ deletes: [ItemDelete], deviceID: String) async throws
    -> ItemBatchResults
  {
    guard deletes.count <= ItemDelete.maxPerBatch else {
      throw CloudError.invalid("a batch holds at most \(ItemDelete.maxPerBatch) deletes, not \(deletes.count)")
    }
    if let problem = DeviceIDRule.problem(deviceID) { throw CloudError.invalid(problem) }
    // The deletes up to the first invalid one are carried out; the store may refuse one earlier.
    var valid = deletes[...]
    var invalid: CloudError?
    if let bad = deletes.firstIndex(where: { Self.deleteRefusal(itemID: $0.itemID) != nil }) {
      invalid = Self.deleteRefusal(itemID: deletes[bad].itemID)
      valid = deletes[..<bad]
    }
    let current = try await metadata.items(
      account: account, container: container.rawValue, itemIDs: valid.map(\.itemID))
    // An item already deleted keeps its tombstone and writes nothing, as does an item the
    // batch deletes a second time (it answers the tombstone the first delete writes); the
    // others become tombstones, written in order in one transaction. An unknown item ends the
    // batch.
    enum Step {
      case alreadyDeleted(CloudItem)
      case write(Int)
      case absent(String)
    }
    var steps: [Step] = []
    var writes: [ItemWrite] = []
    var writeOf: [String: Int] = [:]
    for delete in valid {
      if let earlier = writeOf[delete.itemID] {
        steps.append(.write(earlier))
        continue
      }
      guard let item = current[delete.itemID] else {
        steps.append(.absent(delete.itemID))
        break
      }
      if item.deleted {
        steps.append(.alreadyDeleted(item))
        continue
      }
      writeOf[delete.itemID] = writes.count
      steps.append(.write(writes.count))
      let gone = Self.tombstone(of: item, by: deviceID)
      writes.append(
        ItemWrite(item: gone, ifMatch: delete.ifMatch, chunks: Self.referencedChunks(gone), rule: Self.deleteRule))
    }
    // Nothing to write and records found (so the container exists): no transaction. An empty
    // commit checks that the container exists.
    let stored =
      writes.isEmpty && !current.isEmpty
      ? ItemBatchResults(committed: [], refused: nil)
      : try await metadata.commitAll(account: account, container: container.rawValue, writes: writes)
    var committed: [CloudItem] = []
    for step in steps {
      switch step {
      case .alreadyDeleted(let tombstone): committed.append(tombstone)
      case .absent(let itemID): return ItemBatchResults(committed: committed, refused: .notFound("item \(itemID)"))
      case .write(let w):
        guard w < stored.committed.count else { return ItemBatchResults(committed: committed, refused: stored.refused) }
        committed.append(stored.committed[w])
      }
    }
    return ItemBatchResults(committed: committed, refused: invalid)
  }

  /// Why an item cannot be deleted whatever its state (nil: it may be).
  static func deleteRefusal(itemID: String) -> CloudError? {
    if itemID == WellKnownItem.root || itemID == WellKnownItem.documents {
      return .invalid("the container root and Documents cannot be deleted")
    }
    guard Identifier.isValid(itemID) else { return .invalidID("item id \(Identifier.quoted(itemID))") }
    return nil
  }

  /// The tombstone that replaces `item` when `deviceID` deletes it: no content, no extended
  /// attributes and no settled name (its conflict versions are kept).
  static func tombstone(of item: CloudItem, by deviceID: String) -> CloudItem {
    var tombstone = item
    tombstone.deleted = true
    tombstone.chunks = []
    tombstone.xattrs = [:]
    tombstone.deviceID = deviceID
    tombstone.contentDeviceID = nil
    tombstone.settledNameOf = nil
    return tombstone
  }

  /// The chunks a record keeps alive: its content's and its conflict versions'.
  public static func referencedChunks(_ item: CloudItem) -> Set<String> {
    var hashes = Set(item.chunks.map(\.hash))
    for v in item.conflicts ?? [] { hashes.formUnion(v.chunks.map(\.hash)) }
    return hashes
  }

  /// A folder is deleted only without live items in it: an item another device added (or moved)
  /// there must not be left with a deleted parent.
  static let deleteRule: TreeRule = { tree in
    if let child = tree.liveChild {
      throw CloudError.notEmpty(
        "'\(child.name)' (item \(child.itemID)) is still in the folder", blockingItemID: child.itemID)
    }
  }

  public func item(_ container: ContainerID, itemID: String) async throws -> CloudItem? {
    guard Identifier.isValid(itemID) else { throw CloudError.invalidID("item id \(Identifier.quoted(itemID))") }
    return try await metadata.item(account: account, container: container.rawValue, itemID: itemID)
  }

  /// At most `limit` records (1 to 5000), and no more than `limits.maxChangePageBytes` of them
  /// in JSON (at least one record, however large): `hasMore` and `token` then say where the
  /// next page starts.
  public func changes(_ container: ContainerID, since: Int64, limit: Int) async throws -> ChangeBatch {
    try await storedChanges(container, since: since, limit: limit).decoded()
  }

  /// `changes` with the records as stored, for a server to send as they are.
  public func storedChanges(_ container: ContainerID, since: Int64, limit: Int) async throws -> StoredChangePage {
    try await metadata.storedChanges(
      account: account, container: container.rawValue, since: since, limit: max(1, min(limit, 5000)),
      maxBytes: limits.maxChangePageBytes)
  }

  /// The newest change sequence number of a container; `notFound` when there is no such
  /// container.
  public func lastChange(_ container: ContainerID) async throws -> Int64 {
    try await metadata.lastChange(account: account, container: container.rawValue)
  }

  public func usage() async throws -> Usage { try await metadata.usage(account: account) }

  public func waitForChanges(_ container: ContainerID, since: Int64, timeoutMs: Int) async throws -> Bool {
    let deadline = Clock.monotonicNs() + UInt64(max(0, timeoutMs)) * 1_000_000
    while true {
      if try await metadata.lastChange(account: account, container: container.rawValue) > since { return true }
      if Clock.monotonicNs() >= deadline { return false }
      try await Task.sleep(nanoseconds: 25_000_000)
    }
  }

  public func setQuota(bytes: Int64) async throws { try await metadata.setQuota(account: account, bytes: bytes) }

  /// The account's containers.
  public func containers() async throws -> [String] { try await metadata.containers(account: account) }

  // MARK: KeyValueService

  public func kvEntries(_ container: ContainerID, since: Int64) async throws -> KVSnapshot {
    try await kvStorage().kvEntries(account: account, container: container.rawValue, since: max(0, since))
  }

  public func kvWrite(_ container: ContainerID, _ write: KVWrite) async throws -> KVWriteResult {
    try kvLimits.validate(key: write.key)
    if let problem = DeviceIDRule.problem(write.device) { throw CloudError.invalid(problem) }
    if write.timestamp < 0 { throw CloudError.invalid("timestamp \(write.timestamp) is negative") }
    if let value = write.value {
      if value.depth > JSONValue.maxDepth {
        throw CloudError.invalid("the value nests deeper than \(JSONValue.maxDepth) levels")
      }
      let cost = try KVLimits.cost(key: write.key, value: value)
      if cost > kvLimits.maxTotalBytes {
        throw KeyValueError.quotaViolation("one entry of \(cost) bytes exceeds \(kvLimits.maxTotalBytes) bytes")
      }
    }
    return try await kvStorage().kvWrite(
      account: account, container: container.rawValue, write: write, limits: kvLimits)
  }

  func kvStorage() throws -> KeyValueStorage {
    guard let kv = metadata as? KeyValueStorage else {
      throw CloudError.invalid("this metadata engine has no key-value store")
    }
    return kv
  }

  /// The rules of the cloud's tree for one version (`CloudItem.brokenRule`); the root is not
  /// written.
  private func validate(_ item: CloudItem) throws {
    if item.itemID == WellKnownItem.root {
      throw CloudError.invalid("the container root cannot be written")
    }
    // Only a file has content. Checked on writes, not in `brokenRule`: a record already stored
    // with content on a folder still applies on every device.
    if item.kind != .file && (!item.chunks.isEmpty || !(item.conflicts ?? []).isEmpty) {
      throw CloudError.invalid("item \(item.itemID) is not a file: it has no chunks or conflict versions")
    }
    if item.kind == .directory && item.size != 0 {
      throw CloudError.invalid("folder \(item.itemID) has size \(item.size): a folder's size is 0")
    }
    for id in item.deviceIDs { if let problem = DeviceIDRule.problem(id) { throw CloudError.invalid(problem) } }
    switch item.brokenRule {
    case nil: return
    case .invalidID(let what): throw CloudError.invalidID(what)
    case .cycle(let why): throw CloudError.cycle(why)
    case .invalid(let why): throw CloudError.invalid(why)
    }
  }
}
