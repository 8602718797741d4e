import CFuse3
import Foundation
import Logging
import Synchronization
import UbiqCore
import UbiqFSCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// The FUSE low-level callbacks of one mount, over a `FilesystemCore`: decodes the kernel's
/// arguments, calls the core, and replies exactly once (the result, or the error's errno).
/// Owns nothing but the conversion between C and the core's types, and what the kernel agreed
/// to at `init`.
/// Sendable: immutable references, and one atomic flag.
final class FuseAdapter: @unchecked Sendable {
  let core: FilesystemCore
  let log: Logger
  /// The kernel opens and releases directories itself (`FUSE_CAP_NO_OPENDIR_SUPPORT`): the
  /// first opendir is answered ENOSYS, which the kernel takes as success, and no opendir or
  /// releasedir is sent again; it caches listings as with `cache_readdir` and `keep_cache`.
  /// Set by the session's `init`, before any other request.
  let kernelOpensDirectories = Atomic<Bool>(false)
  var options: MountOptions { core.options }

  init(core: FilesystemCore, logger: Logger) {
    self.core = core
    self.log = logger
  }

  // MARK: - conversions

  func reply(_ req: fuse_req_t?, error: Error) {
    _ = fuse_reply_err(req, errno(for: error))
  }

  /// The errno a failure is reported with; unexpected errors are logged and become EIO.
  func errno(for error: Error) -> Int32 {
    if let e = error as? UbiqError { return e.errno }
    if let code = IndexStore.storageErrno(error) {
      log.warning("index storage: \(error)")
      return code
    }
    log.error("internal error: \(error)")
    return EIO
  }

  /// A name from the kernel. Names are stored exactly as given (no Unicode normalization, as on
  /// ext4); bytes that are not UTF-8 are refused with EILSEQ, never replaced.
  func name(_ p: UnsafePointer<CChar>?) throws -> String {
    guard let p else { return "" }
    guard let s = String(validatingCString: p) else {
      throw UbiqError.illegalByteSequence(String(decoding: Data(bytes: p, count: strlen(p)), as: UTF8.self))
    }
    return s
  }

  func caller(_ req: fuse_req_t?) -> Caller {
    guard let ctx = fuse_req_ctx(req) else { return .current }
    return Caller(uid: ctx.pointee.uid, gid: ctx.pointee.gid, pid: ctx.pointee.pid)
  }

  func stat(_ a: FileAttributes) -> stat {
    var st = Glibc.stat()
    st.st_ino = UInt(a.inode)
    let typeBits: UInt32
    switch a.kind {
    case .file: typeBits = S_IFREG
    case .directory: typeBits = S_IFDIR
    case .symlink: typeBits = S_IFLNK
    }
    st.st_mode = typeBits | a.mode
    st.st_nlink = UInt(a.linkCount)
    st.st_uid = a.uid
    st.st_gid = a.gid
    st.st_size = Int(a.size)
    st.st_blksize = 128 * 1024
    st.st_blocks = Int(a.blocks)
    st.st_atim = FileTime.timespec(a.atimeNs)
    st.st_mtim = FileTime.timespec(a.mtimeNs)
    st.st_ctim = FileTime.timespec(a.ctimeNs)
    return st
  }

  func entry(_ a: FileAttributes) -> fuse_entry_param {
    var e = fuse_entry_param()
    e.ino = fuse_ino_t(a.inode)
    e.generation = 1
    e.attr = stat(a)
    e.attr_timeout = options.attrTimeout
    e.entry_timeout = options.entryTimeout
    return e
  }

  /// Replies with an entry: the kernel then holds a reference to the inode (one more in its
  /// lookup count), counted before the reply goes so that its forget never arrives first.
  func replyEntry(_ req: fuse_req_t?, _ a: FileAttributes) {
    var e = entry(a)
    core.entriesHanded(a.inode)
    if fuse_reply_entry(req, &e) != 0 { core.forget(a.inode, count: 1) }
  }

