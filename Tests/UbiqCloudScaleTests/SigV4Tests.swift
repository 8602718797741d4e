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
