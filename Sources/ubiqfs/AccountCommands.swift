import ArgumentParser
import Foundation
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqDaemon
import UbiqHTTPClient
import UbiqIndex

/// `ubiqfs account login|logout|status|devices|rotate|revoke`: sign this machine in to a
/// `ubiqfs serve` account and manage the account's device tokens.
struct AccountCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "account",
    abstract: "Sign in to a ubiqfs server account, sign out, show the account, list, rotate and revoke device tokens.",
    subcommands: [Login.self, Logout.self, Status.self, Devices.self, Rotate.self, Revoke.self])

  /// Sign-in changes which cloud and state folders mounts use, so it waits for unmounts.
  static func refuseWhileMounted(_ paths: Paths) throws {
    let mounted = ContainerState.all(paths).filter { $0.daemon != nil }
    if let m = mounted.first {
      throw UbiqError.busy(
        "\(m.container) is mounted at \(m.daemon!.mountpoint); unmount every container before switching accounts")
    }
  }

  struct Login: ParsableCommand {
    static let configuration = CommandConfiguration(
      abstract:
        "Sign in with an account token (from 'ubiqfs server account create' or 'server token create'); this device gets its own device token."
    )
    @Option(help: "Server URL, e.g. http://127.0.0.1:8443.") var server: String
    @Option(help: "An account token (or set UBIQFS_TOKEN).") var token: String?
    @Option(help: "Name of this device (default: the host name).") var device: String?
    @Option(help: "Lifetime of this device's token, e.g. 90d, 12h (default: never expires).") var expires: String?
    @Option(help: "CA certificate (PEM) to verify an https server against, kept with the account.")
    var caCert: String?
    @Flag(help: "Allow sending the token over plain http:// to a server that is not on loopback.")
    var insecureHttp = false
    @OptionGroup var location: LocationOptions

    func run() throws {
      try cli {
        let paths = location.paths
        try AccountCommand.refuseWhileMounted(paths)
        guard let token = token ?? ProcessInfo.processInfo.environment["UBIQFS_TOKEN"], !token.isEmpty else {
          throw UbiqError.invalidArgument("give --token TOKEN (or set UBIQFS_TOKEN)")
        }
        var caPEM: String? = nil
        if let caCert {
          do { caPEM = try String(contentsOfFile: absolutePath(caCert), encoding: .utf8) } catch {
            throw UbiqError.invalidArgument("cannot read --ca-cert \(caCert): \(error.localizedDescription)")
          }
        }
        let api: APIClient
        do {
          api = try APIClient(baseURL: server, token: token, caCertificatePEM: caPEM, allowInsecureHTTP: insecureHttp)
        } catch let e as CloudError {
          throw UbiqError.invalidArgument(e.description)
        }
        let name = device ?? ProcessInfo.processInfo.hostName
        let lifetime = try expires.map { try parseDuration($0) }
        let info = try runBlocking { try await AccountAPI(api: api).accountInfo() }
        let issued: AccountAPI.NewDevice
        do {
          issued = try runBlocking { try await AccountAPI(api: api).registerDevice(name: name, expiresIn: lifetime) }
        } catch CloudError.unauthorized {
          // The token is valid (the account call passed), but may not mint tokens.
          throw UbiqError.invalidArgument(
            "this is a device token, which cannot register devices; log in with an account token "
              + "(from 'ubiqfs server account create' or 'ubiqfs server token create')")
        }
        let config = AccountConfig(
          server: api.baseURL, account: info.account, device: issued.device.device, tokenID: issued.device.id,
          token: issued.token, caCertificatePEM: caPEM, insecureHTTP: insecureHttp ? true : nil)
        try config.save(paths)
        print("signed in to \(api.baseURL) as \(info.account) (device \(name), token \(issued.device.id))")
      }
    }
  }

  struct Logout: ParsableCommand {
    static let configuration = CommandConfiguration(
      abstract:
        "Sign out: wait for uploads, unmount this account's containers, remove its local data, revoke the token.")
    @Flag(help: "Do not wait for pending uploads: discard them with the local data.") var discard = false
    @Option(help: "Seconds to wait for pending uploads before giving up (nothing is removed then).")
    var timeout: Double = 120
    @OptionGroup var location: LocationOptions

    func run() throws {
      try cli {
        let paths = location.paths
        guard let config = try AccountConfig.load(paths) else {
          print("not signed in")
          return
        }
        let mine = ContainerState.all(paths).filter { $0.account == config.account }
        // 1. Uploads drain first (mounted containers upload on their own).
        if !discard {
          for s in mine where s.daemon == nil {
            let pending = try s.openIndex().pendingCount(under: IndexStore.rootInode)
            if pending > 0 {
              throw UbiqError.busy(
                "\(pending) uploads of \(s.container) are still pending and it is not mounted; "
                  + "mount it so they upload, or sign out with --discard")
            }
          }
          let deadline = Date().addingTimeInterval(timeout)
          while true {
            let pending = try mine.filter { $0.daemon != nil }.reduce(0) {
              $0 + (try $1.openIndex().pendingCount(under: IndexStore.rootInode))
            }
            if pending == 0 { break }
            if Date() > deadline {
              throw UbiqError.busy(
                "\(pending) uploads still pending after \(Int(timeout)) s (see 'ubiqfs status'); "
                  + "nothing was removed; retry, or sign out with --discard")
            }
            usleep(100_000)
          }
        }
        // 2. Unmount.
        for s in mine {
          if let d = s.daemon { try unmountAndWait(d.mountpoint, lazy: false, daemon: d) }
        }
        // 3. Revoke, forget, remove this account's local data.
        let api = try config.api
        do {
          try runBlocking { try await AccountAPI(api: api).revoke(tokenID: "current") }
        } catch {
          eprint("ubiqfs: warning: could not revoke the token on the server (\(error)); it stays valid there")
        }
        try AccountConfig.remove(paths)
        let accountDir = paths.stateRoot.appendingPathComponent("accounts").appendingPathComponent(config.account)
        try? FileManager.default.removeItem(at: accountDir)
        print("signed out of \(config.account) at \(config.server); local data removed")
      }
    }
  }

  struct Status: ParsableCommand {
    static let configuration = CommandConfiguration(abstract: "Show the signed-in account and its usage.")
    @Flag(help: "Machine-readable output.") var json = false
    @OptionGroup var location: LocationOptions

    struct Report: Codable {
      var signedIn: Bool
      /// Opaque; changes whenever the account (or its server) changes
      /// (NSFileManager.ubiquityIdentityToken).
      var identityToken: String
      var server: String?
      var account: String
      var device: String?
      var reachable: Bool?
      var usedBytes: Int64?
      var quotaBytes: Int64?
      /// The part of usedBytes that item records cost.
      var metadataBytes: Int64?
      var error: String?
    }

    func run() throws {
      try cli {
        let paths = location.paths
        guard let config = try AccountConfig.load(paths) else {
          let r = Report(
            signedIn: false, identityToken: identityToken("embedded:" + paths.cloudDir.path, AccountName.local),
            account: AccountName.local)
          if json {
            try printJSON(r)
          } else {
            print("not signed in: mounts use the embedded cloud (\(paths.cloudDir.path))")
            print("identity \(r.identityToken)")
          }
          return
        }
        var r = Report(
          signedIn: true, identityToken: identityToken(config.server, config.account), server: config.server,
          account: config.account, device: config.device)
        let api = try config.api
        do {
          let info = try runBlocking { try await AccountAPI(api: api).accountInfo() }
          r.reachable = true
          r.usedBytes = info.usage.usedBytes
          r.quotaBytes = info.usage.quotaBytes
          r.metadataBytes = info.usage.metadataBytes
        } catch {
          r.reachable = false
          r.error = "\(error)"
        }
        if json {
          try printJSON(r)
          return
        }
        print("account \(config.account) at \(config.server) (device \(config.device))")
        print("identity \(r.identityToken)")
        if r.reachable == true {
          let quota = r.quotaBytes! > 0 ? formatBytes(r.quotaBytes!) : "unlimited"
          let metadata = r.metadataBytes.map { " (\(formatBytes($0)) of it item metadata)" } ?? ""
          print("used \(formatBytes(r.usedBytes!)) of \(quota)\(metadata)")
        } else {
          print("server unreachable: \(r.error ?? "")")
        }
      }
    }
  }
}

