import Foundation
import Testing
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqDaemon

@testable import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// The state root the daemon and the commands share: where each container's files live, the
/// daemon record and what it says about a crash, the signed-in account file, mount points.
@Suite struct StateRootTests {
  /// A fresh state root under the temporary folder, removed at the end of the test.
  final class TemporaryRoot {
    let url: URL
    let paths: Paths

    init() throws {
      url = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("ubiq-state-\(UUID().uuidString)")
      try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
      paths = Paths(stateDir: url.path, cloudDir: nil)
    }

    deinit { try? FileManager.default.removeItem(at: url) }

    /// A container state folder with an index, as a mount leaves it.
    func makeContainer(account: String, _ container: String) throws -> URL {
      let dir = paths.containerDir(account: account, try ContainerID(container))
      try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
      let index = try IndexStore(path: dir.appendingPathComponent("index.sqlite").path)
      try index.bootstrap(uid: getuid(), gid: getgid())
      return dir
    }

    func writeRecord(_ record: DaemonRecord, in dir: URL) throws {
      try JSONEncoder().encode(record).write(to: dir.appendingPathComponent("daemon.json"))
    }
  }

  /// The pid of a process that has exited and been reaped.
  func deadPID() throws -> Int32 {
    let p = Process()
    p.executableURL = URL(fileURLWithPath: "/bin/true")
    try p.run()
    p.waitUntilExit()
    return p.processIdentifier
  }

  /// A daemon whose main thread has exited while another thread still runs (SIGKILL reaches
  /// every thread, but one in an fdatasync finishes it first) is alive: it still holds its files
  /// and the container's lock, so `ubiqfs unmount` must wait for it, or a mount right after fails.
  @Test func aProcessWhoseMainThreadExitedWhileAnotherRunsIsAlive() throws {
    let p = Process()
    p.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
    p.arguments = [
      "-c",
      "import ctypes, threading, time; threading.Thread(target=lambda: time.sleep(1.5)).start(); "
        + "ctypes.CDLL(None).pthread_exit(None)",
    ]
    try p.run()
    let record = DaemonRecord(
      pid: p.processIdentifier, mountpoint: "/m", container: "iCloud.x", account: "a", startedAt: Date())
    // Until the main thread is a zombie.
    let deadline = Date().addingTimeInterval(1)
    var leaderExited = false
    while !leaderExited && Date() < deadline {
      let stat = (try? String(contentsOfFile: "/proc/\(p.processIdentifier)/stat", encoding: .utf8)) ?? ""
      leaderExited = stat.split(separator: ")").last?.trimmingCharacters(in: .whitespaces).hasPrefix("Z") == true
      usleep(10_000)
    }
    #expect(leaderExited, "the main thread exits first")
    #expect(record.isAlive, "its other thread still runs")
    p.waitUntilExit()
    #expect(!record.isAlive, "gone once every thread has exited")
  }

  @Test func containerFoldersLiveUnderTheirAccountAndAreListedInOrder() throws {
    let root = try TemporaryRoot()
    #expect(root.paths.cloudDir.path == root.url.path + "/cloud")
    let b = try root.makeContainer(account: "bob", "iCloud.b")
    let a = try root.makeContainer(account: "alice", "iCloud.a")
    #expect(a.path == root.url.path + "/accounts/alice/iCloud.a")
    #expect(root.paths.allContainerDirs().map(\.path) == [a.path, b.path])
    // A folder without an index is no container state.
    try FileManager.default.createDirectory(
      at: root.paths.containerDir(account: "carol", try ContainerID("iCloud.c")), withIntermediateDirectories: true)
    #expect(ContainerState.all(root.paths).map(\.container) == ["iCloud.a", "iCloud.b"])
    #expect(ContainerState.all(root.paths).map(\.account) == ["alice", "bob"])
  }

  @Test func aRecordWhoseProcessIsGoneIsACrashAndALiveOneIsTheDaemon() throws {
    let root = try TemporaryRoot()
    let crashedDir = try root.makeContainer(account: "local", "iCloud.crashed")
    let liveDir = try root.makeContainer(account: "local", "iCloud.live")
    let dead = try deadPID()
    try root.writeRecord(
      DaemonRecord(
        pid: dead, mountpoint: "/mnt/gone", container: "iCloud.crashed", account: "local", startedAt: Date()),
      in: crashedDir)
    try root.writeRecord(
      DaemonRecord(
        pid: getpid(), mountpoint: "/mnt/live", container: "iCloud.live", account: "local", startedAt: Date()),
      in: liveDir)

    let states = Dictionary(uniqueKeysWithValues: ContainerState.all(root.paths).map { ($0.container, $0) })
    let crashed = try #require(states["iCloud.crashed"])
    #expect(crashed.daemon == nil)
    #expect(crashed.crashed?.pid == dead)
    #expect(crashed.crashed?.staleMount == false)
    #expect(crashed.crashed?.remedy == "ubiqfs mount iCloud.crashed /mnt/gone")
    #expect(crashed.crashed?.summary.contains("remount with `ubiqfs mount iCloud.crashed /mnt/gone`") == true)
    let live = try #require(states["iCloud.live"])
    #expect(live.daemon?.mountpoint == "/mnt/live")
    #expect(live.crashed == nil)
  }

