import Foundation
import XCTest

@testable import UbiqCloudScale

/// The example signature calculations of the AWS S3 documentation ("Signature Calculations
/// for the Authorization Header: Transferring Payload in a Single Chunk").
final class SigV4Tests: XCTestCase {
  let signer = SigV4Signer(
    accessKey: "AKIAIOSFODNN7EXAMPLE", secretKey: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", region: "us-east-1")
  let date = Date(timeIntervalSince1970: 1_369_353_600)  // 2013-05-24T00:00:00Z

  func testAmzDate() {
    XCTAssertEqual(SigV4Signer.amzDate(date), "20130524T000000Z")
  }

  func testGetObjectWithRange() {
    let h = signer.sign(
      method: "GET", path: "/test.txt", headers: ["Host": "examplebucket.s3.amazonaws.com", "Range": "bytes=0-9"],
      payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(
      h["Authorization"],
      "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        + "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        + "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
  }

  func testPutObject() {
    let body = Data("Welcome to Amazon S3.".utf8)
    let path = "/" + SigV4Signer.uriEncode("test$file.text", slash: false)
    XCTAssertEqual(path, "/test%24file.text")
    let h = signer.sign(
      method: "PUT", path: path,
      headers: [
        "Host": "examplebucket.s3.amazonaws.com", "Date": "Fri, 24 May 2013 00:00:00 GMT",
        "x-amz-storage-class": "REDUCED_REDUNDANCY",
      ], payloadHash: SigV4Signer.sha256Hex(body), date: date)
    XCTAssertEqual(h["x-amz-content-sha256"], "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072")
    XCTAssertEqual(
      h["Authorization"],
      "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        + "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class, "
        + "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd")
  }

  func testGetBucketLifecycleQuery() {
    let h = signer.sign(
      method: "GET", path: "/", query: [("lifecycle", "")], headers: ["Host": "examplebucket.s3.amazonaws.com"],
      payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertTrue(
      h["Authorization"]!.hasSuffix("Signature=fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"),
      h["Authorization"]!)
  }

  func testURIEncoding() {
    XCTAssertEqual(SigV4Signer.uriEncode("a b/c~d", slash: true), "a%20b%2Fc~d")
    XCTAssertEqual(SigV4Signer.uriEncode("a b/c", slash: false), "a%20b/c")
  }
}

/// Vectors of AWS's published SigV4 test suite (`aws-sig-v4-test-suite`, "Signature Version 4
/// test suite" of the AWS General Reference): credentials AKIDEXAMPLE, region us-east-1,
/// service `service`, 2015-08-30T12:36:00Z, host example.amazonaws.com. The suite's requests
/// carry no `x-amz-content-sha256` (an S3 header), so the signer is made without it.
final class SigV4TestSuiteTests: XCTestCase {
  let signer = SigV4Signer(
    accessKey: "AKIDEXAMPLE", secretKey: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", region: "us-east-1",
    service: "service", sendsPayloadHash: false)
  let date = Date(timeIntervalSince1970: 1_440_938_160)  // 2015-08-30T12:36:00Z
  let host = ("Host", "example.amazonaws.com")
  /// The suite's example session token (post-sts-token).
  let token =
    "AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGBuFqwAeMicRXmxfpSPfIeoIYRqTflfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8phUZampKsburEDy0KPkyQDYwT7WZ0wq5VSXDvp75YU9HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xVqr7ZD0u0iPPkUL64lIZbqBAz+scqKmlzm8FDrypNC9Yjc8fPOLn9FX9KSYvKTr4rvx3iSIlTJabIQwj2ICCR/oLxBA=="

  func authorization(_ signedHeaders: String, _ signature: String) -> String {
    "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
      + "SignedHeaders=\(signedHeaders), Signature=\(signature)"
  }

  func testGetVanilla() {
    let h = signer.sign(
      method: "GET", path: "/", headerList: [host], payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(h["x-amz-date"], "20150830T123600Z")
    XCTAssertNil(h["x-amz-content-sha256"])
    XCTAssertEqual(
      h["Authorization"],
      authorization("host;x-amz-date", "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"))
  }

  func testPostVanilla() {
    let h = signer.sign(
      method: "POST", path: "/", headerList: [host], payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(
      h["Authorization"],
      authorization("host;x-amz-date", "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"))
  }

  func testGetVanillaQueryOrderKeyCase() {
    let h = signer.sign(
      method: "GET", path: "/", query: [("Param2", "value2"), ("Param1", "value1")], headerList: [host],
      payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(
      h["Authorization"],
      authorization("host;x-amz-date", "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500"))
  }

  func testGetVanillaQueryUnreserved() {
    let unreserved = "-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    let h = signer.sign(
      method: "GET", path: "/", query: [(unreserved, unreserved)], headerList: [host],
      payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(
      h["Authorization"],
      authorization("host;x-amz-date", "9c3e54bfcdf0b19771a7f523ee5669cdf59bc7cc0884027167c21bb143a40197"))
  }

  func testGetHeaderKeyDuplicate() {
    let h = signer.sign(
      method: "GET", path: "/",
      headerList: [host, ("My-Header1", "value2"), ("My-Header1", "value2"), ("My-Header1", "value1")],
      payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(
      h["Authorization"],
      authorization(
        "host;my-header1;x-amz-date", "c9d5ea9f3f72853aea855b47ea873832890dbdd183b4468f858259531a5138ea"))
  }

  func testGetHeaderValueTrim() {
    let h = signer.sign(
      method: "GET", path: "/", headerList: [host, ("My-Header1", " value1"), ("My-Header2", "\"a   b   c\"")],
      payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(
      h["Authorization"],
      authorization(
        "host;my-header1;my-header2;x-amz-date",
        "acc3ed3afb60bb290fc8d2dd0098b9911fcaa05412b367055dee359757a9c736"))
  }

  /// post-sts-header-before: the session token is sent as `x-amz-security-token` and signed.
  func testPostSTSHeaderBefore() {
    var s = signer
    s.sessionToken = token
    let h = s.sign(
      method: "POST", path: "/", headerList: [host], payloadHash: SigV4Signer.emptyPayloadHash, date: date)
    XCTAssertEqual(h["x-amz-security-token"], token)
    XCTAssertEqual(
      h["Authorization"],
      authorization(
        "host;x-amz-date;x-amz-security-token", "85d96828115b5dc0cfc3bd16ad9e210dd772bbebba041836c64533a82be05ead"))
  }
}
