import Foundation

#if canImport(Glibc)
  import Glibc
#endif

/// Where a long command's progress goes: one line redrawn in place on a terminal, one JSON
/// object per line with --json, or nowhere (a pipe without --json stays quiet).
enum ProgressStyle {
  case terminal, jsonLines, silent

  static func choose(json: Bool) -> ProgressStyle {
    if json { return .jsonLines }
    return isatty(STDOUT_FILENO) == 1 ? .terminal : .silent
  }
}

/// One progress report: a JSON object, and the line a terminal shows.
protocol ProgressReport: Encodable {
  var line: String { get }
}

/// Prints progress reports in a `ProgressStyle`: at most one every `interval` seconds, and the
/// final one always. Safe to call from several threads.
/// Sendable: `lastPrinted` and `lineShown` are guarded by `lock`.
final class ProgressPrinter<Report: ProgressReport>: @unchecked Sendable {
  let style: ProgressStyle
  private let interval: TimeInterval
  private let lock = NSLock()
  private var lastPrinted = Date.distantPast
  private var lineShown = false
  private let encoder: JSONEncoder = {
    let e = JSONEncoder()
    e.outputFormatting = [.sortedKeys]
    return e
  }()

  init(style: ProgressStyle) {
    self.style = style
    interval = style == .terminal ? 0.2 : 0.5
  }

  func report(_ r: Report, final: Bool = false) {
    lock.lock()
    defer { lock.unlock() }
    let now = Date()
    guard final || now.timeIntervalSince(lastPrinted) >= interval else { return }
    lastPrinted = now
    switch style {
    case .silent: return
    case .jsonLines:
      guard let data = try? encoder.encode(r) else { return }
      FileHandle.standardOutput.write(data + Data("\n".utf8))
    case .terminal:
      // Carriage return and erase-line: the line is redrawn in place; the final one stays.
      FileHandle.standardOutput.write(Data(("\r\u{1B}[K" + r.line + (final ? "\n" : "")).utf8))
      lineShown = !final
    }
  }

  /// Erases a progress line still on the terminal (before an error message, say).
  func clearLine() {
    lock.lock()
    defer { lock.unlock() }
    if lineShown { FileHandle.standardOutput.write(Data("\r\u{1B}[K".utf8)) }
    lineShown = false
  }
}

/// "1m05s", "42s": a duration for progress lines.
func formatDuration(_ seconds: Double) -> String {
  let s = Int(seconds.rounded(.up))
  if s >= 3600 { return "\(s / 3600)h\(String(format: "%02d", s % 3600 / 60))m" }
  if s >= 60 { return "\(s / 60)m\(String(format: "%02d", s % 60))s" }
  return "\(s)s"
}
