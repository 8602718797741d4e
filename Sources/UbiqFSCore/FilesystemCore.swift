import CLinux
import Foundation
import Logging
import UbiqCloudAPI
import UbiqCore
import UbiqIndex
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// The POSIX filesystem of one mounted container, without FUSE: typed requests in, typed
/// results or a `UbiqError` (which carries the errno) out. Answers from the local index
/// (metadata) and the content cache (file bytes); records every change in the index and its
/// durable upload queue; never waits on the network for metadata.
///
/// Concurrency: called on many threads at once (the FUSE adapter's worker pool, tests). Each
/// piece of shared state has one owner with its own lock: `InodeTable` (all per-inode state in
/// memory, and the per-inode lock that orders content transitions), `HandleTable` (open
/// handles by number), `Downloader` (running downloads); the index serializes its own writes.
/// Content transitions of one inode (open, truncate, first write, flush, evict, remote
/// replacement, download completion) run under that inode's lock.
/// Sendable: the callbacks and `downloader` are set before the mount starts; `forgotten` is
/// guarded by `forgottenLock`.
public final class FilesystemCore: @unchecked Sendable {
  public let index: IndexStore
  public let cache: ContentCache
  public let inodes: InodeTable
  public let container: ContainerID
  public let options: MountOptions
  let log: Logger
  let handles = HandleTable()
  /// Fetches evicted content; nil means content can never be downloaded.
  public var downloader: Downloader?
  /// Tells the kernel to forget cached attributes/pages of an inode and cached (parent, name)
  /// entries. Set by the FUSE session.
  public var invalidate: (_ inode: Int64?, _ entries: [(Int64, String)]) -> Void = { _, _ in }
  /// Tells the kernel to forget cached attributes of an inode, keeping its pages.
  public var invalidateAttributes: (Int64) -> Void = { _ in }
  /// Called after something was queued for upload.
  var onQueued: () -> Void = {}
  /// Percent uploaded of an item whose upload is in flight.
  public var uploadPercent: (Int64) -> Int? = { _ in nil }
  /// Whether the uploader is sending an inode's content now (set by the daemon).
  public var isUploading: (Int64) -> Bool = { _ in false }
  /// Reads the cloud's change feed again from its start (`user.ubiq.action` = resync); nil
  /// where nothing pulls (the action is refused).
  public var resync: (() -> Void)?
  /// Called when the last handle of a file closes (a remote version may wait for it).
  public var lastClosed: ((Int64) -> Void)?
  let xattrSnapshots = XattrSnapshots()
  /// Drops the kernel's pages of an inode after a read through a handle older than its
  /// content (`didRead`): outside the request, one drop at a time.
  private let pageDrops = DispatchQueue(label: "ubiqfs.page-drops")
  /// Items whose cache files wait for `removeForgottenContent`.
  private var forgotten: [Int64] = []
  private let forgottenLock = NSLock()

  /// The largest file ubiqfs stores (16 TiB, ext4's limit); larger sizes get EFBIG.
  public static let maxFileSize: Int64 = 1 << 44

  public init(
    index: IndexStore, cache: ContentCache, inodes: InodeTable, container: ContainerID,
    options: MountOptions, logger: Logger, onQueued: @escaping () -> Void
  ) {
    self.index = index
    self.cache = cache
    self.inodes = inodes
    self.container = container
    self.options = options
    self.log = logger
    self.onQueued = onQueued
  }

  // MARK: - helpers

  /// Validates a name from the kernel (ENAMETOOLONG beyond 255 bytes).
  func checkName(_ n: String) throws {
    if n.utf8.count > ItemName.maxBytes { throw UbiqError.nameTooLong(n) }
  }

  func requireRow(_ inode: Int64) throws -> ItemRow {
    guard let row = try index.item(inode) else { throw UbiqError.notFound("inode \(inode)") }
    return row
  }

  /// The attributes of `row`. `subdirectories`: for a directory, the count of directories in
  /// it if the caller read it with the row (it is read here otherwise).
  func attributes(for row: ItemRow, subdirectories: Int? = nil) -> FileAttributes {
    let ino = row.id!
    var size = row.size
    var mtime = row.mtimeNs
    if row.kind == .file, let live = inodes.openFileState(ino) {
      if let s = live.size { size = s }
      if let m = live.pendingMtimeNs { mtime = m }
    }
    var links = 1
    if row.kind == .directory {
      size = 4096
      links = 2 + (subdirectories ?? (try? index.subdirectoryCount(ino)) ?? 0)
    }
    // An evicted file keeps its size but occupies nothing locally.
    let blocks = (row.kind == .file && row.content == .dataless) ? 0 : (size + 511) / 512
    // Writes not recorded yet changed the inode when they moved its mtime; an mtime set
    // explicitly (in the future, say) is no change time.
    let ctime = mtime != row.mtimeNs ? max(row.ctimeNs, mtime) : row.ctimeNs
    return FileAttributes(
      inode: ino, kind: row.kind, mode: row.mode & 0o7777, linkCount: links, uid: row.uid, gid: row.gid, size: size,
      blocks: blocks, atimeNs: row.atimeNs, mtimeNs: mtime, ctimeNs: ctime)
  }

