import Foundation
import Logging
import UbiqCloud
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// One in-progress download of a file's content into its cache file. Chunks arrive out of order
/// (what readers wait for first, then sequential prefetch, several at a time); readers block
/// only until their own byte range is present. All readers of the inode share it.
public final class ContentStream: @unchecked Sendable {
  public let inode: Int64
  /// The chunk manifest being fetched: the download completes only if the item still has it.
  public let manifest: String?
  public let size: Int64
  let chunks: [ChunkRef]
  let offsets: [Int64]
  let fd: Int32
  private let cond = NSCondition()
  private var done: [Bool]
  private var inFlight: Set<Int> = []
  private var wanted: [Int] = []
  private var failure: UbiqError?
  private var isFinished = false
  /// Set when the file's content was replaced locally (truncate, O_TRUNC): no chunk of the old
  /// version may land in the cache file after that, and waiting readers read the file as it is.
  private var isSuperseded = false
  /// Held around every write into the cache file, so `supersede` returns only after the last
  /// write of an old chunk is done.
  private let writeLock = NSLock()
  public var finished: Bool { cond.withLock { isFinished } }
  private var doneCount = 0

  init(inode: Int64, manifest: String?, size: Int64, chunks: [ChunkRef], fd: Int32) {
    self.inode = inode
    self.manifest = manifest
    self.size = size
    self.chunks = chunks
    var offs: [Int64] = []
    var o: Int64 = 0
    for c in chunks {
      offs.append(o)
      o += c.length
    }
    offsets = offs
    self.fd = fd
    done = Array(repeating: false, count: chunks.count)
  }

  /// Fraction downloaded, 0...100.
  public var percent: Int {
    cond.withLock { chunks.isEmpty ? 100 : Int(Double(doneCount) * 100 / Double(chunks.count)) }
  }

  /// Chunk indexes overlapping [off, off+len).
  func chunkRange(_ off: Int64, _ len: Int) -> Range<Int> {
    guard !chunks.isEmpty, len > 0, off < size else { return 0..<0 }
    let end = min(size, off + Int64(len))
    var lo = 0
    var hi = offsets.count - 1
    while lo < hi {
      let mid = (lo + hi + 1) / 2
      if offsets[mid] <= off { lo = mid } else { hi = mid - 1 }
    }
    var last = lo
    while last + 1 < offsets.count && offsets[last + 1] < end { last += 1 }
    return lo..<(last + 1)
  }

  /// Blocks until [off, off+len) is present (or the download failed / `timeoutNs` passed). A
  /// range that reaches the end of the file also waits until the download is finished (made
  /// durable and recorded), so a reader that read the whole file then sees it downloaded.
  public func waitForRange(_ off: Int64, _ len: Int, timeoutNs: UInt64) throws {
    let range = chunkRange(off, len)
    cond.lock()
    defer { cond.unlock() }
    if range.contains(where: { !done[$0] }) {
      // Readers go first: put their chunks at the front of the queue.
      wanted.insert(contentsOf: range.filter { !done[$0] && !inFlight.contains($0) }, at: 0)
      cond.broadcast()
    }
    let deadline = Date(timeIntervalSinceNow: Double(timeoutNs) / 1e9)
    while range.contains(where: { !done[$0] }) {
      if isSuperseded { return }
      if let failure { throw failure }
      if !cond.wait(until: deadline) {
        throw UbiqError.unavailable("timed out waiting for content from the cloud")
      }
    }
    if off + Int64(len) >= size {
      // Every byte is here: past the deadline the read goes on without the record.
      while !isFinished && !isSuperseded && failure == nil && cond.wait(until: deadline) {}
    }
  }

  /// Blocks until the whole file is present.
  public func waitForAll(timeoutNs: UInt64) throws { try waitForRange(0, Int(clamping: size), timeoutNs: timeoutNs) }

