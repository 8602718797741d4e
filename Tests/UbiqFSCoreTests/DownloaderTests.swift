import Foundation
import Testing
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqIndex

@testable import UbiqFSCore
@testable import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// Downloads of evicted content through the core, device B reading what device A uploaded:
/// bounded read-ahead, cancellation at the last close, interruptible waits that hold no lock
/// other inodes need.
@Suite(.serialized) struct DownloaderTests {
  /// Incompressible bytes, so chunk boundaries fall as in real files.
  static func noise(_ count: Int, seed: UInt64) -> Data {
    var x = seed &* 0x9E37_79B9_7F4A_7C15 | 1
    var words = [UInt64](repeating: 0, count: (count + 7) / 8)
    for i in words.indices {
      x ^= x << 13
      x ^= x >> 7
      x ^= x << 17
      words[i] = x
    }
    return words.withUnsafeBytes { Data($0.prefix(count)) }
  }

  /// Reads a file from start to end in 128 KiB reads through one handle, as `cat` does.
  static func readInOrder(_ w: CoreWorld, _ inode: Int64, size: Int) throws -> Data {
    let h = try w.core.open(inode, flags: O_RDONLY, caller: .current).handle
    defer { w.core.release(h) }
    return try readOn(w, h, after: Data(), size: size)
  }

  /// Reads on through handle `h`, from the end of `read` up to `size`, in 128 KiB reads.
  static func readOn(_ w: CoreWorld, _ h: UInt64, after read: Data, size: Int) throws -> Data {
    var read = read
    while read.count < size {
      read += try w.core.read(h, offset: Int64(read.count), size: min(128 << 10, size - read.count))
    }
    return read
  }

  /// Waits (up to `seconds`) until `condition` holds.
  static func waitUntil(_ what: String, within seconds: TimeInterval = 30, _ condition: () throws -> Bool) throws {
    let deadline = Date().addingTimeInterval(seconds)
    while try !condition() {
      if Date() > deadline { throw UbiqError.busy("timed out waiting until \(what)") }
      usleep(5_000)
    }
  }

  /// A with files uploaded, and B (over `cloud`, wrapping the cloud they share) with them evicted.
  static func evictedOnB(_ files: [String: Data]) throws -> (a: CoreWorld, b: CoreWorld, cloud: FlakyCloud) {
    let engine = try CloudEngine.embedded(directory: CoreWorld.temporaryFolder("ubiq-cloud"))
    let a = try CoreWorld(cloud: engine)
    for (name, data) in files { try a.writeFile(name, data) }
    try a.drainUploads()
    let cloud = FlakyCloud(engine)
    let b = try CoreWorld(cloud: cloud)
    try b.pull()
    for name in files.keys { #expect(try b.index.item(try b.inode(name)!)!.content == .dataless) }
    return (a, b, cloud)
  }

  @Test func aSmallReadOfEachEvictedFileFetchesAboutOneWindow() async throws {
    try await onOwnThread {
      let count = 6
      let size = 8 << 20
      var files: [String: Data] = [:]
      for i in 0..<count { files["f\(i)"] = Self.noise(size, seed: UInt64(i + 1)) }
      let (a, b, _) = try Self.evictedOnB(files)
      defer { withExtendedLifetime(a) {} }
      var allowed: Int64 = 0
      var handles: [UInt64] = []
      for i in 0..<count {
        let inode = try b.inode("f\(i)")!
        let row = try b.index.item(inode)!
        let h = try b.core.open(inode, flags: O_RDONLY, caller: .current).handle
        handles.append(h)
        #expect(try b.core.read(h, offset: 0, size: 4096) == files["f\(i)"]!.prefix(4096))
        // The read-ahead window of a first read: the chunks that overlap its 4 KiB plus 1 MiB.
        var offset: Int64 = 0
        for chunk in row.chunkList {
          if offset < 4096 + (1 << 20) { allowed += chunk.length }
          offset += chunk.length
        }
      }
      // With every handle still open, the downloads fetch their windows and then idle.
      try Self.waitUntil("no chunk is being fetched") { b.downloader.activeFetches == 0 }
      let fetched = b.downloader.bytesFetched
      #expect(
        fetched > 0 && fetched <= allowed, "fetched \(fetched) bytes; the windows allow \(allowed) of \(count * size)")
      for h in handles { b.core.release(h) }
      for i in 0..<count {
        let inode = try b.inode("f\(i)")!
        // The download stopped with the last close, and its partial cache file went with it.
        #expect(!b.downloader.isDownloading(inode))
        #expect(!b.core.cache.exists(inode))
        #expect(try b.index.item(inode)!.content == .dataless)
      }
    }
  }