  /// The command name (/proc/PID/comm, at most 15 bytes) of a process.
  func programName(_ pid: Int32) -> String? {
    guard pid > 0, let comm = try? String(contentsOfFile: "/proc/\(pid)/comm", encoding: .utf8) else { return nil }
    let name = comm.trimmingCharacters(in: .whitespacesAndNewlines)
    // comm is truncated to 15 bytes: match configured names by the same prefix.
    return options.noDownloadPrograms.first { String($0.utf8.prefix(15)) == name } ?? name
  }

  // MARK: - namespace

  /// The attributes of `name` in `parent`, or nil if there is none (a negative entry).
  public func lookup(parent: Int64, name: String) throws -> FileAttributes? {
    try checkName(name)
    guard let found = try index.childWithSubdirectoryCount(of: parent, named: name) else { return nil }
    return attributes(for: found.row, subdirectories: found.subdirectories)
  }

  public func getattr(_ inode: Int64) throws -> FileAttributes {
    if let found = try index.itemWithSubdirectoryCount(inode) {
      return attributes(for: found.row, subdirectories: found.subdirectories)
    }
    // An open file that was unlinked.
    if let o = inodes.unlinkedAttributes(inode), let live = inodes.openFileState(inode, anyHandle: true) {
      let size = live.size ?? 0
      let mtime = live.pendingMtimeNs ?? o.mtimeNs
      return FileAttributes(
        inode: inode, kind: .file, mode: o.mode & 0o7777, linkCount: 0, uid: o.uid, gid: o.gid, size: size,
        blocks: (size + 511) / 512, atimeNs: o.mtimeNs, mtimeNs: mtime, ctimeNs: mtime)
    }
    if let removed = removedDirectoryAttributes(inode) { return removed }
    throw UbiqError.notFound("inode \(inode)")
  }

  public func setattr(_ inode: Int64, _ update: AttributeUpdate, handle: UInt64? = nil) throws -> FileAttributes {
    if inodes.removedDirectoryAttributes(inode) != nil, try index.item(inode) == nil {
      // A removed directory's mode, owner and times live in memory until it is forgotten.
      inodes.changeRemovedDirectory(inode) { a in
        if let mode = update.mode { a.mode = mode }
        if let uid = update.uid { a.uid = uid }
        if let gid = update.gid { a.gid = gid }
        switch update.mtime {
        case .now: a.mtimeNs = index.clock.nowNs()
        case .at(let t): a.mtimeNs = t
        case nil: break
        }
      }
      return try getattr(inode)
    }
    var c = AttributeChanges()
    let now = self.index.clock.nowNs()
    c.mode = update.mode
    c.uid = update.uid
    c.gid = update.gid
    switch update.atime {
    case .now: c.atimeNs = now
    case .at(let t): c.atimeNs = t
    case nil: break
    }
    switch update.mtime {
    case .now: c.mtimeNs = now
    case .at(let t): c.mtimeNs = t
    case nil: break
    }
    // An explicit mtime (cp -p, touch) replaces the time of earlier writes.
    if c.mtimeNs != nil { inodes.clearPendingMtime(inode) }
    if let size = update.size {
      let row = try requireRow(inode)
      if row.kind == .directory { throw UbiqError.isDirectory(row.name) }
      if row.kind != .file { throw UbiqError.invalidArgument("not a regular file") }
      guard size >= 0 else { throw UbiqError.invalidArgument("negative size") }
      guard size <= Self.maxFileSize else { throw UbiqError.fileTooLarge("\(size) bytes") }
      let open = handle.flatMap { handles.get($0) }
      func truncate() throws {
        // Through a handle that may write (ftruncate), the truncation is that handle's write: the
        // upload waits for its flush, as after an open with O_TRUNC.
        if let open, open.writable { try handleBeginsWriting(open) }
        try truncateContent(inode, to: size, through: open?.fd)
      }
      if size != 0 {
        // A size other than 0 keeps a prefix of the content, so the content must be here.
        try withContentCached(inode, interruption: nil) { _ in try truncate() }
      } else {
        try inodes.withInodeLock(inode) { try truncate() }
      }
      c.size = size
      if c.mtimeNs == nil { c.mtimeNs = now }
      inodes.clearPendingMtime(inode)
    }
    _ = try index.setAttributes(inode, c)
    if c.syncs { onQueued() }
    return attributes(for: try requireRow(inode))
  }

