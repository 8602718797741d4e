import Foundation
import Logging
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqIndex
import UbiqSync

@testable import UbiqFSCore
@testable import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// One device's filesystem core over a real index, content cache and the embedded cloud engine,
/// all in a temporary folder, driven in-process (no mount). `restart` drops every in-memory
/// piece and builds them again from what is on disk, as a daemon restart after a crash would.
final class CoreWorld: @unchecked Sendable {
  let root: URL
  let container = try! ContainerID("iCloud.com.example.core")
  let cloud: CloudService
  private(set) var index: IndexStore!
  private(set) var core: FilesystemCore!
  private(set) var worker: UploadWorker!
  private(set) var downloader: Downloader!
  private(set) var puller: ChangePuller!
  let log: Logger

  /// Handed the SQL of every statement the index runs (nil: not traced).
  let statementObserver: (@Sendable (String) -> Void)?
  /// When the index's batches of the mount's changes commit.
  let batching: NamespaceBatchPolicy
  /// The device's wall clock (mtimes, when queued uploads are due).
  let clock: WallClock
  /// Where the device's index takes new ids from.
  let identifiers: IdentifierSource
  /// What the uploader's short waits are measured by.
  let waitClock: any _Concurrency.Clock<Duration>
  /// The drains below take only the entries due by `clock` (a failed upload waits out its
  /// backoff); otherwise every queued entry is due.
  var uploadsWaitForBackoff = false

  /// `cloud`: the cloud this device syncs with (default: a new embedded engine of its own).
  init(
    cloud: CloudService? = nil, cloudDirectory: URL? = nil, clock: WallClock = .system,
    identifiers: IdentifierSource = .random, waitClock: any _Concurrency.Clock<Duration> = ContinuousClock(),
    statementObserver: (@Sendable (String) -> Void)? = nil, batching: NamespaceBatchPolicy = NamespaceBatchPolicy()
  ) throws {
    self.statementObserver = statementObserver
    self.batching = batching
    self.clock = clock
    self.identifiers = identifiers
    self.waitClock = waitClock
    root = Self.temporaryFolder("ubiq-core")
    try FileManager.default.createDirectory(at: root, withIntermediateDirectories: true)
    var log = Logger(label: "core-test")
    log.logLevel = ProcessInfo.processInfo.environment["UBIQ_TEST_LOG"] != nil ? .debug : .critical
    self.log = log
    if let cloud {
      self.cloud = cloud
    } else {
      self.cloud = try CloudEngine.embedded(directory: cloudDirectory ?? root.appendingPathComponent("cloud"))
    }
    try runBlocking { try await self.cloud.ensureContainer(self.container) }
    try start()
  }

  deinit { try? FileManager.default.removeItem(at: root) }

  /// A folder under the temporary directory for one test, removed when the test process exits
  /// (a world a test still holds, or one kept alive by a task, is never deinitialized).
  static func temporaryFolder(_ prefix: String) -> URL {
    let url = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("\(prefix)-\(UUID().uuidString)")
    TemporaryFolders.shared.add(url)
    return url
  }

  /// Two devices of one account on an embedded cloud of their own. The cloud's folder is not
  /// below either device's, so a test may drop `a` (its folder goes at deinit) and go on with
  /// the cloud; it is removed when the test process exits.
  static func pair() throws -> (a: CoreWorld, b: CoreWorld, cloud: CloudEngine) {
    let cloud = try CloudEngine.embedded(directory: temporaryFolder("ubiq-cloud"))
    return (try CoreWorld(cloud: cloud), try CoreWorld(cloud: cloud), cloud)
  }

