import CStatementCapture
import Foundation
import GRDB
import UbiqCore

/// The write transaction that the mount's namespace and content-record changes share
/// (`IndexStore.batchedWrite`), committed every `NamespaceBatchPolicy.maxChanges` changes or
/// `maxDelayNs` after it opened, and the redo log that keeps each change safe against a crash of the daemon
/// before that commit.
///
/// A change runs in a savepoint of the open transaction; the statements it ran (captured by the
/// writer connection's trace, with their values) are copied into the redo log (a shared mapping)
/// before the change returns, so a reply to the kernel follows its change as it followed a WAL
/// commit before: in the page cache, durable against a killed process, not against a power
/// loss. Every write transaction of the index bumps `meta.commitSeq`, and a batch's log names
/// the sequence its batch began on; at the next open the log is run again if the index is at
/// that sequence (the batch never committed: SQLite gives its inserts the same rowids), and is
/// dropped otherwise (the batch committed, or a power loss took the index back further).
///
/// Owns: whether a batch is open (`isOpen`, read from any thread), the statements of the open
/// batch and of the running change, the log file and its lock. Every method that takes a
/// `Database` runs on the pool's writer queue.
final class NamespaceBatch: @unchecked Sendable {
  let policy: NamespaceBatchPolicy
  /// The writer connection's trace: the statements of the change running now.
  let capture: StatementCapture
  private let log: RedoLog
  private let stateLock = NSLock()
  /// A batch is open on the writer connection (guarded by `stateLock`).
  private var open = false
  /// A commit is scheduled for the open batch (guarded by `stateLock`).
  private var commitScheduled = false
  /// Changes in the open batch, and the statements they ran (writer queue only).
  private var changes = 0
  private var statements: [String] = []
  /// The log could not be written or emptied: until a batch empties it again, each change
  /// commits by itself (writer queue only).
  private var logBroken = false
  /// Schedules `commit` on the writer queue after the given delay (set by the index).
  var scheduleCommit: (@Sendable (_ afterNs: Int64) -> Void)?

  var isOpen: Bool { stateLock.withLock { open } }

  private init(policy: NamespaceBatchPolicy, capture: StatementCapture, log: RedoLog) {
    self.policy = policy
    self.capture = capture
    self.log = log
  }

  /// Opens the redo log beside `databasePath` and runs again what a crash left in it.
  /// Nil when another process or index holds the log (only one may batch changes of an index).
  static func open(
    pool: any DatabaseWriter, databasePath: String, policy: NamespaceBatchPolicy, capture: StatementCapture
  ) throws -> NamespaceBatch? {
    guard let log = try RedoLog(path: databasePath + "-redo") else { return nil }
    if let (base, records) = log.records(), !records.isEmpty {
      try pool.writeWithoutTransaction { db in
        try db.execute(sql: "BEGIN IMMEDIATE TRANSACTION")
        do {
          if try Self.storedSeq(db) == base {
            try Self.run(records.flatMap { $0 }, db)
            try Self.bumpSeq(db)
          }
          try db.execute(sql: "COMMIT TRANSACTION")
        } catch {
          if db.isInsideTransaction { try? db.rollback() }
          throw error
        }
      }
    }
    do {
      try log.map()
    } catch {
      return nil
    }
    return NamespaceBatch(policy: policy, capture: capture, log: log)
  }

