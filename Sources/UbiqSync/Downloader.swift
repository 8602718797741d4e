import Foundation
import Logging
import UbiqCloudAPI
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// How far past a read the download of its file may fetch, for one open handle. The window is
/// as long as the handle's current run of sequential reads (at least `initial`, at most
/// `maximum`), so it grows while the handle streams the file and falls back to `initial` after
/// a seek, like the kernel's own read-ahead and mountpoint-s3's prefetcher. A handle that reads
/// one byte costs about one window of download, not the whole file.
public struct ReadAheadWindow: Sendable {
  public let initial: Int64
  public let maximum: Int64
  /// Where the handle's current sequential run started, and where its next read would follow
  /// it; -1 before the first read.
  private var runStart: Int64 = -1
  private var nextOffset: Int64 = -1

  public init(initial: Int64 = 1 << 20, maximum: Int64 = 64 << 20) {
    self.initial = max(1, initial)
    self.maximum = max(self.initial, maximum)
  }

  /// Records a read of [offset, offset+length) and returns the offset up to which the download
  /// may fetch ahead of it.
  public mutating func fetchLimit(afterReadAt offset: Int64, length: Int) -> Int64 {
    let (end, overflow) = offset.addingReportingOverflow(Int64(max(0, length)))
    if overflow || offset < 0 { return .max }
    // The kernel sends neighbouring reads slightly out of order: within `initial` of the
    // expected offset counts as sequential.
    let sequential =
      nextOffset >= 0 && offset >= nextOffset.subtractingReportingOverflow(initial).partialValue
      && offset <= nextOffset.addingReportingOverflow(initial).partialValue
    if sequential {
      nextOffset = max(nextOffset, end)
    } else {
      runStart = offset
      nextOffset = end
    }
    let window = min(maximum, max(initial, nextOffset - runStart))
    let (limit, over) = nextOffset.addingReportingOverflow(window)
    return over ? .max : limit
  }
}