  @Test func aSequentialReadFetchesEachChunkOnceAndLeavesTheFileCached() async throws {
    try await onOwnThread {
      let data = Self.noise(9 << 20, seed: 42)
      let (a, b, _) = try Self.evictedOnB(["big": data])
      defer { withExtendedLifetime(a) {} }
      let inode = try b.inode("big")!
      let read = try Self.readInOrder(b, inode, size: data.count)
      #expect(read == data)
      #expect(try b.index.item(inode)!.content == .cached)
      #expect(b.downloader.bytesFetched == Int64(data.count))
    }
  }

  /// A sparse file's holes (its chunks of zeros) stay holes in the cache file of a device that
  /// downloads it: the bytes read are the file's, and the cache holds little more than its data.
  @Test func aSparseFileDownloadsIntoASparseCacheFile() async throws {
    try await onOwnThread {
      let data = Self.noise(1 << 20, seed: 1) + Data(count: 32 << 20) + Self.noise(1 << 20, seed: 2)
      let (a, b, _) = try Self.evictedOnB(["sparse": data])
      defer { withExtendedLifetime(a) {} }
      let inode = try b.inode("sparse")!
      #expect(try Self.readInOrder(b, inode, size: data.count) == data)
      #expect(try b.index.item(inode)!.content == .cached)
      var st = stat()
      #expect(stat(b.core.cache.path(inode), &st) == 0)
      #expect(st.st_size == data.count)
      #expect(Int(st.st_blocks) * 512 < 8 << 20, "the cache file holds \(st.st_blocks) blocks")
    }
  }

  /// A bandwidth cap (`--download-limit`) holds each chunk back until its share of the link is
  /// free. That is no stall: a reader waits for as long as the cap makes it, and a cap slower
  /// than one chunk per stall timeout reads the file, slowly, instead of failing it with EIO.
  @Test func aReaderWaitsForChunksTheBandwidthCapHoldsBack() async throws {
    try await onOwnThread {
      let data = Self.noise(3 << 19, seed: 45)
      let (a, b, _) = try Self.evictedOnB(["capped": data])
      defer { withExtendedLifetime(a) {} }
      let inode = try b.inode("capped")!
      try checkThat(try b.index.item(inode)!.chunkList.count >= 2, "the file has several chunks")
      // Each chunk after the first (256 KiB at least) waits 1 s or more for its share of
      // 256 KiB/s: twice the stall timeout.
      b.downloader.limiter = RateLimiter(bytesPerSecond: 256 << 10)
      b.downloader.stallTimeoutNs = 500_000_000
      let read = try Self.readInOrder(b, inode, size: data.count)
      try checkThat(read == data, "the whole file was read")
    }
  }

