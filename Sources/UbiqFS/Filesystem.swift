import CFuse3
import Foundation
import Logging
import UbiqCloud
import UbiqCore
import UbiqIndex
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// Tunables of a mount.
public struct MountOptions: Sendable {
  /// How long the kernel may cache entries and attributes, in seconds.
  public var attrTimeout: Double = 60.0
  public var entryTimeout: Double = 60.0
  public var maxThreads: Int = 16
  public var debug = false
  /// Content cache budget in bytes (0: no limit) and the free space to keep on the cache's disk.
  public var cacheBudgetBytes: Int64 = 0
  public var minFreeBytes: Int64 = 1 << 30
  /// Process names (as in /proc/PID/comm) whose reads must never trigger a download: they get
  /// EACCES on evicted files instead. Indexers and thumbnailers by default.
  public var noDownloadPrograms: Set<String> = [
    "tracker-miner-f", "tracker-extract", "tracker-extract-3", "tracker-miner-fs-3", "baloo_file",
    "baloo_file_extractor", "updatedb", "updatedb.plocate", "plocate", "mlocate", "tumblerd", "ffmpegthumbnailer",
    "gdk-pixbuf-thumbnailer", "totem-video-thumbnailer", "evince-thumbnailer", "gnome-desktop-thumbnailer",
  ]
  public init() {}
}

/// The FUSE low-level operations of one mounted container: answers the kernel from the local
/// index (metadata) and the content cache (file bytes), and records every change in the index
/// and its durable upload queue. Never waits on the network for metadata.
public final class UbiqFilesystem: @unchecked Sendable {
  let index: IndexStore
  let cache: ContentCache
  let coordinator: WriteCoordinator
  let container: ContainerID
  let options: MountOptions
  let log: Logger
  let handles = HandleTable()
  /// Fetches evicted content; nil means content can never be downloaded.
  public var downloader: Downloader?
  /// Set by the session: tells the kernel to forget cached attributes/pages of an inode and
  /// cached (parent, name) entries.
  var invalidate: (_ inode: Int64?, _ entries: [(Int64, String)]) -> Void = { _, _ in }
  /// Set by the session: the kernel forgets cached attributes of an inode, keeping its pages.
  var invalidateAttributes: (Int64) -> Void = { _ in }
  /// Called after something was queued for upload.
  var onQueued: () -> Void = {}
  /// Percent uploaded of an item whose upload is in flight.
  public var uploadPercent: (Int64) -> Int? = { _ in nil }
  /// Computes the virtual `user.ubiq.*` attributes.
  lazy var xattrSurface = XattrSurface(fs: self)
  let xattrSnapshots = XattrSnapshots()
  let pageEpochs = PageCacheEpochs()

  public init(
    index: IndexStore, cache: ContentCache, coordinator: WriteCoordinator, container: ContainerID,
    options: MountOptions, logger: Logger, onQueued: @escaping () -> Void
  ) {
    self.index = index
    self.cache = cache
    self.coordinator = coordinator
    self.container = container
    self.options = options
    self.log = logger
    self.onQueued = onQueued
  }

  // MARK: - helpers

  func fail(_ req: fuse_req_t?, _ code: Int32) { _ = fuse_reply_err(req, code) }

  func reply(_ req: fuse_req_t?, error: Error) {
    let code: Int32
    switch error {
    case let e as UbiqError: code = e.errno
    default:
      log.error("internal error: \(error)")
      code = EIO
    }
    _ = fuse_reply_err(req, code)
  }

  func name(_ p: UnsafePointer<CChar>?) -> String { p.map { String(cString: $0) } ?? "" }

  /// Validates a name coming from the kernel (ENAMETOOLONG beyond 255 bytes).
  func checkName(_ n: String) throws {
    if n.utf8.count > ItemName.maxBytes { throw UbiqError.nameTooLong(n) }
  }

