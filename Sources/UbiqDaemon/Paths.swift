import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// Where ubiqfs keeps its files on this machine: the state root (per-account, per-container
/// index and content cache) and the embedded cloud's folder.
public struct Paths {
  public let stateRoot: URL
  public let cloudDir: URL

  public init(stateDir: String?, cloudDir cloudOverride: String?) {
    let env = ProcessInfo.processInfo.environment
    let root: String
    if let s = stateDir ?? env["UBIQFS_STATE_DIR"] {
      root = s
    } else if let x = env["XDG_DATA_HOME"], !x.isEmpty {
      root = x + "/ubiqfs"
    } else {
      root = NSHomeDirectory() + "/.local/share/ubiqfs"
    }
    stateRoot = URL(fileURLWithPath: absolutePath(root))
    self.cloudDir = URL(fileURLWithPath: absolutePath(cloudOverride ?? env["UBIQFS_CLOUD_DIR"] ?? (root + "/cloud")))
  }

  public func containerDir(account: String, _ c: ContainerID) -> URL {
    stateRoot.appendingPathComponent("accounts").appendingPathComponent(account).appendingPathComponent(c.rawValue)
  }

  /// Every container state folder that exists.
  public func allContainerDirs() -> [URL] {
    let fm = FileManager.default
    let accounts = stateRoot.appendingPathComponent("accounts")
    var out: [URL] = []
    for a in (try? fm.contentsOfDirectory(atPath: accounts.path)) ?? [] {
      for c in (try? fm.contentsOfDirectory(atPath: accounts.appendingPathComponent(a).path)) ?? [] {
        out.append(accounts.appendingPathComponent(a).appendingPathComponent(c))
      }
    }
    return out.sorted { $0.path < $1.path }
  }
}

/// The running daemon of a container, as recorded in `daemon.json` in its state folder.
public struct DaemonRecord: Codable, Sendable {
  public var pid: Int32
  public var mountpoint: String
  public var container: String
  public var account: String
  public var startedAt: Date
  /// When the kernel showed the mount; nil while the daemon is still mounting.
  public var mountedAt: Date?

  public init(pid: Int32, mountpoint: String, container: String, account: String, startedAt: Date) {
    self.pid = pid
    self.mountpoint = mountpoint
    self.container = container
    self.account = account
    self.startedAt = startedAt
  }

  /// How a running daemon's mount stands.
  public enum MountState: Sendable {
    /// The kernel shows it at its mount point.
    case mounted
    /// Not yet shown: the daemon is still mounting.
    case mounting
    /// Taken off its mount point behind the daemon's back (`fusermount3 -uz`, `umount -l`)
    /// while files on it are still open: the daemon serves them until the last one is closed,
    /// then ends.
    case detached
  }

  /// The mount's state, from the mount table (read once).
  public var mountState: MountState {
    if MountTable.isUbiqMount(mountpoint) { return .mounted }
    return mountedAt == nil ? .mounting : .detached
  }

  /// `state` (this record's `mountState`) for a user.
  public func summary(of state: MountState) -> String {
    switch state {
    case .mounted: return "mounted at \(mountpoint) (pid \(pid))"
    case .mounting: return "mounting at \(mountpoint) (pid \(pid))"
    case .detached:
      return "detached from \(mountpoint) (unmounted lazily; pid \(pid) serves the files still open "
        + "on it and ends when the last one is closed)"
    }
  }

  public static func load(_ dir: URL) -> DaemonRecord? {
    guard let d = try? Data(contentsOf: dir.appendingPathComponent("daemon.json")) else { return nil }
    return try? JSONDecoder().decode(DaemonRecord.self, from: d)
  }

  /// Forgets the record in `dir` (its daemon is gone and its mount too).
  public static func remove(_ dir: URL) {
    try? FileManager.default.removeItem(at: dir.appendingPathComponent("daemon.json"))
  }

  /// False for a record written before the machine last booted: that daemon cannot be running.
  public var startedThisBoot: Bool {
    guard let text = try? String(contentsOfFile: "/proc/stat", encoding: .utf8),
      let line = text.split(separator: "\n").first(where: { $0.hasPrefix("btime ") }),
      let boot = Double(line.dropFirst("btime ".count).trimmingCharacters(in: .whitespaces))
    else { return true }
    // btime is whole seconds; allow for the rounding.
    return startedAt.timeIntervalSince1970 >= boot - 1
  }

  /// True while the process exists and is not a zombie waiting to be reaped. Its main thread
  /// can be a zombie while another thread still exits (a SIGKILL'ed daemon with a thread in an
  /// fdatasync): the process then still holds its files, the container's lock among them, and
  /// is alive.
  public var isAlive: Bool {
    guard kill(pid, 0) == 0 || errno == EPERM else { return false }
    guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
      let close = stat.lastIndex(of: ")")
    else { return true }
    guard stat[stat.index(after: close)...].trimmingCharacters(in: .whitespaces).hasPrefix("Z") else { return true }
    let threads = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")) ?? []
    return threads.contains { $0 != String(pid) }
  }
}

public func absolutePath(_ p: String) -> String {
  let url =
    p.hasPrefix("/")
    ? URL(fileURLWithPath: p) : URL(fileURLWithPath: FileManager.default.currentDirectoryPath).appendingPathComponent(p)
  return url.standardizedFileURL.path
}

/// Mount table entries (from /proc/self/mountinfo).
public enum MountTable {
  public struct Entry {
    public var mountpoint: String
    public var fstype: String
  }

  public static func entries() -> [Entry] {
    guard let text = try? String(contentsOfFile: "/proc/self/mountinfo", encoding: .utf8) else { return [] }
    return text.split(separator: "\n").compactMap { line in
      let parts = line.split(separator: " ")
      guard let dash = parts.firstIndex(of: "-"), parts.count > dash + 1, parts.count > 4 else { return nil }
      return Entry(mountpoint: unescape(String(parts[4])), fstype: String(parts[dash + 1]))
    }
  }

  public static func unescape(_ s: String) -> String {
    var out = ""
    var it = s.makeIterator()
    while let c = it.next() {
      if c == "\\" {
        var digits = ""
        for _ in 0..<3 { if let d = it.next() { digits.append(d) } }
        if let v = UInt8(digits, radix: 8) { out.append(Character(UnicodeScalar(v))) } else { out += "\\" + digits }
      } else {
        out.append(c)
      }
    }
    return out
  }

  /// The type of the file system that holds `path` (an absolute path with no symlinks): that
  /// of the deepest mount point above it, the latest mounted there.
  public static func fileSystemType(holding path: String) -> String? {
    var best: Entry?
    for e in entries() where path == e.mountpoint || path.hasPrefix(e.mountpoint == "/" ? "/" : e.mountpoint + "/") {
      if e.mountpoint.count >= (best?.mountpoint.count ?? 0) { best = e }
    }
    return best?.fstype
  }

  /// Whether `path` (absolute, no symlinks) is held by a ubiqfs mount.
  public static func isInsideUbiqMount(_ path: String) -> Bool { fileSystemType(holding: path) == "fuse.ubiqfs" }

  public static func isUbiqMount(_ path: String) -> Bool {
    entries().contains { $0.mountpoint == path && $0.fstype == "fuse.ubiqfs" }
  }

  public static func isMounted(_ path: String) -> Bool { entries().contains { $0.mountpoint == path } }
}
