import Foundation
import Logging
import UbiqCloudAPI
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// Drains the durable upload queue into the cloud: chunks changed files, sends only the chunks
/// the cloud lacks, commits item versions with If-Match, and deletes. Failures are retried with
/// exponential backoff forever and shown in status; nothing is dropped.
/// Sendable: `kicked`, `stopped`, `task`, `unrecorded`, `pausedUntilNs` and `sending` are guarded by `lock`;
/// the callbacks, `limiter` and `parallelUploads` are set before `start`.
public final class UploadWorker: @unchecked Sendable {
  let index: IndexStore
  let cache: ContentCache
  let cloud: CloudService
  let inodes: InodeTable
  let container: ContainerID
  let deviceID: String
  let chunker: Chunker
  let log: Logger
  private let lock = NSLock()
  private var kicked = false
  private var stopped = false
  private var task: Task<Void, Never>?
  /// Consecutive attempts whose outcome could not be recorded in the index (its disk is full):
  /// the worker pauses, 1 s doubling to 60 s, instead of repeating work it cannot record.
  private var unrecorded = 0
  private var pausedUntilNs: UInt64 = 0
  /// Bytes of chunk data sent to the cloud since start (for tests and status).
  public private(set) var bytesSent: Int64 = 0
  /// Called after a merged version was committed and applied to the index.
  public var onMerged: ([RemoteApplyResult]) -> Void = { _ in }
  /// Running downloads: a merged version replacing a file's content detaches its download.
  public var downloader: Downloader?
  /// The content transitions, over this worker's index, cache, inode table and downloader.
  var content: FileContent {
    FileContent(index: index, cache: cache, inodes: inodes, downloads: downloader, logger: log)
  }
  /// Called when the cloud refused a change that only a pull can settle: a delete of an item
  /// changed elsewhere, a move into a folder that moved meanwhile.
  public var onNeedsPull: () -> Void = {}
  /// Whether a newer version of the file at an inode waits for the processes reading it here
  /// to close (`ChangePuller.waitsForReaders`): its changes wait too, so that their merge does
  /// not replace the content under those readers.
  public var waitsForReaders: (Int64) -> Bool = { _ in false }
  /// Optional bandwidth cap for uploads.
  public var limiter: RateLimiter?
  /// Uploads whose content is being sent, by inode.
  private var sending: [Int64: UploadProgress] = [:]
  /// Items whose version is being committed.
  private var committing: Set<Int64> = []
  /// How many queue entries have their content prepared (chunked, missing chunks sent) at once.
  /// Commits still happen in queue order (in batches, `drain`), so a parent always reaches the
  /// cloud before its children and a rename before a create that reuses the old name.
  public var parallelUploads = 6
  /// What the page's short waits are measured by (how long versions gathered for a batch wait
  /// for an upload still being prepared). `_Concurrency.Clock`: `Clock` here is UbiqCore's wall
  /// clock. A simulation sets a clock that moves only when it says, so that how a page is cut
  /// into requests never depends on the machine's speed.
  public var waitClock: any _Concurrency.Clock<Duration> = ContinuousClock()

  /// Progress of the uploads in flight (empty when idle), by path.
  public var inFlight: [UploadProgress] {
    // Paths are looked up when asked for: most uploads end before anyone looks.
    lock.withLock { Array(sending.values) }.map { progress in
      var named = progress
      named.path = (try? index.path(of: progress.inode)) ?? progress.path
      return named
    }.sorted { $0.path < $1.path }
  }

  /// Whether an upload of `inode` is in flight now: its content read and sent, or its version
  /// committed.
  public func isUploading(_ inode: Int64) -> Bool {
    lock.withLock { sending[inode] != nil || committing.contains(inode) }
  }

  /// Whether a version of `inode` is in a commit whose answer is not recorded yet.
  public func isCommitting(_ inode: Int64) -> Bool { lock.withLock { committing.contains(inode) } }

  /// Percent uploaded of `inode` if its upload is in flight.
  public func percent(_ inode: Int64) -> Int? {
    lock.withLock {
      guard let c = sending[inode], c.totalBytes > 0 else { return nil }
      return Int(Double(c.sentBytes) * 100 / Double(c.totalBytes))
    }
  }

  public init(
    index: IndexStore, cache: ContentCache, cloud: CloudService, inodes: InodeTable,
    container: ContainerID, deviceID: String, chunker: Chunker = .standard, logger: Logger
  ) {
    self.index = index
    self.cache = cache
    self.cloud = cloud
    self.inodes = inodes
    self.container = container
    self.deviceID = deviceID
    self.chunker = chunker
    self.log = logger
  }

  public func start() {
    task = Task.detached { [self] in await self.run() }
  }

  /// Stops after the upload in progress (queued work stays in the index for next time).
  public func stop() async {
    lock.withLock { stopped = true }
    await task?.value
  }

  /// Something was queued: look at the queue soon.
  public func kick() {
    lock.withLock { kicked = true }
  }

  private func takeKick() -> (kicked: Bool, stopped: Bool) {
    lock.withLock {
      defer { kicked = false }
      return (kicked, stopped)
    }
  }

  func run() async {
    var idleSince = Clock.monotonicNs()
    while true {
      let (_, stop) = takeKick()
      if stop { return }
      if let pause = pauseLeftNs() {
        try? await Task.sleep(nanoseconds: min(pause, 100_000_000))
        continue
      }
      var didWork = false
      do {
        let due = try index.dueQueue(now: self.index.clock.nowNs(), limit: Self.pageLimit)
        if !due.isEmpty {
          didWork = true
          let (stopped, processed) = await drain(due)
          if stopped { return }
          // A full page: more is due at once, read it without a pause.
          if due.count == Self.pageLimit && processed == due.count {
            idleSince = Clock.monotonicNs()
            continue
          }
        }
      } catch {
        log.error("upload queue: \(error)")
      }
      if didWork { idleSince = Clock.monotonicNs() }
      // Sleep in short steps so a kick, a due entry or stop is noticed quickly.
      let nextDue = (try? index.nextDueNs()) ?? nil
      var waitedNs: UInt64 = 0
      let quiet = Clock.monotonicNs() - idleSince > 5_000_000_000
      while true {
        let step: UInt64 = quiet ? 100_000_000 : 20_000_000
        try? await Task.sleep(nanoseconds: step)
        waitedNs += step
        let wake = lock.withLock { kicked || stopped }
        if wake { break }
        if let nextDue, self.index.clock.nowNs() >= nextDue { break }
        if waitedNs >= 1_000_000_000 { break }
      }
    }
  }

