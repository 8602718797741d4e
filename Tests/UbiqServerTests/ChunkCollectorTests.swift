import Foundation
import Logging
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCore
@testable import UbiqServer

/// The server's collector service: when its passes run.
final class ChunkCollectorTests: XCTestCase {
  var dir: URL!

  override func setUp() {
    dir = URL(fileURLWithPath: NSTemporaryDirectory()).appendingPathComponent("collector-\(UUID().uuidString)")
  }
  override func tearDown() { try? FileManager.default.removeItem(at: dir) }

  /// A server restarted more often than the interval still collects: the first pass comes
  /// soon after the start, not one interval later.
  func testTheFirstPassComesSoonAfterTheStartNotAfterOneInterval() async throws {
    var log = Logger(label: "test")
    log.logLevel = .warning
    let logger = log
    try await Backend.with(.embedded(directory: dir), logger: logger) { backend in
      _ = try await backend.createAccount("dora", quotaBytes: 0, device: "setup")
      let engine = backend.engine(account: "dora")
      let orphan = Data("no item refers to this".utf8)
      try await engine.putChunk(hash: Chunker.sha256Hex(orphan), data: orphan)
      let used = try await engine.usage().usedBytes
      XCTAssertEqual(used, Int64(orphan.count))

      let collector = ChunkCollector(
        backend: backend, schedule: CollectionSchedule(interval: 3600, grace: 0, firstPassAfter: 1), logger: logger)
      let running = Task { try await collector.run() }
      defer { running.cancel() }
      let deadline = ContinuousClock.now + .seconds(20)
      while try await engine.usage().usedBytes != 0 {
        guard ContinuousClock.now < deadline else { return XCTFail("no pass within 20 s of the start") }
        try await Task.sleep(for: .milliseconds(100))
      }
      let missing = try await engine.missingChunks([Chunker.sha256Hex(orphan)])
      XCTAssertEqual(missing, [Chunker.sha256Hex(orphan)])
    }
  }
}