/// One in-progress download of a file's content into its cache file, shared by every reader of
/// the inode. Chunks are fetched in parallel, those readers wait for first, then those inside
/// the read-ahead windows of the open handles (or all of them, for a whole-file download);
/// readers block only until their own byte range is present. Owns the chunk bookkeeping, the
/// cache file descriptor it writes through and the count of handles using it; all of it is
/// guarded by `cond`, and writes into the file by `writeLock`.
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
  private var doneCount = 0
  private var inFlight: Set<Int> = []
  /// Chunks readers wait for, in the order they asked, fetched before any other.
  private var wanted: [Int] = []
  /// The read-ahead window of the latest reads: chunks from `aheadNext` up to `aheadEnd` are
  /// fetched after those readers wait for.
  private var aheadNext = 0
  private var aheadEnd = 0
  /// The whole file is wanted (an open for writing, a pin, `ubiqfs download`): the download
  /// runs to the end even when no handle reads it any more. Every chunk below `wholeNext` is
  /// done or in flight.
  private var wholeFile = false
  private var wholeNext = 0
  /// Open handles reading through this download.
  private var users = 0
  private var failure: UbiqError?
  private var isFinished = false
  private var endingStarted = false
  /// For each chunk, the monotonic time the bandwidth cap lets its fetch start (0: not booked):
  /// a reader's stall timeout counts from the latest of the chunks it waits for, not from the
  /// last chunk that arrived nor from chunks booked after them.
  private var pacedStartNs: [UInt64]
  /// Set when the download must stop: the file's content was replaced locally (truncate,
  /// O_TRUNC), the item went away, or the last handle reading it closed. No chunk may land in
  /// the cache file after that; waiting readers read the file as it is.
  private var isStopped = false
  /// Held around every write into the cache file, so `stop` returns only after the last write
  /// of a chunk is done.
  private let writeLock = NSLock()
  /// Cancel the chunk requests in flight (`cancellingOnStop`), by key.
  private var cancellers: [Int: @Sendable () -> Void] = [:]
  private var nextCanceller = 0

  /// The cache file was made empty and given its final size, so every byte no chunk wrote reads
  /// as zero: a chunk of zeros (a sparse file's hole) is not written and stays a hole.
  let holesReadAsZero: Bool

  init(inode: Int64, manifest: String?, size: Int64, chunks: [ChunkRef], fd: Int32, holesReadAsZero: Bool = false) {
    self.inode = inode
    self.holesReadAsZero = holesReadAsZero
    self.manifest = manifest
    self.size = size
    self.chunks = chunks
    var offs: [Int64] = []
    var o: Int64 = 0
    for c in chunks {
      offs.append(o)
      o = o.addingReportingOverflow(c.length).partialValue
    }
    offsets = offs
    self.fd = fd
    done = Array(repeating: false, count: chunks.count)
    pacedStartNs = Array(repeating: 0, count: chunks.count)
  }

  public var finished: Bool { cond.withLock { isFinished } }
  public var stopped: Bool { cond.withLock { isStopped } }
  public var failed: UbiqError? { cond.withLock { failure } }

  /// Fraction downloaded, 0...100.
  public var percent: Int {
    cond.withLock { chunks.isEmpty ? 100 : Int(Double(doneCount) * 100 / Double(chunks.count)) }
  }

  /// The index of the chunk holding byte `offset` (the last chunk for offsets past the end).
  func chunkIndex(containing offset: Int64) -> Int {
    var lo = 0
    var hi = offsets.count - 1
    while lo < hi {
      let mid = (lo + hi + 1) / 2
      if offsets[mid] <= offset { lo = mid } else { hi = mid - 1 }
    }
    return lo
  }

  /// Chunk indexes overlapping [off, off+len).
  func chunkRange(_ off: Int64, _ len: Int) -> Range<Int> {
    guard !chunks.isEmpty, len > 0, off >= 0, off < size else { return 0..<0 }
    let end = min(size, off.addingReportingOverflow(Int64(len)).partialValue)
    return chunkIndex(containing: off)..<(chunkIndex(containing: end - 1) + 1)
  }

  // MARK: - readers

  /// Asks for [off, off+len) first and lets the download fetch the chunks after it, up to
  /// `fetchAheadTo`. A read that continues the current window extends it; any other read
  /// starts a new one. Returns true if the scheduler should look for chunks to start.
  func request(_ off: Int64, _ len: Int, fetchAheadTo: Int64) -> Bool {
    let range = chunkRange(off, len)
    return cond.withLock {
      if isStopped || failure != nil { return false }
      // First come, first served: a reader already waiting keeps its place ahead of newer
      // reads, so a stream of new readers cannot starve it.
      let missing = range.filter { !done[$0] && !inFlight.contains($0) && !wanted.contains($0) }
      wanted.append(contentsOf: missing)
      if !range.isEmpty && fetchAheadTo > 0 {
        let start = range.upperBound
        let end = max(start, chunkIndex(containing: max(0, min(size, fetchAheadTo) - 1)) + 1)
        if start >= aheadNext && start <= aheadEnd {
          aheadEnd = max(aheadEnd, end)
        } else {
          aheadNext = start
          aheadEnd = end
        }
      }
      return !missing.isEmpty || aheadNext < aheadEnd
    }
  }

  /// Asks for every chunk.
  func requestWholeFile() { cond.withLock { wholeFile = true } }

  /// The fetch of chunk `i` may start only at `ns` (monotonic), when the bandwidth cap has room
  /// for it.
  func paced(chunk i: Int, until ns: UInt64) {
    cond.withLock { if pacedStartNs.indices.contains(i) { pacedStartNs[i] = ns } }
  }

  /// True if a read of [off, off+len) would not wait: the range is here, or the download
  /// stopped (the read takes the file as it is).
  func isReadable(_ off: Int64, _ len: Int) -> Bool {
    let range = chunkRange(off, len)
    let toEnd = off.addingReportingOverflow(Int64(len)).partialValue >= size
    return cond.withLock { isStopped || !lacks(range, toEnd: toEnd) }
  }

  /// Whether a read of `range` must still wait (`toEnd`: it reaches the end of the file, which
  /// is final only once the download has finished). Called under `cond`.
  private func lacks(_ range: Range<Int>, toEnd: Bool) -> Bool {
    range.contains(where: { !done[$0] }) || (toEnd && doneCount == chunks.count && !isFinished)
  }

  /// Blocks until [off, off+len) is present, or the download failed, or no chunk arrived for
  /// `stallTimeoutNs` (counted from when the bandwidth cap lets the last of the range's missing
  /// chunks start), or the caller was interrupted. A range that reaches the end of the file,
  /// once every chunk is here, also waits until the download is finished (made durable and
  /// recorded), so a reader that read the whole file then sees it downloaded.
  func waitForRange(_ off: Int64, _ len: Int, stallTimeoutNs: UInt64, interruption: Interruption?) throws {
    let range = chunkRange(off, len)
    let toEnd = off.addingReportingOverflow(Int64(len)).partialValue >= size
    let wait = {
      self.cond.lock()
      defer { self.cond.unlock() }
      var progress = self.doneCount
      var deadline = Date(timeIntervalSinceNow: Double(stallTimeoutNs) / 1e9)
      while self.lacks(range, toEnd: toEnd) {
        if self.isStopped { return }
        if let failure = self.failure { throw failure }
        if interruption?.isInterrupted == true { throw UbiqError.interrupted("waiting for content from the cloud") }
        if self.doneCount != progress {
          progress = self.doneCount
          deadline = Date(timeIntervalSinceNow: Double(stallTimeoutNs) / 1e9)
        }
        if !self.cond.wait(until: deadline) && self.doneCount == progress {
          // Every byte asked for is here: past the deadline the read goes on without the record.
          if !range.contains(where: { !self.done[$0] }) { return }
          // A fetch the bandwidth cap holds back is no stall: its time starts when it may go.
          let now = Clock.monotonicNs()
          let pacedUntil = range.lazy.filter { !self.done[$0] }.map { self.pacedStartNs[$0] }.max() ?? 0
          let pacedDeadline = pacedUntil.addingReportingOverflow(stallTimeoutNs)
          if !pacedDeadline.overflow && pacedDeadline.partialValue > now {
            deadline = Date(timeIntervalSinceNow: Double(pacedDeadline.partialValue - now) / 1e9)
            continue
          }
          throw UbiqError.unavailable("no content arrived from the cloud for \(stallTimeoutNs / 1_000_000_000) s")
        }
      }
    }
    if let interruption {
      try interruption.watching(wake: { [cond] in cond.withLock { cond.broadcast() } }, wait)
    } else {
      try wait()
    }
  }

  // MARK: - handles

  func addUser() { cond.withLock { users += 1 } }

  /// Whether a handle reads through the download.
  var hasUsers: Bool { cond.withLock { users > 0 } }

  /// A handle reading through the download closed. Returns true if it was the last one and
  /// nothing else wants the rest of the file.
  func removeUser() -> Bool {
    cond.withLock {
      users = max(0, users - 1)
      return users == 0 && !wholeFile && doneCount < chunks.count
    }
  }

  // MARK: - the fetch loop

  /// Chunks to start now, marked in flight: those readers wait for, then those in the
  /// read-ahead window, then (for a whole-file download) the rest in order. The first chunk of
  /// a download goes alone: a reader is usually waiting for it (time to first byte), and
  /// parallel fetches would compete with it for the link.
  func startableChunks(parallelism: Int) -> [Int] {
    cond.withLock {
      if isStopped || failure != nil { return [] }
      let slots = (doneCount == 0 ? 1 : max(1, parallelism)) - inFlight.count
      var picked: [Int] = []
      func take(_ i: Int) {
        if !done[i] && !inFlight.contains(i) {
          inFlight.insert(i)
          picked.append(i)
        }
      }
      while picked.count < slots, !wanted.isEmpty { take(wanted.removeFirst()) }
      while picked.count < slots && aheadNext < aheadEnd {
        take(aheadNext)
        aheadNext += 1
      }
      while wholeFile && picked.count < slots && wholeNext < chunks.count {
        take(wholeNext)
        wholeNext += 1
      }
      return picked
    }
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

  /// Chunk `i` was not written because the download stopped.
  func drop(_ i: Int) {
    cond.withLock {
      inFlight.remove(i)
      cond.broadcast()
    }
  }

  func giveUp(_ i: Int, _ e: UbiqError) {
    cond.withLock {
      inFlight.remove(i)
      if failure == nil { failure = e }
      cond.broadcast()
    }
  }

  /// Fails the download (the first failure is the one readers get).
  func fail(_ e: UbiqError) {
    cond.withLock {
      if failure == nil { failure = e }
      cond.broadcast()
    }
  }

  /// How a download ended.
  enum Ending {
    case complete
    case stopped
    case failed(UbiqError)
  }

  /// The ending, once: when nothing is in flight and every chunk is here, or the download
  /// stopped or failed. Nil while it goes on (or idles between reads) and after it was returned.
  func ending() -> Ending? {
    cond.withLock {
      guard !endingStarted, inFlight.isEmpty else { return nil }
      let result: Ending
      if isStopped {
        result = .stopped
      } else if let failure {
        result = .failed(failure)
      } else if doneCount == chunks.count {
        result = .complete
      } else {
        return nil
      }
      endingStarted = true
      return result
    }
  }

  /// Stops the download for good. Returns once no chunk can be written into the cache file any
  /// more.
  func stop() {
    let cancel = writeLock.withLock {
      cond.withLock { () -> [@Sendable () -> Void] in
        isStopped = true
        cond.broadcast()
        defer { cancellers = [:] }
        return Array(cancellers.values)
      }
    }
    for c in cancel { c() }
  }

  /// Runs one chunk's request so that `stop` cancels it: a request that hangs would otherwise
  /// hold the stopped download (its task and its cache file descriptor) until it times out.
  func cancellingOnStop<T: Sendable>(_ request: @escaping @Sendable () async throws -> T) async throws -> T {
    let task = Task { try await request() }
    let key = cond.withLock { () -> Int? in
      if isStopped { return nil }
      nextCanceller += 1
      cancellers[nextCanceller] = { task.cancel() }
      return nextCanceller
    }
    guard let key else {
      task.cancel()
      throw CancellationError()
    }
    defer { cond.withLock { _ = cancellers.removeValue(forKey: key) } }
    return try await task.value
  }

  /// Writes fetched bytes at `offset` of the cache file unless the download stopped. Returns
  /// false if it did (nothing written).
  func writeChunk(_ data: Data, at offset: Int64) throws -> Bool {
    try writeLock.withLock {
      if stopped { return false }
      if holesReadAsZero && Self.isAllZero(data) { return true }
      try data.withUnsafeBytes { raw in
        var written = 0
        while written < raw.count {
          let n = pwrite(fd, raw.baseAddress! + written, raw.count - written, off_t(offset) + off_t(written))
          if n < 0 && errno == EINTR { continue }
          if n <= 0 { throw UbiqError.posix(errno, "writing the cache") }
          written += n
        }
      }
      return true
    }
  }

  /// Whether every byte of `data` is zero: the first is, and each equals the next.
  static func isAllZero(_ data: Data) -> Bool {
    data.withUnsafeBytes { raw in
      guard let base = raw.baseAddress, raw.count > 0 else { return true }
      return raw[0] == 0 && memcmp(base, base + 1, raw.count - 1) == 0
    }
  }

  func markFinished() {
    cond.withLock {
      isFinished = true
      cond.broadcast()
    }
  }
}