  /// The next chunk to fetch: one a reader waits for, else the next in file order.
  func nextChunk() -> Int? {
    cond.lock()
    defer { cond.unlock() }
    if isSuperseded { return nil }
    while let w = wanted.first {
      wanted.removeFirst()
      if !done[w] && !inFlight.contains(w) {
        inFlight.insert(w)
        return w
      }
    }
    if let i = done.indices.first(where: { !done[$0] && !inFlight.contains($0) }) {
      inFlight.insert(i)
      return i
    }
    return nil
  }

  func complete(_ i: Int) {
    cond.withLock {
      inFlight.remove(i)
      if !done[i] {
        done[i] = true
        doneCount += 1
      }
      cond.broadcast()
    }
  }

  func fail(_ e: UbiqError) {
    cond.withLock {
      if failure == nil { failure = e }
      cond.broadcast()
    }
  }

  /// Stops the download for good because the local content replaced the version it fetches.
  /// Returns once no old chunk can be written into the cache file any more.
  func supersede() {
    writeLock.withLock {
      cond.withLock {
        isSuperseded = true
        cond.broadcast()
      }
    }
  }

  public var superseded: Bool { cond.withLock { isSuperseded } }

  /// Writes fetched bytes at `offset` of the cache file unless the download was superseded.
  /// Returns false if it was (nothing written).
  func writeChunk(_ data: Data, at offset: Int64) throws -> Bool {
    try writeLock.withLock {
      if superseded { return false }
      try data.withUnsafeBytes { raw in
        var done = 0
        while done < raw.count {
          let n = pwrite(fd, raw.baseAddress! + done, raw.count - done, off_t(offset) + off_t(done))
          if n < 0 && errno == EINTR { continue }
          if n <= 0 { throw UbiqError.io("writing the cache: \(String(cString: strerror(errno)))") }
          done += n
        }
      }
      return true
    }
  }

  func markFinished() {
    cond.withLock {
      isFinished = true
      cond.broadcast()
    }
  }
  public var failed: UbiqError? { cond.withLock { failure } }
}

/// Brings evicted ("dataless") content into the cache by streaming it from the cloud: fetches
/// chunks in parallel, verifies each SHA-256, writes them into the cache file in place and
/// marks the file cached once all arrived (so a crash mid-download just downloads again).
/// Concurrent readers of one inode share one `ContentStream`.
public final class Downloader: @unchecked Sendable {
  let index: IndexStore
  let cache: ContentCache
  let cloud: CloudService
  let log: Logger
  /// Concurrent chunk fetches per file.
  public var parallelism = 4
  /// How long a reader waits without progress before failing (cloud unreachable).
  public var stallTimeoutNs: UInt64 = 15_000_000_000
  /// Optional bandwidth cap for downloads.
  public var limiter: RateLimiter?
  /// Called when a file's content became fully cached (its st_blocks changed).
  public var onCached: (Int64) -> Void = { _ in }
  private let lock = NSLock()
  private var streams: [Int64: ContentStream] = [:]
  private var failures: [Int64: String] = [:]

  public init(index: IndexStore, cache: ContentCache, cloud: CloudService, logger: Logger) {
    self.index = index
    self.cache = cache
    self.cloud = cloud
    self.log = logger
  }

  /// The last download error of an inode, if its last download failed.
  public func lastError(_ inode: Int64) -> String? { lock.withLock { failures[inode] } }
  public func isDownloading(_ inode: Int64) -> Bool { lock.withLock { streams[inode] != nil } }
  public func percent(_ inode: Int64) -> Int? { lock.withLock { streams[inode] }?.percent }

