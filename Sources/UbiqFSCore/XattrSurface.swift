import Foundation
import UbiqCore
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// The extended-attribute surface: the user's own `user.*` attributes (stored in the index and
/// synced) and the virtual `user.ubiq.*` status/control attributes computed from the index.
struct XattrSurface {
  unowned let fs: FilesystemCore
  static let prefix = "user.ubiq."
  /// Read-only status attributes. Writes to them are accepted and ignored, so that `cp -a` and
  /// `rsync -X` between two places in the mount keep working.
  static let statusNames = [
    "status", "content_state", "downloading", "uploading", "uploaded", "percent_downloaded", "percent_uploaded",
    "download_error",
    "upload_error", "conflicts", "etag", "item_id", "container", "pinned", "excluded",
  ]

  /// Value of a virtual attribute, or nil if the item has none of that name.
  func virtualValue(_ name: String, _ row: ItemRow) throws -> String? {
    let entry = try fs.index.queueEntry(forInode: row.id!)
    let localOnly = try fs.index.isLocalOnly(row.id!)
    let uploaded =
      !localOnly && entry == nil && row.revision == row.syncedRevision
      && (row.etag != nil || row.id == IndexStore.rootInode)
    switch name {
    case "status":
      if row.kind == .file && row.content == .dataless { return "not_downloaded" }
      return "current"
    case "content_state":
      return try fs.content.state(of: row, uploading: fs.isUploading(row.id!)).description
    case "downloading": return fs.downloader?.isDownloading(row.id!) == true ? "1" : "0"
    case "percent_downloaded":
      guard row.kind == .file, row.content == .dataless else { return "100" }
      return String(fs.downloader?.percent(row.id!) ?? 0)
    case "download_error": return row.content == .dataless ? fs.downloader?.lastError(row.id!) : nil
    case "uploading": return entry != nil ? "1" : "0"
    case "uploaded": return uploaded ? "1" : "0"
    case "percent_uploaded":
      if uploaded { return "100" }
      return String(fs.uploadPercent(row.id!) ?? 0)
    case "upload_error":
      guard let e = entry, let msg = e.lastError else { return nil }
      return msg
    case "conflicts": return String(row.conflictList.count)
    case "etag": return row.etag
    case "item_id": return row.itemID
    case "container": return fs.container.rawValue
    case "pinned": return row.pinned ? "1" : "0"
    case "excluded": return localOnly ? "1" : "0"
    default: return nil
    }
  }

  func get(_ inode: Int64, _ name: String, size: Int) throws -> XattrAnswer {
    // security.*, system.*, trusted.* are not supported (no SELinux labels, no POSIX ACLs):
    // answer without touching the index. EOPNOTSUPP rather than ENODATA lets `ls -l` remember
    // that for the whole device and stop asking for every file (two round trips per entry).
    guard name.hasPrefix("user.") else { throw UbiqError.notSupported("\(name): only user.* attributes exist here") }
    try Self.refuseEmptyName(name)
    let row = try fs.requireRow(inode)
    let value: Data
    if name.hasPrefix(Self.prefix) {
      guard let v = try virtualValue(String(name.dropFirst(Self.prefix.count)), row) else {
        throw UbiqError.noData(name)
      }
      value = Data(v.utf8)
    } else {
      guard let v = try fs.index.xattr(row.id!, name) else { throw UbiqError.noData(name) }
      value = v
    }
    return try answer(inode, name, value, size)
  }

  /// Answers a size query (and remembers the value) or gives the value; see `XattrSnapshots`.
  private func answer(_ inode: Int64, _ key: String, _ value: Data, _ size: Int) throws -> XattrAnswer {
    if size == 0 {
      fs.xattrSnapshots.remember(UInt64(inode), key, value)
      return .size(value.count)
    }
    guard let fitting = fs.xattrSnapshots.fitting(UInt64(inode), key, current: value, size: size) else {
      throw UbiqError.range(key)
    }
    return .value(fitting)
  }

