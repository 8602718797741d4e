import ArgumentParser
import Foundation
import UbiqCloudAPI
import UbiqCore
import UbiqDaemon
import UbiqIndex
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// `ubiqfs status`: mounts, crashed daemons, pending uploads and upload errors.
struct StatusCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "status", abstract: "Show mounts, crashed daemons, pending uploads and upload errors.")

  @Argument(help: "Only the mount holding this path.") var path: String?
  @Flag(help: "Machine-readable output.") var json = false
  @Flag(help: "Refresh continuously (queue, bytes pending, per-file progress bars) until interrupted.")
  var watch = false
  @Option(help: .hidden) var iterations: Int?
  @OptionGroup var location: LocationOptions

  struct Report: Codable {
    var container: String
    var account: String
    var mountpoint: String?
    var pid: Int32?
    /// True when the daemon's mount was detached behind its back (lazy unmount) and it serves
    /// only the files still open on it.
    var detached: Bool?
    /// Set when the daemon died without unmounting.
    var crashed: CrashedDaemon?
    var queue: QueueSummary
    var uploading: [UploadProgress]
    /// The daemon's mount state for a user (`DaemonRecord.summary(of:)`; text output only).
    var mountSummary: String?

    enum CodingKeys: String, CodingKey {
      case container, account, mountpoint, pid, detached, crashed, queue, uploading
    }
  }

  func run() throws {
    guard watch else { return try once() }
    var n = 0
    while iterations.map({ n < $0 }) ?? true {
      if !json { print("\u{1B}[H\u{1B}[2J", terminator: "") }
      try once()
      fflush(nil)
      n += 1
      if iterations.map({ n >= $0 }) ?? false { break }
      usleep(500_000)
    }
  }

  static func bar(_ done: Int64, _ total: Int64, width: Int = 30) -> String {
    let frac = total > 0 ? min(1, Double(done) / Double(total)) : 0
    let filled = Int(frac * Double(width))
    return "[" + String(repeating: "#", count: filled) + String(repeating: "-", count: width - filled) + "] "
      + String(format: "%3d%%", Int(frac * 100))
  }

  func once() throws {
    try cli {
      var states = ContainerState.all(location.paths)
      if let path {
        let (s, _) = try ContainerState.locate(path, location.paths)
        states = [s]
      }
      var reports: [Report] = []
      for s in states {
        let index = try s.openIndex()
        let summary = try index.queueSummary()
        var uploading: [UploadProgress] = []
        if s.daemon != nil, let d = try? Data(contentsOf: s.dir.appendingPathComponent("progress.json")) {
          // progress.json trails by up to 250 ms: show only uploads that are still queued.
          uploading = ((try? JSONDecoder().decode([UploadProgress].self, from: d)) ?? []).filter {
            (try? index.queueEntry(forInode: $0.inode)) != nil
          }
        }
        let mount = s.daemon.map { ($0, $0.mountState) }
        reports.append(
          Report(
            container: s.container, account: s.account, mountpoint: s.daemon?.mountpoint, pid: s.daemon?.pid,
            detached: mount.map { $0.1 == .detached }, crashed: s.crashed, queue: summary, uploading: uploading,
            mountSummary: mount.map { $0.0.summary(of: $0.1) }))
      }
      if json {
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        print(String(decoding: try enc.encode(reports), as: UTF8.self))
        return
      }
      if reports.isEmpty { print("no containers (nothing mounted yet)") }
      let now = Clock.nowNs()
      for r in reports {
        let state = r.mountSummary ?? r.crashed?.summary ?? "not mounted"
        print("\(r.container) [account \(r.account)]: \(state)")
        let q = r.queue
        if q.pendingItems == 0 && q.pendingDeletes == 0 {
          print("  all changes uploaded")
        } else {
          print("  pending: \(q.pendingItems) uploads (\(formatBytes(q.pendingBytes))), \(q.pendingDeletes) deletes")
        }
        for u in r.uploading {
          print(
            "  uploading \(u.path) \(Self.bar(u.sentBytes, u.totalBytes)) \(formatBytes(u.sentBytes))/\(formatBytes(u.totalBytes))"
          )
        }
        for f in q.failing {
          let wait = max(0, (f.nextAttemptNs - now) / 1_000_000_000)
          print("  error: \(f.path): \(f.error) (attempt \(f.attempts), retry in \(wait)s)")
        }
        if q.waitingForParent > 0 {
          print("  \(q.waitingForParent) changes from the cloud wait for a folder that is not here yet")
        }
        for path in q.waitingForFiles {
          print("  a change from the cloud waits for \(path) to be uploaded, or closed by the processes reading it")
        }
        for r in q.refusedRecords {
          print("  refused a change from the cloud: item \(r.itemID) (name \(String(reflecting: r.name))): \(r.reason)")
        }
      }
    }
  }
}

