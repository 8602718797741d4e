import Foundation
import PropertyBased
import Testing
import UbiqCore

@testable import UbiqFSCore

#if canImport(Glibc)
  import Glibc
#endif

/// One generated step: what to do (`kind`) and its arguments, all small integers so that the
/// shrinker can make a failing sequence short and simple.
struct ModelStep: Sendable, CustomStringConvertible {
  var kind: Int
  var a: Int
  var b: Int
  var n: Int

  static let paths = ["a", "b", "c", "a/a", "a/b", "b/a", "b/c", "c/b", "a/b/c"]
  static let kinds = [
    "create", "write", "truncate", "read", "rename", "unlink", "mkdir", "rmdir", "setmtime", "evict", "open",
    "writeOpen", "readOpen", "close", "crash", "setxattr", "chmod", "download", "pin", "remoteWrite",
  ]
  /// How often each kind is drawn (out of 37): namespace changes and evictions of files that
  /// have content are what finds bugs, so they come often.
  static let weights = [4, 4, 1, 2, 4, 2, 2, 1, 1, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 2]
  /// The kind a drawn number 0..<37 stands for.
  static let drawnKinds: [Int] = weights.enumerated().flatMap { Array(repeating: $0.offset, count: $0.element) }
  var p: String { Self.paths[a % Self.paths.count] }
  var q: String { Self.paths[b % Self.paths.count] }
  var description: String { "\(Self.kinds[kind % Self.kinds.count])(\(p), \(q), \(n))" }
}

/// Where the model expects a file's bytes to be (`ModelRun.expectedContentStates`).
enum ModelResidency {
  /// In the cache file.
  case here
  /// Evicted or replaced remotely: only in the cloud.
  case evicted
  /// A pinned file's new version is being fetched in the background.
  case fetching
  /// A reader may have started (and finished, or stopped) a download.
  case unsure
  /// A background fetch may still start, run or have finished (the file was unpinned or
  /// evicted while its fetch waited or ran): no later eviction settles it.
  case fetchMayRun
}

/// Drives the real filesystem core (real index, cache, uploader, downloader and embedded cloud)
/// and the reference model with the same steps, and checks after every step that results,
/// errnos, listings, contents and each file's content state agree.
final class ModelRun {
  let world: CoreWorld
  var model = ReferenceModel()
  /// Open handles: the model's node, the core's handle, and whether it wrote since its last
  /// flush.
  var held: [(node: Int, handle: UInt64, writable: Bool, wrote: Bool)] = []
  var log: [String] = []
  /// The content-state side of the model, per file node: changes made here and not uploaded
  /// yet (`dirty`), where the bytes are, and pinned files.
  var pending: Set<Int> = []
  var residency: [Int: ModelResidency] = [:]
  var pinned: Set<Int> = []
  /// A second device on the same cloud, for changes made elsewhere (made at first use).
  var otherDevice: CoreWorld?

  init() throws { world = try CoreWorld() }
  nonisolated(unsafe) static var stats: [String: Int] = [:]

  var core: FilesystemCore { world.core }

  func errno(_ body: () throws -> Void) -> Int32 {
    do {
      try body()
      return 0
    } catch let e as UbiqError {
      return e.errno
    } catch {
      return -1
    }
  }

  /// Resolves a path the way the kernel walks it: ENOENT for a missing part, ENOTDIR when a
  /// part that must be a folder is a file.
  func resolve(_ path: String) throws -> FileAttributes {
    var cur = try core.getattr(world.documents)
    for part in path.split(separator: "/") {
      guard cur.kind == .directory else { throw UbiqError.notDirectory(path) }
      guard let next = try core.lookup(parent: cur.inode, name: String(part)) else { throw UbiqError.notFound(path) }
      cur = next
    }
    return cur
  }

  /// Whether a file's content is evicted (what `user.ubiq.status` says).
  func isEvicted(_ path: String) throws -> Bool {
    try core.getxattr(try resolve(path).inode, name: "user.ubiq.status", size: 64)
      == .value(Data("not_downloaded".utf8))
  }

  func parentAndName(_ path: String) throws -> (Int64, String) {
    let parts = path.split(separator: "/").map(String.init)
    let parent = try resolve(parts.dropLast().joined(separator: "/"))
    guard parent.kind == .directory else { throw UbiqError.notDirectory(path) }
    return (parent.inode, parts.last!)
  }

