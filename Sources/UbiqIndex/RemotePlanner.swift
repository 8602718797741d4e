import UbiqCore

/// The decisions of applying one remote record, as pure functions of the three views of an item
/// on this device (see docs/architecture.md, "Three trees and the rules for concurrent
/// changes"): the record (Remote), the local row with its revisions (Local against Synced) and
/// what is still queued. No I/O: `IndexStore.applyRemote` reads the views inside its transaction,
/// asks the planner, and carries the answer out. Tests run the rules on generated views
/// (Tests/UbiqIndexTests/RemotePlannerTests).
public enum RemotePlanner {
  /// This device's view of the item a remote record is for.
  public struct LocalView: Sendable, Equatable {
    /// The etag of the cloud version the row derives from (nil: never in the cloud).
    public var etag: String?
    public var isDirectory: Bool
    /// A queue entry or unrecorded writes through a handle: the item changed here.
    public var changedHere: Bool
    /// Live children of a folder (the record may be its tombstone).
    public var hasChildren: Bool
    /// An item below the folder changed here (made or moved here, edited, queued): deleting the
    /// folder would lose it.
    public var changedBelow: Bool

    public init(etag: String?, isDirectory: Bool, changedHere: Bool, hasChildren: Bool, changedBelow: Bool = false) {
      self.etag = etag
      self.isDirectory = isDirectory
      self.changedHere = changedHere
      self.hasChildren = hasChildren
      self.changedBelow = changedBelow
    }
  }

  /// What to do with one remote record.
  public enum Decision: Sendable, Equatable {
    /// This device has the version already, or a newer one (a held record passed by its own
    /// upload), or the record is the tombstone of an item it never had.
    case alreadyApplied
    /// The item changed here (or its delete is queued): keep the record for when the local
    /// change is done; never overwrite local work.
    case holdBack
    /// A folder deleted there still holds items changed here: keep it, and upload it again (the
    /// children must not be lost).
    case keepFolderAndUploadIt
    /// A folder deleted there still holds items here, all as the cloud had them. The cloud
    /// deletes no folder that still has items, so each of them was moved or deleted there
    /// first; when a later change of it replaced that record in the feed, the record comes
    /// after the folder's tombstone. The tombstone waits for them (retried in the pull, then
    /// held); deleting the folder now would lose them, keeping it would bring it back.
    case waitForChildren
    /// Delete the local item.
    case delete
    /// Make the local row match the record (`IndexStore.applyRecord`).
    case apply
  }

  /// The rule for one record. `deleteQueued`: this device deleted the item and the delete is
  /// not in the cloud yet. `deletedHere`: this device deleted the item, the cloud did too, and
  /// the item's tombstone has this change sequence; a record not newer was read before the
  /// delete was done (a page the pull was still applying) and is stale.
  public static func decide(
    _ record: CloudItem, local: LocalView?, deleteQueued: Bool, deletedHere: Int64?
  ) -> Decision {
    if deleteQueued { return .holdBack }
    if local == nil, let tombstone = deletedHere, record.changeSeq <= tombstone { return .alreadyApplied }
    if let local {
      if hasSeen(record, localEtag: local.etag) { return .alreadyApplied }
      if local.changedHere { return .holdBack }
    }
    guard record.deleted else { return .apply }
    guard let local else { return .alreadyApplied }
    guard local.hasChildren else { return .delete }
    return local.changedBelow ? .keepFolderAndUploadIt : .waitForChildren
  }

  /// True if the local row is at `record`'s version or a newer one (its etag is the record's,
  /// or a later change sequence): the record changes nothing, whatever else is known.
  public static func hasSeen(_ record: CloudItem, localEtag: String?) -> Bool {
    if localEtag == record.etag { return true }
    if let seq = localEtag.flatMap({ Int64($0) }), record.changeSeq < seq { return true }
    return false
  }

