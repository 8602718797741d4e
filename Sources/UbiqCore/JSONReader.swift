import Foundation

/// A type that `JSONReader` reads directly (the record types on hot paths); `JSONDecoder` reads
/// the same text into the same value. Decoding helpers that take any `Decodable` use this path
/// when a type has it.
public protocol JSONReadable {
  /// Reads one value at the reader's position.
  static func read(from reader: inout JSONReader) throws -> Self
}

/// Reads JSON text (RFC 8259) value by value, for decoders written by hand for the record types
/// on hot paths (`RecordJSON.decode`): no intermediate tree, no `Decoder` machinery. Strict:
/// invalid UTF-8 in strings, escapes of unpaired UTF-16 surrogates, raw control characters,
/// a key twice in one object, nesting deeper than `maxDepth` and anything after the value are
/// errors, never replacements. Numbers are read as integers: a fraction or an exponent where an
/// integer is expected is a type error. Owns only its copy of the text and a read position.
public struct JSONReader {
  /// Why the text could not be read as the expected value.
  public enum Failure: Error, Equatable, CustomStringConvertible {
    /// Not JSON at `offset` (bytes from the start).
    case syntax(offset: Int)
    /// A string that is not valid UTF-8, or escapes an unpaired surrogate.
    case invalidUTF8(offset: Int)
    /// A value of another type than expected, or out of the expected range, at `field`.
    case wrongType(field: String)
    /// A required field is absent or null.
    case missing(field: String)
    /// A key appears twice in one object.
    case duplicateKey(String)
    /// Arrays and objects nested deeper than `maxDepth`.
    case tooDeep

    public var description: String {
      switch self {
      case .syntax(let offset): return "not valid JSON at byte \(offset)"
      case .invalidUTF8(let offset): return "a string at byte \(offset) is not valid UTF-8"
      case .wrongType(let field): return "wrong type at '\(field.prefix(80))'"
      case .missing(let field): return "missing field '\(field.prefix(80))'"
      case .duplicateKey(let key): return "the key '\(key.prefix(80))' appears twice in one object"
      case .tooDeep: return "nested deeper than \(JSONReader.maxDepth) levels"
      }
    }
  }

  /// The deepest nesting of arrays and objects read (the same limit as `JSONDecoder`).
  public static let maxDepth = 512

  private let bytes: [UInt8]
  private var position = 0
  private var depth = 0

  public init(_ data: Data) { bytes = [UInt8](data) }
  public init(_ bytes: [UInt8]) { self.bytes = bytes }

  /// Reads the one value of the text with `read`, then checks that nothing but whitespace follows.
  public static func read<T>(_ data: Data, _ read: (inout JSONReader) throws -> T) throws -> T {
    var reader = JSONReader(data)
    let value = try read(&reader)
    reader.skipWhitespace()
    guard reader.position == reader.bytes.count else { throw Failure.syntax(offset: reader.position) }
    return value
  }

  // MARK: - structure

  /// Reads an object, calling `field` with each key; `field` must read (or skip) its value.
  public mutating func object(_ field: (inout JSONReader, String) throws -> Void) throws {
    try expect(UInt8(ascii: "{"))
    try enter()
    var seen: [String] = []
    var seenSet: Set<String> = []
    skipWhitespace()
    if peek() == UInt8(ascii: "}") {
      position += 1
      depth -= 1
      return
    }
    while true {
      skipWhitespace()
      guard peek() == UInt8(ascii: "\"") else { throw Failure.syntax(offset: position) }
      let key = try string()
      // Few keys: a linear look; an object with many keys switches to a set, so a hostile body
      // costs linear time.
      if seen.count < 16 {
        if seen.contains(key) { throw Failure.duplicateKey(key) }
        seen.append(key)
      } else {
        if seenSet.isEmpty { seenSet = Set(seen) }
        if !seenSet.insert(key).inserted { throw Failure.duplicateKey(key) }
      }
      try expect(UInt8(ascii: ":"))
      try field(&self, key)
      skipWhitespace()
      switch peek() {
      case UInt8(ascii: ","): position += 1
      case UInt8(ascii: "}"):
        position += 1
        depth -= 1
        return
      default: throw Failure.syntax(offset: position)
      }
    }
  }

