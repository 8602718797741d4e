import Foundation
import Testing
import UbiqCloud
import UbiqCloudAPI
import UbiqCore
import UbiqIndex

@testable import UbiqSync

/// The upload worker commits consecutive prepared versions together (`UploadWorker.drain`).
@Suite(.serialized) struct BatchedUploadTests {
  /// Two devices of one embedded cloud; device a reaches it through a `FlakyCloud` that counts
  /// its requests.
  func twoDevices() throws -> (counted: FlakyCloud, a: CoreWorld, b: CoreWorld) {
    let engine = try CloudEngine.embedded(directory: CoreWorld.temporaryFolder("ubiq-cloud"))
    let counted = FlakyCloud(engine)
    return (counted, try CoreWorld(cloud: counted), try CoreWorld(cloud: engine))
  }

  /// An `rm -r` of a tree of 310 files goes to the cloud in a few requests, not one per item. A
  /// delete the cloud refuses in the middle of a batch (the file was edited on another device)
  /// is settled alone: the file comes back, and so does its folder, whose delete is then refused
  /// as not empty; the deletes after it are still sent together.
  @Test func anRmROfATreeGoesInFewRequestsAndARefusedDeleteIsSettledAlone() async throws {
    try await onOwnThread {
      let (counted, a, b) = try twoDevices()
      let d = try a.core.mkdir(parent: a.documents, name: "d", mode: 0o755, caller: .current).inode
      let sub = try a.core.mkdir(parent: d, name: "sub", mode: 0o755, caller: .current).inode
      for i in 0..<300 { try a.writeFile("d/f\(i)", Data("\(i)".utf8)) }
      for i in 0..<10 { try a.writeFile("d/sub/g\(i)", Data()) }
      try a.drainUploads()
      try b.pull()
      try b.writeFile("d/f7", Data("from b\n".utf8))
      try b.drainUploads()

      let before = counted.deleteRequests
      for i in 0..<300 { try a.core.unlink(parent: d, name: "f\(i)") }
      for i in 0..<10 { try a.core.unlink(parent: sub, name: "g\(i)") }
      try a.core.rmdir(parent: d, name: "sub")
      try a.core.rmdir(parent: a.documents, name: "d")
      try a.drainUploads()
      let requests = counted.deleteRequests - before
      // One by one, the 312 deletes take 312 requests.
      try checkThat(requests <= 20, "312 deletes took \(requests) requests")
      try checkThat(try a.index.dueQueue(now: Int64.max / 2, limit: 10).isEmpty, "a's queue is empty")

      try a.pull()
      try b.pull()
      for world in [a, b] {
        try checkThat(try world.readFile("d/f7") == Data("from b\n".utf8), "the edited file is back, with its edit")
        try checkThat(try world.inode("d/f8") == nil, "d/f8 is gone")
        try checkThat(try world.inode("d/sub") == nil, "d/sub is gone")
        var names: [String] = []
        try world.core.readdir(try #require(try world.inode("d")), offset: 0) { entry in
          if entry.name != "." && entry.name != ".." { names.append(entry.name) }
          return true
        }
        try checkThat(names == ["f7"], "d holds only f7, not \(names)")
      }
    }
  }

  /// The cloud's push about a commit can come before the commit's answer: a pull then meets
  /// this device's own versions before the uploader has recorded them. It waits for the answer
  /// and finds the echoes, instead of holding each record back (an index write) to release it
  /// at a later pull (another).
  @Test func aPullThatMeetsItsOwnVersionsBeforeTheirAnswerWaitsForIt() async throws {
    try await onOwnThread {
      let (counted, a, _) = try twoDevices()
      let worker = try #require(a.worker)
      let puller = try #require(a.puller)
      puller.commitInFlight = { worker.isCommitting($0) }
      for i in 0..<5 { try a.writeFile("f\(i)", Data("\(i)".utf8)) }
      let pull = LockedBox<Task<Int, Error>>()
      let held = LockedBox<[String]>()
      counted.afterPutItems = {
        guard pull.get() == nil else { return }
        let task = Task {
          let results = try await puller.pullOnce()
          held.set(try a.index.heldRemote().map(\.name))
          return results
        }
        pull.set(task)
        // The answer comes late: the pull has long had the records by then.
        try? await Task.sleep(nanoseconds: 200_000_000)
      }
      try a.drainUploads()
      counted.afterPutItems = nil
      let task = try #require(pull.get())
      let applied = try runBlocking { try await task.value }
      try checkThat(held.get() == [], "records held back: \(held.get() ?? [])")
      try checkThat(applied == 0, "the pull applied \(applied) changes")
      try checkThat(try a.index.dueQueue(now: Int64.max / 2, limit: 10).isEmpty, "a's queue is empty")
    }
  }

