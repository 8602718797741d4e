import ArgumentParser
import CFuse3
import Foundation
import UbiqCore
import UbiqDaemon

#if canImport(Glibc)
  import Glibc
#endif

/// The content controls of a mount (the writable `user.ubiq.action` and `user.ubiq.pinned`
/// xattrs), applied to paths, recursively on directories.
enum ContentAction: String, CaseIterable, Sendable {
  case download, evict, pin, unpin

  /// The xattr that asks the daemon for this action on one item, or nil when the action does
  /// not apply to that kind of item (directories are only walked for download and evict).
  func xattr(isDirectory: Bool) -> (name: String, value: String)? {
    switch self {
    case .download, .evict: return isDirectory ? nil : ("user.ubiq.action", rawValue)
    case .pin: return ("user.ubiq.pinned", "1")
    case .unpin: return ("user.ubiq.pinned", "0")
    }
  }

  /// Applies the action to every path (and everything below directories). Items that refuse
  /// (evicting an open file, say) are reported one per line and make the whole run fail.
  func apply(to paths: [String]) throws {
    var failures = 0
    for t in try Self.walk(paths) {
      guard let attr = xattr(isDirectory: t.isDirectory) else { continue }
      if let message = try Self.set(t.path, attr.name, attr.value) {
        eprint("ubiqfs: \(rawValue) \(t.path): \(message)")
        failures += 1
      }
    }
    if failures > 0 { throw ExitCode.failure }
  }

  /// Every path and everything below the directories among them, symlinks left out. Every
  /// path is checked to be in a ubiqfs mount before anything is walked.
  static func walk(_ paths: [String]) throws -> [(path: String, isDirectory: Bool, size: Int64)] {
    let roots = paths.map(absolutePath)
    for abs in roots { try requireMounted(abs) }
    var out: [(String, Bool, Int64)] = []
    for abs in roots {
      var st = stat()
      guard lstat(abs, &st) == 0 else { throw UbiqError.notFound(abs) }
      var targets = [abs]
      if st.st_mode & S_IFMT == S_IFDIR, let e = FileManager.default.enumerator(atPath: abs) {
        while let sub = e.nextObject() as? String { targets.append(abs + "/" + sub) }
      }
      for t in targets {
        var tst = stat()
        guard lstat(t, &tst) == 0, tst.st_mode & S_IFMT != S_IFLNK else { continue }
        out.append((t, tst.st_mode & S_IFMT == S_IFDIR, Int64(tst.st_size)))
      }
    }
    return out
  }

  /// Throws unless `path` is an item of a ubiqfs mount: held by a `fuse.ubiqfs` file system
  /// (its symlinks resolved), and answering `user.ubiq.container`. A folder elsewhere would take
  /// the control attributes as ordinary user attributes, on everything below it.
  static func requireMounted(_ path: String) throws {
    var st = stat()
    guard lstat(path, &st) == 0 else { throw UbiqError.notFound(path) }
    let resolved = realpath(path, nil).map { p in
      defer { free(p) }
      return String(cString: p)
    }
    guard let resolved, MountTable.isInsideUbiqMount(resolved),
      get(path, "user.ubiq.container") != nil
    else {
      throw UbiqError.invalidArgument("\(path) is not inside a ubiqfs mount (see 'ubiqfs status' for mounts)")
    }
  }

  /// Sets one control xattr; returns the error text when the item refused. A path outside a
  /// ubiqfs mount (no such xattrs there) is an error for the whole command.
  static func set(_ path: String, _ name: String, _ value: String) throws -> String? {
    guard setxattr(path, name, value, value.utf8.count, 0) != 0 else { return nil }
    let err = errno
    if err == ENOTSUP || err == EOPNOTSUPP {
      throw UbiqError.invalidArgument("\(path) is not inside a ubiqfs mount (see 'ubiqfs status' for mounts)")
    }
    return String(cString: strerror(err))
  }

  /// A `user.ubiq.*` attribute of a path, if it has one.
  static func get(_ path: String, _ name: String) -> String? {
    var buf = [CChar](repeating: 0, count: 256)
    let n = getxattr(path, name, &buf, buf.count - 1)
    guard n >= 0 else { return nil }
    return String(decoding: buf[0..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self)
  }
}

/// The paths a content command works on.
struct ContentPaths: ParsableArguments {
  @Argument(help: "Paths inside a mount (directories are processed recursively).", completion: .file())
  var paths: [String]

  func validate() throws { if paths.isEmpty { throw ValidationError("give at least one path") } }
}

/// `ubiqfs download PATH...`: fetch content now, with progress on a terminal or as JSON lines.
struct DownloadCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "download", abstract: "Download content now (directories recursively).",
    discussion: """
      The same as setting the user.ubiq.action xattr to 'download' on every file. On a terminal \
      a progress line shows files, bytes, rate and ETA; --json prints one JSON object per line \
      (filesDone, filesTotal, bytesDone, bytesTotal, bytesPerSecond, etaSeconds, elapsedSeconds, \
      done) instead.
      """)

  @Flag(help: "Progress as one JSON object per line (also when stdout is not a terminal).") var json = false
  @OptionGroup var target: ContentPaths

  func run() throws {
    try cli { try DownloadJob(printer: ProgressPrinter(style: .choose(json: json))).run(target.paths) }
  }
}