  /// Under a bandwidth cap, a cloud that stops answering is found a stall timeout after the
  /// chunk the reader waits for may start, not after the chunks booked behind it: a pinned
  /// file's fetch books several chunks ahead, each its share of the cap after the one before.
  @Test func aHungCloudIsFoundAStallAfterTheChunkTheReaderWaitsFor() async throws {
    try await onOwnThread {
      let data = Self.noise(6 << 20, seed: 46)
      let (a, b, cloud) = try Self.evictedOnB(["capped": data])
      defer { withExtendedLifetime(a) {} }
      defer { cloud.chunkReadsHang = false }
      let inode = try b.inode("capped")!
      let chunks = try b.index.item(inode)!.chunkList
      // A second chunk of 1 MiB or more: the third may start 2 s or more after it.
      try checkThat(chunks.count >= 3 && chunks[1].length >= 1 << 20, "chunks: \(chunks.map(\.length))")
      let rate: Int64 = 512 << 10
      b.downloader.limiter = RateLimiter(bytesPerSecond: rate)
      b.downloader.stallTimeoutNs = 500_000_000
      let start = Date()
      // The whole file is wanted (a pinned file's new version): its first chunk goes at once,
      // then the next ones are booked.
      try b.index.setPinned(inode, true)
      b.downloader.fetchInBackground(inode)
      try Self.waitUntil("the first chunk is here") { b.downloader.bytesFetched >= chunks[0].length }
      cloud.chunkReadsHang = true
      let h = try b.core.open(inode, flags: O_RDONLY, caller: .current).handle
      defer { b.core.release(h) }
      #expect(throws: UbiqError.self) { try b.core.read(h, offset: chunks[0].length, size: 4096) }
      let elapsed = Date().timeIntervalSince(start)
      // The second chunk may start the first's share of the cap after it; the third, the
      // second's share after that.
      let thirdMayStart = Double(chunks[0].length + chunks[1].length) / Double(rate)
      #expect(
        elapsed < thirdMayStart,
        "the reader failed after \(elapsed) s; chunks \(chunks.map(\.length)) at \(rate) bytes/s")
    }
  }

  @Test func aReadAtTheEndOfAnEvictedFileFetchesOnlyWhatItReads() async throws {
    try await onOwnThread {
      let data = Self.noise(9 << 20, seed: 11)
      let (a, b, _) = try Self.evictedOnB(["big": data])
      defer { withExtendedLifetime(a) {} }
      let inode = try b.inode("big")!
      let chunks = try b.index.item(inode)!.chunkList
      let h = try b.core.open(inode, flags: O_RDONLY, caller: .current).handle
      // `tail -c 100`, a zip's central directory, an mp4's index.
      #expect(try b.core.read(h, offset: Int64(data.count - 100), size: 100) == data.suffix(100))
      try Self.waitUntil("no chunk is being fetched") { b.downloader.activeFetches == 0 }
      let allowed = chunks.suffix(2).reduce(Int64(0)) { $0 + $1.length }
      #expect(b.downloader.bytesFetched <= allowed, "fetched \(b.downloader.bytesFetched) of \(data.count) bytes")
      b.core.release(h)
    }
  }

  /// Device b has evicted f (4 MiB of noise from `seed`, `old`) and a reader of it has read
  /// the first MiB (`read`) when device a uploads a smaller version (`small`), which b has not
  /// pulled yet.
  static func smallerVersionWhileBReads(seed: UInt64) throws -> (
    a: CoreWorld, b: CoreWorld, inode: Int64, reader: UInt64, read: Data, old: Data, small: Data
  ) {
    let old = Self.noise(4 << 20, seed: seed)
    let (a, b, _) = try Self.evictedOnB(["f": old])
    let inode = try b.inode("f")!
    let reader = try b.core.open(inode, flags: O_RDONLY, caller: .current).handle
    let read = try b.core.read(reader, offset: 0, size: 1 << 20)
    let small = Data("saved smaller elsewhere\n".utf8)
    try a.writeFile("f", small)
    try a.drainUploads()
    return (a, b, inode, reader, read, old, small)
  }

  /// A smaller version made elsewhere while a process here reads the file waits for the last
  /// reader to close: the kernel holds one size per inode, and a smaller one would end the
  /// reader's reads early with no error (a torn copy). The reader reads the whole version it
  /// opened; after its close the next pull applies the new one.
  @Test func aSmallerRemoteVersionWaitsForTheReadersOfTheFile() async throws {
    try await onOwnThread {
      let (_, b, inode, reader, read, old, small) = try Self.smallerVersionWhileBReads(seed: 7)
      try b.pull()
      #expect(try b.core.getattr(inode).size == Int64(old.count), "the size the reader reads stays")
      #expect(try Self.readOn(b, reader, after: read, size: old.count) == old)
      b.core.release(reader)
      try b.pull()
      #expect(try b.readFile("f") == small)
      #expect(try b.index.heldRemote().isEmpty)
    }
  }

  /// A change of this device's own (chmod) to a file whose smaller version from elsewhere
  /// waits for its readers waits too: its merge with that version would replace the content
  /// under them. After the last close both apply, and both devices agree.
  @Test(arguments: [true, false])
  func aLocalChangeWaitsWithASmallerRemoteVersionForTheReaders(pulledFirst: Bool) async throws {
    try await onOwnThread {
      let (a, b, inode, reader, read, old, small) = try Self.smallerVersionWhileBReads(seed: 8)
      if pulledFirst { try b.pull() }
      _ = try b.core.setattr(inode, AttributeUpdate(mode: 0o600))
      try b.drainUploadsOnce()
      try b.drainUploadsOnce()
      #expect(try b.core.getattr(inode).size == Int64(old.count), "the size the reader reads stays")
      #expect(try Self.readOn(b, reader, after: read, size: old.count) == old)
      b.core.release(reader)
      for _ in 0..<2 {
        try b.pull()
        try b.drainUploads()
        try a.pull()
      }
      for w in [a, b] {
        #expect(try w.readFile("f") == small)
        #expect(try w.core.getattr(try w.inode("f")!).mode & 0o777 == 0o600)
      }
    }
  }

  @Test func aReaderClosingAfterARemoteReplacementLeavesANewLocalWriteAlone() async throws {
    try await onOwnThread {
      let (a, b, _) = try Self.evictedOnB(["f": Self.noise(4 << 20, seed: 5)])
      let inode = try b.inode("f")!
      let reader = try b.core.open(inode, flags: O_RDONLY, caller: .current).handle
      _ = try b.core.read(reader, offset: 0, size: 4096)
      // Device A replaces the file with a larger one; B applies it while its reader is open (a
      // version as large or larger does not wait for readers), then writes the file itself.
      try a.writeFile("f", Self.noise(5 << 20, seed: 6))
      try a.drainUploads()
      try b.pull()
      let mine = Data("written on b after the remote version\n".utf8)
      try b.writeFile("f", mine)
      b.core.release(reader)
      #expect(try b.readFile("f") == mine)
      try b.drainUploads()
      try a.pull()
      #expect(try a.readFile("f") == mine)
    }
  }

  @Test func aFileReadWholeCanBeEvictedRightAfterItsLastClose() async throws {
    try await onOwnThread {
      let data = Data("small and quickly downloaded\n".utf8)
      let (a, b, _) = try Self.evictedOnB(["f": data])
      defer { withExtendedLifetime(a) {} }
      let inode = try b.inode("f")!
      // The download's completion is a content transition under the inode lock: an eviction
      // after the read sees the file cached (evicts it) or still evicted (nothing to do), never
      // a download in progress (EBUSY).
      for _ in 0..<200 {
        #expect(try b.readFile("f") == data)
        try b.core.evict(inode)
        try Self.waitUntil("the download ended") { !b.downloader.isDownloading(inode) }
        try b.core.evict(inode)
        #expect(try b.index.item(inode)!.content == .dataless)
      }
    }
  }

  @Test func aWriterWaitingForADownloadIsInterruptedAndBlocksNoOtherFile() async throws {
    try await onOwnThread {
      let (a, b, cloud) = try Self.evictedOnB(["evicted": Self.noise(2 << 20, seed: 7)])
      defer { withExtendedLifetime(a) {} }
      cloud.chunkReadsFail = true
      b.downloader.stallTimeoutNs = 120_000_000_000
      let inode = try b.inode("evicted")!
      // A local file whose inode shares the evicted file's lock stripe.
      var neighbour: Int64 = -1
      for k in 0..<130 where neighbour < 0 {
        let other = try b.writeFile("n\(k)", Data("local \(k)\n".utf8))
        if other % 64 == inode % 64 { neighbour = other }
      }
      #expect(neighbour >= 0)
      try b.drainUploads()

      let interruption = Interruption()
      let outcome = OutcomeBox()
      let writer = Thread {
        do {
          _ = try b.core.open(inode, flags: O_RDWR, caller: .current, interruption: interruption)
          outcome.set("opened")
        } catch {
          outcome.set("\(error)")
        }
      }
      writer.start()
      try Self.waitUntil("the writer's download runs") { b.downloader.isDownloading(inode) }
      // The writer waits for content the cloud does not send; other files go on meanwhile.
      let h = try b.core.open(neighbour, flags: O_RDWR, caller: .current).handle
      b.core.release(h)
      try b.core.evict(neighbour)
      #expect(outcome.get() == nil, "the writer's open ended before it was interrupted")
      interruption.interrupt()
      try Self.waitUntil("the writer's open returns") { outcome.get() != nil }
      #expect(outcome.get() == "\(UbiqError.interrupted("waiting for content from the cloud"))")
    }
  }

  @Test func aDownloadStoppedWhileItsRequestHangsEndsAtOnce() async throws {
    try await onOwnThread {
      let (a, b, cloud) = try Self.evictedOnB(["evicted": Self.noise(2 << 20, seed: 9)])
      defer { withExtendedLifetime(a) {} }
      cloud.chunkReadsHang = true
      let inode = try b.inode("evicted")!
      let h = try b.core.open(inode, flags: O_RDONLY, caller: .current).handle
      let reader = Thread { _ = try? b.core.prepareRead(h, offset: 0, size: 4096) }
      reader.start()
      try Self.waitUntil("a chunk request runs") { b.downloader.activeFetches > 0 }
      // The truncation supersedes the download: its hanging request is cancelled.
      _ = try b.core.setattr(inode, AttributeUpdate(size: 0))
      try Self.waitUntil("the stopped download's request ends", within: 10) { b.downloader.activeFetches == 0 }
      b.core.release(h)
      let content = try b.readFile("evicted")
      if !content.isEmpty { throw UbiqError.io("the truncated file reads \(content.count) bytes") }
    }
  }

  /// A pinned file gets new versions from another device one after the other: the background
  /// fetch of a version that is already replaced stops (nobody will read it) instead of
  /// running to the end beside the fetch of the current one.
  @Test func aPinnedFilesFetchOfAReplacedVersionStops() async throws {
    try await onOwnThread {
      let (a, b, cloud) = try Self.evictedOnB(["p": Self.noise(2 << 20, seed: 3)])
      defer { withExtendedLifetime(a) {} }
      let p = try b.inode("p")!
      try b.core.setxattr(p, name: "user.ubiq.pinned", value: Data("1".utf8), flags: [])
      cloud.chunkReadsHang = true
      try a.writeFile("p", Self.noise(2 << 20, seed: 4))
      try a.drainUploads()
      try b.pull()
      try Self.waitUntil("the new version's fetch runs") { b.downloader.activeFetches == 1 }
      try a.writeFile("p", Self.noise(2 << 20, seed: 5))
      try a.drainUploads()
      try b.pull()
      try Self.waitUntil("only the current version is fetched", within: 10) { b.downloader.activeFetches == 1 }
      // The truncation stops the last fetch too.
      _ = try b.core.setattr(p, AttributeUpdate(size: 0))
      try Self.waitUntil("no fetch is left", within: 10) { b.downloader.activeFetches == 0 }
    }
  }

  /// Pinning many files and then getting a new version of each from another device (or a
  /// crash that left them dataless) starts their background fetches a few at a time: each
  /// running fetch holds a descriptor and a share of the link. The others show as
  /// downloading and are fetched in turn.
  @Test func pinnedFilesAreFetchedInTheBackgroundAFewAtATime() async throws {
    try await onOwnThread {
      let count = 6
      var files: [String: Data] = [:]
      for i in 0..<count { files["p\(i)"] = Self.noise(1 << 20, seed: UInt64(10 + i)) }
      let (a, b, cloud) = try Self.evictedOnB(files)
      defer { withExtendedLifetime(a) {} }
      for name in files.keys {
        try b.core.setxattr(try b.inode(name)!, name: "user.ubiq.pinned", value: Data("1".utf8), flags: [])
      }
      cloud.chunkReadsHang = true
      for i in 0..<count { try a.writeFile("p\(i)", Self.noise(1 << 20, seed: UInt64(20 + i))) }
      try a.drainUploads()
      try b.pull()
      // One chunk in flight per running fetch: its first chunk goes alone.
      try Self.waitUntil("the first fetches run") { b.downloader.activeFetches == 2 }
      usleep(300_000)
      try checkThat(b.downloader.activeFetches == 2, "fetches running at once: \(b.downloader.activeFetches)")
      for i in 0..<count {
        let state = try FileContentTests.state(b, try b.inode("p\(i)")!)
        try checkThat(state == "downloading", "p\(i) waiting for its fetch shows \(state)")
      }
      cloud.chunkReadsHang = false
      for i in 0..<count {
        let inode = try b.inode("p\(i)")!
        try Self.waitUntil("p\(i) is fetched") { try FileContentTests.state(b, inode) == "cached" }
        try checkThat(
          try b.readFile("p\(i)") == Self.noise(1 << 20, seed: UInt64(20 + i)), "p\(i) holds its new version")
      }
    }
  }

  /// A pinned file's background fetch that failed (the cloud unreachable) is tried again
  /// later without anyone opening the file, so the file is available offline once the cloud
  /// was back for a while.
  @Test func aPinnedFilesFailedFetchIsTriedAgain() async throws {
    try await onOwnThread {
      let (a, b, cloud) = try Self.evictedOnB(["p": Self.noise(1 << 20, seed: 30)])
      defer { withExtendedLifetime(a) {} }
      let p = try b.inode("p")!
      try b.core.setxattr(p, name: "user.ubiq.pinned", value: Data("1".utf8), flags: [])
      b.downloader.stallTimeoutNs = 300_000_000
      b.downloader.backgroundRetryDelayNs = 200_000_000
      cloud.chunkReadsFail = true
      try a.writeFile("p", Self.noise(1 << 20, seed: 31))
      try a.drainUploads()
      try b.pull()
      try Self.waitUntil("the fetch fails") { try FileContentTests.state(b, p) == "error" }
      cloud.chunkReadsFail = false
      try Self.waitUntil("the fetch is tried again", within: 10) { try FileContentTests.state(b, p) == "cached" }
      try checkThat(try b.readFile("p") == Self.noise(1 << 20, seed: 31), "the new version is here")
    }
  }
}

