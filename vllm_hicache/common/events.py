"""KV cache events for HiCache's tiers, for KV-aware routers: the record.

With vLLM's KV events on (``--kv-events-config '{"enable_kv_cache_events":
true, ...}'``), vLLM publishes its own L1 blocks (medium ``GPU``) and, every
step, what the connector's ``take_events`` returns. The scheduler half
records here:

- L2 (medium ``CPU``): ``BlockStored`` when blocks are indexed in L2 (a
  store or write-back planned this step, or pages an L3 prefetch committed),
  ``BlockRemoved`` when they leave the index (eviction, a failed copy,
  ``reset_cache``).
- L3 (medium ``STORAGE``, ``ownership`` = the backend's name, e.g. ``file``):
  ``BlockStored`` once every rank acknowledged a backup, for the blocks no
  rank failed to write (including objects L3 already had); ``BlockRemoved``
  when a prefetch found objects it had just looked up missing or invalid
  (for the rest of that prefetch: unreachable by prefix from here), and
  exactly where the removal is known (l3/removals.py): the ``file``
  backend's ``max_bytes`` LRU evicted an object, or Redis notified an
  evicted or expired key. Where a store evicts without telling (Mooncake
  leases, NIXL targets, Redis without keyspace notifications) ``STORAGE``
  entries stay hints.
- The node tier (medium ``NODE``, ``ownership`` = ``node_tier_name``):
  ``BlockStored`` for blocks this instance sealed into the machine's shared
  tier, ``BlockRemoved`` for blocks its stores evicted there; each change
  once per machine, by the instance that made it (l3/node_events.py). One
  event per block, without a parent hash.

One event per contiguous run of blocks (parent hash, hashes, and the run's
token ids where the request is at hand: stores; prefetch commits and
backups carry none). Hashes are vLLM's block hashes converted as vLLM does
(``maybe_convert_block_hash``), so they match the ``GPU`` events. The same
block may be announced more than once (stored, evicted, stored again); as
for vLLM's offloading connector, consumers deduplicate.

Bounded: at most ``MAX_EVENTS`` wait for ``take_events`` (vLLM takes them
every step); beyond that the oldest are dropped and counted. With events
off every call returns at once.

This module is the pure part: what is announced and when, bounded. The
event objects themselves are made by ``_stored_event``/``_removed_event``
(plain ``StoredBlocks``/``RemovedBlocks`` here); ``connector/kv_events.py``
makes vLLM's ``BlockStored``/``BlockRemoved`` with hashes converted as
vLLM converts them.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MEDIUM_L2 = "CPU"
MEDIUM_L3 = "STORAGE"
# The node tier (host memory shared by a machine's instances; l3/node_events.py).
MEDIUM_NODE = "NODE"
# Events waiting for take_events, at most.
MAX_EVENTS = 16384


def contiguous_runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive block indices, in order."""
    if not blocks:
        return []
    if blocks[-1] - blocks[0] + 1 == len(blocks):
        return [(blocks[0], blocks[-1] + 1)]  # the usual case: one run
    runs = []
    lo = prev = blocks[0]
    for b in blocks[1:]:
        if b != prev + 1:
            runs.append((lo, prev + 1))
            lo = b
        prev = b
    runs.append((lo, prev + 1))
    return runs


@dataclass(frozen=True)
class StoredBlocks:
    """A run of blocks entered ``medium`` (the fields of vLLM's BlockStored)."""

    block_hashes: list
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    group_idx: int
    ownership: str | None


@dataclass(frozen=True)
class RemovedBlocks:
    """Blocks left ``medium`` (the fields of vLLM's BlockRemoved)."""

    block_hashes: list
    medium: str
    group_idx: int
    ownership: str | None


class EventLog:
    """The bounded record; ``request`` arguments are vLLM requests (duck
    typed: ``lora_request``, ``all_token_ids``)."""

    def __init__(self, enabled: bool, block_size: int, max_events: int = MAX_EVENTS) -> None:
        self.enabled = enabled
        self.block_size = block_size
        self._events: collections.deque = collections.deque(maxlen=max_events)
        self.dropped = 0

    # The event makers: pure here, vLLM's in connector/kv_events.py.
    def _convert(self, block_hash: bytes) -> Any:
        return block_hash

    def _stored_event(self, **fields: Any) -> Any:
        return StoredBlocks(**fields)

    def _removed_event(self, **fields: Any) -> Any:
        return RemovedBlocks(**fields)

    def _append(self, event) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1  # the deque drops the oldest
        self._events.append(event)

    def stored(self, medium: str, chain: Sequence[bytes], blocks: Sequence[int],
               request: Any = None, ownership: str | None = None) -> None:
        """Blocks ``blocks`` (indices into ``chain``, ascending) entered ``medium``."""
        if not self.enabled or not blocks:
            return
        convert, bs = self._convert, self.block_size
        lora = request.lora_request if request is not None else None
        for lo, hi in contiguous_runs(blocks):
            self._append(self._stored_event(
                block_hashes=[convert(h) for h in chain[lo:hi]],
                parent_block_hash=convert(chain[lo - 1]) if lo else None,
                token_ids=request.all_token_ids[lo * bs:hi * bs] if request is not None else [],
                block_size=bs,
                lora_id=lora.adapter_id if lora is not None else None,
                medium=medium,
                lora_name=lora.name if lora is not None else None,
                group_idx=0,
                ownership=ownership,
            ))

    def removed(self, medium: str, hashes: Sequence[bytes], ownership: str | None = None) -> None:
        if not self.enabled or not hashes:
            return
        convert = self._convert
        self._append(self._removed_event(block_hashes=[convert(h) for h in hashes],
                                         medium=medium, group_idx=0, ownership=ownership))

    def take(self) -> list[Any]:
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
