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
    zip(Gen.int64(in: 1...20), Gen.bool, Gen.int64(in: 0...20).optional, Gen.bool, Gen.bool, Gen.bool, Gen.bool(0.2)),
    Gen.int64(in: 1...20).optional, Gen.bool
  ).map { views, deletedHere, changedBelow in
    let (seq, deleted, localSeq, isDirectory, changedHere, hasChildren, deleteQueued) = views
    var record = CloudItem(
      itemID: "x", parentID: WellKnownItem.documents, name: "f", kind: isDirectory ? .directory : .file,
      mode: 0o644, size: 0, mtimeNs: 1, etag: String(seq), deleted: deleted, changeSeq: seq)
    record.deleted = deleted
    // nil: no local row; 0: a local row never in the cloud.
    let local = localSeq.map {
      RemotePlanner.LocalView(
        etag: $0 == 0 ? nil : String($0), isDirectory: isDirectory, changedHere: changedHere,
        hasChildren: isDirectory && hasChildren, changedBelow: isDirectory && hasChildren && changedBelow)
    }
    return Situation(record: record, local: local, deleteQueued: deleteQueued, deletedHere: deletedHere)
  }

  struct Situation: Sendable, CustomStringConvertible {
    var record: CloudItem
    var local: RemotePlanner.LocalView?
    var deleteQueued: Bool
    /// This device's delete is done in the cloud; the item's tombstone has this sequence.
    var deletedHere: Int64?
    var description: String {
      "record seq \(record.changeSeq) deleted \(record.deleted), local \(String(describing: local)), "
        + "delete queued \(deleteQueued), deleted here up to \(String(describing: deletedHere))"
    }
  }

  @Test func localWorkIsNeverOverwrittenAndLocalChildrenNeverDropped() async {
    await propertyCheck(count: Self.cases, input: Self.situations) { s in
      let decision = RemotePlanner.decide(
        s.record, local: s.local, deleteQueued: s.deleteQueued, deletedHere: s.deletedHere)
      if s.deleteQueued {
        #expect(decision == .holdBack, "a delete queued here: \(s)")
      }
      if let local = s.local, local.changedHere {
        #expect([.holdBack, .alreadyApplied].contains(decision), "changed here: \(s) -> \(decision)")
      }
      if decision == .delete {
        #expect(s.local?.hasChildren == false, "a folder with local children deleted: \(s)")
      }
      // A folder deleted there is kept only for items changed here; items as the cloud had
      // them leave by their own records, and the tombstone waits for them.
      if decision == .keepFolderAndUploadIt {
        #expect(s.local?.changedBelow == true, "a folder kept for items not changed here: \(s)")
      }
      if decision == .waitForChildren {
        #expect(
          s.record.deleted && s.local?.hasChildren == true && s.local?.changedBelow == false,
          "a tombstone waits with nothing to wait for: \(s)")
      }
      if s.record.deleted, let local = s.local, local.hasChildren, !local.changedHere, !s.deleteQueued,
        !RemotePlanner.hasSeen(s.record, localEtag: local.etag)
      {
        #expect(
          decision == (local.changedBelow ? .keepFolderAndUploadIt : .waitForChildren),
          "a folder deleted there with items here: \(s) -> \(decision)")
      }
      if let local = s.local, let have = local.etag.flatMap({ Int64($0) }), s.record.changeSeq <= have {
        #expect(
          [.alreadyApplied, .holdBack].contains(decision), "a record not newer than the local one: \(s) -> \(decision)")
      }
      if s.local == nil && s.record.deleted && !s.deleteQueued {
        #expect(decision == .alreadyApplied, "the tombstone of an item never seen: \(s)")
      }
      let readBeforeTheDelete = s.deletedHere.map { s.record.changeSeq <= $0 } ?? false
      if s.local == nil && !s.record.deleted && !s.deleteQueued && readBeforeTheDelete {
        #expect(decision == .alreadyApplied, "a version older than this device's delete: \(s)")
      }
      if s.local == nil && !s.record.deleted && !s.deleteQueued && !readBeforeTheDelete {
        #expect(decision == .apply, "a new item, or a newer version of one deleted here: \(s)")
      }
    }
  }

  /// Two items X and Y had one name in the cloud, one after the other. Device 1 has X there and
  /// receives Y; device 2 has Y there and receives X. Both must give the name to the same item:
  /// the one the cloud has there now, with the larger change sequence (the other left it).
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
          holder: RemotePlanner.NameHolder(itemID: holder, unchanged: true, changeSeq: holderSeq, placeFromCloud: true),
          policy: .settle, ownOrphan: false)
        return outcome == .recordYields ? incoming : holder
      }
      let onDevice1 = renamed(holder: "X", holderSeq: sx, incoming: "Y", incomingSeq: sy)
      let onDevice2 = renamed(holder: "Y", holderSeq: sy, incoming: "X", incomingSeq: sx)
      #expect(onDevice1 == onDevice2, "X seq \(sx), Y seq \(sy)")
      #expect(onDevice1 == (sx > sy ? "Y" : "X"), "the item that left the name gives it up")
    }
  }

  /// A holder that is not where its cloud version put it (made, moved or renamed here, or named
  /// by this device's sync) claims the name in a version the cloud has not taken: it yields to
  /// the record's item, which has the name there, whatever the versions and the policy, unless
  /// the record is this device's own for an item it no longer has.
  @Test func aHolderWhosePlaceTheCloudHasNotTakenYields() async {
    let inputs = zip(Gen.int64(in: 1...1000), Gen.int64(in: 1...1000).optional, Gen.bool, Gen.int(in: 0...2))
    await propertyCheck(count: Self.cases, input: inputs) { recordSeq, holderSeq, laterDeleted, policyIndex in
      let r = CloudItem(
        itemID: "there", parentID: WellKnownItem.documents, name: "n", kind: .file, mode: 0o644, size: 0,
        mtimeNs: 1, etag: String(recordSeq), changeSeq: recordSeq)
      let holder = RemotePlanner.NameHolder(
        itemID: "here", unchanged: false, changeSeq: holderSeq, placeFromCloud: false,
        laterInCloud: laterDeleted ? .deleted : nil)
      let policies: [IndexStore.NameCollisionPolicy] = [.settle, .deferUnchangedHolders, .moveAsideHolders(["here"])]
      let policy = policies[policyIndex]
      #expect(RemotePlanner.settleName(record: r, holder: holder, policy: policy, ownOrphan: false) == .holderYields)
      #expect(RemotePlanner.settleName(record: r, holder: holder, policy: policy, ownOrphan: true) == .recordYields)
    }
  }

  /// The cloud gives a name to one item at a time: a holder that is where its cloud version put
  /// it, met by a newer record for that name, left the name in the cloud. The record keeps the
  /// name on every device; the holder follows its held newer record, or yields.
  @Test func aHolderThatLeftTheNameInTheCloudNeverTakesItFromANewerRecord() async {
    let later: [RemotePlanner.LaterVersion?] = [nil, .moved, .deleted]
    let inputs = zip(
      Gen.int64(in: 1...1000), Gen.int64(in: 1...1000), Gen.bool, Gen.int(in: 0...2), Gen.int(in: 0...2))
    await propertyCheck(count: Self.cases, input: inputs) { recordSeq, holderSeq, unchanged, laterIndex, policyIndex in
      let r = CloudItem(
        itemID: "newer", parentID: WellKnownItem.documents, name: "n", kind: .file, mode: 0o644, size: 0,
        mtimeNs: 1, etag: String(recordSeq), changeSeq: recordSeq)
      let holder = RemotePlanner.NameHolder(
        itemID: "here", unchanged: unchanged, changeSeq: holderSeq, placeFromCloud: true,
        laterInCloud: later[laterIndex])
      let policies: [IndexStore.NameCollisionPolicy] = [.settle, .deferUnchangedHolders, .moveAsideHolders(["here"])]
      let outcome = RemotePlanner.settleName(record: r, holder: holder, policy: policies[policyIndex], ownOrphan: false)
      guard holderSeq < recordSeq else { return }
      #expect(outcome != .recordYields, "the record took the name after the holder left it: \(holder), \(outcome)")
      if later[laterIndex] == .moved && !(unchanged && policyIndex != 0) {
        #expect(outcome == .holderFollowsItsRecord, "its newer record says where it went")
      }
    }
  }

  @Test func ownOrphanRecordsNeverTakeALocalName() async {
    let inputs = zip(Gen.int64(in: 1...100), Gen.int64(in: 1...100).optional, Gen.bool)
    await propertyCheck(count: Self.cases, input: inputs) { seq, holderSeq, unchanged in
      let r = CloudItem(
        itemID: "gone", parentID: WellKnownItem.documents, name: "n", kind: .file, mode: 0o644, size: 0, mtimeNs: 1,
        etag: String(seq), changeSeq: seq)
      let holder = RemotePlanner.NameHolder(
        itemID: "here", unchanged: unchanged, changeSeq: holderSeq, placeFromCloud: unchanged)
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

  /// A folder tree for the crossed-move rule, built from a script of small integers so that the
  /// shrinker can simplify it: folders 1...n in the cloud (the base, Synced), folders made here
  /// only, local moves not yet in the cloud, and a remote record that moves folder `dir` into
  /// `target` (valid in the cloud: `target` is not below `dir` there).
  struct CrossedMoves: CustomStringConvertible {
    var parentInCloud: [Int64: Int64] = [:]
    var parentHere: [Int64: Int64] = [:]
    var dir: Int64 = 1
    var target: Int64 = 0
    var localMoves: [(Int64, Int64)] = []

    static func within(_ node: Int64, _ ancestor: Int64, _ parents: [Int64: Int64]) -> Bool {
      var cur: Int64? = node
      var steps = 0
      while let c = cur {
        if c == ancestor || steps > parents.count + 1 { return true }
        steps += 1
        cur = parents[c]
      }
      return false
    }

    /// Nil when the script gives no valid remote move.
    init?(_ script: [Int]) {
      var i = 0
      func next() -> Int {
        defer { i += 1 }
        return i < script.count ? script[i] : 0
      }
      let inCloud = 2 + next() % 9
      let madeHere = next() % 3
      for f in 1...inCloud { parentInCloud[Int64(f)] = Int64(next() % f) }
      parentHere = parentInCloud
      for f in inCloud + 1..<inCloud + 1 + madeHere { parentHere[Int64(f)] = Int64(next() % f) }
      dir = Int64(1 + next() % inCloud)
      target = Int64(next() % (inCloud + 1))
      guard target != dir, !Self.within(target, dir, parentInCloud) else { return nil }
      let all = inCloud + madeHere
      for _ in 0..<(next() % 6) {
        let folder = Int64(1 + next() % all)
        let to = Int64(next() % (all + 1))
        // The record's own folder has no change here (it would be held back), and a move here
        // never puts a folder below itself.
        guard folder != dir, !Self.within(to, folder, parentHere) else { continue }
        parentHere[folder] = to
        localMoves.append((folder, to))
      }
    }

    var description: String {
      "cloud \(parentInCloud.sorted { $0.key < $1.key }), here \(parentHere.sorted { $0.key < $1.key }), "
        + "local moves \(localMoves), remote: \(dir) into \(target)"
    }
  }

  /// Move/move into a cycle, on random trees: the remote move (which the cloud took first)
  /// always wins; only folders moved here, not yet in the cloud, go back to their place in the
  /// cloud; afterwards every folder still reaches the root (no cycle, nothing lost).
  @Test func crossedMovesAreUndoneWithoutLeavingACycleOrAnOrphan() async {
    let scripts = Gen.int(in: 0...99).array(of: 4...40)
    await propertyCheck(count: Self.cases, input: scripts) { script in
      guard let t = CrossedMoves(script) else { return }
      let plan = RemotePlanner.undoCrossedMoves(
        of: t.dir, into: t.target, maxDepth: 64, parentHere: { t.parentHere[$0] },
        parentInCloud: { t.parentInCloud[$0] })
      guard let plan else {
        Issue.record("the loop remains: \(t)")
        return
      }
      if !CrossedMoves.within(t.target, t.dir, t.parentHere) {
        #expect(plan.isEmpty, "nothing crosses, yet \(plan): \(t)")
      }
      Self.checkMovesBack(plan, in: t, then: (t.dir, t.target))
    }
  }

  /// Move/move into a cycle, seen from the device whose move lost: the cloud has folder `dir`
  /// above the parent this device moved it into. While a move of this device's own, not yet in
  /// the cloud, takes a folder on the cloud's chain elsewhere, the planner waits (that move may
  /// break the cycle); otherwise it puts `dir` back where the cloud has it, moving only folders
  /// moved here, each to its place in the cloud, and afterwards every folder still reaches the
  /// root.
  @Test func aMoveTheCloudRefusedAsACycleGoesBackWithoutLeavingACycleOrAnOrphan() async {
    let scripts = Gen.int(in: 0...99).array(of: 6...40)
    await propertyCheck(count: Self.cases, input: scripts) { script in
      guard var t = CrossedMoves(script) else { return }
      // This device's own move of `dir` (the record's folder in the generated tree): into a
      // folder that is below `dir` in the cloud, and not below it here.
      let candidates = t.parentInCloud.keys.sorted().filter {
        $0 != t.dir && CrossedMoves.within($0, t.dir, t.parentInCloud)
          && !CrossedMoves.within($0, t.dir, t.parentHere) && t.parentHere[t.dir] != $0
      }
      guard !candidates.isEmpty else { return }
      let into = candidates[script[0] % candidates.count]
      t.parentHere[t.dir] = into
      // The other local moves are still queued in some runs, refused as cycles themselves in
      // others.
      let live = script[1] % 4 == 0
      let movedHere = { (folder: Int64) in
        live && t.localMoves.contains { $0.0 == folder } && t.parentHere[folder] != t.parentInCloud[folder]
      }
      let plan = RemotePlanner.undoRefusedMove(
        of: t.dir, maxDepth: 64, parentHere: { t.parentHere[$0] }, parentInCloud: { t.parentInCloud[$0] },
        movedHere: movedHere)
      var chainMovedHere = false
      var cur = into
      while cur != t.dir {
        if movedHere(cur) { chainMovedHere = true }
        cur = t.parentInCloud[cur]!
      }
      guard let plan else {
        #expect(chainMovedHere, "the move was not undone, with no move of this device's on the chain: \(t)")
        return
      }
      #expect(!chainMovedHere, "undone while a move of this device's on the chain may still break the cycle: \(t)")
      #expect(plan.last?.folder == t.dir && plan.last?.backTo == t.parentInCloud[t.dir], "\(plan): \(t)")
      Self.checkMovesBack(plan, in: t, then: nil)
    }
  }

  /// Checks a plan of folders put back: each was moved here, goes where the cloud has it, and
  /// only once; after the plan and the move `then`, every folder still reaches the root.
  static func checkMovesBack(
    _ plan: [(folder: Int64, backTo: Int64)], in t: CrossedMoves, then move: (Int64, Int64)?
  ) {
    var after = t.parentHere
    for step in plan {
      #expect(after[step.folder] != t.parentInCloud[step.folder], "\(step.folder) was not moved here: \(t)")
      #expect(
        step.backTo == t.parentInCloud[step.folder], "\(step.folder) goes elsewhere than the cloud has it: \(t)")
      after[step.folder] = step.backTo
    }
    #expect(Set(plan.map(\.folder)).count == plan.count, "a folder moved twice: \(plan) \(t)")
    if let (folder, into) = move { after[folder] = into }
    for folder in after.keys {
      var cur = folder
      var steps = 0
      while cur != 0 && steps <= after.count {
        cur = after[cur] ?? -1
        steps += 1
      }
      #expect(cur == 0, "folder \(folder) no longer reaches the root after \(plan): \(t)")
    }
  }
}
