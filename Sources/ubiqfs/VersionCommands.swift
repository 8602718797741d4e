import ArgumentParser
import CFuse3
import Foundation
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqDaemon
import UbiqIndex

#if canImport(Glibc)
  import Glibc
#endif

/// `ubiqfs versions PATH`: the current version of a file and its unresolved conflict versions.
struct VersionsCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "versions", abstract: "List a file's current version and its unresolved conflict versions.")

  @Argument(help: "A file inside a mount.") var path: String
  @Flag(help: "Machine-readable output.") var json = false
  @Option(help: "Write that version's content to standard output (a version id, or 'current').")
  var cat: String?
  @OptionGroup var location: LocationOptions

  struct Entry: Codable {
    var version: String
    var current: Bool
    var device: String
    var mtime: String
    var size: Int64
  }

  func run() throws {
    try cli {
      let (state, inode) = try ContainerState.locate(path, location.paths)
      guard let row = try state.openIndex().item(inode) else { throw UbiqError.notFound(path) }
      guard row.kind == .file else { throw UbiqError.invalidArgument("\(path) is not a file") }
      if let cat {
        let chunks: [ChunkRef]
        if cat == "current" || cat == row.etag.map({ "v\($0)" }) {
          chunks = row.chunkList
        } else if let v = row.conflictList.first(where: { $0.versionID == cat }) {
          chunks = v.chunks
        } else {
          throw UbiqError.notFound("no version \(cat) of \(path) (see 'ubiqfs versions')")
        }
        try writeVersion(chunks)
        return
      }
      let fmt = ISO8601DateFormatter()
      func time(_ ns: Int64) -> String { fmt.string(from: Date(timeIntervalSince1970: Double(ns) / 1e9)) }
      var entries = [
        Entry(
          version: row.etag.map { "v\($0)" } ?? "local", current: true,
          device: row.baseItem?.contentAuthor ?? "this device",
          mtime: time(row.mtimeNs), size: row.size)
      ]
      for v in row.conflictList {
        entries.append(
          Entry(version: v.versionID, current: false, device: v.deviceID, mtime: time(v.mtimeNs), size: v.size))
      }
      if json {
        let enc = JSONEncoder()
        enc.outputFormatting = [.prettyPrinted, .sortedKeys]
        print(String(decoding: try enc.encode(entries), as: UTF8.self))
        return
      }
      for e in entries {
        print("\(e.current ? "*" : " ") \(e.version)\t\(e.mtime)\t\(e.size) bytes\tdevice \(e.device)")
      }
    }
  }
}

extension VersionsCommand {
  /// Streams a version's chunks from the cloud to standard output, verifying each hash.
  func writeVersion(_ chunks: [ChunkRef]) throws {
    let cloud = try CloudSession.open(location.paths).makeCloud()
    for chunk in chunks {
      let data = try runBlocking { try await cloud.getChunk(hash: chunk.hash, range: nil) }
      guard Chunker.sha256Hex(data) == chunk.hash else { throw UbiqError.io("chunk \(chunk.hash) is corrupt") }
      FileHandle.standardOutput.write(data)
    }
  }
}

/// `ubiqfs resolve PATH --keep current|VERSION`: resolves a file's conflicts.
struct ResolveCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "resolve", abstract: "Resolve conflicts: keep the current version or another, drop the rest.")

  @Argument(help: "A file inside a mount.") var path: String
  @Option(help: "'current' or a version id from 'ubiqfs versions'.") var keep: String

  func run() throws {
    try cli {
      let abs = absolutePath(path)
      if setxattr(abs, "user.ubiq.resolve", keep, keep.utf8.count, 0) != 0 {
        let err = errno
        switch err {
        case ENOENT: throw UbiqError.notFound("\(keep) is not a version of \(abs) (see 'ubiqfs versions')")
        case EBUSY: throw UbiqError.busy("\(abs) is open or still uploading; try again")
        case ENOTSUP, EOPNOTSUPP: throw UbiqError.invalidArgument("\(abs) is not inside a ubiqfs mount")
        default: throw UbiqError.io("resolve \(abs): \(String(cString: strerror(err)))")
        }
      }
    }
  }
}