  /// Reads an array, calling `element` for each element; `element` must read (or skip) it.
  public mutating func forEachElement(_ element: (inout JSONReader) throws -> Void) throws {
    try expect(UInt8(ascii: "["))
    try enter()
    skipWhitespace()
    if peek() == UInt8(ascii: "]") {
      position += 1
      depth -= 1
      return
    }
    while true {
      try element(&self)
      skipWhitespace()
      switch peek() {
      case UInt8(ascii: ","): position += 1
      case UInt8(ascii: "]"):
        position += 1
        depth -= 1
        return
      default: throw Failure.syntax(offset: position)
      }
    }
  }

  /// Reads an array whose elements `element` returns.
  public mutating func array<T>(_ element: (inout JSONReader) throws -> T) throws -> [T] {
    var out: [T] = []
    try forEachElement { r in out.append(try element(&r)) }
    return out
  }

  /// True, and the null read, if the next value is `null`.
  public mutating func null() throws -> Bool {
    skipWhitespace()
    guard peek() == UInt8(ascii: "n") else { return false }
    try literal("null")
    return true
  }

  /// Reads one value of any type and returns its text (a part read by another decoder).
  public mutating func rawValue() throws -> Data {
    skipWhitespace()
    let start = position
    try skipValue()
    return Data(bytes[start..<position])
  }