  /// Runs `body` as one change of the open batch (opening one if none is), logs its statements
  /// and commits the batch if it is full. A change that throws is undone, the rest of the batch
  /// stays.
  func run<T>(_ db: Database, _ body: (Database) throws -> T) throws -> T {
    if !db.isInsideTransaction {
      // A batch with changes but no transaction: SQLite ended it by itself (a full disk, an I/O
      // error) at a commit that failed; its changes, still in the log, are run again.
      if changes > 0 { try redo(db) } else { try begin(db) }
    }
    try db.cached("SAVEPOINT change").execute()
    let value: T
    let ran: [String]
    do {
      (value, ran) = try capture.statements { try body(db) }
    } catch {
      try undoChange(db)
      throw error
    }
    try db.cached("RELEASE SAVEPOINT change").execute()
    changes += 1
    statements += ran
    if !logBroken && !ran.isEmpty {
      do {
        try log.append(ran)
      } catch {
        logBroken = true
      }
    }
    if logBroken {
      // Not in the log: only its commit keeps the change.
      try commit(db)
    } else if changes >= policy.maxChanges {
      // The change is in the log: a commit that fails is tried again by the timer or the next
      // change, and does not fail the change.
      try? commit(db)
    }
    return value
  }

  /// Commits the open batch, if there is one (its log then no longer applies).
  func commit(_ db: Database) throws {
    guard isOpen else { return }
    var committed = false
    if db.isInsideTransaction {
      try Self.bumpSeq(db)
      do {
        try db.cached("COMMIT TRANSACTION").execute()
        committed = true
      } catch {
        guard !db.isInsideTransaction else { throw error }
      }
    }
    if !committed {
      // SQLite ended the transaction by itself (a full disk, an I/O error), at this COMMIT or
      // after the last change: the batch's changes run again from their statements.
      try redo(db)
      try Self.bumpSeq(db)
      try db.cached("COMMIT TRANSACTION").execute()
    }
    changes = 0
    statements = []
    stateLock.withLock { open = false }
    log.markBatchOpen(false)
  }

  /// The commit scheduled when a batch opened: commits the open batch, if any (a batch that
  /// filled up committed already; the one open now is younger than its deadline).
  /// A commit that fails is tried again after the same delay.
  func scheduledCommit(_ db: Database) throws {
    stateLock.withLock { commitScheduled = false }
    do {
      try commit(db)
    } catch {
      let again = stateLock.withLock {
        guard open, !commitScheduled else { return false }
        commitScheduled = true
        return true
      }
      if again { scheduleCommit?(policy.maxDelayNs) }
      throw error
    }
  }

  /// Opens a batch: its transaction, and its log, emptied and naming the sequence it begins on.
  private func begin(_ db: Database) throws {
    try db.cached("BEGIN IMMEDIATE TRANSACTION").execute()
    log.markBatchOpen(true)
    changes = 0
    statements = []
    do {
      try log.reset(base: try Self.storedSeq(db))
      logBroken = false
    } catch {
      logBroken = true
    }
    let schedule = stateLock.withLock {
      open = true
      defer { commitScheduled = true }
      return !commitScheduled
    }
    if schedule { scheduleCommit?(policy.maxDelayNs) }
  }

  /// Undoes the change that failed; an empty batch ends.
  private func undoChange(_ db: Database) throws {
    if db.isInsideTransaction {
      try db.cached("ROLLBACK TRANSACTION TO SAVEPOINT change").execute()
      try db.cached("RELEASE SAVEPOINT change").execute()
      if changes == 0 {
        try db.cached("ROLLBACK TRANSACTION").execute()
        stateLock.withLock { open = false }
        log.markBatchOpen(false)
      }
    } else if changes == 0 {
      stateLock.withLock { open = false }
      log.markBatchOpen(false)
    } else {
      // SQLite ended the whole transaction: the batch's earlier changes are run again.
      try redo(db)
    }
  }

  /// Opens a transaction again and runs the open batch's statements in it.
  private func redo(_ db: Database) throws {
    try db.cached("BEGIN IMMEDIATE TRANSACTION").execute()
    do {
      try Self.run(statements, db)
    } catch {
      if db.isInsideTransaction { try? db.rollback() }
      throw error
    }
  }

  /// Runs logged statements in the open transaction. A statement that failed when it first ran
  /// (a change that caught the error and went on) fails again the same way and is passed over;
  /// a failure that ended the transaction is thrown.
  private static func run(_ statements: [String], _ db: Database) throws {
    for sql in statements {
      do {
        try db.execute(sql: sql)
      } catch {
        if !db.isInsideTransaction { throw error }
      }
    }
  }

