import Foundation
import Logging
import UbiqCloudAPI
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// Applies the cloud's change feed to the index: at mount (before the kernel sees anything) and
/// then every `interval`. Items with local changes, or open for writing, are left alone.
/// Sendable: `task`, `stopped`, `waiting`, `wakeRequested` and the read-from-start counters are
/// guarded by `lock`; the callbacks are set before `start`.
public final class ChangePuller: @unchecked Sendable {
  let index: IndexStore
  let cache: ContentCache
  let cloud: CloudService
  let container: ContainerID
  let inodes: InodeTable
  let uid: UInt32
  let gid: UInt32
  let log: Logger
  /// Called with what changed, to drop cache files and invalidate kernel caches.
  public var onApplied: ([RemoteApplyResult]) -> Void = { _ in }
  /// Called when a pull succeeds after failures (the cloud came back).
  public var onRecovered: () -> Void = {}
  /// Running downloads: a remote version replacing a file's content detaches its download.
  public var downloader: Downloader?
  /// Whether the uploader has a version of the item in a commit whose answer it has not
  /// recorded yet (`UploadWorker.isCommitting`).
  public var commitInFlight: (Int64) -> Bool = { _ in false }
  /// The longest a page of the feed waits for the answers of such commits.
  public var echoWaitNs: UInt64 = 1_000_000_000
  /// The content transitions, over this puller's index, cache, inode table and downloader.
  var content: FileContent {
    FileContent(index: index, cache: cache, inodes: inodes, downloads: downloader, logger: log)
  }
  private var task: Task<Void, Never>?
  private let lock = NSLock()
  private var stopped = false
  /// The wait for the next change in progress, cancelled by `wake`.
  private var waiting: Task<Bool, Error>?
  private var wakeRequested = false
  /// Files whose record waits for their readers here to close (`shrinksWhatIsRead`).
  private var heldForReaders: Set<Int64> = []
  /// Requests to read the change feed from its start (`pullEverythingAgain`); the latest of
  /// them whose read has begun (a pull stored the token of its first page: the rest of the
  /// feed follows from there, by that pull or the next ones); and the latest whose read has
  /// reached the end of the feed (counted in the index, `feedReadsFromStart`).
  private var readFromStartRequests = 0
  private var readFromStartBegun = 0
  private var readFromStartEnded = 0

  public init(
    index: IndexStore, cache: ContentCache, cloud: CloudService, container: ContainerID, inodes: InodeTable,
    uid: UInt32, gid: UInt32, logger: Logger
  ) {
    self.index = index
    self.cache = cache
    self.cloud = cloud
    self.container = container
    self.inodes = inodes
    self.uid = uid
    self.gid = gid
    self.log = logger
  }