  @Test func aRecordFromBeforeTheLastBootIsNeitherRunningNorACrash() throws {
    let root = try TemporaryRoot()
    let dir = try root.makeContainer(account: "local", "iCloud.old")
    let old = DaemonRecord(
      pid: getpid(), mountpoint: "/mnt/old", container: "iCloud.old", account: "local",
      startedAt: Date(timeIntervalSince1970: 1000))
    #expect(!old.startedThisBoot)
    try root.writeRecord(old, in: dir)
    let state = try #require(ContainerState.all(root.paths).first)
    #expect(state.daemon == nil)
    #expect(state.crashed == nil)
  }

  @Test func aPathOutsideEveryMountIsAClearError() throws {
    let root = try TemporaryRoot()
    _ = try root.makeContainer(account: "local", "iCloud.x")
    #expect(throws: UbiqError.self) { try ContainerState.locate(root.url.path, root.paths) }
  }

  @Test func theAccountFileIsPrivateToItsOwnerAndReadsBack() throws {
    let root = try TemporaryRoot()
    #expect(try AccountConfig.load(root.paths) == nil)
    #expect(root.paths.activeAccount == AccountName.local)
    let config = AccountConfig(
      server: "https://example.test:8443", account: "alice", device: "laptop", tokenID: "t1", token: "secret",
      caCertificatePEM: nil, insecureHTTP: nil)
    try config.save(root.paths)
    var st = stat()
    #expect(stat(AccountConfig.url(root.paths).path, &st) == 0)
    #expect(st.st_mode & 0o777 == 0o600)
    let loaded = try #require(try AccountConfig.load(root.paths))
    #expect(loaded.account == "alice" && loaded.token == "secret" && loaded.server == config.server)
    #expect(root.paths.activeAccount == "alice")
    #expect(try CloudSession.open(root.paths).account == "alice")
    try AccountConfig.remove(root.paths)
    #expect(try CloudSession.open(root.paths).account == AccountName.local)
  }

  @Test func aDamagedAccountFileSaysWhatToRun() throws {
    let root = try TemporaryRoot()
    try Data("{not json".utf8).write(to: AccountConfig.url(root.paths))
    #expect {
      try AccountConfig.load(root.paths)
    } throws: { error in
      "\(error)".contains("ubiqfs account logout")
    }
  }

  @Test func mountinfoEscapesAreDecoded() {
    #expect(MountTable.unescape(#"/mnt/with\040space"#) == "/mnt/with space")
    #expect(MountTable.unescape(#"/a\011tab\134slash"#) == "/a\ttab\\slash")
    #expect(MountTable.unescape(#"/bad\09"#) == #"/bad\09"#)
  }

  @Test func aMountPointMustBeAnExistingFreeDirectory() throws {
    let root = try TemporaryRoot()
    var reports: [String] = []
    try MountPoint.prepare(root.url.path) { reports.append($0) }
    #expect(reports.isEmpty)
    let missing = root.url.appendingPathComponent("missing").path
    #expect {
      try MountPoint.prepare(missing) { _ in }
    } throws: { error in
      "\(error)".contains("mkdir -p \(missing)")
    }
    let file = root.url.appendingPathComponent("file").path
    #expect(FileManager.default.createFile(atPath: file, contents: Data()))
    #expect(throws: UbiqError.self) { try MountPoint.prepare(file) { _ in } }
    // /proc is mounted and answers: never detached, always refused with the command to run.
    #expect {
      try MountPoint.prepare("/proc") { _ in }
    } throws: { error in
      "\(error)".contains("already a mount point (proc)")
    }
    #expect(MountPoint.deadConnection("/proc") == nil)
  }

  @Test func eventPathsFollowFolderRenames() throws {
    let root = try TemporaryRoot()
    let dir = try root.makeContainer(account: "local", "iCloud.events")
    let index = try IndexStore(path: dir.appendingPathComponent("index.sqlite").path)
    var paths = EventPaths(index: index)
    func event(
      _ kind: ChangeEvent.Kind, inode: Int64, dir: Bool = false, parent: Int64, _ name: String,
      from: (Int64, String)? = nil
    ) -> ChangeEvent {
      ChangeEvent(
        seq: 0, timeNs: 0, kind: kind, inode: inode, itemID: "i\(inode)", isDirectory: dir, parent: parent, name: name,
        oldParent: from?.0, oldName: from?.1, remote: false)
    }
    let rootInode = IndexStore.rootInode
    #expect(try paths.resolve(event(.created, inode: 10, dir: true, parent: rootInode, "a")) == ("a", nil))
    #expect(try paths.resolve(event(.created, inode: 11, dir: true, parent: 10, "sub")) == ("a/sub", nil))
    #expect(try paths.resolve(event(.created, inode: 12, parent: 11, "f.txt")) == ("a/sub/f.txt", nil))
    let renamed = try paths.resolve(
      event(.renamed, inode: 10, dir: true, parent: rootInode, "b", from: (rootInode, "a")))
    #expect(renamed == ("b", "a"))
    // Folders below the renamed one follow it.
    #expect(try paths.resolve(event(.modified, inode: 12, parent: 11, "f.txt")) == ("b/sub/f.txt", nil))
    let moved = try paths.resolve(event(.renamed, inode: 12, parent: 10, "g.txt", from: (11, "f.txt")))
    #expect(moved == ("b/g.txt", "b/sub/f.txt"))
  }
}
