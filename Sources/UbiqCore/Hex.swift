/// Lower-case hexadecimal text of bytes: chunk hashes, token hashes and signatures.
public enum Hex {
  private static let digits = Array("0123456789abcdef".utf8)

  /// Two lower-case hex digits per byte, in order.
  public static func lowercase<S: Sequence>(_ bytes: S) -> String where S.Element == UInt8 {
    var out: [UInt8] = []
    out.reserveCapacity(bytes.underestimatedCount * 2)
    for b in bytes {
      out.append(digits[Int(b >> 4)])
      out.append(digits[Int(b & 0x0f)])
    }
    return String(decoding: out, as: UTF8.self)
  }
}