  /// The content transitions, over this core's index, cache, inode table and downloader.
  var content: FileContent {
    FileContent(index: index, cache: cache, inodes: inodes, downloads: downloader, logger: log)
  }

  /// Sets the content of `inode` to its first `size` bytes (`FileContent.truncate`). Runs under
  /// the inode lock.
  func truncateContent(_ inode: Int64, to size: Int64, through fd: Int32?) throws {
    try content.truncate(inode, to: size, through: fd)
    onQueued()
  }

  /// Inserts an item. `inserted` runs inside the insert's transaction (`IndexStore.create`).
  /// A regular file starts with no cache file; one left under its new inode number (a power
  /// loss rolled the index back past an earlier insert, and the mount's sweep missed its file)
  /// is removed first, so its bytes never become the new file's.
  func makeItem(
    parent: Int64, name: String, kind: ItemKind, mode: UInt32, caller: Caller, target: String? = nil,
    inserted: (Int64) -> Void = { _ in }
  ) throws -> ItemRow {
    try checkName(name)
    let row = try index.create(
      parent: parent, name: name, kind: kind, mode: mode & 0o7777, uid: caller.uid, gid: caller.gid,
      symlinkTarget: target, inserted: inserted)
    if kind == .file, cache.exists(row.id!) {
      log.warning("a cache file was left under the new inode \(row.id!); removed")
      cache.remove(row.id!)
    }
    onQueued()
    return row
  }

  public func mkdir(parent: Int64, name: String, mode: UInt32, caller: Caller) throws -> FileAttributes {
    attributes(for: try makeItem(parent: parent, name: name, kind: .directory, mode: mode, caller: caller))
  }

  /// `mode` includes the file type bits; only regular files can be made this way.
  public func mknod(parent: Int64, name: String, mode: UInt32, caller: Caller) throws -> FileAttributes {
    guard mode & S_IFMT == S_IFREG else {
      throw UbiqError.notPermitted("only regular files, directories and symlinks can be stored")
    }
    // An empty file needs no cache file: the first open that needs one makes it
    // (`FileContent.isPresent`).
    let row = try makeItem(parent: parent, name: name, kind: .file, mode: mode, caller: caller)
    return attributes(for: row)
  }

  public func symlink(parent: Int64, name: String, target: String, caller: Caller) throws -> FileAttributes {
    if target.isEmpty || target.utf8.count > 4095 { throw UbiqError.invalidArgument("bad symlink target") }
    return attributes(
      for: try makeItem(parent: parent, name: name, kind: .symlink, mode: 0o777, caller: caller, target: target))
  }

  public func readlink(_ inode: Int64) throws -> String {
    let row = try requireRow(inode)
    guard row.kind == .symlink, let t = row.symlinkTarget else { throw UbiqError.invalidArgument("not a symlink") }
    return t
  }

  public func unlink(parent: Int64, name: String) throws { try remove(parent: parent, name: name, directory: false) }
  public func rmdir(parent: Int64, name: String) throws { try remove(parent: parent, name: name, directory: true) }

  func remove(parent: Int64, name: String, directory: Bool) throws {
    try checkName(name)
    let row = try index.remove(parent: parent, name: name, directory: directory)
    if directory, let inode = row.id {
      inodes.directoryRemoved(
        inode, UnlinkedAttributes(mode: row.mode, uid: row.uid, gid: row.gid, mtimeNs: row.mtimeNs))
    }
    dispose(row)
    onQueued()
  }

  /// The row of `inode`, or nil for a directory removed while the kernel still holds it (it
  /// answers as an empty directory with no links). Throws `notFound` for anything else gone.
  func rowUnlessRemovedDirectory(_ inode: Int64) throws -> ItemRow? {
    if let row = try index.item(inode) { return row }
    if inodes.removedDirectoryAttributes(inode) != nil { return nil }
    throw UbiqError.notFound("inode \(inode)")
  }

  /// The attributes of a directory removed while the kernel still holds it (an open
  /// descriptor, a working directory): as on ext4, an empty directory with no links.
  func removedDirectoryAttributes(_ inode: Int64) -> FileAttributes? {
    guard let d = inodes.removedDirectoryAttributes(inode) else { return nil }
    return FileAttributes(
      inode: inode, kind: .directory, mode: d.mode & 0o7777, linkCount: 0, uid: d.uid, gid: d.gid, size: 0,
      blocks: 0, atimeNs: d.mtimeNs, mtimeNs: d.mtimeNs, ctimeNs: d.mtimeNs)
  }

