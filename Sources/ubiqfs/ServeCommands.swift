import ArgumentParser
import Foundation
import Logging
import UbiqCloud
import UbiqCloudAPI
import UbiqCloudScale
import UbiqCore
import UbiqDaemon
import UbiqServer

/// Which engine `serve` and the `server` admin commands use: `--data DIR` (embedded,
/// the default) or `--postgres URL` plus the `--s3-*` options (scale-out). Every option can
/// also come from the environment (secrets belong there, not on the command line).
struct StorageOptions: ParsableArguments {
  @Option(help: "Embedded engine folder (SQLite + blobs). Default: $UBIQFS_SERVER_DIR or <state dir>/server.")
  var data: String?
  @Option(help: "PostgreSQL URL for the scale-out engine ($UBIQFS_POSTGRES_URL), e.g. postgres://u:p@host/db.")
  var postgres: String?
  @Option(
    help:
      "PostgreSQL TLS ($UBIQFS_POSTGRES_SSLMODE): disable, prefer, require, verify-ca, verify-full (use verify-full in production)."
  )
  var postgresSslmode: String?
  @Option(help: "CA certificate (PEM) that verifies PostgreSQL's certificate ($UBIQFS_POSTGRES_CA).")
  var postgresCa: String?
  @Option(
    help: "S3 endpoint URL ($UBIQFS_S3_ENDPOINT), e.g. http://127.0.0.1:8333 or https://proxy.example/s3 (a base path)."
  ) var s3Endpoint: String?
  @Option(help: "S3 bucket ($UBIQFS_S3_BUCKET).") var s3Bucket: String?
  @Option(help: "S3 access key ($UBIQFS_S3_ACCESS_KEY).") var s3AccessKey: String?
  @Option(help: "S3 secret key ($UBIQFS_S3_SECRET_KEY).") var s3SecretKey: String?
  @Option(help: "S3 session token of temporary credentials ($UBIQFS_S3_SESSION_TOKEN).") var s3SessionToken: String?
  @Option(help: "S3 region ($UBIQFS_S3_REGION, default us-east-1).") var s3Region: String?
  @Option(help: "Prefix for every object key ($UBIQFS_S3_PREFIX).") var s3Prefix: String?
  @Option(help: "Folder for local state (used for the default --data).") var stateDir: String?

  func storage() throws -> StorageConfig {
    let env = ProcessInfo.processInfo.environment
    func pick(_ v: String?, _ name: String) -> String? {
      if let v, !v.isEmpty { return v }
      if let e = env[name], !e.isEmpty { return e }
      return nil
    }
    if let pg = pick(postgres, "UBIQFS_POSTGRES_URL") {
      if data != nil { throw ValidationError("--data and --postgres exclude each other") }
      var missing: [String] = []
      let endpoint = pick(s3Endpoint, "UBIQFS_S3_ENDPOINT")
      let bucket = pick(s3Bucket, "UBIQFS_S3_BUCKET")
      let access = pick(s3AccessKey, "UBIQFS_S3_ACCESS_KEY")
      let secret = pick(s3SecretKey, "UBIQFS_S3_SECRET_KEY")
      if endpoint == nil { missing.append("--s3-endpoint") }
      if bucket == nil { missing.append("--s3-bucket") }
      if access == nil { missing.append("--s3-access-key") }
      if secret == nil { missing.append("--s3-secret-key") }
      if !missing.isEmpty {
        throw ValidationError("the scale-out engine (--postgres) also needs \(missing.joined(separator: ", "))")
      }
      return .scaleOut(
        postgresURL: try Self.postgresURL(
          pg, sslmode: pick(postgresSslmode, "UBIQFS_POSTGRES_SSLMODE"),
          rootCertificate: pick(postgresCa, "UBIQFS_POSTGRES_CA").map(absolutePath)),
        s3: S3Config(
          endpoint: endpoint!, bucket: bucket!, accessKey: access!, secretKey: secret!,
          region: pick(s3Region, "UBIQFS_S3_REGION") ?? "us-east-1",
          keyPrefix: pick(s3Prefix, "UBIQFS_S3_PREFIX") ?? "",
          sessionToken: pick(s3SessionToken, "UBIQFS_S3_SESSION_TOKEN")))
    }
    let dir =
      pick(data, "UBIQFS_SERVER_DIR") ?? (Paths(stateDir: stateDir, cloudDir: nil).stateRoot.path + "/server")
    return .embedded(directory: URL(fileURLWithPath: absolutePath(dir)))
  }

