import Foundation
import UbiqCore
import UbiqIndex

/// Three-way merge of an item after a stale-etag rejection: each field group (place, mode,
/// xattrs, content) comes from the side that changed it since the common base. When both sides
/// changed the content, the documented rule picks the winner (newest mtime, then device id) and
/// the loser is kept as an unresolved conflict version, so nothing is lost.
public enum ConflictMerge {
  /// The record that replaces a delete of `current` by device `deviceID` when `current` has
  /// conflict versions written by other devices: nobody here resolved them, so deleting the
  /// file would delete their edits. The newest of them (by `CloudItem.wins`) becomes the
  /// current content and the other devices' remaining versions stay conflict versions; the
  /// deleted content and this device's own versions go. Nil when there is nothing to keep.
  public static func keepingOthersVersions(of current: CloudItem, deletedBy deviceID: String) -> CloudItem? {
    let others = (current.conflicts ?? []).filter { $0.deviceID != deviceID }
    guard current.kind == .file, !current.deleted, var newest = others.first else { return nil }
    for v in others.dropFirst()
    where CloudItem.wins(mtimeNs: v.mtimeNs, deviceID: v.deviceID, over: (newest.mtimeNs, newest.deviceID)) {
      newest = v
    }
    var out = current
    out.settledNameOf = nil
    out.chunks = newest.chunks
    out.size = newest.size
    out.mtimeNs = newest.mtimeNs
    out.setWriter(deviceID, contentAuthor: newest.deviceID)
    let rest = others.filter { $0.versionID != newest.versionID }
    out.conflicts = rest.isEmpty ? nil : rest
    return out
  }

  /// The cloud's version an upload merges with: `server` itself, or, when it breaks a rule of
  /// the cloud's tree (a cloud that checks nothing let it through: a name no item may have, an
  /// item that is its own folder), the same version at the local side's place, which the merge
  /// then keeps, so that its commit puts the item back where the rules allow. Throws when the
  /// place is not what breaks the rule.
  public static func mergeable(_ server: CloudItem, placeOf local: CloudItem) throws(BrokenItemRule) -> CloudItem {
    guard !server.deleted, server.brokenRule != nil else { return server }
    var mended = server
    mended.parentID = local.parentID
    mended.name = local.name
    if let broken = mended.brokenRule { throw broken }
    return mended
  }

  /// Whether a merged version is the local side as the user saw it: the same place, mode,
  /// extended attributes, symlink target, content and conflict versions. Such a merge took
  /// nothing from the cloud's version.
  public static func isTheLocalSide(_ merged: CloudItem, _ local: CloudItem) -> Bool {
    merged.parentID == local.parentID && merged.name == local.name && merged.mode == local.mode
      && merged.xattrs == local.xattrs && merged.symlinkTarget == local.symlinkTarget && merged.chunks == local.chunks
      && Set((merged.conflicts ?? []).map(\.versionID)) == Set((local.conflicts ?? []).map(\.versionID))
  }

  /// The cloud's conflict versions, and those the local side took on since the base (a file
  /// renamed over this one brings its versions along): content no other side has.
  static func versionsKept(local: CloudItem, base: CloudItem?, server: CloudItem) -> [ConflictVersion] {
    var kept = server.conflicts ?? []
    let baseVersions = Set((base?.conflicts ?? []).map(\.versionID))
    for version in local.conflicts ?? [] where !baseVersions.contains(version.versionID) {
      if !kept.contains(where: { $0.versionID == version.versionID || $0.chunks == version.chunks }) {
        kept.append(version)
      }
    }
    return kept
  }

