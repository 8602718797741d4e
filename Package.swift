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
  ],
  targets: [
    .systemLibrary(name: "CFuse3", pkgConfig: "fuse3", providers: [.apt(["libfuse3-dev"])]),
    .target(
      name: "UbiqCore",
      dependencies: [.product(name: "Crypto", package: "swift-crypto")]),
    .target(
      name: "UbiqIndex",
      dependencies: ["UbiqCore", .product(name: "GRDB", package: "GRDB.swift")]),
    .target(
      name: "UbiqCloud",
      dependencies: [
        "UbiqCore", .product(name: "GRDB", package: "GRDB.swift"),
        .product(name: "Crypto", package: "swift-crypto"),
      ]),
    .target(
      name: "UbiqSync",
      dependencies: [
        "UbiqCore", "UbiqIndex", "UbiqCloud", .product(name: "Logging", package: "swift-log"),
      ]),
    .target(
      name: "UbiqFS",
      dependencies: [
        "CFuse3", "UbiqCore", "UbiqIndex", "UbiqCloud", "UbiqSync",
        .product(name: "Logging", package: "swift-log"),
      ]),
    .executableTarget(
      name: "ubiqfs",
      dependencies: [
        "CFuse3", "UbiqCore", "UbiqIndex", "UbiqCloud", "UbiqSync", "UbiqFS",
        .product(name: "ArgumentParser", package: "swift-argument-parser"),
        .product(name: "Logging", package: "swift-log"),
      ]),
    .testTarget(name: "UbiqCoreTests", dependencies: ["UbiqCore"]),
    .testTarget(name: "UbiqCloudTests", dependencies: ["UbiqCore", "UbiqCloud", "UbiqIndex"]),
  ],
  swiftLanguageModes: [.v5]
)
