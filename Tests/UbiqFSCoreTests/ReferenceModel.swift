import Foundation
import UbiqCore

#if canImport(Glibc)
  import Glibc
#endif

/// An in-memory reference of what a POSIX filesystem (ext4) does for the operations the model
/// test issues: a tree of numbered nodes, open handles on node numbers (an unlinked node lives
/// while a handle holds it), and the errno each failing call must give. Where a file's bytes
/// are (evicted, downloading, uploaded) does not change anything here: the mount must look the
/// same whatever it is. `ModelRun` models that content state on the side and checks it through
/// `user.ubiq.content_state`.
struct ReferenceModel {
  enum Node: Equatable {
    case file(Data)
    case directory
  }

  var nodes: [Int: Node] = [:]
  /// path below Documents -> node number
  var paths: [String: Int] = [:]
  var mtimes: [Int: Int64] = [:]
  var xattrs: [Int: [String: Data]] = [:]
  /// Permission bits set by chmod (nodes not listed keep the mode they were made with).
  var modes: [Int: UInt32] = [:]
  var nextNode = 1

  func parentPath(_ p: String) -> String? {
    guard let i = p.lastIndex(of: "/") else { return nil }
    return String(p[..<i])
  }

  /// The errno resolving the parent folder of `p` gives, if any.
  func parentError(_ p: String) -> Int32? {
    guard let parent = parentPath(p) else { return nil }
    if let e = parentError(parent) { return e }
    guard let id = paths[parent] else { return ENOENT }
    return nodes[id] == .directory ? nil : ENOTDIR
  }

  func children(_ dir: String) -> [String] {
    paths.keys.filter { parentPath($0) == (dir.isEmpty ? nil : dir) }
  }

  mutating func newNode(_ n: Node) -> Int {
    let id = nextNode
    nextNode += 1
    nodes[id] = n
    return id
  }

  mutating func create(_ p: String) -> Int32 {
    if let e = parentError(p) { return e }
    if paths[p] != nil { return EEXIST }
    paths[p] = newNode(.file(Data()))
    return 0
  }

  mutating func mkdir(_ p: String) -> Int32 {
    if let e = parentError(p) { return e }
    if paths[p] != nil { return EEXIST }
    paths[p] = newNode(.directory)
    return 0
  }

  func lookupFile(_ p: String) -> (Int, Int32) {
    if let e = parentError(p) { return (0, e) }
    guard let id = paths[p] else { return (0, ENOENT) }
    if nodes[id] == .directory { return (id, EISDIR) }
    return (id, 0)
  }

  mutating func write(node id: Int, offset: Int, _ bytes: Data) {
    guard case .file(var d) = nodes[id] else { return }
    mtimes[id] = nil  // a write sets mtime to now
    if d.count < offset { d.append(Data(count: offset - d.count)) }
    let end = offset + bytes.count
    if d.count < end { d.append(Data(count: end - d.count)) }
    d.replaceSubrange(offset..<end, with: bytes)
    nodes[id] = .file(d)
  }

  mutating func truncate(node id: Int, to size: Int) {
    guard case .file(var d) = nodes[id] else { return }
    mtimes[id] = nil
    if d.count > size { d = d.prefix(size) } else { d.append(Data(count: size - d.count)) }
    nodes[id] = .file(d)
  }

  mutating func unlink(_ p: String) -> Int32 {
    if let e = parentError(p) { return e }
    guard let id = paths[p] else { return ENOENT }
    if nodes[id] == .directory { return EISDIR }
    paths[p] = nil
    return 0
  }

  mutating func rmdir(_ p: String) -> Int32 {
    if let e = parentError(p) { return e }
    guard let id = paths[p] else { return ENOENT }
    if nodes[id] != .directory { return ENOTDIR }
    if !children(p).isEmpty { return ENOTEMPTY }
    paths[p] = nil
    return 0
  }

  /// `flags`: 0, RENAME_NOREPLACE (1) or RENAME_EXCHANGE (2).
  mutating func rename(_ from: String, _ to: String, flags: UInt32) -> Int32 {
    if let e = parentError(from) { return e }
    if let e = parentError(to) { return e }
    guard let src = paths[from] else { return ENOENT }
    let dst = paths[to]
    // The kernel's order: NOREPLACE over a taken name, EXCHANGE with a missing name, then the
    // ancestor checks.
    if flags == 2 && dst == nil { return ENOENT }
    if flags == 1 && dst != nil { return EEXIST }
    if from == to { return 0 }
    // A directory never moves below itself (for an exchange, in either direction).
    if nodes[src] == .directory && to.hasPrefix(from + "/") { return EINVAL }
    if flags == 2, let dst, nodes[dst] == .directory, from.hasPrefix(to + "/") { return EINVAL }
    if let dst {
      if flags == 1 { return EEXIST }
      if flags == 0 {
        let srcDir = nodes[src] == .directory
        let dstDir = nodes[dst] == .directory
        if dstDir && !srcDir { return EISDIR }
        if !dstDir && srcDir { return ENOTDIR }
        if dstDir && !children(to).isEmpty { return ENOTEMPTY }
      }
    }
    // Move every path below `from` (and, for an exchange, below `to`) in one step.
    var moved: [String: Int] = [:]
    for (p, id) in paths {
      if p == from || p.hasPrefix(from + "/") {
        moved[to + p.dropFirst(from.count)] = id
      } else if flags == 2 && (p == to || p.hasPrefix(to + "/")) {
        moved[from + p.dropFirst(to.count)] = id
      } else if p == to || p.hasPrefix(to + "/") {
        continue  // replaced (an empty directory or a file)
      } else {
        moved[p] = id
      }
    }
    paths = moved
    return 0
  }

  /// Everything a listing and reads show: path -> "dir" or the file's bytes.
  var visibleTree: [String: Data?] {
    var out: [String: Data?] = [:]
    for (p, id) in paths {
      switch nodes[id]! {
      case .directory: out[p] = .some(nil)
      case .file(let d): out[p] = .some(d)
      }
    }
    return out
  }
}
