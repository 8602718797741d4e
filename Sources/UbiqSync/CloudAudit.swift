import Foundation
import UbiqCloudAPI
import UbiqCore
import UbiqIndex

/// Compares this device's index with the cloud's whole tree (`SyncAudit`), and mends what
/// the comparison found. The index is read first, in one transaction, and the cloud after:
/// whatever changed in the cloud since is past the index's change token, so it is reported as
/// not pulled yet, never as a fault.
public enum CloudAudit {
  /// Every item on which the device and the cloud disagree.
  public static func compare(index: IndexStore, cloud: CloudService, container: ContainerID) async throws
    -> [SyncAudit.Finding]
  {
    let local = try index.auditSnapshot()
    let remote = try await wholeTree(cloud: cloud, container: container)
    return SyncAudit.compare(local: local, remote: remote)
  }

  /// The latest version of every item of the container, tombstones included: the change feed
  /// read from its start.
  public static func wholeTree(cloud: CloudService, container: ContainerID) async throws -> [CloudItem] {
    var items: [CloudItem] = []
    var since: Int64 = 0
    while true {
      let batch = try await cloud.changes(container, since: since, limit: 5000)
      items += batch.items
      guard batch.hasMore, batch.token > since else { return items }
      since = batch.token
    }
  }

  /// Queues the uploads that mend `findings` (`SyncAudit.Repair.upload`, `.uploadAsNew`,
  /// `.merge`), and
  /// says whether the change feed must be read again from its start (`.pullAgain`), which
  /// only the mount's puller can do (`ChangePuller.pullEverythingAgain`).
  public static func queueUploads(for findings: [SyncAudit.Finding], index: IndexStore) throws -> (
    queued: Int, pullAgain: Bool
  ) {
    func items(_ repair: SyncAudit.Repair) -> [String] { findings.filter { $0.problem.repair == repair }.map(\.itemID) }
    let uploads = items(.upload) + items(.uploadAsNew) + items(.merge)
    let queued =
      uploads.isEmpty
      ? 0
      : try index.queueRepairUploads(uploads, asNew: Set(items(.uploadAsNew)), merging: Set(items(.merge)))
    return (queued, findings.contains { $0.problem.repair == .pullAgain })
  }
}
