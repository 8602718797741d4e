import Foundation
import Testing
import UbiqCore

@testable import UbiqSync

/// The three-way merge after a stale-etag rejection, when a merge this device committed comes
/// back to it as the cloud's version (its reply was lost).
@Suite struct ConflictMergeTests {
  static func file(_ content: String, mtimeNs: Int64, by device: String, etag: String = "") -> CloudItem {
    let chunk = ChunkRef(hash: Chunker.sha256Hex(Data(content.utf8)), length: Int64(content.utf8.count))
    var item = CloudItem(
      itemID: "item-1", parentID: WellKnownItem.documents, name: "f", kind: .file, mode: 0o644,
      size: chunk.length, mtimeNs: mtimeNs, etag: etag, deviceID: device)
    item.chunks = [chunk]
    return item
  }

  /// A merge that kept another device's content names that device as the content's author, and a
  /// later merge from a device that never had a base does not take that content for its own.
  @Test func aMergeThatKeptAnotherDevicesContentIsNotMistakenForThisDevicesOwnUpload() {
    let theirs = Self.file("theirs", mtimeNs: 20, by: "device-b", etag: "4")
    let mine = Self.file("mine", mtimeNs: 10, by: "device-a")
    var committed = ConflictMerge.merge(local: mine, base: nil, server: theirs, deviceID: "device-a")
    #expect(committed.chunks == theirs.chunks, "the newer content wins")
    #expect(committed.deviceID == "device-a")
    #expect(committed.contentAuthor == "device-b")
    #expect(committed.conflicts?.map(\.chunks) == [mine.chunks])
    committed.etag = "5"

    // The reply was lost; device a saves again (newer) and retries with no base.
    let saved = Self.file("mine, saved again", mtimeNs: 30, by: "device-a")
    let next = ConflictMerge.merge(local: saved, base: nil, server: committed, deviceID: "device-a")
    #expect(next.chunks == saved.chunks)
    #expect(next.contentAuthor == "device-a")
    let kept = next.conflicts ?? []
    #expect(kept.contains { $0.chunks == theirs.chunks && $0.deviceID == "device-b" }, "device b's content is kept")
    #expect(kept.contains { $0.chunks == mine.chunks })
  }

  /// Retrying a merge whose commit reached the cloud keeps the loser once.
  @Test func aLoserAlreadyKeptIsNotKeptTwice() {
    let base = Self.file("base", mtimeNs: 1, by: "device-a", etag: "3")
    let theirs = Self.file("theirs", mtimeNs: 20, by: "device-b", etag: "4")
    let mine = Self.file("mine", mtimeNs: 10, by: "device-a")
    var committed = ConflictMerge.merge(local: mine, base: base, server: theirs, deviceID: "device-a")
    committed.etag = "5"
    let retried = ConflictMerge.merge(local: mine, base: base, server: committed, deviceID: "device-a")
    #expect(retried.chunks == theirs.chunks)
    #expect(retried.conflicts?.count == 1)
  }
}