/// Brings evicted ("dataless") content into the cache by streaming it from the cloud: fetches
/// chunks in parallel, verifies each SHA-256, writes them into the cache file in place and
/// marks the file cached once all arrived and are durable (so a crash mid-download just
/// downloads again). Owns the running downloads (one `ContentStream` per inode, shared by its
/// readers), the last failure of each inode and the count of bytes fetched, guarded by `lock`.
/// Waits never hold a lock other inodes need; fetches run as tasks, never on the callers'
/// threads.
/// Sendable: `parallelism`, `stallTimeoutNs`, `limiter` and `onCached` are set before the mount starts.
public final class Downloader: @unchecked Sendable {
  let index: IndexStore
  let cache: ContentCache
  let cloud: CloudService
  let inodes: InodeTable
  let log: Logger
  /// Concurrent chunk fetches per file.
  public var parallelism = 4
  /// How long a reader waits without any chunk arriving before failing (cloud unreachable).
  public var stallTimeoutNs: UInt64 = 15_000_000_000
  /// Optional bandwidth cap for downloads.
  public var limiter: RateLimiter?
  /// Called when a file's content became fully cached (its st_blocks changed).
  public var onCached: (Int64) -> Void = { _ in }
  /// Background fetches (`fetchInBackground`) running at once; the others wait their turn.
  public var backgroundFetchLimit = 2
  /// The pause before a failed background fetch is tried again; it doubles with each failure
  /// in a row, up to `maximumBackgroundRetryDelayNs`.
  public var backgroundRetryDelayNs: UInt64 = 30_000_000_000
  public var maximumBackgroundRetryDelayNs: UInt64 = 600_000_000_000
  private let lock = NSLock()
  private var streams: [Int64: ContentStream] = [:]
  private var failures: [Int64: String] = [:]
  private var fetched: Int64 = 0
  private var fetching = 0
  private var background = BackgroundFetches()
  /// Set by `stopAll`: nothing starts any more.
  private var shutDown = false

