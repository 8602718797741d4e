import Foundation

/// Writes a `CloudItem` as JSON without `JSONEncoder`: the same keys and values that its
/// `Encodable` conformance writes (an absent optional is left out, `Data` is base64), which
/// `JSONDecoder` reads back into an equal value. The stores write every record they keep (the
/// cloud's record, the index's merge base) this way; it is several times faster than the
/// generic encoder on the upload path. Keys are not sorted: no reader compares the text.
public enum RecordJSON {
  public static func encode(_ item: CloudItem) -> Data {
    var out: [UInt8] = []
    out.reserveCapacity(
      256 + item.name.utf8.count + 90 * item.chunks.count + item.xattrs.values.reduce(0) { $0 + $1.count * 4 / 3 + 8 })
    write(item, into: &out)
    return Data(out)
  }

  /// Records as a JSON array.
  public static func encode(_ items: [CloudItem]) -> Data {
    var out: [UInt8] = []
    out.reserveCapacity(400 * items.count + 2)
    writeArray(items, into: &out)
    return Data(out)
  }

  /// Appends records as a JSON array to `out`.
  public static func writeArray(_ items: [CloudItem], into out: inout [UInt8]) {
    writeArray(items, into: &out) { item, out in write(item, into: &out) }
  }

  /// Appends a JSON array to `out`, each element written by `element`.
  public static func writeArray<T>(
    _ elements: [T], into out: inout [UInt8], _ element: (T, inout [UInt8]) -> Void
  ) {
    out.append(UInt8(ascii: "["))
    for (i, e) in elements.enumerated() {
      if i > 0 { out.append(UInt8(ascii: ",")) }
      element(e, &out)
    }
    out.append(UInt8(ascii: "]"))
  }

  /// The JSON object `{"<key>": [...]}` (`key` needs no escaping), each element of the array
  /// written by `element`; `bytesEach` is a guess of an element's size, to reserve space once.
  public static func object<T>(
    key: String, array elements: [T], bytesEach: Int, _ element: (T, inout [UInt8]) -> Void
  ) -> Data {
    var out: [UInt8] = Array("{\"\(key)\":".utf8)
    out.reserveCapacity(bytesEach * elements.count + key.utf8.count + 8)
    writeArray(elements, into: &out, element)
    out.append(UInt8(ascii: "}"))
    return Data(out)
  }

  /// Appends the record's JSON object to `out`.
  public static func write(_ item: CloudItem, into out: inout [UInt8]) {
    out.append(UInt8(ascii: "{"))
    key("itemID", &out, first: true)
    string(item.itemID, &out)
    if let parentID = item.parentID {
      key("parentID", &out)
      string(parentID, &out)
    }
    key("name", &out)
    string(item.name, &out)
    key("kind", &out)
    number(Int64(item.kind.rawValue), &out)
    key("mode", &out)
    number(Int64(item.mode), &out)
    key("size", &out)
    number(item.size, &out)
    key("mtimeNs", &out)
    number(item.mtimeNs, &out)
    if let target = item.symlinkTarget {
      key("symlinkTarget", &out)
      string(target, &out)
    }
    key("xattrs", &out)
    out.append(UInt8(ascii: "{"))
    for (i, (name, value)) in item.xattrs.enumerated() {
      if i > 0 { out.append(UInt8(ascii: ",")) }
      string(name, &out)
      out.append(UInt8(ascii: ":"))
      string(value.base64EncodedString(), &out)
    }
    out.append(UInt8(ascii: "}"))
    key("chunks", &out)
    chunks(item.chunks, &out)
    key("etag", &out)
    string(item.etag, &out)
    key("deleted", &out)
    out.append(contentsOf: (item.deleted ? "true" : "false").utf8)
    key("changeSeq", &out)
    number(item.changeSeq, &out)
    key("deviceID", &out)
    string(item.deviceID, &out)
    if let author = item.contentDeviceID {
      key("contentDeviceID", &out)
      string(author, &out)
    }
    if let conflicts = item.conflicts {
      key("conflicts", &out)
      writeArray(conflicts, into: &out) { v, out in
        out.append(UInt8(ascii: "{"))
        key("versionID", &out, first: true)
        string(v.versionID, &out)
        key("deviceID", &out)
        string(v.deviceID, &out)
        key("mtimeNs", &out)
        number(v.mtimeNs, &out)
        key("size", &out)
        number(v.size, &out)
        key("chunks", &out)
        chunks(v.chunks, &out)
        out.append(UInt8(ascii: "}"))
      }
    }
    if let settled = item.settledNameOf {
      key("settledNameOf", &out)
      string(settled, &out)
    }
    out.append(UInt8(ascii: "}"))
  }