  /// Builds index, cache, core, uploader and downloader from the state folder.
  func start() throws {
    let state = root.appendingPathComponent("state")
    try FileManager.default.createDirectory(at: state, withIntermediateDirectories: true)
    let index = try IndexStore(
      path: state.appendingPathComponent("index.sqlite").path, clock: clock, identifiers: identifiers,
      batching: batching, statementObserver: statementObserver)
    index.uploadDelayNs = 0
    try index.bootstrap(uid: getuid(), gid: getgid())
    try runBlocking { [cloud, container] in
      try await WellKnownVersions.adopt(index: index, cloud: cloud, container: container)
    }
    let cache = try ContentCache(directory: state.appendingPathComponent("content").path)
    let inodes = InodeTable()
    let core = FilesystemCore(
      index: index, cache: cache, inodes: inodes, container: container, options: MountOptions(),
      logger: log, onQueued: {})
    try core.recoverUnrecordedWrites()
    let downloader = Downloader(index: index, cache: cache, cloud: cloud, inodes: inodes, logger: log)
    downloader.stallTimeoutNs = 5_000_000_000
    core.downloader = downloader
    worker = UploadWorker(
      index: index, cache: cache, cloud: cloud, inodes: inodes, container: container,
      deviceID: try index.deviceID(), logger: log)
    puller = ChangePuller(
      index: index, cache: cache, cloud: cloud, container: container, inodes: inodes, uid: getuid(),
      gid: getgid(), logger: log)
    puller.onApplied = { core.remoteChangesApplied($0) }
    worker.onMerged = { [weak core] in core?.remoteChangesApplied($0) }
    let pulling = puller!
    worker.waitsForReaders = { [weak pulling] in pulling?.waitsForReaders($0) ?? false }
    core.lastClosed = { [weak pulling] in pulling?.readersClosed($0) }
    puller.downloader = downloader
    worker.downloader = downloader
    worker.waitClock = waitClock
    core.fetchPinnedFiles()
    core.isUploading = { [worker] in worker?.isUploading($0) ?? false }
    self.index = index
    self.core = core
    self.downloader = downloader
  }

  /// A crash: every handle is dropped without flush or release, and everything in memory goes.
  func crashAndRestart() throws {
    stopBackgroundWork()
    core = nil
    worker = nil
    downloader = nil
    puller = nil
    index = nil
    try start()
  }

  /// A power loss of the state folder: everything in memory goes, and the index files are put
  /// back as they were when `restoringIndex` was read (nil: the file did not exist).
  func crashAndRestart(restoringIndex files: [(String, Data?)]) throws {
    stopBackgroundWork()
    core = nil
    worker = nil
    downloader = nil
    puller = nil
    index = nil
    let state = root.appendingPathComponent("state")
    try? FileManager.default.removeItem(at: state.appendingPathComponent("index.sqlite-shm"))
    for (name, data) in files {
      let url = state.appendingPathComponent(name)
      try? FileManager.default.removeItem(at: url)
      if let data { try data.write(to: url) }
    }
    try start()
  }

  /// What a crash ends that would outlive the dropped objects here: the downloads, which run
  /// as tasks of their own and would otherwise write into the restarted device's cache files
  /// and index.
  private func stopBackgroundWork() {
    downloader?.stopAll()
  }

  /// The time the drains take queued entries up to.
  private var dueBy: Int64 { uploadsWaitForBackoff ? clock.nowNs() : Int64.max / 2 }

  /// Uploads everything queued (the upload delay is 0 here) but what waits for a writer's
  /// flush: as on the mount, the content of a file a handle holds unflushed writes of (its new
  /// place reaches the cloud, its content waits), and the new name of a file renamed away from
  /// its cloud place while a new file there is being written (an editor's save that keeps a
  /// backup: the backup's name waits, for a while, for the new file's writer). Returns the
  /// files left queued for another file's writer.
  @discardableResult
  func drainUploads() throws -> Set<Int64> {
    /// The file whose writer `inode`'s entry waits for, if another's.
    func otherWriterWaitedFor(_ inode: Int64) -> Int64? {
      guard let row = try? index.item(inode), let holder = try? index.unsentFileAtTheCloudPlace(of: row),
        core.inodes.isBusy(holder)
      else { return nil }
      return holder
    }
    func waitsForAWriter(_ entry: QueueEntry) -> Bool {
      guard let inode = entry.item else { return false }
      return core.inodes.dirtyHandleCount(inode) > 0 || otherWriterWaitedFor(inode) != nil
    }
    // An entry whose file a writer holds is tried too (its rename may go ahead of its content)
    // and then waits for the flush: the queue is drained once only such entries are left.
    var passesWithOnlyHeldEntries = 0
    for _ in 0..<50 {
      let due = try index.dueQueue(now: dueBy, limit: 64)
      if due.isEmpty { return [] }
      if due.allSatisfy(waitsForAWriter) {
        passesWithOnlyHeldEntries += 1
        if passesWithOnlyHeldEntries > 3 {
          return Set(due.compactMap { $0.item }.filter { otherWriterWaitedFor($0) != nil })
        }
      }
      let w = worker!
      _ = try runBlocking { await w.drain(due) }
    }
    throw UbiqError.busy("the upload queue does not drain")
  }