  public init(
    index: IndexStore, cache: ContentCache, cloud: CloudService, inodes: InodeTable, logger: Logger
  ) {
    self.index = index
    self.cache = cache
    self.cloud = cloud
    self.inodes = inodes
    self.log = logger
  }

  /// The content transitions, over this downloader's index, cache and inode table.
  var content: FileContent { FileContent(index: index, cache: cache, inodes: inodes, downloads: self, logger: log) }

  /// The last download error of an inode, if its last download failed.
  public func lastError(_ inode: Int64) -> String? { lock.withLock { failures[inode] } }
  /// Whether a download of `inode` runs or waits for its turn in the background queue.
  public func isDownloading(_ inode: Int64) -> Bool {
    lock.withLock { streams[inode] != nil || background.isWaiting(inode) || background.running[inode] != nil }
  }
  public func percent(_ inode: Int64) -> Int? { lock.withLock { streams[inode] }?.percent }
  /// Bytes of content fetched from the cloud since the mount.
  public var bytesFetched: Int64 { lock.withLock { fetched } }
  /// Chunk fetches running now, over all files.
  public var activeFetches: Int { lock.withLock { fetching } }

  /// The running download of `inode`, started if needed; nil if the content is already cached.
  /// Starting one fetches nothing yet: readers and whole-file requests say what to fetch. Runs
  /// under the inode lock (it may create the cache file).
  func stream(_ inode: Int64) throws -> ContentStream? {
    let (s, isNew) = try lock.withLock { () throws -> (ContentStream?, Bool) in
      // Checked under the lock `stopAll` takes: a download is made before it (and stopped by
      // it), or never.
      if shutDown { throw UbiqError.unavailable("the mount is stopping") }
      guard let row = try index.item(inode), row.kind == .file else { throw UbiqError.notFound("inode \(inode)") }
      if row.content == .cached { return (nil, false) }
      // A download of an older version (changed remotely meanwhile) serves its own readers.
      if let s = streams[inode], s.manifest == row.chunks || s.chunks == row.chunkList { return (s, false) }
      // A new file: readers of an earlier download (failed, stopped, or of an older version)
      // keep the old one through their descriptors and never see its bytes change.
      let path = cache.path(inode)
      unlink(path)
      let fd = Glibc.open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
      guard fd >= 0 else { throw UbiqError.posix(errno, "creating the cache file of \(row.name)") }
      // The file gets its final size at once (its holes read as zero); if that fails, each
      // chunk's write extends it.
      let sized = ftruncate(fd, off_t(row.size)) == 0
      let s = ContentStream(
        inode: inode, manifest: row.chunks, size: row.size, chunks: row.chunkList, fd: fd, holesReadAsZero: sized)
      streams[inode] = s
      failures[inode] = nil
      return (s, true)
    }
    // A file without chunks (empty) is complete at once.
    if let s, isNew { schedule(s) }
    return s
  }