  private static func chunks(_ refs: [ChunkRef], _ out: inout [UInt8]) {
    writeArray(refs, into: &out) { c, out in
      out.append(UInt8(ascii: "{"))
      key("hash", &out, first: true)
      string(c.hash, &out)
      key("length", &out)
      number(c.length, &out)
      out.append(UInt8(ascii: "}"))
    }
  }

  private static func key(_ k: StaticString, _ out: inout [UInt8], first: Bool = false) {
    if !first { out.append(UInt8(ascii: ",")) }
    out.append(UInt8(ascii: "\""))
    k.withUTF8Buffer { out.append(contentsOf: $0) }
    out.append(contentsOf: [UInt8(ascii: "\""), UInt8(ascii: ":")])
  }

  private static func number(_ n: Int64, _ out: inout [UInt8]) {
    out.append(contentsOf: String(n).utf8)
  }

  private static let hex: [UInt8] = Array("0123456789abcdef".utf8)

  /// A JSON string: the quote, the backslash and the control characters escaped, everything
  /// else as its UTF-8 bytes (a Swift string is always valid Unicode).
  public static func writeString(_ s: String, into out: inout [UInt8]) { string(s, &out) }

  private static func string(_ s: String, _ out: inout [UInt8]) {
    out.append(UInt8(ascii: "\""))
    for b in s.utf8 {
      switch b {
      case UInt8(ascii: "\""), UInt8(ascii: "\\"):
        out.append(UInt8(ascii: "\\"))
        out.append(b)
      case 0..<0x20:
        out.append(contentsOf: Array("\\u00".utf8))
        out.append(hex[Int(b >> 4)])
        out.append(hex[Int(b & 0xF)])
      default:
        out.append(b)
      }
    }
    out.append(UInt8(ascii: "\""))
  }
}

extension RecordJSON {
  /// Reads a `CloudItem` written as JSON without `JSONDecoder`: the same values its `Decodable`
  /// conformance reads (keys in any order, unknown keys skipped, null or absent optionals are
  /// nil, `Data` is base64), more strictly (see `JSONReader`). The stores read every record they
  /// keep this way, the server every record it is sent, the client every record it receives.
  public static func decode(_ data: Data) throws -> CloudItem {
    try JSONReader.read(data) { try item(&$0) }
  }

  /// Reads a record this program stored or was sent by a server: `decode`, and if that refuses
  /// the text, `JSONDecoder` (text that only the generic decoder reads, from another writer, is
  /// still read as before).
  public static func decodeStored(_ data: Data) throws -> CloudItem {
    if let item = try? decode(data) { return item }
    return try JSONDecoder().decode(CloudItem.self, from: data)
  }

  /// Reads a JSON array of records.
  public static func decodeArray(_ data: Data) throws -> [CloudItem] {
    try JSONReader.read(data) { try $0.array { try item(&$0) } }
  }

