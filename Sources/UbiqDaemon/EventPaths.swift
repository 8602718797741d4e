import Foundation
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// Paths of the items events name, relative to the container root. Folders are looked up in
/// the index once and then followed through the events (renames, deletes), so a path is the
/// one the item had when the event happened, also for an item deleted since.
public struct EventPaths {
  public let index: IndexStore
  private var folders: [Int64: String] = [:]

  public init(index: IndexStore) { self.index = index }

  /// The event's path, and for a rename the path before it.
  public mutating func resolve(_ e: ChangeEvent) throws -> (String, String?) {
    let path = try join(e.parent, e.name)
    var from: String?
    if e.kind == .renamed { from = try join(e.oldParent, e.oldName ?? e.name) }
    if e.isDirectory {
      switch e.kind {
      case .deleted: dropFolder(path)
      case .renamed:
        if let from { moveFolder(from, to: path) }
        folders[e.inode] = path
      default: folders[e.inode] = path
      }
    }
    return (path, from)
  }

  private mutating func join(_ parent: Int64?, _ name: String) throws -> String {
    guard let parent else { return name }
    if let known = folders[parent] { return known.isEmpty ? name : known + "/" + name }
    let found = try index.path(of: parent) ?? "?"
    folders[parent] = found
    return found.isEmpty ? name : found + "/" + name
  }

  private mutating func dropFolder(_ path: String) {
    folders = folders.filter { $0.value != path && !$0.value.hasPrefix(path + "/") }
  }

  private mutating func moveFolder(_ old: String, to new: String) {
    for (inode, p) in folders where p == old || p.hasPrefix(old + "/") {
      folders[inode] = new + p.dropFirst(old.count)
    }
  }
}

/// Wakes a waiter when a file in a folder is written, created or renamed into it (inotify).
public final class DirectoryChanges {
  private let fd: Int32

  public init(_ directory: String) throws {
    fd = inotify_init1(Int32(IN_NONBLOCK | IN_CLOEXEC))
    guard fd >= 0 else { throw UbiqError.posix(errno, "inotify_init1") }
    let mask = UInt32(IN_MODIFY | IN_CLOSE_WRITE | IN_CREATE | IN_MOVED_TO)
    guard inotify_add_watch(fd, directory, mask) >= 0 else {
      let code = errno
      Glibc.close(fd)
      throw UbiqError.posix(code, "watching \(directory)")
    }
  }

  /// Returns after a change or `timeoutMs`, whichever comes first.
  public func wait(timeoutMs: Int32) {
    var p = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
    if poll(&p, 1, timeoutMs) > 0 {
      var buffer = [UInt8](repeating: 0, count: 4096)
      while read(fd, &buffer, buffer.count) > 0 {}
    }
  }

  public func close() { Glibc.close(fd) }
}
