import ArgumentParser
import CFuse3
import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// `ubiqfs download|evict|pin|unpin PATH...`: the same controls as the `user.ubiq.*` xattrs,
/// applied recursively to directories.
struct ContentCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "content", abstract: "Download, evict, pin or unpin content (also: ubiqfs download|evict|pin|unpin).",
    shouldDisplay: false)

  enum Action: String, ExpressibleByArgument, CaseIterable { case download, evict, pin, unpin }

  @Argument(help: "download | evict | pin | unpin") var action: Action
  @Argument(help: "Paths inside a mount (directories are processed recursively).") var paths: [String]

  func validate() throws { if paths.isEmpty { throw ValidationError("give at least one path") } }

  func run() throws {
    try cli {
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
          guard lstat(t, &tst) == 0, tst.st_mode & S_IFMT != S_IFLNK else { continue }
          let isDir = tst.st_mode & S_IFMT == S_IFDIR
          let (name, value): (String, String)
          switch action {
          case .download, .evict:
            if isDir { continue }
            (name, value) = ("user.ubiq.action", action.rawValue)
          case .pin: (name, value) = ("user.ubiq.pinned", "1")
          case .unpin: (name, value) = ("user.ubiq.pinned", "0")
          }
          if setxattr(t, name, value, value.utf8.count, 0) != 0 {
            let err = errno
            if err == ENOTSUP || err == EOPNOTSUPP {
              throw UbiqError.invalidArgument("\(t) is not inside a ubiqfs mount")
            }
            eprint("ubiqfs: \(action.rawValue) \(t): \(String(cString: strerror(err)))")
            failures += 1
          }
        }
      }
      if failures > 0 { throw ExitCode.failure }
    }
  }
}

/// Lets `ubiqfs evict PATH` etc. stand for `ubiqfs content evict PATH`.
func rewriteContentShortcuts(_ args: [String]) -> [String] {
  guard let first = args.first, ContentCommand.Action(rawValue: first) != nil else { return args }
  return ["content"] + args
}
