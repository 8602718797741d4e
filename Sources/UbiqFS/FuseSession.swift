import CFuse3
import Foundation
import Logging
import UbiqCore
import UbiqFSCore

#if canImport(Glibc)
  import Glibc
#endif

/// Owns one libfuse low-level session: builds the operation table that forwards to a
/// `FuseAdapter` over the filesystem core, mounts, runs the multithreaded loop and unmounts,
/// and carries the core's invalidations to the kernel.
/// Sendable: `session` and `unmounted` are guarded by `lock`.
public final class FuseSession: @unchecked Sendable {
  let fs: FuseAdapter
  let core: FilesystemCore
  let mountpoint: String
  /// Guards `session` and `unmounted`.
  private let lock = NSLock()
  private var session: OpaquePointer?
  private var unmounted = false

  public init(core: FilesystemCore, mountpoint: String, logger: Logger) {
    self.core = core
    self.fs = FuseAdapter(core: core, logger: logger)
    self.mountpoint = mountpoint
  }

  /// Mounts the filesystem; throws if libfuse refuses.
  public func mount(fsname: String) throws {
    var ops = Self.operations()
    var args = fuse_args(argc: 0, argv: nil, allocated: 0)
    let argv =
      ["ubiqfs", "-o", "fsname=\(fsname),subtype=ubiqfs,default_permissions"] + (fs.options.debug ? ["-d"] : [])
    for a in argv { fuse_opt_add_arg(&args, a) }
    defer { fuse_opt_free_args(&args) }
    let userdata = Unmanaged.passUnretained(fs).toOpaque()
    guard let se = fuse_session_new(&args, &ops, MemoryLayout<fuse_lowlevel_ops>.size, userdata) else {
      throw UbiqError.io("fuse_session_new failed")
    }
    if fuse_session_mount(se, mountpoint) != 0 {
      fuse_session_destroy(se)
      throw UbiqError.io("cannot mount at \(mountpoint) (is /dev/fuse available and the directory empty?)")
    }
    session = se
    core.invalidate = { [weak self] inode, entries in self?.invalidate(inode, entries) }
    core.invalidateAttributes = { [weak self] inode in self?.invalidateAttributes(inode) }
  }

  /// Tells the kernel to forget the cached attributes (not the pages) of `inode`.
  func invalidateAttributes(_ inode: Int64) {
    guard let se = lock.withLock({ unmounted ? nil : session }) else { return }
    _ = fuse_lowlevel_notify_inval_inode(se, fuse_ino_t(inode), -1, 0)
  }

  /// Tells the kernel to forget what it cached about `inode` and the given directory entries.
  /// Called from sync threads, never from inside a request handler.
  func invalidate(_ inode: Int64?, _ entries: [(Int64, String)]) {
    guard let se = lock.withLock({ unmounted ? nil : session }) else { return }
    for (parent, name) in entries {
      _ = name.withCString { fuse_lowlevel_notify_inval_entry(se, fuse_ino_t(parent), $0, strlen($0)) }
    }
    // The kernel caches directory listings (cache_readdir); an entry invalidation only drops
    // them if that name was in the dentry cache, so the parents' listings go explicitly.
    for parent in Set(entries.map(\.0)) { _ = fuse_lowlevel_notify_inval_inode(se, fuse_ino_t(parent), 0, 0) }
    if let inode { _ = fuse_lowlevel_notify_inval_inode(se, fuse_ino_t(inode), 0, 0) }
  }

  /// Runs the request loop on the calling thread until unmounted.
  public func run() -> Int32 {
    guard let se = session else { return -1 }
    let cfg = fuse_loop_cfg_create()
    fuse_loop_cfg_set_max_threads(cfg, UInt32(fs.options.maxThreads))
    fuse_loop_cfg_set_idle_threads(cfg, 4)
    let rc = ubiq_fuse_session_loop_mt(se, cfg)
    fuse_loop_cfg_destroy(cfg)
    return rc
  }

  /// Asks the loop to end: detaches the mount so the kernel closes the connection.
  public func requestExit() {
    guard let se = session else { return }
    fuse_session_exit(se)
    unmountOnce()
  }

  private func unmountOnce() {
    let doIt = lock.withLock { () -> Bool in
      if unmounted { return false }
      unmounted = true
      return true
    }
    if doIt, let se = session { fuse_session_unmount(se) }
  }

  /// Unmounts (if still mounted) and frees the session.
  public func close() {
    unmountOnce()
    if let se = session { fuse_session_destroy(se) }
    session = nil
  }