  func stat(for row: ItemRow) -> stat {
    var st = Glibc.stat()
    let ino = row.id!
    st.st_ino = UInt(ino)
    let typeBits: UInt32
    switch row.kind {
    case .file: typeBits = S_IFREG
    case .directory: typeBits = S_IFDIR
    case .symlink: typeBits = S_IFLNK
    }
    st.st_mode = typeBits | (row.mode & 0o7777)
    st.st_nlink = row.kind == .directory ? 2 : 1
    st.st_uid = row.uid
    st.st_gid = row.gid
    var size = row.size
    var mtime = row.mtimeNs
    if row.kind == .file, let live = handles.liveState(ino) {
      if live.anyFD >= 0 {
        var fst = Glibc.stat()
        if fstat(live.anyFD, &fst) == 0 { size = Int64(fst.st_size) }
      }
      if let m = live.pendingMtimeNs { mtime = m }
    }
    if row.kind == .directory { size = 4096 }
    st.st_size = Int(size)
    st.st_blksize = 128 * 1024
    // An evicted file keeps its size but occupies nothing locally.
    st.st_blocks = (row.kind == .file && row.content == .dataless) ? 0 : Int((size + 511) / 512)
    st.st_atim = Self.ts(row.atimeNs)
    st.st_mtim = Self.ts(mtime)
    st.st_ctim = Self.ts(max(row.ctimeNs, mtime))
    return st
  }

  static func ts(_ ns: Int64) -> timespec {
    timespec(tv_sec: Int(ns / 1_000_000_000), tv_nsec: Int(ns % 1_000_000_000))
  }

  static func ns(_ t: timespec) -> Int64 { Int64(t.tv_sec) * 1_000_000_000 + Int64(t.tv_nsec) }

  func entry(for row: ItemRow) -> fuse_entry_param {
    var e = fuse_entry_param()
    e.ino = fuse_ino_t(row.id!)
    e.generation = 1
    e.attr = stat(for: row)
    e.attr_timeout = options.attrTimeout
    e.entry_timeout = options.entryTimeout
    return e
  }

  func requireRow(_ ino: fuse_ino_t) throws -> ItemRow {
    guard let row = try index.item(Int64(ino)) else { throw UbiqError.notFound("inode \(ino)") }
    return row
  }

  /// The command name (/proc/PID/comm, at most 15 bytes) of the process behind a request.
  func callerProgram(_ req: fuse_req_t?) -> String? {
    guard let ctx = fuse_req_ctx(req), ctx.pointee.pid > 0,
      let comm = try? String(contentsOfFile: "/proc/\(ctx.pointee.pid)/comm", encoding: .utf8)
    else { return nil }
    let name = comm.trimmingCharacters(in: .whitespacesAndNewlines)
    // comm is truncated to 15 bytes: match configured names by the same prefix.
    return options.noDownloadPrograms.first { String($0.utf8.prefix(15)) == name } ?? name
  }

  func caller(_ req: fuse_req_t?) -> (uid: UInt32, gid: UInt32) {
    guard let ctx = fuse_req_ctx(req) else { return (getuid(), getgid()) }
    return (ctx.pointee.uid, ctx.pointee.gid)
  }

  // MARK: - namespace

  func lookup(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?) {
    do {
      let n = name(namePtr)
      try checkName(n)
      guard let row = try index.child(of: Int64(parent), named: n) else {
        // Negative entry, cached by the kernel for the entry timeout.
        var e = fuse_entry_param()
        e.ino = 0
        e.entry_timeout = options.entryTimeout
        _ = fuse_reply_entry(req, &e)
        return
      }
      var e = entry(for: row)
      _ = fuse_reply_entry(req, &e)
    } catch { reply(req, error: error) }
  }

  func getattr(_ req: fuse_req_t?, _ ino: fuse_ino_t) {
    do {
      if let row = try index.item(Int64(ino)) {
        var st = stat(for: row)
        _ = fuse_reply_attr(req, &st, options.attrTimeout)
        return
      }
      // An open file that was unlinked.
      if let live = handles.liveState(Int64(ino)), let o = live.orphan {
        var st = Glibc.stat()
        if live.anyFD >= 0 { fstat(live.anyFD, &st) }
        st.st_ino = UInt(ino)
        st.st_mode = S_IFREG | (o.mode & 0o7777)
        st.st_nlink = 0
        st.st_uid = o.uid
        st.st_gid = o.gid
        st.st_mtim = Self.ts(live.pendingMtimeNs ?? o.mtimeNs)
        _ = fuse_reply_attr(req, &st, 0)
        return
      }
      throw UbiqError.notFound("inode \(ino)")
    } catch { reply(req, error: error) }
  }