  func setHandle(_ fi: UnsafeMutablePointer<fuse_file_info>?, _ opened: OpenedFile) {
    guard let fi else { return }
    fi.pointee.fh = opened.handle
    ubiq_fi_set_keep_cache(fi, opened.keepCache ? 1 : 0)
  }

  /// Replies to an open. If the reply cannot be sent (the caller was interrupted and is gone),
  /// the kernel never releases the handle, so it is released here.
  func replyOpen(_ req: fuse_req_t?, _ fi: UnsafeMutablePointer<fuse_file_info>?, _ opened: OpenedFile) {
    setHandle(fi, opened)
    if fuse_reply_open(req, fi) != 0 { core.release(opened.handle) }
  }

  /// Runs `body` and replies with its error, if any; `body` replies on success.
  @inline(__always)
  func run(_ req: fuse_req_t?, _ body: () throws -> Void) {
    do { try body() } catch { reply(req, error: error) }
  }

  /// Runs `body` (which may wait for content) with an `Interruption` that the kernel's
  /// FUSE_INTERRUPT for `req` fires. Returns before any reply: libfuse frees the request with
  /// its reply, so the callback is unregistered first (which also waits for a running one).
  func interruptible<T>(_ req: fuse_req_t?, _ body: (Interruption) throws -> T) throws -> T {
    let interruption = Interruption()
    let token = Unmanaged.passRetained(interruption)
    fuse_req_interrupt_func(
      req,
      { _, data in
        guard let data else { return }
        Unmanaged<Interruption>.fromOpaque(data).takeUnretainedValue().interrupt()
      }, token.toOpaque())
    defer {
      fuse_req_interrupt_func(req, nil, nil)
      token.release()
    }
    return try body(interruption)
  }

  /// Runs `body`, which waits for content from the cloud and then replies, on a thread of its
  /// own. The FUSE loop's workers never wait for the network: they stay free to read the
  /// kernel's next requests, among them the FUSE_INTERRUPT that ends such a wait, and to serve
  /// other processes while a download is slow. Were the waits on the workers, as many of them
  /// as the loop has threads would stall the whole mount until the stall deadline.
  func onWaitingThread(_ body: @escaping @Sendable () -> Void) {
    Thread(block: body).start()
  }

  // MARK: - namespace

  /// The kernel dropped entries of inodes (FUSE forget); nothing is replied, as FUSE asks.
  func forget(_ req: fuse_req_t?, _ forgets: [(fuse_ino_t, UInt64)]) {
    for (ino, count) in forgets { core.forget(Int64(ino), count: count) }
    fuse_reply_none(req)
  }

  func lookup(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?) {
    run(req) {
      guard let a = try core.lookup(parent: Int64(parent), name: try name(namePtr)) else {
        // Negative entry, cached by the kernel for the entry timeout.
        var e = fuse_entry_param()
        e.ino = 0
        e.entry_timeout = options.entryTimeout
        _ = fuse_reply_entry(req, &e)
        return
      }
      replyEntry(req, a)
    }
  }

  func getattr(_ req: fuse_req_t?, _ ino: fuse_ino_t) {
    run(req) {
      let a = try core.getattr(Int64(ino))
      var st = stat(a)
      // An open-unlinked file's attributes are not cached.
      _ = fuse_reply_attr(req, &st, a.linkCount == 0 ? 0 : options.attrTimeout)
    }
  }

