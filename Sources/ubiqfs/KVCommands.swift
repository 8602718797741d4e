import ArgumentParser
import Foundation
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqDaemon
import UbiqHTTPClient
import UbiqKV

/// `ubiqfs kv ...`: the per-container key-value store (NSUbiquitousKeyValueStore for Linux).
struct KVCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "kv", abstract: "The container's key-value store (JSON values, synced across devices).",
    subcommands: [KVGet.self, KVSet.self, KVRemove.self, KVList.self, KVImport.self, KVWatch.self])
}

/// Options of every `kv` subcommand.
struct KVOptions: ParsableArguments {
  @Option(help: "Container id (default iCloud.default).") var container: String?
  @OptionGroup var location: LocationOptions
}

/// The mirror of the signed-in account's store for a container, and a way to sync it.
struct KVContext {
  let paths: Paths
  let session: CloudSession
  let container: ContainerID
  let mirror: KVMirror
  /// True when this open logged an `account_change` (the previous kv command ran as another account).
  var accountChanged = false

  static func open(_ o: KVOptions) throws -> KVContext {
    let paths = o.location.paths
    let container = try o.container.map { try ContainerID($0) } ?? .defaultContainer
    let session = try CloudSession.open(paths)
    let dir = paths.containerDir(account: session.account, container)
    let mirror = try KVMirror(path: dir.appendingPathComponent("kv.sqlite"), container: container)
    var ctx = KVContext(paths: paths, session: session, container: container, mirror: mirror)
    ctx.accountChanged = try ctx.noteAccount()
    return ctx
  }

  /// The account the key-value commands last used on this state root (`<state>/kv-account`).
  static func lastAccountURL(_ paths: Paths) -> URL { paths.stateRoot.appendingPathComponent("kv-account") }

  /// Records an `account_change` notification in this account's mirror when the previous kv
  /// command ran as another account. Mirrors are per account, so the new account never sees
  /// the previous one's values.
  func noteAccount() throws -> Bool {
    let url = Self.lastAccountURL(paths)
    let last = (try? String(contentsOf: url, encoding: .utf8))?.trimmingCharacters(in: .whitespacesAndNewlines)
    if last == session.account { return false }
    var changed = false
    if let last, !last.isEmpty {
      try mirror.record(.accountChange, keys: [], message: "account \(last) -> \(session.account)")
      changed = true
    }
    try FileManager.default.createDirectory(at: paths.stateRoot, withIntermediateDirectories: true)
    try Data(session.account.utf8).write(to: url, options: .atomic)
    return changed
  }

  func service() throws -> KeyValueService { try session.makeKeyValueService() }

  /// Pushes pending writes and pulls; returns false (changing nothing) when the cloud is
  /// unreachable, so reads fall back to the mirror and writes stay queued.
  @discardableResult
  func sync() -> Bool {
    do {
      let svc = try service()
      let device = try mirror.device(suggested: session.config?.device)
      let m = mirror
      if try mirror.token() == nil {
        // The cloud keeps a store per existing container: create it on the first sync.
        let cloud = try session.makeCloud()
        let c = container
        try runBlocking { try await cloud.ensureContainer(c) }
      }
      try runBlocking { try await KVSync(mirror: m, service: svc, device: device).run() }
      return true
    } catch {
      return false
    }
  }
}

/// A key-value command failure, printed as `ubiqfs: MESSAGE`.
struct KVCLIError: Error, CustomStringConvertible {
  let description: String
  init(_ m: String) { description = m }
}

func kvJSON(_ v: JSONValue) throws -> String { String(decoding: try v.jsonData(), as: UTF8.self) }

/// `ubiqfs kv get KEY`
struct KVGet: ParsableCommand {
  static let configuration = CommandConfiguration(commandName: "get", abstract: "Print a key's JSON value.")
  @Argument(help: "The key.") var key: String
  @OptionGroup var options: KVOptions

  func run() throws {
    try cli {
      let ctx = try KVContext.open(options)
      ctx.sync()
      guard let v = try ctx.mirror.get(key) else { throw KVCLIError("no such key: \(key)") }
      print(try kvJSON(v))
    }
  }
}