  /// Drops the local content of a row that left the namespace (now, or at its last release).
  func dispose(_ row: ItemRow) {
    guard let inode = row.id, row.kind == .file else { return }
    let attributes = UnlinkedAttributes(mode: row.mode, uid: row.uid, gid: row.gid, mtimeNs: row.mtimeNs)
    if !inodes.markUnlinked(inode, attributes) { forgetContent(inode) }
  }

  /// The item's row is gone (deleted, replaced by a rename; inode numbers are never reused)
  /// and no handle holds it open: its download stops, its state in memory goes, and its cache
  /// file is removed once the index commit that dropped the row is durable: a power loss
  /// before that brings the row back, which must find its bytes (a name removal is durable at
  /// once on most filesystems, a commit is not).
  func forgetContent(_ inode: Int64) {
    downloader?.supersede(inode)
    forgottenLock.withLock { forgotten.append(inode) }
    inodes.itemGone(inode)
  }

  /// Removes the cache files of forgotten items, making the index durable first if asked (it
  /// already is right after an fsync). Runs after fsync/fsyncdir, every few seconds from the
  /// daemon's timer and at unmount; a crash leaves the files to the sweep at the next mount.
  public func removeForgottenContent(makeDurable: Bool = true) throws {
    let inodes = forgottenLock.withLock {
      defer { forgotten = [] }
      return forgotten
    }
    guard !inodes.isEmpty else { return }
    do {
      if makeDurable { try index.makeDurable() }
    } catch {
      forgottenLock.withLock { forgotten = inodes + forgotten }
      throw error
    }
    for inode in inodes { cache.remove(inode) }
  }

  public func rename(parent: Int64, name: String, newParent: Int64, newName: String, flags: RenameFlags) throws {
    try checkName(name)
    try checkName(newName)
    let mode: IndexStore.RenameMode
    if flags == .exchange {
      mode = .exchange
    } else if flags == .noReplace {
      mode = .noReplace
    } else if flags.isEmpty {
      mode = .replace
    } else {
      throw UbiqError.invalidArgument("unsupported rename flags \(flags.rawValue)")
    }
    let result = try keepingContentLocal {
      try index.rename(parent: parent, name: name, newParent: newParent, newName: newName, mode: mode)
    }
    if let replaced = result.replaced { dispose(replaced) }
    onQueued()
  }

  /// Hard links have no equivalent in the cloud model; tools (git, rsync) fall back to copies.
  public func link() throws -> Never { throw UbiqError.notPermitted("hard links are not supported") }

  // MARK: - directories

  public func opendir(_ inode: Int64) throws {
    guard let dir = try rowUnlessRemovedDirectory(inode) else { return }
    guard dir.isDirectory else { throw UbiqError.notDirectory(dir.name) }
  }

  /// Lists `inode` from cursor `offset` (0 at the start), calling `add` for each entry until it
  /// returns false (the reply buffer is full). Offsets: 1 = ".", 2 = "..", then 2 + child inode,
  /// a cursor that stays valid while the directory changes.
  public func readdir(_ inode: Int64, offset: Int64, batch: Int = 256, _ add: (DirectoryEntry) -> Bool) throws {
    var offset = offset
    if offset < 2 {
      // Past "." and "..", the folder's own row is not needed: the entries are its children.
      // A removed directory lists nothing, as on ext4.
      guard let dir = try rowUnlessRemovedDirectory(inode) else { return }
      guard dir.isDirectory else { throw UbiqError.notDirectory(dir.name) }
      if offset < 1 {
        var a = attributes(for: dir)
        a.inode = inode
        if !add(DirectoryEntry(name: ".", attributes: a, nextOffset: 1)) { return }
        offset = 1
      }
      var a = attributes(for: dir)
      a.inode = dir.parent ?? inode
      if !add(DirectoryEntry(name: "..", attributes: a, nextOffset: 2)) { return }
      offset = 2
    }
    var after = offset - 2
    while true {
      let rows = try index.children(of: inode, after: after, limit: max(16, min(1024, batch)))
      if rows.isEmpty { return }
      for row in rows {
        if !add(DirectoryEntry(name: row.name, attributes: attributes(for: row), nextOffset: row.id! + 2)) { return }
        after = row.id!
      }
    }
  }

  // MARK: - files

