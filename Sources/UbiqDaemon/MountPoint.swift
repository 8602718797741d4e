import CFuse3
import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// Why a mount point cannot be used, or why a command needs a daemon that is not there; each
/// message ends with what to run.
public enum MountPointError: Error, CustomStringConvertible {
  /// Something is mounted there and answers.
  case alreadyMounted(String, fstype: String)
  /// A mount of another filesystem whose server is gone; ubiqfs leaves it alone.
  case staleForeignMount(String, fstype: String)
  /// Detaching a stale ubiqfs mount failed.
  case detachFailed(String, reason: String)
  /// The daemon serving a path died without unmounting.
  case daemonCrashed(CrashedDaemon)

  public var description: String {
    switch self {
    case .alreadyMounted(let mp, let fstype) where fstype == "fuse.ubiqfs":
      return "\(mp) is already a mount point (ubiqfs); unmount it first with `ubiqfs unmount \(mp)`"
    case .alreadyMounted(let mp, let fstype):
      return "\(mp) is already a mount point (\(fstype)); unmount it first with `umount \(mp)`"
    case .staleForeignMount(let mp, let fstype):
      return "\(mp) is a stale \(fstype) mount (its server is gone); detach it with `fusermount3 -uz \(mp)`"
    case .detachFailed(let mp, let reason):
      return
        "\(mp) is a stale mount and detaching it failed (\(reason)); run `fusermount3 -uz \(mp)` (or `umount -l \(mp)` as root)"
    case .daemonCrashed(let c):
      return c.summary
    }
  }
}

/// A daemon that died without unmounting: its `daemon.json` is left behind and its process is gone.
public struct CrashedDaemon: Codable, Equatable, Sendable {
  public var pid: Int32
  public var mountpoint: String
  /// The kernel still lists the mount (every access fails with ENOTCONN).
  public var staleMount: Bool
  /// The command that brings the container back.
  public var remedy: String

  public init(_ record: DaemonRecord) {
    pid = record.pid
    mountpoint = record.mountpoint
    staleMount = MountTable.isUbiqMount(record.mountpoint)
    remedy = "ubiqfs mount \(record.container) \(record.mountpoint)"
  }

  /// One line for status output and error messages.
  public var summary: String {
    let location = staleMount ? "; \(mountpoint) is a stale mount" : " (it was mounted at \(mountpoint))"
    return "daemon crashed (pid \(pid) is gone)\(location); remount with `\(remedy)`"
  }
}

/// Checks a mount point before mounting and recovers one left stale by a crashed daemon.
public enum MountPoint {
  /// Makes `path` ready to mount on: it must be a directory with nothing mounted on it. A
  /// ubiqfs mount whose daemon is gone is lazily detached first and `report` gets one line
  /// saying so; anything else mounted there is an error.
  public static func prepare(_ path: String, report: (String) -> Void) throws {
    var detached = 0
    // Only something mounted right there can be stale; a plain directory is never asked.
    while let entry = MountTable.entries().last(where: { $0.mountpoint == path }), let err = deadConnection(path) {
      let fstype = entry.fstype
      guard fstype == "fuse.ubiqfs" else { throw MountPointError.staleForeignMount(path, fstype: fstype) }
      // Stacked stale mounts come off one at a time; a handful is already far from normal.
      guard detached < 8 else { throw MountPointError.detachFailed(path, reason: String(cString: strerror(err))) }
      try detach(path)
      detached += 1
    }
    if detached > 0 {
      report("\(path) was a stale mount (its daemon had crashed); detached it lazily and mounting again")
    }
    var st = stat()
    guard stat(path, &st) == 0 else {
      let err = errno
      if err == ENOENT {
        throw UbiqError.notFound("mount point \(path) does not exist; create it with `mkdir -p \(path)`")
      }
      throw UbiqError.io("mount point \(path): \(String(cString: strerror(err)))")
    }
    if st.st_mode & S_IFMT != S_IFDIR { throw UbiqError.notDirectory("mount point \(path)") }
    if let entry = MountTable.entries().last(where: { $0.mountpoint == path }) {
      throw MountPointError.alreadyMounted(path, fstype: entry.fstype)
    }
  }

  /// Detaches the mount that a crashed daemon of the same container (its `record`) left at
  /// another mount point, if that still answers ENOTCONN; `report` gets one line either way.
  /// Mounting goes on if detaching fails.
  public static func recoverPrevious(_ record: DaemonRecord?, mountingAt path: String, report: (String) -> Void) {
    guard let record, record.mountpoint != path, !record.isAlive, MountTable.isUbiqMount(record.mountpoint),
      deadConnection(record.mountpoint) != nil
    else { return }
    do {
      try detach(record.mountpoint)
      report("\(record.mountpoint) was a stale mount (its daemon, pid \(record.pid), had crashed); detached it lazily")
    } catch {
      report("\(error)")
    }
  }

  /// The errno of a FUSE mount at `path` whose daemon is gone (ENOTCONN, or ECONNABORTED for
  /// an aborted connection), nil otherwise. statvfs always reaches the daemon, where stat may be
  /// answered from the kernel's attribute cache.
  public static func deadConnection(_ path: String) -> Int32? {
    var fs = statvfs()
    guard statvfs(path, &fs) != 0 else { return nil }
    let err = errno
    return err == ENOTCONN || err == ECONNABORTED ? err : nil
  }

  /// Lazily detaches the mount at `path`: `fusermount3 -uz`, or `umount -l` (which works for
  /// root) when that fails.
  public static func detach(_ path: String) throws {
    var reasons: [String] = []
    for (tool, args) in [("fusermount3", ["-u", "-z", path]), ("umount", ["-l", path])] {
      guard let exe = ["/usr/bin/", "/bin/"].map({ $0 + tool }).first(where: { access($0, X_OK) == 0 }) else {
        reasons.append("\(tool) not found")
        continue
      }
      let p = Process()
      p.executableURL = URL(fileURLWithPath: exe)
      p.arguments = args
      let errPipe = Pipe()
      p.standardError = errPipe
      p.standardOutput = FileHandle.nullDevice
      try p.run()
      let message = errPipe.fileHandleForReading.readDataToEndOfFile()
      p.waitUntilExit()
      if p.terminationStatus == 0 { return }
      reasons.append(String(decoding: message, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines))
    }
    throw MountPointError.detachFailed(path, reason: reasons.joined(separator: "; "))
  }
}