/// `ubiqfs kv set KEY VALUE` / `--data FILE`
struct KVSet: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "set",
    abstract: "Set a key to a JSON value (a bare word that is not JSON is stored as a string).")
  @Argument(help: "The key (at most 64 bytes UTF-8).") var key: String
  @Argument(help: "The value as JSON: 42, \"text\", true, [1,2], {\"a\":1} (a negative number after --).")
  var value: String?
  @Option(help: "Store this file's bytes as {\"$data\": \"<base64>\"}.") var data: String?
  @Option(help: .hidden) var timestamp: Int64?
  @OptionGroup var options: KVOptions

  func run() throws {
    try cli {
      let v: JSONValue
      if data != nil && value != nil { throw UbiqError.invalidArgument("give a VALUE or --data FILE, not both") }
      if let data {
        let bytes = try Data(contentsOf: URL(fileURLWithPath: absolutePath(data)))
        v = .object(["$data": .string(bytes.base64EncodedString())])
      } else if let value {
        v = try Self.parse(value)
      } else {
        throw UbiqError.invalidArgument("give a VALUE or --data FILE")
      }
      let ctx = try KVContext.open(options)
      try kvWrite(ctx, key, v, timestamp)
    }
  }
}

extension KVSet {
  /// The value as the user meant it: JSON when it parses, else a bare word as a string. A value
  /// that looks like JSON and is not (an integer past 64 bits, which would become an inexact
  /// double; an array, object or string that does not parse, or nests too deep) is refused
  /// rather than stored as something else.
  static func parse(_ text: String) throws -> JSONValue {
    let trimmed = text.trimmingCharacters(in: .whitespacesAndNewlines)
    if trimmed.wholeMatch(of: /-?(0|[1-9][0-9]*)/) != nil {
      guard let i = Int64(trimmed) else {
        throw UbiqError.invalidArgument(
          "\(trimmed.prefix(40)) is outside the 64-bit integer range; give it as a JSON string to store it as text")
      }
      return .int(i)
    }
    let value: JSONValue
    do {
      value = try JSONDecoder().decode(JSONValue.self, from: Data(text.utf8))
    } catch {
      guard let first = trimmed.first, "[{\"".contains(first) else { return .string(text) }
      var reason = "\(error)"
      if case .dataCorrupted(let context) = error as? DecodingError {
        reason =
          (context.underlyingError as NSError?)?.userInfo[NSDebugDescriptionErrorKey] as? String
          ?? context.debugDescription
      }
      reason = reason.replacingOccurrences(of: "\n", with: " ")
      throw UbiqError.invalidArgument("not valid JSON (\(reason)); give it as a JSON string to store it as text")
    }
    try refuseInexactIntegers(in: text)
    return value
  }
}

/// Refuses JSON text with an integer literal outside the 64-bit range anywhere in it (in an
/// array or object too): the decoder would store it as an inexact double.
func refuseInexactIntegers(in text: String) throws {
  let bytes = Array(text.utf8)
  var i = 0
  while i < bytes.count {
    let c = bytes[i]
    if c == UInt8(ascii: "\"") {
      // Skip the string, escapes included.
      i += 1
      while i < bytes.count && bytes[i] != UInt8(ascii: "\"") { i += bytes[i] == UInt8(ascii: "\\") ? 2 : 1 }
      i += 1
    } else if c == UInt8(ascii: "-") || (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(c) {
      let start = i
      while i < bytes.count, "-+.eE0123456789".utf8.contains(bytes[i]) { i += 1 }
      let token = String(decoding: bytes[start..<i], as: UTF8.self)
      if !token.contains(where: { ".eE".contains($0) }) && Int64(token) == nil {
        throw UbiqError.invalidArgument(
          "the integer \(token.prefix(40)) is outside the 64-bit range; give it as a JSON string to store it as text")
      }
    } else {
      i += 1
    }
  }
}

/// Queues writes in the mirror (limits checked first) and syncs them when the cloud is reachable.
func kvWrite(_ ctx: KVContext, _ changes: [(String, JSONValue?)], _ timestamp: Int64?) throws {
  do {
    let ts = timestamp ?? Int64(Date().timeIntervalSince1970 * 1e9)
    try ctx.mirror.write(changes, timestamp: ts)
  } catch let e as KeyValueError {
    throw KVCLIError("\(e.description); nothing changed")
  }
  let before = try ctx.mirror.lastNotificationSeq()
  if !ctx.sync() {
    eprint("ubiqfs: cloud unreachable; the change is saved locally and will sync later")
    return
  }
  // The server is the authority on limits: report a rejected write.
  let keys = Set(changes.map { $0.0 })
  for n in try ctx.mirror.notifications(after: before) {
    guard let note = try? JSONDecoder().decode(KVNotification.self, from: Data(n.json.utf8)),
      note.reason == .quotaViolation, let key = note.keys.first(where: keys.contains)
    else { continue }
    throw KVCLIError("the cloud rejected the write of \(key): \(note.message ?? "key-value store quota exceeded")")
  }
}

func kvWrite(_ ctx: KVContext, _ key: String, _ value: JSONValue?, _ timestamp: Int64?) throws {
  try kvWrite(ctx, [(key, value)], timestamp)
}

/// `ubiqfs kv import FILE`: sets every key of a JSON object at once (all or nothing).
struct KVImport: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "import", abstract: "Set every key of a JSON object file at once (all or nothing).")
  @Argument(help: "A file holding one JSON object.") var file: String
  @OptionGroup var options: KVOptions

  func run() throws {
    try cli {
      let data = try Data(contentsOf: URL(fileURLWithPath: absolutePath(file)))
      guard case .object(let obj) = try JSONDecoder().decode(JSONValue.self, from: data) else {
        throw KVCLIError("\(file) does not hold a JSON object")
      }
      try refuseInexactIntegers(in: String(decoding: data, as: UTF8.self))
      let ctx = try KVContext.open(options)
      try kvWrite(ctx, obj.keys.sorted().map { ($0, obj[$0]) }, nil)
    }
  }
}