  /// One pass over the entries due now; what fails or is postponed stays queued.
  func drainUploadsOnce() throws {
    let due = try index.dueQueue(now: dueBy, limit: 64)
    let w = worker!
    if !due.isEmpty { _ = try runBlocking { await w.drain(due) } }
  }

  /// Applies every remote change.
  func pull() throws {
    let p = puller!
    _ = try runBlocking { try await p.pullOnce() }
  }

  // MARK: - paths

  var documents: Int64 { try! index.item(itemID: WellKnownItem.documents)!.id! }

  /// The inode of a path below Documents ("a/b"), or nil.
  func inode(_ path: String) throws -> Int64? {
    var cur = documents
    for part in path.split(separator: "/") {
      guard let a = try core.lookup(parent: cur, name: String(part)) else { return nil }
      cur = a.inode
    }
    return cur
  }

  func parentAndName(_ path: String) throws -> (Int64, String) {
    let parts = path.split(separator: "/").map(String.init)
    let parentPath = parts.dropLast().joined(separator: "/")
    guard let parent = try inode(parentPath) else { throw UbiqError.notFound(parentPath) }
    return (parent, parts.last!)
  }

  // MARK: - whole-file helpers

  @discardableResult
  func writeFile(_ path: String, _ data: Data, at offset: Int64 = 0, truncate: Bool = true) throws -> Int64 {
    let (parent, name) = try parentAndName(path)
    let handle: UInt64
    let inode: Int64
    if let existing = try core.lookup(parent: parent, name: name) {
      inode = existing.inode
      handle = try core.open(inode, flags: O_WRONLY | (truncate ? O_TRUNC : 0), caller: .current).handle
    } else {
      let (a, opened) = try core.create(parent: parent, name: name, mode: 0o644, caller: .current)
      inode = a.inode
      handle = opened.handle
    }
    defer { core.release(handle) }
    _ = try data.withUnsafeBytes { try core.write(handle, $0, offset: offset) }
    try core.flush(handle)
    return inode
  }

  /// The names readdir lists for a folder below Documents ("a/b"), "." and ".." included.
  func listing(_ path: String) throws -> [String] {
    guard let folder = try inode(path) else { throw UbiqError.notFound(path) }
    var names: [String] = []
    try core.readdir(folder, offset: 0) {
      names.append($0.name)
      return true
    }
    return names
  }

  func readFile(_ path: String) throws -> Data {
    guard let inode = try inode(path) else { throw UbiqError.notFound(path) }
    let size = try core.getattr(inode).size
    let h = try core.open(inode, flags: O_RDONLY, caller: .current).handle
    defer { core.release(h) }
    return try core.read(h, offset: 0, size: Int(size))
  }
}

/// A check for code running on a thread of its own (`onOwnThread`), where `#expect` has no
/// test to report to: a failed one throws, and the error fails the test and names it.
func checkThat(_ condition: Bool, _ what: String) throws {
  if !condition { throw UbiqError.io("check failed: \(what)") }
}

/// The temporary folders the tests made, removed at exit.
final class TemporaryFolders: @unchecked Sendable {
  static let shared: TemporaryFolders = {
    let folders = TemporaryFolders()
    atexit { TemporaryFolders.shared.removeAll() }
    return folders
  }()
  private let lock = NSLock()
  private var urls: [URL] = []

  func add(_ url: URL) { lock.withLock { urls.append(url) } }

  func removeAll() {
    for url in lock.withLock({ urls }) { try? FileManager.default.removeItem(at: url) }
  }
}
