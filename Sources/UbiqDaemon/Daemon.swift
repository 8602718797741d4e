import CFuse3
import Foundation
import Logging
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqFS
import UbiqFSCore
import UbiqIndex
import UbiqKV
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// Everything one mounted container runs: index, content cache, cloud, upload worker and the
/// FUSE session. Built by `ubiqfs mount --foreground` (directly, or by systemd, or by the
/// background `ubiqfs mount` which starts it as a detached child).
public final class Daemon {
  public let container: ContainerID
  public let mountpoint: String
  public let paths: Paths
  public let options: MountOptions
  public let uploadDelayMs: Int
  public let pullIntervalMs: Int
  public let downloadLimitBytes: Int64
  public let uploadLimitBytes: Int64
  public var log: Logger

  public init(
    container: ContainerID, mountpoint: String, paths: Paths, options: MountOptions, uploadDelayMs: Int,
    pullIntervalMs: Int, downloadLimitBytes: Int64 = 0, uploadLimitBytes: Int64 = 0
  ) {
    self.uploadLimitBytes = uploadLimitBytes
    self.pullIntervalMs = pullIntervalMs
    self.downloadLimitBytes = downloadLimitBytes
    self.container = container
    self.mountpoint = mountpoint
    self.paths = paths
    self.options = options
    self.uploadDelayMs = uploadDelayMs
    log = Logger(label: "ubiqfs")
    log.logLevel = options.debug ? .debug : .info
  }

  public func run() throws -> Int32 {
    do {
      return try mountAndServe()
    } catch let error where IndexStore.storageErrno(error) == ENOSPC {
      throw UbiqError.noSpace("the index cannot be written (\(error))")
    }
  }

