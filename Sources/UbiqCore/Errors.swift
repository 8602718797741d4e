import Foundation

#if canImport(Glibc)
  import Glibc
#endif

/// A typed failure anywhere in ubiqfs. Every case maps to the errno a FUSE reply carries,
/// and to a one-line message the CLI prints.
public enum UbiqError: Error, Equatable, CustomStringConvertible, Sendable {
  case notFound(String)
  case exists(String)
  case notDirectory(String)
  case isDirectory(String)
  case notEmpty(String)
  case nameTooLong(String)
  case invalidArgument(String)
  case notPermitted(String)
  case notSupported(String)
  case noData(String)
  case range(String)
  case io(String)
  case quotaExceeded(String)
  case conflict(String)
  case unavailable(String)
  case busy(String)
  case accessDenied(String)

  public var errno: Int32 {
    switch self {
    case .notFound: return ENOENT
    case .exists: return EEXIST
    case .notDirectory: return ENOTDIR
    case .isDirectory: return EISDIR
    case .notEmpty: return ENOTEMPTY
    case .nameTooLong: return ENAMETOOLONG
    case .invalidArgument: return EINVAL
    case .notPermitted: return EPERM
    case .notSupported: return EOPNOTSUPP
    case .noData: return ENODATA
    case .range: return ERANGE
    case .io: return EIO
    case .quotaExceeded: return EDQUOT
    case .conflict: return EBUSY
    case .unavailable: return EHOSTUNREACH
    case .busy: return EBUSY
    case .accessDenied: return EACCES
    }
  }

  public var description: String {
    switch self {
    case .notFound(let m): return "not found: \(m)"
    case .exists(let m): return "already exists: \(m)"
    case .notDirectory(let m): return "not a directory: \(m)"
    case .isDirectory(let m): return "is a directory: \(m)"
    case .notEmpty(let m): return "directory not empty: \(m)"
    case .nameTooLong(let m): return "name too long: \(m)"
    case .invalidArgument(let m): return "invalid argument: \(m)"
    case .notPermitted(let m): return "not permitted: \(m)"
    case .notSupported(let m): return "not supported: \(m)"
    case .noData(let m): return "no such attribute: \(m)"
    case .range(let m): return "buffer too small: \(m)"
    case .io(let m): return "I/O error: \(m)"
    case .quotaExceeded(let m): return "quota exceeded (EDQUOT): \(m)"
    case .conflict(let m): return "conflict: \(m)"
    case .unavailable(let m): return "cloud unavailable: \(m)"
    case .busy(let m): return "busy: \(m)"
    case .accessDenied(let m): return "access denied: \(m)"
    }
  }
}