  func setattr(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>?, _ toSet: Int32,
    _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    do {
      let inode = Int64(ino)
      guard let a = attr?.pointee else { throw UbiqError.invalidArgument("no attributes") }
      var c = AttributeChanges()
      let now = Clock.nowNs()
      if toSet & FUSE_SET_ATTR_MODE != 0 { c.mode = a.st_mode }
      if toSet & FUSE_SET_ATTR_UID != 0 { c.uid = a.st_uid }
      if toSet & FUSE_SET_ATTR_GID != 0 { c.gid = a.st_gid }
      if toSet & FUSE_SET_ATTR_ATIME_NOW != 0 {
        c.atimeNs = now
      } else if toSet & FUSE_SET_ATTR_ATIME != 0 {
        c.atimeNs = Self.ns(a.st_atim)
      }
      if toSet & FUSE_SET_ATTR_MTIME_NOW != 0 {
        c.mtimeNs = now
      } else if toSet & FUSE_SET_ATTR_MTIME != 0 {
        c.mtimeNs = Self.ns(a.st_mtim)
      }
      // An explicit mtime (cp -p, touch) replaces the time of earlier writes.
      if c.mtimeNs != nil { handles.setPendingMtime(inode, nil) }
      if toSet & FUSE_SET_ATTR_SIZE != 0 {
        let row = try requireRow(ino)
        if row.kind == .directory { throw UbiqError.isDirectory(row.name) }
        if row.kind != .file { throw UbiqError.invalidArgument("not a regular file") }
        if row.content == .dataless && a.st_size != 0 { try ensureContent(row) }
        let size = Int64(a.st_size)
        let handle = fi.flatMap { handles.get($0.pointee.fh) }
        let fd = try handle?.fd ?? cache.open(inode, create: true)
        defer { if handle == nil { close(fd) } }
        if ftruncate(fd, off_t(size)) != 0 { throw UbiqError.io("truncate: \(String(cString: strerror(errno)))") }
        c.size = size
        coordinator.noteReplaced(inode)
        if c.mtimeNs == nil { c.mtimeNs = now }
        handles.setPendingMtime(inode, nil)
      }
      let row = try index.setAttributes(inode, c)
      if c.size != nil {
        try index.recordContentChange(inode, size: c.size!, mtimeNs: row.mtimeNs)
      }
      if c.syncs { onQueued() }
      var st = stat(for: try requireRow(ino))
      _ = fuse_reply_attr(req, &st, options.attrTimeout)
    } catch { reply(req, error: error) }
  }

  func makeItem(
    _ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, kind: ItemKind, mode: UInt32,
    target: String? = nil
  ) throws -> ItemRow {
    let n = name(namePtr)
    try checkName(n)
    let who = caller(req)
    let row = try index.create(
      parent: Int64(parent), name: n, kind: kind, mode: mode & 0o7777, uid: who.uid, gid: who.gid,
      symlinkTarget: target)
    onQueued()
    return row
  }

  func mkdir(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ mode: mode_t) {
    do {
      let row = try makeItem(req, parent, namePtr, kind: .directory, mode: mode)
      var e = entry(for: row)
      _ = fuse_reply_entry(req, &e)
    } catch { reply(req, error: error) }
  }

  func mknod(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ mode: mode_t) {
    do {
      guard mode & S_IFMT == S_IFREG else {
        throw UbiqError.notPermitted("only regular files, directories and symlinks can be stored")
      }
      let row = try makeItem(req, parent, namePtr, kind: .file, mode: mode)
      close(try cache.open(row.id!, create: true))
      var e = entry(for: row)
      _ = fuse_reply_entry(req, &e)
    } catch { reply(req, error: error) }
  }