extension AccountCommand {
  static func signedIn(_ paths: Paths) throws -> AccountConfig {
    guard let config = try AccountConfig.load(paths) else {
      throw UbiqError.invalidArgument("not signed in (run 'ubiqfs account login')")
    }
    return config
  }

  struct Devices: ParsableCommand {
    static let configuration = CommandConfiguration(abstract: "List the account's devices and their tokens.")
    @OptionGroup var location: LocationOptions

    func run() throws {
      try cli {
        let config = try AccountCommand.signedIn(location.paths)
        let api = try config.api
        let devices = try runBlocking { try await AccountAPI(api: api).devices() }
        let now = Int64(Date().timeIntervalSince1970)
        let iso = ISO8601DateFormatter()
        print("id\tdevice\tscope\texpires\tstate")
        for d in devices {
          let expires = d.expiresAt.map { iso.string(from: Date(timeIntervalSince1970: TimeInterval($0))) } ?? "never"
          let state =
            d.revoked ? "revoked" : d.isExpired(now: now) ? "expired" : d.id == config.tokenID ? "this device" : "live"
          print("\(d.id)\t\(d.device)\t\(d.scope.rawValue)\t\(expires)\t\(state)")
        }
      }
    }
  }

  struct Rotate: ParsableCommand {
    static let configuration = CommandConfiguration(
      abstract: "Swap this device's token for a new one; the old token stops working at once.")
    @OptionGroup var location: LocationOptions