  public func open(
    _ inode: Int64, flags: Int32, caller: Caller, interruption: Interruption? = nil
  ) throws -> OpenedFile {
    var row = try requireRow(inode)
    if row.kind == .directory { throw UbiqError.isDirectory(row.name) }
    let writable = flags & O_ACCMODE != O_RDONLY
    // As on Linux: O_TRUNC truncates also through a read-only open (the kernel checked write
    // permission), and moves mtime and ctime also when the file is already empty.
    if flags & O_TRUNC != 0 && (!writable || (row.size == 0 && row.content == .cached)) {
      _ = try setattr(inode, AttributeUpdate(size: 0))
      row = try requireRow(inode)
    }
    if row.content == .dataless, let who = programName(caller.pid), options.noDownloadPrograms.contains(who) {
      log.info("refused download of \(row.name) for \(who) (no-download program)")
      throw UbiqError.accessDenied("\(who) may not download content")
    }
    // The handle is registered under the inode lock, so an eviction (which takes the same
    // lock) either ran before this open or sees the handle and refuses.
    func register(_ fd: Int32, _ stream: ContentStream?, dirty: Bool = false) -> UInt64 {
      let file = OpenFile(inode: inode, fd: fd, writable: writable, readAhead: newReadAheadWindow())
      file.stream = stream
      file.dirty = dirty
      let h = handles.add(file)
      file.epoch = inodes.opened(inode, handle: h, fd: fd, writable: writable)
      return h
    }
    let h: UInt64
    if writable && flags & O_TRUNC == 0 {
      // A writer needs the whole content here first.
      h = try withContentCached(inode, interruption: interruption) { _ in
        return register(try cache.open(inode, create: false), nil)
      }
    } else {
      h = try inodes.withInodeLock(inode) {
        let (fd, stream, dirty) = try openCacheFile(inode, flags: flags)
        return register(fd, stream, dirty: dirty)
      }
    }
    handles.noteUse(inode)
    // Local writes go through the kernel's page cache, so cached pages stay valid, unless the
    // content was replaced remotely since (see `InodeTable.contentReplaced`).
    return OpenedFile(handle: h, keepCache: inodes.mayKeepPages(inode))
  }

  /// A new handle's read-ahead: at most 64 MiB, and at most a quarter of the cache budget.
  func newReadAheadWindow() -> ReadAheadWindow {
    var maximum: Int64 = 64 << 20
    if options.cacheBudgetBytes > 0 { maximum = min(maximum, max(1 << 20, options.cacheBudgetBytes / 4)) }
    return ReadAheadWindow(initial: 1 << 20, maximum: maximum)
  }

  /// Opens the cache file of `inode` for a new handle that does not need the old content, under
  /// the inode lock: truncated for O_TRUNC (works offline, downloads nothing), streamed (the
  /// returned download, which the handle gives back when it closes) for readers of evicted
  /// content. `dirty`: the truncation counts as the new handle's first write, so the upload
  /// waits for the handle's flush and the empty file between the truncation and the writes that
  /// follow (`echo new > f`) never leaves the device.
  func openCacheFile(_ inode: Int64, flags: Int32) throws -> (Int32, ContentStream?, dirty: Bool) {
    let current = try requireRow(inode)
    let writable = flags & O_ACCMODE != O_RDONLY
    if writable {
      let fd = try cache.open(inode, create: true)
      do {
        guard content.openTruncates(current, cacheFile: fd) else { return (fd, nil, false) }
        try content.writeBegins(inode)
        do {
          try truncateContent(inode, to: 0, through: fd)
        } catch {
          inodes.noteFlushed(inode)
          throw error
        }
        inodes.clearPendingMtime(inode)
        return (fd, nil, true)
      } catch {
        close(fd)
        throw error
      }
    }
    var stream: ContentStream?
    if try !content.isPresent(current) {
      guard let downloader else { throw UbiqError.io("content of \(current.name) is not downloaded") }
      // Each read waits only for its own range.
      stream = try downloader.openReader(inode)
    }
    do {
      return (try cache.open(inode, create: false), stream, false)
    } catch {
      if let stream { downloader?.closeReader(stream) }
      throw error
    }
  }

  /// Runs `body` under the inode lock with the file's content in the cache (for anything that
  /// is not a file, at once). A download waits outside the lock, so other inodes that share
  /// its stripe go on and the caller can be interrupted; the content is then looked at again
  /// under the lock (an eviction or a remote version may have come in between).
  func withContentCached<T>(_ inode: Int64, interruption: Interruption?, _ body: (ItemRow) throws -> T) throws -> T {
    for _ in 0..<3 {
      let result = try inodes.withInodeLock(inode) { () throws -> T? in
        let row = try requireRow(inode)
        if row.kind != .file { return try body(row) }
        return try content.isPresent(row) ? try body(row) : nil
      }
      if let result { return result }
      guard let downloader else { throw UbiqError.io("content of inode \(inode) is not downloaded") }
      do {
        try downloader.ensureCached(inode, interruption: interruption)
      } catch let e as CloudError {
        log.warning("download of inode \(inode) failed: \(e)")
        throw UbiqError.io("download failed: \(e)")
      }
    }
    throw UbiqError.busy("the content keeps changing; try again")
  }