  /// The PostgreSQL URL with `sslmode` and `sslrootcert` set from the options (they win over
  /// the URL's own).
  static func postgresURL(_ url: String, sslmode: String?, rootCertificate: String?) throws -> String {
    if sslmode == nil && rootCertificate == nil { return url }
    guard var c = URLComponents(string: url) else {
      throw UbiqError.invalidArgument("bad PostgreSQL URL (want postgres://user:password@host:port/database)")
    }
    var items = c.queryItems ?? []
    if let sslmode {
      items.removeAll { $0.name == "sslmode" }
      items.append(URLQueryItem(name: "sslmode", value: sslmode))
    }
    if let rootCertificate {
      items.removeAll { $0.name == "sslrootcert" }
      items.append(URLQueryItem(name: "sslrootcert", value: rootCertificate))
    }
    c.queryItems = items
    return c.string ?? url
  }

  /// Opens the engine, runs `body` against it, closes it.
  func withBackend<T: Sendable>(_ body: @escaping @Sendable (Backend) async throws -> T) throws -> T {
    let storage = try storage()
    var log = Logger(label: "ubiqfs")
    log.logLevel = .warning
    let logger = log
    return try runBlocking { try await Backend.with(storage, logger: logger, body) }
  }
}

/// `ubiqfs serve`: the HTTP API for clients (docs/protocol.md).
struct ServeCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "serve",
    abstract: "Serve accounts and their containers over HTTP, or HTTPS with --tls-cert/--tls-key (docs/protocol.md).")

  @Option(help: "Address and port to listen on.") var listen = "127.0.0.1:8443"
  @Option(help: "Log level: trace, debug, info, notice, warning, error.") var logLevel = "info"
  @Option(help: "Milliseconds between checks for changes committed by other server processes.")
  var pollIntervalMs = 200
  @Option(help: "Serve HTTPS with this certificate chain (PEM file); needs --tls-key.") var tlsCert: String?
  @Option(help: "The private key (PEM file) of --tls-cert.") var tlsKey: String?
  @Option(help: "How often to delete chunks no item refers to, e.g. 6h; 'off' for never (see 'server gc').")
  var gcInterval = "6h"
  @Option(help: "How long a chunk no item refers to is kept after its last use, e.g. 24h.")
  var gcGrace = "24h"
  @Option(help: "Containers one account may have.") var maxContainers = CloudLimits().maxContainersPerAccount
  @Option(help: "Live items (files, folders, symlinks) one container may hold.")
  var maxItemsPerContainer = CloudLimits().maxItemsPerContainer
  @Option(help: "Long-polls one token may have waiting at once.")
  var maxLongPollsPerToken = ServerLimits().maxLongPollsPerToken
  @Option(help: "JSON bytes of one change page, e.g. 8M (a page holds at least one record).")
  var maxChangePage = "8M"
  @Option(
    help:
      "Close a connection that sends nothing this long (no request, or one part way), e.g. 30s; a long-poll is not idle."
  )
  var idleTimeout = "30s"
  @OptionGroup var storage: StorageOptions

  /// `--idle-timeout` in seconds: from 1 s to a day.
  func idleTimeoutSeconds() throws -> Int64 {
    guard let seconds = try? parseDuration(idleTimeout), seconds <= 86_400 else {
      throw ValidationError("--idle-timeout must be a duration from 1s to 24h, e.g. 30s")
    }
    return seconds
  }

  func validate() throws {
    _ = try idleTimeoutSeconds()
    _ = try parseListen(listen)
    if (tlsCert == nil) != (tlsKey == nil) { throw ValidationError("--tls-cert and --tls-key go together") }
    if Logger.Level(rawValue: logLevel) == nil { throw ValidationError("unknown --log-level \(logLevel)") }
    if pollIntervalMs < 10 { throw ValidationError("--poll-interval-ms must be >= 10") }
    _ = try collectionSchedule()
    if maxContainers < 1 || maxItemsPerContainer < 1 || maxLongPollsPerToken < 1 {
      throw ValidationError("--max-containers, --max-items-per-container and --max-long-polls-per-token must be >= 1")
    }
    _ = try changePageBytes()
  }

  func changePageBytes() throws -> Int {
    guard let bytes = try? parseSize(maxChangePage), bytes >= 1, bytes <= Int64(Int32.max) else {
      throw ValidationError("--max-change-page must be a size from 1 byte to 2G, e.g. 8M")
    }
    return Int(bytes)
  }

  func collectionSchedule() throws -> CollectionSchedule {
    do {
      return CollectionSchedule(
        interval: gcInterval == "off" ? nil : try parseDuration(gcInterval),
        grace: try parseDuration(gcGrace, allowZero: true))
    } catch let e as UbiqError {
      throw ValidationError("--gc-interval/--gc-grace: \(e.description)")
    }
  }

  func run() throws {
    try cli {
      let (host, port) = try parseListen(listen)
      var options = ServeOptions(host: host, port: port, storage: try storage.storage())
      options.limits.pollIntervalMs = pollIntervalMs
      options.collection = try collectionSchedule()
      options.limits.maxLongPollsPerToken = maxLongPollsPerToken
      options.limits.idleTimeoutSeconds = try idleTimeoutSeconds()
      options.limits.cloud.maxContainersPerAccount = maxContainers
      options.limits.cloud.maxItemsPerContainer = maxItemsPerContainer
      options.limits.cloud.maxChangePageBytes = try changePageBytes()
      if let tlsCert, let tlsKey {
        options.tls = TLSFiles(certificateChain: absolutePath(tlsCert), privateKey: absolutePath(tlsKey))
      }
      var logger = Logger(label: "ubiqfs.serve")
      logger.logLevel = Logger.Level(rawValue: logLevel) ?? .info
      let log = logger
      let opts = options
      try runBlocking { try await UbiqServer.run(opts, logger: log) }
    }
  }
}

