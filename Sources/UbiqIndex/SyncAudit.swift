import UbiqCore

/// The whole-tree comparison of one device with the cloud (`ubiqfs check`): every item of the
/// cloud's tree (Remote: each item's latest version, tombstones included), of this device's
/// index (Local, with what is still queued or held) and its bases (Synced, through the etags),
/// compared at once, with no I/O. It names each item on which the two disagree, and says
/// whether sync is still working on it (a change queued here, a record not pulled yet or held
/// back) or whether nothing left would make them agree (a fault), and what repairs a fault.
/// Tests: Tests/UbiqIndexTests/SyncAuditTests, and the simulation, which checks that every
/// device agrees with the cloud in full once quiet.
public enum SyncAudit {
  /// One item as this device's index has it.
  public struct LocalItem: Sendable, Equatable {
    public var itemID: String
    /// The cloud id of its folder (nil for the container's root).
    public var parentID: String?
    public var name: String
    public var kind: ItemKind
    public var mode: UInt32
    public var size: Int64
    public var symlinkTarget: String?
    /// The etag of the cloud version the row derives from (nil: never uploaded).
    public var etag: String?
    /// A queue entry, or bytes written through a handle and not recorded yet: what the pull's
    /// rules count as changed here (`RemotePlanner.LocalView.changedHere`). A local revision
    /// the cloud has not confirmed with neither is a change no upload will send.
    public var changedHere: Bool
    /// Where the mount shows it, for the report.
    public var path: String

    public init(
      itemID: String, parentID: String?, name: String, kind: ItemKind, mode: UInt32, size: Int64,
      symlinkTarget: String?, etag: String?, changedHere: Bool, path: String
    ) {
      self.itemID = itemID
      self.parentID = parentID
      self.name = name
      self.kind = kind
      self.mode = mode
      self.size = size
      self.symlinkTarget = symlinkTarget
      self.etag = etag
      self.changedHere = changedHere
      self.path = path
    }
  }

  /// What one device's index holds, read in one transaction.
  public struct LocalSnapshot: Sendable, Equatable {
    /// The change token: every cloud change up to it was applied, held or refused.
    public var token: Int64
    /// The items that have, or may get, a cloud identity (local-only items are left out).
    public var items: [String: LocalItem]
    /// Items whose delete is queued.
    public var queuedDeletes: Set<String>
    /// Items with a record held back (the item changed here, its folder is not here) or refused.
    public var heldBack: Set<String>
    /// Local-only items (`.nosync`, excluded) and those below them: the cloud has none of them.
    public var localOnly: Set<String>

    public init(
      token: Int64, items: [String: LocalItem], queuedDeletes: Set<String> = [], heldBack: Set<String> = [],
      localOnly: Set<String> = []
    ) {
      self.token = token
      self.items = items
      self.queuedDeletes = queuedDeletes
      self.heldBack = heldBack
      self.localOnly = localOnly
    }
  }

  /// How an item differs between this device and the cloud.
  public enum Problem: Sendable, Equatable, CustomStringConvertible {
    /// Changed here (or deleted here) and not confirmed by the cloud yet: the uploader sends it.
    case changedHere
    /// Changed in the cloud after this device's change token: the next pull brings it.
    case notPulledYet
    /// Its record is held back or was refused (`ubiqfs status` says why).
    case heldBack
    /// The cloud has a newer version or its tombstone, from before the token, that was never
    /// applied here, and nothing changed here.
    case missedChange
    /// Live in the cloud since before the token, and not here.
    case missingHere
    /// Uploaded from here once, and the cloud has no version of it at all.
    case missingInCloud
    /// Never uploaded and not queued: no upload will ever send it.
    case neverQueued
    /// The same version on both sides, nothing changed here, and yet these fields differ.
    case differs([String])

    /// Nothing in sync's way will make the two sides agree.
    public var isFault: Bool {
      switch self {
      case .changedHere, .notPulledYet, .heldBack: return false
      default: return true
      }
    }

    /// What mends a fault: nil for a difference sync is still working on.
    public var repair: Repair? {
      switch self {
      case .changedHere, .notPulledYet, .heldBack: return nil
      case .missedChange, .missingHere: return .pullAgain
      case .neverQueued: return .upload
      case .differs: return .merge
      case .missingInCloud: return .uploadAsNew
      }
    }