  /// Fetches and applies every change since the stored token, page by page; with `budget`,
  /// stops after the first page that ends past it, leaving the rest of the feed, and the held
  /// records (which wait for the whole feed), to the next pull: the token stays in front of
  /// every record not applied yet. Each page's changes go to `onApplied` as the page is done
  /// and are not kept: a catch-up of a million records holds one page of results at a time.
  /// Returns how many changes were applied.
  @discardableResult
  public func pullOnce(budget: Duration? = nil) async throws -> Int {
    let started = ContinuousClock.now
    var token = try index.changeToken()
    let readFromStart = lock.withLock { readFromStartRequests > readFromStartBegun ? readFromStartRequests : nil }
    if readFromStart != nil {
      log.info("reading the change feed again from its start (token was \(token))")
      token = 0
    }
    func tokenStored() {
      if let readFromStart { lock.withLock { readFromStartBegun = max(readFromStartBegun, readFromStart) } }
    }
    var applied = 0
    var deferred: [CloudItem] = []
    var stoppedMidFeed = false
    while true {
      var all: [RemoteApplyResult] = []
      defer { applied += report(all) }
      let since = token
      let batch = try await cloud.changes(container, since: since, limit: 500)
      // Records that are no item version are refused one by one; the rest of the page applies.
      for record in batch.unreadable {
        log.warning("refused a record of the change feed: \(record.error)")
        try index.refuseRemote(
          RefusedRecord(itemID: record.itemID ?? "(no item id)", name: "", reason: "unreadable: \(record.error)"),
          at: record.changeSeq ?? batch.token)
      }
      let known = try await localEtags(of: batch.items)
      // Records of items that are not here (a new device's catch-up is all of them) are applied
      // together, a run at a time, in feed order; any other record alone, under its inode's lock.
      var new: [CloudItem] = []
      var inPage = Set<String>()
      func applyNewRun() throws {
        for (n, r) in zip(new, try applyNew(new, collisions: .deferUnchangedHolders)) {
          if r.outcome == .deferred { deferred.append(n) } else { all.append(r) }
        }
        new = []
      }
      for item in batch.items {
        // A record at or before the token the page was asked from was applied or held when it
        // first came (a retried request answered from earlier, a late copy of an old page). For
        // an item that is not here it is stale: the item's tombstone may be behind the token and
        // never come again, so it must not make the item again.
        let stale = try item.changeSeq <= since && known[item.itemID] == nil && index.etag(itemID: item.itemID) == nil
        let isNew = !stale && known[item.itemID] == nil && !inPage.contains(item.itemID)
        inPage.insert(item.itemID)
        if isNew {
          new.append(item)
          continue
        }
        try applyNewRun()
        if stale { continue }
        let r = try apply(item, collisions: .deferUnchangedHolders, known: known[item.itemID])
        if r.outcome == .deferred { deferred.append(item) } else { all.append(r) }
      }
      try applyNewRun()
      // Parents may come later in the feed than their children (moves), and the item holding a
      // name may be moving away later in the feed (exchanges): retry the deferred while that
      // makes progress. Then items that hold each other's names (a swap) step aside for each
      // other, and any other collision is settled by the naming rule.
      var movable = Set<String>()
      var movableRecords: [CloudItem] = []
      for final in [false, true] {
        if final {
          movable = try Self.movable(deferred, index: index, isBusy: inodes.isBusy)
          movableRecords = deferred.filter { movable.contains($0.itemID) }
        }
        let policy: IndexStore.NameCollisionPolicy = final ? .moveAsideHolders(movable) : .deferUnchangedHolders
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
      // An item that stepped aside but whose own record did not apply (it was opened for
      // writing meanwhile) gets a place back now, not when that record is applied.
      all += try index.unpark(movableRecords)
      token = batch.token
      if !batch.hasMore {
        // Records whose folder is not here (not in the cloud either, or a change of this device
        // keeps it away) are held, not left in front of the token: the feed moves on, every later
        // pull retries them, and `ubiqfs status` counts them.
        for item in deferred { try index.holdRemote(item) }
        try index.setChangeToken(token)
        tokenStored()
        if let ended = lock.withLock({ readFromStartBegun > readFromStartEnded ? readFromStartBegun : nil }) {
          try index.noteFeedReadFromStart()
          lock.withLock { readFromStartEnded = ended }
          log.info("read the change feed again up to \(token)")
        }
        break
      }
      // Mid-feed, the token stays before the first record still waiting for its parent, which
      // may come on a later page.
      let safe = deferred.map { $0.changeSeq - 1 }.min().map { min($0, token) } ?? token
      try index.setChangeToken(safe)
      tokenStored()
      if let budget, ContinuousClock.now - started >= budget {
        log.info("pulled changes up to \(safe) of the cloud's feed; the rest comes with the next pull")
        stoppedMidFeed = true
        break
      }
    }
    if stoppedMidFeed { return applied }
    // Held records, after the whole feed (a record later in it may free the name a held record
    // takes): those a newer record superseded are gone, and a record whose folder this pull
    // brought, or whose item's local changes are done, applies now.
    applied += report(try applyHeld())
    if !deferred.isEmpty { log.info("\(deferred.count) remote items wait for their parent") }
    return applied
  }

  /// The items among `deferred` records that may step aside under a temporary name for another
  /// record of the pull: those whose own record is applied in the same pass, so that the name
  /// is temporary. That is a record whose folder is here, or is made by another such record
  /// (a file moving into a new folder that takes the file's old name: `mkdir b; mv c b/c;
  /// mv b c`), of an item not open for writing here (`isBusy`: its record waits for the
  /// handle).
  static func movable(_ deferred: [CloudItem], index: IndexStore, isBusy: (Int64) -> Bool) throws -> Set<String> {
    var movable = Set<String>()
    var rest = deferred
    var grew = true
    while grew {
      grew = false
      rest = try rest.filter { item in
        guard let parent = item.parentID else { return false }
        if let inode = try index.etag(itemID: item.itemID)?.inode, isBusy(inode) { return false }
        guard try movable.contains(parent) || index.item(itemID: parent) != nil else { return true }
        movable.insert(item.itemID)
        grew = true
        return false
      }
    }
    return movable
  }

  /// Hands the results that changed something here to `onApplied`; returns how many there were.
  private func report(_ results: [RemoteApplyResult]) -> Int {
    let effective = results.filter {
      $0.outcome != .unchanged && $0.outcome != .locallyModified && $0.outcome != .refused
    }
    if !effective.isEmpty { onApplied(effective) }
    return effective.count
  }

  /// The local inode and etag of each of `items` that is here, read once the uploader has
  /// recorded the answers of its commits in flight for any of them (at most `echoWaitNs`). The
  /// cloud's push about a commit can come before the commit's answer: a record of this device's
  /// own version found before its answer is recorded is not recognized as an echo, and is held
  /// back and released again (two index writes) instead.
  func localEtags(of items: [CloudItem]) async throws -> [String: (inode: Int64, etag: String?)] {
    var known = try index.etags(itemIDs: items.map(\.itemID))
    var waitedNs: UInt64 = 0
    let stepNs: UInt64 = 5_000_000
    while waitedNs < echoWaitNs,
      items.contains(where: { item in
        known[item.itemID].map { $0.etag != item.etag && commitInFlight($0.inode) } ?? false
      })
    {
      try await Task.sleep(nanoseconds: stepNs)
      waitedNs += stepNs
      known = try index.etags(itemIDs: items.map(\.itemID))
    }
    return known
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

  /// Applies records of items that are not here, in one index transaction. If that fails, one
  /// by one, so that the records before a bad one are applied and its error is its own.
  func applyNew(_ items: [CloudItem], collisions: IndexStore.NameCollisionPolicy) throws -> [RemoteApplyResult] {
    if items.count > 1 {
      do {
        return try index.applyRemote(items, uid: uid, gid: gid, collisions: collisions, holding: true)
      } catch {
        log.warning("applying \(items.count) new records together failed (\(error)); applying them one by one")
      }
    }
    var results: [RemoteApplyResult] = []
    do {
      for item in items { results.append(try apply(item, collisions: collisions)) }
    } catch {
      _ = report(results)  // applied before the failing record: the kernel must still hear of them
      throw error
    }
    return results
  }

  /// Applies one record. `holding`: a record the item's local changes block is kept (see
  /// `IndexStore.holdRemote`) and applied by a later pull, once they are done. `known`: the
  /// item's inode and etag here, read with the rest of its page: enough to recognize the echo
  /// of an upload (an etag only moves forward); anything else is looked up again.
  func apply(
    _ item: CloudItem, collisions: IndexStore.NameCollisionPolicy = .settle, holding: Bool = true,
    known: (inode: Int64, etag: String?)? = nil
  ) throws -> RemoteApplyResult {
    if let known, !item.deleted, known.etag == item.etag {
      return RemoteApplyResult(outcome: .unchanged, inode: known.inode)
    }
    guard let (inode, etag) = try index.etag(itemID: item.itemID) else {
      return try index.applyRemote(item, uid: uid, gid: gid, collisions: collisions, holding: holding)
    }
    // The echo of our own upload: nothing to write (applyRemote would say the same, in a write
    // transaction).
    if !item.deleted && etag == item.etag { return RemoteApplyResult(outcome: .unchanged, inode: inode) }
    return try inodes.withInodeLock(inode) {
      if inodes.isBusy(inode) {
        if holding { try index.holdRemote(item) }
        return RemoteApplyResult(outcome: .locallyModified, inode: inode)
      }
      if try shrinksWhatIsRead(item, inode) {
        try holdForReaders(item, inode, holding: holding)
        return RemoteApplyResult(outcome: .locallyModified, inode: inode)
      }
      lock.withLock { _ = heldForReaders.remove(inode) }
      let result = try index.applyRemote(item, uid: uid, gid: gid, collisions: collisions, holding: holding)
      // The old bytes go now, under the inode lock: an open after this point downloads the new
      // version, and its download must not be removed by a late clean-up. Open readers keep the
      // old bytes through their descriptors.
      if result.outcome == .updated(contentChanged: true) { content.remoteVersionReplaced(inode) }
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

  /// Whether `item`, a newer version of the file at `inode`, is smaller than the version here
  /// while that is open. Readers go on reading the version they opened, through their
  /// descriptors, but the kernel holds one size per inode: a smaller one would end their reads
  /// early, with no error. Such a record waits until the last of them closes (`readersClosed`);
  /// one of the same size or larger applies at once, and an older one is dropped as any is.
  /// Under the inode lock.
  func shrinksWhatIsRead(_ item: CloudItem, _ inode: Int64) throws -> Bool {
    guard !item.deleted, item.kind == .file, inodes.isOpen(inode), let row = try index.item(inode) else {
      return false
    }
    return row.kind == .file && item.size < row.size && item.changeSeq > (row.etag.flatMap { Int64($0) } ?? 0)
  }

  /// Holds `item` until the readers of the file at `inode` close (`shrinksWhatIsRead`). Under
  /// the inode lock; the last close may come just before the file is noted (`release` does not
  /// take that lock), so it is looked at again after.
  func holdForReaders(_ item: CloudItem, _ inode: Int64, holding: Bool) throws {
    if holding { try index.holdRemote(item) }
    lock.withLock { _ = heldForReaders.insert(inode) }
    if !inodes.isOpen(inode) { readersClosed(inode) }
  }

  /// Whether a newer version of the file at `inode` waits for its readers here to close.
  public func waitsForReaders(_ inode: Int64) -> Bool { lock.withLock { heldForReaders.contains(inode) } }

  /// The last handle of the file at `inode` closed: a record that waited for its readers is
  /// applied now.
  public func readersClosed(_ inode: Int64) {
    if lock.withLock({ heldForReaders.remove(inode) != nil }) { wake() }
  }

  /// Pulls now instead of waiting for the cloud's next change: something was held back or
  /// refused that the next pull settles.
  public func wake() {
    lock.withLock {
      wakeRequested = true
      waiting?.cancel()
    }
  }

  /// Reads the whole change feed again, from its start, at the next pull, which starts now: a
  /// repair of `ubiqfs check` for records this device missed. Each record goes through the
  /// rules of any pull; one this device has applied, or a newer version of, changes nothing.
  public func pullEverythingAgain() {
    lock.withLock { readFromStartRequests += 1 }
    wake()
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
