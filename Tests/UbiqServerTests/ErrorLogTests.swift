import XCTest

@testable import UbiqServer

/// The log line of an answer the server could not give (a 500).
final class ErrorLogTests: XCTestCase {
  struct HugeError: Error, CustomDebugStringConvertible {
    var debugDescription: String { "first line\n\u{1B}[2J\u{2028}" + String(repeating: "x", count: 1_000_000) }
  }

  /// A request that makes an unknown error (a bug) is logged on one line of bounded length,
  /// whatever the error holds: a client cannot fill the server's log with what it sent.
  func testAnUnknownErrorIsLoggedOnOneShortLine() {
    let line = UnknownErrorLog.line(method: "PUT", path: "/v1/x", error: HugeError())
    // No line break, no terminal escape: only printable characters and spaces.
    XCTAssertFalse(line.unicodeScalars.contains { $0.properties.generalCategory == .control || $0 == "\u{2028}" })
    XCTAssertLessThan(line.utf8.count, 1_200)
    XCTAssertTrue(line.hasPrefix("PUT /v1/x: first line  [2J x"), line)
    XCTAssertTrue(line.hasSuffix("(1000018 bytes in all)"), String(line.suffix(60)))
    let short = UnknownErrorLog.line(method: "GET", path: "/v1/y", error: CancellationError())
    XCTAssertEqual(short, "GET /v1/y: \(String(reflecting: CancellationError()))")
  }
}