  /// The download an open handle reads evicted content through; nil if the content is cached.
  /// The handle must give it back with `closeReader` when it closes. Runs under the inode lock.
  public func openReader(_ inode: Int64) throws -> ContentStream? {
    guard let s = try stream(inode) else { return nil }
    s.addUser()
    return s
  }

  /// A handle reading through `s` closed. When it was the last one and nothing else wants the
  /// rest of the file, the download stops and its partial cache file goes. Runs under the
  /// inode lock (cache file names change only under it).
  public func closeReader(_ s: ContentStream) {
    guard s.removeUser() else { return }
    lock.withLock {
      s.stop()
      // The cache file goes unless it belongs to a newer download (or to content written
      // since): the item is still evicted, and a later open downloads into a new file.
      if streams[s.inode] === s {
        streams[s.inode] = nil
        cache.remove(s.inode)
      }
    }
    schedule(s)
  }

  /// Waits until [offset, offset+length) of the file is in its cache file, fetching ahead up to
  /// `fetchAheadTo` meanwhile.
  /// Asks for [offset, offset+length) of the file and read-ahead up to `fetchAheadTo`; true if
  /// a read of the range can go on at once, false if it must wait (`waitForRequestedRange`).
  public func requestRange(_ s: ContentStream, _ offset: Int64, _ length: Int, fetchAheadTo: Int64) -> Bool {
    if s.request(offset, length, fetchAheadTo: fetchAheadTo) { schedule(s) }
    return s.isReadable(offset, length)
  }

  /// Waits for a range asked for with `requestRange`.
  public func waitForRequestedRange(
    _ s: ContentStream, _ offset: Int64, _ length: Int, interruption: Interruption? = nil
  ) throws {
    try s.waitForRange(offset, length, stallTimeoutNs: stallTimeoutNs, interruption: interruption)
  }

  public func waitForRange(
    _ s: ContentStream, _ offset: Int64, _ length: Int, fetchAheadTo: Int64, interruption: Interruption? = nil
  ) throws {
    if s.request(offset, length, fetchAheadTo: fetchAheadTo) { schedule(s) }
    try s.waitForRange(offset, length, stallTimeoutNs: stallTimeoutNs, interruption: interruption)
  }