  func setattr(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>?, _ toSet: Int32,
    _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    run(req) {
      guard let a = attr?.pointee else { throw UbiqError.invalidArgument("no attributes") }
      var u = AttributeUpdate()
      if toSet & FUSE_SET_ATTR_MODE != 0 { u.mode = a.st_mode }
      if toSet & FUSE_SET_ATTR_UID != 0 { u.uid = a.st_uid }
      if toSet & FUSE_SET_ATTR_GID != 0 { u.gid = a.st_gid }
      if toSet & FUSE_SET_ATTR_ATIME_NOW != 0 {
        u.atime = .now
      } else if toSet & FUSE_SET_ATTR_ATIME != 0 {
        u.atime = .at(try FileTime.nanoseconds(a.st_atim))
      }
      if toSet & FUSE_SET_ATTR_MTIME_NOW != 0 {
        u.mtime = .now
      } else if toSet & FUSE_SET_ATTR_MTIME != 0 {
        u.mtime = .at(try FileTime.nanoseconds(a.st_mtim))
      }
      if toSet & FUSE_SET_ATTR_SIZE != 0 { u.size = Int64(a.st_size) }
      let result = try core.setattr(Int64(ino), u, handle: fi?.pointee.fh)
      var st = stat(result)
      _ = fuse_reply_attr(req, &st, options.attrTimeout)
    }
  }

  func mkdir(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ mode: mode_t) {
    run(req) {
      replyEntry(req, try core.mkdir(parent: Int64(parent), name: try name(namePtr), mode: mode, caller: caller(req)))
    }
  }

  func mknod(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ mode: mode_t) {
    run(req) {
      replyEntry(req, try core.mknod(parent: Int64(parent), name: try name(namePtr), mode: mode, caller: caller(req)))
    }
  }

  func symlink(
    _ req: fuse_req_t?, _ link: UnsafePointer<CChar>?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?
  ) {
    run(req) {
      let a = try core.symlink(
        parent: Int64(parent), name: try name(namePtr), target: try name(link), caller: caller(req))
      replyEntry(req, a)
    }
  }

  func readlink(_ req: fuse_req_t?, _ ino: fuse_ino_t) {
    run(req) { _ = fuse_reply_readlink(req, try core.readlink(Int64(ino))) }
  }

  func remove(_ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, directory: Bool) {
    run(req) {
      let n = try name(namePtr)
      if directory {
        try core.rmdir(parent: Int64(parent), name: n)
      } else {
        try core.unlink(parent: Int64(parent), name: n)
      }
      _ = fuse_reply_err(req, 0)
    }
  }

  func rename(
    _ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ newParent: fuse_ino_t,
    _ newNamePtr: UnsafePointer<CChar>?, _ flags: UInt32
  ) {
    run(req) {
      try core.rename(
        parent: Int64(parent), name: try name(namePtr), newParent: Int64(newParent), newName: try name(newNamePtr),
        flags: RenameFlags(rawValue: flags))
      _ = fuse_reply_err(req, 0)
    }
  }

  func link(_ req: fuse_req_t?) {
    run(req) { try core.link() }
  }

  // MARK: - directories

  /// Lets the kernel cache the listing (and keep it across opens): local changes go through the
  /// kernel, which drops it itself; remote ones drop it with an inode invalidation of the parent.
  /// Where the kernel can open directories itself, the first opendir hands that over: listing
  /// a folder then costs no request but its readdir (none while its listing is cached), which
  /// is what `git status`, `find` and `rm -rf` do for every folder. Nothing here depends on a
  /// directory handle: readdir's cursor is its offset, fsyncdir syncs the whole index.
  func opendir(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    run(req) {
      try core.opendir(Int64(ino))
      if kernelOpensDirectories.load(ordering: .acquiring) {
        _ = fuse_reply_err(req, ENOSYS)
        return
      }
      if let fi {
        ubiq_fi_set_cache_readdir(fi, 1)
        ubiq_fi_set_keep_cache(fi, 1)
      }
      _ = fuse_reply_open(req, fi)
    }
  }