  func bytes(_ step: ModelStep) -> Data {
    let count = (step.b &* 997 &+ step.n) % 3000 + 1
    return Data((0..<count).map { UInt8(truncatingIfNeeded: $0 &+ step.n &* 31 &+ step.a) })
  }

  func expectSame(_ got: Int32, _ want: Int32, _ step: ModelStep) {
    #expect(got == want, "\(step): errno \(got), the model says \(want); steps: \(log)")
  }

  func run(_ step: ModelStep) throws {
    log.append(step.description)
    ModelRun.stats["steps", default: 0] += 1
    let p = step.p
    let q = step.q
    switch step.kind % ModelStep.kinds.count {
    case 0:  // create (O_CREAT|O_EXCL)
      let want = model.create(p)
      let got = errno {
        let (parent, name) = try parentAndName(p)
        if try core.lookup(parent: parent, name: name) != nil { throw UbiqError.exists(p) }
        let (_, opened) = try core.create(parent: parent, name: name, mode: 0o644, caller: .current)
        core.release(opened.handle)
      }
      expectSame(got, want, step)
      if got == 0, let id = model.paths[p] { changedHere(id) }
    case 1:  // open, write at an offset, close
      let (node, want) = model.lookupFile(p)
      let data = bytes(step)
      let offset = step.n % 5000
      let got = errno {
        let a = try resolve(p)
        if a.kind == .directory { throw UbiqError.isDirectory(p) }
        let h = try core.open(a.inode, flags: O_WRONLY, caller: .current).handle
        defer { core.release(h) }
        _ = try data.withUnsafeBytes { try core.write(h, $0, offset: Int64(offset)) }
        try core.flush(h)
      }
      if want == 0 {
        model.write(node: node, offset: offset, data)
        changedHere(node)
      }
      expectSame(got, want, step)
    case 2:  // truncate(2)
      let (node, want) = model.lookupFile(p)
      let size = step.n % 6000
      let got = errno {
        let a = try resolve(p)
        if a.kind == .directory { throw UbiqError.isDirectory(p) }
        _ = try core.setattr(a.inode, AttributeUpdate(size: Int64(size)))
      }
      if want == 0 {
        model.truncate(node: node, to: size)
        changedHere(node)
      }
      expectSame(got, want, step)
    case 3:  // read whole file (checked by `check` too; here through a fresh open)
      let (node, want) = model.lookupFile(p)
      var content = Data()
      let got = errno {
        let a = try resolve(p)
        if a.kind == .directory { throw UbiqError.isDirectory(p) }
        let h = try core.open(a.inode, flags: O_RDONLY, caller: .current).handle
        defer { core.release(h) }
        content = try core.read(h, offset: 0, size: Int(a.size) + 10)
      }
      expectSame(got, want, step)
      if want == 0, case .file(let d) = model.nodes[node] { #expect(content == d, "\(step): content; steps: \(log)") }
      if want == 0 { readHere(node) }
    case 4:  // rename / RENAME_NOREPLACE / RENAME_EXCHANGE
      let flags = UInt32(step.n % 3)
      if let a = try? resolve(p), a.blocks == 0, a.size > 0 {
        ModelRun.stats["rename of an evicted file", default: 0] += 1
      }
      let moving = [model.paths[p], model.paths[q]]
      let want = model.rename(p, q, flags: flags)
      let got = errno {
        let (fromParent, fromName) = try parentAndName(p)
        let (toParent, toName) = try parentAndName(q)
        if try core.lookup(parent: fromParent, name: fromName) == nil { throw UbiqError.notFound(p) }
        if p == q {
          if flags == 1 { throw UbiqError.exists(q) }
          return
        }
        try core.rename(
          parent: fromParent, name: fromName, newParent: toParent, newName: toName,
          flags: RenameFlags(rawValue: flags))
      }
      expectSame(got, want, step)
      // The moved item (both, for an exchange) has a new name to upload.
      if got == 0 && p != q {
        if let id = moving[0] { pending.insert(id) }
        if flags == 2, let id = moving[1] { pending.insert(id) }
      }
    case 5:
      let want = model.unlink(p)
      let got = errno {
        let (parent, name) = try parentAndName(p)
        try core.unlink(parent: parent, name: name)
      }
      expectSame(got, want, step)
    case 6:
      let want = model.mkdir(p)
      let got = errno {
        let (parent, name) = try parentAndName(p)
        if try core.lookup(parent: parent, name: name) != nil { throw UbiqError.exists(p) }
        _ = try core.mkdir(parent: parent, name: name, mode: 0o755, caller: .current)
      }
      expectSame(got, want, step)
    case 7:
      let want = model.rmdir(p)
      let got = errno {
        let (parent, name) = try parentAndName(p)
        try core.rmdir(parent: parent, name: name)
      }
      expectSame(got, want, step)
    case 8:  // utimensat with times before 1970, at 0 and far ahead
      let times: [Int64] = [-1_500_000_000, 0, 4_102_444_800_123_456_789, Int64(step.n) * 1_000_000_007]
      let t = times[step.b % times.count]
      let want: Int32 = model.parentError(p) ?? (model.paths[p] == nil ? ENOENT : 0)
      let got = errno {
        let a = try resolve(p)
        let after = try core.setattr(a.inode, AttributeUpdate(mtime: .at(t)))
        #expect(after.mtimeNs == t, "\(step): mtime; steps: \(log)")
      }
      // A folder's mtime moves with every change inside it: the model keeps files' only.
      if want == 0, let id = model.paths[p], model.nodes[id] != .directory {
        model.mtimes[id] = t
        pending.insert(id)
      }
      expectSame(got, want, step)
    case 9 where step.n % 2 == 1:  // upload everything, then evict every file that is not open
      try drainUploads()
      for (path, id) in model.paths where model.nodes[id] != .directory {
        // Evicting an evicted file is a no-op; an open, pinned or still pending file with
        // local content is refused.
        let evicted = try isEvicted(path)
        let refused = (held.contains { $0.node == id } || pinned.contains(id) || pending.contains(id)) && !evicted
        let got = errno { try core.evict(try resolve(path).inode) }
        // A pinned file's fetch may end between the look and the eviction: still dataless (a
        // no-op), or cached and pinned (EBUSY).
        let fetching = [.fetching, .fetchMayRun].contains(residency[id]) && got == EBUSY
        expectSame(got, refused || fetching ? EBUSY : 0, step)
        if got == 0 { evictedHere(id) }
        ModelRun.stats["evict-all file", default: 0] += 1
        if got == 0, let a = try? resolve(path), a.blocks == 0, a.size > 0 {
          ModelRun.stats["evicted by all", default: 0] += 1
        }
      }
      ModelRun.stats["evict-all", default: 0] += 1
    case 9:  // evict after everything was uploaded: refused only while the file is open, pinned or pending
      try drainUploads()
      var want: Int32 = model.parentError(p) ?? (model.paths[p] == nil ? ENOENT : 0)
      if want == 0, let id = model.paths[p],
        held.contains(where: { $0.node == id }) || pinned.contains(id) || pending.contains(id),
        !(try isEvicted(p))
      {
        want = EBUSY
      }
      let got = errno { try core.evict(try resolve(p).inode) }
      if got == 0, let id = model.paths[p] { evictedHere(id) }
      if got == 0, let a = try? resolve(p), a.blocks == 0, a.size > 0 { ModelRun.stats["evicted", default: 0] += 1 }
      if got == EBUSY, let id = model.paths[p],
        [.fetching, .fetchMayRun].contains(residency[id])
      {
        want = EBUSY
      }
      expectSame(got, want, step)
    case 10:  // open and keep the handle
      guard held.count < 3 else { return }
      let writable = step.n % 2 == 0
      let (node, want) = model.lookupFile(p)
      var handle: UInt64 = 0
      let got = errno {
        let a = try resolve(p)
        if a.kind == .directory { throw UbiqError.isDirectory(p) }
        handle = try core.open(a.inode, flags: writable ? O_RDWR : O_RDONLY, caller: .current).handle
      }
      expectSame(got, want, step)
      if got == 0 {
        held.append((node, handle, writable, false))
        // A writer needs the whole content here; a reader streams what it reads.
        if writable { residency[node] = .here } else { readHere(node) }
      }
    case 11:  // write through a kept handle (no flush)
      // The kernel refuses writes through a read-only descriptor (EBADF) before asking us.
      let writable = held.indices.filter { held[$0].writable }
      guard !writable.isEmpty else { return }
      let i = writable[step.a % writable.count]
      let h = held[i]
      let data = bytes(step)
      let offset = step.n % 5000
      let got = errno { _ = try data.withUnsafeBytes { try core.write(h.handle, $0, offset: Int64(offset)) } }
      expectSame(got, 0, step)
      if got == 0 {
        model.write(node: h.node, offset: offset, data)
        held[i].wrote = true
      }
    case 12:  // read through a kept handle, also after the file was unlinked or renamed
      guard !held.isEmpty else { return }
      let h = held[step.a % held.count]
      guard case .file(let d) = model.nodes[h.node] else { return }
      let got = try core.read(h.handle, offset: 0, size: d.count + 10)
      #expect(got == d, "\(step): read through an open handle; steps: \(log)")
    case 13:
      guard !held.isEmpty else { return }
      let h = held.remove(at: step.a % held.count)
      core.release(h.handle)
      // Its writes are recorded and queued.
      if h.wrote { pending.insert(h.node) }
    case 14:  // the daemon dies: handles vanish unflushed; nothing written may be lost
      // Their writes are found at the restart and queued; pinned files still being fetched are
      // fetched again.
      for h in held where h.wrote { pending.insert(h.node) }
      held.removeAll()
      try world.crashAndRestart()
    case 15:  // user xattr
      let want: Int32 = model.parentError(p) ?? (model.paths[p] == nil ? ENOENT : 0)
      let value = Data("v\(step.n)".utf8)
      let got = errno {
        let a = try resolve(p)
        try core.setxattr(a.inode, name: "user.k", value: value, flags: [])
      }
      expectSame(got, want, step)
      if want == 0 {
        model.xattrs[model.paths[p]!, default: [:]]["user.k"] = value
        pending.insert(model.paths[p]!)
      }
    case 16:  // chmod
      let mode: UInt32 = [0o600, 0o644, 0o640, 0o755][step.n % 4]
      let want: Int32 = model.parentError(p) ?? (model.paths[p] == nil ? ENOENT : 0)
      // The mode before (the check after every step compares it with the model's): a mode
      // set to what it is is no change to upload.
      let before = (try? resolve(p)).map { $0.mode & 0o7777 }
      let got = errno { _ = try core.setattr(try resolve(p).inode, AttributeUpdate(mode: mode)) }
      expectSame(got, want, step)
      if got == 0, let id = model.paths[p] {
        model.modes[id] = mode
        if before != mode { pending.insert(id) }
      }
    case 17:  // ubiqfs download
      let want: Int32 = model.parentError(p) ?? (model.paths[p] == nil ? ENOENT : 0)
      let got = errno { try core.download(try resolve(p).inode) }
      expectSame(got, want, step)
      if got == 0, let id = model.paths[p], model.nodes[id] != .directory { residency[id] = .here }
    case 18:  // ubiqfs pin / unpin
      let pin = step.n % 2 == 0
      let want: Int32 = model.parentError(p) ?? (model.paths[p] == nil ? ENOENT : 0)
      let got = errno {
        try core.setxattr(
          try resolve(p).inode, name: "user.ubiq.pinned", value: Data(pin ? "1".utf8 : "0".utf8), flags: [])
      }
      expectSame(got, want, step)
      if got == 0, let id = model.paths[p], model.nodes[id] != .directory {
        if pin {
          pinned.insert(id)
          residency[id] = .here
        } else {
          pinned.remove(id)
          // A fetch still waiting for its turn is dropped; one already running goes on.
          if residency[id] == .fetching { residency[id] = .fetchMayRun }
        }
      }
    case 19:  // another device replaces the file's content; nothing here has it open or pending
      let (node, want) = model.lookupFile(p)
      guard want == 0, !held.contains(where: { $0.node == node }) else { return }
      try drainUploads()
      // The other device names the file by the place it has in the cloud.
      guard !pending.contains(node) else { return }
      if otherDevice == nil { otherDevice = try CoreWorld(cloud: world.cloud) }
      let other = otherDevice!
      try other.pull()
      let data = bytes(step)
      try other.writeFile(p, data)
      try other.drainUploads()
      try world.pull()
      model.truncate(node: node, to: 0)
      model.write(node: node, offset: 0, data)
      // The new version is only in the cloud; a pinned file fetches it at once.
      residency[node] = pinned.contains(node) ? .fetching : .evicted
      ModelRun.stats["remote writes", default: 0] += 1
    default:
      break
    }
    try check(after: step)
  }

  /// The file changed here (content, name, times, mode, xattrs): queued for upload.
  func changedHere(_ id: Int) {
    pending.insert(id)
    residency[id] = .here
  }

  /// A reader opened the file: if its bytes were only in the cloud, a download may have run.
  func readHere(_ id: Int) {
    if let r = residency[id], r != .here, r != .fetchMayRun { residency[id] = .unsure }
  }

  /// An eviction succeeded: a file with bytes keeps only its metadata here. With a handle open
  /// it succeeds only as a no-op on a file already evicted, whose download goes on.
  func evictedHere(_ id: Int) {
    if held.contains(where: { $0.node == id }) { return }
    // Still being fetched (a no-op), or fetched just before and now evicted.
    if residency[id] == .fetching || residency[id] == .fetchMayRun {
      residency[id] = .fetchMayRun
      return
    }
    if case .file(let d) = model.nodes[id], !d.isEmpty { residency[id] = .evicted }
  }

  /// Uploads everything the core may upload: what a handle holds unflushed stays.
  /// Uploads everything that can go now. What stays pending: files a handle holds writes of,
  /// and files the core keeps queued for another file's writer (a file renamed away from its
  /// uploaded place while a new file there is open for writing): those must be pending
  /// already, and a writer must hold a file.
  func drainUploads() throws {
    let waiting = try world.drainUploads()
    var waitingNodes: Set<Int> = []
    for (path, id) in model.paths where waiting.contains(try resolve(path).inode) {
      #expect(
        pending.contains(id) && held.contains { $0.writable && $0.node != id },
        "\(path) waits for another file's writer, but has no change or no writer holds a file; steps: \(log)")
      waitingNodes.insert(id)
    }
    pending = pending.filter { id in held.contains { $0.node == id && $0.wrote } || waitingNodes.contains(id) }
  }

