import Foundation
import XCTest

@testable import UbiqCloud

final class StoreOpeningTests: XCTestCase {
  var dir: URL!

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("store-\(UUID().uuidString)")
    try? FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  /// `ubiqfs serve` and `ubiqfs server account create` (or several servers) may open one new
  /// storage folder at the same moment: every one of them must find the schema migrated, none
  /// may fail on a migration another applied first.
  func testStoresOpenedAtOnceAllFindTheSchemaMigrated() throws {
    let failures = NSLock()
    nonisolated(unsafe) var errors: [String] = []
    for round in 0..<20 {
      let path = dir.appendingPathComponent("cloud-\(round).sqlite").path
      let group = DispatchGroup()
      for _ in 0..<6 {
        group.enter()
        Thread.detachNewThread {
          defer { group.leave() }
          do {
            let store = try SQLiteMetadataStore(path: path)
            try store.ensureAccountSync("a")
          } catch {
            failures.withLock { errors.append("round \(round): \(error)") }
          }
        }
      }
      group.wait()
    }
    XCTAssertEqual(errors, [])
  }
}