  func symlink(
    _ req: fuse_req_t?, _ link: UnsafePointer<CChar>?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?
  ) {
    do {
      let target = name(link)
      if target.isEmpty || target.utf8.count > 4095 { throw UbiqError.invalidArgument("bad symlink target") }
      let row = try makeItem(req, parent, namePtr, kind: .symlink, mode: 0o777, target: target)
      var e = entry(for: row)
      _ = fuse_reply_entry(req, &e)
    } catch { reply(req, error: error) }
  }

  func readlink(_ req: fuse_req_t?, _ ino: fuse_ino_t) {
    do {
      let row = try requireRow(ino)
      guard row.kind == .symlink, let t = row.symlinkTarget else { throw UbiqError.invalidArgument("not a symlink") }
      _ = fuse_reply_readlink(req, t)
    } catch { reply(req, error: error) }
  }

  func remove(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, directory: Bool) {
    do {
      let n = name(namePtr)
      try checkName(n)
      let row = try index.remove(parent: Int64(parent), name: n, directory: directory)
      dispose(row)
      onQueued()
      _ = fuse_reply_err(req, 0)
    } catch { reply(req, error: error) }
  }

  /// Drops the local content of a row that left the namespace (now, or at its last release).
  func dispose(_ row: ItemRow) {
    guard let inode = row.id, row.kind == .file else { return }
    let snap = ItemSnapshot(mode: row.mode, uid: row.uid, gid: row.gid, mtimeNs: row.mtimeNs)
    if !handles.markUnlinked(inode, orphan: snap) { forgetContent(inode) }
  }

  /// An item is gone for good (inodes are never reused): its cache file and per-inode state go.
  func forgetContent(_ inode: Int64) {
    cache.remove(inode)
    coordinator.forget(inode)
    pageEpochs.forget(inode)
  }

  func rename(
    _ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ newParent: fuse_ino_t,
    _ newNamePtr: UnsafePointer<CChar>?, _ flags: UInt32
  ) {
    do {
      let n = name(namePtr)
      let nn = name(newNamePtr)
      try checkName(n)
      try checkName(nn)
      let mode: IndexStore.RenameMode
      if flags & UBIQ_RENAME_EXCHANGE != 0 {
        mode = .exchange
      } else if flags & UBIQ_RENAME_NOREPLACE != 0 {
        mode = .noReplace
      } else if flags == 0 {
        mode = .replace
      } else {
        throw UbiqError.invalidArgument("unsupported rename flags \(flags)")
      }
      if mode == .exchange, try index.child(of: Int64(newParent), named: nn) == nil {
        throw UbiqError.notFound(nn)
      }
      let result = try index.rename(
        parent: Int64(parent), name: n, newParent: Int64(newParent), newName: nn, mode: mode)
      if let replaced = result.replaced { dispose(replaced) }
      onQueued()
      _ = fuse_reply_err(req, 0)
    } catch { reply(req, error: error) }
  }

  func link(_ req: fuse_req_t?) {
    // Hard links have no equivalent in the cloud model; tools (git, rsync) fall back to copies.
    _ = fuse_reply_err(req, EPERM)
  }

  // MARK: - directories

  /// Lets the kernel cache the listing (and keep it across opens): local changes go through the
  /// kernel, which drops it itself; remote ones drop it with an inode invalidation of the parent.
  func opendir(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    do {
      let dir = try requireRow(ino)
      guard dir.isDirectory else { throw UbiqError.notDirectory(dir.name) }
      if let fi {
        ubiq_fi_set_cache_readdir(fi, 1)
        ubiq_fi_set_keep_cache(fi, 1)
      }
      _ = fuse_reply_open(req, fi)
    } catch { reply(req, error: error) }
  }