  /// The content the download fetches was replaced (a remote version, a merge): the download
  /// leaves the table, so it never marks the file cached. While handles read through it, it
  /// goes on, so they finish with the old bytes (their descriptors keep the old cache file);
  /// with none (a pinned file's background fetch, a download only a waiter asked for) it stops:
  /// nobody will read that version. Runs under the inode lock.
  public func detach(_ inode: Int64) {
    guard let s = lock.withLock({ streams.removeValue(forKey: inode) }), !s.hasUsers else { return }
    s.stop()
    schedule(s)
  }

  /// The file's content was replaced locally (truncated) or the item went away: a running
  /// download of the previous version stops before this returns, and never marks the file
  /// cached.
  public func supersede(_ inode: Int64) {
    guard let s = lock.withLock({ streams.removeValue(forKey: inode) }) else { return }
    s.stop()
    schedule(s)
  }

  /// Blocks until the content of `inode` is cached (writable opens, pinning, `download`), or
  /// the download failed, stalled or the caller was interrupted. Holds no lock while it waits.
  public func ensureCached(_ inode: Int64, interruption: Interruption? = nil) throws {
    for _ in 0..<3 {
      // Under the inode lock: creating the cache file is a content transition.
      guard let s = try inodes.withInodeLock(inode, { try stream(inode) }) else { return }
      s.requestWholeFile()
      schedule(s)
      try s.waitForRange(
        0, Int(clamping: max(1, s.size)), stallTimeoutNs: stallTimeoutNs, interruption: interruption)
      // A stopped download (replaced locally, or remotely meanwhile) is looked at again.
      if let row = try index.item(inode), row.content == .cached { return }
    }
    throw UbiqError.busy("the item keeps changing; try again")
  }

  /// Fetches the whole content of `inode` in the background: a pinned file's new version, or
  /// one a crash left dataless. Queued, at most `backgroundFetchLimit` run at once; when its
  /// turn comes, a file no longer pinned, no longer dataless or gone is skipped. A failed fetch
  /// shows in `lastError` and is tried again after a pause (`backgroundRetryDelayNs`), or at
  /// once by `retryFailedBackgroundFetches`. Returns at once; any lock may be held.
  public func fetchInBackground(_ inode: Int64) {
    guard
      lock.withLock({ () -> Bool in
        if !shutDown { background.add(inode) }
        return !shutDown
      })
    else { return }
    Task.detached { [self] in startBackgroundFetches() }
  }

  /// Tries again every failed background fetch now (the cloud is reachable again).
  public func retryFailedBackgroundFetches() {
    lock.withLock { background.retryFailed() }
    startBackgroundFetches()
  }

  /// Starts queued background fetches while there is room.
  private func startBackgroundFetches() {
    while let inode = lock.withLock({ shutDown ? nil : background.nextToStart(limit: backgroundFetchLimit) }) {
      // Under the inode lock: creating the download's cache file is a content transition.
      var couldNotStart = false
      let started = inodes.withInodeLock(inode) { () -> ContentStream? in
        do {
          guard let row = try index.item(inode), row.kind == .file, row.pinned, row.content == .dataless,
            let s = try stream(inode)
          else { return nil }
          s.requestWholeFile()
          return s
        } catch {
          log.warning("download of inode \(inode) could not start: \(error)")
          lock.withLock { failures[inode] = "\(error)" }
          couldNotStart = true
          return nil
        }
      }
      guard let started else {
        // Nothing to fetch (cached, unpinned, gone), or the download could not start (no
        // descriptor, a full disk): then it is tried again like a failed fetch.
        let retryAfter = lock.withLock { () -> UInt64? in
          let failed = couldNotStart && !shutDown
          background.notStarted(inode, failed: failed)
          return failed ? scheduleRetry(inode) : nil
        }
        if let retryAfter { retry(inode, after: retryAfter) }
        continue
      }
      let retryAfter = lock.withLock { () -> UInt64? in
        background.started(inode, started) == .alreadyFailed && !shutDown ? scheduleRetry(inode) : nil
      }
      if let retryAfter { retry(inode, after: retryAfter) }
      schedule(started)
    }
  }

  /// The pause before the next try of a failed background fetch, or nil if a try is already
  /// scheduled. Under `lock`.
  private func scheduleRetry(_ inode: Int64) -> UInt64? {
    guard background.retryScheduled.insert(inode).inserted else { return nil }
    return background.retryDelay(base: backgroundRetryDelayNs, maximum: maximumBackgroundRetryDelayNs, inode: inode)
  }

  /// Queues a failed background fetch again after `delay`.
  private func retry(_ inode: Int64, after delay: UInt64) {
    Task.detached { [self] in
      try? await Task.sleep(nanoseconds: delay)
      lock.withLock {
        background.retryScheduled.remove(inode)
        background.retry(inode)
      }
      startBackgroundFetches()
    }
  }