/// The background fetch queue's bookkeeping, driven directly.
@Suite struct BackgroundFetchesTests {
  /// A pinned file's fetch can join a reader's download that fails just then: the fetch failed
  /// too, and is tried again like any failed fetch.
  @Test func aFetchThatJoinsADownloadWhichJustFailedCountsAsFailed() {
    var fetches = BackgroundFetches()
    fetches.add(7)
    #expect(fetches.nextToStart(limit: 2) == 7)
    let s = ContentStream(
      inode: 7, manifest: nil, size: 1 << 20, chunks: [ChunkRef(hash: "c", length: 1 << 20)], fd: -1)
    s.fail(UbiqError.unavailable("cloud unreachable"))
    s.markFinished()
    #expect(fetches.started(7, s) == .alreadyFailed)
    #expect(fetches.running.isEmpty && fetches.failed[7] == 1)
  }

  @Test func aFetchThatJoinsADownloadWhichJustCompletedIsDone() {
    var fetches = BackgroundFetches()
    fetches.add(7)
    _ = fetches.nextToStart(limit: 2)
    let s = ContentStream(inode: 7, manifest: nil, size: 0, chunks: [], fd: -1)
    s.markFinished()
    #expect(fetches.started(7, s) == .alreadyEnded)
    #expect(fetches.running.isEmpty && fetches.failed[7] == nil)
  }
}

