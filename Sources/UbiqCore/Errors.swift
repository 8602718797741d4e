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
  /// A value does not fit what can be stored (a time past 2262, a size past Int64).
  case overflow(String)
  /// A file would grow past the largest size ubiqfs stores.
  case fileTooLarge(String)
  /// The disk under the state folder is full.
  case noSpace(String)
  /// A name that is not valid UTF-8.
  case illegalByteSequence(String)
  /// The caller gave up on the request (a signal interrupted its system call).
  case interrupted(String)

  /// A failed system call on local storage (the cache, the index's disk), keeping the errno a
  /// user can act on: ENOSPC and EDQUOT (disk full), EFBIG; anything else is an I/O error.
  public static func posix(_ code: Int32, _ what: String) -> UbiqError {
    let why = "\(what): \(String(cString: strerror(code)))"
    switch code {
    case ENOSPC: return .noSpace(why)
    case EDQUOT: return .quotaExceeded(why)
    case EFBIG: return .fileTooLarge(why)
    default: return .io(why)
    }
  }

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
    case .overflow: return EOVERFLOW
    case .fileTooLarge: return EFBIG
    case .noSpace: return ENOSPC
    case .illegalByteSequence: return EILSEQ
    case .interrupted: return EINTR
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
    case .overflow(let m): return "value too large: \(m)"
    case .fileTooLarge(let m): return "file too large: \(m)"
    case .noSpace(let m): return "no space left on the state folder's disk: \(m)"
    case .illegalByteSequence(let m): return "name is not valid UTF-8: \(m)"
    case .interrupted(let m): return "interrupted: \(m)"
    }
  }
}
