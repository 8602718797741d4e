import Foundation
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import XCTest

@testable import UbiqKV

final class KVMirrorTests: XCTestCase {
  func makeMirror() throws -> KVMirror {
    let dir = FileManager.default.temporaryDirectory.appendingPathComponent("kvmirror-\(UUID().uuidString)")
    addTeardownBlock { try? FileManager.default.removeItem(at: dir) }
    return try KVMirror(path: dir.appendingPathComponent("kv.sqlite"), container: .defaultContainer)
  }

  /// The daemon pulls every second; a pull that brings nothing writes nothing (an idle mount
  /// would otherwise write and sync the store's file every second).
  func testAPullWithNothingNewWritesNothing() throws {
    let m = try makeMirror()
    let entry = KVEntry(key: "b", value: .string("x"), timestamp: 50, device: "d2", seq: 1)
    try m.applyPull(KVSnapshot(entries: [entry], token: 1, usedBytes: 0, keyCount: 1))
    let changes = try m.db.read { $0.totalChangesCount }
    XCTAssertEqual(try m.applyPull(KVSnapshot(entries: [], token: 1, usedBytes: 0, keyCount: 1)), [])
    XCTAssertEqual(try m.db.read { $0.totalChangesCount }, changes)
    // A new token with no entries is still stored.
    try m.applyPull(KVSnapshot(entries: [], token: 5, usedBytes: 0, keyCount: 1))
    XCTAssertEqual(try m.token(), 5)
    XCTAssertEqual(try m.get("b"), .string("x"))
  }

  func testPendingOverlaysAndLWWOnPull() throws {
    let m = try makeMirror()
    try m.write("a", .int(1), timestamp: 100)
    XCTAssertEqual(try m.get("a"), .int(1))
    // First pull: initial_sync; an older server entry does not replace a newer stored one.
    try m.applyPull(
      KVSnapshot(
        entries: [KVEntry(key: "b", value: .string("x"), timestamp: 50, device: "d2", seq: 1)], token: 1,
        usedBytes: 0, keyCount: 1))
    try m.acknowledge(
      "a", sentTimestamp: 100, entry: KVEntry(key: "a", value: .int(1), timestamp: 100, device: "d1", seq: 2))
    XCTAssertTrue(try m.pending().isEmpty)
    let changed = try m.applyPull(
      KVSnapshot(
        entries: [
          KVEntry(key: "a", value: .int(0), timestamp: 90, device: "d2", seq: 3),
          KVEntry(key: "b", value: .string("y"), timestamp: 60, device: "d2", seq: 4),
        ], token: 4, usedBytes: 0, keyCount: 2))
    XCTAssertEqual(changed, ["b"])
    XCTAssertEqual(try m.get("a"), .int(1))
    XCTAssertEqual(try m.get("b"), .string("y"))
    let reasons = try m.notifications(after: 0).map { $0.json }
    XCTAssertTrue(reasons[0].contains("initial_sync"))
    XCTAssertTrue(reasons[1].contains("server_change") && reasons[1].contains("\"b\""))
  }

  func testLimitsChangeNothing() throws {
    let m = try makeMirror()
    XCTAssertThrowsError(try m.write(String(repeating: "k", count: 65), .int(1), timestamp: 1))
    XCTAssertThrowsError(try m.write("big", .string(String(repeating: "x", count: 1024 * 1024)), timestamp: 1))
    // All or nothing: a batch over the key limit queues nothing.
    XCTAssertThrowsError(try m.write((0..<1025).map { ("k\($0)", JSONValue.int(Int64($0))) }, timestamp: 1))
    XCTAssertTrue(try m.pending().isEmpty)
    try m.write((0..<1024).map { ("k\($0)", JSONValue.int(Int64($0))) }, timestamp: 1)
    XCTAssertThrowsError(try m.write("one-more", .int(1), timestamp: 2)) { e in
      guard case KeyValueError.quotaViolation = e else { return XCTFail("\(e)") }
    }
    XCTAssertEqual(try m.all().count, 1024)
    XCTAssertNil(try m.get("one-more"))
    // A server rejection drops the pending write and logs quota_violation.
    try m.reject("k1", sentTimestamp: 1, message: "too big")
    XCTAssertNil(try m.get("k1"))
    XCTAssertTrue(try m.notifications(after: 0).last!.json.contains("quota_violation"))
  }
}