  /// Processes a page of due entries: the content of up to `parallelUploads` uploads is
  /// prepared concurrently, ahead of the commits, which happen in queue order. Consecutive
  /// prepared versions are committed together (`commitTogether`), and consecutive plain deletes
  /// are sent together (`deleteTogether`); any other entry (a delete with rules of its own, a
  /// move waiting for its content, an entry whose preparation is still running) sends the ones
  /// gathered before it first. Returns whether the worker was stopped meanwhile, and how many
  /// entries were processed.
  func drain(_ due: [QueueEntry]) async -> (stopped: Bool, processed: Int) {
    var preparing: [Int: Task<PreparedUpload?, Error>] = [:]
    let prepared = PreparedSet()
    var launched = 0
    var gathered: [GatheredUpload] = []
    var gatheredBytes = 0
    var deletes: [GatheredDelete] = []
    defer { for task in preparing.values { task.cancel() } }
    /// Whether the worker was stopped or paused (a record failed): the preparations in flight
    /// are then cancelled and awaited, and the rest of the page waits.
    func interrupted() async -> Bool {
      guard takeKick().stopped || pauseLeftNs() != nil else { return false }
      for t in preparing.values {
        t.cancel()
        _ = try? await t.value
      }
      return true
    }
    do {
      // A commit may reach the cloud and a power loss take its record from the index: what may
      // be sent is marked durably first, so a later delete of such an item asks the cloud.
      try index.markCommitsSent(items: due.compactMap(\.item))
    } catch {
      log.error("upload queue: cannot mark the batch as sent (\(error)); uploads pause")
      recorded(false)
      return (false, 0)
    }
    // The page's snapshots in one read; an item missing here (or when the read fails) takes its
    // own when its preparation starts.
    let snapshots = (try? index.uploadSnapshots(due.compactMap(\.item))) ?? [:]
    for i in due.indices {
      while launched < due.count && launched < i + max(1, parallelUploads) {
        if let inode = due[launched].item {
          let n = launched
          let snapshot = snapshots[inode]
          preparing[launched] = Task { [self] in
            defer { prepared.insert(n) }
            return try await self.prepare(inode, snapshot: snapshot)
          }
        }
        launched += 1
      }
      if await interrupted() { return (lock.withLock { stopped }, i) }
      let task = preparing.removeValue(forKey: i)
      if let delete = Self.plainDelete(due[i]) {
        await commitTogether(&gathered)
        deletes.append(GatheredDelete(entry: due[i], delete: delete))
        continue
      }
      // The deletes gathered before this entry go first; when their record failed, the worker
      // pauses and this entry waits with the rest of the page.
      await deleteTogether(&deletes)
      if await interrupted() { return (lock.withLock { stopped }, i) }
      if let inode = due[i].item, let task {
        // A big upload still being sent: what was gathered before it need not wait for it.
        if !gathered.isEmpty, !(await prepared.waitFor(i, upTo: .milliseconds(50), on: waitClock)) {
          await commitTogether(&gathered)
        }
        if let ready = await gatherable(due[i], inode, task) {
          // What is gathered stays within a few requests' worth of JSON (`commitTogether` cuts
          // it into requests within the server's body limit).
          if !gathered.isEmpty, gatheredBytes + ready.bytes > 4 * batchBytes { await commitTogether(&gathered) }
          if gathered.isEmpty { gatheredBytes = 0 }
          gathered.append(ready)
          gatheredBytes += ready.bytes
          if gathered.count >= Self.pageLimit { await commitTogether(&gathered) }
          continue
        }
      }
      await commitTogether(&gathered)
      if await interrupted() { return (lock.withLock { stopped }, i) }
      await process(due[i], prepared: task)
    }
    await commitTogether(&gathered)
    await deleteTogether(&deletes)
    return (false, due.count)
  }

  /// A delete queued with the etag it is based on and no rule of its own to apply first (no
  /// conflict versions to keep): it can go in a batch.
  static func plainDelete(_ entry: QueueEntry) -> ItemDelete? {
    guard entry.item == nil, let itemID = entry.deleteItemID, let etag = entry.deleteEtag, !entry.deleteKeepsVersions
    else { return nil }
    return ItemDelete(itemID: itemID, ifMatch: etag)
  }

  /// A plain delete waiting to be sent with others.
  struct GatheredDelete {
    var entry: QueueEntry
    var delete: ItemDelete
  }

  /// Sends gathered deletes in queue order, at most `batchLimit` per request, and records each
  /// request's deletes in one index transaction. A refused delete goes the one way (`process`:
  /// an edit elsewhere brings the file back, a folder that is not empty waits or comes back),
  /// then the ones after it are sent again. Empties `gathered`.
  func deleteTogether(_ gathered: inout [GatheredDelete]) async {
    var pending = gathered[...]
    gathered = []
    while let first = pending.first {
      let next = pending.prefix(Self.batchLimit)
      if next.count == 1 {
        await process(first.entry, prepared: nil)
        pending = pending.dropFirst()
        continue
      }
      let results: ItemBatchResults
      do {
        results = try await cloud.deleteItems(container, next.map(\.delete), deviceID: deviceID)
      } catch CloudError.invalid, CloudError.notFound {
        // The request as a whole was refused (its body, or a container the cloud does not
        // know): one by one, each entry gets its own answer.
        for gatheredDelete in next { await process(gatheredDelete.entry, prepared: nil) }
        pending = pending.dropFirst(next.count)
        continue
      } catch {
        // Nothing is known to be done: each entry failed as its own delete would have.
        for gatheredDelete in next { failed(gatheredDelete.entry, error) }
        pending = pending.dropFirst(next.count)
        continue
      }
      let done = next.prefix(results.committed.count)
      do {
        if !done.isEmpty {
          try index.finishDeletes(
            zip(done, results.committed).map { ($0.entry.seq, $0.delete.itemID, $1.changeSeq) })
          recorded(true)
          log.debug("deleted \(done.count) items together")
        }
      } catch {
        // The deletes stay queued; sent again, they find their tombstones.
        log.error("upload queue: cannot record \(done.count) deletes: \(error)")
        recorded(false)
        return
      }
      pending = pending.dropFirst(done.count)
      if results.refused != nil, let refused = pending.popFirst() { await process(refused.entry, prepared: nil) }
    }
  }

