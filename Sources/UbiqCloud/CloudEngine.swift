import Foundation
import UbiqCore

/// The cloud's rules (etags and If-Match, chunk hash verification, quota, container seeding)
/// over a metadata store and a blob store, for one account. Used in-process as the embedded
/// default cloud and by `ubiqfs serve`.
public final class CloudEngine: CloudService, @unchecked Sendable {
  public let account: String
  let metadata: MetadataStore
  let blobs: BlobStore

  public init(account: String, metadata: MetadataStore, blobs: BlobStore) throws {
    self.account = account
    self.metadata = metadata
    self.blobs = blobs
    try metadata.ensureAccount(account)
  }

  /// The embedded default: SQLite metadata and a blob folder under `directory`.
  public static func embedded(directory: URL, account: String = "local") throws -> CloudEngine {
    try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
    let meta = try SQLiteMetadataStore(path: directory.appendingPathComponent("cloud.sqlite").path)
    let blobs = try FolderBlobStore(root: directory.appendingPathComponent("blobs"))
    return try CloudEngine(account: account, metadata: meta, blobs: blobs)
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
    try metadata.ensureContainer(account: account, container: container.rawValue, seed: seed)
  }

  public func missingChunks(_ hashes: [String]) async throws -> Set<String> {
    for h in hashes where !Chunker.isValidHash(h) { throw CloudError.invalid("bad chunk hash '\(h)'") }
    let known = try metadata.knownChunks(account: account, hashes: hashes)
    return Set(hashes).subtracting(known)
  }

  public func putChunk(hash: String, data: Data) async throws {
    guard Chunker.isValidHash(hash) else { throw CloudError.invalid("bad chunk hash '\(hash)'") }
    guard Chunker.sha256Hex(data) == hash else { throw CloudError.hashMismatch(hash) }
    if try metadata.knownChunks(account: account, hashes: [hash]).contains(hash) { return }
    let usage = try metadata.usage(account: account)
    if usage.quotaBytes > 0 && usage.usedBytes + Int64(data.count) > usage.quotaBytes {
      throw CloudError.quotaExceeded(usage)
    }
    try blobs.put(account: account, hash: hash, data: data)
    try metadata.recordChunk(account: account, hash: hash, size: Int64(data.count))
  }

  public func getChunk(hash: String, range: Range<Int64>?) async throws -> Data {
    guard Chunker.isValidHash(hash) else { throw CloudError.invalid("bad chunk hash '\(hash)'") }
    // Chunks are scoped per account: a hash this account never stored reads as not found,
    // even if another account holds the same bytes.
    guard try metadata.knownChunks(account: account, hashes: [hash]).contains(hash) else {
      throw CloudError.notFound("chunk \(hash)")
    }
    return try blobs.get(account: account, hash: hash, range: range)
  }

  public func putItem(_ container: ContainerID, _ item: CloudItem, ifMatch: String?) async throws -> CloudItem {
    try validate(item)
    if item.kind == .file {
      let known = try metadata.knownChunks(account: account, hashes: item.chunks.map(\.hash))
      let missing = item.chunks.map(\.hash).filter { !known.contains($0) }
      if !missing.isEmpty { throw CloudError.missingChunks(missing) }
      let total = item.chunks.reduce(Int64(0)) { $0 + $1.length }
      if total != item.size { throw CloudError.invalid("chunk lengths add up to \(total), size is \(item.size)") }
    }
    var record = item
    record.deleted = false
    return try metadata.commit(account: account, container: container.rawValue, item: record, ifMatch: ifMatch)
  }

  public func deleteItem(_ container: ContainerID, itemID: String, ifMatch: String?, deviceID: String) async throws
    -> CloudItem
  {
    guard itemID != WellKnownItem.root, itemID != WellKnownItem.documents else {
      throw CloudError.invalid("the container root and Documents cannot be deleted")
    }
    guard var current = try metadata.item(account: account, container: container.rawValue, itemID: itemID) else {
      throw CloudError.notFound("item \(itemID)")
    }
    if current.deleted { return current }
    current.deleted = true
    current.chunks = []
    current.xattrs = [:]
    current.deviceID = deviceID
    return try metadata.commit(account: account, container: container.rawValue, item: current, ifMatch: ifMatch)
  }

  public func item(_ container: ContainerID, itemID: String) async throws -> CloudItem? {
    try metadata.item(account: account, container: container.rawValue, itemID: itemID)
  }

  public func changes(_ container: ContainerID, since: Int64, limit: Int) async throws -> ChangeBatch {
    try metadata.changes(account: account, container: container.rawValue, since: since, limit: max(1, min(limit, 5000)))
  }

  public func usage() async throws -> Usage { try metadata.usage(account: account) }

  public func waitForChanges(_ container: ContainerID, since: Int64, timeoutMs: Int) async throws -> Bool {
    let deadline = Clock.monotonicNs() + UInt64(max(0, timeoutMs)) * 1_000_000
    while true {
      if try metadata.lastChange(account: account, container: container.rawValue) > since { return true }
      if Clock.monotonicNs() >= deadline { return false }
      try await Task.sleep(nanoseconds: 25_000_000)
    }
  }

  public func setQuota(bytes: Int64) throws { try metadata.setQuota(account: account, bytes: bytes) }

  private func validate(_ item: CloudItem) throws {
    guard !item.itemID.isEmpty, item.itemID.utf8.count <= 128 else { throw CloudError.invalid("bad item id") }
    if item.itemID == WellKnownItem.root {
      throw CloudError.invalid("the container root cannot be written")
    }
    do { try ItemName.validate(item.name) } catch let e as UbiqError { throw CloudError.invalid(e.description) }
    if item.parentID == nil { throw CloudError.invalid("item \(item.itemID) has no parent") }
    if item.kind == .symlink && (item.symlinkTarget ?? "").isEmpty {
      throw CloudError.invalid("symlink without target")
    }
    if item.size < 0 { throw CloudError.invalid("negative size") }
  }
}
