import ArgumentParser
import CFuse3
import Foundation
import UbiqCore
import UbiqDaemon
import UbiqIndex
import UbiqSync

#if canImport(Glibc)
  import Glibc
#endif

/// `ubiqfs check`: compares a mounted container's index with the cloud's whole tree and, with
/// --repair, mends what sync would never mend by itself.
struct CheckCommand: ParsableCommand {
  static let configuration = CommandConfiguration(
    commandName: "check", abstract: "Compare what a mount shows with the cloud, item by item; --repair mends faults.",
    discussion: """
      Every item of the container, in the cloud and in this device's index, is compared. A \
      difference sync is still working on (a change not uploaded yet, a cloud change not pulled \
      yet, a change held back) is counted; one nothing would mend is a fault and is listed. \
      Exit status 0 when there is no fault, 1 otherwise. --repair mends faults: items missing \
      here or missed changes are pulled again (the whole change feed is read again, each record \
      under the usual rules), items the cloud does not have are uploaded again, items it has \
      otherwise under the same version are merged with its version (both contents are kept, \
      the older as a conflict version), and the check runs again until no fault is left or \
      --timeout has passed.
      """)

  @Argument(help: "A path inside a mount (default: every mounted container).") var path: String?
  @Flag(help: "Mend the faults found, then check again.") var repair = false
  @Option(help: "With --repair, give up after this many seconds (exit 1).") var timeout: Double = 120
  @Flag(help: "Machine-readable output: one JSON object per container.") var json = false
  @OptionGroup var location: LocationOptions

  struct Report: Codable {
    struct Item: Codable {
      var itemID: String
      var path: String
      var problem: String
      var repair: String?
    }
    var container: String
    var faults: [Item]
    /// Differences sync is still working on.
    var inFlight: Int
    var repaired: Bool
  }

  func run() throws {
    try cli {
      let states: [ContainerState]
      if let path {
        states = [try ContainerState.locate(path, location.paths).0]
      } else {
        states = ContainerState.all(location.paths).filter { $0.daemon != nil }
      }
      if states.isEmpty {
        throw UbiqError.invalidArgument(
          "nothing is mounted; mount a container with `ubiqfs mount [CONTAINER] MOUNTPOINT`")
      }
      let session = try CloudSession.open(location.paths)
      if let other = states.first(where: { $0.account != session.account }) {
        throw UbiqError.invalidArgument(
          "\(other.container) is mounted for account \(other.account), and this machine is signed in to \(session.account)"
        )
      }
      let cloud = try session.makeCloud()
      var faulty = false
      for state in states {
        let container = try ContainerID(state.container)
        let index = try state.openIndex(readOnly: !repair)
        func compare() throws -> [SyncAudit.Finding] {
          try runBlocking { try await CloudAudit.compare(index: index, cloud: cloud, container: container) }
        }
        var findings = try compare()
        var repaired = false
        if repair && findings.contains(where: \.problem.isFault) {
          let readsBefore = try index.feedReadsFromStart()
          let pullAgain = try mend(findings, state: state, index: index)
          repaired = true
          let deadline = Date().addingTimeInterval(timeout)
          // A fault may look mended while the feed is read again (the token goes back to its
          // start, so every record is past it): the check counts once the read has ended.
          while try pullAgain && index.feedReadsFromStart() <= readsBefore && Date() < deadline {
            usleep(100_000)
          }
          findings = try compare()
          while findings.contains(where: \.problem.isFault) && Date() < deadline {
            usleep(250_000)
            findings = try compare()
          }
        }
        let faults = findings.filter(\.problem.isFault)
        faulty = faulty || !faults.isEmpty
        let report = Report(
          container: state.container,
          faults: faults.map {
            Report.Item(itemID: $0.itemID, path: $0.path, problem: "\($0.problem)", repair: $0.problem.repair?.rawValue)
          }, inFlight: findings.count - faults.count, repaired: repaired)
        print(report, for: state)
      }
      if faulty { throw ExitCode.failure }
    }
  }

  /// Queues the uploads that mend the faults and has the mount read its change feed again if
  /// that mends some; returns whether it does.
  func mend(_ findings: [SyncAudit.Finding], state: ContainerState, index: IndexStore) throws -> Bool {
    guard let mountpoint = state.daemon?.mountpoint else {
      throw UbiqError.invalidArgument("\(state.container) is not mounted: mount it to repair")
    }
    let (_, pullAgain) = try CloudAudit.queueUploads(for: findings, index: index)
    guard pullAgain else { return false }
    let action = "resync"
    if setxattr(mountpoint, "user.ubiq.action", action, action.utf8.count, 0) != 0 {
      throw UbiqError.io("asking the mount at \(mountpoint) to pull again: \(String(cString: strerror(errno)))")
    }
    return true
  }

  func print(_ report: Report, for state: ContainerState) {
    if json {
      let enc = JSONEncoder()
      enc.outputFormatting = .sortedKeys
      Swift.print(String(decoding: (try? enc.encode(report)) ?? Data(), as: UTF8.self))
      return
    }
    let mountedAt = state.daemon.map { " (\($0.mountpoint))" } ?? ""
    for f in report.faults { Swift.print("\(state.container): \(f.path): \(f.problem)") }
    let inFlight = report.inFlight == 0 ? "" : "; \(report.inFlight) changes still syncing"
    if report.faults.isEmpty {
      Swift.print(
        "\(state.container)\(mountedAt): in agreement with the cloud\(report.repaired ? " after repair" : "")\(inFlight)"
      )
    } else {
      Swift.print("\(state.container)\(mountedAt): \(report.faults.count) faults\(inFlight)")
    }
  }
}
