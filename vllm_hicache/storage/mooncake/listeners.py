"""The TCP listeners Mooncake opens in this process, named in the start-up log.

Mooncake's ``setup()`` starts a transfer engine that listens for peers: a
handshake port and a data port (TCP transport). Mooncake 0.3 binds both to
every interface (``0.0.0.0`` and dual-stack ``[::]``) whatever
``local_hostname`` says (that only picks the address it advertises), and
``MC_TCP_BIND_ADDRESS`` does not change it either (checked against
mooncake-transfer-engine 0.3.13; tests/storage/mooncake pins this). A peer
that reaches those ports can read and write this process's registered memory
(the staging area, memory.py) without authentication. Nothing here can
narrow that; what we can do is say it, with the ports, so the operator can
firewall them: the backend diffs this process's listening sockets around
``setup()``.

Source: Linux ``/proc/self/net/tcp{,6}`` (this network namespace's sockets),
kept to the sockets this process holds (``/proc/self/fd``). Elsewhere, or
when /proc cannot be read, nothing is found and the log says so.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys

logger = logging.getLogger(__name__)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
_WILDCARDS = ("0.0.0.0", "::")

# (address, port) of one listening socket.
Listener = tuple[str, int]


def listening_sockets() -> set[Listener]:
    """The TCP sockets this process listens on; empty when unknown."""
    try:
        ours = _socket_inodes()
    except OSError:
        return set()
    found: set[Listener] = set()
    for table in _TABLES:
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == _LISTEN and cols[9] in ours:
                found.add(_decode(cols[1]))
    return found


def is_wildcard(listener: Listener) -> bool:
    return listener[0] in _WILDCARDS


def report(opened: set[Listener], local_hostname: str, staging_bytes: int) -> None:
    """Log what Mooncake's setup() opened, and what that exposes."""
    shown = ", ".join(_show(lst) for lst in sorted(opened)) or "ports not found (no /proc)"
    if not opened or any(is_wildcard(lst) for lst in opened):
        logger.warning(
            "mooncake L3: Mooncake's transfer engine listens on every interface (%s); it "
            "cannot be bound to local_hostname=%s (Mooncake offers no option for it). "
            "Anyone who reaches these ports can read and write this process's %d-byte "
            "staging area without authentication (never the host pool): firewall them or "
            "keep the hosts on a private network, and set storage_secret (docs/security.md)",
            shown, local_hostname, staging_bytes)
    else:
        logger.info("mooncake L3: Mooncake's transfer engine listens on %s", shown)


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode(local: str) -> Listener:
    """``/proc/net/tcp``'s "HEXADDR:HEXPORT" (the address as 32-bit words
    printed in host byte order) as (address, port)."""
    hex_address, hex_port = local.split(":")
    step = -1 if sys.byteorder == "little" else 1
    words = [bytes.fromhex(hex_address[i:i + 8])[::step] for i in range(0, len(hex_address), 8)]
    packed = b"".join(words)
    address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), int(hex_port, 16)


def _show(listener: Listener) -> str:
    address, port = listener
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