  /// The content states `user.ubiq.content_state` may show for file node `id`.
  func expectedContentStates(_ id: Int) -> Set<String> {
    if pending.contains(id) || held.contains(where: { $0.node == id && $0.wrote }) { return ["dirty"] }
    switch residency[id] ?? .here {
    case .here: return ["cached"]
    case .evicted: return ["dataless"]
    case .fetching: return ["downloading", "cached"]
    case .unsure, .fetchMayRun: return ["dataless", "downloading", "cached"]
    }
  }

  /// The whole visible tree (names, kinds, sizes, contents, set mtimes and xattrs) equals the
  /// model's. Evicted files are compared by size only unless `readEvicted` (reading them would
  /// download them, and the next steps must also see evicted files); `finish` reads everything.
  func check(after step: ModelStep, readEvicted: Bool = false) throws {
    var seen: [String: Data?] = [:]
    func walk(_ inode: Int64, _ prefix: String) throws {
      var entries: [DirectoryEntry] = []
      try core.readdir(inode, offset: 0) { e in
        entries.append(e)
        return true
      }
      for e in entries where e.name != "." && e.name != ".." {
        let path = prefix.isEmpty ? e.name : prefix + "/" + e.name
        if e.attributes.kind == .file, !readEvicted, let id = model.paths[path] {
          let state = try contentState(e.attributes.inode)
          #expect(
            expectedContentStates(id).contains(state),
            "\(step): content state of \(path) is \(state), the model says \(expectedContentStates(id)); steps: \(log)")
        }
        if e.attributes.kind == .directory {
          seen[path] = .some(nil)
          try walk(e.attributes.inode, path)
        } else if e.attributes.blocks == 0 && e.attributes.size > 0 && !readEvicted {
          // Evicted: what a listing shows, without downloading.
          let id = model.paths[path]
          if let id, case .file(let d) = model.nodes[id] {
            #expect(Int(e.attributes.size) == d.count, "\(step): size of evicted \(path); steps: \(log)")
            seen[path] = .some(d)
          } else {
            seen[path] = .some(Data())
          }
        } else {
          let h = try core.open(e.attributes.inode, flags: O_RDONLY, caller: .current).handle
          defer { core.release(h) }
          let content = try core.read(h, offset: 0, size: Int(e.attributes.size) + 10)
          #expect(Int(e.attributes.size) == content.count, "\(step): size of \(path); steps: \(log)")
          seen[path] = .some(content)
        }
        if let id = model.paths[path] {
          if let mode = model.modes[id] {
            #expect(e.attributes.mode & 0o7777 == mode, "\(step): mode of \(path); steps: \(log)")
          }
          if let t = model.mtimes[id] {
            #expect(try core.getattr(e.attributes.inode).mtimeNs == t, "\(step): mtime of \(path); steps: \(log)")
          }
          for (k, v) in model.xattrs[id] ?? [:] {
            #expect(
              try core.getxattr(e.attributes.inode, name: k, size: 1024) == .value(v),
              "\(step): xattr of \(path); steps: \(log)")
          }
        }
      }
    }
    try walk(world.documents, "")
    let want = model.visibleTree
    #expect(seen == want, "\(step): tree differs (\(Self.differences(seen, want))); steps: \(log)")
  }

  /// The paths whose presence, kind or bytes differ, with where their bytes first differ.
  static func differences(_ seen: [String: Data?], _ want: [String: Data?]) -> String {
    Set(seen.keys).union(want.keys).sorted().compactMap { path -> String? in
      switch (seen[path], want[path]) {
      case (nil, _): return "\(path) missing"
      case (_, nil): return "\(path) unexpected"
      case (.some(let a), .some(let b)) where a != b:
        guard let a, let b else { return "\(path) kind" }
        let (x, y) = (Array(a), Array(b))
        let at = (0..<min(x.count, y.count)).first { x[$0] != y[$0] } ?? min(x.count, y.count)
        return "\(path): \(a.count) bytes, want \(b.count), first differs at \(at)"
      default: return nil
      }
    }.joined(separator: ", ")
  }

  func contentState(_ inode: Int64) throws -> String {
    guard case .value(let v) = try core.getxattr(inode, name: "user.ubiq.content_state", size: 64) else { return "" }
    return String(decoding: v, as: UTF8.self)
  }

  /// After the last step: every handle closed, everything uploaded, then every file read.
  func finish() throws {
    for h in held { core.release(h.handle) }
    held.removeAll()
    try drainUploads()
    try check(after: ModelStep(kind: 3, a: 0, b: 0, n: 0), readEvicted: true)
  }
}