  /// A download ended: if it was a background fetch, its slot frees and the next one starts; a
  /// failed one is tried again after its pause.
  private func backgroundFetchEnded(_ s: ContentStream, failed: Bool) {
    let retryAfter = lock.withLock { () -> UInt64? in
      guard background.ended(s, failed: failed), failed, !shutDown else { return nil }
      return scheduleRetry(s.inode)
    }
    if let retryAfter { retry(s.inode, after: retryAfter) }
    startBackgroundFetches()
  }

  /// Stops every download and background fetch for good (at unmount, before the index
  /// closes; a simulated crash): once this returns, no chunk is written and no file is marked
  /// cached any more. Readers still waiting read their files as they are.
  public func stopAll() {
    let running = lock.withLock { () -> [ContentStream] in
      shutDown = true
      background = BackgroundFetches()
      return Array(streams.values)
    }
    for s in running {
      // Under the inode lock: a completion either ran wholly before, or finds the download
      // gone and marks nothing.
      inodes.withInodeLock(s.inode) { lock.withLock { if streams[s.inode] === s { streams[s.inode] = nil } } }
      s.stop()
      schedule(s)
    }
  }

  /// Starts the fetches `s` can run now, or ends it when nothing more will arrive.
  private func schedule(_ s: ContentStream) {
    for i in s.startableChunks(parallelism: parallelism) {
      lock.withLock { fetching += 1 }
      Task.detached { [self] in
        await fetchAndRecord(s, i)
        lock.withLock { fetching -= 1 }
        schedule(s)
      }
    }
    if let ending = s.ending() {
      Task.detached { [self] in await finish(s, ending) }
    }
  }

  /// Ends a download: the bytes and the cache file's name are durable before the index says
  /// cached, so a power loss never leaves an index that describes content its cache file lost.
  private func finish(_ s: ContentStream, _ ending: ContentStream.Ending) async {
    var ending = ending
    if case .complete = ending {
      if fdatasync(s.fd) != 0 {
        ending = .failed(UbiqError.posix(errno, "fdatasync of the cache file"))
      } else if (try? Durability.fsyncDirectory(cache.directory)) == nil {
        ending = .failed(UbiqError.io("fsync of the cache folder failed"))
      }
    }
    close(s.fd)
    let name = (try? index.item(s.inode))?.name ?? "inode \(s.inode)"
    switch ending {
    case .stopped:
      log.debug("download of \(name) stopped")
    case .failed(let e):
      log.warning("download of \(name) failed: \(e)")
      s.fail(e)
      lock.withLock { failures[s.inode] = e.description }
    case .complete:
      // A content transition: under the inode lock, so an eviction or an open sees the file
      // either downloading or cached. Only the inode's current stream may complete it: an
      // older one of the same manifest (a revert while it ran) did not fill the cache file the
      // index now points at.
      let ok = inodes.withInodeLock(s.inode) { () -> Bool in
        guard lock.withLock({ streams[s.inode] === s }) else { return false }
        let marked = content.downloadCompleted(s.inode, manifest: s.manifest)
        lock.withLock { streams[s.inode] = nil }
        return marked
      }
      if ok {
        log.debug("downloaded \(name) (\(s.size) bytes)")
        onCached(s.inode)
      } else {
        log.info("\(name) changed while downloading; the next read fetches the current version")
      }
    }
    lock.withLock { if streams[s.inode] === s { streams[s.inode] = nil } }
    s.markFinished()
    var failed = false
    if case .failed = ending { failed = true }
    backgroundFetchEnded(s, failed: failed)
  }

  /// Fetches chunk `i` and marks it done, or fails the stream.
  func fetchAndRecord(_ s: ContentStream, _ i: Int) async {
    do {
      if try await fetch(s, i) { s.complete(i) } else { s.drop(i) }
    } catch let e as UbiqError {
      s.giveUp(i, e)
    } catch {
      // A request cancelled because the download stopped is no failure.
      if s.stopped { s.drop(i) } else { s.giveUp(i, .io("\(error)")) }
    }
  }

