"""``NODE`` KV events, from the tier changes an instance's workers report
(storage/node_keys.py); the admin API's view of the instance's node tier.

The node tier is shared by the instances of a machine, so a router must be
able to tell "on this host" (medium ``NODE``, ``ownership`` = the tier's
name) from "in this instance's L2" (``CPU``). Each change is announced
once per machine, by the instance whose process made it:

- ``BlockStored`` (NODE) by the instance that sealed the block's pages (a
  backup, or a page it read from the remote store and promoted); an
  instance storing a page the tier had already announces nothing;
- ``BlockRemoved`` (NODE) by the instance whose reservation evicted a page
  of the block (any instance's block: the key names it, node_keys.py).

A router subscribed to every instance of the host (as it is for their GPU
events) so sees each change once; one subscribed to a single instance sees
only that instance's changes. A block is in the tier only while every
shard's page (one per rank's namespace) is: BlockStored waits for all of
them from this instance's workers (a bounded table, ``MAX_PENDING``),
BlockRemoved follows the first shard's eviction. With a storage secret a
page's name is a keyed hash: only blocks this engine backed up or looked
up recently can be named (l3/removals.py), the rest are counted as
unnamed. Not announced: the admin API's clear, and a page dropped because
its seal failed (a later lookup misses it: a hint, as for STORAGE).

The page counts are not taken from the changes (a report carries each
page's last change only): they travel as counts (common/node_counts.py).

Pure module: no torch, no vllm.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vllm_hicache.common.events import MEDIUM_NODE, EventLog
from vllm_hicache.common.node_counts import NodeTierCounts
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.removals import RemovedKeys
from vllm_hicache.storage.node_keys import EVICTED, PROMOTED, SEALED, ObjectKeyNames

# Blocks with some but not all shards sealed, at most (oldest dropped).
MAX_PENDING = 1 << 16


class NodeTierEvents:
    """Announces one engine's node tier changes (module doc); counts the
    blocks announced, for the admin API."""

    def __init__(self, tier_name: str, namespaces: Sequence[KeyNamespace],
                 removals: RemovedKeys, max_pending: int = MAX_PENDING) -> None:
        self.tier_name = tier_name
        self._names = ObjectKeyNames(ns.tag for ns in namespaces)
        self._shards = len({ns.tag for ns in namespaces})
        self._removals = removals
        self._max_pending = max_pending
        # block hash -> shards (tags) of it sealed so far
        self._pending: OrderedDict[bytes, set[str]] = OrderedDict()
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.unnamed_pages = 0

    def apply(self, changes: dict[str, list[bytes]], events: EventLog | None) -> None:
        """``changes``: change -> node keys (node_keys.split_tier_changes)."""
        stored = self._complete(changes.get(SEALED, []) + changes.get(PROMOTED, []))
        removed: dict[bytes, None] = {}
        for key in changes.get(EVICTED, []):
            named = self._name(key)
            if named is not None:
                self._pending.pop(named[0], None)
                removed[named[0]] = None
        self.stored_blocks += len(stored)
        self.removed_blocks += len(removed)
        if events is None:
            return
        for h in stored:
            events.stored(MEDIUM_NODE, [h], [0], ownership=self.tier_name)
        if removed:
            events.removed(MEDIUM_NODE, list(removed), ownership=self.tier_name)

    def _complete(self, keys: list[bytes]) -> list[bytes]:
        """Blocks of which ``keys`` sealed the last missing shard."""
        done: list[bytes] = []
        pending = self._pending
        for key in keys:
            named = self._name(key)
            if named is None:
                continue
            h, tag = named
            shards = pending.pop(h, set())
            shards.add(tag)
            if len(shards) >= self._shards:
                done.append(h)
                continue
            pending[h] = shards
            while len(pending) > self._max_pending:
                pending.popitem(last=False)
        return done

    def _name(self, key: bytes) -> tuple[bytes, str] | None:
        """(block hash, shard tag) of a node key; None: not nameable here."""
        object_key = self._names.object_key(key)
        h = self._removals.block_hash(object_key) if object_key is not None else None
        if h is None or object_key is None:
            self.unnamed_pages += 1
            return None
        return h, object_key.rsplit("-", 1)[0]

    def status(self, hit_tokens: int, pages: NodeTierCounts) -> dict[str, int]:
        """The admin API's view of this instance: its node tier hit tokens
        and the pages its processes stored (backups), promoted and evicted
        (both given: the scheduler half counts them, the pages exactly as
        the Prometheus counters do), and the blocks announced."""
        return {"hit_tokens": hit_tokens, **pages.as_dict(),
                "announced_stored_blocks": self.stored_blocks,
                "announced_removed_blocks": self.removed_blocks,
                "unnamed_pages": self.unnamed_pages}
