"""Loopback ports for the servers tests start, picked outside the kernel's ephemeral range.

A port found by binding port 0 comes from the ephemeral range
(``net.ipv4.ip_local_port_range``), the range every outgoing connection and
every ``bind(0)`` of the servers themselves draws from. Between the pick and
the server's own bind (a vLLM server binds its ports tens of seconds after
start) one of those can take it: a decode server's NIXL side channel once
lost its port to one of the servers' ephemeral ZMQ binds and never answered.
A port below the ephemeral range is taken only by an explicit bind, so a pick
there stays free until the server it was picked for binds it.

Picks are random within the range (so processes picking at once rarely
collide) and never repeat within a process (so two servers of one module
never get the same port even if the first has not bound it yet).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Explicit binds of system services sit mostly below 10000; the picks stay
# above them.
LOWEST_PORT = 10000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_rng = random.Random()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where unreadable)."""
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _candidates() -> range:
    """Ports neither ephemeral nor privileged: below the range if it leaves
    room there, else above it."""
    low, high = ephemeral_range()
    if low - LOWEST_PORT >= 1000:
        return range(LOWEST_PORT, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    raise RuntimeError(f"the ephemeral port range {low}-{high} leaves no room for test ports")


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports, free now, outside the ephemeral range,
    never handed out before by this process."""
    candidates = _candidates()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(200 * n):  # bounded: most candidates are free
            if len(ports) == n:
                break
            port = _rng.choice(candidates)
            if port in _handed_out or port in ports:
                continue
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)  # held until all n are picked
            ports.append(port)
    finally:
        for sock in socks:
            sock.close()
    if len(ports) < n:
        raise RuntimeError(f"found only {len(ports)} of {n} free ports in {candidates}")
    _handed_out.update(ports)
    return ports


def free_port() -> int:
    """One port, as ``free_ports(1)``."""
    return free_ports(1)[0]
