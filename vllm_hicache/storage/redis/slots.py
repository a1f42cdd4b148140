"""Redis Cluster hash slots and the slot -> master map; pure (no I/O, no redis-py).

A key's slot is CRC16 (the XMODEM variant: polynomial 0x1021, initial value
0, which is what ``binascii.crc_hqx(key, 0)`` computes) of the key modulo
16384. If the key holds a hash tag, a ``{`` followed later by a ``}`` with at
least one byte between, only the bytes between the first ``{`` and the first
``}`` after it are hashed, so keys sharing a tag share a slot.

Our objects are one key each (one SET writes the whole object, header and
payload), so nothing needs co-locating and the backend uses no hash tags:
a prefix's pages spread over every master.

``SlotMap`` is one topology snapshot: for every slot the (host, port) of its
master, or None where no master serves it. Built from a ``CLUSTER SLOTS``
reply, whose entries are ``[first_slot, last_slot, master, replica...]`` and
each node ``[host, port, node_id, ...]``; an empty host means "the node that
answered", a host of "?" an unknown endpoint (the slot counts as unserved).
"""

from __future__ import annotations

import binascii
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SLOTS = 16384
Address = tuple[str, int]


def key_slot(key: bytes) -> int:
    """The hash slot of ``key`` (hash tags honoured; see the module docstring)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) % SLOTS


class SlotMap:
    """Which master serves each slot, and every node the snapshot named."""

    def __init__(self, owners: list[Address | None], nodes: Iterable[Address]) -> None:
        if len(owners) != SLOTS:
            raise ValueError(f"a slot map has {SLOTS} entries, got {len(owners)}")
        self._owners = owners
        # Masters and replicas: where to ask for the next CLUSTER SLOTS.
        self.nodes: tuple[Address, ...] = tuple(dict.fromkeys(nodes))

    @classmethod
    def empty(cls) -> SlotMap:
        return cls([None] * SLOTS, ())

    @classmethod
    def from_cluster_slots(cls, reply: Any, answered_by: Address) -> SlotMap:
        """Parse a ``CLUSTER SLOTS`` reply (as a RESP2 reader returns it: lists,
        bytes, ints); ValueError naming what is malformed."""
        if not isinstance(reply, list):
            raise ValueError(f"CLUSTER SLOTS: expected a list, got {type(reply).__name__}")
        owners: list[Address | None] = [None] * SLOTS
        nodes: list[Address] = []
        for entry in reply:
            if not isinstance(entry, list) or len(entry) < 3:
                raise ValueError(f"CLUSTER SLOTS: malformed slot range {entry!r:.200}")
            first, last = entry[0], entry[1]
            if not (isinstance(first, int) and isinstance(last, int)
                    and 0 <= first <= last < SLOTS):
                raise ValueError(f"CLUSTER SLOTS: bad slot range {first!r}-{last!r}")
            served = [_address(node, answered_by) for node in entry[2:]]
            nodes.extend(a for a in served if a is not None)
            owners[first:last + 1] = [served[0]] * (last - first + 1)
        return cls(owners, nodes)

    def owner(self, slot: int) -> Address | None:
        return self._owners[slot]

    def moved(self, moves: Mapping[int, Address]) -> SlotMap:
        """A copy with each slot of ``moves`` served by its new master (MOVED
        redirections): snapshots are never changed in place, so a reader never
        sees a torn one."""
        owners = list(self._owners)
        for slot, address in moves.items():
            owners[slot] = address
        return SlotMap(owners, (*self.nodes, *moves.values()))

    def masters(self) -> list[Address]:
        """The distinct masters serving at least one slot, sorted."""
        return sorted({a for a in self._owners if a is not None})

    def unserved(self) -> int:
        """How many slots have no reachable master in this snapshot."""
        return sum(1 for a in self._owners if a is None)

    def group(self, slots: Sequence[int]) -> dict[Address | None, list[int]]:
        """Indices into ``slots``, grouped by the master serving each (None:
        unserved), in their original order within each group."""
        out: dict[Address | None, list[int]] = {}
        for i, slot in enumerate(slots):
            out.setdefault(self._owners[slot], []).append(i)
        return out


def _address(node: Any, answered_by: Address) -> Address | None:
    if not isinstance(node, list) or len(node) < 2 or not isinstance(node[1], int):
        raise ValueError(f"CLUSTER SLOTS: malformed node {node!r:.200}")
    host = node[0].decode() if isinstance(node[0], bytes) else node[0]
    if not isinstance(host, str):
        raise ValueError(f"CLUSTER SLOTS: malformed host {node[0]!r:.100}")
    if host == "?":
        return None
    return (host or answered_by[0], node[1])
