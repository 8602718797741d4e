import Foundation
import UbiqCloudAPI
import UbiqCore

/// One break of the tree invariants found in stored data.
public struct TreeProblem: Sendable, Equatable, CustomStringConvertible {
  /// What is wrong with the item's place.
  public enum Kind: String, Sendable {
    /// The parent record does not exist.
    case orphan
    /// The parent is a tombstone.
    case parentDeleted = "parent-deleted"
    /// The parent is a file or a symlink.
    case parentNotDirectory = "parent-not-directory"
    /// The item is on a loop of parents (`members` lists the loop).
    case cycle
    /// Another live item of the same parent has the same name (`members`: all of them).
    case duplicateName = "duplicate-name"
    /// The name is one no cloud item may have (`ItemName.validateInCloud`).
    case badName = "bad-name"
  }
  public var kind: Kind
  /// The item a repair changes: moved to lost+found, or (duplicate names) renamed.
  public var itemID: String
  public var members: [String]

  public var description: String {
    switch kind {
    case .cycle: return "cycle: \(members.joined(separator: " -> ")) (repair moves \(itemID) to lost+found)"
    case .duplicateName: return "duplicate-name: \(members.joined(separator: ", ")) (repair renames \(itemID))"
    case .badName: return "bad-name: \(itemID) (repair renames it)"
    default: return "\(kind.rawValue): \(itemID)"
    }
  }
}

/// The result of checking (and maybe repairing) one container.
public struct TreeReport: Sendable {
  public var problems: [TreeProblem]
  /// How many problems a repair fixed (0 without `repair`).
  public var repaired: Int
}

extension CloudEngine {
  /// The name of the folder in Documents that repairs move misplaced items into.
  public static let lostAndFoundName = "lost+found"

  /// Every break of the tree invariants in the container's stored records (the newest
  /// version of each item): live items under a missing, deleted or non-directory parent, loops
  /// of parents, names no cloud item may have, live namesakes in one folder.
  public static func treeProblems(_ items: [CloudItem]) -> [TreeProblem] {
    var byID: [String: CloudItem] = [:]
    for i in items { byID[i.itemID] = i }
    let live = items.filter { !$0.deleted && $0.itemID != WellKnownItem.root }.sorted { $0.itemID < $1.itemID }
    var problems: [TreeProblem] = []
    for i in live {
      guard let parentID = i.parentID, let parent = byID[parentID] else {
        problems.append(TreeProblem(kind: .orphan, itemID: i.itemID, members: [i.itemID]))
        continue
      }
      if parent.deleted {
        problems.append(TreeProblem(kind: .parentDeleted, itemID: i.itemID, members: [i.itemID]))
      } else if parent.kind != .directory {
        problems.append(TreeProblem(kind: .parentNotDirectory, itemID: i.itemID, members: [i.itemID]))
      }
    }
    // Loops of parents: walk up from every item, remembering which walks already ended well.
    var settled = Set<String>()
    var reported = Set<String>()
    for i in live where !settled.contains(i.itemID) {
      var path: [String] = []
      var onPath: [String: Int] = [:]
      var next: String? = i.itemID
      while let id = next, !settled.contains(id), let item = byID[id] {
        if let start = onPath[id] {
          let loop = Array(path[start...])
          if reported.isDisjoint(with: loop) {
            reported.formUnion(loop)
            let first = loop.min()!
            let rotated = Array(loop[loop.firstIndex(of: first)!...] + loop[..<loop.firstIndex(of: first)!])
            problems.append(TreeProblem(kind: .cycle, itemID: first, members: rotated))
          }
          break
        }
        onPath[id] = path.count
        path.append(id)
        next = item.parentID
      }
      settled.formUnion(path)
    }
    for i in live where !ItemName.isValidInCloud(i.name) {
      problems.append(TreeProblem(kind: .badName, itemID: i.itemID, members: [i.itemID]))
    }
    // Namesakes: the item that reached the cloud first keeps the name, as on the clients. Names
    // are compared byte for byte, as the stores and the mounts do ("café" in NFC and in NFD are
    // two names), not as Swift strings, which are equal when canonically equivalent.
    var byPlace: [Place: [CloudItem]] = [:]
    for i in live { byPlace[Place(parentID: i.parentID, name: Array(i.name.utf8)), default: []].append(i) }
    let groups = byPlace.values.map { $0.sorted { $0.changeSeq < $1.changeSeq } }
    for ordered in groups.sorted(by: { $0[0].changeSeq < $1[0].changeSeq }) where ordered.count > 1 {
      for later in ordered.dropFirst() {
        problems.append(TreeProblem(kind: .duplicateName, itemID: later.itemID, members: ordered.map(\.itemID)))
      }
    }
    return problems
  }