/// Downloads every evicted file below some paths, one after the other (each setxattr returns
/// once that file's content is cached), while a timer reports progress.
/// Sendable: the counts and the current file are guarded by `lock`.
final class DownloadJob: @unchecked Sendable {
  /// Progress of a download run.
  struct Report: ProgressReport {
    var filesDone: Int
    var filesTotal: Int
    var bytesDone: Int64
    var bytesTotal: Int64
    var bytesPerSecond: Int64
    /// Seconds, to a tenth; absent until a rate is known.
    var etaSeconds: Double?
    var elapsedSeconds: Double
    var done: Bool

    var line: String {
      if done {
        if filesTotal == 0 { return "nothing to download" }
        let count = filesDone == filesTotal ? "\(filesDone)" : "\(filesDone) of \(filesTotal)"
        return "downloaded \(count) files (\(formatBytes(bytesDone))) in \(formatDuration(elapsedSeconds))"
      }
      let eta = etaSeconds.map(formatDuration) ?? "?"
      return "downloading: \(filesDone)/\(filesTotal) files, \(formatBytes(bytesDone))/\(formatBytes(bytesTotal)), "
        + "\(formatBytes(bytesPerSecond))/s, ETA \(eta)"
    }
  }

  let printer: ProgressPrinter<Report>
  private let lock = NSLock()
  private let start = Date()
  private var filesTotal = 0
  private var bytesTotal: Int64 = 0
  private var filesDone = 0
  private var bytesOfDoneFiles: Int64 = 0
  private var current: (path: String, size: Int64)?
  private var lastBytes: Int64 = 0

  init(printer: ProgressPrinter<Report>) { self.printer = printer }

  func run(_ paths: [String]) throws {
    var pending: [(path: String, size: Int64)] = []
    var failures = 0
    for t in try ContentAction.walk(paths) where !t.isDirectory {
      if ContentAction.get(t.path, "user.ubiq.status") == "not_downloaded" {
        pending.append((t.path, t.size))
      } else if let message = try ContentAction.set(t.path, "user.ubiq.action", "download") {
        // Cached already: this only fetches content whose local copy went missing.
        eprint("ubiqfs: download \(t.path): \(message)")
        failures += 1
      }
    }
    lock.withLock {
      filesTotal = pending.count
      bytesTotal = pending.reduce(0) { $0 + $1.size }
    }
    // Reports while a file downloads; not needed when nothing is shown.
    var timer: DispatchSourceTimer?
    if printer.style != .silent {
      let t = DispatchSource.makeTimerSource(queue: .global(qos: .utility))
      t.schedule(deadline: .now() + 0.1, repeating: 0.1)
      t.setEventHandler { [self] in printer.report(snapshot(done: false)) }
      t.resume()
      timer = t
    }
    for file in pending {
      lock.withLock { current = file }
      let message = try ContentAction.set(file.path, "user.ubiq.action", "download")
      lock.withLock {
        current = nil
        if message == nil {
          filesDone += 1
          bytesOfDoneFiles += file.size
        }
      }
      if let message {
        printer.clearLine()
        eprint("ubiqfs: download \(file.path): \(message)")
        failures += 1
      }
      printer.report(snapshot(done: false))
    }
    timer?.cancel()
    printer.report(snapshot(done: true), final: true)
    if failures > 0 { throw ExitCode.failure }
  }

  /// Where the run is: finished files plus the share of the current one downloaded so far.
  private func snapshot(done: Bool) -> Report {
    let (file, total, files) = lock.withLock { (current, bytesTotal, filesTotal) }
    var partial: Int64 = 0
    if let file, let percent = ContentAction.get(file.path, "user.ubiq.percent_downloaded").flatMap({ Int64($0) }) {
      partial = file.size * min(percent, 100) / 100
    }
    return lock.withLock {
      // The file may have finished while its percentage was read: count its share only while it
      // is still the current one, and never go backwards.
      let stillCurrent = file != nil && current?.path == file?.path
      lastBytes = max(lastBytes, min(total, bytesOfDoneFiles + (stillCurrent ? partial : 0)))
      let elapsed = Date().timeIntervalSince(start)
      let rate = elapsed > 0 ? Double(lastBytes) / elapsed : 0
      let eta = rate > 0 ? Double(total - lastBytes) / rate : nil
      func tenths(_ x: Double) -> Double { (x * 10).rounded() / 10 }
      return Report(
        filesDone: filesDone, filesTotal: files, bytesDone: lastBytes, bytesTotal: total,
        bytesPerSecond: Int64(rate), etaSeconds: done ? 0 : eta.map(tenths), elapsedSeconds: tenths(elapsed), done: done
      )
    }
  }
}

/// `ubiqfs evict PATH...`: drop local content; it downloads again on first read.
struct EvictCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "evict", abstract: "Drop local content; it downloads again on first read.",
    discussion: "Refused (EBUSY) for files not yet uploaded, open or pinned. Directories are processed recursively.")

  @OptionGroup var target: ContentPaths

  func run() throws { try cli { try ContentAction.evict.apply(to: target.paths) } }
}

/// `ubiqfs pin PATH...`: download and keep content (never evicted).
struct PinCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "pin", abstract: "Download and keep content: pinned items are never evicted.",
    discussion: "The same as setting the user.ubiq.pinned xattr to 1. Directories are processed recursively.")

  @OptionGroup var target: ContentPaths

  func run() throws { try cli { try ContentAction.pin.apply(to: target.paths) } }
}

/// `ubiqfs unpin PATH...`: let pinned content be evicted again.
struct UnpinCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "unpin", abstract: "Let pinned content be evicted again.",
    discussion: "The same as setting the user.ubiq.pinned xattr to 0. Directories are processed recursively.")

  @OptionGroup var target: ContentPaths

  func run() throws { try cli { try ContentAction.unpin.apply(to: target.paths) } }
}
