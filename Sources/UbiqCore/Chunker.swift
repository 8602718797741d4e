import Crypto
import Foundation

#if canImport(Glibc)
  import Glibc
#endif

/// Content-defined chunking (FastCDC-style gear hash with normalized chunking) plus SHA-256
/// chunk identifiers. Boundaries depend only on content, so an edit in the middle of a large
/// file changes only the chunks around it.
public struct Chunker: Sendable {
  public let minSize: Int
  public let averageSize: Int
  public let maxSize: Int
  private let maskSmall: UInt64
  private let maskLarge: UInt64

  /// ~1 MiB average chunks, 256 KiB minimum, 4 MiB maximum, normalization level 1.
  public static let standard = Chunker(minSize: 256 << 10, averageSize: 1 << 20, maxSize: 4 << 20)

  /// `normalization`: how many bits harder the mask is before the average size (and easier
  /// after it). A higher level keeps chunk sizes closer to the average, but after an edit the
  /// chunk boundaries take longer to fall back in step with the old ones (each chunk starts the
  /// harder mask at its own offset), so a small edit re-uploads more: for an edit of one
  /// average chunk, about 6.6 average chunks at the 99th percentile with level 1 and 9.9 with
  /// level 2 (`ChunkerTests.testASmallEditReChunksLittleEvenInTheTail`).
  public init(minSize: Int, averageSize: Int, maxSize: Int, normalization: Int = 1) {
    precondition(minSize > 0 && minSize <= averageSize && averageSize <= maxSize)
    precondition((0...8).contains(normalization))
    self.minSize = minSize
    self.averageSize = averageSize
    self.maxSize = maxSize
    let bits = max(1, Int(log2(Double(averageSize)).rounded()))
    // Normalized chunking: a harder mask before the average size, an easier one after it.
    // Masks select high bits, which depend on the last 64 bytes of the gear window.
    maskSmall = ~UInt64(0) << UInt64(64 - min(63, bits + normalization))
    maskLarge = ~UInt64(0) << UInt64(64 - max(1, bits - normalization))
  }

  /// Length of the next chunk at the start of `buf` (which is either at least `maxSize` long or
  /// the end of the input).
  public func cutPoint(_ buf: UnsafeRawBufferPointer) -> Int {
    let n = buf.count
    if n <= minSize { return n }
    let end = min(n, maxSize)
    let normal = min(end, averageSize)
    var hash: UInt64 = 0
    var i = minSize
    let gear = Gear.table
    while i < normal {
      hash = (hash << 1) &+ gear[Int(buf[i])]
      if hash & maskSmall == 0 { return i + 1 }
      i += 1
    }
    while i < end {
      hash = (hash << 1) &+ gear[Int(buf[i])]
      if hash & maskLarge == 0 { return i + 1 }
      i += 1
    }
    return end
  }

  /// Splits an open file into chunks, reading it sequentially from offset 0, and hands each
  /// chunk's reference and bytes to `body` in order.
  public func chunkFile(fd: Int32, body: (ChunkRef, Data) throws -> Void) throws {
    let readSize = max(maxSize * 2, 8 << 20)
    let fullSize = readSize + maxSize
    // Small files (most of them) get a small buffer: zeroing 12 MiB per file dominated the cost
    // of uploading many small files. The buffer grows if the file turns out larger.
    var st = stat()
    let expected = fstat(fd, &st) == 0 ? Int(st.st_size) : fullSize
    var buffer = [UInt8](repeating: 0, count: min(fullSize, max(expected, 0) + 64 * 1024))
    var filled = 0
    var offset: Int64 = 0
    var eof = false
    while true {
      while !eof && filled < maxSize {
        if filled == buffer.count {
          buffer.append(contentsOf: repeatElement(0, count: min(fullSize, buffer.count * 2) - buffer.count))
        }
        let got = buffer.withUnsafeMutableBytes { raw -> Int in
          pread(fd, raw.baseAddress! + filled, raw.count - filled, off_t(offset))
        }
        if got < 0 {
          if errno == EINTR { continue }
          throw UbiqError.io("read failed: \(String(cString: strerror(errno)))")
        }
        if got == 0 {
          eof = true
        } else {
          filled += got
          offset += Int64(got)
        }
      }
      if filled == 0 { return }
      let cut = buffer.withUnsafeBytes { raw in cutPoint(UnsafeRawBufferPointer(rebasing: raw[0..<filled])) }
      let data = Data(buffer[0..<cut])
      try body(ChunkRef(hash: Self.sha256Hex(data), length: Int64(cut)), data)
      buffer.withUnsafeMutableBytes { raw in
        if filled > cut { memmove(raw.baseAddress!, raw.baseAddress! + cut, filled - cut) }
      }
      filled -= cut
    }
  }

  /// Lower-case hex SHA-256 of `data`.
  public static func sha256Hex(_ data: Data) -> String {
    Hex.lowercase(SHA256.hash(data: data))
  }

  /// True if `s` looks like a SHA-256 hex digest.
  public static func isValidHash(_ s: String) -> Bool {
    s.utf8.count == 64 && s.utf8.allSatisfy { (0x30...0x39).contains($0) || (0x61...0x66).contains($0) }
  }
}

/// The gear table: 256 fixed pseudo-random 64-bit values (splitmix64 from a constant seed),
/// identical on every device so that every device cuts the same chunks.
enum Gear {
  static let table: [UInt64] = {
    var state: UInt64 = 0x7562_6971_6673_2d31  // "ubiqfs-1"
    return (0..<256).map { _ in
      state &+= 0x9E37_79B9_7F4A_7C15
      var z = state
      z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
      z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
      return z ^ (z >> 31)
    }
  }()
}
