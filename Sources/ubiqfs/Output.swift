import Foundation

/// Writes a message to standard error.
func eprint(_ s: String) {
  FileHandle.standardError.write(Data((s + "\n").utf8))
}

/// Human-readable byte counts.
func formatBytes(_ n: Int64) -> String {
  let units = ["B", "KiB", "MiB", "GiB", "TiB"]
  var v = Double(n)
  var i = 0
  while v >= 1024 && i < units.count - 1 {
    v /= 1024
    i += 1
  }
  return i == 0 ? "\(n) B" : String(format: "%.1f %@", v, units[i])
}

/// Prints a value as pretty, key-sorted JSON on standard output.
func printJSON<T: Encodable>(_ value: T) throws {
  let e = JSONEncoder()
  e.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
  print(String(decoding: try e.encode(value), as: UTF8.self))
}
