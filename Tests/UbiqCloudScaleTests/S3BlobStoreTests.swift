import AsyncHTTPClient
import Foundation
import XCTest

@testable import UbiqCloud
@testable import UbiqCloudAPI
@testable import UbiqCloudScale

/// How requests to S3 are addressed and signed (endpoint base path, port, session token), and
/// how failed ones are retried.
final class S3BlobStoreTests: XCTestCase {
  func testEndpointHostKeepsANonDefaultPort() throws {
    XCTAssertEqual(try S3Endpoint("http://127.0.0.1:8333").host, "127.0.0.1:8333")
    XCTAssertEqual(try S3Endpoint("https://s3.example.com:9000").host, "s3.example.com:9000")
    XCTAssertEqual(try S3Endpoint("http://s3.example.com:80").host, "s3.example.com")
    XCTAssertEqual(try S3Endpoint("https://s3.example.com:443/").host, "s3.example.com")
    XCTAssertEqual(try S3Endpoint("https://s3.example.com").host, "s3.example.com")
    XCTAssertEqual(try S3Endpoint("http://[::1]:8333").host, "[::1]:8333")
  }

  func testEndpointBasePath() throws {
    let e = try S3Endpoint("http://127.0.0.1:8333/store/s3/")
    XCTAssertEqual(e.basePath, "/store/s3")
    XCTAssertEqual(e.origin, "http://127.0.0.1:8333")
    XCTAssertEqual(try S3Endpoint("http://127.0.0.1:8333").basePath, "")
    XCTAssertEqual(try S3Endpoint("http://127.0.0.1:8333/").basePath, "")
  }

  func testBadEndpointsAreRefused() {
    for bad in ["ftp://h/x", "http://", "127.0.0.1:8333", "http://h:8333?x=1"] {
      XCTAssertThrowsError(try S3Endpoint(bad), bad)
    }
  }