  /// A pull with a budget (a daemon's first pull, before the mount appears) stops after the
  /// page that ends past it, with the token in front of what it did not apply: the next pull
  /// brings the rest, and nothing is lost or applied twice. Each page's changes reach
  /// `onApplied` (the kernel's caches) as the page is done.
  @Test func aPullWithABudgetStopsAfterAPageAndTheNextPullBringsTheRest() async throws {
    try await onOwnThread {
      let (_, a, b) = try twoDevices()
      let d = try a.core.mkdir(parent: a.documents, name: "d", mode: 0o755, caller: .current).inode
      for i in 0..<1200 { _ = try a.core.mknod(parent: d, name: "f\(i)", mode: 0o100644, caller: .current) }
      try a.drainUploads()
      let puller = try #require(b.puller)
      let reported = LockedBox<[Int]>()
      puller.onApplied = { results in reported.set((reported.get() ?? []) + [results.count]) }
      // The feed: root and Documents (b has them: unchanged), d, then the 1,200 files; pages of 500.
      let first = try runBlocking { try await puller.pullOnce(budget: .zero) }
      try checkThat(first == 498, "the first page alone was applied: \(first)")
      try checkThat(reported.get() == [498], "one page reported: \(reported.get() ?? [])")
      let rest = try runBlocking { try await puller.pullOnce() }
      try checkThat(rest == 703, "the rest came with the next pull: \(rest)")
      try checkThat(reported.get() == [498, 500, 203], "each page reported as it was done: \(reported.get() ?? [])")
      try checkThat(try b.listing("d").count == 1202, "b lists d with its 1,200 files")
    }
  }

  /// Records held back by local changes wait for the whole feed, as a later record may free
  /// the name one of them takes: a pull that stops on its budget leaves them held, and the
  /// pull that reaches the end of the feed applies them.
  @Test func aPullStoppedByItsBudgetLeavesHeldRecordsForTheEndOfTheFeed() async throws {
    try await onOwnThread {
      let (_, a, b) = try twoDevices()
      try a.writeFile("f", Data("one\n".utf8))
      try a.drainUploads()
      try b.pull()
      let f = try #require(try b.inode("f"))
      // b holds f open for writing: a's edit of it is held back.
      let handle = try b.core.open(f, flags: O_RDWR, caller: .current).handle
      try a.writeFile("f", Data("two\n".utf8))
      try a.drainUploads()
      try b.pull()
      try checkThat(try b.index.heldRemote().map(\.name) == ["f"], "a's edit waits for b's writer")
      b.core.release(handle)
      // More than a page of changes after the held record.
      let d = try a.core.mkdir(parent: a.documents, name: "d", mode: 0o755, caller: .current).inode
      for i in 0..<600 { _ = try a.core.mknod(parent: d, name: "g\(i)", mode: 0o100644, caller: .current) }
      try a.drainUploads()
      let puller = try #require(b.puller)
      _ = try runBlocking { try await puller.pullOnce(budget: .zero) }
      try checkThat(try b.index.heldRemote().map(\.name) == ["f"], "held until the end of the feed")
      try b.pull()
      try checkThat(try b.index.heldRemote().isEmpty, "applied at the end of the feed")
      try checkThat(try b.readFile("f") == Data("two\n".utf8), "b has a's edit")
    }
  }

  /// A new device's catch-up writes its index a page at a time: the records of items that are
  /// not here yet are applied together, in one transaction per run of them, not one each.
  @Test func aCatchUpAppliesNewRecordsAPageAtATime() async throws {
    try await onOwnThread {
      let engine = try CloudEngine.embedded(directory: CoreWorld.temporaryFolder("ubiq-cloud"))
      let a = try CoreWorld(cloud: engine)
      let commits = LockedBox<Int>()
      commits.set(0)
      let b = try CoreWorld(
        cloud: engine,
        statementObserver: { sql in
          if sql.uppercased().hasPrefix("COMMIT") { commits.set((commits.get() ?? 0) + 1) }
        })
      let d = try a.core.mkdir(parent: a.documents, name: "d", mode: 0o755, caller: .current).inode
      for i in 0..<1200 { _ = try a.core.mknod(parent: d, name: "f\(i)", mode: 0o100644, caller: .current) }
      try a.drainUploads()
      commits.set(0)
      try b.pull()
      let written = commits.get() ?? 0
      try checkThat(written < 20, "the catch-up of 1,201 records committed \(written) index transactions")
      let names = Set(try b.listing("d"))
      try checkThat(names.count == 1202 && names.contains("f1199"), "b lists d with its 1,200 files")
    }
  }

