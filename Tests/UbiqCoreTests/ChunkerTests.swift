import Foundation
import XCTest

@testable import UbiqCore

final class ChunkerTests: XCTestCase {
  func randomData(_ n: Int, seed: UInt64) -> Data {
    var s = seed
    var d = Data(count: n)
    d.withUnsafeMutableBytes { raw in
      let p = raw.bindMemory(to: UInt64.self)
      for i in 0..<p.count {
        s &+= 0x9E37_79B9_7F4A_7C15
        var z = s
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        p[i] = z ^ (z >> 27)
      }
    }
    return d
  }

  /// Chunk names are SHA-256 in lower-case hex: the published test vectors, and every byte
  /// value through the hex writer.
  func testHashesAreSHA256InLowerCaseHex() {
    XCTAssertEqual(
      Chunker.sha256Hex(Data()), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    XCTAssertEqual(
      Chunker.sha256Hex(Data("abc".utf8)), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    XCTAssertEqual(Hex.lowercase([0x00, 0x09, 0x0a, 0x7f, 0xa0, 0xff]), "00090a7fa0ff")
    let all = Hex.lowercase((0...255).map { UInt8($0) })
    XCTAssertEqual(
      all,
      (0...255).map { String($0, radix: 16).count == 1 ? "0" + String($0, radix: 16) : String($0, radix: 16) }.joined())
  }

  func chunks(_ data: Data, _ c: Chunker = .standard) throws -> [ChunkRef] {
    let path = NSTemporaryDirectory() + "chunk-\(UUID().uuidString)"
    try data.write(to: URL(fileURLWithPath: path))
    defer { unlink(path) }
    let fd = open(path, O_RDONLY)
    defer { close(fd) }
    var out: [ChunkRef] = []
    try c.chunkFile(fd: fd) { ref, bytes in
      XCTAssertEqual(Int64(bytes.count), ref.length)
      XCTAssertEqual(Chunker.sha256Hex(bytes), ref.hash)
      out.append(ref)
    }
    return out
  }

  func testChunksCoverFileWithinBounds() throws {
    let data = randomData(24 << 20, seed: 1)
    let refs = try chunks(data)
    XCTAssertEqual(refs.reduce(0) { $0 + $1.length }, Int64(data.count))
    for r in refs.dropLast() {
      XCTAssertGreaterThanOrEqual(r.length, Int64(Chunker.standard.minSize))
      XCTAssertLessThanOrEqual(r.length, Int64(Chunker.standard.maxSize))
    }
    XCTAssertGreaterThan(refs.count, 8)
  }

  func testEmptyAndSmallFiles() throws {
    XCTAssertEqual(try chunks(Data()).count, 0)
    let small = Data("hello".utf8)
    let refs = try chunks(small)
    XCTAssertEqual(refs, [ChunkRef(hash: Chunker.sha256Hex(small), length: 5)])
    XCTAssertEqual(refs[0].hash, "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")
  }

  func testInsertionChangesOnlyNearbyChunks() throws {
    let base = randomData(32 << 20, seed: 7)
    var edited = base
    edited.insert(contentsOf: Data(repeating: 0xAB, count: 1000), at: 16 << 20)
    let a = Set(try chunks(base).map(\.hash))
    let b = try chunks(edited)
    let changed = b.filter { !a.contains($0.hash) }.reduce(Int64(0)) { $0 + $1.length }
    XCTAssertLessThan(changed, 10 << 20, "an insertion should re-chunk only its neighbourhood")
  }

  /// A small edit re-chunks little, in the tail too: over many files, the bytes in chunks the
  /// old version does not have, after an edit of one average chunk's size in the middle. The
  /// standard chunker's sizes scaled down 256 times (each chunk start sees the same odds per
  /// byte), so that hundreds of files take seconds: a 192 KiB file, a 4 KiB edit at 80 KiB.
  func testASmallEditReChunksLittleEvenInTheTail() throws {
    func reChunked(_ c: Chunker) throws -> [Int64] {
      var out: [Int64] = []
      for seed in UInt64(1)...400 {
        let base = randomData(192 << 10, seed: seed)
        var edited = base
        edited.replaceSubrange((80 << 10)..<(84 << 10), with: randomData(4 << 10, seed: seed &+ 1_000_000))
        let old = Set(try chunks(base, c).map(\.hash))
        out.append(try chunks(edited, c).filter { !old.contains($0.hash) }.reduce(0) { $0 + $1.length })
      }
      return out.sorted()
    }
    let standard = Chunker.standard
    let scaled = Chunker(
      minSize: standard.minSize >> 8, averageSize: standard.averageSize >> 8, maxSize: standard.maxSize >> 8)
    let sizes = try reChunked(scaled)
    let average = Double(scaled.averageSize)
    let (median, p95, p99) = (
      Double(sizes[sizes.count / 2]) / average, Double(sizes[sizes.count * 95 / 100]) / average,
      Double(sizes[sizes.count * 99 / 100]) / average
    )
    print("re-chunked for an edit of one average chunk, in average chunks: median \(median), p95 \(p95), p99 \(p99)")
    XCTAssertLessThanOrEqual(median, 3.5)
    XCTAssertLessThanOrEqual(p95, 6)
    XCTAssertLessThanOrEqual(p99, 8.5)
  }

  func testNames() {
    XCTAssertThrowsError(try ItemName.validate("a/b"))
    XCTAssertThrowsError(try ItemName.validate(".."))
    XCTAssertThrowsError(try ItemName.validate(String(repeating: "x", count: 256))) { e in
      XCTAssertEqual((e as? UbiqError)?.errno, ENAMETOOLONG)
    }
    XCTAssertNoThrow(try ItemName.validate(String(repeating: "x", count: 255)))
    XCTAssertEqual(ItemName.numbered("notes.txt", 2), "notes 2.txt")
    XCTAssertEqual(ItemName.numbered("README", 3), "README 3")
    // A name at the limit gives up characters of its stem (whole characters) for its number.
    let longest = String(repeating: "x", count: 251) + ".txt"
    XCTAssertEqual(ItemName.numbered(longest, 2), String(repeating: "x", count: 249) + " 2.txt")
    for name in [
      longest, String(repeating: "é", count: 125) + "a.txt", String(repeating: "e\u{301}", count: 85),
      "a." + String(repeating: "e", count: 253), String(repeating: "😀", count: 63) + "abc", "x",
    ] {
      XCTAssertLessThanOrEqual(name.utf8.count, 255)
      for n in [2, 10, 999_999] {
        let numbered = ItemName.numbered(name, n)
        XCTAssertLessThanOrEqual(numbered.utf8.count, 255, numbered)
        XCTAssertNoThrow(try ItemName.validateInCloud(numbered), numbered)
        XCTAssertTrue(numbered.contains(" \(n)"), numbered)
        XCTAssertNotEqual(numbered, name)
      }
    }
    XCTAssertThrowsError(try ContainerID("bad/id"))
    XCTAssertNoThrow(try ContainerID("iCloud.com.example.notes"))
    // A cloud item's name: valid, and not a name that stays on its device.
    XCTAssertThrowsError(try ItemName.validateInCloud("keep.nosync"))
    XCTAssertNoThrow(try ItemName.validateInCloud("keep.nosync.txt"))
    // A repair makes every name one a cloud item may have, with room for a number.
    let long = String(repeating: "é", count: 200)
    for bad in ["a/b", "", ".", "..", "x\u{0}y", "k.nosync", ".nosync", long, long + "/"] {
      let repaired = ItemName.repaired(bad)
      XCTAssertNoThrow(try ItemName.validateInCloud(repaired), bad)
      XCTAssertNoThrow(try ItemName.validateInCloud(ItemName.numbered(repaired, 99)), bad)
    }
    XCTAssertEqual(ItemName.repaired("a/b"), "a_b")
    XCTAssertEqual(ItemName.repaired("k.nosync"), "k_nosync")
    XCTAssertEqual(ItemName.repaired(".."), "unnamed")
  }
}
