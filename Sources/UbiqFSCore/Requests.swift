import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// Tunables of a mount.
public struct MountOptions: Sendable {
  /// How long the kernel may cache entries and attributes, in seconds.
  public var attrTimeout: Double = 60.0
  public var entryTimeout: Double = 60.0
  public var maxThreads: Int = 16
  public var debug = false
  /// Content cache budget in bytes (0: no limit) and the free space to keep on the cache's disk.
  public var cacheBudgetBytes: Int64 = 0
  public var minFreeBytes: Int64 = 1 << 30
  /// Process names (as in /proc/PID/comm) whose reads must never trigger a download: they get
  /// EACCES on evicted files instead. Indexers and thumbnailers by default.
  public var noDownloadPrograms: Set<String> = [
    "tracker-miner-f", "tracker-extract", "tracker-extract-3", "tracker-miner-fs-3", "baloo_file",
    "baloo_file_extractor", "updatedb", "updatedb.plocate", "plocate", "mlocate", "tumblerd", "ffmpegthumbnailer",
    "gdk-pixbuf-thumbnailer", "totem-video-thumbnailer", "evince-thumbnailer", "gnome-desktop-thumbnailer",
  ]
  public init() {}
}

/// Who makes a request: the calling process's credentials and pid (0 when unknown).
public struct Caller: Sendable, Equatable {
  public var uid: UInt32
  public var gid: UInt32
  public var pid: Int32
  public init(uid: UInt32, gid: UInt32, pid: Int32 = 0) {
    self.uid = uid
    self.gid = gid
    self.pid = pid
  }
  /// The daemon's own user, for requests made on its behalf (tests, CLI actions).
  public static var current: Caller { Caller(uid: getuid(), gid: getgid(), pid: 0) }
}

/// The attributes the filesystem reports for an inode (what `stat` shows).
public struct FileAttributes: Sendable, Equatable {
  public var inode: Int64
  public var kind: ItemKind
  /// Permission bits only (0o7777); the file type is `kind`.
  public var mode: UInt32
  public var linkCount: Int
  public var uid: UInt32
  public var gid: UInt32
  public var size: Int64
  /// 512-byte blocks held locally (0 for evicted content).
  public var blocks: Int64
  public var atimeNs: Int64
  public var mtimeNs: Int64
  public var ctimeNs: Int64
}

/// A time to set: the request's own value (nanoseconds since the epoch) or the current time.
public enum TimeUpdate: Sendable, Equatable {
  case now
  case at(Int64)
}

/// The attributes a setattr request changes (nil: unchanged).
public struct AttributeUpdate: Sendable, Equatable {
  public var mode: UInt32?
  public var uid: UInt32?
  public var gid: UInt32?
  public var size: Int64?
  public var atime: TimeUpdate?
  public var mtime: TimeUpdate?
  public init(
    mode: UInt32? = nil, uid: UInt32? = nil, gid: UInt32? = nil, size: Int64? = nil, atime: TimeUpdate? = nil,
    mtime: TimeUpdate? = nil
  ) {
    self.mode = mode
    self.uid = uid
    self.gid = gid
    self.size = size
    self.atime = atime
    self.mtime = mtime
  }
}

/// renameat2 flags (Linux values).
public struct RenameFlags: OptionSet, Sendable {
  public let rawValue: UInt32
  public init(rawValue: UInt32) { self.rawValue = rawValue }
  public static let noReplace = RenameFlags(rawValue: 1 << 0)
  public static let exchange = RenameFlags(rawValue: 1 << 1)
}

/// setxattr flags (Linux values).
public struct XattrFlags: OptionSet, Sendable {
  public let rawValue: Int32
  public init(rawValue: Int32) { self.rawValue = rawValue }
  public static let create = XattrFlags(rawValue: 1)
  public static let replace = XattrFlags(rawValue: 2)
}

/// An open handle handed to the kernel.
public struct OpenedFile: Sendable, Equatable {
  public var handle: UInt64
  /// Whether the kernel may keep the pages it has cached for this inode.
  public var keepCache: Bool
}

/// One directory listing entry; `nextOffset` is the cursor that continues after it.
public struct DirectoryEntry: Sendable, Equatable {
  public var name: String
  public var attributes: FileAttributes
  public var nextOffset: Int64
}

/// The answer to getxattr/listxattr: the size a zero-size query asks for, or the bytes.
public enum XattrAnswer: Sendable, Equatable {
  case size(Int)
  case value(Data)
}