  /// Creates and opens a regular file (O_CREAT with O_EXCL semantics: the kernel only asks when
  /// the name is free).
  public func create(parent: Int64, name: String, mode: UInt32, caller: Caller) throws -> (
    FileAttributes, OpenedFile
  ) {
    // Until its creator's first flush the file is that writer's, from inside the insert's
    // transaction on: the upload waits for it, so the empty file between the create and the
    // writes never leaves the device. The index is written once (the insert): the dirty mark
    // waits for a first write.
    var held: Int64?
    let row: ItemRow
    do {
      row = try makeItem(parent: parent, name: name, kind: .file, mode: mode, caller: caller) { inode in
        content.createdForWriting(inode)
        held = inode
      }
    } catch {
      if let held { inodes.noteFlushed(held) }
      throw error
    }
    // The handle opens the cache file when a request first needs it (`descriptor`): a file
    // closed unwritten (touch, a lock file) costs the index insert and nothing on disk.
    let file = OpenFile(inode: row.id!, fd: nil, writable: true)
    inodes.withInodeLock(row.id!) {
      file.dirty = true
      file.createdUnwritten = true
    }
    let h = handles.add(file)
    file.epoch = inodes.opened(row.id!, handle: h, fd: nil, writable: true)
    return (attributes(for: row), OpenedFile(handle: h, keepCache: true))
  }

  func openHandle(_ handle: UInt64) throws -> OpenFile {
    guard let f = handles.get(handle) else { throw UbiqError.invalidArgument("bad file handle \(handle)") }
    return f
  }

  /// The cache file descriptor of `f`, opening the cache file (made if there is none: the
  /// file is empty, or another handle made it) if the handle has no descriptor yet.
  func descriptor(_ f: OpenFile) throws -> Int32 {
    if let fd = f.fd { return fd }
    return try inodes.withInodeLock(f.inode) { try descriptorUnderInodeLock(f) }
  }

  /// `descriptor` under the inode lock.
  func descriptorUnderInodeLock(_ f: OpenFile) throws -> Int32 {
    if let fd = f.fd { return fd }
    let fd = try cache.open(f.inode, create: true)
    f.setDescriptor(fd)
    inodes.descriptorOpened(f.inode, handle: f.number, fd: fd)
    return fd
  }

  /// Waits until [offset, offset+size) of the handle's file is present and returns the cache
  /// file descriptor to read it from. `didRead` must follow the read.
  public func prepareRead(
    _ handle: UInt64, offset: Int64, size: Int, interruption: Interruption? = nil
  ) throws -> Int32 {
    if let fd = try readableDescriptor(handle, offset: offset, size: size) { return fd }
    return try waitForRead(handle, offset: offset, size: size, interruption: interruption)
  }

  /// The first half of `prepareRead`, which never waits: asks for the range (and the
  /// handle's read-ahead) and returns the descriptor to read it from if it is here, or nil if
  /// the read must wait for the cloud (`waitForRead`).
  public func readableDescriptor(_ handle: UInt64, offset: Int64, size: Int) throws -> Int32? {
    let f = try openHandle(handle)
    // `stream` is set once at open and never changed, so reading it here is race-free.
    if let s = f.stream, let downloader, !(s.finished && s.failed == nil) {
      let ahead = f.fetchLimit(afterReadAt: offset, length: size)
      if !downloader.requestRange(s, offset, size, fetchAheadTo: ahead) { return nil }
    }
    return try descriptor(f)
  }

  /// The second half of `prepareRead`: waits for a range `readableDescriptor` asked for.
  public func waitForRead(
    _ handle: UInt64, offset: Int64, size: Int, interruption: Interruption? = nil
  ) throws -> Int32 {
    let f = try openHandle(handle)
    if let s = f.stream, let downloader, !(s.finished && s.failed == nil) {
      try downloader.waitForRequestedRange(s, offset, size, interruption: interruption)
    }
    return try descriptor(f)
  }

  /// True if an open of `inode` with `flags` waits for a download: an open that may write
  /// (without O_TRUNC) needs the whole content, and it is not here.
  public func openWaitsForContent(_ inode: Int64, flags: Int32) throws -> Bool {
    guard flags & O_ACCMODE != O_RDONLY, flags & O_TRUNC == 0, let row = try index.item(inode) else { return false }
    return row.kind == .file && row.content != .cached
  }

  /// A read through `handle` was answered. If the handle is older than the inode's content, the
  /// answer may have put old bytes in the kernel's page cache, which every open shares: they are
  /// dropped (see `InodeTable.noteRead`).
  public func didRead(_ handle: UInt64) {
    guard let f = handles.get(handle), inodes.noteRead(f.inode, openedIn: f.epoch) else { return }
    let inode = f.inode
    pageDrops.async { [self] in
      inodes.pageDropStarting(inode)
      invalidate(inode, [])
    }
  }

