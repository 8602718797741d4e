import ArgumentParser
import CFuse3
import Foundation
import UbiqCore

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
    for p in paths {
      let abs = absolutePath(p)
      var st = stat()
      guard lstat(abs, &st) == 0 else { throw UbiqError.notFound(abs) }
      var targets = [abs]
      if st.st_mode & S_IFMT == S_IFDIR, let e = FileManager.default.enumerator(atPath: abs) {
        while let sub = e.nextObject() as? String { targets.append(abs + "/" + sub) }
      }
      for t in targets {
        var tst = stat()
        guard lstat(t, &tst) == 0, tst.st_mode & S_IFMT != S_IFLNK,
          let attr = xattr(isDirectory: tst.st_mode & S_IFMT == S_IFDIR)
        else { continue }
        if setxattr(t, attr.name, attr.value, attr.value.utf8.count, 0) != 0 {
          let err = errno
          if err == ENOTSUP || err == EOPNOTSUPP {
            throw UbiqError.invalidArgument("\(t) is not inside a ubiqfs mount (see 'ubiqfs status' for mounts)")
          }
          eprint("ubiqfs: \(rawValue) \(t): \(String(cString: strerror(err)))")
          failures += 1
        }
      }
    }
    if failures > 0 { throw ExitCode.failure }
  }
}

/// The paths a content command works on.
struct ContentPaths: ParsableArguments {
  @Argument(help: "Paths inside a mount (directories are processed recursively).", completion: .file())
  var paths: [String]

  func validate() throws { if paths.isEmpty { throw ValidationError("give at least one path") } }
}

/// `ubiqfs download PATH...`: fetch content now.
struct DownloadCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "download", abstract: "Download content now (directories recursively).",
    discussion: "The same as setting the user.ubiq.action xattr to 'download' on every file.")

  @OptionGroup var target: ContentPaths

  func run() throws { try cli { try ContentAction.download.apply(to: target.paths) } }
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