  /// The request goes to `<endpoint base path>/<bucket>/<key>` with `Host: host:port` and the
  /// session token, and its signature is the one of exactly what is sent.
  func testRequestIsSignedAsSent() throws {
    let config = S3Config(
      endpoint: "http://127.0.0.1:8333/store/", bucket: "chunks", accessKey: "AK", secretKey: "SK",
      region: "eu-west-1", keyPrefix: "p/", sessionToken: "TOKEN")
    let store = try S3BlobStore(config: config, http: HTTPClient.shared)
    let hash = String(repeating: "ab", count: 32)
    let date = Date(timeIntervalSince1970: 1_700_000_000)
    let req = store.prepare(.GET, path: store.objectPath("acc", hash), extra: ["range": "bytes=0-9"], date: date)
    XCTAssertEqual(req.url, "http://127.0.0.1:8333/store/chunks/p/acc/ab/\(hash)")
    XCTAssertEqual(req.headers["host"], ["127.0.0.1:8333"])
    XCTAssertEqual(req.headers["x-amz-security-token"], ["TOKEN"])
    var signer = SigV4Signer(accessKey: "AK", secretKey: "SK", region: "eu-west-1")
    signer.sessionToken = "TOKEN"
    let expected = signer.sign(
      method: "GET", path: URLComponents(string: req.url)!.percentEncodedPath,
      headers: ["host": req.headers["host"][0], "range": req.headers["range"][0]],
      payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(req.headers["Authorization"], [expected["Authorization"]!])
    XCTAssertTrue(
      expected["Authorization"]!.contains(
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date;x-amz-security-token"))
  }

  func testRetryableResults() {
    typealias R = Result<(HTTPClientResponse, Data), any Error>
    for code in [500, 502, 503, 504] {
      XCTAssertTrue(S3BlobStore.isRetryable(R.success((HTTPClientResponse(status: .init(statusCode: code)), Data()))))
    }
    for code in [200, 206, 403, 404, 409, 416] {
      XCTAssertFalse(S3BlobStore.isRetryable(R.success((HTTPClientResponse(status: .init(statusCode: code)), Data()))))
    }
    XCTAssertTrue(S3BlobStore.isRetryable(R.failure(CloudError.unavailable("S3 GET: connect timeout"))))
    XCTAssertFalse(S3BlobStore.isRetryable(R.failure(CloudError.notFound("chunk"))))
  }
}

/// A clock whose time moves only when the code under test sleeps or an attempt takes time.
final class FakeRetryClock: @unchecked Sendable {
  let start = ContinuousClock.now
  var offset: Duration = .zero
  var sleeps: [Duration] = []

  func now() -> ContinuousClock.Instant { start + offset }
  func sleep(_ d: Duration) {
    sleeps.append(d)
    offset += d
  }
}

final class S3RetryPolicyTests: XCTestCase {
  struct Failure: Error, Equatable { var attempt: Int }

  /// Runs `policy` over an operation that fails (retryably) until attempt `succeedAt`, each
  /// attempt taking `attemptTime`; returns the attempts made, the sleeps and the outcome.
  func run(
    _ policy: S3RetryPolicy, succeedAt: Int = .max, attemptTime: Duration = .zero, jitter: Double = 1
  ) async -> (attempts: Int, sleeps: [Duration], result: Result<Int, Failure>) {
    let clock = FakeRetryClock()
    var attempts = 0
    let operation = { () async throws -> Int in
      attempts += 1
      clock.offset += attemptTime
      if attempts < succeedAt { throw Failure(attempt: attempts) }
      return attempts
    }
    let failed = { (r: Result<Int, any Error>) -> Bool in if case .failure = r { return true } else { return false } }
    do {
      let value = try await policy.run(
        isRetryable: failed, random: { jitter }, now: clock.now, sleep: clock.sleep, operation)
      return (attempts, clock.sleeps, .success(value))
    } catch {
      return (attempts, clock.sleeps, .failure(error as! Failure))
    }
  }

  func testBacksOffExponentiallyUntilSuccess() async {
    let r = await run(S3RetryPolicy(), succeedAt: 4)
    XCTAssertEqual(r.attempts, 4)
    XCTAssertEqual(r.sleeps, [.milliseconds(100), .milliseconds(200), .milliseconds(400)])
    XCTAssertEqual(r.result, .success(4))
  }

  func testJitterScalesTheDelay() async {
    let r = await run(S3RetryPolicy(), succeedAt: 3, jitter: 0.5)
    XCTAssertEqual(r.sleeps, [.milliseconds(50), .milliseconds(100)])
    let none = await run(S3RetryPolicy(), succeedAt: 3, jitter: 0)
    XCTAssertEqual(none.sleeps, [.zero, .zero])
  }

  func testDelayIsCappedAndAttemptsAreBounded() async {
    let policy = S3RetryPolicy(
      maxAttempts: 7, baseDelay: .milliseconds(100), maxDelay: .milliseconds(500), totalBudget: .seconds(60))
    let r = await run(policy)
    XCTAssertEqual(r.attempts, 7)
    XCTAssertEqual(
      r.sleeps,
      [
        .milliseconds(100), .milliseconds(200), .milliseconds(400), .milliseconds(500), .milliseconds(500),
        .milliseconds(500),
      ])
    XCTAssertEqual(r.result, .failure(Failure(attempt: 7)))
  }

  /// Slow attempts (timeouts) use up the total budget: no attempt starts after it.
  func testTotalTimeIsBounded() async {
    let r = await run(S3RetryPolicy(), attemptTime: .seconds(4))
    // 4 s, +0.1 s wait, 4 s, +0.2 s wait, 4 s = 12.3 s: a fourth attempt would start past 10 s.
    XCTAssertEqual(r.attempts, 3)
    XCTAssertEqual(r.result, .failure(Failure(attempt: 3)))
  }

  func testDefaultsRetryForAtMostTenSeconds() async {
    let r = await run(S3RetryPolicy(maxAttempts: 1000))
    let slept = r.sleeps.reduce(Duration.zero, +)
    XCTAssertLessThanOrEqual(slept, .seconds(10))
    XCTAssertGreaterThan(slept, .seconds(8))
    XCTAssertTrue(r.sleeps.allSatisfy { $0 <= .seconds(2) })
  }

  func testNotRetryableFailsAtOnce() async throws {
    let clock = FakeRetryClock()
    var attempts = 0
    let operation = { () async throws -> Int in
      attempts += 1
      throw Failure(attempt: attempts)
    }
    do {
      _ = try await S3RetryPolicy().run(
        isRetryable: { (_: Result<Int, any Error>) in false }, now: clock.now, sleep: clock.sleep, operation)
      XCTFail("no error")
    } catch let e as Failure {
      XCTAssertEqual(e, Failure(attempt: 1))
    }
    XCTAssertEqual(attempts, 1)
    XCTAssertEqual(clock.sleeps, [])
  }
}
