import Foundation
import PropertyBased
import Testing

@testable import UbiqCore
@testable import UbiqIndex

/// The whole-tree comparison (`SyncAudit.compare`) on generated trees: a cloud tree of files
/// and folders, a device that mirrors it, and on each item one of the ways the two can
/// differ. The comparison must name exactly the items that differ, each with its problem,
/// tell what sync is still working on from a fault, and pick the repair that mends it.
@Suite struct SyncAuditTests {
  static let cases = Int(ProcessInfo.processInfo.environment["UBIQ_PLANNER_CASES"] ?? "") ?? 20_000

  /// How one item differs, and what the comparison must say of it.
  enum Twist: Int, CaseIterable, Sendable {
    case none, changedHere, deleteQueued, notPulledYet, heldBack, missedChange, missedDelete, missingHere,
      tombstoneNotHere, missingInCloud, neverQueued, modeDiffers, nameDiffers, localOnly

    var expected: SyncAudit.Problem? {
      switch self {
      case .none, .tombstoneNotHere, .localOnly: return nil
      case .changedHere, .deleteQueued: return .changedHere
      case .notPulledYet: return .notPulledYet
      case .heldBack: return .heldBack
      case .missedChange, .missedDelete: return .missedChange
      case .missingHere: return .missingHere
      case .missingInCloud: return .missingInCloud
      case .neverQueued: return .neverQueued
      case .modeDiffers: return .differs(["mode"])
      case .nameDiffers: return .differs(["name"])
      }
    }
  }

  /// Items (a twist and a folder among the earlier items, or the documents folder) and the token.
  static let trees = zip(
    zip(Gen.int(in: 0...(Twist.allCases.count - 1)), Gen.int(in: 0...40), Gen.bool).array(of: 1...30),
    Gen.int64(in: 100...200)
  )

  struct World {
    var local: SyncAudit.LocalSnapshot
    var remote: [CloudItem]
    var expected: [String: SyncAudit.Problem]
  }

  /// The cloud and the device for generated items. Folders whose twist takes them away on one
  /// side carry no items, so each item's twist is the only difference.
  static func world(_ items: [(Int, Int, Bool)], token: Int64) -> World {
    let documents = CloudItem(
      itemID: WellKnownItem.documents, parentID: WellKnownItem.root, name: "Documents", kind: .directory,
      mode: 0o755, size: 0, mtimeNs: 0, etag: "d", changeSeq: 1)
    var remote: [CloudItem] = [documents]
    var local = SyncAudit.LocalSnapshot(token: token, items: [:])
    local.items[documents.itemID] = localItem(documents, path: "Documents")
    var expected: [String: SyncAudit.Problem] = [:]
    var folders: [(id: String, path: String)] = [(documents.itemID, "Documents")]
    for (n, (twistNumber, parentPick, isFolder)) in items.enumerated() {
      let twist = Twist(rawValue: twistNumber)!
      let parent = folders[parentPick % folders.count]
      let id = "item-\(n)"
      let seq = Int64(2 + n)
      let record = CloudItem(
        itemID: id, parentID: parent.id, name: "n\(n)", kind: isFolder ? .directory : .file, mode: 0o644,
        size: isFolder ? 0 : Int64(n), mtimeNs: 0, etag: "e\(n)", changeSeq: seq)
      let path = parent.path + "/n\(n)"
      var here: SyncAudit.LocalItem? = localItem(record, path: path)
      var there: CloudItem? = record
      switch twist {
      case .none: break
      case .changedHere: here?.changedHere = true
      case .deleteQueued:
        here = nil
        local.queuedDeletes.insert(id)
      case .notPulledYet:
        there?.etag = "newer"
        there?.changeSeq = token + 1
      case .heldBack:
        there?.etag = "newer"
        local.heldBack.insert(id)
      case .missedChange: there?.etag = "newer"
      case .missedDelete:
        there?.etag = "newer"
        there?.deleted = true
      case .missingHere: here = nil
      case .tombstoneNotHere:
        here = nil
        there?.deleted = true
      case .missingInCloud: there = nil
      case .neverQueued:
        there = nil
        here?.etag = nil
      case .modeDiffers: here?.mode = 0o600
      case .nameDiffers: here?.name = "other"
      case .localOnly:
        there = nil
        here = nil
        local.localOnly.insert(id)
      }
      if let here { local.items[id] = here }
      if let there { remote.append(there) }
      if let problem = twist.expected { expected[id] = problem }
      // Only a folder both sides have, where both say, holds later items.
      if isFolder && [.none, .changedHere, .heldBack, .missedChange, .modeDiffers, .notPulledYet].contains(twist) {
        folders.append((id, path))
      }
    }
    return World(local: local, remote: remote, expected: expected)
  }

  static func localItem(_ r: CloudItem, path: String) -> SyncAudit.LocalItem {
    SyncAudit.LocalItem(
      itemID: r.itemID, parentID: r.parentID, name: r.name, kind: r.kind, mode: r.mode, size: r.size,
      symlinkTarget: r.symlinkTarget, etag: r.etag, changedHere: false, path: path)
  }

  @Test func everyDifferenceIsNamedWithItsProblemAndRepair() async {
    await propertyCheck(count: Self.cases, input: Self.trees) { items, token in
      let w = Self.world(items, token: token)
      let findings = SyncAudit.compare(local: w.local, remote: w.remote)
      let found = Dictionary(findings.map { ($0.itemID, $0.problem) }, uniquingKeysWith: { a, _ in a })
      #expect(found.count == findings.count, "an item named twice: \(findings)")
      #expect(found == w.expected, "items \(items), token \(token)")
      for f in findings {
        #expect(!f.path.isEmpty && !f.path.contains("?"), "\(f)")
        #expect((f.problem.repair != nil) == f.problem.isFault, "\(f.problem)")
      }
    }
  }

  /// A device that mirrors the cloud, local-only items aside, has nothing to report, in
  /// whatever order the cloud lists its items and however often (a page read twice).
  @Test func aMirrorHasNothingToReport() async {
    await propertyCheck(count: Self.cases / 4, input: Self.trees) { items, token in
      let w = Self.world(
        items.map { ($0.0 % 2 == 0 ? Twist.none.rawValue : Twist.localOnly.rawValue, $0.1, $0.2) }, token: token)
      let remote = w.remote.reversed() + w.remote.prefix(3)
      #expect(SyncAudit.compare(local: w.local, remote: Array(remote)).isEmpty)
    }
  }

  /// Of two versions of an item in the listing, the later change counts.
  @Test func theLatestVersionOfAnItemCounts() {
    let old = CloudItem(
      itemID: "i", parentID: WellKnownItem.documents, name: "f", kind: .file, mode: 0o644, size: 0, mtimeNs: 0,
      etag: "1", changeSeq: 5)
    var new = old
    new.etag = "2"
    new.changeSeq = 9
    let here = Self.localItem(new, path: "Documents/f")
    let local = SyncAudit.LocalSnapshot(token: 10, items: ["i": here])
    #expect(SyncAudit.compare(local: local, remote: [new, old]).isEmpty)
    #expect(SyncAudit.compare(local: local, remote: [old, new]).isEmpty)
  }
}
