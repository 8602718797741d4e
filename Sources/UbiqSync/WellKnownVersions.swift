import UbiqCloudAPI
import UbiqCore
import UbiqIndex

/// The cloud creates the root and Documents of every container; a fresh index takes the cloud's
/// versions of them (`IndexStore.adoptWellKnown`) before its first pull. Owns no state.
public enum WellKnownVersions {
  /// Adopts the cloud's version of each well-known item the index has no etag for yet.
  public static func adopt(index: IndexStore, cloud: CloudService, container: ContainerID) async throws {
    for id in [WellKnownItem.root, WellKnownItem.documents] {
      guard let row = try index.item(itemID: id), row.etag == nil,
        let remote = try await cloud.item(container, itemID: id)
      else { continue }
      try index.adoptWellKnown(remote)
    }
  }
}
