"""Child lookup of the L2 index: (parent node, first block hash) -> child node.

One open-addressing table for the whole tree, in an ``array('i')`` of node
ids: 4 bytes a slot, at most half full, where a dict per parent (or one
dict to int ids) costs 40-70 bytes and an int object a node. Keying by the
parent as well as the hash keeps the tree's meaning exact even for hashes
that are not chained. Linear probing; deletion shifts later entries back, so
there are no tombstones and a lookup stops at the first empty slot.

Invariant: a node is in the table exactly while it is reachable from the
root (linked under its parent, not orphaned); its parent and first hash do
not change while it is in (``HiRadixTree`` removes and re-adds it). Pure module.
"""

from __future__ import annotations

from array import array

from vllm_hicache.index.node import NO_NODE, NodeStore

# Spreads parent ids over the table (a 32-bit golden-ratio multiplier).
_PARENT_MIX = 0x9E3779B1
_MIN_SLOTS = 16


class ChildIndex:
    """Owned by ``HiRadixTree``; reads parents and keys from the store."""

    def __init__(self, store: NodeStore) -> None:
        self._store = store
        self._slots = array("i", [NO_NODE]) * _MIN_SLOTS
        self._mask = _MIN_SLOTS - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def find(self, parent: int, first_hash: bytes) -> int:
        """The child of ``parent`` whose run starts with ``first_hash``, or NO_NODE."""
        slots, mask = self._slots, self._mask
        parents, keys = self._store.parent, self._store.key
        i = (hash(first_hash) ^ parent * _PARENT_MIX) & mask
        while True:
            node = slots[i]
            if node == NO_NODE:
                return NO_NODE
            if parents[node] == parent:
                key = keys[node]
                if (key[0] if type(key) is list else key) == first_hash:
                    return node
            i = (i + 1) & mask

    def add(self, node: int) -> None:
        # At most half full: removal shifts back the rest of a cluster, and
        # clusters stay short.
        if (self._count + 1) * 2 > len(self._slots):
            self._resize(len(self._slots) * 2)
        slots, mask = self._slots, self._mask
        i = self._home(node)
        while slots[i] != NO_NODE:
            i = (i + 1) & mask
        slots[i] = node
        self._count += 1

    def remove(self, node: int) -> None:
        slots, mask = self._slots, self._mask
        parents, keys = self._store.parent, self._store.key
        i = self._home(node)
        while slots[i] != node:
            assert slots[i] != NO_NODE, f"node {node} is not in the child index"
            i = (i + 1) & mask
        # Shift back every later entry of the cluster that may sit at i.
        j = i
        while True:
            j = (j + 1) & mask
            moved = slots[j]
            if moved == NO_NODE:
                break
            key = keys[moved]  # _home, inlined: this loop is the hot part of removal
            first_hash = key[0] if type(key) is list else key
            home = (hash(first_hash) ^ parents[moved] * _PARENT_MIX) & mask
            # ``moved`` may fill the hole at i unless its home lies in (i, j].
            if (i < j and not i < home <= j) or (j < i and j < home <= i):
                slots[i] = moved
                i = j
        slots[i] = NO_NODE
        self._count -= 1

    def _home(self, node: int) -> int:
        key = self._store.key[node]
        first_hash = key[0] if type(key) is list else key
        return (hash(first_hash) ^ self._store.parent[node] * _PARENT_MIX) & self._mask

    def _resize(self, num_slots: int) -> None:
        old = self._slots
        self._slots = array("i", [NO_NODE]) * num_slots
        self._mask = num_slots - 1
        slots, mask = self._slots, self._mask
        for node in old:
            if node != NO_NODE:
                i = self._home(node)
                while slots[i] != NO_NODE:
                    i = (i + 1) & mask
                slots[i] = node