  static func operations() -> fuse_lowlevel_ops {
    var ops = fuse_lowlevel_ops()
    ops.`init` = { userdata, conn in
      guard let conn else { return }
      let want =
        FUSE_CAP_READDIRPLUS | FUSE_CAP_READDIRPLUS_AUTO | FUSE_CAP_PARALLEL_DIROPS
        | FUSE_CAP_ASYNC_READ | FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE
        // O_TRUNC arrives with open: truncating an evicted file needs no download.
        | FUSE_CAP_ATOMIC_O_TRUNC
      conn.pointee.want |= UInt32(want) & conn.pointee.capable
      if conn.pointee.capable & UInt32(FUSE_CAP_NO_OPENDIR_SUPPORT) != 0, let userdata {
        Unmanaged<FuseAdapter>.fromOpaque(userdata).takeUnretainedValue().kernelOpensDirectories.store(
          true, ordering: .releasing)
      }
      conn.pointee.max_write = 1 << 20
      conn.pointee.max_readahead = 1 << 20
      conn.pointee.max_background = 64
      conn.pointee.congestion_threshold = 48
      conn.pointee.time_gran = 1
    }
    ops.lookup = { req, parent, name in fsOf(req).lookup(req, parent, name) }
    ops.forget = { req, ino, nlookup in fsOf(req).forget(req, [(ino, nlookup)]) }
    ops.forget_multi = { req, count, forgets in
      fsOf(req).forget(req, UnsafeBufferPointer(start: forgets, count: count).map { ($0.ino, $0.nlookup) })
    }
    ops.getattr = { req, ino, _ in fsOf(req).getattr(req, ino) }
    ops.setattr = { req, ino, attr, toSet, fi in fsOf(req).setattr(req, ino, attr, toSet, fi) }
    ops.readlink = { req, ino in fsOf(req).readlink(req, ino) }
    ops.mknod = { req, parent, name, mode, _ in fsOf(req).mknod(req, parent, name, mode) }
    ops.mkdir = { req, parent, name, mode in fsOf(req).mkdir(req, parent, name, mode) }
    ops.unlink = { req, parent, name in fsOf(req).remove(req, parent, name, directory: false) }
    ops.rmdir = { req, parent, name in fsOf(req).remove(req, parent, name, directory: true) }
    ops.symlink = { req, link, parent, name in fsOf(req).symlink(req, link, parent, name) }
    ops.rename = { req, parent, name, newParent, newName, flags in
      fsOf(req).rename(req, parent, name, newParent, newName, flags)
    }
    ops.link = { req, _, _, _ in fsOf(req).link(req) }
    ops.open = { req, ino, fi in fsOf(req).open(req, ino, fi) }
    ops.read = { req, _, size, off, fi in fsOf(req).read(req, size, off, fi) }
    ops.write_buf = { req, _, data, off, fi in fsOf(req).write(req, data, off, fi) }
    ops.flush = { req, _, fi in fsOf(req).flush(req, fi) }
    ops.release = { req, _, fi in fsOf(req).release(req, fi) }
    ops.fsync = { req, _, datasync, fi in fsOf(req).fsync(req, datasync, fi) }
    ops.opendir = { req, ino, fi in fsOf(req).opendir(req, ino, fi) }
    ops.readdir = { req, ino, size, off, _ in fsOf(req).readdir(req, ino, size, off, plus: false) }
    ops.readdirplus = { req, ino, size, off, _ in fsOf(req).readdir(req, ino, size, off, plus: true) }
    ops.fsyncdir = { req, ino, _, _ in fsOf(req).fsyncdir(req, ino) }
    ops.statfs = { req, _ in fsOf(req).statfs(req) }
    ops.setxattr = { req, ino, name, value, size, flags in fsOf(req).setxattr(req, ino, name, value, size, flags) }
    ops.getxattr = { req, ino, name, size in fsOf(req).getxattr(req, ino, name, size) }
    ops.listxattr = { req, ino, size in fsOf(req).listxattr(req, ino, size) }
    ops.removexattr = { req, ino, name in fsOf(req).removexattr(req, ino, name) }
    ops.create = { req, parent, name, mode, fi in fsOf(req).create(req, parent, name, mode, fi) }
    ops.fallocate = { req, _, mode, off, len, fi in fsOf(req).fallocate(req, mode, off, len, fi) }
    return ops
  }
}

/// The adapter a request belongs to (the session's userdata).
@inline(__always)
func fsOf(_ req: fuse_req_t?) -> FuseAdapter {
  Unmanaged<FuseAdapter>.fromOpaque(fuse_req_userdata(req)!).takeUnretainedValue()
}