  /// A batch of deletes that the cloud carried out but whose reply was lost: sent again, each
  /// delete finds its tombstone and writes nothing, and the queue empties.
  @Test func aBatchOfDeletesWhoseReplyWasLostIsDoneOnce() async throws {
    try await onOwnThread {
      let (counted, a, b) = try twoDevices()
      let engine = try #require(counted.inner as? CloudEngine)
      for i in 0..<40 { try a.writeFile("g\(i)", Data()) }
      try a.drainUploads()
      try b.pull()
      for i in 0..<40 { try a.core.unlink(parent: a.documents, name: "g\(i)") }
      let before = try runBlocking { try await engine.lastChange(a.container) }
      counted.repliesToLose = 1
      try a.drainUploadsOnce()
      try checkThat(try a.index.dueQueue(now: Int64.max / 2, limit: 64).count == 40, "the 40 deletes stay queued")
      try checkThat(try runBlocking { try await engine.lastChange(a.container) } == before + 40, "the batch was done")
      let requests = counted.deleteRequests
      try a.drainUploads()
      try checkThat(counted.deleteRequests - requests <= 2, "sent again in one request")
      try checkThat(try a.index.dueQueue(now: Int64.max / 2, limit: 10).isEmpty, "a's queue is empty")
      try checkThat(
        try runBlocking { try await engine.lastChange(a.container) } == before + 40, "each delete was written once")
      try b.pull()
      for i in 0..<40 { try checkThat(try b.inode("g\(i)") == nil, "g\(i) is gone on b") }
    }
  }

  /// A hundred new items reach the cloud in a few requests, not one each; a version the cloud
  /// refuses in the middle of a batch (based on a stale etag) is merged on its own, and the
  /// versions after it are still sent together.
  @Test func manyItemsShareRequestsAndARefusedOneIsSettledAlone() async throws {
    try await onOwnThread {
      let (counted, a, b) = try twoDevices()
      try a.writeFile("shared.txt", Data("base\n".utf8))
      try a.drainUploads()
      try b.pull()
      try b.writeFile("shared.txt", Data("from b\n".utf8))
      try b.drainUploads()

      let before = counted.itemRequests
      let folder = try a.core.mkdir(parent: a.documents, name: "d", mode: 0o755, caller: .current).inode
      for i in 0..<50 { try a.writeFile("d/f\(i)", Data()) }
      try a.writeFile("shared.txt", Data("from a\n".utf8))
      for i in 50..<100 { try a.writeFile("d/f\(i)", Data()) }
      try a.drainUploads()
      let requests = counted.itemRequests - before
      // 102 versions: one by one they take 103 requests (the merge needs a second commit).
      try checkThat(requests <= 10, "102 versions took \(requests) requests")
      try checkThat(try a.index.dueQueue(now: Int64.max / 2, limit: 10).isEmpty, "a's queue is empty")
      _ = folder

      try b.pull()
      try a.pull()
      for i in 0..<100 { try checkThat(try b.inode("d/f\(i)") != nil, "d/f\(i) reached b") }
      try checkThat(try a.readFile("shared.txt") == b.readFile("shared.txt"), "a and b show one shared.txt")
      let shared = try #require(try b.index.item(b.inode("shared.txt")!))
      try checkThat(shared.conflictList.count == 1, "the losing edit is kept as a conflict version")
    }
  }

  /// A batch stored in the cloud whose reply was lost: on the retry every version's etag is
  /// stale, so the cloud refuses each in turn. Each costs a few versions sent, not a resend
  /// of all the ones after it.
  @Test func refusalsInARowCostEachEntryFewVersionsSent() async throws {
    try await onOwnThread {
      let (counted, a, b) = try twoDevices()
      // As many as one pass of the test harness takes (64).
      for i in 0..<60 { try a.writeFile("f\(i)", Data()) }
      counted.repliesToLose = 1
      try a.drainUploadsOnce()
      let sent = counted.committedNames.count
      try checkThat(sent == 60, "the first batch carried every version (\(sent))")
      try a.drainUploads()
      let resent = counted.committedNames.count - sent
      // Re-sent whole after each refusal, the 60 would take about 1,900 versions.
      try checkThat(resent <= 300, "the retry sent \(resent) versions for 60 entries")
      try checkThat(try a.index.dueQueue(now: Int64.max / 2, limit: 10).isEmpty, "a's queue is empty")
      try b.pull()
      for i in 0..<60 { try checkThat(try b.inode("f\(i)") != nil, "f\(i) reached b") }
    }
  }

