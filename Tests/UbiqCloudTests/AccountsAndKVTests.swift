import Foundation
import GRDB
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore

/// Accounts, tokens and the key-value store on the embedded engine (the PostgreSQL engine is
/// exercised by the server API tests in Tests/server against a real database).
final class AccountsAndKVTests: XCTestCase {
  var dir: URL!
  let container = try! ContainerID("iCloud.com.example.kv")

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("accounts-\(UUID().uuidString)")
    try! FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  func store() throws -> SQLiteMetadataStore {
    try SQLiteMetadataStore(path: dir.appendingPathComponent("cloud.sqlite").path)
  }

  /// Every commit backs a reply (an acknowledged upload): the WAL is synced at each commit, on
  /// the writer and on every reader connection the pool opens later.
  func testEveryCommitSyncsTheWAL() async throws {
    let s = try store()
    try await s.createAccount("alice", quotaBytes: 0)
    let writer = try await s.pool.write { db in try Int.fetchOne(db, sql: "PRAGMA synchronous") }
    let reader = try await s.pool.read { db in try Int.fetchOne(db, sql: "PRAGMA synchronous") }
    XCTAssertEqual(writer, 2, "synchronous=FULL")
    XCTAssertEqual(reader, 2, "synchronous=FULL")
  }

  func testTokensAreHashedAndRevocable() async throws {
    let s = try store()
    try await s.createAccount("alice", quotaBytes: 0)
    do {
      try await s.createAccount("alice", quotaBytes: 0)
      XCTFail("expected exists")
    } catch CloudError.exists {}
    let token = BearerToken.generate()
    XCTAssertTrue(token.hasPrefix("ubq_"))
    let rec = TokenRecord(id: BearerToken.newID(), account: "alice", device: "laptop", createdAt: 1, scope: .device)
    try await s.addToken(rec, tokenHash: BearerToken.hash(token))
    let found = try await s.token(hash: BearerToken.hash(token))
    XCTAssertEqual(found?.account, "alice")
    // The token itself is nowhere in the database file.
    let raw = try Data(contentsOf: dir.appendingPathComponent("cloud.sqlite"))
    XCTAssertNil(raw.range(of: Data(token.utf8)))
    let revoked = try await s.revokeToken(account: "alice", id: rec.id)
    XCTAssertTrue(revoked)
    let gone = try await s.token(hash: BearerToken.hash(token))
    XCTAssertNil(gone)
    let again = try await s.revokeToken(account: "alice", id: rec.id)
    XCTAssertFalse(again)
  }

  func testAccountNames() {
    XCTAssertNoThrow(try AccountName.validate("alice.smith-2_x"))
    for bad in ["", "local", "a/b", ".hidden", "-x", String(repeating: "a", count: 65), "émile"] {
      XCTAssertThrowsError(try AccountName.validate(bad), bad)
    }
  }

  func testKeyValueLastWriterWinsAndLimits() async throws {
    let s = try store()
    let engine = CloudEngine(account: "alice", metadata: s, blobs: try FolderBlobStore(root: dir))
    try await s.createAccount("alice", quotaBytes: 0)
    try await engine.ensureContainer(container)
    let w1 = try await engine.kvWrite(
      container, KVWrite(key: "color", value: .string("blue"), timestamp: 10, device: "a"))
    XCTAssertTrue(w1.applied)
    // An older write loses and reports the winner.
    let w0 = try await engine.kvWrite(
      container, KVWrite(key: "color", value: .string("red"), timestamp: 5, device: "b"))
    XCTAssertFalse(w0.applied)
    XCTAssertEqual(w0.entry.value, .string("blue"))
    // A newer remove wins; an older set cannot bring the key back.
    _ = try await engine.kvWrite(container, KVWrite(key: "color", value: nil, timestamp: 20, device: "b"))
    let late = try await engine.kvWrite(container, KVWrite(key: "color", value: .int(1), timestamp: 15, device: "a"))
    XCTAssertFalse(late.applied)
    let all = try await engine.kvEntries(container, since: 0)
    XCTAssertEqual(all.entries, [])
    let changes = try await engine.kvEntries(container, since: w1.token)
    XCTAssertEqual(changes.entries.map(\.deleted), [true])
    // Key length.
    do {
      _ = try await engine.kvWrite(
        container, KVWrite(key: String(repeating: "k", count: 65), value: .bool(true), timestamp: 1, device: "a"))
      XCTFail("expected invalid key")
    } catch KeyValueError.invalidKey {}
    // Total size: 1 MiB.
    let big = JSONValue.string(String(repeating: "x", count: 600_000))
    _ = try await engine.kvWrite(container, KVWrite(key: "big1", value: big, timestamp: 30, device: "a"))
    do {
      _ = try await engine.kvWrite(container, KVWrite(key: "big2", value: big, timestamp: 31, device: "a"))
      XCTFail("expected quota violation")
    } catch KeyValueError.quotaViolation {}
    // Replacing the big entry with a small one fits.
    let small = try await engine.kvWrite(container, KVWrite(key: "big1", value: .int(1), timestamp: 32, device: "a"))
    XCTAssertTrue(small.applied)
    // Key count: 1024.
    var limits = KVLimits()
    limits.maxKeys = 3
    engine.kvLimits = limits
    _ = try await engine.kvWrite(container, KVWrite(key: "k2", value: .null, timestamp: 40, device: "a"))
    _ = try await engine.kvWrite(container, KVWrite(key: "k3", value: .null, timestamp: 40, device: "a"))
    do {
      _ = try await engine.kvWrite(container, KVWrite(key: "k4", value: .null, timestamp: 40, device: "a"))
      XCTFail("expected key count violation")
    } catch KeyValueError.quotaViolation {}
  }

  func testJSONValueRoundTrip() throws {
    let text = #"{"a":[1,2.5,"x",true,null,{"b":false}],"big":9007199254740993}"#
    let v = try JSONDecoder().decode(JSONValue.self, from: Data(text.utf8))
    XCTAssertEqual(String(decoding: try v.jsonData(), as: UTF8.self), text)
  }
}
