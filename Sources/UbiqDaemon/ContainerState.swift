import Foundation
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// A container's state folder with its daemon record (if mounted), the record of a daemon
/// that crashed (if one did), and its index.
public struct ContainerState {
  public let dir: URL
  public let daemon: DaemonRecord?
  public let crashed: CrashedDaemon?
  public let container: String
  public let account: String

  public static func all(_ paths: Paths) -> [ContainerState] {
    paths.allContainerDirs().compactMap { dir in
      guard FileManager.default.fileExists(atPath: dir.appendingPathComponent("index.sqlite").path) else { return nil }
      // A record from before the last boot is no crash: that mount ended with the machine.
      let record = DaemonRecord.load(dir).flatMap { $0.startedThisBoot ? $0 : nil }
      let alive = record?.isAlive == true
      return ContainerState(
        dir: dir, daemon: alive ? record : nil, crashed: alive ? nil : record.map(CrashedDaemon.init),
        container: dir.lastPathComponent, account: dir.deletingLastPathComponent().lastPathComponent)
    }
  }

  public func openIndex(readOnly: Bool = true) throws -> IndexStore {
    try IndexStore(path: dir.appendingPathComponent("index.sqlite").path, readOnly: readOnly)
  }

  /// The mounted container holding `path`, and the path's inode in it.
  public static func locate(_ path: String, _ paths: Paths) throws -> (ContainerState, Int64) {
    let abs = absolutePath(path)
    func holds(_ mountpoint: String) -> Bool { abs == mountpoint || abs.hasPrefix(mountpoint + "/") }
    let states = all(paths)
    let state = states.filter { $0.daemon.map { holds($0.mountpoint) } ?? false }
      .max { $0.daemon!.mountpoint.count < $1.daemon!.mountpoint.count }
    guard let state else {
      if let crash = states.compactMap(\.crashed).first(where: { holds($0.mountpoint) }) {
        throw MountPointError.daemonCrashed(crash)
      }
      if MountTable.isInsideUbiqMount(abs) {
        throw UbiqError.invalidArgument(
          "\(abs) is in a ubiqfs mount of another state folder than \(paths.stateRoot.path); "
            + "give that mount's --state-dir (or UBIQFS_STATE_DIR)")
      }
      throw UbiqError.invalidArgument("\(abs) is not inside a ubiqfs mount (see 'ubiqfs status' for mounts)")
    }
    var st = stat()
    guard lstat(abs, &st) == 0 else { throw UbiqError.notFound(abs) }
    return (state, Int64(st.st_ino))
  }
}