  /// The merged record. `newVersionID` names this device's content if it loses and is kept as
  /// a conflict version (a fresh identifier; unused otherwise). `unanswered`: where the item
  /// was, and its mode, in this device's commits of it sent since its last stored one
  /// (`QueueEntry.unansweredPlaces`).
  public static func merge(
    local: CloudItem, base: CloudItem?, server: CloudItem, deviceID: String, newVersionID: String,
    unanswered: [ItemPlace] = []
  ) -> CloudItem {
    // Edited here, deleted there: the edit wins and brings the item back.
    if server.deleted {
      var out = local
      let conflicts =
        server.conflicts == nil ? local.conflicts ?? [] : versionsKept(local: local, base: base, server: server)
      out.conflicts = conflicts.isEmpty ? nil : conflicts
      out.settledNameOf = nil
      return out
    }
    var out = server
    // A merge is no name settled by sync alone.
    out.settledNameOf = nil
    // The content stays the cloud's, and its author with it, unless the local side's is taken.
    out.setWriter(deviceID, contentAuthor: server.contentAuthor)
    // A place that differs from the base only by a name this device's sync chose
    // (`settledNameOf`) is no user's change: a place changed in the cloud wins over it. Where
    // the cloud's place did not change, the settled name stays: it settles a name collision.
    // A temporary name this device's own earlier commit took in the cloud while the item moved
    // (`ItemName.aside`) is no user's place either: the local place is where the user put it.
    let serverAside = server.deviceID == deviceID && ItemName.isAside(server.name, itemID: server.itemID)
    // A place (or mode, or set of extended attributes) that a version of this device's own in
    // the cloud has, and that this device sent in a commit whose answer never came, is this
    // device's own earlier change, stored with its reply lost: where the item has moved (or
    // changed mode or attributes) here since, the local one is newer than the cloud's.
    let ownSent = server.deviceID == deviceID ? unanswered : []
    let movedSinceSent =
      ownSent.contains { $0.parentID == server.parentID && ItemName.same($0.name, server.name) }
      && (local.parentID != server.parentID || !ItemName.same(local.name, server.name))
    let modeChangedSinceSent = ownSent.contains { $0.mode == server.mode } && local.mode != server.mode
    let xattrsChangedSinceSent =
      ownSent.contains { $0.xattrs != nil && $0.hasXattrs(server.xattrs) } && local.xattrs != server.xattrs
    // With no base (no commit of the item has been answered), this device's commits of it,
    // noted before they were sent, stand in for one: every version of the item in the cloud
    // comes from one of them. A place, mode or set of extended attributes the cloud has that
    // none of them had is another device's change, and wins; one that any of them had is this
    // device's own, and the local side, newer, is taken. Without notes the local side is taken.
    let serverPlaceSent =
      unanswered.isEmpty
      || unanswered.contains { $0.parentID == server.parentID && ItemName.same($0.name, server.name) }
    let serverModeSent = unanswered.isEmpty || unanswered.contains { $0.mode == server.mode }
    let serverXattrsSent = unanswered.isEmpty || unanswered.contains { $0.hasXattrs(server.xattrs) }
    let placeChanged =
      (base.map { $0.parentID != local.parentID || !ItemName.same($0.name, local.name) } ?? serverPlaceSent)
      || movedSinceSent
    let serverPlaceChanged =
      base.map { $0.parentID != server.parentID || !ItemName.same($0.name, server.name) } ?? true
    if serverAside || (placeChanged && !(local.settledNameOf != nil && serverPlaceChanged)) {
      out.parentID = local.parentID
      out.name = local.name
    }
    if base.map({ $0.mode != local.mode }) ?? serverModeSent || modeChangedSinceSent { out.mode = local.mode }
    if base.map({ $0.xattrs != local.xattrs }) ?? serverXattrsSent || xattrsChangedSinceSent {
      out.xattrs = local.xattrs
    }
    if local.kind == .symlink, base.map({ $0.symlinkTarget != local.symlinkTarget }) ?? true {
      out.symlinkTarget = local.symlinkTarget
    }
    var conflicts = versionsKept(local: local, base: base, server: server)
    if local.kind == .file {
      let localChanged = base.map { $0.chunks != local.chunks } ?? true
      let serverChanged = base.map { $0.chunks != server.chunks } ?? (server.chunks != local.chunks)
      if localChanged && serverChanged && local.chunks != server.chunks {
        // Our own earlier upload whose confirmation was lost (e.g. a crash): ours is newer. Only
        // when the cloud's content is this device's: a merge this device committed may carry
        // another device's content.
        let ownStale = base == nil && server.contentAuthor == deviceID
        let localWins =
          ownStale
          || CloudItem.wins(
            mtimeNs: local.mtimeNs, deviceID: deviceID, over: (server.mtimeNs, server.contentAuthor))
        let loser = localWins ? server : local
        // A loser already kept (a merge committed before, whose reply was lost) is not kept twice.
        if !ownStale && !conflicts.contains(where: { $0.chunks == loser.chunks }) {
          conflicts.append(
            ConflictVersion(
              versionID: localWins ? "v\(server.etag)" : "v-\(newVersionID.prefix(12))",
              deviceID: localWins ? server.contentAuthor : deviceID, mtimeNs: loser.mtimeNs, size: loser.size,
              chunks: loser.chunks))
        }
        if localWins { take(local, into: &out) }
      } else if localChanged {
        take(local, into: &out)
      }
    }
    out.conflicts = conflicts.isEmpty ? nil : conflicts
    // Where the local side is only a name this device's sync chose and the merge differs from
    // the cloud's version by that name alone, the merge is such a name too, settled on the
    // cloud's version: a delete made on that version still wins over it.
    if local.settledNameOf != nil && (out.parentID != server.parentID || out.name != server.name)
      && isTheSameButForThePlace(out, server)
    {
      out.settledNameOf = server.etag
    }
    return out
  }

  /// Whether two versions differ at most by their folder and name.
  static func isTheSameButForThePlace(_ a: CloudItem, _ b: CloudItem) -> Bool {
    var moved = a
    moved.parentID = b.parentID
    moved.name = b.name
    return isTheLocalSide(moved, b)
  }

  static func take(_ local: CloudItem, into out: inout CloudItem) {
    out.chunks = local.chunks
    out.size = local.size
    out.mtimeNs = local.mtimeNs
    out.contentDeviceID = nil
  }
}