  private static func storedSeq(_ db: Database) throws -> Int64 {
    try String.fetchOne(db.cached("SELECT value FROM meta WHERE key = 'commitSeq'")).flatMap { Int64($0) } ?? 0
  }

  /// Counts one more write transaction of the index: every write transaction runs this.
  static func bumpSeq(_ db: Database) throws {
    try db.cached(
      """
      INSERT INTO meta(key, value) VALUES ('commitSeq', '1')
      ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1
      """
    ).execute()
  }
}

/// When the changes that share a batch (`NamespaceBatch`) commit.
public struct NamespaceBatchPolicy: Sendable {
  /// Changes after which the batch commits at once.
  public var maxChanges: Int
  /// How long after its first change a batch commits at the latest.
  public var maxDelayNs: Int64

  public init(maxChanges: Int = 64, maxDelayNs: Int64 = 5_000_000) {
    self.maxChanges = maxChanges
    self.maxDelayNs = maxDelayNs
  }
}

/// The statements that change the index, with their values, of the change running on the writer
/// connection (`NamespaceBatch.run`), reported by the connection's trace (`CStatementCapture`:
/// in C, as GRDB's trace makes and trims Swift strings for every statement). Also hands the
/// SQL of every statement to a test's observer.
final class StatementCapture: @unchecked Sendable {
  /// The C side's state: the flag it reads and the sinks it calls. Touched on the writer queue
  /// only, like `captured`.
  private let trace: UnsafeMutablePointer<ubiq_statement_trace>
  private var captured: [String] = []
  private let observer: (@Sendable (String) -> Void)?

  init(observer: (@Sendable (String) -> Void)?) {
    self.observer = observer
    trace = .allocate(capacity: 1)
    trace.initialize(to: ubiq_statement_trace())
  }

  deinit {
    trace.deinitialize(count: 1)
    trace.deallocate()
  }

  /// Starts reporting on the writer connection `db` (from the pool's `prepareDatabase`).
  func install(on db: Database) throws {
    trace.pointee.context = Unmanaged.passUnretained(self).toOpaque()
    trace.pointee.changed = { context, sql in
      let capture = Unmanaged<StatementCapture>.fromOpaque(context!).takeUnretainedValue()
      capture.captured.append(String(cString: sql!))
    }
    if observer != nil {
      trace.pointee.observed = { context, sql in
        let capture = Unmanaged<StatementCapture>.fromOpaque(context!).takeUnretainedValue()
        capture.observer?(String(cString: sql!))
      }
    }
    let code = ubiq_trace_statements(UnsafeMutableRawPointer(db.sqliteConnection), trace)
    // 0 is SQLITE_OK.
    guard code == 0 else {
      throw UbiqError.io("the index's statement trace could not be set (\(code))")
    }
  }

  /// Captures the statements `body` runs.
  func statements<T>(of body: () throws -> T) rethrows -> (T, [String]) {
    captured = []
    trace.pointee.capturing = 1
    defer { trace.pointee.capturing = 0 }
    let value = try body()
    return (value, captured)
  }
}

/// The redo log file of a `NamespaceBatch`: a header (magic, the batch sequence its records
/// apply on) and records of a change's statements, each with its length and a checksum over
/// the sequence, its position and its bytes, so that a torn record, a stale one or zeros a
/// power loss left end the log. An exclusive `flock` says which open index batches changes;
/// a write lock (open file description lock) on its first byte says a batch is open, and an
/// index opened elsewhere (a command of the CLI) waits for it to go (`waitForOpenBatch`), so it
/// reads every change the mount answered before.
final class RedoLog {
  private static let magic = Array("UBIQREDO".utf8)
  /// F_OFD_SETLK and F_OFD_SETLKW of Linux's fcntl.h (behind _GNU_SOURCE, not in Glibc's module).
  private static let setLock: Int32 = 37
  private static let setLockWaiting: Int32 = 38
  private static let headerSize = 16
  /// The log's size: its blocks are allocated once, and records are copied into a shared
  /// mapping of it (no system call per change; a killed process's writes stay in the page
  /// cache). A change whose record does not fit commits its batch instead.
  static let capacity = 4 << 20
  private let fd: Int32
  /// The shared mapping of the whole log, once `map` made it.
  private var mapping: UnsafeMutableRawPointer?
  /// The batch sequence the records apply on.
  private var base: Int64 = 0
  /// Where the next record goes, and how many the log holds.
  private var end = headerSize
  private var count: Int64 = 0