    func run() throws {
      try cli {
        let paths = location.paths
        var config = try AccountCommand.signedIn(paths)
        let api = try config.api
        let issued = try runBlocking { try await AccountAPI(api: api).rotate() }
        config.token = issued.token
        try config.save(paths)
        print("rotated the token of \(config.device) (token \(issued.device.id))")
      }
    }
  }

  struct Revoke: ParsableCommand {
    static let configuration = CommandConfiguration(
      abstract: "Revoke another device's token; needs an account token (--token or UBIQFS_TOKEN).")
    @Argument(help: "Token id (from 'ubiqfs account devices').") var id: String
    @Option(help: "An account token (or set UBIQFS_TOKEN).") var token: String?
    @OptionGroup var location: LocationOptions

    func run() throws {
      try cli {
        let config = try AccountCommand.signedIn(location.paths)
        guard let token = token ?? ProcessInfo.processInfo.environment["UBIQFS_TOKEN"], !token.isEmpty else {
          throw UbiqError.invalidArgument(
            "revoking a device needs an account token: give --token TOKEN (or set UBIQFS_TOKEN)")
        }
        let api: APIClient
        do { api = try config.client(token: token) } catch let e as CloudError {
          throw UbiqError.invalidArgument(e.description)
        }
        let id = self.id
        do {
          try runBlocking { try await AccountAPI(api: api).revoke(tokenID: id) }
        } catch CloudError.unauthorized(let m) {
          throw UbiqError.invalidArgument(m)
        }
        print("revoked token \(id)")
      }
    }
  }
}

/// An opaque token naming the signed-in identity: equal for the same account on the same cloud,
/// different for any other.
func identityToken(_ cloud: String, _ account: String) -> String {
  String(Chunker.sha256Hex(Data("ubiqfs-identity\u{0}\(cloud)\u{0}\(account)".utf8)).prefix(32))
}