  /// Fetches one chunk into the cache file, retrying transient failures until `stallTimeoutNs`
  /// has passed since the first. Returns false if the download stopped first (nothing written).
  func fetch(_ s: ContentStream, _ i: Int) async throws -> Bool {
    let chunk = s.chunks[i]
    var firstFailure: UInt64?
    var delay: UInt64 = 100_000_000
    // The chunk books its share of a bandwidth cap once: a retry sends the bytes it paid for.
    var booked = false
    while true {
      if s.stopped { return false }
      do {
        if let limiter, !booked {
          booked = true
          let startAt = limiter.reserve(Int(clamping: chunk.length))
          s.paced(chunk: i, until: startAt)
          let now = Clock.monotonicNs()
          if startAt > now { try? await Task.sleep(nanoseconds: startAt - now) }
          if s.stopped { return false }
        }
        let data = try await s.cancellingOnStop { [cloud] in try await cloud.getChunk(hash: chunk.hash, range: nil) }
        lock.withLock { fetched &+= Int64(data.count) }
        guard Int64(data.count) == chunk.length, Chunker.sha256Hex(data) == chunk.hash else {
          throw UbiqError.io("downloaded chunk \(chunk.hash.prefix(12)) does not match its hash")
        }
        return try s.writeChunk(data, at: s.offsets[i])
      } catch let e as CloudError {
        switch e {
        case .unavailable:
          let now = Clock.monotonicNs()
          if now - (firstFailure ?? now) > stallTimeoutNs {
            throw UbiqError.unavailable("cloud unreachable: \(e)")
          }
          if firstFailure == nil { firstFailure = now }
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

/// The queue of background fetches: files waiting for their turn (in order), those running
/// (by the download each runs through) and those whose last fetch failed (with the number of
/// failures in a row). A value guarded by the `Downloader`'s lock.
struct BackgroundFetches {
  private(set) var waiting: [Int64] = []
  private var waitingSet: Set<Int64> = []
  /// A reserved slot (nil) until the download is made, then the download.
  private(set) var running: [Int64: ContentStream?] = [:]
  private(set) var failed: [Int64: Int] = [:]

  func isWaiting(_ inode: Int64) -> Bool { waitingSet.contains(inode) }

  /// Queues `inode`, unless it waits already.
  mutating func add(_ inode: Int64) {
    if waitingSet.insert(inode).inserted { waiting.append(inode) }
  }

  /// The next file to fetch, its slot reserved; nil when `limit` fetches run or none waits. A
  /// file whose previous fetch still runs waits for it to end.
  mutating func nextToStart(limit: Int) -> Int64? {
    guard running.count < limit, let i = waiting.firstIndex(where: { running[$0] == nil }) else { return nil }
    let inode = waiting.remove(at: i)
    waitingSet.remove(inode)
    running[inode] = .some(nil)
    return inode
  }

  /// What became of a reserved slot given its download.
  enum Start: Equatable {
    /// The download runs; its end frees the slot (`ended`).
    case running
    /// The download (a reader's, joined) had already ended well: the slot is free.
    case alreadyEnded
    /// The download had already failed: the slot is free and the failure counted; the caller
    /// schedules the retry.
    case alreadyFailed
  }

  /// The reserved slot of `inode` got its download.
  mutating func started(_ inode: Int64, _ s: ContentStream) -> Start {
    guard s.finished else {
      running[inode] = .some(s)
      return .running
    }
    let didFail = s.failed != nil
    notStarted(inode, failed: didFail)
    return didFail ? .alreadyFailed : .alreadyEnded
  }

  /// The reserved slot of `inode` frees without a download: `failed`, it could not start (it
  /// is tried again); else there was nothing to fetch (no retry either).
  mutating func notStarted(_ inode: Int64, failed didFail: Bool) {
    running[inode] = nil
    if didFail { failed[inode, default: 0] += 1 } else { failed[inode] = nil }
  }

  /// `s` ended; true if it was a background fetch (its slot frees).
  mutating func ended(_ s: ContentStream, failed didFail: Bool) -> Bool {
    guard case .some(let r) = running[s.inode], r === s else { return false }
    running[s.inode] = nil
    if didFail { failed[s.inode, default: 0] += 1 } else { failed[s.inode] = nil }
    return true
  }

  /// The pause before the next try of a file that failed: `base` doubled for each failure in
  /// a row after the first, at most `maximum`.
  func retryDelay(base: UInt64, maximum: UInt64, inode: Int64) -> UInt64 {
    let shift = min(20, max(0, (failed[inode] ?? 1) - 1))
    let (d, overflow) = base.multipliedReportingOverflow(by: UInt64(1) << UInt64(shift))
    return overflow ? maximum : min(maximum, d)
  }

  /// Failed files whose next try waits for its pause.
  var retryScheduled: Set<Int64> = []

  /// Queues a failed file again (its pause is over), unless it is being fetched already.
  mutating func retry(_ inode: Int64) {
    if failed[inode] != nil && running[inode] == nil { add(inode) }
  }

  /// Queues every failed file again.
  mutating func retryFailed() {
    for inode in failed.keys.sorted() { add(inode) }
  }
}
