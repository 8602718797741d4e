import Foundation
import UbiqCore

/// Chunk bytes, addressed by (account, SHA-256). Folder on disk or an S3 bucket.
public protocol BlobStore: Sendable {
  func contains(account: String, hash: String) throws -> Bool
  func put(account: String, hash: String, data: Data) throws
  func get(account: String, hash: String, range: Range<Int64>?) throws -> Data
}

/// Item records, change sequences, chunk bookkeeping and quotas. SQLite or PostgreSQL.
/// Every method is one atomic transaction, so several server processes may share one store.
public protocol MetadataStore: Sendable {
  func ensureAccount(_ account: String) throws
  func ensureContainer(account: String, container: String, seed: [CloudItem]) throws
  func item(account: String, container: String, itemID: String) throws -> CloudItem?
  /// Stores `item` with a new change sequence number and etag if the current etag matches
  /// `ifMatch` (nil: the item must not exist or be a tombstone). Returns the stored record.
  func commit(account: String, container: String, item: CloudItem, ifMatch: String?) throws -> CloudItem
  func changes(account: String, container: String, since: Int64, limit: Int) throws -> ChangeBatch
  /// The newest change sequence number of a container (0 if none).
  func lastChange(account: String, container: String) throws -> Int64
  /// Which of `hashes` are recorded for the account.
  func knownChunks(account: String, hashes: [String]) throws -> Set<String>
  /// Records a stored chunk and charges it to the quota; throws `CloudError.quotaExceeded`
  /// (and records nothing) if it does not fit.
  func recordChunk(account: String, hash: String, size: Int64) throws
  func usage(account: String) throws -> Usage
  func setQuota(account: String, bytes: Int64) throws
}