  /// The most due entries read at once: a page is committed in several requests, so that the
  /// record of one overlaps the sending of the next.
  static let pageLimit = 1024

  /// The most versions committed in one request.
  static let batchLimit = 256

  /// Indices of a page's entries whose preparation has finished, and the one wait for such an
  /// entry at a time: `insert` resumes it at once, a timer after its time is up. Sendable:
  /// guarded by `lock`.
  final class PreparedSet: @unchecked Sendable {
    private let lock = NSLock()
    private var done = Set<Int>()
    /// The wait in progress: its entry, its continuation and its timer.
    private var waiting: (entry: Int, resume: CheckedContinuation<Void, Never>, timer: Task<Void, Never>?)?

    func insert(_ i: Int) {
      let woken = lock.withLock { () -> (CheckedContinuation<Void, Never>, Task<Void, Never>?)? in
        done.insert(i)
        guard let w = waiting, w.entry == i else { return nil }
        waiting = nil
        return (w.resume, w.timer)
      }
      woken?.1?.cancel()
      woken?.0.resume()
    }

    func contains(_ i: Int) -> Bool { lock.withLock { done.contains(i) } }

    /// Whether entry `i`'s preparation has finished, or does within `limit` on `clock`. One
    /// wait at a time (the page's loop is the only caller).
    func waitFor(_ i: Int, upTo limit: Duration, on clock: any _Concurrency.Clock<Duration>) async -> Bool {
      if contains(i) { return true }
      await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in
        let registered = lock.withLock {
          if done.contains(i) { return false }
          waiting = (i, c, nil)
          return true
        }
        guard registered else { return c.resume() }
        let timer = Task {
          do { try await clock.sleep(for: limit) } catch { return }
          self.timeOut(i)
        }
        let stillWaiting = lock.withLock {
          guard waiting?.entry == i else { return false }
          waiting?.timer = timer
          return true
        }
        if !stillWaiting { timer.cancel() }
      }
      return contains(i)
    }

