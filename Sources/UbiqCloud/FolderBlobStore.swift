import Foundation
import UbiqCloudAPI
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// Chunks as files: `<root>/<account>/<first two hex digits>/<hash>`, written to a temporary
/// file, fsynced and renamed into place so a crash never leaves a torn chunk.
/// Sendable: immutable; concurrent writers of one chunk each use their own temporary file.
public final class FolderBlobStore: BlobStore, @unchecked Sendable {
  let root: URL
  /// `root`'s path, for building a chunk's path without `URL` (it is built for every read and write).
  let rootPath: String

  public init(root: URL) throws {
    self.root = root
    rootPath = root.path
    try FileManager.default.createDirectory(at: root, withIntermediateDirectories: true)
  }

  func path(_ account: String, _ hash: String) -> String {
    "\(rootPath)/\(account)/\(hash.prefix(2))/\(hash)"
  }

  public func contains(account: String, hash: String) async throws -> Bool {
    access(path(account, hash), F_OK) == 0
  }

  public func put(account: String, hash: String, data: Data) async throws {
    try await offload { try self.putSync(account: account, hash: hash, data: data) }
  }

  public func get(account: String, hash: String, range: Range<Int64>?) async throws -> Data {
    try await offload { try self.getSync(account: account, hash: hash, range: range) }
  }

  public func delete(account: String, hash: String) async throws {
    try await offload {
      let p = self.path(account, hash)
      if unlink(p) != 0 && errno != ENOENT {
        throw UbiqError.io("removing chunk \(hash): \(String(cString: strerror(errno)))")
      }
    }
  }

  func putSync(account: String, hash: String, data: Data) throws {
    let final = path(account, hash)
    let dir = (final as NSString).deletingLastPathComponent
    let accountDir = (dir as NSString).deletingLastPathComponent
    // Folders made here are fsync'ed into their parents, up to the blob root.
    var created: [String] = []
    for d in [(accountDir as NSString).deletingLastPathComponent, accountDir, dir]
    where !FileManager.default.fileExists(atPath: d) {
      created.append(d)
    }
    try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
    for d in created.reversed() { try Durability.fsyncDirectory((d as NSString).deletingLastPathComponent) }
    let tmp = final + ".tmp.\(getpid()).\(UInt32.random(in: 0...UInt32.max))"
    let fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
    guard fd >= 0 else { throw UbiqError.io("cannot create \(tmp): \(String(cString: strerror(errno)))") }
    defer { close(fd) }
    try data.withUnsafeBytes { raw in
      var done = 0
      while done < raw.count {
        let n = write(fd, raw.baseAddress! + done, raw.count - done)
        if n < 0 {
          if errno == EINTR { continue }
          unlink(tmp)
          throw UbiqError.io("write \(tmp): \(String(cString: strerror(errno)))")
        }
        done += n
      }
    }
    guard fsync(fd) == 0, rename(tmp, final) == 0 else {
      unlink(tmp)
      throw UbiqError.io("storing chunk \(hash): \(String(cString: strerror(errno)))")
    }
    // The new name is durable before the chunk is recorded and the upload acknowledged.
    try Durability.fsyncDirectory(dir)
  }

  func getSync(account: String, hash: String, range: Range<Int64>?) throws -> Data {
    let p = path(account, hash)
    let fd = open(p, O_RDONLY | O_CLOEXEC)
    guard fd >= 0 else { throw CloudError.notFound("chunk \(hash)") }
    defer { close(fd) }
    var st = stat()
    fstat(fd, &st)
    let size = Int64(st.st_size)
    let lower = max(0, min(range?.lowerBound ?? 0, size))
    let upper = max(lower, min(range?.upperBound ?? size, size))
    var out = Data(count: Int(upper - lower))
    try out.withUnsafeMutableBytes { raw in
      var done = 0
      while done < raw.count {
        let n = pread(fd, raw.baseAddress! + done, raw.count - done, off_t(lower) + off_t(done))
        if n < 0 && errno == EINTR { continue }
        if n <= 0 { throw UbiqError.io("short read of chunk \(hash)") }
        done += n
      }
    }
    return out
  }
}

/// Runs blocking file I/O on a dispatch queue instead of a Swift concurrency thread.
func offload<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
  try await withCheckedThrowingContinuation { cont in
    blockingIOQueue.async { cont.resume(with: Result { try body() }) }
  }
}

let blockingIOQueue = DispatchQueue(label: "ubiqfs.blob-io", qos: .userInitiated, attributes: .concurrent)