  /// Reads bytes through a handle (tests and tools; the FUSE adapter splices from the descriptor).
  public func read(_ handle: UInt64, offset: Int64, size: Int) throws -> Data {
    let fd = try prepareRead(handle, offset: offset, size: size)
    var data = Data(count: size)
    let n = data.withUnsafeMutableBytes { raw -> Int in
      var done = 0
      while done < size {
        let r = pread(fd, raw.baseAddress! + done, size - done, off_t(offset) + off_t(done))
        if r < 0 && errno == EINTR { continue }
        if r <= 0 { return r < 0 && done == 0 ? -1 : done }
        done += r
      }
      return done
    }
    if n < 0 { throw UbiqError.posix(errno, "read") }
    didRead(handle)
    return data.prefix(n)
  }

  public func write(_ handle: UInt64, _ bytes: UnsafeRawBufferPointer, offset: Int64) throws -> Int {
    try write(handle, count: bytes.count, offset: offset) { fd in
      var done = 0
      while done < bytes.count {
        let n = pwrite(fd, bytes.baseAddress! + done, bytes.count - done, off_t(offset) + off_t(done))
        if n < 0 {
          if errno == EINTR { continue }
          throw UbiqError.posix(errno, "write")
        }
        done += n
      }
      return done
    }
  }

  /// Writes `count` bytes at `offset` through the handle: `copy` puts them into the cache file
  /// whose descriptor it is given, at `offset`, and returns how many it wrote (fewer only when
  /// the disk refused the rest). The FUSE adapter copies straight from the pipe the kernel's
  /// request was spliced into.
  public func write(
    _ handle: UInt64, count: Int, offset: Int64, copy: (_ fd: Int32) throws -> Int
  ) throws -> Int {
    let f = try openHandle(handle)
    let (end, overflow) = offset.addingReportingOverflow(Int64(count))
    guard offset >= 0, count >= 0, !overflow, end <= Self.maxFileSize else {
      throw UbiqError.fileTooLarge("write past 16 TiB")
    }
    return try f.withWrite {
      try beginWrite(f)
      let done = try copy(try descriptor(f))
      inodes.noteWritten(f.inode, mtimeNs: self.index.clock.nowNs())
      return done
    }
  }

  /// Called before a write through `f` changes the cache file. The generation moves first, so
  /// an upload snapshot taken before it is thrown away and one taken after it waits. A handle's
  /// first write since its last flush leaves a durable mark in the index, so a crash before the
  /// flush is found at the next mount and the bytes are recorded and uploaded.
  func beginWrite(_ f: OpenFile) throws {
    if f.dirty && !f.createdUnwritten {
      inodes.beginWrite(f.inode, handleWasClean: false)
      return
    }
    try inodes.withInodeLock(f.inode) { try handleBeginsWriting(f) }
  }

  /// `beginWrite` under the inode lock: a clean handle becomes dirty (`FileContent.writeBegins`),
  /// the handle that created the file leaves its dirty mark, a dirty one moves the generation.
  func handleBeginsWriting(_ f: OpenFile) throws {
    if f.createdUnwritten {
      _ = try descriptorUnderInodeLock(f)
      try content.createdFileWriteBegins(f.inode)
      f.createdUnwritten = false
    } else if f.dirty {
      inodes.beginWrite(f.inode, handleWasClean: false)
    } else {
      try content.writeBegins(f.inode)
      f.dirty = true
    }
  }

  /// Records the handle's writes in the index and queues the upload.
  func persist(_ f: OpenFile) throws {
    let recorded = try f.withWritesQuiesced { () throws -> Bool in
      guard f.dirty else { return false }
      if f.createdUnwritten {
        inodes.withInodeLock(f.inode) {
          content.createdFileFlushedUnwritten(f.inode)
          f.dirty = false
          f.createdUnwritten = false
        }
        return true  // the upload queued at the create may go now
      }
      var st = Glibc.stat()
      if fstat(try descriptor(f), &st) != 0 { throw UbiqError.posix(errno, "fstat of the cache file") }
      // nil: the mtime was set explicitly after the last write; keep it.
      let mtime = inodes.takePendingMtime(f.inode)
      try inodes.withInodeLock(f.inode) {
        // The last dirty handle clears the durable mark in the same transaction.
        let clean = inodes.dirtyHandleCount(f.inode) <= 1
        try content.writesRecorded(f.inode, size: Int64(st.st_size), mtimeNs: mtime, clean: clean)
        f.dirty = false
      }
      return true
    }
    if recorded { onQueued() }
  }