/// `ubiqfs sync`: makes waiting uploads due now and, with --wait, waits for them.
struct SyncCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "sync", abstract: "Upload now; with --wait, return when everything under PATH is uploaded.",
    discussion: """
      With --wait on a terminal, a progress line shows what is left; --json prints it as one \
      JSON object per line (pendingUploads, pendingDeletes, pendingBytes, done) instead.
      """)

  @Flag(help: "Block until everything under PATH is uploaded.") var wait = false
  @Argument(help: "A path inside a mount (default: every mounted container).") var path: String?
  @Option(help: "Give up after this many seconds (exit 1).") var timeout: Double?
  @Flag(help: "With --wait, what is left as one JSON object per line (also when stdout is not a terminal).")
  var json = false
  @OptionGroup var location: LocationOptions

  /// What `sync --wait` still waits for.
  struct Report: ProgressReport {
    var pendingUploads: Int
    var pendingDeletes: Int
    /// Bytes of the pending uploads; reported when whole containers are synced.
    var pendingBytes: Int64?
    var done: Bool

    var line: String {
      if done { return "all changes uploaded" }
      let bytes = pendingBytes.map { " (\(formatBytes($0)))" } ?? ""
      return "waiting: \(pendingUploads) uploads\(bytes) and \(pendingDeletes) deletes left"
    }
  }

  func run() throws {
    try cli {
      var targets: [(ContainerState, Int64)] = []
      if let path {
        targets = [try ContainerState.locate(path, location.paths)]
      } else {
        let states = ContainerState.all(location.paths)
        targets = states.filter { $0.daemon != nil }.map { ($0, IndexStore.rootInode) }
        if targets.isEmpty, let crash = states.compactMap(\.crashed).first {
          throw MountPointError.daemonCrashed(crash)
        }
      }
      if targets.isEmpty {
        throw UbiqError.invalidArgument(
          "nothing is mounted; mount a container with `ubiqfs mount [CONTAINER] MOUNTPOINT`")
      }
      // Make waiting entries due now.
      for (s, _) in targets { try s.openIndex(readOnly: false).retryAllNow() }
      guard wait else { return }
      let deadline = timeout.map { Date().addingTimeInterval($0) }
      let printer = ProgressPrinter<Report>(style: .choose(json: json))
      var reported = Set<String>()
      var rounds = 0
      while true {
        var pending = 0
        var left = Report(pendingUploads: 0, pendingDeletes: 0, pendingBytes: path == nil ? 0 : nil, done: false)
        for (s, inode) in targets {
          let index = try s.openIndex()
          // Uploads under the path plus every delete: what the wait is for.
          let under = try index.pendingCount(under: inode)
          pending += under
          let summary = try index.queueSummary()
          left.pendingDeletes += summary.pendingDeletes
          left.pendingUploads += path == nil ? summary.pendingItems : max(0, under - summary.pendingDeletes)
          left.pendingBytes? += summary.pendingBytes
          for f in summary.failing where !reported.contains(f.path + f.error) {
            reported.insert(f.path + f.error)
            printer.clearLine()
            // The server signed this device out (a revoked or expired token): no retry helps
            // until the user signs in again, so the wait ends here.
            if f.errno == EACCES && f.error.hasPrefix(CloudError.notSignedIn) {
              throw UbiqError.accessDenied(
                "\(f.error); sign in again with 'ubiqfs account login' (changes stay queued here)")
            }
            eprint("ubiqfs: still trying: \(f.path): \(f.error)")
          }
        }
        if pending == 0 {
          // What was uploaded is recorded durably before the wait returns.
          for (s, _) in targets { try s.openIndex(readOnly: false).makeDurable() }
          printer.report(
            Report(pendingUploads: 0, pendingDeletes: 0, pendingBytes: path == nil ? 0 : nil, done: true), final: true)
          return
        }
        printer.report(left)
        rounds += 1
        if rounds % 100 == 0 {
          // While the user waits, entries in backoff are retried every 5 s.
          for (s, _) in targets { try? s.openIndex(readOnly: false).retryAllNow() }
        }
        if let deadline, Date() > deadline {
          printer.clearLine()
          throw UbiqError.busy("timed out with \(pending) uploads pending (see 'ubiqfs status')")
        }
        usleep(50_000)
      }
    }
  }
}

/// `ubiqfs find`: name search in the index (works on evicted items and offline).
struct FindCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "find", abstract: "Find items by name (glob) in the index; works on evicted items, offline.",
    discussion: "Exits 0 when something matches, 1 when nothing does, and 64 for a malformed pattern.")

  @Argument(help: "Name pattern, e.g. '*.txt'.") var pattern: String
  @Option(help: "Container identifier (default: every container).") var container: String?
  @Option(help: "At most this many results (1 or more).") var limit: Int = 1000
  @OptionGroup var location: LocationOptions

  func validate() throws {
    if let problem = IndexStore.globProblem(pattern) { throw ValidationError("pattern \(pattern): \(problem)") }
    if limit < 1 { throw ValidationError("--limit must be 1 or more") }
  }

  /// Prints the paths of the items that match; exits 1 when none does.
  func run() throws {
    try cli {
      if let container { _ = try ContainerID(container) }
      var found = 0
      for s in ContainerState.all(location.paths) where container == nil || s.container == container {
        for (p, _) in try s.openIndex().find(glob: pattern, limit: limit) {
          if let mp = s.daemon?.mountpoint { print(mp + "/" + p) } else { print("\(s.container):\(p)") }
          found += 1
        }
      }
      if found == 0 { throw ExitCode(1) }
    }
  }
}