  /// The moves that make room for folder `dir` to move into `target` (a remote record) when
  /// `target` is below `dir` here: a move made on this device, not yet in the cloud, crossed the
  /// cloud's move, and the cloud took the other one first. Folders on the way up from `target`
  /// whose place here is a local move go back to their place in the cloud (the nearest to
  /// `target` first), one at a time, until `target` is no longer below `dir`. A folder whose
  /// place in the cloud is below it here first makes room for itself the same way. Empty:
  /// nothing crosses. Nil: the loop remains with nothing local to undo.
  /// `parentHere`: a folder's parent on this device (Local); `parentInCloud`: its parent where
  /// the cloud last said it is (its base, or a newer record held back), nil if it has none here. Each folder goes back at most once, so the walk
  /// ends; chains longer than `maxDepth` count as a loop.
  public static func undoCrossedMoves(
    of dir: Int64, into target: Int64, maxDepth: Int, parentHere: (Int64) throws -> Int64?,
    parentInCloud: (Int64) throws -> Int64?
  ) rethrows -> [(folder: Int64, backTo: Int64)]? {
    var undone: [Int64: Int64] = [:]
    var plan: [(folder: Int64, backTo: Int64)] = []
    /// Folders making room for themselves now: not tried again further down.
    var makingRoom: Set<Int64> = []
    func parent(_ node: Int64) throws -> Int64? { try undone[node] ?? parentHere(node) }
    func isWithin(_ node: Int64, _ ancestor: Int64) throws -> Bool {
      var cur: Int64? = node
      var depth = 0
      while let c = cur {
        if c == ancestor || depth > maxDepth { return true }
        depth += 1
        cur = try parent(c)
      }
      return false
    }
    /// Undoes moves until `target` is not below `dir`; false if it stays below.
    func makeRoom(for dir: Int64, in target: Int64) throws -> Bool {
      makingRoom.insert(dir)
      defer { makingRoom.remove(dir) }
      while plan.count <= maxDepth {
        // The chain from `target` up to `dir`, if `target` is below `dir`.
        var chain: [Int64] = []
        var cur: Int64? = target
        while let c = cur, c != dir {
          if chain.count > maxDepth { return false }
          chain.append(c)
          cur = try parent(c)
        }
        guard cur == dir else { return true }
        var found = false
        for folder in chain where undone[folder] == nil && !makingRoom.contains(folder) {
          guard let back = try parentInCloud(folder), try back != parent(folder) else { continue }
          if try isWithin(back, folder) {
            guard try makeRoom(for: folder, in: back), try !isWithin(back, folder) else { continue }
          }
          undone[folder] = back
          plan.append((folder, back))
          found = true
          break
        }
        if !found { return false }
      }
      return false
    }
    return try makeRoom(for: dir, in: target) ? plan : nil
  }

  /// The moves that undo this device's move of folder `dir`, which the cloud refused because
  /// the new parent is below `dir` there: another device's move crossed it and the cloud took
  /// that one first, so this one loses. `dir` goes back to its place in the cloud, after the
  /// folders that must make room for it there (`undoCrossedMoves`), last in the list. Nil
  /// (try again later) while the cycle is not known here (the pull that brings the other move
  /// has not run), while a move of this device's own not yet in the cloud (`movedHere`) takes a
  /// folder on the cloud's chain elsewhere and may still break the cycle (queue order is not the
  /// order of the user's moves: `mv A A2; mv A2/B B; mv A2 B/` queues A first), or when `dir` is
  /// where the cloud has it. `parentHere` and `parentInCloud` are as in `undoCrossedMoves`.
  public static func undoRefusedMove(
    of dir: Int64, maxDepth: Int, parentHere: (Int64) throws -> Int64?, parentInCloud: (Int64) throws -> Int64?,
    movedHere: (Int64) throws -> Bool
  ) rethrows -> [(folder: Int64, backTo: Int64)]? {
    guard let here = try parentHere(dir), let back = try parentInCloud(dir), back != here else { return nil }
    // The cloud's chain from the new parent up to `dir`.
    var node = here
    var depth = 0
    while node != dir {
      guard depth <= maxDepth, try !movedHere(node), let up = try parentInCloud(node) else { return nil }
      node = up
      depth += 1
    }
    guard
      let room = try undoCrossedMoves(
        of: dir, into: back, maxDepth: maxDepth, parentHere: parentHere, parentInCloud: parentInCloud)
    else { return nil }
    return room + [(dir, back)]
  }

