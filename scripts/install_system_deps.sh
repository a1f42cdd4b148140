#!/usr/bin/env bash
# Debian packages the L3 tests need: redis-server (Redis backend tests start
# their own servers) and libibverbs1 (the Mooncake wheel links against it).
# Installs only what is missing; needs root (CI and these machines run as root).
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || missing+=(libibverbs1)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "install_system_deps: need root to apt-get install ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