/// The order in which a download starts its chunks, driven directly: no cloud, no file.
@Suite struct ContentStreamSchedulingTests {
  /// A stream of 64 chunks of 1 MiB (its file descriptor is never written here).
  static func stream() -> ContentStream {
    let chunks = (0..<64).map { ChunkRef(hash: "c\($0)", length: 1 << 20) }
    return ContentStream(inode: 1, manifest: nil, size: 64 << 20, chunks: chunks, fd: -1)
  }

  @Test func aWaitingReaderIsServedWhileNewReadersKeepArriving() {
    let s = Self.stream()
    // The first chunk goes alone; then two fetches run at once.
    _ = s.request(0, 1, fetchAheadTo: 0)
    for i in s.startableChunks(parallelism: 2) { s.complete(i) }
    // A reader waits for chunk 40; new random readers then arrive faster than chunks land.
    _ = s.request(40 << 20, 1, fetchAheadTo: 0)
    var started: [Int] = []
    for round in 0..<20 {
      _ = s.request(Int64(round + 1) << 20, 1, fetchAheadTo: 0)
      _ = s.request(Int64(round + 21) << 20, 1, fetchAheadTo: 0)
      let picked = s.startableChunks(parallelism: 2)
      started += picked
      for i in picked { s.complete(i) }
    }
    #expect(started.prefix(2).contains(40), "the waiting reader's chunk goes first, not after newer reads: \(started)")
  }

  @Test func aChunkAskedForTwiceStartsOnce() {
    let s = Self.stream()
    _ = s.request(0, 1, fetchAheadTo: 0)
    for i in s.startableChunks(parallelism: 4) { s.complete(i) }
    _ = s.request(5 << 20, 1, fetchAheadTo: 0)
    _ = s.request(6 << 20, 1, fetchAheadTo: 0)
    _ = s.request(5 << 20, 1, fetchAheadTo: 0)
    #expect(s.startableChunks(parallelism: 4) == [5, 6])
    #expect(s.startableChunks(parallelism: 4) == [])
  }
}

/// One value set from another thread (a hook, a task) and read by the test; guarded by its lock.
final class LockedBox<Value>: @unchecked Sendable {
  private let lock = NSLock()
  private var value: Value?
  func set(_ v: Value) { lock.withLock { value = v } }
  func get() -> Value? { lock.withLock { value } }
}

typealias OutcomeBox = LockedBox<String>
