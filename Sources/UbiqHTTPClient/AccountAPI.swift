import Foundation
import NIOCore
import UbiqCloudAPI
import UbiqCore

/// Account and device calls a signed-in client makes: who am I, register this device (which
/// issues the device's own token; needs an account token), list devices, rotate the calling
/// token, revoke tokens (others only with an account token).
public struct AccountAPI: Sendable {
  public let api: APIClient
  public init(api: APIClient) { self.api = api }

  /// `GET /v1/account`.
  public struct AccountInfo: Codable, Sendable {
    public var account: String
    public var device: String
    public var tokenID: String
    public var usage: Usage
  }

  /// `POST /v1/devices`: a new token for a named device.
  public struct NewDevice: Codable, Sendable {
    public var token: String
    public var device: TokenRecord
  }

  public func accountInfo() async throws -> AccountInfo {
    try api.json(AccountInfo.self, try await api.send(.GET, "/v1/account", timeout: .seconds(10)).body)
  }

  /// `POST /v1/devices` (needs an account token): a device token, expiring after `expiresIn`
  /// seconds if given.
  public func registerDevice(name: String, expiresIn: Int64? = nil) async throws -> NewDevice {
    struct Body: Codable {
      var name: String
      var expiresIn: Int64?
    }
    let r = try await api.send(
      .POST, "/v1/devices", body: try api.encode(Body(name: name, expiresIn: expiresIn)), timeout: .seconds(10))
    return try api.json(NewDevice.self, r.body)
  }

  /// `POST /v1/devices/current/rotate`: swaps the calling token for a new one; the old one stops
  /// working at once.
  public func rotate() async throws -> NewDevice {
    try api.json(
      NewDevice.self, try await api.send(.POST, "/v1/devices/current/rotate", timeout: .seconds(10)).body)
  }

  public func devices() async throws -> [TokenRecord] {
    struct List: Codable { var devices: [TokenRecord] }
    return try api.json(List.self, try await api.send(.GET, "/v1/devices", timeout: .seconds(10)).body).devices
  }

  /// Revokes a token by id (`current`: the token making the call).
  public func revoke(tokenID: String) async throws {
    _ = try await api.send(.DELETE, "/v1/devices/\(APIClient.segment(tokenID))", timeout: .seconds(10))
  }
}
