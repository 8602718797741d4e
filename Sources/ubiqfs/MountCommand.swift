import ArgumentParser
import Foundation
import UbiqCore
import UbiqDaemon
import UbiqFS
import UbiqFSCore

#if canImport(Glibc)
  import Glibc
#endif

/// `ubiqfs mount`: starts the daemon of a container (in the background, or in the foreground
/// for systemd) once the mount point is ready.
struct MountCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "mount", abstract: "Mount a container (default iCloud.default) at MOUNTPOINT.")

  @Argument(help: "Container identifier (e.g. iCloud.com.example.notes), then the mount point.")
  var arguments: [String]
  @Flag(name: .shortAndLong, help: "Stay in the foreground (for systemd); default is to return once mounted.")
  var foreground = false
  @Option(help: "Seconds the kernel may cache names and attributes.")
  var cacheTimeout: Double = 60.0
  @Option(help: "Milliseconds an upload waits after the last change (coalesces editor saves).")
  var uploadDelayMs: Int = 1000
  @Option(help: "Milliseconds to wait before retrying after the cloud's change feed failed.")
  var pullIntervalMs: Int = 1000
  @Option(help: "Content cache budget, e.g. 10G, 500M; 0 or left out: no limit besides --min-free.")
  var cacheBudget: String?
  @Option(help: "Cap download bandwidth, bytes per second (e.g. 10M); 0 or left out: unlimited.")
  var downloadLimit: String?
  @Option(help: "Cap upload bandwidth, bytes per second (e.g. 10M); 0 or left out: unlimited.")
  var uploadLimit: String?
  @Option(help: "Free space to keep on the cache's disk, e.g. 1G.")
  var minFree: String = "1G"
  @Option(help: "Comma-separated program names whose reads never download (replaces the default list).")
  var noDownloadPrograms: String?
  @Flag(help: "Verbose logging (and libfuse debug output).")
  var debug = false
  @OptionGroup var location: LocationOptions

  func validate() throws {
    if arguments.isEmpty || arguments.count > 2 {
      throw ValidationError("usage: ubiqfs mount [CONTAINER] MOUNTPOINT")
    }
    if uploadDelayMs < 0 { throw ValidationError("--upload-delay-ms must be >= 0") }
    if pullIntervalMs < 10 { throw ValidationError("--pull-interval-ms must be >= 10") }
    do {
      _ = try cacheBudget.map(parseSize)
      _ = try downloadLimit.map(parseSize)
      _ = try uploadLimit.map(parseSize)
      _ = try parseSize(minFree)
    } catch { throw ValidationError("\(error)") }
  }

  func run() throws {
    try cli {
      let container = arguments.count == 2 ? try ContainerID(arguments[0]) : ContainerID.defaultContainer
      let mountpoint = absolutePath(arguments.last!)
      if foreground {
        var options = MountOptions()
        options.attrTimeout = cacheTimeout
        options.entryTimeout = cacheTimeout
        options.debug = debug
        options.cacheBudgetBytes = try cacheBudget.map(parseSize) ?? 0
        options.minFreeBytes = try parseSize(minFree)
        if let list = noDownloadPrograms {
          options.noDownloadPrograms = Set(list.split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) })
        }
        let daemon = Daemon(
          container: container, mountpoint: mountpoint, paths: location.paths, options: options,
          uploadDelayMs: uploadDelayMs, pullIntervalMs: pullIntervalMs,
          downloadLimitBytes: try downloadLimit.map(parseSize) ?? 0,
          uploadLimitBytes: try uploadLimit.map(parseSize) ?? 0)
        let rc = try daemon.run()
        if rc != 0 { throw ExitCode(rc) }
      } else {
        try startInBackground(container: container, mountpoint: mountpoint)
      }
    }
  }

  /// Starts `ubiqfs mount --foreground ...` detached (new session, output to the container's
  /// daemon.log) and returns once the kernel shows the mount, or fails with the daemon's error.
  func startInBackground(container: ContainerID, mountpoint: String) throws {
    // Checked here too: an existing mount at MOUNTPOINT would look like success below. A mount
    // left stale by a crashed daemon is detached here, so the line saying so reaches the user.
    try MountPoint.prepare(mountpoint) { eprint("ubiqfs: \($0)") }
    let paths = location.paths
    let dir = paths.containerDir(account: paths.activeAccount, container)
    try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
    MountPoint.recoverPrevious(DaemonRecord.load(dir), mountingAt: mountpoint) { eprint("ubiqfs: \($0)") }
    let logPath = dir.appendingPathComponent("daemon.log").path
    var args = [
      "/proc/self/exe", "mount", "--foreground", container.rawValue, mountpoint,
      "--state-dir", paths.stateRoot.path, "--cloud-dir", paths.cloudDir.path,
      "--cache-timeout", String(cacheTimeout), "--upload-delay-ms", String(uploadDelayMs),
      "--pull-interval-ms", String(pullIntervalMs), "--min-free", minFree,
    ]
    if debug { args.append("--debug") }
    if let cacheBudget { args += ["--cache-budget", cacheBudget] }
    if let downloadLimit { args += ["--download-limit", downloadLimit] }
    if let uploadLimit { args += ["--upload-limit", uploadLimit] }
    if let noDownloadPrograms { args += ["--no-download-programs", noDownloadPrograms] }
    let exe = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/exe")) ?? CommandLine.arguments[0]
    args[0] = exe
    let startOffset = (try? FileManager.default.attributesOfItem(atPath: logPath)[.size] as? Int) ?? 0

    var fa: posix_spawn_file_actions_t = posix_spawn_file_actions_t()
    posix_spawn_file_actions_init(&fa)
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0)
    posix_spawn_file_actions_addopen(&fa, 1, logPath, O_WRONLY | O_CREAT | O_APPEND, 0o600)
    posix_spawn_file_actions_adddup2(&fa, 1, 2)
    var attr = posix_spawnattr_t()
    posix_spawnattr_init(&attr)
    posix_spawnattr_setflags(&attr, Int16(0x80))  // POSIX_SPAWN_SETSID
    var pid: pid_t = 0
    let cargs = args.map { strdup($0) } + [nil]
    defer { for arg in cargs { free(arg) } }
    let rc = posix_spawn(&pid, exe, &fa, &attr, cargs, environ)
    posix_spawn_file_actions_destroy(&fa)
    posix_spawnattr_destroy(&attr)
    guard rc == 0 else { throw UbiqError.io("cannot start the daemon: \(String(cString: strerror(rc)))") }

    let deadline = Date().addingTimeInterval(30)
    while Date() < deadline {
      if MountTable.isUbiqMount(mountpoint) {
        print("mounted \(container) at \(mountpoint)")
        return
      }
      var status: Int32 = 0
      if waitpid(pid, &status, WNOHANG) == pid {
        let text = (try? String(contentsOfFile: logPath, encoding: .utf8)) ?? ""
        let tail = String(text.utf8.dropFirst(startOffset)) ?? ""
        // The daemon's own one-line error, as it said it; else only that it ended.
        guard let lastError = tail.split(separator: "\n").last(where: { $0.hasPrefix("ubiqfs:") }) else {
          throw UbiqError.io("the daemon exited (log: \(logPath))")
        }
        eprint("\(lastError) (log: \(logPath))")
        throw ExitCode.failure
      }
      usleep(20_000)
    }
    kill(pid, SIGTERM)
    throw UbiqError.io("the mount did not appear within 30 s (log: \(logPath))")
  }
}

