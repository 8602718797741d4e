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