  /// A page of more versions than one request carries goes in several requests, each recorded
  /// while the next is sent; every version arrives and the queue empties.
  @Test func aPageOfManyVersionsGoesInSeveralRequestsAndEveryOneArrives() async throws {
    try await onOwnThread {
      let (counted, a, b) = try twoDevices()
      let n = 3 * UploadWorker.batchLimit + 10
      for i in 0..<n { try a.writeFile("m\(i)", Data(i % 50 == 0 ? "\(i)".utf8 : "".utf8)) }
      let before = counted.itemRequests
      try a.drainUploads()
      let requests = counted.itemRequests - before
      // At least one request per batch; a content upload slower than the wait for it sends
      // what was gathered before it early, so a few more.
      try checkThat(requests >= 4 && requests <= n / 20, "\(n) versions took \(requests) requests")
      try checkThat(try a.index.dueQueue(now: Int64.max / 2, limit: 10).isEmpty, "a's queue is empty")
      try b.pull()
      for i in 0..<n {
        _ = try #require(try b.inode("m\(i)"), "m\(i) arrived")
        try checkThat(try b.readFile("m\(i)") == Data(i % 50 == 0 ? "\(i)".utf8 : "".utf8), "m\(i) has its bytes")
      }
    }
  }

  /// A batch request stays within its byte budget: versions with big extended attributes go a
  /// few per request, and every one arrives.
  @Test func bigVersionsMakeSmallerBatches() async throws {
    try await onOwnThread {
      let (counted, a, b) = try twoDevices()
      let value = Data(repeating: 0x61, count: 4096)
      for i in 0..<30 {
        let inode = try a.writeFile("x\(i)", Data())
        try a.core.setxattr(inode, name: "user.big", value: value, flags: [])
      }
      // About 12 KB each by the estimate (base64 with escapes): three fit in 40 KB.
      a.worker.batchBytes = 40_000
      let before = counted.itemRequests
      try a.drainUploads()
      let requests = counted.itemRequests - before
      try checkThat(requests >= 10 && requests <= 15, "30 versions of 12 KB took \(requests) requests")
      try b.pull()
      for i in 0..<30 {
        let inode = try #require(try b.inode("x\(i)"))
        try checkThat(try b.index.xattr(inode, "user.big") == value, "x\(i) arrived with its attribute")
      }
    }
  }
}

/// The wait of a page's loop for an entry's preparation (`UploadWorker.PreparedSet`).
@Suite struct PreparedSetTests {
  /// An entry already prepared, or prepared while the loop waits, ends the wait with true; one
  /// that is not prepared in time ends it with false; an insert racing the timer resumes the
  /// wait once (a second resume of a continuation traps).
  @Test func aWaitEndsWhenItsEntryIsPreparedOrItsTimeIsUp() async throws {
    try await onOwnThread {
      try runBlocking {
        let set = UploadWorker.PreparedSet()
        set.insert(0)
        #expect(await set.waitFor(0, upTo: .seconds(1), on: ContinuousClock()))
        #expect(!(await set.waitFor(1, upTo: .milliseconds(2), on: ContinuousClock())))
        // Inserted from elsewhere while the wait is in progress, at every moment around the
        // registration and around the timer's end.
        for i in 2..<2_000 {
          let delayNs = UInt64(i % 7) * 200_000
          let inserter = Task.detached {
            if delayNs > 0 { try? await Task.sleep(nanoseconds: delayNs) }
            set.insert(i)
          }
          let seen = await set.waitFor(i, upTo: .microseconds(i % 5 * 300), on: ContinuousClock())
          // True only for an entry inserted by then.
          if seen { #expect(set.contains(i)) }
          await inserter.value
        }
        // A long wait ends at the insert: a 60 s timer would otherwise hold the test.
        let late = Task.detached {
          try? await Task.sleep(nanoseconds: 20_000_000)
          set.insert(5_000)
        }
        #expect(await set.waitFor(5_000, upTo: .seconds(60), on: ContinuousClock()))
        await late.value
      }
    }
  }
}