  func readdir(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int, _ off: off_t, plus: Bool
  ) {
    do {
      let dir = try requireRow(ino)
      guard dir.isDirectory else { throw UbiqError.notDirectory(dir.name) }
      var buf = [CChar](repeating: 0, count: size)
      var used = 0
      var offset = Int64(off)
      // Offsets: 1 = ".", 2 = "..", then 2 + child inode (stable while the directory changes).
      func add(_ name: String, _ st: stat, _ entryParam: fuse_entry_param?, _ nextOff: Int64) -> Bool {
        let remaining = size - used
        let need: Int = buf.withUnsafeMutableBufferPointer { b in
          var st = st
          if plus {
            var e = entryParam ?? fuse_entry_param()
            if entryParam == nil { e.attr = st }
            return fuse_add_direntry_plus(req, b.baseAddress! + used, remaining, name, &e, off_t(nextOff))
          }
          return fuse_add_direntry(req, b.baseAddress! + used, remaining, name, &st, off_t(nextOff))
        }
        if need > remaining { return false }
        used += need
        return true
      }
      if offset < 1 {
        var st = Glibc.stat()
        st.st_ino = UInt(ino)
        st.st_mode = S_IFDIR
        if !add(".", st, nil, 1) { return finish(req, buf, used) }
        offset = 1
      }
      if offset < 2 {
        var st = Glibc.stat()
        st.st_ino = UInt(dir.parent ?? Int64(ino))
        st.st_mode = S_IFDIR
        if !add("..", st, nil, 2) { return finish(req, buf, used) }
        offset = 2
      }
      var after = offset - 2
      // Fetch about as many rows as fit in the kernel's buffer (often one page).
      let batch = max(16, min(1024, size / (plus ? 120 : 24) + 1))
      outer: while true {
        let rows = try index.children(of: Int64(ino), after: after, limit: batch)
        if rows.isEmpty { break }
        for row in rows {
          let st = stat(for: row)
          if !add(row.name, st, plus ? entry(for: row) : nil, row.id! + 2) { break outer }
          after = row.id!
        }
      }
      finish(req, buf, used)
    } catch { reply(req, error: error) }
  }

  private func finish(_ req: fuse_req_t?, _ buf: [CChar], _ used: Int) {
    buf.withUnsafeBufferPointer { b in _ = fuse_reply_buf(req, b.baseAddress, used) }
  }

  // MARK: - files

  func open(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    do {
      let row = try requireRow(ino)
      if row.kind == .directory { throw UbiqError.isDirectory(row.name) }
      let flags = fi?.pointee.flags ?? 0
      let writable = flags & O_ACCMODE != O_RDONLY
      let inode = row.id!
      if row.content == .dataless, let who = callerProgram(req), options.noDownloadPrograms.contains(who) {
        log.info("refused download of \(row.name) for \(who) (no-download program)")
        throw UbiqError.accessDenied("\(who) may not download content")
      }
      var stream: ContentStream?
      let fd = try coordinator.withInodeLock(inode) { () throws -> Int32 in
        let current = try requireRow(ino)
        if writable && flags & O_TRUNC != 0 {
          // Replaced whole: the old content is never needed (works offline, downloads nothing).
          let fd = try cache.open(inode, create: true)
          if ftruncate(fd, 0) != 0 { throw UbiqError.io("truncate: \(String(cString: strerror(errno)))") }
          if current.size != 0 || current.content == .dataless {
            coordinator.noteReplaced(inode)
            handles.setPendingMtime(inode, nil)
            try index.recordContentChange(inode, size: 0, mtimeNs: Clock.nowNs())
            onQueued()
          }
          coordinator.noteWriterOpened(inode)
          return fd
        }
        if current.content == .dataless && !writable, let downloader {
          // Read-only: return now; each read waits only for its own range.
          stream = try downloader.stream(inode)
        } else {
          try ensureContent(current)
        }
        let fd = try cache.open(inode, create: false)
        if writable { coordinator.noteWriterOpened(inode) }
        return fd
      }
      let file = OpenFile(inode: inode, fd: fd, writable: writable, epoch: pageEpochs.current(inode))
      file.stream = stream
      let h = handles.add(file)
      handles.noteUse(inode)
      if let fi {
        fi.pointee.fh = h
        // Local writes go through the kernel's page cache, so cached pages stay valid, unless
        // the content was replaced remotely since (see PageCacheEpochs).
        ubiq_fi_set_keep_cache(fi, pageEpochs.mayKeepPages(inode) ? 1 : 0)
      }
      _ = fuse_reply_open(req, fi)
    } catch { reply(req, error: error) }
  }

