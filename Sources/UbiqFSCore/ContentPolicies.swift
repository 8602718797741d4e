import Foundation
import UbiqCore
import UbiqIndex
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

extension FilesystemCore {
  /// Called (under the inode lock) right after a remote version replaced the cached content.
  /// A remote version or a merge replaced the content of `inode` (under its inode lock, right
  /// after its cache file went): a download of the old version leaves the download table, so
  /// the next open starts the new version's; its open readers finish with the old bytes.
  public func contentReplaced(_ inode: Int64) {
    downloader?.detach(inode)
    inodes.contentReplaced(inode)
  }

  /// Drops replaced or deleted local content and tells the kernel what changed remotely.
  public func remoteChangesApplied(_ results: [RemoteApplyResult]) {
    for r in results {
      guard let inode = r.inode else { continue }
      switch r.outcome {
      case .unchanged, .deferred, .locallyModified:
        // Nothing the kernel shows changed (often the echo of our own upload): keep its caches.
        continue
      case .deleted:
        if !inodes.isOpen(inode) { forgetContent(inode) }
      default:
        // Replaced content was already dropped under the inode lock by whoever applied the
        // change (ChangePuller, UploadWorker); here only the kernel learns of it.
        break
      }
      invalidate(inode, r.staleEntries)
    }
  }

  /// Tells the kernel that attributes it may have cached changed outside its view.
  public func attributesChanged(_ inode: Int64) { invalidateAttributes(inode) }

  /// Evicts a file's local content if it is uploaded, not pinned and not open; EBUSY otherwise.
  public func evict(_ inode: Int64) throws { try evict(try requireRow(inode)) }

  func evict(_ row: ItemRow) throws {
    guard row.kind == .file else { return }
    let inode = row.id!
    if row.content == .dataless { return }
    try inodes.withInodeLock(inode) {
      if downloader?.isDownloading(inode) == true { throw UbiqError.busy("\(row.name) is being downloaded") }
      if inodes.isOpen(inode) { throw UbiqError.busy("\(row.name) is open") }
      if inodes.isBusy(inode) { throw UbiqError.busy("\(row.name) has unflushed writes") }
      if row.pinned { throw UbiqError.busy("\(row.name) is pinned") }
      guard try index.markEvicted(inode) else {
        throw UbiqError.busy("\(row.name) has changes not yet uploaded")
      }
      if row.size > 0 { cache.remove(inode) }
    }
    // Same bytes, different st_blocks: cached pages stay valid.
    invalidateAttributes(inode)
  }

  /// Downloads a file's content into the cache (a no-op if it is there).
  public func download(_ inode: Int64) throws {
    try withContentCached(inode, interruption: nil) { _ in }
  }

  /// Evicts least-recently-used clean content until the cache fits its budget and the disk keeps
  /// its minimum free space. Never evicts dirty, open or pinned files. Returns bytes freed.
  @discardableResult
  public func enforceCacheBudget() -> Int64 {
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

  /// Records writes that were in the cache file but not in the index when the daemon stopped
  /// (a crash while a handle held unflushed writes, or between a truncation and its record):
  /// the size and mtime of the cache file become a new local revision, queued for upload. Also
  /// checks files recorded without an fsync of their cache file (a power loss may have kept the
  /// record but not the bytes): one whose cache file's size differs from the record is
  /// re-recorded the same way. Every cache file checked is fdatasync'ed before its mark goes.
  /// Cache files of items that no longer exist are removed.
  /// Runs before the first pull and before the kernel sees the mount. Returns how many files
  /// were recovered.
  @discardableResult
  public func recoverUnrecordedWrites() throws -> Int {
    var recovered = 0
    let dirty = try index.dirtyContentItems()
    let unsynced = Set(try index.unsyncedContentItems()).subtracting(dirty)
    for inode in dirty + unsynced.sorted() {
      let hadHandles = !unsynced.contains(inode)
      // A file still dataless never had an acknowledged write (the first one downloads or
      // truncates it first): what its cache file holds is a partial download.
      guard let row = try index.item(inode), row.kind == .file, row.content == .cached else {
        try index.clearContentDirty(inode)
        try index.clearContentUnsynced(inode, upTo: Int64.max)
        continue
      }
      var st = Glibc.stat()
      let fd = Glibc.open(cache.path(inode), O_RDONLY | O_CLOEXEC)
      guard fd >= 0, fstat(fd, &st) == 0 else {
        if fd >= 0 { close(fd) }
        if hadHandles {
          log.warning("\(row.name): unflushed writes at the last stop, but the cache file is gone")
          try index.clearContentDirty(inode)
        }
        // An unsynced record whose cache file is gone stays as it is: the file reads as lost
        // (EIO) rather than as other bytes.
        continue
      }
      let synced = fdatasync(fd) == 0
      close(fd)
      if !hadHandles && Int64(st.st_size) == row.size {
        if synced { try index.clearContentUnsynced(inode, upTo: row.revision) }
        continue
      }
      // The last write's time, unless an explicit time was set after it (touch, cp -p).
      let written = (try? FileTime.nanoseconds(st.st_mtim)) ?? Clock.nowNs()
      let mtime: Int64? = row.ctimeNs >= written ? nil : written
      try index.recordContentChange(inode, size: Int64(st.st_size), mtimeNs: mtime, clean: true, synced: synced)
      log.warning(
        "\(row.name): recorded \(st.st_size) bytes \(hadHandles ? "written" : "left in its cache file") before an unclean stop; queued for upload"
      )
      recovered += 1
    }
    // Cache files of items whose rows are gone (their removal waits until the delete is
    // durable, and a crash came first).
    for name in (try? FileManager.default.contentsOfDirectory(atPath: cache.directory)) ?? [] {
      guard let inode = Int64(name), try index.item(inode) == nil else { continue }
      cache.remove(inode)
    }
    try cache.syncDirectory()
    return recovered
  }

  /// `user.ubiq.action`: download | evict.
  func perform(action: String, on row: ItemRow) throws {
    switch action {
    case "download":
      try download(row.id!)
    case "evict":
      try evict(row)
    default:
      throw UbiqError.invalidArgument("user.ubiq.action takes 'download' or 'evict', not '\(action)'")
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
        cache.remove(inode)
        contentReplaced(inode)
      }
    }
    onQueued()
    invalidate(inode, [])
  }
}
