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
    item.settledNameOf = maybe(text)
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
    item.settledNameOf = "6"
    let ours = try JSONSerialization.jsonObject(with: RecordJSON.encode(item)) as? NSDictionary
    let theirs = try JSONSerialization.jsonObject(with: JSONEncoder().encode(item)) as? NSDictionary
    #expect(ours != nil && ours == theirs)
  }

  // MARK: - reading

  @Test func whatEitherEncoderWritesItReadsBack() async {
    await propertyCheck(count: Self.cases, input: Self.records) { item in
      let ours = RecordJSON.encode(item)
      #expect((try? RecordJSON.decode(ours)) == item, "\(String(decoding: ours, as: UTF8.self))")
      let theirs = try! JSONEncoder().encode(item)
      #expect((try? RecordJSON.decode(theirs)) == item, "\(String(decoding: theirs, as: UTF8.self))")
      #expect((try? RecordJSON.decodeArray(RecordJSON.encode([item, item]))) == [item, item])
    }
  }

  /// Damaged records (bytes dropped, changed, inserted, cut short): the reader never crashes,
  /// and whatever it reads `JSONDecoder` reads too, as the same record. It is never more lenient.
  @Test func itNeverReadsMoreThanJSONDecoderDoes() async {
    let damaged = Generator<Data, Shrink.None<Data>>(run: { rng in
      var item = Self.records.run(using: &rng)
      if Bool.random(using: &rng) { item.name = "n" }
      var bytes = [UInt8](Bool.random(using: &rng) ? RecordJSON.encode(item) : try! JSONEncoder().encode(item))
      let significant = Array(#"{}[]:,"\ -+.0123456789eEtfnulx"#.utf8) + [0, 0x1F, 0x80, 0xC3, 0xFF]
      for _ in 0..<Int.random(in: 1...3, using: &rng) where !bytes.isEmpty {
        let at = Int.random(in: 0..<bytes.count, using: &rng)
        switch Int.random(in: 0..<4, using: &rng) {
        case 0: bytes.remove(at: at)
        case 1: bytes[at] = significant.randomElement(using: &rng)!
        case 2: bytes.insert(significant.randomElement(using: &rng)!, at: at)
        default: bytes.removeLast(Int.random(in: 0...min(8, bytes.count), using: &rng))
        }
      }
      return Data(bytes)
    })
    await propertyCheck(count: Self.cases * 4, input: damaged) { data in
      guard let ours = try? RecordJSON.decode(data) else { return }
      let theirs = try? JSONDecoder().decode(CloudItem.self, from: data)
      #expect(theirs == ours, "\(String(decoding: data, as: UTF8.self))")
    }
  }

  /// What it refuses, and how: the record's JSON with one thing wrong.
  @Test func itRefusesWhatIsNotARecord() throws {
    let good =
      #"{"itemID":"i","parentID":null,"name":"n","kind":1,"mode":420,"size":0,"mtimeNs":5,"xattrs":{},"chunks":[],"etag":"1","deleted":false,"changeSeq":1,"deviceID":"d"}"#
    #expect(try RecordJSON.decode(Data(good.utf8)).name == "n")
    func refusal(_ text: String) -> JSONReader.Failure? {
      do {
        _ = try RecordJSON.decode(Data(text.utf8))
        return nil
      } catch let failure as JSONReader.Failure {
        return failure
      } catch {
        return .syntax(offset: -1)
      }
    }
    func with(_ old: String, _ new: String) -> String { good.replacingOccurrences(of: old, with: new) }
    #expect(refusal(with(#""name":"n""#, #""name":"n","name":"m""#)) == .duplicateKey("name"))
    #expect(refusal(with(#""name":"n""#, #""name":"\ud800""#)) == .invalidUTF8(offset: 37))
    #expect(refusal(with(#""name":"n""#, #""name":"\udc00\ud800""#)) == .invalidUTF8(offset: 37))
    #expect(refusal(with(#""name":"n""#, "\"name\":\"a\u{1}\"")) == .syntax(offset: 39))
    #expect(refusal(with(#""size":0"#, #""size":1.0"#)) == .wrongType(field: "size"))
    #expect(refusal(with(#""size":0"#, #""size":1e3"#)) == .wrongType(field: "size"))
    #expect(refusal(with(#""size":0"#, #""size":"0""#)) == .wrongType(field: "size"))
    #expect(refusal(with(#""size":0"#, #""size":9223372036854775808"#)) == .wrongType(field: "size"))
    #expect(try RecordJSON.decode(Data(with(#""size":0"#, #""size":-9223372036854775808"#).utf8)).size == .min)
    #expect(refusal(with(#""size":0"#, #""size":01"#)) != nil)
    #expect(refusal(with(#""mode":420"#, #""mode":-1"#)) == .wrongType(field: "mode"))
    #expect(refusal(with(#""mode":420"#, #""mode":4294967296"#)) == .wrongType(field: "mode"))
    #expect(refusal(with(#""kind":1"#, #""kind":4"#)) == .wrongType(field: "kind"))
    #expect(refusal(with(#""etag":"1","#, "")) == .missing(field: "etag"))
    #expect(refusal(with(#""etag":"1""#, #""etag":null"#)) == .wrongType(field: "etag"))
    #expect(refusal(with(#""xattrs":{}"#, #""xattrs":{"k":"not base64!"}"#)) == .wrongType(field: "xattrs.k"))
    #expect(refusal(good + " x") == .syntax(offset: good.utf8.count + 1))
    #expect(refusal("\u{FEFF}" + good) != nil)
    let deep = String(repeating: "[", count: 600) + String(repeating: "]", count: 600)
    #expect(refusal(with(#""name":"n""#, #""name":"n","extra":"# + deep)) == .tooDeep)
    let nested = String(repeating: "[", count: 100) + String(repeating: "]", count: 100)
    #expect(
      try RecordJSON.decode(Data(with(#""name":"n""#, #""extra":{"a":"# + nested + #"},"name":"n""#).utf8)).name == "n")
    var bytes = Array(good.utf8)
    bytes[bytes.firstIndex(of: UInt8(ascii: "n"))! + 4] = 0xFF
    #expect(throws: JSONReader.Failure.self) { try RecordJSON.decode(Data(bytes)) }
  }
}