  /// Makes sure the content of a file is in the cache (downloads evicted content).
  func ensureContent(_ row: ItemRow) throws {
    if row.content == .cached {
      guard !cache.exists(row.id!) else { return }
      // No cache file: an empty file (created remotely), or lost local bytes (a crash, a hand
      // removal). Content the cloud has is downloaded again rather than shown empty.
      guard downloader != nil, try index.markContentMissing(row.id!) else {
        close(try cache.open(row.id!, create: true))
        return
      }
      log.warning("cache file of \(row.name) was missing; downloading it again")
    }
    guard let downloader else { throw UbiqError.io("content of \(row.name) is not downloaded") }
    do {
      try downloader.ensureCached(row.id!)
    } catch let e as UbiqError {
      throw e
    } catch let e as CloudError {
      log.warning("download of \(row.name) failed: \(e)")
      throw UbiqError.io("download of \(row.name) failed: \(e)")
    }
  }

  func create(
    _ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ mode: mode_t,
    _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    do {
      let row = try makeItem(req, parent, namePtr, kind: .file, mode: mode)
      let fd = try cache.open(row.id!, create: true)
      _ = ftruncate(fd, 0)
      coordinator.noteWriterOpened(row.id!)
      let h = handles.add(OpenFile(inode: row.id!, fd: fd, writable: true))
      if let fi {
        fi.pointee.fh = h
        ubiq_fi_set_keep_cache(fi, 1)
      }
      var e = entry(for: row)
      _ = fuse_reply_create(req, &e, fi)
    } catch { reply(req, error: error) }
  }

  func read(_ req: fuse_req_t?, _ size: Int, _ off: off_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    guard let fi, let f = handles.get(fi.pointee.fh) else { return fail(req, EBADF) }
    // `stream` is set once at open and never changed, so reading it here is race-free.
    if let s = f.stream, !(s.finished && s.failed == nil) {
      do {
        try s.waitForRange(Int64(off), size, timeoutNs: downloader?.stallTimeoutNs ?? 15_000_000_000)
      } catch {
        return reply(req, error: error)
      }
    }
    _ = ubiq_reply_fd(req, f.fd, size, off)
    pageEpochs.noteRead(f.inode, openedIn: f.epoch)
  }

  func write(
    _ req: fuse_req_t?, _ buf: UnsafePointer<CChar>?, _ size: Int, _ off: off_t,
    _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    guard let fi, let f = handles.get(fi.pointee.fh) else { return fail(req, EBADF) }
    var done = 0
    while done < size {
      let n = pwrite(f.fd, buf! + done, size - done, off + off_t(done))
      if n < 0 {
        if errno == EINTR { continue }
        return fail(req, errno)
      }
      done += n
    }
    coordinator.noteWrite(f.inode, handleWasClean: !f.dirty)
    f.dirty = true
    handles.noteWrite(f.inode, mtimeNs: Clock.nowNs())
    _ = fuse_reply_write(req, done)
  }

  /// Records the handle's writes in the index and queues the upload.
  func persist(_ f: OpenFile) throws {
    guard f.dirty else { return }
    var st = Glibc.stat()
    fstat(f.fd, &st)
    // nil: the mtime was set explicitly after the last write; keep it.
    let mtime = handles.takePendingMtime(f.inode)
    try index.recordContentChange(f.inode, size: Int64(st.st_size), mtimeNs: mtime)
    f.dirty = false
    coordinator.noteFlushed(f.inode)
    onQueued()
  }

  func flush(_ req: fuse_req_t?, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    guard let fi, let f = handles.get(fi.pointee.fh) else { return fail(req, EBADF) }
    do {
      try persist(f)
      _ = fuse_reply_err(req, 0)
    } catch { reply(req, error: error) }
  }

  func fsync(_ req: fuse_req_t?, _ datasync: Int32, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    guard let fi, let f = handles.get(fi.pointee.fh) else { return fail(req, EBADF) }
    do {
      if (datasync != 0 ? fdatasync(f.fd) : Glibc.fsync(f.fd)) != 0 {
        throw UbiqError.io("fsync: \(String(cString: strerror(errno)))")
      }
      try persist(f)
      _ = fuse_reply_err(req, 0)
    } catch { reply(req, error: error) }
  }

