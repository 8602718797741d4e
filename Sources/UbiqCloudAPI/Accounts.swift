import Crypto
import Foundation
import UbiqCore

/// Rules for account and device names (account names become folder names on clients and
/// blob prefixes on servers, so they are kept to a safe alphabet).
public enum AccountName {
  /// The embedded engine's built-in account; never a server account.
  public static let local = "local"

  public static func validate(_ name: String) throws {
    let allowed = Set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-".unicodeScalars)
    guard !name.isEmpty, name.utf8.count <= 64, name.unicodeScalars.allSatisfy({ allowed.contains($0) }),
      !name.hasPrefix("."), !name.hasPrefix("-")
    else {
      throw CloudError.invalid(
        "account name '\(name)' must be 1-64 characters of letters, digits, '.', '-', '_' (not starting with '.' or '-')"
      )
    }
    if name == local { throw CloudError.invalid("'local' is reserved for the embedded cloud") }
  }

  /// A device's name is the device id of its token's writes that name none, so it follows
  /// `DeviceIDRule`, and is not empty.
  public static func validateDevice(_ name: String) throws {
    guard !name.isEmpty, DeviceIDRule.problem(name) == nil else {
      throw CloudError.invalid("device name must be 1-128 bytes without control characters")
    }
  }
}

/// Bearer tokens: 32 random bytes as `ubq_<64 hex digits>`; servers store only the SHA-256.
public enum BearerToken {
  public static func generate() -> String {
    var rng = SystemRandomNumberGenerator()
    let bytes = (0..<32).map { _ in UInt8.random(in: 0...255, using: &rng) }
    return "ubq_" + Hex.lowercase(bytes)
  }

  /// A short random identifier for a token record (shown by `server token list`).
  public static func newID() -> String {
    var rng = SystemRandomNumberGenerator()
    return Hex.lowercase((0..<8).map { _ in UInt8.random(in: 0...255, using: &rng) })
  }

  /// True for the one token format, `ubq_` and 64 lower-case hex digits.
  public static func isWellFormed(_ token: some StringProtocol) -> Bool {
    token.hasPrefix("ubq_") && Chunker.isValidHash(String(token.dropFirst(4)))
  }

  public static func hash(_ token: String) -> String {
    Hex.lowercase(SHA256.hash(data: Data(token.utf8)))
  }
}

/// What a token may do. An account token (issued by the admin CLI) manages the account's devices;
/// a device token (issued by `POST /v1/devices`, i.e. at login) syncs but cannot mint tokens or
/// revoke any token but itself, so a stolen device cannot lock its owner out.
public enum TokenScope: String, Codable, Sendable, CaseIterable {
  case account
  case device
}

/// One bearer token of an account: the device it was issued to, its scope, when it expires and
/// whether it was revoked. Only the token's SHA-256 is ever stored.
public struct TokenRecord: Codable, Sendable, Equatable {
  public var id: String
  public var account: String
  public var device: String
  /// Seconds since the Unix epoch.
  public var createdAt: Int64
  public var revoked: Bool
  public var scope: TokenScope
  /// Seconds since the Unix epoch; nil: never expires.
  public var expiresAt: Int64?

  public init(
    id: String, account: String, device: String, createdAt: Int64, revoked: Bool = false, scope: TokenScope,
    expiresAt: Int64? = nil
  ) {
    self.id = id
    self.account = account
    self.device = device
    self.createdAt = createdAt
    self.revoked = revoked
    self.scope = scope
    self.expiresAt = expiresAt
  }

  /// True once the token's lifetime has passed (`now` in seconds since the epoch).
  public func isExpired(now: Int64) -> Bool {
    guard let expiresAt else { return false }
    return now >= expiresAt
  }
}