  func readdir(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int, _ off: off_t, plus: Bool) {
    run(req) {
      var buf = [CChar](repeating: 0, count: size)
      var used = 0
      // Inodes of readdirplus entries in the reply: the kernel takes a reference to each.
      var handed: [Int64] = []
      // Fetch about as many rows as fit in the kernel's buffer (often one page).
      let batch = size / (plus ? 120 : 24) + 1
      try core.readdir(Int64(ino), offset: Int64(off), batch: batch) { d in
        let remaining = size - used
        let need: Int = buf.withUnsafeMutableBufferPointer { b in
          if plus {
            var e = entry(d.attributes)
            if d.name == "." || d.name == ".." {
              // Not looked up: the kernel must not take a reference on these.
              e = fuse_entry_param()
              e.attr = stat(d.attributes)
            }
            return fuse_add_direntry_plus(req, b.baseAddress! + used, remaining, d.name, &e, off_t(d.nextOffset))
          }
          var st = stat(d.attributes)
          return fuse_add_direntry(req, b.baseAddress! + used, remaining, d.name, &st, off_t(d.nextOffset))
        }
        if need > remaining { return false }
        used += need
        if plus && d.name != "." && d.name != ".." { handed.append(d.attributes.inode) }
        return true
      }
      for inode in handed { core.entriesHanded(inode) }
      let failed = buf.withUnsafeBufferPointer { b in fuse_reply_buf(req, b.baseAddress, used) != 0 }
      if failed { for inode in handed { core.forget(inode, count: 1) } }
    }
  }

  // MARK: - files

  func open(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    run(req) {
      let flags = fi?.pointee.flags ?? 0
      let who = caller(req)
      @Sendable func openAndReply(_ req: fuse_req_t?, _ fi: UnsafeMutablePointer<fuse_file_info>?) throws {
        let opened = try interruptible(req) { try core.open(Int64(ino), flags: flags, caller: who, interruption: $0) }
        replyOpen(req, fi, opened)
      }
      guard try core.openWaitsForContent(Int64(ino), flags: flags), let fi else { return try openAndReply(req, fi) }
      // libfuse's fuse_file_info lives in this worker's frame: the later reply uses a copy.
      let deferred = DeferredReply(req, fi.pointee)
      onWaitingThread {
        self.run(deferred.req) {
          try withUnsafeMutablePointer(to: &deferred.info) { try openAndReply(deferred.req, $0) }
        }
      }
    }
  }

  func create(
    _ req: fuse_req_t?, _ parent: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ mode: mode_t,
    _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    run(req) {
      let (a, opened) = try core.create(
        parent: Int64(parent), name: try name(namePtr), mode: mode, caller: caller(req))
      setHandle(fi, opened)
      var e = entry(a)
      core.entriesHanded(a.inode)
      if fuse_reply_create(req, &e, fi) != 0 {
        core.forget(a.inode, count: 1)
        core.release(opened.handle)
      }
    }
  }

  func read(_ req: fuse_req_t?, _ size: Int, _ off: off_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    guard let fh = fi?.pointee.fh else { return reply(req, error: UbiqError.invalidArgument("no handle")) }
    @Sendable func replyRead(_ req: fuse_req_t?, _ fd: Int32) {
      _ = ubiq_reply_fd(req, fd, size, off)
      core.didRead(fh)
    }
    run(req) {
      if let fd = try core.readableDescriptor(fh, offset: Int64(off), size: size) { return replyRead(req, fd) }
      let deferred = DeferredReply(req)
      onWaitingThread {
        self.run(deferred.req) {
          let fd = try self.interruptible(deferred.req) {
            try self.core.waitForRead(fh, offset: Int64(off), size: size, interruption: $0)
          }
          replyRead(deferred.req, fd)
        }
      }
    }
  }

  /// The request's data goes from wherever libfuse holds it (memory, or the pipe it spliced the
  /// request into) to the cache file, with no copy through a buffer of ours.
  func write(
    _ req: fuse_req_t?, _ data: UnsafeMutablePointer<fuse_bufvec>?, _ off: off_t,
    _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    guard let fh = fi?.pointee.fh, let data else {
      return reply(req, error: UbiqError.invalidArgument("no handle"))
    }
    run(req) {
      let size = fuse_buf_size(data)
      let n = try core.write(fh, count: size, offset: Int64(off)) { fd in
        let copied = ubiq_write_buf_to_fd(data, size, fd, off)
        if copied < 0 { throw UbiqError.posix(Int32(-copied), "write") }
        return copied
      }
      _ = fuse_reply_write(req, n)
    }
  }

