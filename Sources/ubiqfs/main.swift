import ArgumentParser
import Foundation
import UbiqCore
import UbiqDaemon

/// `ubiqfs`: iCloud-style ubiquity containers for Linux.
struct Ubiqfs: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "ubiqfs",
    abstract: "iCloud-style ubiquity containers for Linux.",
    subcommands: [
      // Mounts and what they hold.
      MountCommand.self, UnmountCommand.self, StatusCommand.self, SyncCommand.self, CheckCommand.self,
      WatchCommand.self,
      FindCommand.self,
      DownloadCommand.self, EvictCommand.self, PinCommand.self, UnpinCommand.self,
      VersionsCommand.self, ResolveCommand.self,
      // The container's key-value store.
      KVCommand.self,
      // Server accounts: signing in on this machine, and running a server.
      AccountCommand.self, ServeCommand.self, ServerCommand.self,
    ])
}

/// Options every command that touches local state shares.
struct LocationOptions: ParsableArguments {
  @Option(help: "Folder for local state (index, content cache). Default: $UBIQFS_STATE_DIR or ~/.local/share/ubiqfs.")
  var stateDir: String?
  @Option(help: "Folder of the embedded cloud. Default: $UBIQFS_CLOUD_DIR or <state dir>/cloud.")
  var cloudDir: String?

  var paths: Paths { Paths(stateDir: stateDir, cloudDir: cloudDir) }
}

/// Runs a command body, turning typed errors into a one-line message and exit code 1.
func cli(_ body: () throws -> Void) throws {
  do {
    try body()
  } catch let e as UbiqError {
    eprint("ubiqfs: \(e.description)")
    throw ExitCode.failure
  } catch let e as ExitCode {
    throw e
  } catch let e as ValidationError {
    throw e
  } catch let e as CocoaError {
    // A file Foundation could not read or write: its path and the system's reason.
    let path = e.filePath ?? e.url?.path
    let reason = (e.underlying as? POSIXError).map { String(cString: strerror($0.code.rawValue)) }
    eprint("ubiqfs: \(path.map { "\($0): " } ?? "")\(reason ?? e.localizedDescription)")
    throw ExitCode.failure
  } catch let e as DecodingError {
    let detail: String
    switch e {
    case .dataCorrupted(let c), .keyNotFound(_, let c), .typeMismatch(_, let c), .valueNotFound(_, let c):
      detail = c.debugDescription
    @unknown default: detail = "\(e)"
    }
    eprint("ubiqfs: invalid JSON: \(detail)")
    throw ExitCode.failure
  } catch {
    eprint("ubiqfs: \(error)")
    throw ExitCode.failure
  }
}

/// Parses and runs; usage errors print one `ubiqfs: ...` line (help still prints in full).
func runCLI() -> Never {
  // Everything ubiqfs itself writes to disk is private state (client indexes, key-value
  // mirrors, content caches, tokens; the server's database and blobs): folders are created
  // 0700 and files 0600 by the system, with no window in which they are readable by others.
  // Files seen through a mount take their modes from the index, not from this mask.
  umask(0o077)
  // Arguments are bytes; Swift reads them as strings with U+FFFD in place of bytes that are
  // not UTF-8, which would turn two keys (or names) into one. Such an argument is refused.
  for i in 1..<Int(CommandLine.argc) {
    guard let raw = CommandLine.unsafeArgv[i], String(validatingCString: raw) == nil else { continue }
    eprint("ubiqfs: argument \(i) is not valid UTF-8")
    exit(ExitCode.validationFailure.rawValue)
  }
  do {
    var command = try Ubiqfs.parseAsRoot()
    try command.run()
    exit(0)
  } catch {
    let code = Ubiqfs.exitCode(for: error)
    if code == .success || error is CleanExit {
      Ubiqfs.exit(withError: error)
    }
    if error is ExitCode { exit(code.rawValue) }
    let message = Ubiqfs.message(for: error).split(separator: "\n").first.map(String.init) ?? "\(error)"
    eprint("ubiqfs: \(message.replacingOccurrences(of: "Error: ", with: "")) (see 'ubiqfs --help')")
    exit(code.rawValue)
  }
}

runCLI()
