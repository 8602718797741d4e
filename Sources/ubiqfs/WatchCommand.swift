import ArgumentParser
import Foundation
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// `ubiqfs watch`: prints each change of a mounted container's items once the index has
/// committed it, local and remote alike. The kernel raises inotify events only for changes
/// made through the mount; changes that arrive from the cloud show up here.
struct WatchCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "watch",
    abstract: "Print changes as they happen, local and remote (created, modified, deleted, renamed, downloaded, "
      + "evicted, uploaded, conflict).",
    discussion: """
      Runs until interrupted. With --json, one object per line: {"seq", "time", "event", "path", "from" (renamed), \
      "kind" (file, directory), "origin" (local, remote), "itemID"}. --since SEQ resumes after an earlier line.
      """)

  @Argument(help: "Only changes at or below this path inside a mount (default: the one mount).") var path: String?
  @Flag(help: "One JSON object per line.") var json = false
  @Option(help: "Start after this event number (an earlier line's seq) instead of now.") var since: Int64?
  @OptionGroup var location: LocationOptions

  func run() throws {
    try cli {
      let (state, scope) = try target()
      guard let mountpoint = state.daemon?.mountpoint else {
        throw UbiqError.invalidArgument("\(state.container) is not mounted")
      }
      let index = try state.openIndex()
      let start = try since ?? index.lastEventSeq()
      if let since, let first = try index.firstEventSeq(), first > since + 1 {
        eprint("ubiqfs: events \(since + 1) to \(first - 1) are no longer kept; starting at \(first)")
      }
      let wake = try DirectoryChanges(state.dir.path)
      defer { wake.close() }
      var paths = EventPaths(index: index)
      var after = start
      while true {
        let batch = try index.events(after: after, limit: 500)
        for event in batch {
          after = event.seq
          let (path, from) = try paths.resolve(event)
          if let scope, !inside(path, scope) && !(from.map { inside($0, scope) } ?? false) { continue }
          print(line(event, path: mountpoint + "/" + path, from: from.map { mountpoint + "/" + $0 }))
          fflush(nil)
        }
        // The index commits through its write-ahead log in the state folder: any write there
        // wakes the loop; a second without one looks anyway.
        if batch.count < 500 { wake.wait(timeoutMs: 1000) }
      }
    }
  }

  /// The container to watch and the path (relative to its root) to limit the output to.
  func target() throws -> (ContainerState, String?) {
    if let path {
      let (state, _) = try ContainerState.locate(path, location.paths)
      let abs = absolutePath(path)
      let mountpoint = state.daemon!.mountpoint
      return (state, abs == mountpoint ? nil : String(abs.dropFirst(mountpoint.count + 1)))
    }
    let mounted = ContainerState.all(location.paths).filter { $0.daemon != nil }
    guard mounted.count == 1 else {
      throw UbiqError.invalidArgument(
        mounted.isEmpty ? "nothing is mounted" : "\(mounted.count) containers are mounted; give a path inside one")
    }
    return (mounted[0], nil)
  }

  func inside(_ path: String, _ scope: String) -> Bool { path == scope || path.hasPrefix(scope + "/") }

  func line(_ e: ChangeEvent, path: String, from: String?) -> String {
    let time = Date(timeIntervalSince1970: Double(e.timeNs) / 1e9)
    if json {
      var object: [String: Any] = [
        "seq": e.seq, "time": time.ISO8601Format(Date.ISO8601FormatStyle(includingFractionalSeconds: true)),
        "event": e.kind.rawValue, "path": path, "kind": e.isDirectory ? "directory" : "file",
        "origin": e.remote ? "remote" : "local", "itemID": e.itemID,
      ]
      if let from { object["from"] = from }
      let data = (try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys, .withoutEscapingSlashes]))
      return data.map { String(decoding: $0, as: UTF8.self) } ?? "{}"
    }
    let clock = time.formatted(.iso8601.time(includingFractionalSeconds: true))
    let what = e.kind.rawValue.padding(toLength: 10, withPad: " ", startingAt: 0)
    let origin = e.remote ? "  (remote)" : ""
    return from.map { "\(clock) \(what) \($0) -> \(path)\(origin)" } ?? "\(clock) \(what) \(path)\(origin)"
  }
}

/// Paths of the items events name, relative to the container root. Folders are looked up in
/// the index once and then followed through the events (renames, deletes), so a path is the
/// one the item had when the event happened, also for an item deleted since.
struct EventPaths {
  let index: IndexStore
  private var folders: [Int64: String] = [:]

  init(index: IndexStore) { self.index = index }

  /// The event's path, and for a rename the path before it.
  mutating func resolve(_ e: ChangeEvent) throws -> (String, String?) {
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
final class DirectoryChanges {
  private let fd: Int32

  init(_ directory: String) throws {
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
  func wait(timeoutMs: Int32) {
    var p = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
    if poll(&p, 1, timeoutMs) > 0 {
      var buffer = [UInt8](repeating: 0, count: 4096)
      while read(fd, &buffer, buffer.count) > 0 {}
    }
  }

  func close() { Glibc.close(fd) }
}
