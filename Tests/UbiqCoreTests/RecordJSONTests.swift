import Foundation
import PropertyBased
import Testing

@testable import UbiqCore

/// `RecordJSON` writes what `JSONDecoder` reads back into the same record, whatever the
/// record holds: names with quotes, backslashes, control characters and any Unicode, absent
/// and present optionals, extended attributes, chunks, conflict versions, extreme numbers.
@Suite struct RecordJSONTests {
  static let cases = Int(ProcessInfo.processInfo.environment["UBIQ_RECORD_JSON_CASES"] ?? "") ?? 5_000

  static let characters: [Character] = [
    "a", "Z", "0", " ", "/", "\"", "\\", "\u{0}", "\n", "\r", "\t", "\u{1F}", "\u{7F}", "é", "e\u{301}",
    "\u{2028}", "\u{FEFF}", "😀", "👩‍👩‍👧", "中", "\u{10FFFF}",
  ]
  static let records = Generator<CloudItem, Shrink.None<CloudItem>>(run: { rng in
    func text() -> String {
      String((0..<Int.random(in: 0...12, using: &rng)).map { _ in characters.randomElement(using: &rng)! })
    }
    func number() -> Int64 {
      Bool.random(using: &rng)
        ? [Int64.min, -1, 0, 1, 255, 1 << 40, Int64.max].randomElement(using: &rng)!
        : Int64.random(in: .min ... .max, using: &rng)
    }
    func chunks() -> [ChunkRef] {
      (0..<Int.random(in: 0...3, using: &rng)).map { _ in ChunkRef(hash: text(), length: number()) }
    }
    func maybe<T>(_ make: () -> T) -> T? { Bool.random(using: &rng) ? make() : nil }
    var xattrs: [String: Data] = [:]
    for _ in 0..<Int.random(in: 0...3, using: &rng) {
      xattrs[text()] = Data(
        (0..<Int.random(in: 0...40, using: &rng)).map { _ in UInt8.random(in: 0...255, using: &rng) })
    }
    var item = CloudItem(
      itemID: text(), parentID: maybe(text), name: text(),
      kind: [.file, .directory, .symlink].randomElement(using: &rng)!,
      mode: [0, 0o644, UInt32.max].randomElement(using: &rng)!, size: number(), mtimeNs: number(),
      symlinkTarget: maybe(text), xattrs: xattrs, chunks: chunks(), etag: text(), deleted: Bool.random(using: &rng),
      changeSeq: number(), deviceID: text())
    item.contentDeviceID = maybe(text)
    item.conflicts = maybe {
      (0..<Int.random(in: 0...2, using: &rng)).map { _ in
        ConflictVersion(versionID: text(), deviceID: text(), mtimeNs: number(), size: number(), chunks: chunks())
      }
    }
    return item
  })

  @Test func whatItWritesDecodesToTheSameRecord() async {
    await propertyCheck(count: Self.cases, input: Self.records) { item in
      let data = RecordJSON.encode(item)
      let decoded = try? JSONDecoder().decode(CloudItem.self, from: data)
      #expect(decoded == item, "\(String(decoding: data, as: UTF8.self))")
    }
  }

  /// The same value as `JSONEncoder` writes, read back (key order aside).
  @Test func itAgreesWithJSONEncoder() throws {
    var item = CloudItem(
      itemID: "i\"d", parentID: nil, name: "a\\b\u{1}c/é", kind: .symlink, mode: 0o777, size: -1,
      mtimeNs: .max, symlinkTarget: "../t", xattrs: ["k": Data([0, 255, 62, 63])],
      chunks: [ChunkRef(hash: "h", length: 3)], etag: "7", deleted: true, changeSeq: 7, deviceID: "d")
    item.conflicts = []
    let ours = try JSONSerialization.jsonObject(with: RecordJSON.encode(item)) as? NSDictionary
    let theirs = try JSONSerialization.jsonObject(with: JSONEncoder().encode(item)) as? NSDictionary
    #expect(ours != nil && ours == theirs)
  }
}
