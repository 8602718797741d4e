import Foundation
import Logging
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// What a regular file's bytes are, locally. Derived, never stored as such: the durable parts
/// are the index's `content` column (dataless or cached), its `dirtyContent` and
/// `unsyncedContent` marks and the upload queue row; the rest is in memory (the `InodeTable`'s
/// record, the `Downloader`'s stream, the uploader's current item). `FileContent` holds every
/// transition between these states.
public enum FileContentState: Equatable, Sendable, CustomStringConvertible {
  /// Metadata and chunk manifest only; nothing here (`st_blocks` 0).
  case dataless
  /// A download fills the cache file.
  case downloading
  /// The cache file holds exactly what the index describes, and the cloud has it.
  case cached
  /// Bytes or attributes here that the cloud does not have yet: a handle wrote bytes not yet
  /// recorded, or a recorded revision waits in the upload queue.
  case dirty
  /// The uploader is sending this file's current revision.
  case uploading
  /// The last download or upload failed; the message says why (retried; the bytes stay).
  case error(String)

  /// The name `user.ubiq.content_state` shows.
  public var description: String {
    switch self {
    case .dataless: return "dataless"
    case .downloading: return "downloading"
    case .cached: return "cached"
    case .dirty: return "dirty"
    case .uploading: return "uploading"
    case .error: return "error"
    }
  }
}

/// Every transition of a regular file's content state, in one place: the filesystem core, the
/// downloader, the uploader and the change puller move a file's content only through these
/// functions. It owns no state of its own (see `FileContentState` for where each part lives),
/// so each of those layers makes one from the owners it already holds.
///
/// Locking: a function documented as "under the inode lock" expects its caller to hold
/// `InodeTable.withInodeLock(inode)`, so the transitions of one inode never interleave and an
/// open, an eviction and a download's completion each see the file in one state. None waits
/// for the network.
///
/// ```
/// dataless ──open/read──> downloading ──downloadCompleted──> cached ──writeBegins──> dirty
///    ^  ^                     │ truncate: superseded            ^  │                   │ writesRecorded
///    │  └── cacheFileMissing  v                                 │  │                   v (queued)
///    │      (cloud has it)  cached (empty, or O_TRUNC)          │  │ evict           uploading
///    └──────── remoteVersionReplaced / evict <──────────────────┘  │                   │ committed
///                                                                   └───────────────────┘
/// ```
public struct FileContent: Sendable {
  public let index: IndexStore
  public let cache: ContentCache
  public let inodes: InodeTable
  /// Running downloads: a transition that replaces the content stops or detaches them.
  public let downloads: Downloader?
  let log: Logger

  public init(index: IndexStore, cache: ContentCache, inodes: InodeTable, downloads: Downloader?, logger: Logger) {
    self.index = index
    self.cache = cache
    self.inodes = inodes
    self.downloads = downloads
    self.log = logger
  }

  // MARK: - the state

  /// The content state of `row`'s file, read under its inode lock (so a transition running on
  /// another thread, such as a download completing, is seen wholly before or wholly after).
  /// `uploading`: the uploader is working on this item now.
  public func state(of row: ItemRow, uploading: Bool) throws -> FileContentState {
    guard row.kind == .file, let inode = row.id else { return .cached }
    return try inodes.withInodeLock(inode) {
      let row = try index.item(inode) ?? row
      if inodes.dirtyHandleCount(inode) > 0 { return .dirty }
      if let entry = try index.queueEntry(forInode: inode) {
        if uploading { return .uploading }
        if let e = entry.lastError { return .error(e) }
        return .dirty
      }
      if row.content == .dataless {
        if downloads?.isDownloading(inode) == true { return .downloading }
        if let e = downloads?.lastError(inode) { return .error(e) }
        return .dataless
      }
      return .cached
    }
  }

  // MARK: - local writes

  /// cached → dirty: a handle's first write since its last flush. Under the inode lock. The
  /// durable dirty mark is committed before the write is acknowledged (a crash before the
  /// flush is found at the next mount: `recoverAfterUncleanStop`), and the generation moves
  /// before the bytes reach the cache file (an upload snapshot taken before is thrown away).
  public func writeBegins(_ inode: Int64) throws {
    try index.markContentDirty(inode)
    inodes.beginWrite(inode, handleWasClean: true)
  }

  /// (new) → dirty: a file created open for writing. The creating handle holds it as a writer
  /// does (its upload waits for the handle's flush), but nothing is marked in the index: the
  /// file is empty, and a crash before its first write loses nothing. Runs inside the insert's
  /// transaction, before anything else can know the inode (so with no lock); undone by
  /// `InodeTable.noteFlushed` if that transaction fails.
  public func createdForWriting(_ inode: Int64) {
    inodes.beginWrite(inode, handleWasClean: true)
  }