    /// Ends the wait for `i` if it is still in progress.
    private func timeOut(_ i: Int) {
      let c = lock.withLock { () -> CheckedContinuation<Void, Never>? in
        guard let w = waiting, w.entry == i else { return nil }
        waiting = nil
        return w.resume
      }
      c?.resume()
    }
  }

  /// A prepared version that can be committed with others: a plain new version of the item as
  /// its snapshot was taken.
  struct GatheredUpload {
    var entry: QueueEntry
    var inode: Int64
    var prepared: PreparedUpload
    var version: CloudItem
    /// More than the version's JSON takes (`estimatedBytes`).
    var bytes: Int
  }

  /// The most JSON bytes of versions one batch request carries (estimated, `estimatedBytes`).
  public var batchBytes = 4 << 20

  /// An upper bound of the bytes a version takes in JSON: a fixed part, the name and symlink
  /// target (a control character is escaped in 6 bytes), each chunk reference (hash, length,
  /// punctuation), and each extended attribute (base64, whose "/" JSONEncoder escapes: at most
  /// 8 bytes for 3), conflict versions included.
  static func estimatedBytes(of item: CloudItem) -> Int {
    var bytes = 1024 + 6 * (item.name.utf8.count + (item.symlinkTarget?.utf8.count ?? 0))
    bytes += 128 * item.chunks.count
    for (name, value) in item.xattrs { bytes += 64 + 6 * name.utf8.count + (value.count + 2) / 3 * 8 }
    for v in item.conflicts ?? [] { bytes += 512 + 128 * v.chunks.count }
    return bytes
  }

  /// The entry's prepared version, if it can be committed in a batch; nil when it goes the one
  /// way: its preparation failed or found nothing, or it is a move waiting for its content.
  func gatherable(_ entry: QueueEntry, _ inode: Int64, _ task: Task<PreparedUpload?, Error>) async
    -> GatheredUpload?
  {
    guard let p = try? await task.value, !p.placeOnly else { return nil }
    let version = version(of: p)
    return GatheredUpload(
      entry: entry, inode: inode, prepared: p, version: version, bytes: Self.estimatedBytes(of: version))
  }

  /// Commits gathered versions in queue order, as many per request as the cloud stores (at
  /// most `batchLimit` versions, `batchBytes` of JSON): the stored ones are recorded in one
  /// index transaction, which runs while the next request is sent. A refused version goes the
  /// one way (`process`: a merge on a conflict, a step aside from a taken name, a backoff),
  /// then the ones after it are sent again. Empties `gathered`; returns with every record
  /// written.
  func commitTogether(_ gathered: inout [GatheredUpload]) async {
    var pending = gathered[...]
    gathered = []
    // The record of the batch before, written while this one is sent: the entries of two
    // batches are different items. Anything else that writes to the queue waits for it.
    var recording: Task<Bool, Never>?
    func previousRecordStood() async -> Bool {
      defer { recording = nil }
      return await recording?.value ?? true
    }
    // After a refusal the next requests start small and double: when refusals follow one
    // another (a lost reply made every etag stale, a parent that failed, the quota), each
    // entry costs a request or two, never a resend of all the ones after it.
    var size = Self.batchLimit
    while let first = pending.first {
      // An item that changed since its snapshot goes the one way, which takes a fresh one.
      var bytes = 0
      let next = pending.prefix(size).prefix { upload in
        defer { bytes += upload.bytes }
        return bytes == 0 || bytes + upload.bytes <= batchBytes
      }
      let now = (try? index.identities(next.map(\.inode))) ?? [:]
      let unchanged = next.prefix { now[$0.inode] == $0.prepared.snapshot.identity }
      size = min(Self.batchLimit, size * 2)
      if unchanged.count <= 1 {
        guard await previousRecordStood() else { return }
        await process(first.entry, prepared: Task { first.prepared })
        pending = pending.dropFirst()
        continue
      }
      let inodes = Set(unchanged.map(\.inode))
      lock.withLock { committing.formUnion(inodes) }
      noteSent(unchanged.map { ($0.entry.seq, $0.version) })
      let results: ItemBatchResults
      do {
        results = try await cloud.putItems(
          container, unchanged.map { ItemPut(item: $0.version, ifMatch: $0.prepared.snapshot.row.etag) })
      } catch CloudError.invalid {
        lock.withLock { committing.subtract(inodes) }
        // The request as a whole was refused (its body, its size): one by one, each entry gets
        // its own answer, and one that cannot be sent holds back no other.
        size = 1
        continue
      } catch {
        lock.withLock { committing.subtract(inodes) }
        guard await previousRecordStood() else { return }
        // Nothing is known to be stored: each entry failed as its own commit would have.
        for upload in unchanged { failed(upload.entry, error) }
        pending = pending.dropFirst(unchanged.count)
        continue
      }
      let stored = zip(unchanged, results.committed).map { upload, result in
        UploadRecord(
          seq: upload.entry.seq, inode: upload.inode, itemID: upload.prepared.snapshot.row.itemID,
          revision: upload.prepared.snapshot.row.revision, result: result)
      }
      // One record at a time, in order; a record that fails stops the batches (the versions
      // sent meanwhile are settled as lost replies: their entries stay queued).
      guard await previousRecordStood() else {
        lock.withLock { committing.subtract(inodes) }
        return
      }
      recording = Task { [self] in
        defer { lock.withLock { committing.subtract(inodes) } }
        do {
          try index.markUploaded(stored)
          self.recorded(true)
          log.debug("uploaded \(stored.count) items together")
          return true
        } catch {
          log.error("upload queue: cannot record \(stored.count) uploads: \(error)")
          self.recorded(false)
          return false
        }
      }
      pending = pending.dropFirst(stored.count)
      if results.refused != nil, let refused = pending.popFirst() {
        size = 1
        guard await previousRecordStood() else { return }
        await process(refused.entry, prepared: Task { refused.prepared })
      }
    }
    _ = await previousRecordStood()
  }

  func process(_ entry: QueueEntry, prepared: Task<PreparedUpload?, Error>?) async {
    do {
      if let inode = entry.item {
        var p = try await (prepared ?? Task { try await self.prepare(inode) }).value
        // Prepared ahead of its turn: if the item changed since (renamed over another, written,
        // deleted), that snapshot is no longer the state to commit. One fresh snapshot is; its
        // content's chunks are mostly in the cloud already.
        if prepared != nil, let snap = p?.snapshot,
          try index.identities([inode])[inode] != snap.identity
        {
          p = try await prepare(inode)
        }
        if let p {
          lock.withLock { _ = committing.insert(inode) }
          defer { lock.withLock { _ = committing.remove(inode) } }
          try await commit(entry, inode, p)
        } else {
          try index.markDone(seq: entry.seq)
        }
      } else if let itemID = entry.deleteItemID {
        var restoring: CloudItem? = nil
        var etag = entry.deleteEtag
        // The change sequence of the item's tombstone, once the cloud has one.
        var tombstone: Int64? = nil
        if etag == nil && entry.deleteMaybeInCloud {
          switch try await cloud.item(container, itemID: itemID) {
          case nil:
            // The cloud has not seen the item, but its first upload may still be on its way
            // (held back in the network): the delete is recorded as a tombstone, which that
            // upload cannot pass. If it arrived meanwhile, the next attempt finds it and deletes it.
            do {
              tombstone = try await cloud.deleteItem(container, itemID: itemID, ifMatch: nil, deviceID: deviceID)
                .changeSeq
            } catch CloudError.notFound {
              // A cloud that records no tombstone for an item it has not seen.
            } catch CloudError.conflict {
              throw CloudError.unavailable("the first upload of \(itemID) arrived while its delete was sent")
            }
          case let current? where !current.deleted:
            // An upload whose reply was lost did reach the cloud. Our own version goes; a version
            // another device wrote on top of it, or whose content another device wrote (a merge),
            // wins over this delete. So does any folder version that differs from this device's
            // own first commit of it only by a name another device's sync chose to settle a
            // collision (`settledNameOf`): no user's change (a folder has no content; the cloud
            // refuses the delete while anything is in it).
            let settledOwnFolder =
              current.kind == .directory && current.settledNameOf != nil
              && entry.unansweredPlaces.contains { $0.parentID == current.parentID && $0.mode == current.mode }
            if (current.deviceID == deviceID && current.contentAuthor == deviceID) || settledOwnFolder {
              etag = current.etag
            } else {
              log.info("delete of \(itemID) skipped: changed remotely (etag \(current.etag)); restoring it")
              restoring = current
            }
          case let deleted?:
            tombstone = deleted.changeSeq  // Already deleted.
          }
        }
        // A file with other devices' unresolved conflict versions: their edits are kept (the
        // newest becomes the content and the file comes back), as an edit elsewhere wins over
        // a delete here. Only the version this device deleted goes.
        /// Commits `kept` (the cloud's version `current` with this device's content gone and the
        /// newest of the other devices' versions current) in place of the delete.
        func keepOthersVersions(_ kept: CloudItem, of current: CloudItem) async throws -> CloudItem {
          do {
            let result = try await cloud.putItem(container, kept, ifMatch: current.etag)
            log.info("delete of \(itemID) kept the conflict versions of other devices; the newest is current")
            return result
          } catch CloudError.conflict(let newer) {
            log.info("delete of \(itemID) skipped: changed remotely (etag \(newer.etag)); restoring it")
            return newer
          }
        }
        if entry.deleteKeepsVersions, let etag, restoring == nil,
          let current = try await cloud.item(container, itemID: itemID), current.etag == etag,
          let kept = ConflictMerge.keepingOthersVersions(of: current, deletedBy: deviceID)
        {
          restoring = try await keepOthersVersions(kept, of: current)
        }
        // Still no etag: nothing of the item is live in the cloud (it was never sent, is
        // deleted already, or its tombstone was recorded above). A newer version of this
        // device's own (a commit whose answer was lost or held back in the network, which the
        // user deleted knowingly) does not stop the delete: it is sent again on that version,
        // at most a few times. Only if it is where and as the user saw the item, or where and as
        // it was in one of its commits with no answer (the user moved it since): a merge this
        // device committed may carry another device's rename or mode change, which wins over
        // the delete. Nor does a version that differs from the deleted one only by a name
        // another device's sync chose (`settledNameOf`): no user's change. As for any delete,
        // other devices' unresolved conflict versions of the file are kept.
        var newerVersionsPassed = 0
        while let ifMatch = etag, restoring == nil, tombstone == nil {
          do {
            tombstone = try await cloud.deleteItem(container, itemID: itemID, ifMatch: ifMatch, deviceID: deviceID)
              .changeSeq
            break
          } catch CloudError.notFound {
            // Already gone.
            break
          } catch CloudError.conflict(let current) {
            if current.deleted {
              tombstone = current.changeSeq
              break
            }
            let settledElsewhere = current.settledNameOf == ifMatch
            let ownAsSeen =
              current.deviceID == deviceID && current.contentAuthor == deviceID
              && (entry.deletedPlace?.matches(current) == true
                || entry.unansweredPlaces.contains { $0.matches(current) })
            if (settledElsewhere || ownAsSeen) && newerVersionsPassed < 3 {
              newerVersionsPassed += 1
              if settledElsewhere {
                log.info("delete of \(itemID) meets a name settled elsewhere (etag \(current.etag)); deleting that")
              }
              if let kept = ConflictMerge.keepingOthersVersions(of: current, deletedBy: deviceID) {
                restoring = try await keepOthersVersions(kept, of: current)
              } else {
                etag = current.etag
              }
              continue
            }
            // Changed elsewhere since we saw it: the edit wins over our delete (nothing is lost).
            // The cloud's version comes back here with the next pull.
            log.info("delete of \(itemID) skipped: changed remotely (etag \(current.etag)); restoring it")
            restoring = current
          } catch CloudError.notEmpty(let why, let blockingItemID) {
            // A folder with an item in it in the cloud: another device put it there (the folder
            // comes back), or this device's own entries have yet to take it out (they go first).
            // A cloud that does not name the item gets the folder back: nothing is lost.
            if let blockingItemID {
              let placedHere = try await cloud.item(container, itemID: blockingItemID)?.deviceID == deviceID
              if try index.hasQueuedEntry(
                takingOut: blockingItemID, of: itemID, placedHere: placedHere, besides: entry.seq)
              {
                throw CloudError.notEmpty(why, blockingItemID: blockingItemID)
              }
            }
            log.info("delete of folder \(itemID) skipped: \(why); restoring it")
            restoring = try await cloud.item(container, itemID: itemID)
            break
          }
        }
        try index.finishDelete(seq: entry.seq, itemID: itemID, tombstone: tombstone, restoring: restoring)
        if restoring != nil { onNeedsPull() }
      }
      recorded(true)
    } catch let e as Postpone {
      recorded((try? index.postpone(seq: entry.seq, byNs: e.ns)) != nil)
    } catch {
      failed(entry, error)
    }
  }

  /// Records a failed attempt of an entry (retried with backoff).
  func failed(_ entry: QueueEntry, _ error: Error) {
    let (message, code) = Self.describe(error)
    log.warning("upload of queue entry \(entry.seq) failed (attempt \(entry.attempts + 1)): \(message)")
    let current = try? index.markFailed(seq: entry.seq, error: message, errno: code, triedAsOf: entry.enqueuedNs)
    recorded(current != nil)
    switch error {
    case CloudError.cycle:
      // Another device's move crossed this one and the cloud took it first: this move loses.
      // Once the pull has brought the other move here, the folder goes back where the cloud
      // has it, and the entry uploads that. A move made here since is tried on its own.
      if let inode = entry.item, current == true {
        do {
          if let undone = try index.undoRefusedMove(seq: entry.seq, inode: inode) {
            log.info("move of \(inode) crossed another device's move and lost; it is undone here")
            onMerged([undone])
          }
        } catch {
          log.error("upload queue: cannot undo the move of \(inode): \(error)")
        }
      }
      onNeedsPull()
    case CloudError.badParent:
      // The item's new place went away in the cloud: the pull brings that here, and settles
      // this change.
      onNeedsPull()
    default: break
    }
  }

  struct Postpone: Error { var ns: Int64 }

  /// Notes whether an attempt's outcome reached the index; after one that did not, the worker
  /// pauses (see `unrecorded`).
  private func recorded(_ ok: Bool) {
    lock.withLock {
      if ok {
        unrecorded = 0
        return
      }
      unrecorded += 1
      let pause = min(UInt64(60_000_000_000), UInt64(1_000_000_000) << UInt64(min(unrecorded - 1, 6)))
      pausedUntilNs = Clock.monotonicNs() + pause
    }
    if !ok { log.error("the index cannot record upload results (is its disk full?); uploads pause") }
  }

  /// Nanoseconds left of a pause, or nil.
  private func pauseLeftNs() -> UInt64? {
    lock.withLock {
      let now = Clock.monotonicNs()
      return pausedUntilNs > now ? pausedUntilNs - now : nil
    }
  }

  static func describe(_ error: Error) -> (String, Int32) {
    switch error {
    case let e as CloudError: return (e.description, e.errno)
    case let e as UbiqError: return (e.description, e.errno)
    default: return ("\(error)", EIO)
    }
  }

  /// An item's state as of one moment, with its content already in the cloud's chunk store.
  struct PreparedUpload: Sendable {
    var snapshot: UploadSnapshot
    var chunks: [ChunkRef]
    var size: Int64
    /// Only the item's new place (parent and name) is committed, over the cloud's version: a
    /// writer holds unflushed bytes of the file, so its content cannot be read consistently yet.
    var placeOnly = false
  }

  /// Takes a snapshot of an item and sends the chunks of its content the cloud lacks. Nil if
  /// the item is gone.
  func prepare(_ inode: Int64, snapshot: UploadSnapshot? = nil) async throws -> PreparedUpload? {
    guard let snap = try snapshot ?? index.uploadSnapshot(inode) else { return nil }
    let row = snap.row
    var chunks: [ChunkRef] = []
    var size = row.size
    // A file renamed away from its cloud place while a new file there is being written: an
    // editor's save that keeps the old file as a backup and removes it once the new one is
    // written, which then takes its identity. Committed meanwhile, the backup's name would
    // reach the other devices, an edit made there would go into the backup, and its removal
    // would delete the edit with it.
    if let holder = try index.unsentFileAtTheCloudPlace(of: row), inodes.isBusy(holder) {
      throw Postpone(ns: 200_000_000)
    }
    lock.withLock { sending[inode] = UploadProgress(inode: inode, path: row.name, sentBytes: 0, totalBytes: row.size) }
    defer { lock.withLock { _ = sending.removeValue(forKey: inode) } }
    if row.kind == .file, row.content == .cached, inodes.dirtyHandleCount(inode) > 0, row.etag != nil,
      let base = row.baseItem, !base.deleted, base.itemID == row.itemID,
      base.parentID != snap.parentItemID || base.name != row.name
    {
      // The content waits for the writer's flush, the rename need not: the cloud gets the move
      // now, so the name it frees is free for other items (a log rotated while it is written).
      return PreparedUpload(snapshot: snap, chunks: base.chunks, size: base.size, placeOnly: true)
    }
    if row.kind == .file {
      let empty = row.content == .cached && row.size == 0 ? emptyContent(inode) : nil
      if empty == .heldByAWriter {
        // The writer's flush records what it wrote (it may have no cache file yet).
        throw Postpone(ns: 500_000_000)
      } else if empty == .withoutCacheFile {
        // No bytes that a power loss could take: the file is empty without a cache file.
        chunks = []
        if snap.contentUnsynced { try content.bytesDurable(inode, upTo: row.revision) }
      } else if empty == .emptyCacheFile && !snap.contentUnsynced {
        // Created and never written, or emptied durably: no bytes to read, send or sync.
        chunks = []
      } else if row.content == .cached {
        (chunks, size) = try await sendContent(inode)
        if size != row.size {
          // The cache file and the index disagree: either a flush landed after the snapshot
          // (the next attempt sees it), or bytes were written without being recorded. The cache
          // file is the content; the index follows it before anything is committed.
          try content.cacheFileDisagrees(inode, size: size)
          throw Postpone(ns: 50_000_000)
        }
        // The cache file was fdatasync'ed after this revision was recorded. A mark the snapshot
        // did not show is of a later revision: it stays.
        try cache.syncDirectory()
        if snap.contentUnsynced { try content.bytesDurable(inode, upTo: row.revision) }
      } else {
        chunks = row.chunkList
      }
    }
    return PreparedUpload(snapshot: snap, chunks: chunks, size: size)
  }

  /// The version a prepared upload commits.
  func version(of p: PreparedUpload) -> CloudItem {
    let snap = p.snapshot
    let row = snap.row
    var local: CloudItem
    if p.placeOnly, let base = row.baseItem {
      // The cloud's version under the new place.
      local = CloudItem(
        itemID: base.itemID, parentID: snap.parentItemID, name: row.name, kind: base.kind, mode: base.mode,
        size: base.size, mtimeNs: base.mtimeNs, symlinkTarget: base.symlinkTarget, xattrs: base.xattrs,
        chunks: base.chunks, deviceID: deviceID)
      local.conflicts = base.conflicts
    } else {
      local = CloudItem(
        itemID: row.itemID, parentID: snap.parentItemID, name: row.name, kind: row.kind, mode: row.mode,
        size: p.size, mtimeNs: row.mtimeNs, symlinkTarget: row.symlinkTarget, xattrs: snap.xattrs, chunks: p.chunks,
        deviceID: deviceID)
      local.conflicts = row.conflictList.isEmpty ? nil : row.conflictList
    }
    // Only a file has content (the cloud refuses any other item with some): a folder or a
    // symlink whose record came with a size, chunks or conflict versions goes back without.
    if local.kind != .file {
      local.chunks = []
      local.conflicts = nil
      if local.kind == .directory { local.size = 0 }
    }
    // Only a name this device's sync chose differs from the base: the version says so, so that
    // a delete based on the base still wins over it (`settledNameOf`). Any other difference
    // from the base (place, mode, a file's mtime, content, extended attributes, symlink target,
    // conflict versions) leaves it unset. A folder's mtime is no user's change here: it moves
    // with the folder's entries on each device, those other devices add included.
    if snap.automaticRename, let etag = row.etag, let base = row.baseItem, !base.deleted, base.etag == etag,
      base.itemID == local.itemID, base.parentID == local.parentID, base.kind == local.kind,
      base.mode == local.mode, local.kind == .directory || base.mtimeNs == local.mtimeNs, base.size == local.size,
      base.chunks == local.chunks, base.xattrs == local.xattrs, base.symlinkTarget == local.symlinkTarget,
      (base.conflicts ?? []) == (local.conflicts ?? [])
    {
      local.settledNameOf = etag
    }
    return local
  }

  /// What an empty row's content is on disk, seen with no writer holding unflushed bytes.
  enum EmptyContent {
    /// There is no cache file (an empty file never written).
    case withoutCacheFile
    /// The cache file is empty.
    case emptyCacheFile
    /// A handle holds writes not yet recorded (or created the file and has not flushed it).
    case heldByAWriter
  }

  /// What the content of `inode`, recorded as empty, is (nil: the cache file is not empty, or
  /// could not be looked at; the content path reads it then).
  func emptyContent(_ inode: Int64) -> EmptyContent? {
    guard let token = inodes.beginSnapshot(inode) else { return .heldByAWriter }
    defer { inodes.endSnapshot(inode) }
    var st = stat()
    let found: EmptyContent
    if stat(cache.path(inode), &st) == 0 {
      guard st.st_size == 0 else { return nil }
      found = .emptyCacheFile
    } else {
      guard errno == ENOENT else { return nil }
      found = .withoutCacheFile
    }
    return inodes.isSnapshotIntact(inode, token) ? found : .heldByAWriter
  }

  /// Notes the place, mode and extended attributes of every version about to be sent
  /// (`IndexStore.noteSent`), so that a later merge or delete knows such a version of this
  /// device's own in the cloud for what it is if the reply is lost: also one that changes only
  /// the content, which a delete after a chmod must still take for the version the user had. A
  /// note that cannot be written leaves only that knowledge out: the versions are sent anyway.
  func noteSent(_ versions: [(seq: Int64, version: CloudItem)]) {
    let places = versions.compactMap { seq, version -> (seq: Int64, place: ItemPlace)? in
      guard let parentID = version.parentID else { return nil }
      return (seq, ItemPlace(parentID: parentID, name: version.name, mode: version.mode, xattrs: version.xattrs))
    }
    do {
      try index.noteSent(places)
    } catch {
      log.warning("upload queue: cannot note the places of \(places.count) commits: \(error)")
    }
  }

  /// Commits a prepared item version (If-Match its etag), merging on conflict.
  func commit(_ entry: QueueEntry, _ inode: Int64, _ p: PreparedUpload) async throws {
    if waitsForReaders(inode) { throw Postpone(ns: 1_000_000_000) }
    let row = p.snapshot.row
    let chunks = p.chunks
    let local = version(of: p)
    // The local side of every commit below: a merge's place and mode from the cloud are not
    // this device's change.
    noteSent([(entry.seq, local)])
    var item = local
    var ifMatch = row.etag
    // The cloud's version that `ifMatch` names, as far as this device knows it.
    var inCloud = row.baseItem
    var merged = false
    // The committed version mixes both sides: bring the local row in line with it.
    func adopt(_ result: CloudItem, keepingPlace: Bool) throws {
      let applied = try inodes.withInodeLock(inode) {
        // Opened for writing while the merge was committed: the cache file holds bytes newer
        // than the merge and must stay.
        let applied = try index.adoptMerged(
          inode, result, localChunks: chunks, since: p.snapshot, keepingPlace: keepingPlace,
          keepingContent: inodes.isBusy(inode))
        if applied.outcome == .updated(contentChanged: true) { content.remoteVersionReplaced(inode) }
        return applied
      }
      onMerged([applied])
    }
    for _ in 0..<8 {
      do {
        let result = try await cloud.putItem(container, item, ifMatch: ifMatch)
        if merged {
          await learnWhereTheNameHolderWent(result)
          try adopt(result, keepingPlace: false)
        }
        // A merge that took nothing from the cloud's version (it met this device's own earlier
        // commit, whose reply was lost) carries no change the user has not seen.
        try index.markUploaded(
          seq: entry.seq, inode: inode, itemID: row.itemID, revision: row.revision, result: result,
          adopted: merged && !ConflictMerge.isTheLocalSide(result, local), placeOnly: p.placeOnly)
        log.debug("\(p.placeOnly ? "moved" : "uploaded") \(row.name) etag \(result.etag)")
        return
      } catch CloudError.nameTaken(let why) {
        // Another item holds the name in the cloud. If that item is itself on its way elsewhere
        // (two names swapped, folders exchanged, `mv a t; mv b a; mv t b`), waiting cannot help:
        // each entry would wait for the other forever. This one steps aside under a temporary
        // name in its new folder, the other commits, and this entry's next attempt takes the
        // name. If the cloud has it aside already, the name is really taken: retry with
        // backoff. (A version that stepped aside and was moved elsewhere since, into the
        // folder that holds the name, say, steps aside again: the holder may be waiting for
        // it to leave.)
        let aside = ItemName.aside(item.name, itemID: item.itemID)
        guard inCloud?.name != aside || inCloud?.parentID != item.parentID else {
          throw CloudError.nameTaken(why)
        }
        var parked = item
        parked.name = aside
        log.info("\(row.name): name taken in the cloud (\(why)); stepping aside as \(aside)")
        let result = try await cloud.putItem(container, parked, ifMatch: ifMatch)
        // A merged version is now the item's content: the row takes it, keeping its own name.
        if merged { try adopt(result, keepingPlace: true) }
        // The cloud now has an earlier state of this item: the entry stays queued.
        try index.markUploaded(
          seq: entry.seq, inode: inode, itemID: row.itemID, revision: row.revision - 1, result: result,
          adopted: merged, placeOnly: p.placeOnly)
        throw Postpone(ns: 50_000_000)
      } catch CloudError.conflict(let stale) {
        // A merge needs the local content: the move waits with it for the writer's flush.
        if p.placeOnly { throw Postpone(ns: 500_000_000) }
        let current: CloudItem
        do {
          current = try ConflictMerge.mergeable(stale, placeOf: local)
        } catch {
          throw CloudError.invalid("the cloud's version of \(row.name) breaks a rule of its tree: \(error)")
        }
        // Deleted elsewhere while the only change here is a name this device's sync chose: the
        // delete wins. A file open here waits for its close (what is written meanwhile wins).
        if current.deleted {
          // Under the inode's lock, as a remote change is applied: no open or write comes between.
          let verdict = try inodes.withInodeLock(inode) { () throws -> IndexStore.DeleteVerdict in
            inodes.isBusy(inode) ? .wait : try index.yieldToDelete(seq: entry.seq, inode: inode, tombstone: current)
          }
          switch verdict {
          case .deleted(let gone):
            log.info("\(row.name): deleted on another device; its automatic rename here gives way")
            onMerged([gone])
            return
          case .wait:
            // Open for writing, or a folder whose items' tombstones the pull has not brought yet.
            onNeedsPull()
            throw Postpone(ns: 500_000_000)
          case .changedHere:
            break
          }
        }
        log.info("conflict on \(row.name): local based on \(ifMatch ?? "nothing"), cloud has \(current.etag); merging")
        // No base: an earlier commit of the item reached the cloud and its reply was lost, and
        // the cloud's version is built on it. Every commit of the item was sent after its entry
        // was marked with the revision it had then: while this version is still that revision,
        // every commit sent was this version, so it is the base, and whatever the cloud's
        // version changed wins. Otherwise the base is unknown and the local side is taken.
        let base =
          try row.baseItem
          ?? (row.etag == nil && index.revisionMarkedSent(seq: entry.seq) == row.revision ? local : nil)
        item = ConflictMerge.merge(
          local: local, base: base, server: current, deviceID: deviceID,
          newVersionID: index.identifiers.next(), unanswered: entry.unansweredPlaces)
        // The other side's content would replace the cache file under a handle open for
        // writing, and what is written through it next would be lost: merge after it closes.
        if item.chunks != chunks && inodes.isBusy(inode) { throw Postpone(ns: 500_000_000) }
        // A smaller content would cut short the processes reading the file here (the kernel
        // keeps one size per inode): merge after the last of them closes. The pull holds the
        // cloud's version meanwhile (`ChangePuller.shrinksWhatIsRead`).
        if item.kind == .file && item.size < p.size && inodes.isOpen(inode) {
          onNeedsPull()
          throw Postpone(ns: 500_000_000)
        }
        ifMatch = current.etag
        inCloud = current
        merged = true
      }
    }
    throw CloudError.unavailable("\(row.name) keeps changing in the cloud; will retry")
  }

  /// A merged version can take a name that an item here still holds: the cloud gave it the
  /// name after that item left it there (names swapped elsewhere). The item's newer version
  /// is fetched and held, so that adopting the merge moves it where the cloud has it
  /// (`RemotePlanner.settleName`) instead of settling a new name for either. Without an
  /// answer the holder steps aside as "name 2" until its own merge takes the cloud's place.
  func learnWhereTheNameHolderWent(_ merged: CloudItem) async {
    do {
      guard let holder = try index.staleNameHolder(of: merged),
        let current = try await cloud.item(container, itemID: holder.itemID), current.changeSeq > holder.changeSeq
      else { return }
      try index.holdRemote(current)
    } catch {
      log.info("\(merged.name): where the item that held its name here went is not known (\(error))")
    }
  }

  /// Chunks the cache file and sends the chunks the cloud lacks. Throws `Postpone` if the file is
  /// being written (its snapshot would not be consistent).
  func sendContent(_ inode: Int64) async throws -> ([ChunkRef], Int64) {
    guard let token = inodes.beginSnapshot(inode) else { throw Postpone(ns: 500_000_000) }
    defer { inodes.endSnapshot(inode) }
    let fd = try cache.open(inode, create: false)
    defer { close(fd) }
    // Pass 1: boundaries and hashes.
    var refs: [ChunkRef] = []
    var offsets: [Int64] = []
    var offset: Int64 = 0
    try chunker.chunkFile(fd: fd) { ref, _ in
      refs.append(ref)
      offsets.append(offset)
      offset += ref.length
    }
    guard inodes.isSnapshotIntact(inode, token) else { throw Postpone(ns: 200_000_000) }
    // What is uploaded is durable here first: `uploaded` is never shown for bytes a power loss
    // could take from the cache file.
    if fdatasync(fd) != 0 { throw UbiqError.posix(errno, "fdatasync of the cache file") }
    // Pass 2: send what is missing, re-reading each chunk and checking it still hashes the same.
    let missing = try await cloud.missingChunks(refs.map(\.hash))
    // Progress counts only what has to travel.
    let toSend = Set(refs.filter { missing.contains($0.hash) }.map(\.hash))
    let travelling = refs.filter { toSend.contains($0.hash) }.reduce(into: [String: Int64]()) {
      $0[$1.hash] = $1.length
    }
    .values.reduce(0, +)
    lock.withLock { sending[inode]?.totalBytes = travelling }
    var sent = Set<String>()
    for (i, ref) in refs.enumerated() where missing.contains(ref.hash) && !sent.contains(ref.hash) {
      var data = Data(count: Int(ref.length))
      let ok = data.withUnsafeMutableBytes { raw -> Bool in
        var done = 0
        while done < raw.count {
          let n = pread(fd, raw.baseAddress! + done, raw.count - done, off_t(offsets[i]) + off_t(done))
          if n < 0 && errno == EINTR { continue }
          if n <= 0 { return false }
          done += n
        }
        return true
      }
      guard ok, Chunker.sha256Hex(data) == ref.hash, inodes.isSnapshotIntact(inode, token) else {
        throw Postpone(ns: 200_000_000)
      }
      await limiter?.acquire(data.count)
      try await cloud.putChunk(hash: ref.hash, data: data)
      sent.insert(ref.hash)
      lock.withLock {
        bytesSent += ref.length
        sending[inode]?.sentBytes += ref.length
      }
    }
    guard inodes.isSnapshotIntact(inode, token) else { throw Postpone(ns: 200_000_000) }
    return (refs, offset)
  }
}

/// The upload in flight: which item and how far along.
public struct UploadProgress: Codable, Sendable, Equatable {
  public var inode: Int64
  public var path: String
  public var sentBytes: Int64
  public var totalBytes: Int64
}