/// `ubiqfs kv rm KEY`
struct KVRemove: ParsableCommand {
  static let configuration = CommandConfiguration(commandName: "rm", abstract: "Remove a key.")
  @Argument(help: "The key.") var key: String
  @Option(help: .hidden) var timestamp: Int64?
  @OptionGroup var options: KVOptions

  func run() throws {
    try cli {
      let ctx = try KVContext.open(options)
      ctx.sync()
      guard try ctx.mirror.get(key) != nil else { throw KVCLIError("no such key: \(key)") }
      try kvWrite(ctx, key, nil, timestamp)
    }
  }
}

/// `ubiqfs kv ls`
struct KVList: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "ls", abstract: "List keys and values.",
    discussion: """
      One line per key: KEY, a tab, the JSON value. A key with a control character (a tab, a line \
      break) or that begins with a double quote is printed as a JSON string.
      """)
  @Flag(help: "Print one JSON object of every key.") var json = false
  @OptionGroup var options: KVOptions

  func run() throws {
    try cli {
      let ctx = try KVContext.open(options)
      ctx.sync()
      let all = try ctx.mirror.all()
      if json {
        print(try kvJSON(.object(all)))
      } else {
        for k in all.keys.sorted() { print("\(try Self.printable(k))\t\(try kvJSON(all[k]!))") }
      }
    }
  }
}

extension KVList {
  /// `key` as `ls` prints it: as it is, or as a JSON string where it could not be told from the
  /// tab and line that frame it.
  static func printable(_ key: String) throws -> String {
    let plain = !key.hasPrefix("\"") && !key.unicodeScalars.contains { $0.properties.generalCategory == .control }
    return plain ? key : try kvJSON(.string(key))
  }
}

/// `ubiqfs kv watch`: one JSON line per change notification.
struct KVWatch: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "watch",
    abstract:
      "Print one JSON line per change notification (server_change, initial_sync, quota_violation, account_change).")
  @Flag(help: "Exit after the first notification.") var once = false
  @Option(help: .hidden) var count: Int?
  @Option(help: "Seconds between polls of the cloud.") var interval: Double = 0.5
  @OptionGroup var options: KVOptions

  func run() throws {
    try cli {
      var ctx = try KVContext.open(options)
      // Print the account_change this open logged, then everything from the first sync on.
      var last = try ctx.mirror.lastNotificationSeq() - (ctx.accountChanged ? 1 : 0)
      let limit = once ? 1 : count
      var printed = 0
      while true {
        // The signed-in account changed under us: switch mirrors (logs account_change).
        if let s = try? CloudSession.open(ctx.paths), s.account != ctx.session.account {
          let previous = ctx.session.account
          ctx = try KVContext.open(options)
          if !ctx.accountChanged {
            try ctx.mirror.record(.accountChange, keys: [], message: "account \(previous) -> \(ctx.session.account)")
          }
          last = try ctx.mirror.lastNotificationSeq() - 1
        }
        ctx.sync()
        for n in try ctx.mirror.notifications(after: last) {
          print(n.json)
          fflush(nil)
          last = n.seq
          printed += 1
          if let limit, printed >= limit { return }
        }
        Thread.sleep(forTimeInterval: interval)
      }
    }
  }
}