  func mountAndServe() throws -> Int32 {
    // The signed-in server account (HTTPCloud), or the embedded engine's "local" account.
    let cloudSession = try CloudSession.open(paths)
    let account = cloudSession.account
    let dir = paths.containerDir(account: account, container)
    try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
    try checkMountpoint()

    // One daemon per container state folder.
    let lockFD = open(dir.appendingPathComponent("lock").path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
    guard lockFD >= 0, flock(lockFD, LOCK_EX | LOCK_NB) == 0 else {
      let holder = DaemonRecord.load(dir)
      if let holder, case let state = holder.mountState, state == .detached {
        throw UbiqError.busy("container \(container) is still \(holder.summary(of: state))")
      }
      let at = holder.map { " at \($0.mountpoint) (pid \($0.pid))" } ?? ""
      throw UbiqError.busy("container \(container) is already mounted\(at); see 'ubiqfs status'")
    }
    defer { close(lockFD) }
    // With the lock held no other daemon of this container runs: a mount point the last one
    // left stale elsewhere is detached.
    MountPoint.recoverPrevious(DaemonRecord.load(dir), mountingAt: mountpoint) { [log] in log.warning("\($0)") }

    // On a full disk the space reserve's room is what the start records, and the removals
    // that free room, need: a full disk mounts, and can be emptied through the mount.
    if SpaceReserve(folder: dir.path).releaseIfDiskIsFull() {
      log.warning("the state folder's disk is full: its space reserve is given back for removals")
    }
    // The mount's changes share transactions; a redo log a crash left is replayed here.
    let index = try IndexStore(
      path: dir.appendingPathComponent("index.sqlite").path, batching: NamespaceBatchPolicy())
    index.uploadDelayNs = Int64(uploadDelayMs) * 1_000_000
    try index.bootstrap(uid: getuid(), gid: getgid())
    let deviceID = try index.deviceID()
    index.reserve?.keep()
    let cache = try ContentCache(directory: dir.appendingPathComponent("content").path)
    // SQLite syncs the folder for its WAL file, not for the database file it creates: the names
    // index.sqlite and content/ become durable here, before anything relies on them.
    try Durability.fsyncDirectory(dir.path)
    let cloud = try cloudSession.makeCloud()
    let container = self.container
    do {
      try runBlocking { try await cloud.ensureContainer(container) }
    } catch CloudError.unavailable(let why) where ((try? index.changeToken()) ?? 0) > 0 {
      // A server account that synced before mounts offline; queued work uploads once it is back.
      log.warning("cloud unavailable (\(why)); mounting from the local index")
    }
    try runBlocking { try await WellKnownVersions.adopt(index: index, cloud: cloud, container: container) }

    let inodes = InodeTable()
    let worker = UploadWorker(
      index: index, cache: cache, cloud: cloud, inodes: inodes, container: container, deviceID: deviceID,
      logger: log)
    let fs = FilesystemCore(
      index: index, cache: cache, inodes: inodes, container: container, options: options, logger: log,
      onQueued: { worker.kick() })
    // Writes a crash left unrecorded become a local revision before remote changes are applied.
    try fs.recoverUnrecordedWrites()
    let downloader = Downloader(index: index, cache: cache, cloud: cloud, inodes: inodes, logger: log)
    if downloadLimitBytes > 0 { downloader.limiter = RateLimiter(bytesPerSecond: downloadLimitBytes) }
    fs.downloader = downloader
    downloader.onCached = { [weak fs] inode in fs?.attributesChanged(inode) }
    let puller = ChangePuller(
      index: index, cache: cache, cloud: cloud, container: container, inodes: inodes, uid: getuid(),
      gid: getgid(), logger: log)
    puller.downloader = downloader
    // Initial sync, for at most about a second: a container that has changed little since the
    // last mount is complete before the kernel sees it, and a new device of a large one mounts
    // at once and fills in while it is used (the puller's loop goes on from the token).
    do {
      _ = try runBlocking { try await puller.pullOnce(budget: .seconds(1)) }
    } catch {
      log.warning("initial pull failed: \(error)")
    }
    fs.fetchPinnedFiles()
    worker.onNeedsPull = { puller.wake() }
    worker.waitsForReaders = { puller.waitsForReaders($0) }
    fs.resync = { puller.pullEverythingAgain() }
    fs.lastClosed = { puller.readersClosed($0) }
    puller.commitInFlight = { worker.isCommitting($0) }
    puller.onApplied = { fs.remoteChangesApplied($0) }
    puller.onRecovered = {
      try? index.retryAllNow()
      worker.kick()
      downloader.retryFailedBackgroundFetches()
    }
    // The daemon's record goes first: a state folder that cannot take it (a full disk) fails
    // the mount before the kernel shows it, instead of a mount whose daemon then ends.
    var record = DaemonRecord(
      pid: getpid(), mountpoint: mountpoint, container: container.rawValue, account: account, startedAt: Date())
    let recordURL = dir.appendingPathComponent("daemon.json")
    do {
      try JSONEncoder().encode(record).write(to: recordURL, options: .atomic)
    } catch {
      let cocoa = error as? CocoaError
      let code =
        cocoa?.code == .fileWriteOutOfSpace ? ENOSPC : (cocoa?.underlying as? POSIXError)?.code.rawValue ?? EIO
      throw UbiqError.posix(code, "cannot write \(recordURL.path)")
    }
    let session = FuseSession(core: fs, mountpoint: mountpoint, logger: log)
    do {
      try session.mount(fsname: "ubiqfs:\(container.rawValue)")
    } catch {
      try? FileManager.default.removeItem(at: recordURL)
      throw error
    }
    // Mounted: a record without this (a full disk) reads as still mounting.
    record.mountedAt = Date()
    try? JSONEncoder().encode(record).write(to: recordURL, options: .atomic)
    worker.start()
    puller.start(retryNs: UInt64(pullIntervalMs) * 1_000_000)

    // SIGTERM / SIGINT / SIGHUP: unmount cleanly; the loop then ends.
    var sources: [DispatchSourceSignal] = []
    for sig in [SIGTERM, SIGINT, SIGHUP] {
      signal(sig, SIG_IGN)
      let src = DispatchSource.makeSignalSource(signal: sig, queue: .global())
      src.setEventHandler { [log] in
        log.info("signal \(sig): unmounting \(self.mountpoint)")
        session.requestExit()
      }
      src.resume()
      sources.append(src)
    }
    fs.uploadPercent = { worker.percent($0) }
    worker.onMerged = { fs.remoteChangesApplied($0) }
    worker.downloader = downloader
    fs.isUploading = { worker.isUploading($0) }
    if uploadLimitBytes > 0 { worker.limiter = RateLimiter(bytesPerSecond: uploadLimitBytes) }
    // Upload progress for `ubiqfs status --watch`, written while something is in flight.
    let progressURL = dir.appendingPathComponent("progress.json")
    let progressTimer = DispatchSource.makeTimerSource(queue: .global(qos: .utility))
    nonisolated(unsafe) var lastProgress: [UploadProgress]? = nil
    progressTimer.schedule(deadline: .now() + 0.25, repeating: 0.25)
    progressTimer.setEventHandler {
      let p = worker.inFlight
      if let last = lastProgress, last == p { return }
      lastProgress = p
      if let data = try? JSONEncoder().encode(p) {
        try? data.write(to: progressURL, options: .atomic)
      }
    }
    progressTimer.resume()
    defer { progressTimer.cancel() }
    // Every few seconds: the cache budget is checked, and writes that a handle could not
    // record when it was closed (a full disk) are recorded.
    let budgetTimer = DispatchSource.makeTimerSource(queue: .global(qos: .utility))
    budgetTimer.schedule(deadline: .now() + 1, repeating: 2.0)
    budgetTimer.setEventHandler {
      fs.recordWritesOfClosedHandles()
      fs.enforceCacheBudget()
    }
    budgetTimer.resume()
    defer { budgetTimer.cancel() }
    // Key-value store: keep the container's kv mirror synced while mounted.
    let kvTimer = startKeyValueSync(session: cloudSession)
    defer { kvTimer?.cancel() }
    let collectionTimer = (cloud as? CloudEngine).map(startGarbageCollection)
    defer { collectionTimer?.cancel() }
    notifySystemd("READY=1\nSTATUS=mounted \(container.rawValue) at \(mountpoint)")
    log.info("mounted \(container) at \(mountpoint) (device \(deviceID))")

    let rc = session.run()
    notifySystemd("STOPPING=1")
    log.info("session ended (\(rc)); stopping upload worker")
    try? runBlocking {
      await puller.stop()
      await worker.stop()
    }
    downloader.stopAll()
    do {
      try fs.removeForgottenContent()
    } catch {
      log.warning("removing the cache files of deleted items failed: \(error)")
    }
    do {
      try index.commitBatch()
    } catch {
      log.warning("the last changes stay in the index's redo log for the next mount: \(error)")
    }
    session.close()
    try? FileManager.default.removeItem(at: recordURL)
    for source in sources { source.cancel() }
    log.info("unmounted \(mountpoint)")
    return 0
  }

  /// The mount point must be a free directory; a mount left stale by a crashed daemon is
  /// detached (systemd restarts the daemon after a crash and ends up here).
  private func checkMountpoint() throws {
    try MountPoint.prepare(mountpoint) { [log] in log.warning("\($0)") }
  }

  /// Keeps the container's key-value mirror synced while mounted: every `interval` seconds it
  /// pushes and pulls the mirror of the account the mount uses, so a mounted device propagates
  /// without kv commands. An unreachable cloud leaves writes queued for a later round.
  private func startKeyValueSync(session: CloudSession, interval: Double = 1.0) -> DispatchSourceTimer? {
    let dir = paths.containerDir(account: session.account, container)
    guard let mirror = try? KVMirror(path: dir.appendingPathComponent("kv.sqlite"), container: container),
      let service = try? session.makeKeyValueService(),
      let device = try? mirror.device(suggested: session.config?.device)
    else { return nil }
    let sync = KVSync(mirror: mirror, service: service, device: device)
    let timer = DispatchSource.makeTimerSource(queue: DispatchQueue(label: "ubiqfs.kv-sync", qos: .utility))
    timer.schedule(deadline: .now() + 0.5, repeating: interval)
    timer.setEventHandler { try? runBlocking { try await sync.run() } }
    timer.resume()
    return timer
  }

  /// The embedded cloud has no server to collect its garbage: while mounted, the daemon runs a
  /// pass every 6 hours with the server's default grace (chunks used within 24 hours stay),
  /// the first one 10 minutes after the mount. Several daemons over one cloud folder are fine
  /// (passes are idempotent).
  private func startGarbageCollection(_ engine: CloudEngine) -> DispatchSourceTimer {
    let timer = DispatchSource.makeTimerSource(queue: DispatchQueue(label: "ubiqfs.cloud-gc", qos: .background))
    timer.schedule(deadline: .now() + 600, repeating: 6 * 3600)
    timer.setEventHandler { [log] in
      do {
        let collected = try runBlocking { try await engine.collectGarbage(grace: 24 * 3600) }
        if collected.chunks > 0 {
          log.info("embedded cloud: \(collected.chunks) unreferenced chunks deleted, \(collected.bytes) bytes freed")
        }
        if let failure = collected.failure {
          log.warning(
            "embedded cloud: \(collected.undeleted) chunks not deleted (the next pass retries): \(failure)")
        }
      } catch {
        log.warning("embedded cloud: garbage collection failed (the next pass retries): \(error)")
      }
    }
    timer.resume()
    return timer
  }

  /// Tells systemd (Type=notify) about our state, if it asked.
  private func notifySystemd(_ message: String) {
    guard let path = ProcessInfo.processInfo.environment["NOTIFY_SOCKET"], !path.isEmpty else { return }
    let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
    guard fd >= 0 else { return }
    defer { close(fd) }
    var addr = sockaddr_un()
    addr.sun_family = sa_family_t(AF_UNIX)
    var bytes = Array(path.utf8)
    if bytes.first == UInt8(ascii: "@") { bytes[0] = 0 }
    withUnsafeMutableBytes(of: &addr.sun_path) { raw in
      for (i, b) in bytes.prefix(raw.count - 1).enumerated() { raw[i] = b }
    }
    let len = socklen_t(MemoryLayout<sa_family_t>.size + min(bytes.count, 107))
    _ = withUnsafePointer(to: &addr) { p in
      p.withMemoryRebound(to: sockaddr.self, capacity: 1) { sp in
        message.withCString { m in sendto(fd, m, strlen(m), 0, sp, len) }
      }
    }
  }
}
