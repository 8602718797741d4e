import Foundation
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqHTTPClient

#if canImport(Glibc)
  import Glibc
#endif

/// The signed-in server account of this state root: `<state>/account.json`, mode 0600. Holds
/// the device's own bearer token, so only its owner may read it.
public struct AccountConfig: Codable {
  public var server: String
  public var account: String
  public var device: String
  public var tokenID: String
  public var token: String
  /// The CA certificate (PEM) the server's certificate is verified against (`login --ca-cert`).
  public var caCertificatePEM: String?
  /// Plain http:// to a non-loopback server was allowed at login (`--insecure-http`).
  public var insecureHTTP: Bool?

  public init(
    server: String, account: String, device: String, tokenID: String, token: String, caCertificatePEM: String?,
    insecureHTTP: Bool?
  ) {
    self.server = server
    self.account = account
    self.device = device
    self.tokenID = tokenID
    self.token = token
    self.caCertificatePEM = caCertificatePEM
    self.insecureHTTP = insecureHTTP
  }

  public static func url(_ paths: Paths) -> URL { paths.stateRoot.appendingPathComponent("account.json") }

  public static func load(_ paths: Paths) throws -> AccountConfig? {
    let u = url(paths)
    guard FileManager.default.fileExists(atPath: u.path) else { return nil }
    do {
      return try JSONDecoder().decode(AccountConfig.self, from: Data(contentsOf: u))
    } catch {
      throw UbiqError.io("cannot read \(u.path): \(error) (run 'ubiqfs account logout' and log in again)")
    }
  }

  /// Written to a temporary file created 0600, then renamed into place.
  public func save(_ paths: Paths) throws {
    try FileManager.default.createDirectory(at: paths.stateRoot, withIntermediateDirectories: true)
    let final = Self.url(paths).path
    let tmp = final + ".tmp.\(getpid())"
    let enc = JSONEncoder()
    enc.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
    let data = try enc.encode(self)
    let fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
    guard fd >= 0 else { throw UbiqError.io("cannot create \(tmp): \(String(cString: strerror(errno)))") }
    let ok = data.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) == $0.count } && fsync(fd) == 0
    close(fd)
    guard ok, rename(tmp, final) == 0 else {
      unlink(tmp)
      throw UbiqError.io("cannot write \(final)")
    }
  }

  public static func remove(_ paths: Paths) throws {
    let u = url(paths)
    if FileManager.default.fileExists(atPath: u.path) { try FileManager.default.removeItem(at: u) }
  }

  /// A client of this account's server with its trust settings and another token.
  public func client(token: String) throws -> APIClient {
    try APIClient(
      baseURL: server, token: token, caCertificatePEM: caCertificatePEM, allowInsecureHTTP: insecureHTTP ?? false)
  }

  public var api: APIClient {
    get throws {
      do { return try client(token: token) } catch let e as CloudError {
        throw UbiqError.invalidArgument(e.description)
      }
    }
  }
}

/// Which cloud this state root syncs with: the signed-in server account (HTTPCloud) or, when
/// nobody is signed in, the embedded engine's `local` account.
public struct CloudSession {
  public let account: String
  public let config: AccountConfig?
  public let paths: Paths

  public static func open(_ paths: Paths) throws -> CloudSession {
    let config = try AccountConfig.load(paths)
    return CloudSession(account: config?.account ?? AccountName.local, config: config, paths: paths)
  }

  public func makeCloud() throws -> CloudService {
    if let config { return HTTPCloud(api: try config.api) }
    return try CloudEngine.embedded(directory: paths.cloudDir, account: account)
  }

  /// The account's key-value store: the server's, or the embedded engine's.
  public func makeKeyValueService() throws -> KeyValueService {
    if let config { return HTTPKeyValue(api: try config.api) }
    return try CloudEngine.embedded(directory: paths.cloudDir, account: account)
  }
}

extension Paths {
  /// The account whose state folders `mount` uses (`local` when nobody is signed in).
  public var activeAccount: String { ((try? AccountConfig.load(self)) ?? nil)?.account ?? AccountName.local }
}