  /// Nil when another open file description holds the log's lock.
  init?(path: String) throws {
    let fd = Foundation.open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
    guard fd >= 0 else { throw UbiqError.posix(errno, "open of the index's redo log \(path)") }
    guard flock(fd, LOCK_EX | LOCK_NB) == 0 else {
      let e = errno
      close(fd)
      if e == EWOULDBLOCK { return nil }
      throw UbiqError.posix(e, "lock of the index's redo log \(path)")
    }
    self.fd = fd
  }

  deinit {
    if let mapping { munmap(mapping, Self.capacity) }
    close(fd)
  }

  /// Allocates the log's blocks (a write into a mapping of blocks a full disk cannot give would
  /// kill the process) and maps it. Throws on a full disk: the index then batches nothing.
  func map() throws {
    let code = posix_fallocate(fd, 0, off_t(Self.capacity))
    guard code == 0 else { throw UbiqError.posix(code, "allocation of the index's redo log") }
    let p = mmap(nil, Self.capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
    guard let p, p != MAP_FAILED else { throw UbiqError.posix(errno, "mapping of the index's redo log") }
    mapping = p
  }

  /// Takes or drops the lock that says a batch is open (waiting out a reader's moment).
  func markBatchOpen(_ open: Bool) {
    var lock = Self.firstByte(open ? F_WRLCK : F_UNLCK)
    while fcntl(fd, Self.setLockWaiting, &lock) != 0 && errno == EINTR {}
  }

  /// Waits, for at most `timeoutNs`, until no batch is open on the index whose redo log is at
  /// `path` (returns at once when there is no log). A batch commits within milliseconds; the
  /// wait polls, because the batching process takes the lock again at its next change.
  static func waitForOpenBatch(path: String, timeoutNs: Int64 = 2_000_000_000) {
    let fd = Foundation.open(path, O_RDONLY | O_CLOEXEC)
    guard fd >= 0 else { return }
    defer { close(fd) }
    let deadline = DispatchTime.now().uptimeNanoseconds + UInt64(timeoutNs)
    while DispatchTime.now().uptimeNanoseconds < deadline {
      var lock = firstByte(F_RDLCK)
      if fcntl(fd, Self.setLock, &lock) == 0 {
        var unlock = firstByte(F_UNLCK)
        _ = fcntl(fd, Self.setLock, &unlock)
        return
      }
      guard errno == EAGAIN || errno == EACCES || errno == EINTR else { return }
      usleep(200)
    }
  }

  private static func firstByte(_ type: Int32) -> flock {
    var lock = flock()
    lock.l_type = Int16(type)
    lock.l_whence = Int16(SEEK_SET)
    lock.l_start = 0
    lock.l_len = 1
    lock.l_pid = 0
    return lock
  }

  /// The sequence and the intact records in the file, nil when it has no valid header.
  func records() -> (base: Int64, records: [[String]])? {
    guard let data = try? FileHandle(fileDescriptor: fd, closeOnDealloc: false).readToEnd() ?? Data() else {
      return nil
    }
    let bytes = [UInt8](data)
    guard bytes.count >= Self.headerSize, Array(bytes[0..<8]) == Self.magic else { return nil }
    let base = Self.int64(bytes, at: 8)
    var records: [[String]] = []
    var at = Self.headerSize
    while let (statements, next) = Self.record(bytes, at: at, base: base, index: Int64(records.count)) {
      records.append(statements)
      at = next
    }
    return (base, records)
  }

  /// Empties the log and writes the header for records applying on `base`.
  func reset(base: Int64) throws {
    var header = Self.magic
    Self.append(base, to: &header)
    // The first record's length and checksum go too: what the last batch left is not read.
    header += [UInt8](repeating: 0, count: 12)
    try write(header, at: 0)
    self.base = base
    end = Self.headerSize
    count = 0
  }

  /// Appends one change's statements.
  func append(_ statements: [String]) throws {
    var payload: [UInt8] = []
    for s in statements {
      let utf8 = Array(s.utf8)
      Self.append(UInt32(utf8.count), to: &payload)
      payload += utf8
    }
    var record: [UInt8] = []
    Self.append(UInt32(payload.count), to: &record)
    Self.append(Self.checksum(base: base, index: count, payload), to: &record)
    record += payload
    try write(record, at: end)
    end += record.count
    count += 1
  }

  private func write(_ bytes: [UInt8], at offset: Int) throws {
    guard let mapping else { throw UbiqError.io("the index's redo log is not mapped") }
    guard bytes.count <= Self.capacity - offset else { throw UbiqError.range("the index's redo log is full") }
    bytes.withUnsafeBytes { (mapping + offset).copyMemory(from: $0.baseAddress!, byteCount: bytes.count) }
  }

  /// The record at `at` and where the next one starts; nil at the end of the intact records.
  private static func record(_ bytes: [UInt8], at: Int, base: Int64, index: Int64) -> ([String], Int)? {
    guard bytes.count - at >= 12 else { return nil }
    let length = Int(uint32(bytes, at: at))
    let sum = UInt64(bitPattern: int64(bytes, at: at + 4))
    let start = at + 12
    guard length <= bytes.count - start else { return nil }
    let payload = Array(bytes[start..<(start + length)])
    guard sum == checksum(base: base, index: index, payload) else { return nil }
    var statements: [String] = []
    var p = 0
    while p < payload.count {
      guard payload.count - p >= 4 else { return nil }
      let n = Int(uint32(payload, at: p))
      p += 4
      guard n <= payload.count - p else { return nil }
      statements.append(String(decoding: payload[p..<(p + n)], as: UTF8.self))
      p += n
    }
    return (statements, start + length)
  }

  /// FNV-1a over the batch sequence, the record's position and its bytes.
  private static func checksum(base: Int64, index: Int64, _ payload: [UInt8]) -> UInt64 {
    var hash: UInt64 = 0xcbf2_9ce4_8422_2325
    func mix(_ byte: UInt8) {
      hash ^= UInt64(byte)
      hash = hash &* 0x0000_0100_0000_01b3
    }
    var prefix: [UInt8] = []
    append(base, to: &prefix)
    append(index, to: &prefix)
    for b in prefix { mix(b) }
    for b in payload { mix(b) }
    return hash
  }

  private static func append(_ value: Int64, to bytes: inout [UInt8]) {
    withUnsafeBytes(of: value.littleEndian) { bytes += $0 }
  }

  private static func append(_ value: UInt64, to bytes: inout [UInt8]) {
    withUnsafeBytes(of: value.littleEndian) { bytes += $0 }
  }

  private static func append(_ value: UInt32, to bytes: inout [UInt8]) {
    withUnsafeBytes(of: value.littleEndian) { bytes += $0 }
  }

  private static func int64(_ bytes: [UInt8], at: Int) -> Int64 {
    var v: UInt64 = 0
    for k in 0..<8 { v |= UInt64(bytes[at + k]) << (8 * UInt64(k)) }
    return Int64(bitPattern: v)
  }

  private static func uint32(_ bytes: [UInt8], at: Int) -> UInt32 {
    var v: UInt32 = 0
    for k in 0..<4 { v |= UInt32(bytes[at + k]) << (8 * UInt32(k)) }
    return v
  }
}