  /// Reads one record at the reader's position.
  static func item(_ r: inout JSONReader) throws -> CloudItem {
    var itemID: String?
    var parentID: String?
    var name: String?
    var kind: ItemKind?
    var mode: UInt32?
    var size: Int64?
    var mtimeNs: Int64?
    var symlinkTarget: String?
    var xattrs: [String: Data]?
    var chunks: [ChunkRef]?
    var etag: String?
    var deleted: Bool?
    var changeSeq: Int64?
    var deviceID: String?
    var contentDeviceID: String?
    var conflicts: [ConflictVersion]?
    var settledNameOf: String?
    try r.object { r, key in
      switch key {
      case "itemID": itemID = try r.string(field: key)
      case "parentID": parentID = try r.optionalString(field: key)
      case "name": name = try r.string(field: key)
      case "kind":
        guard let k = ItemKind(rawValue: try r.integer(Int.self, field: key)) else {
          throw JSONReader.Failure.wrongType(field: key)
        }
        kind = k
      case "mode": mode = try r.integer(field: key)
      case "size": size = try r.integer(field: key)
      case "mtimeNs": mtimeNs = try r.integer(field: key)
      case "symlinkTarget": symlinkTarget = try r.optionalString(field: key)
      case "xattrs":
        var values: [String: Data] = [:]
        try r.object { r, name in
          guard let value = Data(base64Encoded: try r.string(field: "xattrs.\(name)")) else {
            throw JSONReader.Failure.wrongType(field: "xattrs.\(name)")
          }
          values[name] = value
        }
        xattrs = values
      case "chunks": chunks = try r.array { try chunk(&$0) }
      case "etag": etag = try r.string(field: key)
      case "deleted": deleted = try r.bool(field: key)
      case "changeSeq": changeSeq = try r.integer(field: key)
      case "deviceID": deviceID = try r.string(field: key)
      case "contentDeviceID": contentDeviceID = try r.optionalString(field: key)
      case "conflicts": conflicts = try r.null() ? nil : r.array { try conflictVersion(&$0) }
      case "settledNameOf": settledNameOf = try r.optionalString(field: key)
      default: try r.skipValue()
      }
    }
    func required<T>(_ value: T?, _ field: String) throws -> T {
      guard let value else { throw JSONReader.Failure.missing(field: field) }
      return value
    }
    var out = CloudItem(
      itemID: try required(itemID, "itemID"), parentID: parentID, name: try required(name, "name"),
      kind: try required(kind, "kind"), mode: try required(mode, "mode"), size: try required(size, "size"),
      mtimeNs: try required(mtimeNs, "mtimeNs"), symlinkTarget: symlinkTarget,
      xattrs: try required(xattrs, "xattrs"), chunks: try required(chunks, "chunks"), etag: try required(etag, "etag"),
      deleted: try required(deleted, "deleted"), changeSeq: try required(changeSeq, "changeSeq"),
      deviceID: try required(deviceID, "deviceID"))
    out.contentDeviceID = contentDeviceID
    out.conflicts = conflicts
    out.settledNameOf = settledNameOf
    return out
  }

  static func chunk(_ r: inout JSONReader) throws -> ChunkRef {
    var hash: String?
    var length: Int64?
    try r.object { r, key in
      switch key {
      case "hash": hash = try r.string(field: "chunks.hash")
      case "length": length = try r.integer(field: "chunks.length")
      default: try r.skipValue()
      }
    }
    guard let hash else { throw JSONReader.Failure.missing(field: "hash") }
    guard let length else { throw JSONReader.Failure.missing(field: "length") }
    return ChunkRef(hash: hash, length: length)
  }

  static func conflictVersion(_ r: inout JSONReader) throws -> ConflictVersion {
    var versionID: String?
    var deviceID: String?
    var mtimeNs: Int64?
    var size: Int64?
    var chunks: [ChunkRef]?
    try r.object { r, key in
      switch key {
      case "versionID": versionID = try r.string(field: "conflicts.versionID")
      case "deviceID": deviceID = try r.string(field: "conflicts.deviceID")
      case "mtimeNs": mtimeNs = try r.integer(field: "conflicts.mtimeNs")
      case "size": size = try r.integer(field: "conflicts.size")
      case "chunks": chunks = try r.array { try chunk(&$0) }
      default: try r.skipValue()
      }
    }
    guard let versionID else { throw JSONReader.Failure.missing(field: "versionID") }
    guard let deviceID else { throw JSONReader.Failure.missing(field: "deviceID") }
    guard let mtimeNs else { throw JSONReader.Failure.missing(field: "mtimeNs") }
    guard let size else { throw JSONReader.Failure.missing(field: "size") }
    guard let chunks else { throw JSONReader.Failure.missing(field: "chunks") }
    return ConflictVersion(versionID: versionID, deviceID: deviceID, mtimeNs: mtimeNs, size: size, chunks: chunks)
  }
}

extension CloudItem: JSONReadable {
  public static func read(from reader: inout JSONReader) throws -> CloudItem { try RecordJSON.item(&reader) }
}