/// Random operation sequences against the core and the reference model. At most
/// UBIQ_MODEL_CASES sequences run, and none starts after UBIQ_MODEL_SECONDS (CI's budget by
/// default; scripts/soak.sh sets more cases and no time limit). A failure prints the shrunk step
/// list and the seed to replay it (`.fixedSeed(...)` on the test).
@Suite(.serialized) struct ModelTests {
  static func budget() -> RandomBudget {
    RandomBudget(cases: "UBIQ_MODEL_CASES", default: 1500, seconds: "UBIQ_MODEL_SECONDS", default: 150)
  }

  static let stepGenerator = zip(
    Gen.int(in: 0...(ModelStep.drawnKinds.count - 1)), Gen.int(in: 0...8), Gen.int(in: 0...8), Gen.int(in: 0...9999)
  ).map { ModelStep(kind: ModelStep.drawnKinds[$0], a: $1 % 3 == 0 ? $1 : $1 % 3, b: $2 % 3 == 0 ? $2 : $2 % 3, n: $3) }

  /// Sequences found by the random test or written for a known bug, replayed every run.
  /// Steps are (kind, a, b, n) as in `ModelStep`: kind indexes `ModelStep.kinds`, a and b
  /// index `ModelStep.paths`.
  static let regressions: [[(Int, Int, Int, Int)]] = [
    // mv d f with d evicted: f must show d's bytes.
    [(0, 0, 0, 0), (1, 0, 1, 7), (0, 1, 0, 0), (1, 1, 2, 9), (9, 0, 0, 0), (4, 0, 1, 0), (3, 1, 1, 0)],
    [(0, 0, 0, 0), (1, 0, 1, 7), (0, 1, 0, 0), (1, 1, 2, 9), (9, 0, 0, 0), (4, 0, 1, 0)],
    // the same with the target evicted, and with both.
    [(0, 0, 0, 0), (1, 0, 1, 7), (0, 1, 0, 0), (1, 1, 2, 9), (9, 1, 0, 0), (4, 0, 1, 0)],
    [(0, 0, 0, 0), (1, 0, 1, 7), (0, 1, 0, 0), (1, 1, 2, 9), (9, 0, 0, 0), (9, 1, 0, 0), (4, 0, 1, 2)],
    // writes through a handle that is open at a crash.
    [(0, 0, 0, 0), (10, 0, 0, 0), (11, 0, 3, 100), (14, 0, 0, 0), (3, 0, 0, 0)],
    // unlinked while open: still readable and writable through the handle.
    [(0, 2, 0, 0), (1, 2, 2, 5), (10, 2, 0, 0), (5, 2, 0, 0), (11, 0, 1, 40), (12, 0, 0, 0), (13, 0, 0, 0)],
    // a write after an explicit mtime moves the mtime.
    [(0, 2, 0, 0), (8, 2, 0, 0), (1, 2, 0, 0)],
    // an explicit mtime after unflushed writes, then a crash: the explicit time stays.
    [(0, 2, 0, 0), (10, 2, 0, 0), (11, 0, 0, 0), (8, 2, 0, 0), (14, 0, 0, 0)],
    // exchange of a new empty file with an evicted one.
    [(0, 2, 0, 0), (1, 2, 0, 0), (9, 0, 0, 3), (4, 2, 1, 0), (0, 2, 0, 0), (4, 2, 1, 1316), (10, 2, 0, 0)],
    // the order of rename's checks: EXCHANGE to a missing name below the source is ENOENT,
    // NOREPLACE over a taken name below the source is EEXIST, a move over an ancestor ENOTEMPTY.
    [(6, 1, 0, 0), (4, 1, 6, 2)],
    [(6, 1, 0, 0), (6, 6, 0, 0), (4, 1, 6, 1)],
    [(6, 1, 0, 0), (6, 6, 0, 0), (4, 6, 1, 0)],
    [(6, 1, 0, 0), (6, 6, 0, 0), (4, 6, 1, 2)],
    // A pinned empty file gets a new version from another device: it is downloaded at once.
    [(0, 1, 0, 0), (18, 1, 2, 8566), (19, 1, 3, 2549)],
    // The same, unpinned and evicted while its new version may still be arriving.
    [(0, 2, 0, 0), (18, 2, 0, 0), (19, 2, 0, 0), (18, 2, 0, 47), (9, 2, 2, 1649)],
    // The same, evicted while its new version may still be arriving.
    [(0, 1, 0, 0), (18, 1, 0, 4904), (19, 1, 0, 9890), (9, 1, 4, 3483)],
    // An upload waits for the flush of a handle holding writes; everything else drains.
    [(0, 2, 0, 0), (10, 2, 0, 0), (11, 0, 0, 0), (9, 0, 0, 0)],
    // A folder and a file exchange names while the file's writer holds it: the folder's move
    // waits for the file's, which waits for the writer's flush.
    [(6, 2, 0, 0), (0, 1, 0, 0), (10, 1, 0, 0), (9, 0, 0, 0), (4, 2, 1, 2567), (11, 0, 0, 0), (9, 0, 0, 0)],
    // A file is renamed while its writer holds it, and a new file takes its old name: the new
    // file's upload waits for the old one's move, which waits for the writer's flush.
    [(0, 1, 0, 0), (9, 0, 0, 0), (10, 1, 0, 0), (4, 1, 0, 0), (0, 1, 0, 0), (11, 0, 0, 0), (9, 0, 0, 0)],
    // A reader holds an evicted file whose rename was uploaded since, and a writer opens it:
    // both use the one download (the uploaded manifest's text may order its keys otherwise).
    [
      (0, 2, 0, 0), (1, 2, 0, 0), (4, 2, 0, 0), (9, 0, 0, 0), (4, 0, 2, 0), (10, 2, 0, 7), (9, 0, 0, 0), (1, 2, 0, 2),
      (12, 0, 2, 0),
    ],
    // A pinned file's new version is being fetched at a crash: the fetch of the stopped
    // device must not mark the file cached under the restarted device's download.
    [(0, 1, 0, 0), (0, 0, 0, 0), (18, 1, 0, 0), (1, 2, 1, 2611), (19, 1, 3, 0), (14, 1, 0, 2718), (1, 1, 1, 4330)],
    // A reader holds a file changed remotely open; the file is renamed, then written.
    [(0, 2, 0, 0), (19, 2, 0, 0), (10, 2, 0, 7), (4, 2, 0, 0), (9, 0, 0, 0), (1, 0, 0, 2)],
    // File c moves into new folder b, and b is renamed c (mkdir b; mv c b/c; mv b c). The
    // other device pulls the file's move and the new folder in one page: the file holds the
    // name the folder takes, and moves into that folder, so it steps aside until the folder
    // is made; the folder keeps its name c (found by the model test, seed
    // 8qnr0fOOEVBLcKRebGr8BZ+H4EEb4J82rYi50JSCR2w=).
    [(0, 2, 0, 0), (19, 2, 0, 0), (6, 1, 0, 0), (4, 2, 6, 0), (4, 1, 2, 0), (0, 1, 0, 0), (19, 1, 0, 0)],
    // File c is uploaded and renamed a; a new file c is made and written through a handle
    // that stays open: a's move drains while c's upload waits for the writer's flush (found
    // by the model test, seed 05J0tYgAlctrvSI1mTv+/X63dK3d8w/gj8m0KQt7FVY=).
    [(0, 2, 0, 0), (9, 0, 0, 0), (4, 2, 0, 0), (0, 2, 0, 0), (10, 2, 0, 0), (11, 0, 0, 0), (9, 0, 0, 0)],
    // The same with the backup at b, which another device cannot change by that name while
    // its move waits.
    [(0, 2, 0, 0), (9, 0, 0, 0), (4, 2, 1, 0), (0, 2, 0, 0), (10, 2, 0, 154), (11, 3, 2, 8205), (19, 1, 6, 3793)],
  ]

