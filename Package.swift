// swift-tools-version:6.0
import PackageDescription

let package = Package(
  name: "ubiqfs",
  platforms: [.macOS(.v14)],
  products: [
    .executable(name: "ubiqfs", targets: ["ubiqfs"])
  ],
  dependencies: [
    .package(url: "https://github.com/groue/GRDB.swift", from: "7.10.0"),
    .package(url: "https://github.com/apple/swift-argument-parser", from: "1.8.2"),
    .package(url: "https://github.com/apple/swift-log", from: "1.16.2"),
    .package(url: "https://github.com/apple/swift-crypto", from: "3.12.3"),
    // Server and scale-out engines.
    .package(url: "https://github.com/hummingbird-project/hummingbird", from: "2.28.1"),
    .package(url: "https://github.com/swift-server/async-http-client", from: "1.37.0"),
    .package(url: "https://github.com/vapor/postgres-nio", from: "1.33.2"),
    .package(url: "https://github.com/swift-server/swift-service-lifecycle", from: "2.13.0"),
    .package(url: "https://github.com/apple/swift-metrics", from: "2.13.0"),
    .package(url: "https://github.com/swift-server/swift-prometheus", from: "2.4.1"),
    .package(url: "https://github.com/apple/swift-nio", from: "2.101.0"),
    .package(url: "https://github.com/apple/swift-nio-ssl", from: "2.37.0"),
    .package(url: "https://github.com/x-sheep/swift-property-based", from: "2.0.1"),
    // Tests: a clock that moves only when a test moves it.
    .package(url: "https://github.com/pointfreeco/swift-clocks", from: "1.1.1"),
  ],
  targets: [
    .systemLibrary(name: "CFuse3", pkgConfig: "fuse3", providers: [.apt(["libfuse3-dev"])]),
    // Linux calls that Swift's Glibc module does not show.
    .target(name: "CLinux"),
    // The index's statement trace in C (the SQL a change ran, for the redo log).
    .target(name: "CStatementCapture", linkerSettings: [.linkedLibrary("sqlite3")]),
    .target(
      name: "UbiqCore",
      dependencies: [.product(name: "Crypto", package: "swift-crypto")]),
    // The client's contract with a cloud: CloudService and KeyValueService, the wire model
    // (items, changes, usage, key-value entries, tokens) and the typed errors.
    .target(
      name: "UbiqCloudAPI",
      dependencies: ["UbiqCore", .product(name: "Crypto", package: "swift-crypto")]),
    // What every SQLite database of ubiqfs shares (migrations among processes).
    .target(name: "UbiqSQLite", dependencies: [.product(name: "GRDB", package: "GRDB.swift")]),
    .target(
      name: "UbiqIndex",
      dependencies: [
        "CStatementCapture", "UbiqCore", "UbiqSQLite", .product(name: "GRDB", package: "GRDB.swift"),
      ]),
    // The cloud's rules (CloudEngine) over its storage protocols, with the embedded storage
    // (SQLite metadata, blob folder): the default cloud of a mount and one backend of `serve`.
    .target(
      name: "UbiqCloud",
      dependencies: [
        "UbiqCore", "UbiqCloudAPI", "UbiqSQLite", .product(name: "GRDB", package: "GRDB.swift"),
        .product(name: "Crypto", package: "swift-crypto"),
      ]),
    // Scale-out engines: PostgreSQL metadata, S3 chunks (SigV4).
    .target(
      name: "UbiqCloudScale",
      dependencies: [
        "UbiqCore", "UbiqCloudAPI", "UbiqCloud",
        .product(name: "PostgresNIO", package: "postgres-nio"),
        .product(name: "AsyncHTTPClient", package: "async-http-client"),
        .product(name: "NIOCore", package: "swift-nio"),
        .product(name: "NIOHTTP1", package: "swift-nio"),
        .product(name: "NIOFoundationCompat", package: "swift-nio"),
        .product(name: "Crypto", package: "swift-crypto"),
        .product(name: "Logging", package: "swift-log"),
        .product(name: "NIOSSL", package: "swift-nio-ssl"),
      ]),
    // The client of `ubiqfs serve`: HTTPCloud (CloudService) and HTTPKeyValue (KeyValueService).
    .target(
      name: "UbiqHTTPClient",
      dependencies: [
        "UbiqCore", "UbiqCloudAPI",
        .product(name: "AsyncHTTPClient", package: "async-http-client"),
        .product(name: "NIOCore", package: "swift-nio"),
        .product(name: "NIOHTTP1", package: "swift-nio"),
        .product(name: "NIOFoundationCompat", package: "swift-nio"),
        .product(name: "NIOSSL", package: "swift-nio-ssl"),
        .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
      ]),
    // `ubiqfs serve`: the HTTP API over the cloud engines.
    .target(
      name: "UbiqServer",
      dependencies: [
        "UbiqCore", "UbiqCloudAPI", "UbiqCloud", "UbiqCloudScale",
        .product(name: "Hummingbird", package: "hummingbird"),
        .product(name: "HummingbirdTLS", package: "hummingbird"),
        .product(name: "NIOSSL", package: "swift-nio-ssl"),
        .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
        .product(name: "Metrics", package: "swift-metrics"),
        .product(name: "Prometheus", package: "swift-prometheus"),
        .product(name: "Logging", package: "swift-log"),
        .product(name: "NIOFoundationCompat", package: "swift-nio"),
        .product(name: "NIOHTTP1", package: "swift-nio"),
      ]),
    // The key-value store's client: local mirror (kv.sqlite) and its sync.
    .target(
      name: "UbiqKV",
      dependencies: ["UbiqCore", "UbiqCloudAPI", "UbiqSQLite", .product(name: "GRDB", package: "GRDB.swift")]),
    .target(
      name: "UbiqSync",
      dependencies: [
        "UbiqCore", "UbiqIndex", "UbiqCloudAPI", .product(name: "Logging", package: "swift-log"),
      ]),
    // The filesystem's semantics without FUSE: typed requests and results, tested in-process.
    .target(
      name: "UbiqFSCore",
      dependencies: [
        "CLinux", "UbiqCore", "UbiqIndex", "UbiqCloudAPI", "UbiqSync",
        .product(name: "Logging", package: "swift-log"),
      ]),
    // The thin FUSE adapter over UbiqFSCore and the libfuse session.
    .target(
      name: "UbiqFS",
      dependencies: [
        "CFuse3", "UbiqCore", "UbiqIndex", "UbiqFSCore",
        .product(name: "Logging", package: "swift-log"),
      ]),
    // One mount's daemon (index, cache, cloud, workers and the FUSE session wired together) and
    // the state root it shares with the commands: paths, account session, daemon records.
    .target(
      name: "UbiqDaemon",
      dependencies: [
        "CFuse3", "UbiqCore", "UbiqIndex", "UbiqCloudAPI", "UbiqCloud", "UbiqSync", "UbiqFS", "UbiqFSCore",
        "UbiqHTTPClient", "UbiqKV", .product(name: "Logging", package: "swift-log"),
      ]),
    // The command line: parses arguments, calls the libraries, prints.
    .executableTarget(
      name: "ubiqfs",
      dependencies: [
        "CFuse3", "UbiqCore", "UbiqIndex", "UbiqCloudAPI", "UbiqCloud", "UbiqSync", "UbiqFS", "UbiqFSCore",
        "UbiqCloudScale", "UbiqHTTPClient", "UbiqServer", "UbiqKV", "UbiqDaemon",
        .product(name: "ArgumentParser", package: "swift-argument-parser"),
        .product(name: "Logging", package: "swift-log"),
      ]),
    .testTarget(
      name: "UbiqCoreTests",
      dependencies: ["UbiqCore", .product(name: "PropertyBased", package: "swift-property-based")]),
    .testTarget(
      name: "UbiqIndexTests",
      dependencies: [
        "UbiqCore", "UbiqIndex", .product(name: "GRDB", package: "GRDB.swift"),
        .product(name: "PropertyBased", package: "swift-property-based"),
      ]),
    .testTarget(
      name: "UbiqFSCoreTests",
      dependencies: [
        "UbiqCore", "UbiqIndex", "UbiqCloudAPI", "UbiqCloud", "UbiqSync", "UbiqFSCore", "UbiqServer", "UbiqHTTPClient",
        .product(name: "Logging", package: "swift-log"),
        .product(name: "Hummingbird", package: "hummingbird"),
        .product(name: "PropertyBased", package: "swift-property-based"),
        .product(name: "Clocks", package: "swift-clocks"),
      ]),
    .testTarget(
      name: "UbiqDaemonTests", dependencies: ["UbiqCore", "UbiqCloudAPI", "UbiqCloud", "UbiqIndex", "UbiqDaemon"]),
    .testTarget(name: "UbiqKVTests", dependencies: ["UbiqCore", "UbiqCloudAPI", "UbiqCloud", "UbiqKV"]),
    .testTarget(
      name: "UbiqCloudTests",
      dependencies: [
        "UbiqCore", "UbiqCloudAPI", "UbiqCloud", "UbiqIndex", .product(name: "GRDB", package: "GRDB.swift"),
      ]),
    .testTarget(
      name: "UbiqCloudScaleTests",
      dependencies: [
        "UbiqCore", "UbiqCloudAPI", "UbiqCloud", "UbiqCloudScale",
        .product(name: "AsyncHTTPClient", package: "async-http-client"),
      ]),
    .testTarget(
      name: "UbiqServerTests",
      dependencies: [
        "UbiqCore", "UbiqCloudAPI", "UbiqCloud", "UbiqServer", "UbiqHTTPClient",
        .product(name: "Hummingbird", package: "hummingbird"),
        .product(name: "Logging", package: "swift-log"),
      ]),
  ],
  swiftLanguageModes: [.v6]
)