  /// Every stored record of a container (newest version of each item, tombstones included).
  public func allItems(_ container: ContainerID) async throws -> [CloudItem] {
    var out: [CloudItem] = []
    var since: Int64 = 0
    while true {
      let batch = try await metadata.storedChanges(
        account: account, container: container.rawValue, since: since, limit: 5000, maxBytes: .max
      ).decoded()
      out += batch.items
      since = batch.token
      if !batch.hasMore { return out }
    }
  }

  /// Checks a container's tree; with `repair`, moves every item under a missing, deleted or
  /// non-directory parent, and one member of every loop, into `Documents/lost+found`, gives
  /// later namesakes a free "name N" name, and an item whose name no cloud item may have a
  /// valid one (`ItemName.repaired`). Nothing is deleted. Each repair is an ordinary
  /// commit (If-Match on the record it read), so clients pick it up from the change feed.
  public func checkTree(_ container: ContainerID, repair: Bool, deviceID: String = "server-check") async throws
    -> TreeReport
  {
    let items = try await allItems(container)
    let problems = Self.treeProblems(items)
    guard repair, !problems.isEmpty else { return TreeReport(problems: problems, repaired: 0) }
    var byID: [String: CloudItem] = [:]
    for i in items { byID[i.itemID] = i }
    var repaired = 0
    var lostAndFound: CloudItem? = nil
    for p in problems {
      guard let item = try await metadata.item(account: account, container: container.rawValue, itemID: p.itemID)
      else { continue }
      var moved = item
      moved.setWriter(deviceID, contentAuthor: item.contentAuthor)
      // Every repair leaves the item a name a cloud item may have.
      let name = ItemName.isValidInCloud(item.name) ? item.name : ItemName.repaired(item.name)
      if p.kind == .duplicateName || p.kind == .badName {
        moved.name = try await freeName(container, parentID: item.parentID ?? WellKnownItem.documents, name)
      } else {
        if lostAndFound == nil { lostAndFound = try await ensureLostAndFound(container, deviceID: deviceID) }
        moved.parentID = lostAndFound!.itemID
        moved.name = try await freeName(container, parentID: lostAndFound!.itemID, name)
      }
      // A move keeps the record's chunks: nothing for a collection pass to race with.
      _ = try await metadata.commit(
        account: account, container: container.rawValue, item: moved, ifMatch: item.etag, chunks: [],
        rule: Self.treeRule(for: moved))
      repaired += 1
    }
    return TreeReport(problems: problems, repaired: repaired)
  }

  /// `Documents/lost+found`: the live folder of that name, or a new one.
  func ensureLostAndFound(_ container: ContainerID, deviceID: String) async throws -> CloudItem {
    let items = try await allItems(container)
    if let existing = items.first(where: {
      !$0.deleted && $0.parentID == WellKnownItem.documents && $0.name == Self.lostAndFoundName
        && $0.kind == .directory
    }) {
      return existing
    }
    let taken = Set(items.map(\.itemID))
    var id = "lost-and-found"
    var n = 2
    while taken.contains(id) {
      id = "lost-and-found-\(n)"
      n += 1
    }
    let folder = CloudItem(
      itemID: id, parentID: WellKnownItem.documents, name: Self.lostAndFoundName, kind: .directory, mode: 0o700,
      size: 0, mtimeNs: Clock.nowNs(), deviceID: deviceID)
    return try await metadata.commit(
      account: account, container: container.rawValue, item: folder, ifMatch: nil, chunks: [],
      rule: Self.treeRule(for: folder))
  }

  /// `name`, or "name 2", "name 3", ... : the first no live item of `parentID` has.
  func freeName(_ container: ContainerID, parentID: String, _ name: String) async throws -> String {
    // By bytes, as the store compares names.
    let used = Set(
      try await allItems(container).filter { !$0.deleted && $0.parentID == parentID }.map { Array($0.name.utf8) })
    if !used.contains(Array(name.utf8)) { return name }
    var n = 2
    while used.contains(Array(ItemName.numbered(name, n).utf8)) { n += 1 }
    return ItemName.numbered(name, n)
  }

  /// A folder and a name in it, the name as its UTF-8 bytes.
  struct Place: Hashable {
    var parentID: String?
    var name: [UInt8]
  }
}