  @Test func knownSequences() async throws {
    for steps in Self.regressions {
      try await onOwnThread {
        let run = try ModelRun()
        for (k, a, b, n) in steps { try run.run(ModelStep(kind: k, a: a, b: b, n: n)) }
        try run.finish()
      }
    }
  }

  @Test func coreMatchesTheReferenceModel() async {
    let budget = Self.budget()
    print("model test: up to \(budget.cases) random sequences of up to 60 steps in \(budget.seconds) s")
    await propertyCheck(count: budget.cases, input: Self.stepGenerator.array(of: 1...60)) { steps in
      guard budget.startSequence() else { return }
      // The core is synchronous and blocks on async work inside: run it on a thread of its own,
      // never on one of the few threads of Swift's cooperative pool.
      await recordingThrownErrors(budget) {
        try await onOwnThread {
          let run = try ModelRun()
          for step in steps { try run.run(step) }
          try run.finish()
        }
      }
    }
    print("model test: \(budget.summary)")
    print("model stats: \(ModelRun.stats)")
  }
}

/// Runs a property's body and records what it throws as an issue, and as a failure in `budget`
/// (so that shrinking it runs past the time budget). `propertyCheck` counts the issues a body
/// records and drops an error it throws: without this, a failed `checkThat` or an unexpected
/// error from the core would pass.
func recordingThrownErrors(_ budget: RandomBudget, _ body: () async throws -> Void) async {
  do {
    try await body()
  } catch {
    budget.recordFailure()
    Issue.record(error)
  }
}