    public var description: String {
      switch self {
      case .changedHere: return "changed here, not uploaded yet"
      case .notPulledYet: return "changed in the cloud, not pulled yet"
      case .heldBack: return "its change from the cloud is held back or refused (see ubiqfs status)"
      case .missedChange: return "the cloud has a newer version that was never applied here"
      case .missingHere: return "in the cloud, missing here"
      case .missingInCloud: return "uploaded once, missing in the cloud"
      case .neverQueued: return "never uploaded and not queued"
      case .differs(let fields): return "differs from the cloud's version in \(fields.joined(separator: ", "))"
      }
    }
  }

  /// How a fault is mended.
  public enum Repair: String, Sendable, Equatable {
    /// Read the whole change feed again from its start; each record goes through the rules of
    /// the pull, which apply what this device missed.
    case pullAgain
    /// Queue the upload of the item as it is here.
    case upload
    /// Forget the cloud version the item was based on and upload it as a new item.
    case uploadAsNew
    /// Upload it merged with the cloud's version as if both sides had changed it since an
    /// unknown base: which side went wrong is not known, so the local place, mode and
    /// attributes are taken and both contents are kept (the older as a conflict version).
    case merge
  }

  public struct Finding: Sendable, Equatable {
    public var itemID: String
    public var path: String
    public var problem: Problem
  }

  /// Every item on which this device and the cloud disagree, in path order. `remote`: every
  /// item of the container as the cloud has it now (read after `local`).
  public static func compare(local: LocalSnapshot, remote: [CloudItem]) -> [Finding] {
    var cloud: [String: CloudItem] = [:]
    for r in remote {
      if let seen = cloud[r.itemID], seen.changeSeq >= r.changeSeq { continue }
      cloud[r.itemID] = r
    }
    var findings: [Finding] = []
    for id in Set(cloud.keys).union(local.items.keys) where !local.localOnly.contains(id) {
      let here = local.items[id]
      let there = cloud[id]
      guard let problem = problem(here: here, there: there, id: id, local: local) else { continue }
      let path = here?.path ?? there.map { cloudPath($0, in: cloud) } ?? id
      findings.append(Finding(itemID: id, path: path, problem: problem))
    }
    return findings.sorted { ($0.path, $0.itemID) < ($1.path, $1.itemID) }
  }

  static func problem(here: LocalItem?, there: CloudItem?, id: String, local: LocalSnapshot) -> Problem? {
    let live = there.map { !$0.deleted } ?? false
    if here == nil && !live { return nil }
    if let here, let there, !there.deleted, here.etag == there.etag, !here.changedHere,
      !local.queuedDeletes.contains(id), fieldsThatDiffer(here, there).isEmpty
    {
      return nil
    }
    if local.heldBack.contains(id) { return .heldBack }
    if here?.changedHere == true || local.queuedDeletes.contains(id) { return .changedHere }
    if let there, there.changeSeq > local.token { return .notPulledYet }
    guard let here else { return .missingHere }
    guard let there else { return here.etag == nil ? .neverQueued : .missingInCloud }
    if there.deleted || here.etag != there.etag { return .missedChange }
    return .differs(fieldsThatDiffer(here, there))
  }

  /// The fields of the same version that differ between the index and the cloud.
  static func fieldsThatDiffer(_ here: LocalItem, _ there: CloudItem) -> [String] {
    var out: [String] = []
    if here.parentID != there.parentID { out.append("folder") }
    if here.name != there.name { out.append("name") }
    if here.kind != there.kind { out.append("kind") }
    if here.mode & 0o7777 != there.mode & 0o7777 { out.append("mode") }
    if here.kind == .file && here.size != there.size { out.append("size") }
    if here.kind == .symlink && here.symlinkTarget != there.symlinkTarget { out.append("symlink target") }
    return out
  }

  /// An item's path in the cloud's tree from the container's root, as the index gives paths
  /// ("?" for a folder that is not there; at most 256 levels, so a cycle a cloud let through
  /// ends).
  static func cloudPath(_ item: CloudItem, in cloud: [String: CloudItem]) -> String {
    var parts = [item.name]
    var parent = item.parentID
    while let id = parent, id != WellKnownItem.root, parts.count <= 256 {
      guard let folder = cloud[id] else {
        parts.append("?")
        break
      }
      parts.append(folder.name)
      parent = folder.parentID
    }
    return parts.reversed().joined(separator: "/")
  }
}
