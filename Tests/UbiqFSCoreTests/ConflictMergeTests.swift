import Foundation
import PropertyBased
import Testing
import UbiqCore
import UbiqIndex

@testable import UbiqSync

/// The three-way merge after a stale-etag rejection, when a merge this device committed comes
/// back to it as the cloud's version (its reply was lost).
@Suite struct ConflictMergeTests {
  /// The id a losing local version is kept under.
  static let versionID = "c0ffee00-0000-4000-8000-000000000000"

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
    var committed = ConflictMerge.merge(
      local: mine, base: nil, server: theirs, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(committed.chunks == theirs.chunks, "the newer content wins")
    #expect(committed.deviceID == "device-a")
    #expect(committed.contentAuthor == "device-b")
    #expect(committed.conflicts?.map(\.chunks) == [mine.chunks])
    committed.etag = "5"

    // The reply was lost; device a saves again (newer) and retries with no base.
    let saved = Self.file("mine, saved again", mtimeNs: 30, by: "device-a")
    let next = ConflictMerge.merge(
      local: saved, base: nil, server: committed, deviceID: "device-a", newVersionID: Self.versionID)
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
    var committed = ConflictMerge.merge(
      local: mine, base: base, server: theirs, deviceID: "device-a", newVersionID: Self.versionID)
    committed.etag = "5"
    let retried = ConflictMerge.merge(
      local: mine, base: base, server: committed, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(retried.chunks == theirs.chunks)
    #expect(retried.conflicts?.count == 1)
  }

  /// A file renamed over this one brought its own conflict versions along (content only this
  /// device has now): a merge with the cloud's newer version keeps them, beside the loser.
  @Test func conflictVersionsTheLocalSideTookOnAreKept() {
    let base = Self.file("base", mtimeNs: 1, by: "device-a", etag: "3")
    let theirs = Self.file("theirs", mtimeNs: 20, by: "device-b", etag: "4")
    var mine = Self.file("mine", mtimeNs: 10, by: "device-a")
    let brought = ConflictVersion(
      versionID: "v9", deviceID: "device-c", mtimeNs: 5, size: 7,
      chunks: Self.file("brought", mtimeNs: 5, by: "c").chunks)
    mine.conflicts = [brought]
    let merged = ConflictMerge.merge(
      local: mine, base: base, server: theirs, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(merged.chunks == theirs.chunks)
    #expect(Set((merged.conflicts ?? []).map(\.chunks)) == [brought.chunks, mine.chunks])
  }

  /// A name this device's sync chose (`settledNameOf`) is no user's change: when the cloud's
  /// place changed meanwhile (a user's rename elsewhere), the merge takes the cloud's place;
  /// when it did not, the settled name stays (it settles a name collision).
  @Test func aNameSyncChoseGivesWayToAPlaceChangedInTheCloud() {
    let base = Self.file("base", mtimeNs: 1, by: "device-b", etag: "3")
    var settled = base
    settled.name = "f 2"
    settled.deviceID = "device-a"
    settled.etag = ""
    settled.settledNameOf = base.etag
    var renamed = base
    renamed.name = "e"
    renamed.etag = "4"
    let merged = ConflictMerge.merge(
      local: settled, base: base, server: renamed, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(merged.name == "e", "the rename made elsewhere wins over the name sync chose")
    #expect(merged.parentID == renamed.parentID)
    #expect(merged.settledNameOf == nil)

    let edited = Self.file("theirs", mtimeNs: 20, by: "device-b", etag: "4")
    let kept = ConflictMerge.merge(
      local: settled, base: base, server: edited, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(kept.name == "f 2", "with the cloud's place unchanged, the settled name stays")
    #expect(kept.chunks == edited.chunks)
    #expect(kept.settledNameOf == edited.etag, "the merge differs from the cloud's version by the settled name alone")

    // A name the user gave here is a place change: it wins as before.
    var userRenamed = settled
    userRenamed.settledNameOf = nil
    let mine = ConflictMerge.merge(
      local: userRenamed, base: base, server: renamed, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(mine.name == "f 2")
    #expect(mine.settledNameOf == nil)
  }

  /// A temporary name this device's own earlier commit took in the cloud while the item moved
  /// ("f (moving ...)", its reply lost) is no user's place: the merge keeps the local place,
  /// even the base's (the user moved the item back). Another device's version at such a name
  /// is a user's place there.
  @Test func aTemporaryNameOfThisDevicesOwnCommitIsNoUsersPlace() {
    let base = Self.file("base", mtimeNs: 1, by: "device-a", etag: "3")
    var aside = base
    aside.parentID = "folder-d"
    aside.name = ItemName.aside("f", itemID: base.itemID)
    aside.etag = "4"
    #expect(aside.name == "f (moving item-1)")
    #expect(ItemName.withoutAside(aside.name, itemID: base.itemID) == "f")
    #expect(ItemName.withoutAside(aside.name, itemID: "item-2") == nil)
    #expect(ItemName.withoutAside("f", itemID: base.itemID) == nil)
    let movedBack = ConflictMerge.merge(
      local: base, base: base, server: aside, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(movedBack.name == "f" && movedBack.parentID == base.parentID, "the local place is the user's")

    var theirs = aside
    theirs.deviceID = "device-b"
    let renamedThere = ConflictMerge.merge(
      local: base, base: base, server: theirs, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(renamedThere.name == aside.name && renamedThere.parentID == "folder-d")
  }

  /// A commit that moved the item (and changed its mode) reached the cloud with its reply
  /// lost; the user then moved it back (and changed the mode back). The cloud's place and mode
  /// are this device's own earlier ones: the merge keeps the local ones, newer, although they
  /// are the base's. A place or mode the cloud has that this device did not send, or that
  /// another device's version has, is that device's change, and wins over an unchanged local one.
  @Test func aPlaceThisDeviceSentWithItsReplyLostIsOlderThanTheLocalOne() {
    let base = Self.file("base", mtimeNs: 1, by: "device-a", etag: "3")
    var sent = base
    sent.name = "d"
    sent.mode = 0o600
    sent.xattrs = ["user.tag": Data("a".utf8)]
    sent.etag = "4"
    let unanswered = [
      ItemPlace(parentID: WellKnownItem.documents, name: "e", mode: 0o644),
      ItemPlace(parentID: WellKnownItem.documents, name: "d", mode: 0o600, xattrs: sent.xattrs),
    ]
    let movedBack = ConflictMerge.merge(
      local: base, base: base, server: sent, deviceID: "device-a", newVersionID: Self.versionID,
      unanswered: unanswered)
    #expect(movedBack.name == "f" && movedBack.mode == 0o644, "the local place and mode are newer")
    #expect(movedBack.xattrs.isEmpty, "the local extended attributes are newer")
    #expect(movedBack.conflicts == nil)

    var theirs = sent
    theirs.name = "g"
    theirs.mode = 0o640
    theirs.deviceID = "device-b"
    let movedThere = ConflictMerge.merge(
      local: base, base: base, server: theirs, deviceID: "device-a", newVersionID: Self.versionID,
      unanswered: unanswered)
    #expect(movedThere.name == "g" && movedThere.mode == 0o640, "another device's change wins")

    var sameThere = sent
    sameThere.deviceID = "device-b"
    let sameChange = ConflictMerge.merge(
      local: base, base: base, server: sameThere, deviceID: "device-a", newVersionID: Self.versionID,
      unanswered: unanswered)
    #expect(sameChange.name == "d" && sameChange.mode == 0o600, "another device's version is its change")
    #expect(sameChange.xattrs == sent.xattrs)
  }

  /// With no base, the places, modes and extended attributes of this device's unanswered
  /// commits stand in for one: the cloud's place, mode or attributes that none of them had are
  /// another device's change and win; those that any of them had are this device's own, older
  /// than the local side.
  @Test func withNoBaseTheNotedCommitsTellAnotherDevicesChangeFromOurOwn() {
    let local = Self.file("mine", mtimeNs: 10, by: "device-a")
    let unanswered = [
      ItemPlace(parentID: WellKnownItem.documents, name: "f", mode: 0o644, xattrs: [:]),
      ItemPlace(parentID: WellKnownItem.documents, name: "e", mode: 0o640, xattrs: [:]),
    ]
    var theirs = Self.file("mine", mtimeNs: 10, by: "device-b", etag: "4")
    theirs.contentDeviceID = "device-a"
    theirs.name = "g"
    theirs.mode = 0o600
    theirs.xattrs = ["user.tag": Data("b".utf8)]
    let changedThere = ConflictMerge.merge(
      local: local, base: nil, server: theirs, deviceID: "device-a", newVersionID: Self.versionID,
      unanswered: unanswered)
    #expect(changedThere.name == "g" && changedThere.mode == 0o600, "another device's rename and chmod win")
    #expect(changedThere.xattrs == theirs.xattrs, "another device's extended attribute wins")

    var ours = theirs
    ours.name = "e"
    ours.mode = 0o640
    ours.xattrs = [:]
    let changedHere = ConflictMerge.merge(
      local: local, base: nil, server: ours, deviceID: "device-a", newVersionID: Self.versionID,
      unanswered: unanswered)
    #expect(changedHere.name == "f" && changedHere.mode == 0o644, "a place and mode this device sent are older")

    let unknown = ConflictMerge.merge(
      local: local, base: nil, server: theirs, deviceID: "device-a", newVersionID: Self.versionID)
    #expect(unknown.name == "f" && unknown.mode == 0o644, "with nothing noted the local side is taken")
  }

  /// One side of a concurrent change, drawn: its content (0: the base's), whether it renamed
  /// or chmodded the item, its mtime (small, so that they tie) and its device.
  struct Side: Sendable, CustomStringConvertible {
    var content: Int
    var renamed: Bool
    var chmodded: Bool
    var mtimeNs: Int64
    var device: String
    var description: String {
      "content \(content) renamed \(renamed) chmod \(chmodded) mtime \(mtimeNs) by \(device)"
    }

    /// The item as this side left it, from `base`.
    func item(from base: CloudItem, etag: String) -> CloudItem {
      var item = ConflictMergeTests.file(
        content == 0 ? "base" : "content \(content) of \(device)", mtimeNs: content == 0 ? base.mtimeNs : mtimeNs,
        by: device, etag: etag)
      item.name = renamed ? "renamed by \(device)" : base.name
      item.mode = chmodded ? 0o600 : base.mode
      return item
    }
  }

  /// Generated cases per property (the planner's rules share the setting).
  static let cases = Int(ProcessInfo.processInfo.environment["UBIQ_PLANNER_CASES"] ?? "") ?? 20_000

  /// Two devices' changes: the same device id on both sides would be one device racing itself.
  static let pairs = zip(sides, sides).map { x, y in
    var y = y
    y.device = x.device == "device-a" ? "device-b" : "device-a"
    return (x, y)
  }

  static let sides = zip(Gen.int(in: 0...2), Gen.bool, Gen.bool, Gen.int64(in: 1...3), Gen.bool).map {
    Side(content: $0, renamed: $1, chmodded: $2, mtimeNs: $3, device: $4 ? "device-a" : "device-b")
  }

  /// The merge on generated concurrent changes of one file, CanopyCheck-style. Whichever of
  /// the two devices reached the cloud first (the other one merges): the same content is
  /// current afterwards, nothing either side wrote since the base is dropped (it is current or
  /// a conflict version), a place or a mode only one side changed is that side's, and a merge
  /// sent again after its reply was lost keeps nothing twice.
  @Test func bothOrdersOfTwoConcurrentChangesGiveTheSameFileAndDropNothing() async {
    await propertyCheck(count: Self.cases, input: Self.pairs) { x, y in
      let base = Self.file("base", mtimeNs: 0, by: "device-c", etag: "1")
      let (a, b) = (x.item(from: base, etag: "2"), y.item(from: base, etag: "2"))
      // x's change reached the cloud first and y merges, or the other way round.
      let yMerges = ConflictMerge.merge(
        local: b, base: base, server: a, deviceID: y.device, newVersionID: Self.versionID)
      let xMerges = ConflictMerge.merge(
        local: a, base: base, server: b, deviceID: x.device, newVersionID: Self.versionID)
      #expect(yMerges.chunks == xMerges.chunks, "the orders disagree on the content: \(x) / \(y)")
      for (merged, side) in [(yMerges, "y merges"), (xMerges, "x merges")] {
        let kept = [merged.chunks] + (merged.conflicts ?? []).map(\.chunks)
        for (item, change) in [(a, x), (b, y)] where change.content != 0 {
          #expect(kept.contains(item.chunks), "\(side): \(change.device)'s content is dropped: \(x) / \(y)")
        }
        for (item, change, other) in [(a, x, y), (b, y, x)] {
          if change.renamed && !other.renamed { #expect(merged.name == item.name, "\(side): a rename is lost") }
          if change.chmodded && !other.chmodded { #expect(merged.mode == item.mode, "\(side): a chmod is lost") }
        }
        if x.content == 0 && y.content == 0 { #expect(merged.chunks == base.chunks && merged.conflicts == nil) }
      }
      // y's merge was committed but its reply lost: sent again over it, it changes nothing.
      var committed = yMerges
      committed.etag = "3"
      let again = ConflictMerge.merge(
        local: b, base: base, server: committed, deviceID: y.device, newVersionID: Self.versionID)
      #expect(again.chunks == committed.chunks, "a resent merge changes the content: \(x) / \(y)")
      #expect(
        (again.conflicts ?? []).count == (committed.conflicts ?? []).count,
        "a resent merge keeps a version twice: \(x) / \(y)")
    }
  }

  /// The merge's other branches on the same generated changes. Over a tombstone (changed here,
  /// deleted there) the local version is the item again, in its local place. With no base (the
  /// local item never had a confirmed cloud version) nothing either side has is dropped and
  /// both orders give the same content.
  @Test func anEditOverADeleteOrWithoutABaseDropsNothing() async {
    await propertyCheck(count: Self.cases, input: Self.pairs) { x, y in
      let base = Self.file("base", mtimeNs: 0, by: "device-c", etag: "1")
      let (a, b) = (x.item(from: base, etag: "2"), y.item(from: base, etag: "2"))
      var tombstone = a
      tombstone.deleted = true
      tombstone.etag = "3"
      let overDelete = ConflictMerge.merge(
        local: b, base: base, server: tombstone, deviceID: y.device, newVersionID: Self.versionID)
      #expect(!overDelete.deleted, "the delete wins over a change: \(x) / \(y)")
      #expect(overDelete.chunks == b.chunks && overDelete.name == b.name && overDelete.parentID == b.parentID)
      let yMerges = ConflictMerge.merge(
        local: b, base: nil, server: a, deviceID: y.device, newVersionID: Self.versionID)
      let xMerges = ConflictMerge.merge(
        local: a, base: nil, server: b, deviceID: x.device, newVersionID: Self.versionID)
      #expect(yMerges.chunks == xMerges.chunks, "with no base, the orders disagree: \(x) / \(y)")
      for merged in [yMerges, xMerges] {
        let kept = [merged.chunks] + (merged.conflicts ?? []).map(\.chunks)
        #expect(kept.contains(a.chunks) && kept.contains(b.chunks), "with no base, a content is dropped: \(x) / \(y)")
      }
    }
  }
}