  /// The running download of `inode`, started if needed; nil if the content is already cached.
  public func stream(_ inode: Int64) throws -> ContentStream? {
    try lock.withLock {
      guard let row = try index.item(inode), row.kind == .file else { throw UbiqError.notFound("inode \(inode)") }
      if row.content == .cached { return nil }
      // A download of an older version (changed remotely meanwhile) finishes on its own.
      if let s = streams[inode], s.manifest == row.chunks { return s }
      let fd = Glibc.open(cache.path(inode), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
      guard fd >= 0 else { throw UbiqError.io("cannot create the cache file of \(row.name)") }
      _ = ftruncate(fd, off_t(row.size))
      let s = ContentStream(inode: inode, manifest: row.chunks, size: row.size, chunks: row.chunkList, fd: fd)
      streams[inode] = s
      failures[inode] = nil
      Task.detached { [self] in await self.run(s, name: row.name) }
      return s
    }
  }

  /// The file's content was replaced locally (truncated): a running download of the previous
  /// version stops before this returns, and never marks the file cached.
  public func supersede(_ inode: Int64) {
    guard let s = lock.withLock({ streams.removeValue(forKey: inode) }) else { return }
    s.supersede()
  }

  /// Blocks until the content of `inode` is cached (writable opens, pinning, `download`).
  public func ensureCached(_ inode: Int64) throws {
    for _ in 0..<3 {
      guard let s = try stream(inode) else { return }
      try s.waitForAll(timeoutNs: stallTimeoutNs)
      // Wait for the index to record it (or learn it changed remotely meanwhile).
      while !s.finished { usleep(1000) }
      if let row = try index.item(inode), row.content == .cached { return }
    }
    throw UbiqError.busy("the item keeps changing remotely; try again")
  }

  func run(_ s: ContentStream, name: String) async {
    // The first chunk goes alone: a reader is usually waiting for it (time to first byte), and
    // prefetches in parallel would compete with it for the disk or the link.
    if let first = s.nextChunk() { await fetchAndRecord(s, first) }
    await withTaskGroup(of: Void.self) { group in
      for _ in 0..<max(1, parallelism) {
        group.addTask { [self] in
          while s.failed == nil, let i = s.nextChunk() { await fetchAndRecord(s, i) }
        }
      }
    }
    // The bytes and the cache file's name are durable before the index says cached, so a power
    // loss never leaves an index that describes content its cache file lost.
    var durable = s.superseded || s.failed != nil
    if !durable {
      if fdatasync(s.fd) != 0 {
        s.fail(UbiqError.posix(errno, "fdatasync of the cache file"))
      } else {
        durable = (try? ContentCache.fsyncDirectory(cache.directory)) != nil
        if !durable { s.fail(UbiqError.io("fsync of the cache folder failed")) }
      }
    }
    close(s.fd)
    var ok = false
    if s.superseded {
      log.debug("download of \(name) stopped: the file was replaced locally")
    } else if let e = s.failed {
      log.warning("download of \(name) failed: \(e)")
      lock.withLock { failures[s.inode] = e.description }
    } else if lock.withLock({ streams[s.inode] === s }) {
      // Only the inode's current stream may complete it: an older one of the same manifest
      // (a revert while it ran) did not fill the cache file the index now points at.
      ok = (try? index.markCached(s.inode, manifest: s.manifest)) ?? false
      if ok {
        log.debug("downloaded \(name) (\(s.size) bytes)")
        onCached(s.inode)
      }
    }
    s.markFinished()
    lock.withLock { if streams[s.inode] === s { streams[s.inode] = nil } }
    if !ok && s.failed == nil {
      log.info("\(name) changed remotely while downloading; next read fetches the new version")
    }
  }

  /// Fetches chunk `i` and marks it done, or fails the stream.
  func fetchAndRecord(_ s: ContentStream, _ i: Int) async {
    do {
      try await fetch(s, i)
      s.complete(i)
    } catch let e as UbiqError {
      s.fail(e)
    } catch {
      s.fail(.io("\(error)"))
    }
  }

  /// Fetches one chunk, retrying transient failures until `stallTimeoutNs` has passed.
  func fetch(_ s: ContentStream, _ i: Int) async throws {
    let chunk = s.chunks[i]
    let start = Clock.monotonicNs()
    var delay: UInt64 = 100_000_000
    while true {
      do {
        await limiter?.acquire(Int(chunk.length))
        let data = try await cloud.getChunk(hash: chunk.hash, range: nil)
        guard Int64(data.count) == chunk.length, Chunker.sha256Hex(data) == chunk.hash else {
          throw UbiqError.io("downloaded chunk \(chunk.hash.prefix(12)) does not match its hash")
        }
        _ = try s.writeChunk(data, at: s.offsets[i])
        return
      } catch let e as CloudError {
        switch e {
        case .unavailable:
          if Clock.monotonicNs() - start > stallTimeoutNs {
            throw UbiqError.unavailable("cloud unreachable: \(e)")
          }
          try? await Task.sleep(nanoseconds: delay)
          delay = min(delay * 2, 2_000_000_000)
        case .notFound:
          throw UbiqError.notFound("chunk \(chunk.hash.prefix(12)) is missing in the cloud")
        default:
          throw UbiqError.io("download failed: \(e)")
        }
      }
    }
  }
}

/// Applies the cloud's change feed to the index: at mount (before the kernel sees anything) and
/// then every `interval`. Items with local changes, or open for writing, are left alone.
public final class ChangePuller: @unchecked Sendable {
  let index: IndexStore
  let cache: ContentCache
  let cloud: CloudService
  let container: ContainerID
  let coordinator: WriteCoordinator
  let uid: UInt32
  let gid: UInt32
  let log: Logger
  /// Called with what changed, to drop cache files and invalidate kernel caches.
  public var onApplied: ([RemoteApplyResult]) -> Void = { _ in }
  /// Called when a pull succeeds after failures (the cloud came back).
  public var onRecovered: () -> Void = {}
  /// Called under the inode lock when a remote version replaced an item's cached content.
  public var onContentReplaced: (Int64) -> Void = { _ in }
  private var task: Task<Void, Never>?
  private let lock = NSLock()
  private var stopped = false
  /// The wait for the next change in progress, cancelled by `wake`.
  private var waiting: Task<Bool, Error>?
  private var wakeRequested = false

