/// A rule of the cloud's tree that an item version breaks. The cloud refuses such a version
/// (`CloudEngine`), and a device refuses such a record from the change feed, which a cloud that
/// checks nothing could send, so no device shows it.
public enum BrokenItemRule: Error, Sendable, Equatable, CustomStringConvertible {
  /// An item, parent or version id that is not an identifier.
  case invalidID(String)
  /// An item that is its own folder: a cycle of one.
  case cycle(String)
  /// Any other rule; the text says which.
  case invalid(String)

  public var description: String {
    switch self {
    case .invalidID(let what): return "invalid \(what)"
    case .cycle(let why): return why
    case .invalid(let why): return why
    }
  }
}

/// What a device id written into a record may be (an item's writer, a conflict version's, a
/// key-value entry's device): at most 128 bytes and no control character or line separator (a
/// NUL, which PostgreSQL's text cannot hold; a newline, which would split a line of a log or of
/// `ubiqfs status`). Empty is allowed: a record may name no device. A server checks it on every
/// write; a client applies records whatever their device ids hold beyond the length (a record
/// stored before this rule still applies everywhere).
public enum DeviceIDRule {
  public static let maxBytes = 128

  /// Why `id` cannot be a device id, or nil when it can.
  public static func problem(_ id: String) -> String? {
    if id.utf8.count > maxBytes { return "device id longer than \(maxBytes) bytes" }
    let refused: Set<Unicode.GeneralCategory> = [.control, .lineSeparator, .paragraphSeparator]
    if id.unicodeScalars.contains(where: { refused.contains($0.properties.generalCategory) }) {
      return "device id with a control character"
    }
    return nil
  }
}

extension ItemName {
  /// Throws for a name no cloud item may have: an invalid name, or one that stays on its device
  /// (`.nosync`), which a device never uploads.
  public static func validateInCloud(_ name: String) throws {
    try validate(name)
    if isNoSync(name) {
      throw UbiqError.invalidArgument("'\(name)' ends in .nosync: such an item stays on its device")
    }
  }

  /// Whether a cloud item may have `name` (`validateInCloud`).
  public static func isValidInCloud(_ name: String) -> Bool { (try? validateInCloud(name)) != nil }

  /// A name a cloud item may have, made from one it may not (what a repair renames such an
  /// item to): '/' and NUL become '_', a `.nosync` ending becomes `_nosync`, an empty name,
  /// "." and ".." become "unnamed", and the name is cut at a character to leave room for a
  /// number (" 99") within `maxBytes`.
  public static func repaired(_ name: String) -> String {
    var out = String(name.map { $0 == "/" || $0 == "\u{0}" ? "_" : $0 })
    if isNoSync(out) { out = String(out.dropLast(".nosync".count)) + "_nosync" }
    if out.isEmpty || out == "." || out == ".." { out = "unnamed" }
    while out.utf8.count > maxBytes - 8 { out.removeLast() }
    return out
  }
}

extension CloudItem {
  /// The longest symlink target a Linux mount can show (PATH_MAX less its NUL).
  public static let maxSymlinkTargetBytes = 4095
  /// The longest extended attribute name (Linux's XATTR_NAME_MAX).
  public static let maxXattrNameBytes = 255
  /// The largest extended attribute value (Linux's XATTR_SIZE_MAX).
  public static let maxXattrValueBytes = 64 * 1024
  /// The most bytes of extended attribute names (each with its NUL) an item may have: listxattr
  /// answers at most 64 KiB, and the mount adds its own `user.ubiq.*` names.
  public static let maxXattrNamesBytes = 60 * 1024

  /// Every device id the record names: its writer, its content's author, its conflict
  /// versions' writers.
  public var deviceIDs: [String] { [deviceID, contentDeviceID ?? ""] + (conflicts ?? []).map(\.deviceID) }

  /// The first rule of the cloud's tree this version breaks, or nil. (The container root,
  /// which the cloud makes and nothing writes, has no parent.)
  public var brokenRule: BrokenItemRule? {
    guard Identifier.isValid(itemID) else { return .invalidID("item id \(Identifier.quoted(itemID))") }
    if let parentID, !Identifier.isValid(parentID) {
      return .invalidID("parent id \(Identifier.quoted(parentID))")
    }
    for v in conflicts ?? [] where !Identifier.isValid(v.versionID) {
      return .invalidID("conflict version id \(Identifier.quoted(v.versionID))")
    }
    if deviceIDs.contains(where: { $0.utf8.count > DeviceIDRule.maxBytes }) {
      return .invalid("device id longer than \(DeviceIDRule.maxBytes) bytes")
    }
    if (settledNameOf?.utf8.count ?? 0) > 128 { return .invalid("settledNameOf longer than 128 bytes") }
    do { try ItemName.validateInCloud(name) } catch { return .invalid("\(error)") }
    guard let parentID else { return .invalid("item \(itemID) has no parent") }
    if parentID == itemID { return .cycle("item \(itemID) is its own folder") }
    if itemID == WellKnownItem.documents && (parentID != WellKnownItem.root || kind != .directory) {
      return .invalid("Documents is a folder in the container root")
    }
    if kind == .symlink && (symlinkTarget ?? "").isEmpty { return .invalid("symlink without target") }
    if let target = symlinkTarget, target.utf8.count > Self.maxSymlinkTargetBytes || target.utf8.contains(0) {
      return .invalid("symlink target longer than \(Self.maxSymlinkTargetBytes) bytes, or with a NUL")
    }
    var namesBytes = 0
    for (name, value) in xattrs {
      if name.isEmpty || name.utf8.count > Self.maxXattrNameBytes || name.utf8.contains(0) {
        return .invalid("extended attribute name empty, longer than \(Self.maxXattrNameBytes) bytes or with a NUL")
      }
      if value.count > Self.maxXattrValueBytes { return .invalid("extended attribute \(name) larger than 64 KiB") }
      namesBytes += name.utf8.count + 1
    }
    if namesBytes > Self.maxXattrNamesBytes { return .invalid("extended attribute names longer than 60 KiB in all") }
    if size < 0 { return .invalid("negative size") }
    if (conflicts ?? []).contains(where: { $0.size < 0 }) { return .invalid("negative conflict version size") }
    return nil
  }
}
