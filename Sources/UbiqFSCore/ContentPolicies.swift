import Foundation
import UbiqCore
import UbiqIndex
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

extension FilesystemCore {
  /// Drops replaced or deleted local content and tells the kernel what changed remotely.
  public func remoteChangesApplied(_ results: [RemoteApplyResult]) {
    for r in results {
      guard let inode = r.inode else { continue }
      switch r.outcome {
      case .unchanged, .deferred, .locallyModified, .refused:
        // Nothing the kernel shows changed (often the echo of our own upload): keep its caches.
        continue
      case .deleted:
        // As after a local unlink: an open file lives on until its last close.
        if let row = r.removed { dispose(row) }
      default:
        // Replaced content was already dropped under the inode lock by whoever applied the
        // change (ChangePuller, UploadWorker); here only the kernel learns of it.
        break
      }
      invalidate(inode, r.staleEntries)
      // The folders whose entries changed have new times (`IndexStore.applyRemote`).
      for folder in r.foldersWithChangedEntries { invalidateAttributes(folder) }
    }
  }

  /// Tells the kernel that attributes it may have cached changed outside its view.
  public func attributesChanged(_ inode: Int64) { invalidateAttributes(inode) }

  /// Evicts a file's local content if it is uploaded, not pinned and not open; EBUSY otherwise.
  public func evict(_ inode: Int64) throws { try evict(try requireRow(inode)) }

  func evict(_ row: ItemRow) throws {
    // Same bytes, different st_blocks: cached pages stay valid.
    if try content.evict(row) { invalidateAttributes(row.id!) }
  }

  /// Downloads a file's content into the cache (a no-op if it is there).
  public func download(_ inode: Int64) throws {
    try withContentCached(inode, interruption: nil) { _ in }
  }

  /// Runs `change` (a move or an exclusion), first downloading the bytes of files it would make
  /// local-only while they are only in the cloud (`ContentOnlyInTheCloud`): their cloud items
  /// leave with the change. A download that fails fails the change (EIO), which then changes
  /// nothing.
  func keepingContentLocal<T>(_ change: () throws -> T) throws -> T {
    for _ in 0..<3 {
      do {
        return try change()
      } catch let refused as ContentOnlyInTheCloud {
        for inode in refused.inodes { try download(inode) }
      }
    }
    throw UbiqError.busy("files to keep on this device keep being evicted; try again")
  }

  /// Evicts least-recently-used clean content until the cache fits its budget and the disk keeps
  /// its minimum free space. Never evicts dirty, open or pinned files. Returns bytes freed.
  @discardableResult
  public func enforceCacheBudget() -> Int64 {
    // A space reserve given back on a full disk is made again once there is room.
    index.reserve?.keep()
    do {
      try removeForgottenContent()
    } catch {
      log.warning("removing the cache files of deleted items failed: \(error)")
    }
    try? index.recordUse(handles.takeUses())
    var freed: Int64 = 0
    func overBudget() -> Bool {
      var sv = statvfs()
      let free = statvfs(cache.directory, &sv) == 0 ? Int64(sv.f_bavail) * Int64(sv.f_frsize) : Int64.max
      let used = (try? index.cachedBytes()) ?? 0
      return (options.cacheBudgetBytes > 0 && used > options.cacheBudgetBytes)
        || (free < options.minFreeBytes && used > 0)
    }
    guard overBudget(), let candidates = try? index.evictionCandidates(limit: 500) else { return 0 }
    for row in candidates {
      if inodes.isOpen(row.id!) || inodes.isBusy(row.id!) { continue }
      if (try? evict(row)) != nil {
        freed += row.size
        log.debug("cache budget: evicted \(row.name) (\(row.size) bytes)")
      }
      if !overBudget() { break }
    }
    return freed
  }

  /// Records writes a crash left in cache files but not in the index
  /// (`FileContent.recoverAfterUncleanStop`). Runs before the first pull and before the kernel
  /// sees the mount. Returns how many files were recovered.
  @discardableResult
  public func recoverUnrecordedWrites() throws -> Int { try content.recoverAfterUncleanStop() }

  /// Records and queues the writes of handles closed while the index could not be written
  /// (`FileContent.recordWritesOfClosedHandles`); the daemon calls it every few seconds.
  public func recordWritesOfClosedHandles() {
    do {
      if try content.recordWritesOfClosedHandles() > 0 { onQueued() }
    } catch {
      log.warning("writes of closed handles could not be recorded yet: \(error)")
    }
  }

  /// Starts the downloads of pinned files whose content is not here
  /// (`FileContent.fetchPinnedFiles`). Runs when the mount starts, after the first pull.
  public func fetchPinnedFiles() {
    do {
      try content.fetchPinnedFiles()
    } catch {
      log.warning("pinned files could not be fetched: \(error)")
    }
  }

  /// `user.ubiq.action`: download | evict.
  func perform(action: String, on row: ItemRow) throws {
    switch action {
    case "download":
      try download(row.id!)
    case "evict":
      try evict(row)
    case "resync":
      // The whole container's feed, whichever item it is set on.
      guard let resync else { throw UbiqError.notSupported("this mount does not pull from a cloud") }
      resync()
    default:
      throw UbiqError.invalidArgument("user.ubiq.action takes 'download', 'evict' or 'resync', not '\(action)'")
    }
  }

  /// `user.ubiq.resolve` = current | VERSION: resolves an item's conflict versions.
  func resolve(_ row: ItemRow, keep: String) throws {
    guard row.kind == .file else { throw UbiqError.invalidArgument("only files have versions") }
    guard !keep.isEmpty else { throw UbiqError.invalidArgument("user.ubiq.resolve takes 'current' or a version id") }
    let inode = row.id!
    try inodes.withInodeLock(inode) {
      if keep != "current" && inodes.isOpen(inode) { throw UbiqError.busy("\(row.name) is open") }
      if try index.resolveConflicts(inode, keep: keep == "current" ? nil : keep) {
        content.remoteVersionReplaced(inode)
      }
    }
    onQueued()
    invalidate(inode, [])
  }
}
