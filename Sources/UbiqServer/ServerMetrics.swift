import Foundation
import Metrics
import Prometheus

/// The server's Prometheus registry and the counters the routes update. `bootstrap()` makes
/// it the process's swift-metrics backend (so Hummingbird's request metrics land in it too).
public final class ServerMetrics: Sendable {
  public let registry = PrometheusCollectorRegistry()
  let chunkBytesIn: Metrics.Counter
  let chunkBytesOut: Metrics.Counter
  let commits: Metrics.Counter
  let conflicts: Metrics.Counter
  let quotaRejections: Metrics.Counter
  let authFailures: Metrics.Counter
  let longPolls: Metrics.Meter

  public init() {
    let factory = PrometheusMetricsFactory(registry: registry)
    func counter(_ label: String) -> Metrics.Counter { Metrics.Counter(label: label, dimensions: [], factory: factory) }
    chunkBytesIn = counter("ubiq_chunk_bytes_uploaded_total")
    chunkBytesOut = counter("ubiq_chunk_bytes_downloaded_total")
    commits = counter("ubiq_item_commits_total")
    conflicts = counter("ubiq_item_conflicts_total")
    quotaRejections = counter("ubiq_quota_rejections_total")
    authFailures = counter("ubiq_auth_failures_total")
    longPolls = Metrics.Meter(label: "ubiq_long_polls_waiting", dimensions: [], factory: factory)
  }

  /// Routes swift-metrics (Hummingbird's per-endpoint request metrics) into this registry.
  /// Once per process.
  public func bootstrap() {
    MetricsSystem.bootstrap(PrometheusMetricsFactory(registry: registry))
  }

  /// The text exposition format.
  public func render() -> String { registry.emitToString() }
}