  func release(_ req: fuse_req_t?, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    guard let fi, let (f, last, unlinked) = handles.remove(fi.pointee.fh) else { return fail(req, 0) }
    do { try persist(f) } catch { log.error("release: \(error)") }
    close(f.fd)
    if f.writable { coordinator.noteWriterClosed(f.inode) }
    if last && unlinked { forgetContent(f.inode) }
    _ = fuse_reply_err(req, 0)
  }

  func fallocate(
    _ req: fuse_req_t?, _ mode: Int32, _ off: off_t, _ len: off_t, _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    guard let fi, let f = handles.get(fi.pointee.fh) else { return fail(req, EBADF) }
    guard mode == 0 else { return fail(req, EOPNOTSUPP) }
    let r = posix_fallocate(f.fd, off, len)
    if r != 0 { return fail(req, r) }
    coordinator.noteWrite(f.inode, handleWasClean: !f.dirty)
    f.dirty = true
    handles.noteWrite(f.inode, mtimeNs: Clock.nowNs())
    _ = fuse_reply_err(req, 0)
  }

  func statfs(_ req: fuse_req_t?) {
    var sv = statvfs()
    if statvfs(cache.directory, &sv) != 0 { return fail(req, errno) }
    sv.f_namemax = UInt(ItemName.maxBytes)
    _ = fuse_reply_statfs(req, &sv)
  }
}

extension UbiqFilesystem {
  /// Called (under the inode lock) right after a remote version replaced the cached content.
  public func contentReplaced(_ inode: Int64) { pageEpochs.contentReplaced(inode) }

  /// Drops replaced or deleted local content and tells the kernel what changed remotely.
  public func remoteChangesApplied(_ results: [RemoteApplyResult]) {
    for r in results {
      guard let inode = r.inode else { continue }
      switch r.outcome {
      case .unchanged, .deferred, .locallyModified:
        // Nothing the kernel shows changed (often the echo of our own upload): keep its caches.
        continue
      case .deleted:
        if handles.liveState(inode) == nil { forgetContent(inode) }
      default:
        // Replaced content was already dropped under the inode lock by whoever applied the
        // change (ChangePuller, UploadWorker); here only the kernel learns of it.
        break
      }
      invalidate(inode, r.staleEntries)
    }
  }

  /// Evicts a file's local content if it is uploaded, not pinned and not open.
  func evict(_ row: ItemRow) throws {
    guard row.kind == .file else { return }
    let inode = row.id!
    if row.content == .dataless { return }
    try coordinator.withInodeLock(inode) {
      if downloader?.isDownloading(inode) == true { throw UbiqError.busy("\(row.name) is being downloaded") }
      if handles.liveState(inode) != nil { throw UbiqError.busy("\(row.name) is open") }
      if row.pinned { throw UbiqError.busy("\(row.name) is pinned") }
      guard try index.markEvicted(inode) else {
        throw UbiqError.busy("\(row.name) has changes not yet uploaded")
      }
      if row.size > 0 { cache.remove(inode) }
    }
    // Same bytes, different st_blocks: cached pages stay valid.
    invalidateAttributes(inode)
  }
}

extension UbiqFilesystem {
  /// Evicts least-recently-used clean content until the cache fits its budget and the disk keeps
  /// its minimum free space. Never evicts dirty, open or pinned files. Returns bytes freed.
  @discardableResult
  public func enforceCacheBudget() -> Int64 {
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
      if handles.liveState(row.id!) != nil || coordinator.isBusy(row.id!) { continue }
      if (try? evict(row)) != nil {
        freed += row.size
        log.debug("cache budget: evicted \(row.name) (\(row.size) bytes)")
      }
      if !overBudget() { break }
    }
    return freed
  }
}

extension UbiqFilesystem {
  /// Tells the kernel that attributes it may have cached changed outside its view.
  public func attributesChanged(_ inode: Int64) { invalidateAttributes(inode) }
}