/// `host:port`, `[v6]:port` or `:port` (all interfaces).
func parseListen(_ s: String) throws -> (String, Int) {
  guard let colon = s.lastIndex(of: ":"), let port = Int(s[s.index(after: colon)...]), (0...65535).contains(port)
  else { throw ValidationError("--listen must look like 127.0.0.1:8443") }
  var host = String(s[..<colon])
  if host.hasPrefix("[") && host.hasSuffix("]") { host = String(host.dropFirst().dropLast()) }
  return (host.isEmpty ? "0.0.0.0" : host, port)
}

/// `ubiqfs server ...`: administration of the server's storage (run where the server's
/// data folder or database is reachable; it does not need the server to be running).
struct ServerCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "server",
    abstract: "Manage server accounts and tokens, check stored trees (works on the server's storage directly).",
    subcommands: [AccountGroup.self, TokenGroup.self, Check.self, GC.self])

  /// `ubiqfs server gc [--grace D]`: one garbage-collection pass over every account.
  struct GC: ParsableCommand {
    static let configuration = CommandConfiguration(
      commandName: "gc",
      abstract: "Delete chunks no item refers to and not used within the grace period; prints what was freed.",
      discussion: """
        A running server does this every --gc-interval. Safe while servers run: a chunk an upload \
        uses is kept (a commit that lost it to a pass with too short a grace gets "missing chunks" \
        and the client uploads it again).
        """)
    @Option(help: "Keep chunks used within this long, e.g. 24h; 0 collects every unreferenced chunk.")
    var grace = "24h"
    @Flag(help: "One JSON object per account: {account, chunks, bytes}.") var json = false
    @OptionGroup var storage: StorageOptions

    struct AccountResult: Codable, Sendable {
      var account: String
      var chunks: Int
      var bytes: Int64
      /// Chunks whose bytes could not be deleted (the next pass retries them).
      var undeleted: Int
      var failure: String?
    }

    func run() throws {
      try cli {
        let grace = try parseDuration(self.grace, allowZero: true)
        let results = try storage.withBackend { backend -> [AccountResult] in
          var results: [AccountResult] = []
          for account in try await backend.metadata.accounts() {
            let collected = try await backend.engine(account: account).collectGarbage(grace: grace)
            results.append(
              AccountResult(
                account: account, chunks: collected.chunks, bytes: collected.bytes, undeleted: collected.undeleted,
                failure: collected.failure))
          }
          return results
        }
        if json {
          let encoder = JSONEncoder()
          encoder.outputFormatting = [.sortedKeys]
          for r in results { print(String(decoding: try encoder.encode(r), as: UTF8.self)) }
        } else {
          for r in results { print("\(r.account)\t\(r.chunks) chunks\t\(formatBytes(r.bytes)) freed") }
        }
        let stuck = results.filter { $0.undeleted > 0 }
        for r in stuck {
          eprint("ubiqfs: \(r.account): \(r.undeleted) chunks could not be deleted: \(r.failure ?? "unknown error")")
        }
        if !stuck.isEmpty { throw ExitCode.failure }
      }
    }
  }

  /// `ubiqfs server check [--repair]`: the tree invariants over every stored container.
  struct Check: ParsableCommand {
    static let configuration = CommandConfiguration(
      abstract: "Check every container's tree (parents, loops, names); exits 1 if problems remain.",
      discussion: """
        --repair moves items under a missing, deleted or non-directory parent, and one member of \
        every loop of parents, into Documents/lost+found, and renames later namesakes to "name 2"; \
        it never deletes. Repairs are ordinary commits, so clients pick them up from the change feed.
        """)
    @Flag(help: "Repair what is found (moves and renames only).") var repair = false
    @Flag(
      help: """
        One JSON object per container instead of text: {account, container, problems, repaired, remaining}.
        """)
    var json = false
    @OptionGroup var storage: StorageOptions

    /// What the check found in one container.
    struct ContainerResult: Codable, Sendable {
      var account: String
      var container: String
      var problems: [String]
      var repaired: Int
      /// Problems left after the repair (all of them without --repair).
      var remaining: Int
    }

    /// How far the check is, on a terminal.
    struct Report: ProgressReport {
      var containersDone: Int
      var containersTotal: Int
      var problems: Int
      var done: Bool

      var line: String {
        "checking trees: \(containersDone)/\(containersTotal) containers, \(problems) problem\(problems == 1 ? "" : "s")"
      }
    }

    func run() throws {
      try cli {
        let repair = self.repair
        // Progress only on a terminal; with --json stdout carries the results.
        let progress = ProgressPrinter<Report>(style: json ? .silent : .choose(json: false))
        let results = try storage.withBackend { backend -> [ContainerResult] in
          var todo: [(String, String)] = []
          for account in try await backend.metadata.accounts() {
            for c in try await backend.engine(account: account).containers() { todo.append((account, c)) }
          }
          var results: [ContainerResult] = []
          var problems = 0
          for (account, c) in todo {
            progress.report(
              .init(containersDone: results.count, containersTotal: todo.count, problems: problems, done: false))
            let engine = backend.engine(account: account)
            let container = try ContainerID(c)
            let report = try await engine.checkTree(container, repair: repair)
            var remaining = report.problems.count
            if repair && report.repaired > 0 {
              remaining = try await engine.checkTree(container, repair: false).problems.count
            }
            problems += report.problems.count
            results.append(
              ContainerResult(
                account: account, container: c, problems: report.problems.map { "\($0)" }, repaired: report.repaired,
                remaining: remaining))
          }
          return results
        }
        progress.clearLine()
        let remaining = results.reduce(0) { $0 + $1.remaining }
        if json {
          let encoder = JSONEncoder()
          encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
          for result in results { print(String(decoding: try encoder.encode(result), as: UTF8.self)) }
        } else {
          for r in results {
            for problem in r.problems { print("\(r.account)\t\(r.container)\t\(problem)") }
            if r.repaired > 0 { print("\(r.account)\t\(r.container)\trepaired \(r.repaired)") }
          }
        }
        if remaining > 0 {
          eprint(
            "ubiqfs: \(remaining) tree problem\(remaining == 1 ? "" : "s") left\(repair ? "" : " (run with --repair)")")
          throw ExitCode.failure
        }
        if !json { print("tree check: no problems left in \(results.count) container\(results.count == 1 ? "" : "s")") }
      }
    }
  }

  struct AccountGroup: ParsableCommand {
    static let configuration = CommandConfiguration(
      commandName: "account", abstract: "Create and list accounts, set quotas.",
      subcommands: [Create.self, List.self, Quota.self])

    struct Create: ParsableCommand {
      static let configuration = CommandConfiguration(abstract: "Create an account and print its first token.")
      @Argument(help: "Account name (letters, digits, '.', '-', '_').") var name: String
      @Option(help: "Quota, e.g. 10G (default: unlimited).") var quota: String?
      @Option(help: "Device name recorded for the printed token.") var device = "setup"
      @OptionGroup var storage: StorageOptions

      func run() throws {
        try cli {
          let bytes = try quota.map(parseSize) ?? 0
          let (name, device) = (self.name, self.device)
          let (token, record) = try storage.withBackend { backend in
            try await backend.createAccount(name, quotaBytes: bytes, device: device)
          }
          eprint("created account \(name) (account token id \(record.id)); its token (shown once):")
          print(token)
        }
      }
    }

    struct List: ParsableCommand {
      static let configuration = CommandConfiguration(abstract: "List accounts with their usage.")
      @OptionGroup var storage: StorageOptions
      func run() throws {
        try cli {
          let rows = try storage.withBackend { backend in
            var out: [(String, Usage)] = []
            for a in try await backend.metadata.accounts() {
              out.append((a, try await backend.metadata.usage(account: a)))
            }
            return out.map { "\($0.0)\t\($0.1.usedBytes)\t\($0.1.quotaBytes)\t\($0.1.metadataBytes ?? 0)" }
          }
          print("account\tusedBytes\tquotaBytes\tmetadataBytes")
          for row in rows { print(row) }
        }
      }
    }

    struct Quota: ParsableCommand {
      static let configuration = CommandConfiguration(abstract: "Set an account's quota (0 = unlimited).")
      @Argument var name: String
      @Argument(help: "e.g. 10G, 500M, 0") var size: String
      @OptionGroup var storage: StorageOptions
      func run() throws {
        try cli {
          let bytes = try parseSize(size)
          let name = self.name
          try storage.withBackend { backend in try await backend.metadata.setQuota(account: name, bytes: bytes) }
          print("quota of \(name): \(bytes == 0 ? "unlimited" : formatBytes(bytes))")
        }
      }
    }
  }

  struct TokenGroup: ParsableCommand {
    static let configuration = CommandConfiguration(
      commandName: "token", abstract: "Issue, list and revoke bearer tokens.",
      subcommands: [Create.self, List.self, Revoke.self])

    struct Create: ParsableCommand {
      static let configuration = CommandConfiguration(
        abstract: "Issue a new token for a device of an account (an account token unless --scope device).")
      @Argument var account: String
      @Option(help: "Device name.") var device = "setup"
      @Option(help: "account (manages devices; what 'account login' takes) or device (syncs only).")
      var scope = "account"
      @Option(help: "Lifetime, e.g. 90d, 12h, 30m, 45s (default: never expires).") var expires: String?
      @OptionGroup var storage: StorageOptions
      func run() throws {
        try cli {
          guard let scope = TokenScope(rawValue: self.scope) else {
            throw UbiqError.invalidArgument("--scope must be 'account' or 'device', not '\(self.scope)'")
          }
          let lifetime = try expires.map { try parseDuration($0) }
          let (account, device) = (self.account, self.device)
          let (token, record) = try storage.withBackend { backend in
            try await backend.issueToken(account: account, device: device, scope: scope, expiresIn: lifetime)
          }
          eprint("\(scope.rawValue) token id \(record.id) for \(account)/\(device) (shown once):")
          print(token)
        }
      }
    }

    struct List: ParsableCommand {
      static let configuration = CommandConfiguration(abstract: "List an account's tokens (never their values).")
      @Argument var account: String
      @OptionGroup var storage: StorageOptions
      func run() throws {
        try cli {
          let account = self.account
          let tokens = try storage.withBackend { backend in try await backend.metadata.tokens(account: account) }
          let now = Int64(Date().timeIntervalSince1970)
          let iso = ISO8601DateFormatter()
          print("id\tdevice\tscope\tcreated\texpires\tstate")
          for t in tokens {
            let created = iso.string(from: Date(timeIntervalSince1970: TimeInterval(t.createdAt)))
            let expires = t.expiresAt.map { iso.string(from: Date(timeIntervalSince1970: TimeInterval($0))) } ?? "never"
            let state = t.revoked ? "revoked" : t.isExpired(now: now) ? "expired" : "live"
            print("\(t.id)\t\(t.device)\t\(t.scope.rawValue)\t\(created)\t\(expires)\t\(state)")
          }
        }
      }
    }

    struct Revoke: ParsableCommand {
      static let configuration = CommandConfiguration(
        abstract: "Revoke tokens: one by id, all of a device, or all of the account.")
      @Argument var account: String
      @Option(help: "Token id (from 'server token list').") var id: String?
      @Option(help: "Revoke every token of this device.") var device: String?
      @Flag(help: "Revoke every token of the account.") var all = false
      @OptionGroup var storage: StorageOptions

      func validate() throws {
        if [id != nil, device != nil, all].filter({ $0 }).count != 1 {
          throw ValidationError("give exactly one of --id, --device, --all")
        }
      }

      func run() throws {
        try cli {
          let (account, id, device) = (self.account, self.id, self.device)
          let n = try storage.withBackend { backend -> Int in
            if let id { return try await backend.metadata.revokeToken(account: account, id: id) ? 1 : 0 }
            return try await backend.metadata.revokeTokens(account: account, device: device)
          }
          if n == 0 { throw UbiqError.notFound("no live token matched") }
          print("revoked \(n) token\(n == 1 ? "" : "s") of \(account)")
        }
      }
    }
  }
}
