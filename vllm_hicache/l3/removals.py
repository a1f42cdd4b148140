"""Exact L3 removals: object keys a store removed, back to block hashes.

Where an L3 object is removed by our own code (the ``file`` backend's
``max_bytes`` LRU) or the store says it removed one (Redis keyspace
notifications for evicted and expired keys), the scheduler half announces
``BlockRemoved`` for medium ``STORAGE`` exactly: the block is no longer
reachable by prefix, since a block is in L3 only while every rank's object
of it is. This module turns the removed keys into the block hashes vLLM
knows (keys.py: ``hc4-<D>-<shard>-<block name>``):

- A key ``skip`` names (the planner passes l3/canary.py's start-up
  canary objects: no block) is ignored.
- A key outside this engine's namespaces (another model, layout, sharding
  or secret: the digest ``D`` differs) is not ours to announce: ignored.
- Without a storage secret the block name is the block hash in hex: read
  back exactly.
- With a secret it is a keyed hash, which cannot be inverted: only names
  this engine recently backed up or looked up are mapped (a bounded table,
  ``MAX_NAMES``); the rest are counted as ``unmapped``.

Pure module: no torch, no vllm.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from vllm_hicache.keys import KeyNamespace

# Keyed object names remembered (with a storage secret), at most.
MAX_NAMES = 1 << 16


def _digest_prefix(ns: KeyNamespace) -> str:
    """``hc4-<D>-``: every shard's keys of this namespace start with it."""
    return ns.tag.rsplit("-", 1)[0] + "-"


class RemovedKeys:
    """Maps removed object keys to block hashes (see module doc)."""

    def __init__(self, namespaces: Sequence[KeyNamespace], max_names: int = MAX_NAMES,
                 skip: Callable[[str], bool] = lambda key: False) -> None:
        self._skip = skip
        self._namespaces = list(namespaces)
        self._prefixes = tuple({_digest_prefix(ns) for ns in namespaces})
        self._keyed = any(ns.name_key for ns in namespaces)
        self._max_names = max_names
        # Keyed object name -> block hash, least recently noted first.
        self._names: OrderedDict[str, bytes] = OrderedDict()
        self.unmapped = 0

    def note(self, hashes: Iterable[bytes]) -> None:
        """These blocks' objects were written or looked up: with a secret,
        remember their names so a removal can be mapped back."""
        if not self._keyed:
            return
        hashes = list(hashes)
        names = self._names
        per_ns = [ns.object_keys(hashes) for ns in self._namespaces]
        for i, h in enumerate(hashes):  # block by block: the oldest blocks go first
            for keys in per_ns:
                names.pop(keys[i], None)
                names[keys[i]] = bytes(h)
        while len(names) > self._max_names:
            names.popitem(last=False)

    def block_hashes(self, keys: Iterable[str]) -> list[bytes]:
        """The blocks of ``keys`` that are this engine's, each once, in
        the order first seen."""
        out: dict[bytes, None] = {}
        for key in keys:
            if not self._ours(key):
                continue
            h = self._name_of(key)
            if h is None:
                self.unmapped += 1
                continue
            out[h] = None
        return list(out)

    def block_hash(self, key: str) -> bytes | None:
        """The block of ``key`` if it is one of this engine's blocks' objects
        and can be named (counts nothing)."""
        return self._name_of(key) if self._ours(key) else None

    def _ours(self, key: str) -> bool:
        return key.startswith(self._prefixes) and not self._skip(key)

    def _name_of(self, key: str) -> bytes | None:
        return self._names.get(key) if self._keyed else _hex_name(key)


def _hex_name(key: str) -> bytes | None:
    try:
        return bytes.fromhex(key.rsplit("-", 1)[1])
    except (ValueError, IndexError):
        return None
