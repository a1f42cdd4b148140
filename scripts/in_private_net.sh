#!/usr/bin/env bash
# Run a command in a private network namespace that has only loopback, when
# this user can (root + unshare), so every server a test starts — including
# Mooncake's, which also listen on 0.0.0.0 — is reachable from nowhere else.
# Elsewhere the command runs as is (tests bind 127.0.0.1 anyway).
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
    && unshare -n true 2>/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$@"
fi
exec "$@"