  func list(_ inode: Int64, size: Int) throws -> XattrAnswer {
    // A removed directory the kernel still holds has none.
    guard let row = try fs.rowUnlessRemovedDirectory(inode) else { return size == 0 ? .size(0) : .value(Data()) }
    var names = try fs.index.xattrNames(row.id!)
    // The kernel refuses user.* attributes on symlinks, so list none there.
    if row.kind != .symlink {
      for v in Self.statusNames where try virtualValue(v, row) != nil { names.append(Self.prefix + v) }
    }
    var blob = Data()
    for n in names {
      blob.append(contentsOf: Array(n.utf8))
      blob.append(0)
    }
    // "\0" cannot occur in an attribute name, so it keys the list's snapshot.
    return try answer(inode, "\0list", blob, size)
  }

  func set(_ inode: Int64, _ name: String, _ value: Data, _ flags: XattrFlags) throws {
    let row = try fs.requireRow(inode)
    if name.hasPrefix(Self.prefix) {
      let key = String(name.dropFirst(Self.prefix.count))
      let text = String(decoding: value, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
      switch key {
      case "pinned":
        let pin = try Self.bool(text, name)
        try fs.index.setPinned(row.id!, pin)
        // Pinned content is downloaded and kept.
        if pin && row.kind == .file { try fs.download(row.id!) }
      case "excluded":
        let excluded = try Self.bool(text, name)
        try fs.keepingContentLocal { try fs.index.setExcluded(row.id!, excluded) }
        fs.onQueued()
      case "action":
        try fs.perform(action: text, on: row)
      case "resolve":
        try fs.resolve(row, keep: text)
      default:
        if Self.statusNames.contains(key) { return }
        throw UbiqError.notSupported("unknown ubiqfs attribute \(name)")
      }
      return
    }
    guard name.hasPrefix("user.") else { throw UbiqError.notSupported("only user.* attributes are stored") }
    try Self.refuseEmptyName(name)
    if name.utf8.count > CloudItem.maxXattrNameBytes { throw UbiqError.range("attribute name too long") }
    if value.count > CloudItem.maxXattrValueBytes { throw UbiqError.range("attribute value larger than 64 KiB") }
    let mode: IndexStore.XattrMode =
      flags.contains(.create) ? .create : (flags.contains(.replace) ? .replace : .any)
    try fs.index.setXattr(row.id!, name, value, mode: mode)
    fs.onQueued()
  }

  func remove(_ inode: Int64, _ name: String) throws {
    let row = try fs.requireRow(inode)
    if name.hasPrefix(Self.prefix) {
      // Removing a control attribute resets it; status attributes are computed, so removing one
      // is a no-op (rsync -X removes what it did not copy).
      switch String(name.dropFirst(Self.prefix.count)) {
      case "pinned": try fs.index.setPinned(row.id!, false)
      case "excluded":
        try fs.index.setExcluded(row.id!, false)
        fs.onQueued()
      case let key where Self.statusNames.contains(key) || key == "action": break
      default: throw UbiqError.noData(name)
      }
      return
    }
    guard name.hasPrefix("user.") else { throw UbiqError.noData(name) }
    try Self.refuseEmptyName(name)
    try fs.index.removeXattr(row.id!, name)
    fs.onQueued()
  }

  /// `user.` alone names no attribute: EINVAL, as Linux gives for any namespace prefix alone.
  static func refuseEmptyName(_ name: String) throws {
    if name == "user." { throw UbiqError.invalidArgument("an attribute name needs something after user.") }
  }

  static func bool(_ text: String, _ name: String) throws -> Bool {
    switch text.lowercased() {
    case "1", "true", "yes", "on": return true
    case "0", "false", "no", "off", "": return false
    default: throw UbiqError.invalidArgument("\(name) takes 1 or 0, not '\(text)'")
    }
  }
}

extension FilesystemCore {
  var xattrSurface: XattrSurface { XattrSurface(fs: self) }

  public func getxattr(_ inode: Int64, name: String, size: Int) throws -> XattrAnswer {
    try xattrSurface.get(inode, name, size: size)
  }

  public func listxattr(_ inode: Int64, size: Int) throws -> XattrAnswer { try xattrSurface.list(inode, size: size) }

  public func setxattr(_ inode: Int64, name: String, value: Data, flags: XattrFlags) throws {
    try xattrSurface.set(inode, name, value, flags)
  }

  public func removexattr(_ inode: Int64, name: String) throws { try xattrSurface.remove(inode, name) }
}