  /// dirty → dirty: the first write through the handle that created the file leaves the
  /// durable dirty mark `writeBegins` leaves (the handle already counts as dirty). Under the
  /// inode lock.
  public func createdFileWriteBegins(_ inode: Int64) throws {
    try index.markContentDirty(inode)
    inodes.beginWrite(inode, handleWasClean: false)
  }

  /// dirty → cached: the handle that created the file is flushed with nothing written through
  /// it: nothing to record, and the upload queued at the create goes ahead. Under the inode lock.
  public func createdFileFlushedUnwritten(_ inode: Int64) {
    inodes.noteFlushed(inode)
  }

  /// dirty → dirty (queued): a handle's writes are recorded (flush, fsync, close): the cache
  /// file's size and the write time become a new revision in the upload queue. Under the inode
  /// lock. `clean`: no other handle holds unrecorded writes, so the dirty mark goes in the
  /// same transaction.
  public func writesRecorded(_ inode: Int64, size: Int64, mtimeNs: Int64?, clean: Bool) throws {
    try index.recordContentChange(inode, size: size, mtimeNs: mtimeNs, clean: clean)
    inodes.noteFlushed(inode)
  }

  /// dirty → dirty (queued) for writes no handle will record: handles that were closed while
  /// the index could not be written (a full disk) left their bytes in the cache file and the
  /// durable dirty mark. Each such file that no handle has open for writing (a writer records
  /// at its own flush or close) is recorded as `recoverAfterUncleanStop` does at a mount; the
  /// daemon calls this every few seconds. Returns how many were recorded; an index that still
  /// cannot be written throws, and the next call tries again.
  public func recordWritesOfClosedHandles() throws -> Int {
    var recorded = 0
    for inode in try index.dirtyContentItems() {
      let done = try inodes.withInodeLock(inode) { () throws -> Bool in
        guard !inodes.isBusy(inode), let row = try index.item(inode), row.kind == .file, row.content == .cached
        else { return false }
        let fd = Glibc.open(cache.path(inode), O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        var st = Glibc.stat()
        guard fstat(fd, &st) == 0 else { return false }
        try index.recordContentChange(
          inode, size: Int64(st.st_size), mtimeNs: writeTime(of: st, row: row), clean: true)
        inodes.noteFlushed(inode)
        log.info("\(row.name): recorded \(st.st_size) bytes a closed handle could not record; queued for upload")
        return true
      }
      if done { recorded += 1 }
    }
    return recorded
  }

  /// The modification time to record for what a cache file holds, from its `fstat`: the last
  /// write's time, or nil (the row's stays) when an explicit time was set after it (touch,
  /// cp -p).
  private func writeTime(of st: Glibc.stat, row: ItemRow) -> Int64? {
    let written = (try? FileTime.nanoseconds(st.st_mtim)) ?? index.clock.nowNs()
    return row.ctimeNs >= written ? nil : written
  }

  /// Any state → dirty: the content becomes its first `size` bytes (truncate, O_TRUNC), outside
  /// any handle's writes. Under the inode lock. The dirty mark goes first, so a crash between
  /// the truncation and its record is repaired at the next mount; a download of the previous
  /// version stops before the truncation, so no old byte lands after it. `fd`: a descriptor of
  /// the cache file to truncate through (the cache file is opened, and made, otherwise).
  public func truncate(_ inode: Int64, to size: Int64, through fd: Int32?) throws {
    try index.markContentDirty(inode)
    downloads?.supersede(inode)
    let cacheFD = try fd ?? cache.open(inode, create: true)
    defer { if fd == nil { close(cacheFD) } }
    inodes.noteReplaced(inode)
    if ftruncate(cacheFD, off_t(size)) != 0 { throw UbiqError.posix(errno, "truncate") }
    try index.recordContentChange(
      inode, size: size, mtimeNs: self.index.clock.nowNs(), clean: inodes.dirtyHandleCount(inode) == 0)
  }

  /// Whether an open for writing with O_TRUNC changes anything (it then `truncate`s, which
  /// works offline and downloads nothing): an empty file whose cache file is empty stays as it
  /// is (no new revision for `: > empty`). The index may say 0 bytes while another handle has
  /// written more, not yet recorded: the cache file decides. Under the inode lock.
  public func openTruncates(_ row: ItemRow, cacheFile fd: Int32) -> Bool {
    var st = stat()
    let cachedBytes = fstat(fd, &st) == 0 ? Int64(st.st_size) : -1
    return row.size != 0 || row.content == .dataless || cachedBytes != 0
  }

  // MARK: - downloads and eviction

  /// Whether the content of `row` is in the cache file, repairing a cached row whose cache
  /// file is gone (a crash, a hand removal): cached → dataless when the cloud has its content
  /// (to be downloaded again). When its last changes never reached the cloud the content is
  /// lost: `EIO`, never an empty file in its place (that would be uploaded over the cloud's
  /// copy). Under the inode lock.
  public func isPresent(_ row: ItemRow) throws -> Bool {
    guard row.content == .cached else { return false }
    switch cache.cachedContent(row.id!, size: row.size) {
    case .file:
      return true
    case .emptyWithoutFile:
      close(try cache.open(row.id!, create: true))
      return true
    case .missing:
      break
    }
    guard downloads != nil, try index.markContentMissing(row.id!) else {
      log.error("cache file of \(row.name) is gone and its last changes never reached the cloud")
      throw UbiqError.io("the local content of \(row.name) is lost")
    }
    log.warning("cache file of \(row.name) was missing; downloading it again")
    return false
  }

  /// downloading → cached: every chunk of `manifest` is in the cache file, durable. Under the
  /// inode lock. False if the item's manifest changed meanwhile (the download is stale; the
  /// next read fetches the current version).
  public func downloadCompleted(_ inode: Int64, manifest: String?) -> Bool {
    (try? index.markCached(inode, manifest: manifest)) ?? false
  }

  /// cached → dataless: drops the local bytes of a file the cloud has. Under the inode lock
  /// (taken here), so an open either ran before (its handle refuses the eviction) or
  /// downloads again. `EBUSY` for a file being downloaded, open, written, pinned or not yet
  /// uploaded. Returns whether the content went.
  @discardableResult
  public func evict(_ row: ItemRow) throws -> Bool {
    guard row.kind == .file, row.content != .dataless, let inode = row.id else { return false }
    try inodes.withInodeLock(inode) {
      if downloads?.isDownloading(inode) == true { throw UbiqError.busy("\(row.name) is being downloaded") }
      if inodes.isOpen(inode) { throw UbiqError.busy("\(row.name) is open") }
      if inodes.isBusy(inode) { throw UbiqError.busy("\(row.name) has unflushed writes") }
      if row.pinned { throw UbiqError.busy("\(row.name) is pinned") }
      guard try index.markEvicted(inode) else {
        throw UbiqError.busy("\(row.name) has changes not yet uploaded")
      }
      if row.size > 0 { cache.remove(inode) }
    }
    return true
  }

  // MARK: - remote versions and uploads

  /// cached or downloading → dataless: a remote version, a merge or a resolved conflict
  /// replaced the content the index describes (the index already says so). Under the inode
  /// lock. The old cache file goes now, so an open after this downloads the new version; a
  /// download of the old version leaves the download table (its readers finish with the old
  /// bytes through their descriptors); pages the kernel cached of the old bytes are dropped at
  /// the next open or read (`InodeTable.contentReplaced`). A pinned file ("download and keep")
  /// goes on to downloading: its new version is fetched at once, so it stays available offline.
  public func remoteVersionReplaced(_ inode: Int64) {
    cache.remove(inode)
    downloads?.detach(inode)
    inodes.contentReplaced(inode)
    if let row = try? index.item(inode), row.pinned, row.content == .dataless {
      downloads?.fetchInBackground(inode)
    }
  }

  /// dataless → downloading for every pinned file whose content is not here (a crash or an
  /// unmount stopped its download). Runs when the mount starts.
  public func fetchPinnedFiles() throws {
    guard let downloads else { return }
    for inode in try index.pinnedDatalessFiles() { downloads.fetchInBackground(inode) }
  }

  /// The cache file of `inode` was fdatasync'ed after `revision` was recorded (an fsync, or
  /// the uploader before it sends the bytes): the unsynced mark of revisions up to it goes.
  public func bytesDurable(_ inode: Int64, upTo revision: Int64) throws {
    try index.clearContentUnsynced(inode, upTo: revision)
  }

  /// The uploader read `size` bytes from the cache file while the index says otherwise and no
  /// handle holds writes: bytes were written without being recorded. The cache file is the
  /// content: it is recorded as a new revision before anything is committed. Under no lock
  /// (the record is one transaction; a flush that lands first leaves nothing to repair).
  public func cacheFileDisagrees(_ inode: Int64, size: Int64) throws {
    guard let fresh = try index.item(inode), fresh.size != size, !inodes.isBusy(inode) else { return }
    log.warning("\(fresh.name): cache file has \(size) bytes, index said \(fresh.size); recording the file")
    try index.recordContentChange(inode, size: size, mtimeNs: nil)
  }

  // MARK: - crash recovery

  /// Records writes that were in the cache file but not in the index when the daemon stopped
  /// (a crash while a handle held unflushed writes, or between a truncation and its record):
  /// the size and mtime of the cache file become a new local revision, queued for upload. Also
  /// checks files recorded without an fsync of their cache file (a power loss may have kept the
  /// record but not the bytes): one whose cache file's size differs from the record is
  /// re-recorded the same way. Every cache file checked is fdatasync'ed before its mark goes.
  /// Cache files of items that no longer exist are removed.
  /// Runs before the first pull and before the kernel sees the mount. Returns how many files
  /// were recovered.
  public func recoverAfterUncleanStop() throws -> Int {
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
      try index.recordContentChange(
        inode, size: Int64(st.st_size), mtimeNs: writeTime(of: st, row: row), clean: true, synced: synced)
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
}