  public func flush(_ handle: UInt64) throws { try persist(try openHandle(handle)) }

  /// Records the handle's writes, makes the cache file's bytes durable (everything recorded up
  /// to the revision read before the fdatasync is covered, whichever handle wrote it), then the
  /// index. After a power loss the index never describes bytes the cache file lost.
  public func fsync(_ handle: UInt64, dataOnly: Bool) throws {
    let f = try openHandle(handle)
    try persist(f)
    let revision = try index.item(f.inode)?.revision
    let fd = try descriptor(f)
    if (dataOnly ? fdatasync(fd) : Glibc.fsync(fd)) != 0 { throw UbiqError.posix(errno, "fsync") }
    try cache.syncDirectory()
    if let revision { try content.bytesDurable(f.inode, upTo: revision) }
    try index.makeDurable()
    try removeForgottenContent(makeDurable: false)
  }

  /// The directory's entries are in the index: an fsync of it makes the index durable.
  public func fsyncDirectory(_ inode: Int64) throws {
    try opendir(inode)
    try cache.syncDirectory()
    try index.makeDurable()
    try removeForgottenContent(makeDurable: false)
  }

  public func release(_ handle: UInt64) {
    guard let f = handles.remove(handle) else { return }
    do {
      try persist(f)
    } catch {
      // The durable dirty mark stays: the bytes are recorded at the next flush of the file or
      // the next mount. The handle no longer blocks uploads of the file.
      log.error("release: recording the writes failed: \(error)")
    }
    if let s = f.stream, let downloader {
      inodes.withInodeLock(f.inode) { downloader.closeReader(s) }
    }
    let lastOfUnlinked = inodes.closed(f.inode, handle: handle, writable: f.writable, wasDirty: f.dirty) != nil
    if let fd = f.fd { close(fd) }
    if lastOfUnlinked { forgetContent(f.inode) }
    if !inodes.isOpen(f.inode) { lastClosed?(f.inode) }
  }

  /// Linux's FALLOC_FL_KEEP_SIZE: reserve space, keep the size.
  static let fallocateKeepSize: Int32 = 0x01

  /// fallocate modes 0 (allocate, growing the file) and keep-size; the others (punch hole,
  /// zero range, collapse, insert) are not supported (EOPNOTSUPP).
  public func fallocate(_ handle: UInt64, mode: Int32, offset: Int64, length: Int64) throws {
    let f = try openHandle(handle)
    guard mode == 0 || mode == Self.fallocateKeepSize else {
      throw UbiqError.notSupported("fallocate mode \(mode)")
    }
    let (end, overflow) = offset.addingReportingOverflow(length)
    guard offset >= 0, length > 0 else { throw UbiqError.invalidArgument("fallocate range") }
    guard !overflow, end <= Self.maxFileSize else { throw UbiqError.fileTooLarge("fallocate past 16 TiB") }
    if mode == Self.fallocateKeepSize {
      // Space reserved in the cache file (rsync --preallocate); the size and the bytes stay, so
      // there is no change to record.
      try f.withWrite {
        let r = ubiq_fallocate_keep_size(try descriptor(f), offset, length)
        if r != 0 { throw UbiqError.posix(r, "fallocate") }
      }
      return
    }
    try f.withWrite {
      try beginWrite(f)
      let r = posix_fallocate(try descriptor(f), off_t(offset), off_t(length))
      if r != 0 { throw UbiqError.posix(r, "fallocate") }
      inodes.noteWritten(f.inode, mtimeNs: self.index.clock.nowNs())
    }
  }

  public func statfs() throws -> statvfs {
    var sv = statvfs()
    if statvfs(cache.directory, &sv) != 0 { throw UbiqError.posix(errno, "statfs") }
    sv.f_namemax = UInt(ItemName.maxBytes)
    return sv
  }

  /// Open handles (for tests and status).
  public var openHandleCount: Int { handles.count }

  // MARK: - the kernel's references

  /// A reply handed the kernel `count` entries of `inode` (FUSE's lookup count): lookup,
  /// create, mkdir, mknod, symlink, a readdirplus entry. Called before the reply is sent.
  public func entriesHanded(_ inode: Int64, count: UInt64 = 1) { inodes.noteLookup(inode, count: count) }

  /// The kernel forgot `count` of its entries of `inode`; when none is left and no handle is
  /// open, the inode's state in memory goes.
  public func forget(_ inode: Int64, count: UInt64) {
    let unknown = inodes.forget(inode, count: count)
    if unknown > 0 {
      // The count keeps an inode's page-cache epoch while the kernel may hold its pages.
      log.warning("the kernel forgot \(unknown) more entries of inode \(inode) than it was handed")
    }
  }
}