/// `ubiqfs unmount`: unmounts and waits for the daemon to exit.
struct UnmountCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "unmount", abstract: "Unmount a ubiqfs mount; queued uploads resume at the next mount.")

  @Argument(help: "The mount point.") var mountpoint: String
  @Flag(help: "Detach now even if files are open (finishes when they close).") var lazy = false
  @OptionGroup var location: LocationOptions

  func run() throws {
    try cli {
      let mp = absolutePath(mountpoint)
      guard MountTable.isUbiqMount(mp) else {
        throw UbiqError.invalidArgument("\(mp) is not a ubiqfs mount (see 'ubiqfs status' for mounts)")
      }
      let dirs = location.paths.allContainerDirs()
      let owner = dirs.first { DaemonRecord.load($0)?.mountpoint == mp }
      let daemon = owner.flatMap(DaemonRecord.load)
      try unmountAndWait(mp, lazy: lazy, daemon: daemon)
      // A crashed daemon left its record behind; once its mount is gone there is nothing to report.
      if let owner, let daemon, !daemon.isAlive { DaemonRecord.remove(owner) }
      print("unmounted \(mp)")
    }
  }
}

/// Parses sizes like 1048576, 512K, 500M, 10G (powers of 1024).
func parseSize(_ text: String) throws -> Int64 {
  let t = text.trimmingCharacters(in: .whitespaces).uppercased().replacingOccurrences(of: "IB", with: "")
    .replacingOccurrences(of: "B", with: "")
  let units: [Character: Int64] = ["K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40]
  var digits = t
  var mult: Int64 = 1
  if let last = t.last, let m = units[last] {
    mult = m
    digits = String(t.dropLast())
  }
  guard let v = Double(digits), v.isFinite, v >= 0 else {
    throw UbiqError.invalidArgument("'\(text)' is not a size (e.g. 500M, 10G)")
  }
  // Int64.max is not exactly a Double: stay strictly below 2^63.
  let bytes = v * Double(mult)
  guard bytes < 9_223_372_036_854_775_808.0 else {
    throw UbiqError.invalidArgument("the size '\(text)' is too large (at most 8 EiB)")
  }
  return Int64(bytes)
}

/// Parses a lifetime such as `90d`, `12h`, `30m`, `45s` or a plain number of seconds
/// (0 only where `allowZero`).
func parseDuration(_ text: String, allowZero: Bool = false) throws -> Int64 {
  let t = text.trimmingCharacters(in: .whitespaces).lowercased()
  let units: [Character: Int64] = ["s": 1, "m": 60, "h": 3600, "d": 86400]
  var digits = t
  var mult: Int64 = 1
  if let last = t.last, let m = units[last] {
    mult = m
    digits = String(t.dropLast())
  }
  guard let v = Int64(digits), v > 0 || (allowZero && v == 0), v <= Int64.max / mult else {
    throw UbiqError.invalidArgument("'\(text)' is not a duration (e.g. 90d, 12h, 30m, 45s)")
  }
  return v * mult
}

/// Unmounts `mp` with fusermount3 and waits (up to 30 s) for its daemon to exit.
func unmountAndWait(_ mp: String, lazy: Bool, daemon: DaemonRecord?) throws {
  let p = Process()
  p.executableURL = URL(fileURLWithPath: "/bin/fusermount3")
  p.arguments = ["-u"] + (lazy ? ["-z"] : []) + [mp]
  let errPipe = Pipe()
  p.standardError = errPipe
  try p.run()
  p.waitUntilExit()
  if p.terminationStatus != 0 {
    let msg = String(decoding: errPipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
    if msg.contains("busy") {
      throw UbiqError.busy("\(mp) is in use (open files or a shell inside it); close them or use --lazy")
    }
    throw UbiqError.io(msg.trimmingCharacters(in: .whitespacesAndNewlines))
  }
  if let d = daemon {
    let deadline = Date().addingTimeInterval(30)
    while d.isAlive && Date() < deadline { usleep(20_000) }
  }
}