  /// Reads and drops one value of any type (a field this reader does not know).
  public mutating func skipValue() throws {
    skipWhitespace()
    guard let c = peek() else { throw Failure.syntax(offset: position) }
    switch c {
    case UInt8(ascii: "{"): try object { r, _ in try r.skipValue() }
    case UInt8(ascii: "["): try forEachElement { r in try r.skipValue() }
    case UInt8(ascii: "\""): _ = try string()
    case UInt8(ascii: "t"): try literal("true")
    case UInt8(ascii: "f"): try literal("false")
    case UInt8(ascii: "n"): try literal("null")
    case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): try skipNumber()
    default: throw Failure.syntax(offset: position)
    }
  }

  // MARK: - scalars

  /// Reads a string; `field` names it in a type error.
  public mutating func string(field: String) throws -> String {
    skipWhitespace()
    guard peek() == UInt8(ascii: "\"") else { throw Failure.wrongType(field: field) }
    return try string()
  }

  /// Reads a string or null (nil).
  public mutating func optionalString(field: String) throws -> String? {
    try null() ? nil : string(field: field)
  }

  /// Reads `true` or `false`.
  public mutating func bool(field: String) throws -> Bool {
    skipWhitespace()
    switch peek() {
    case UInt8(ascii: "t"):
      try literal("true")
      return true
    case UInt8(ascii: "f"):
      try literal("false")
      return false
    default: throw Failure.wrongType(field: field)
    }
  }

  /// Reads an integer that fits `T`; a fraction, an exponent or a value out of range is a type
  /// error.
  public mutating func integer<T: FixedWidthInteger>(_: T.Type = T.self, field: String) throws -> T {
    skipWhitespace()
    let start = position
    let negative = peek() == UInt8(ascii: "-")
    if negative { position += 1 }
    guard let first = peek(), isDigit(first) else {
      throw start == position ? Failure.wrongType(field: field) : Failure.syntax(offset: position)
    }
    var value: T = 0
    var overflow = false
    var digits = 0
    while let d = peek(), isDigit(d) {
      let digit = T(d - UInt8(ascii: "0"))
      let (times, o1) = value.multipliedReportingOverflow(by: 10)
      let (next, o2) = negative ? times.subtractingReportingOverflow(digit) : times.addingReportingOverflow(digit)
      overflow = overflow || o1 || o2
      value = next
      digits += 1
      position += 1
    }
    if first == UInt8(ascii: "0") && digits > 1 { throw Failure.syntax(offset: start) }
    if let c = peek(), c == UInt8(ascii: ".") || c == UInt8(ascii: "e") || c == UInt8(ascii: "E") {
      // A valid number, but not an integer.
      position = start
      try skipNumber()
      throw Failure.wrongType(field: field)
    }
    if overflow { throw Failure.wrongType(field: field) }
    return value
  }

  // MARK: - text

  private func peek() -> UInt8? { position < bytes.count ? bytes[position] : nil }

  private func isDigit(_ c: UInt8) -> Bool { c >= UInt8(ascii: "0") && c <= UInt8(ascii: "9") }

  private mutating func skipWhitespace() {
    while position < bytes.count {
      switch bytes[position] {
      case 0x20, 0x09, 0x0A, 0x0D: position += 1
      default: return
      }
    }
  }

  private mutating func expect(_ c: UInt8) throws {
    skipWhitespace()
    guard peek() == c else { throw Failure.syntax(offset: position) }
    position += 1
  }

  private mutating func enter() throws {
    depth += 1
    if depth > Self.maxDepth { throw Failure.tooDeep }
  }

  private mutating func literal(_ word: StaticString) throws {
    let n = word.utf8CodeUnitCount
    guard position + n <= bytes.count else { throw Failure.syntax(offset: position) }
    for k in 0..<n where bytes[position + k] != word.utf8Start[k] { throw Failure.syntax(offset: position + k) }
    position += n
  }

  /// Skips a number of any JSON form: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  private mutating func skipNumber() throws {
    if peek() == UInt8(ascii: "-") { position += 1 }
    func digits() throws {
      guard let c = peek(), isDigit(c) else { throw Failure.syntax(offset: position) }
      while let c = peek(), isDigit(c) { position += 1 }
    }
    if peek() == UInt8(ascii: "0") {
      position += 1
    } else {
      try digits()
    }
    if peek() == UInt8(ascii: ".") {
      position += 1
      try digits()
    }
    if let c = peek(), c == UInt8(ascii: "e") || c == UInt8(ascii: "E") {
      position += 1
      if let s = peek(), s == UInt8(ascii: "+") || s == UInt8(ascii: "-") { position += 1 }
      try digits()
    }
  }

  /// Reads a string starting at its opening quote.
  private mutating func string() throws -> String {
    let start = position
    position += 1
    // Fast path: no escapes.
    var end = position
    while end < bytes.count {
      let c = bytes[end]
      if c == UInt8(ascii: "\"") {
        guard let s = String(validating: bytes[position..<end], as: UTF8.self) else {
          throw Failure.invalidUTF8(offset: start)
        }
        position = end + 1
        return s
      }
      if c == UInt8(ascii: "\\") { break }
      if c < 0x20 { throw Failure.syntax(offset: end) }
      end += 1
    }
    guard end < bytes.count else { throw Failure.syntax(offset: end) }
    // Escapes: the bytes are put together, then validated as a whole.
    var out = Array(bytes[position..<end])
    position = end
    while true {
      guard let c = peek() else { throw Failure.syntax(offset: position) }
      position += 1
      switch c {
      case UInt8(ascii: "\""):
        guard let s = String(validating: out, as: UTF8.self) else { throw Failure.invalidUTF8(offset: start) }
        return s
      case UInt8(ascii: "\\"):
        guard let e = peek() else { throw Failure.syntax(offset: position) }
        position += 1
        switch e {
        case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): out.append(e)
        case UInt8(ascii: "b"): out.append(0x08)
        case UInt8(ascii: "f"): out.append(0x0C)
        case UInt8(ascii: "n"): out.append(0x0A)
        case UInt8(ascii: "r"): out.append(0x0D)
        case UInt8(ascii: "t"): out.append(0x09)
        case UInt8(ascii: "u"):
          var scalar = try hex4()
          if scalar >= 0xD800 && scalar < 0xDC00 {
            // A high surrogate must be followed by an escaped low one.
            guard position + 1 < bytes.count, bytes[position] == UInt8(ascii: "\\"),
              bytes[position + 1] == UInt8(ascii: "u")
            else { throw Failure.invalidUTF8(offset: start) }
            position += 2
            let low = try hex4()
            guard low >= 0xDC00 && low < 0xE000 else { throw Failure.invalidUTF8(offset: start) }
            scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
          } else if scalar >= 0xDC00 && scalar < 0xE000 {
            throw Failure.invalidUTF8(offset: start)
          }
          guard let u = Unicode.Scalar(scalar) else { throw Failure.invalidUTF8(offset: start) }
          out.append(contentsOf: UTF8.encode(u)!)
        default: throw Failure.syntax(offset: position - 1)
        }
      default:
        if c < 0x20 { throw Failure.syntax(offset: position - 1) }
        out.append(c)
      }
    }
  }

  private mutating func hex4() throws -> UInt32 {
    guard position + 4 <= bytes.count else { throw Failure.syntax(offset: position) }
    var v: UInt32 = 0
    for _ in 0..<4 {
      let c = bytes[position]
      let d: UInt32
      switch c {
      case UInt8(ascii: "0")...UInt8(ascii: "9"): d = UInt32(c - UInt8(ascii: "0"))
      case UInt8(ascii: "a")...UInt8(ascii: "f"): d = UInt32(c - UInt8(ascii: "a") + 10)
      case UInt8(ascii: "A")...UInt8(ascii: "F"): d = UInt32(c - UInt8(ascii: "A") + 10)
      default: throw Failure.syntax(offset: position)
      }
      v = v << 4 | d
      position += 1
    }
    return v
  }
}
