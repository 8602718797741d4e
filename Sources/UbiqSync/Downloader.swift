import Foundation
import Logging
import UbiqCloud
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// Brings evicted ("dataless") content into the cache: fetches the chunks of the item's cloud
/// version, verifies each SHA-256, writes a temporary file and renames it into place.
/// Concurrent requests for one inode share a single download.
public final class Downloader: @unchecked Sendable {
  let index: IndexStore
  let cache: ContentCache
  let cloud: CloudService
  let log: Logger
  private let cond = NSCondition()
  private var inflight: [Int64: Int] = [:]
  private var failures: [Int64: String] = [:]

  public init(index: IndexStore, cache: ContentCache, cloud: CloudService, logger: Logger) {
    self.index = index
    self.cache = cache
    self.cloud = cloud
    self.log = logger
  }

  /// The last download error of an inode, if its last download failed.
  public func lastError(_ inode: Int64) -> String? { cond.withLock { failures[inode] } }
  public func isDownloading(_ inode: Int64) -> Bool { cond.withLock { inflight[inode] != nil } }

  /// Blocks until the content of `inode` is cached (for FUSE threads and the CLI path).
  public func ensureCached(_ inode: Int64) throws {
    cond.lock()
    while inflight[inode] != nil { cond.wait() }
    if let row = try? index.item(inode), row.content == .cached, cache.exists(inode) {
      cond.unlock()
      return
    }
    inflight[inode] = 1
    cond.unlock()
    var failure: Error?
    do { try download(inode) } catch { failure = error }
    cond.lock()
    inflight[inode] = nil
    if let failure { failures[inode] = "\(failure)" } else { failures[inode] = nil }
    cond.broadcast()
    cond.unlock()
    if let failure { throw failure }
  }

  func download(_ inode: Int64) throws {
    for _ in 0..<3 {
      guard let row = try index.item(inode), row.kind == .file else { throw UbiqError.notFound("inode \(inode)") }
      guard let etag = row.etag else { throw UbiqError.io("\(row.name) has no cloud version") }
      let tmp = cache.path(inode) + ".download"
      let fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
      guard fd >= 0 else { throw UbiqError.io("cannot create \(tmp)") }
      var offset: Int64 = 0
      do {
        for chunk in row.chunkList {
          let data = try runBlocking { [cloud] in try await cloud.getChunk(hash: chunk.hash, range: nil) }
          guard Chunker.sha256Hex(data) == chunk.hash else {
            throw UbiqError.io("downloaded chunk \(chunk.hash) does not match its hash")
          }
          try data.withUnsafeBytes { raw in
            var done = 0
            while done < raw.count {
              let n = pwrite(fd, raw.baseAddress! + done, raw.count - done, off_t(offset) + off_t(done))
              if n < 0 && errno == EINTR { continue }
              if n <= 0 { throw UbiqError.io("writing the cache: \(String(cString: strerror(errno)))") }
              done += n
            }
          }
          offset += Int64(data.count)
        }
        if ftruncate(fd, off_t(row.size)) != 0 { throw UbiqError.io("truncate cache") }
        close(fd)
      } catch {
        close(fd)
        unlink(tmp)
        throw error
      }
      guard rename(tmp, cache.path(inode)) == 0 else { throw UbiqError.io("cannot install downloaded content") }
      if try index.markCached(inode, etag: etag) {
        log.debug("downloaded \(row.name) (\(offset) bytes)")
        return
      }
      // A newer version arrived while downloading: fetch again.
    }
    throw UbiqError.busy("the item keeps changing remotely; try again")
  }
}

/// Applies the cloud's change feed to the index: at mount (before the kernel sees anything) and
/// then every `interval`. Items with local changes, or open for writing, are left alone.
public final class ChangePuller: @unchecked Sendable {
  let index: IndexStore
  let cloud: CloudService
  let container: ContainerID
  let coordinator: WriteCoordinator
  let uid: UInt32
  let gid: UInt32
  let log: Logger
  /// Called with what changed, to drop cache files and invalidate kernel caches.
  public var onApplied: ([RemoteApplyResult]) -> Void = { _ in }
  private var task: Task<Void, Never>?
  private let lock = NSLock()
  private var stopped = false

  public init(
    index: IndexStore, cloud: CloudService, container: ContainerID, coordinator: WriteCoordinator, uid: UInt32,
    gid: UInt32, logger: Logger
  ) {
    self.index = index
    self.cloud = cloud
    self.container = container
    self.coordinator = coordinator
    self.uid = uid
    self.gid = gid
    self.log = logger
  }

  /// Fetches and applies every change since the stored token. Returns the results.
  @discardableResult
  public func pullOnce() async throws -> [RemoteApplyResult] {
    var token = try index.changeToken()
    var all: [RemoteApplyResult] = []
    var deferred: [CloudItem] = []
    while true {
      let batch = try await cloud.changes(container, since: token, limit: 500)
      for item in batch.items {
        let r = try apply(item)
        if r.outcome == .deferred { deferred.append(item) } else { all.append(r) }
      }
      // Parents may come later in the feed than their children (moves): retry the deferred.
      var progress = true
      while progress && !deferred.isEmpty {
        progress = false
        var still: [CloudItem] = []
        for item in deferred {
          let r = try apply(item)
          if r.outcome == .deferred {
            still.append(item)
          } else {
            all.append(r)
            progress = true
          }
        }
        deferred = still
      }
      token = batch.token
      try index.setChangeToken(token)
      if !batch.hasMore { break }
    }
    if !deferred.isEmpty { log.warning("\(deferred.count) remote items have no known parent") }
    let effective = all.filter { $0.outcome != .unchanged && $0.outcome != .locallyModified }
    if !effective.isEmpty { onApplied(effective) }
    return effective
  }

  func apply(_ item: CloudItem) throws -> RemoteApplyResult {
    guard let inode = try index.item(itemID: item.itemID)?.id else {
      return try index.applyRemote(item, uid: uid, gid: gid)
    }
    return try coordinator.withInodeLock(inode) {
      if coordinator.isBusy(inode) { return RemoteApplyResult(outcome: .locallyModified, inode: inode) }
      return try index.applyRemote(item, uid: uid, gid: gid)
    }
  }

  /// Pulls, then waits on the cloud's push channel (long-poll of up to 25 s) for the next
  /// change; `retryNs` is the pause after a failure (cloud unreachable).
  public func start(retryNs: UInt64) {
    task = Task.detached { [self] in
      while !lock.withLock({ stopped }) {
        do {
          try await pullOnce()
          _ = try await cloud.waitForChanges(container, since: try index.changeToken(), timeoutMs: 25_000)
        } catch is CancellationError {
          return
        } catch {
          if Task.isCancelled { return }
          log.warning("pull failed: \(error)")
          try? await Task.sleep(nanoseconds: retryNs)
        }
      }
    }
  }

  public func stop() async {
    lock.withLock { stopped = true }
    task?.cancel()
    await task?.value
  }
}