  func flush(_ req: fuse_req_t?, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    guard let fh = fi?.pointee.fh else { return reply(req, error: UbiqError.invalidArgument("no handle")) }
    run(req) {
      try core.flush(fh)
      _ = fuse_reply_err(req, 0)
    }
  }

  func fsync(_ req: fuse_req_t?, _ datasync: Int32, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    guard let fh = fi?.pointee.fh else { return reply(req, error: UbiqError.invalidArgument("no handle")) }
    run(req) {
      try core.fsync(fh, dataOnly: datasync != 0)
      _ = fuse_reply_err(req, 0)
    }
  }

  func fsyncdir(_ req: fuse_req_t?, _ ino: fuse_ino_t) {
    run(req) {
      try core.fsyncDirectory(Int64(ino))
      _ = fuse_reply_err(req, 0)
    }
  }

  func release(_ req: fuse_req_t?, _ fi: UnsafeMutablePointer<fuse_file_info>?) {
    if let fh = fi?.pointee.fh { core.release(fh) }
    _ = fuse_reply_err(req, 0)
  }

  func fallocate(
    _ req: fuse_req_t?, _ mode: Int32, _ off: off_t, _ len: off_t, _ fi: UnsafeMutablePointer<fuse_file_info>?
  ) {
    guard let fh = fi?.pointee.fh else { return reply(req, error: UbiqError.invalidArgument("no handle")) }
    run(req) {
      try core.fallocate(fh, mode: mode, offset: Int64(off), length: Int64(len))
      _ = fuse_reply_err(req, 0)
    }
  }

  func statfs(_ req: fuse_req_t?) {
    run(req) {
      var sv = try core.statfs()
      _ = fuse_reply_statfs(req, &sv)
    }
  }

  // MARK: - extended attributes

  func replyXattr(_ req: fuse_req_t?, _ answer: XattrAnswer) {
    switch answer {
    case .size(let n): _ = fuse_reply_xattr(req, n)
    case .value(let data):
      data.withUnsafeBytes { raw in
        _ = fuse_reply_buf(req, raw.baseAddress?.assumingMemoryBound(to: CChar.self), raw.count)
      }
    }
  }

  func getxattr(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ size: Int) {
    run(req) { replyXattr(req, try core.getxattr(Int64(ino), name: try name(namePtr), size: size)) }
  }

  func listxattr(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ size: Int) {
    run(req) { replyXattr(req, try core.listxattr(Int64(ino), size: size)) }
  }

  func setxattr(
    _ req: fuse_req_t?, _ ino: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?, _ value: UnsafePointer<CChar>?,
    _ size: Int, _ flags: Int32
  ) {
    run(req) {
      let data = value.map { Data(bytes: $0, count: size) } ?? Data()
      try core.setxattr(Int64(ino), name: try name(namePtr), value: data, flags: XattrFlags(rawValue: flags))
      _ = fuse_reply_err(req, 0)
    }
  }

  func removexattr(_ req: fuse_req_t?, _ ino: fuse_ino_t, _ namePtr: UnsafePointer<CChar>?) {
    run(req) {
      try core.removexattr(Int64(ino), name: try name(namePtr))
      _ = fuse_reply_err(req, 0)
    }
  }
}

/// A request answered later from another thread (`FuseAdapter.onWaitingThread`), with the copy
/// of its `fuse_file_info` the reply reads (libfuse's own copy lives in the worker's frame).
/// Sendable: used by one thread at a time, handed over when the worker returns.
final class DeferredReply: @unchecked Sendable {
  let req: fuse_req_t?
  var info: fuse_file_info

  init(_ req: fuse_req_t?, _ info: fuse_file_info = fuse_file_info()) {
    self.req = req
    self.info = info
  }
}
