import Foundation

/// The one format of client-chosen identifiers: item ids (also a record's `parentID`) and
/// conflict version ids. 1-128 bytes of ASCII letters, digits, `.`, `-` and `_`, not starting
/// with `.`; so an id is never a path, never `.` or `..`, and never needs escaping.
public enum Identifier {
  public static let maxBytes = 128

  /// True if `s` has the identifier format.
  public static func isValid(_ s: String) -> Bool {
    let bytes = s.utf8
    guard !bytes.isEmpty, bytes.count <= maxBytes, bytes.first != UInt8(ascii: ".") else { return false }
    return bytes.allSatisfy { b in
      (b >= 0x30 && b <= 0x39) || (b >= 0x41 && b <= 0x5A) || (b >= 0x61 && b <= 0x7A) || b == 0x2E || b == 0x2D
        || b == 0x5F
    }
  }

  /// A short, printable rendering of a refused identifier for error messages.
  public static func quoted(_ s: String) -> String {
    let shown = s.unicodeScalars.prefix(80).map { $0.isASCII && $0.value >= 0x20 && $0.value < 0x7F ? String($0) : "?" }
    return "'\(shown.joined())'"
  }
}