  /// The item that holds, on this device, the name a remote record wants.
  public struct NameHolder: Sendable, Equatable {
    public var itemID: String
    /// In the cloud as it is here: an etag, no local revision, nothing queued.
    public var unchanged: Bool
    /// The change sequence of the holder's cloud version (nil: never in the cloud).
    public var changeSeq: Int64?
    /// The holder is where its cloud version put it (no move or rename made here).
    public var placeFromCloud: Bool
    /// What a newer record of the holder, held here, does with it (nil: none is held).
    public var laterInCloud: LaterVersion?

    public init(
      itemID: String, unchanged: Bool, changeSeq: Int64?, placeFromCloud: Bool, laterInCloud: LaterVersion? = nil
    ) {
      self.itemID = itemID
      self.unchanged = unchanged
      self.changeSeq = changeSeq
      self.placeFromCloud = placeFromCloud
      self.laterInCloud = laterInCloud
    }
  }

  /// A newer version of a name holder that this device holds back (its local changes wait to
  /// be merged with it).
  public enum LaterVersion: Sendable, Equatable {
    /// It is somewhere else in the cloud.
    case moved
    /// It is deleted in the cloud.
    case deleted
  }

  /// How a name collision is settled.
  public enum NameOutcome: Sendable, Equatable {
    /// Apply the record later (the holder's own record may come in the same pull).
    case deferRecord
    /// The holder moves to a temporary local name until its own record, in this pull, is applied.
    case parkHolder
    /// The holder goes where its held newer record puts it (the name there is free once the
    /// record is applied, as in a swap), and the record takes the name.
    case holderFollowsItsRecord
    /// The holder becomes "name 2" (and uploads that), the record takes the name.
    case holderYields
    /// The holder, which left the name in the cloud, takes "name 2" here until its merge with
    /// its cloud version: a place no user chose, so the cloud's place wins there.
    case holderStepsAside
    /// The record's item becomes "name 2" here (and uploads that).
    case recordYields
  }

  /// The rule when a record's name is held by another item: the item whose claim on the name
  /// reached the cloud later (or has not yet) yields, so every device, whatever order it sees
  /// the records in and whether it commits or reads the feed first, gives the name to the same
  /// item. `ownOrphan`: the record is this device's own commit for an item it no longer has; it
  /// never takes a name from a local item.
  ///
  /// The cloud gives a name in a folder to one item at a time. A holder that is not where its
  /// cloud version put it (made, moved or renamed here, or named by this device's sync) claims
  /// the name in a version the cloud has not taken: the record's item has the name there, and
  /// the holder yields as "name 2", which is what the cloud would answer its commit. A holder
  /// where its cloud version put it, met by a newer record, left the name in the cloud (moved or
  /// deleted; `mv a t; mv b a; mv t b` elsewhere). The name is the record's; the holder goes
  /// where its held newer record puts it (`laterInCloud`, which a temporary "(moving ...)" name
  /// does not tell), or steps aside as "name 2" where that is not known here or that place is
  /// taken. Either place is the cloud's, not a user's: the merge of the holder's own changes
  /// with its cloud version takes the cloud's place. Met by an older record, the holder has the
  /// name in the cloud now, and the record yields.
  public static func settleName(
    record: CloudItem, holder: NameHolder, policy: IndexStore.NameCollisionPolicy, ownOrphan: Bool
  ) -> NameOutcome {
    if case .deferUnchangedHolders = policy, holder.unchanged { return .deferRecord }
    if case .moveAsideHolders(let moving) = policy, holder.unchanged, moving.contains(holder.itemID) {
      return .parkHolder
    }
    if !holder.placeFromCloud { return ownOrphan ? .recordYields : .holderYields }
    let holderSeq = holder.changeSeq ?? Int64.max
    if holderSeq < record.changeSeq && !ownOrphan {
      switch holder.laterInCloud {
      case .moved: return .holderFollowsItsRecord
      case .deleted: return .holderStepsAside
      case nil:
        // Its newer record may come later in this pull (on a later page, when it changed
        // again); once the whole feed is read, it steps aside.
        if case .settle = policy { return .holderStepsAside }
        return .deferRecord
      }
    }
    return .recordYields
  }
}
