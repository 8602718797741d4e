import Foundation
import PropertyBased
import Testing

@testable import UbiqCore
@testable import UbiqIndex

/// The remote-record rules (`RemotePlanner`) on generated views, CanopyCheck-style: whatever
/// the record and the local state, local work is never overwritten, a folder's local children
/// are never dropped, stale records change nothing, and two devices that see two records for
/// one name in opposite orders give the name to the same item.
@Suite struct RemotePlannerTests {
  static let cases = Int(ProcessInfo.processInfo.environment["UBIQ_PLANNER_CASES"] ?? "") ?? 20_000

  /// A record and this device's view of its item: sequence numbers small enough to collide.
  static let situations = zip(
    Gen.int64(in: 1...20), Gen.bool, Gen.int64(in: 0...20).optional, Gen.bool, Gen.bool, Gen.bool, Gen.bool(0.2)
  ).map { seq, deleted, localSeq, isDirectory, changedHere, hasChildren, deleteQueued in
    var record = CloudItem(
      itemID: "x", parentID: WellKnownItem.documents, name: "f", kind: isDirectory ? .directory : .file,
      mode: 0o644, size: 0, mtimeNs: 1, etag: String(seq), deleted: deleted, changeSeq: seq)
    record.deleted = deleted
    // nil: no local row; 0: a local row never in the cloud.
    let local = localSeq.map {
      RemotePlanner.LocalView(
        etag: $0 == 0 ? nil : String($0), isDirectory: isDirectory, changedHere: changedHere,
        hasChildren: isDirectory && hasChildren)
    }
    return Situation(record: record, local: local, deleteQueued: deleteQueued)
  }

  struct Situation: Sendable, CustomStringConvertible {
    var record: CloudItem
    var local: RemotePlanner.LocalView?
    var deleteQueued: Bool
    var description: String {
      "record seq \(record.changeSeq) deleted \(record.deleted), local \(String(describing: local)), "
        + "delete queued \(deleteQueued)"
    }
  }

  @Test func localWorkIsNeverOverwrittenAndLocalChildrenNeverDropped() async {
    await propertyCheck(count: Self.cases, input: Self.situations) { s in
      let decision = RemotePlanner.decide(s.record, local: s.local, deleteQueued: s.deleteQueued)
      if s.deleteQueued {
        #expect(decision == .holdBack, "a delete queued here: \(s)")
      }
      if let local = s.local, local.changedHere {
        #expect([.holdBack, .alreadyApplied].contains(decision), "changed here: \(s) -> \(decision)")
      }
      if decision == .delete {
        #expect(s.local?.hasChildren == false, "a folder with local children deleted: \(s)")
      }
      if let local = s.local, let have = local.etag.flatMap({ Int64($0) }), s.record.changeSeq <= have {
        #expect(
          [.alreadyApplied, .holdBack].contains(decision), "a record not newer than the local one: \(s) -> \(decision)")
      }
      if s.local == nil && s.record.deleted && !s.deleteQueued {
        #expect(decision == .alreadyApplied, "the tombstone of an item never seen: \(s)")
      }
      if s.local == nil && !s.record.deleted && !s.deleteQueued {
        #expect(decision == .apply, "a new item: \(s)")
      }
    }
  }

  /// Two items X and Y want one name. Device 1 has X and receives Y; device 2 has Y and receives
  /// X. Both must give the name to the same item (the one with the smaller change sequence, which
  /// reached the cloud first).
  @Test func twoDevicesSettleANameCollisionTheSameWayWhateverTheOrder() async {
    let pairs = zip(Gen.int64(in: 1...1_000_000), Gen.int64(in: 1...1_000_000)).filter { $0 != $1 }
    await propertyCheck(count: Self.cases, input: pairs) { sx, sy in
      func record(_ id: String, _ seq: Int64) -> CloudItem {
        CloudItem(
          itemID: id, parentID: WellKnownItem.documents, name: "n", kind: .file, mode: 0o644, size: 0, mtimeNs: 1,
          etag: String(seq), changeSeq: seq)
      }
      func renamed(holder: String, holderSeq: Int64, incoming: String, incomingSeq: Int64) -> String {
        let outcome = RemotePlanner.settleName(
          record: record(incoming, incomingSeq),
          holder: RemotePlanner.NameHolder(itemID: holder, unchanged: true, changeSeq: holderSeq), policy: .settle,
          ownOrphan: false)
        return outcome == .holderYields ? holder : incoming
      }
      let onDevice1 = renamed(holder: "X", holderSeq: sx, incoming: "Y", incomingSeq: sy)
      let onDevice2 = renamed(holder: "Y", holderSeq: sy, incoming: "X", incomingSeq: sx)
      #expect(onDevice1 == onDevice2, "X seq \(sx), Y seq \(sy)")
      #expect(onDevice1 == (sx > sy ? "X" : "Y"), "the later item yields")
    }
  }

  @Test func ownOrphanRecordsNeverTakeALocalName() async {
    let inputs = zip(Gen.int64(in: 1...100), Gen.int64(in: 1...100).optional, Gen.bool)
    await propertyCheck(count: Self.cases, input: inputs) { seq, holderSeq, unchanged in
      let r = CloudItem(
        itemID: "gone", parentID: WellKnownItem.documents, name: "n", kind: .file, mode: 0o644, size: 0, mtimeNs: 1,
        etag: String(seq), changeSeq: seq)
      let holder = RemotePlanner.NameHolder(itemID: "here", unchanged: unchanged, changeSeq: holderSeq)
      #expect(RemotePlanner.settleName(record: r, holder: holder, policy: .settle, ownOrphan: true) == .recordYields)
      // Within a pull, a holder whose own record comes later is waited for or parked, never renamed.
      if unchanged {
        #expect(
          RemotePlanner.settleName(record: r, holder: holder, policy: .deferUnchangedHolders, ownOrphan: false)
            == .deferRecord)
        #expect(
          RemotePlanner.settleName(record: r, holder: holder, policy: .moveAsideHolders(["here"]), ownOrphan: false)
            == .parkHolder)
      }
    }
  }
}
