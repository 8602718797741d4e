import ArgumentParser
import Foundation
import UbiqCore
import UbiqDaemon
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