  public init(
    index: IndexStore, cache: ContentCache, cloud: CloudService, container: ContainerID, coordinator: WriteCoordinator,
    uid: UInt32, gid: UInt32, logger: Logger
  ) {
    self.index = index
    self.cache = cache
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
        let r = try apply(item, collisions: .deferUnchangedHolders)
        if r.outcome == .deferred { deferred.append(item) } else { all.append(r) }
      }
      // Parents may come later in the feed than their children (moves), and the item holding a
      // name may be moving away later in the feed (exchanges): retry the deferred while that
      // makes progress. Then items that hold each other's names (a swap) step aside for each
      // other, and any other collision is settled by the naming rule.
      for final in [false, true] {
        // Only items whose record can be applied now (its parent is here) may step aside.
        let movable = try deferred.filter { try $0.parentID.flatMap { try index.item(itemID: $0) } != nil }
        let policy: IndexStore.NameCollisionPolicy =
          final ? .moveAsideHolders(Set(movable.map(\.itemID))) : .deferUnchangedHolders
        var progress = true
        while progress && !deferred.isEmpty {
          progress = false
          var still: [CloudItem] = []
          for item in deferred {
            let r = try apply(item, collisions: policy)
            if r.outcome == .deferred {
              still.append(item)
            } else {
              all.append(r)
              progress = true
            }
          }
          deferred = still
        }
      }
      token = batch.token
      if !batch.hasMore {
        // Records whose folder is not here (not in the cloud either, or a change of this device
        // keeps it away) are held, not left in front of the token: the feed moves on, every later
        // pull retries them, and `ubiqfs status` counts them.
        for item in deferred { try index.holdRemote(item) }
        try index.setChangeToken(token)
        break
      }
      // Mid-feed, the token stays before the first record still waiting for its parent, which
      // may come on a later page.
      let safe = deferred.map { $0.changeSeq - 1 }.min().map { min($0, token) } ?? token
      try index.setChangeToken(safe)
    }
    // Held records, after the feed: those a newer record superseded are gone, and a record
    // whose folder this pull brought, or whose item's local changes are done, applies now.
    all += try applyHeld()
    if !deferred.isEmpty { log.info("\(deferred.count) remote items wait for their parent") }
    let effective = all.filter { $0.outcome != .unchanged && $0.outcome != .locallyModified }
    if !effective.isEmpty { onApplied(effective) }
    return effective
  }

  /// Applies the records held back earlier because their items had local changes, in change
  /// order, while that makes progress. A record still blocked (local changes, or its parent is
  /// not here yet) stays held.
  func applyHeld() throws -> [RemoteApplyResult] {
    var held = try index.heldRemote()
    var results: [RemoteApplyResult] = []
    var progress = true
    while progress && !held.isEmpty {
      progress = false
      var still: [CloudItem] = []
      for item in held {
        // Applied (or found stale), the record releases itself (IndexStore.applyRemote).
        let r = try apply(item, collisions: .settle, holding: false)
        if r.outcome == .deferred || r.outcome == .locallyModified {
          still.append(item)
        } else {
          results.append(r)
          progress = true
        }
      }
      held = still
    }
    return results
  }

  /// Applies one record. `holding`: a record the item's local changes block is kept (see
  /// `IndexStore.holdRemote`) and applied by a later pull, once they are done.
  func apply(
    _ item: CloudItem, collisions: IndexStore.NameCollisionPolicy = .settle, holding: Bool = true
  ) throws -> RemoteApplyResult {
    guard let local = try index.item(itemID: item.itemID), let inode = local.id else {
      return try index.applyRemote(item, uid: uid, gid: gid, collisions: collisions, holding: holding)
    }
    // The echo of our own upload: nothing to write (applyRemote would say the same, in a write
    // transaction).
    if !item.deleted && local.etag == item.etag { return RemoteApplyResult(outcome: .unchanged, inode: inode) }
    return try coordinator.withInodeLock(inode) {
      if coordinator.isBusy(inode) {
        if holding { try index.holdRemote(item) }
        return RemoteApplyResult(outcome: .locallyModified, inode: inode)
      }
      let result = try index.applyRemote(item, uid: uid, gid: gid, collisions: collisions, holding: holding)
      // The old bytes go now, under the inode lock: an open after this point downloads the new
      // version, and its download must not be removed by a late clean-up. Open readers keep the
      // old bytes through their descriptors.
      if result.outcome == .updated(contentChanged: true) {
        cache.remove(inode)
        onContentReplaced(inode)
      }
      return result
    }
  }

  /// Pulls, then waits on the cloud's push channel (long-poll of up to 25 s) for the next
  /// change; `retryNs` is the pause after a failure (cloud unreachable).
  public func start(retryNs: UInt64) {
    task = Task.detached { [self] in
      var failing = false
      while !lock.withLock({ stopped }) {
        do {
          try await pullOnce()
          if failing {
            // The cloud is back: queued work should not sit out its backoff.
            failing = false
            log.info("cloud reachable again")
            onRecovered()
          }
          try await waitForChanges()
        } catch is CancellationError {
          return
        } catch {
          if Task.isCancelled { return }
          failing = true
          log.warning("pull failed: \(error)")
          try? await Task.sleep(nanoseconds: retryNs)
        }
      }
    }
  }

  /// Waits for the cloud's next change (long-poll of up to 25 s), or until `wake`.
  private func waitForChanges() async throws {
    let since = try index.changeToken()
    let wait = Task { [cloud, container] in try await cloud.waitForChanges(container, since: since, timeoutMs: 25_000) }
    let woken = lock.withLock {
      if wakeRequested || stopped { return true }
      waiting = wait
      return false
    }
    var failure: Error? = nil
    if woken {
      wait.cancel()
    } else {
      do { _ = try await wait.value } catch { failure = error }
    }
    let interrupted = lock.withLock {
      defer {
        waiting = nil
        wakeRequested = false
      }
      return wakeRequested || stopped
    }
    try Task.checkCancellation()
    // A failed long-poll that `wake` or `stop` did not cancel goes to the caller's retry pause.
    if let failure, !interrupted { throw failure }
  }

  /// Pulls now instead of waiting for the cloud's next change: something was held back or
  /// refused that the next pull settles.
  public func wake() {
    lock.withLock {
      wakeRequested = true
      waiting?.cancel()
    }
  }

  public func stop() async {
    lock.withLock {
      stopped = true
      waiting?.cancel()
    }
    task?.cancel()
    await task?.value
  }
}