/// Runs blocking work on a thread of its own and waits for it without blocking the caller's
/// thread. The work runs inside the calling task (on a task executor that owns the thread), so
/// `#expect` in it reports to the running test, as it would on Swift's pool.
func onOwnThread(_ body: @escaping @Sendable () throws -> Void) async throws {
  let thread = OwnThreadExecutor()
  defer { thread.stop() }
  try await withTaskExecutorPreference(thread) {
    try await runHere(body)
  }
}

/// Calls `body` on the current executor; nonisolated, so it runs on the preferred task executor.
private nonisolated func runHere(_ body: @Sendable () throws -> Void) async throws {
  try body()
}

/// A task executor with one thread of its own (8 MiB stack), for synchronous code that blocks.
final class OwnThreadExecutor: TaskExecutor, @unchecked Sendable {
  /// Whether the calling thread is the thread of an `OwnThreadExecutor`.
  static var isCurrent: Bool { Thread.current.threadDictionary[marker] as? Bool == true }
  private static let marker = "ubiq.test.ownThread"
  private let condition = NSCondition()
  private var jobs: [UnownedJob] = []
  private var stopped = false

  init() {
    let thread = Thread { [self] in runJobs() }
    thread.stackSize = 8 << 20
    thread.start()
  }

  func enqueue(_ job: UnownedJob) {
    condition.lock()
    jobs.append(job)
    condition.signal()
    condition.unlock()
  }

  /// Ends the thread once the jobs already queued have run.
  func stop() {
    condition.lock()
    stopped = true
    condition.signal()
    condition.unlock()
  }

  private func runJobs() {
    Thread.current.threadDictionary[Self.marker] = true
    while true {
      condition.lock()
      while jobs.isEmpty && !stopped { condition.wait() }
      if jobs.isEmpty {
        condition.unlock()
        return
      }
      let job = jobs.removeFirst()
      condition.unlock()
      job.runSynchronously(on: asUnownedTaskExecutor())
    }
  }
}
