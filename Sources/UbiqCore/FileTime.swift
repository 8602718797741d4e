import Foundation

#if canImport(Glibc)
  import Glibc
#endif

/// Time conversions between the kernel's `timespec` and stored nanoseconds.
public enum FileTime {
  /// A stored time (nanoseconds since the epoch, negative before 1970) as a timespec: whole
  /// seconds rounded down and 0 <= tv_nsec < 1e9.
  public static func timespec(_ ns: Int64) -> Glibc.timespec {
    var sec = ns / 1_000_000_000
    var nsec = ns % 1_000_000_000
    if nsec < 0 {
      sec -= 1
      nsec += 1_000_000_000
    }
    return Glibc.timespec(tv_sec: Int(sec), tv_nsec: Int(nsec))
  }

  /// A time from the kernel in stored form. Times outside what 64-bit nanoseconds hold
  /// (before 1677-09-21 or after 2262-04-11) are refused with EOVERFLOW; a bad tv_nsec with
  /// EINVAL.
  public static func nanoseconds(_ t: Glibc.timespec) throws -> Int64 {
    guard t.tv_nsec >= 0 && t.tv_nsec < 1_000_000_000 else {
      throw UbiqError.invalidArgument("tv_nsec \(t.tv_nsec) out of range")
    }
    let (secNs, o1) = Int64(t.tv_sec).multipliedReportingOverflow(by: 1_000_000_000)
    let (total, o2) = secNs.addingReportingOverflow(Int64(t.tv_nsec))
    if o1 || o2 { throw UbiqError.overflow("time \(t.tv_sec) s is outside 1677-2262") }
    return total
  }
}
