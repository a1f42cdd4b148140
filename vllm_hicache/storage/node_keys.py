"""The node tier's page keys, and the tier changes a worker reports.

A node tier key holds at most 64 bytes (node/segment.py), an object key
(keys.py: ``<tag>-<block name>``, the name 64 hex digits) is longer. So
that a page a member evicts can be named back as a block (for ``NODE``
KV events, l3/node_events.py), the key keeps the name and shortens only
the tag:

    b"N" + blake2b(tag, 15 bytes) + the name's bytes      (48 bytes)

Any object key whose name is not hex, or too long, is keyed
``b"H" + blake2b(key, 32 bytes)`` instead: found and stored alike, but
never named back. The two forms cannot meet (the first byte), and a 15-byte
digest of the tag keeps tags of one tier apart (a tier holds one identity's
handful of shards).

Worker -> scheduler: the keys a worker sealed into the tier (its backups:
``node+``; pages it read from the remote store and promoted: ``node^``) and
the keys its reservations evicted (``node-``) travel with the L3 removals
(worker metadata ``l3_removed_keys``, strings) as ``<prefix><hex key>``;
``split_tier_changes`` takes them back out. No object key starts with
``node`` (they start with ``hc<version>-``). The channel is a set: a worker
sends only the last change of each key per report, which is enough to name
blocks for events; the page counts travel apart (common/node_counts.py).

Pure module: no torch, no vllm.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable

_NAMED = b"N"
_HASHED = b"H"
_TAG_DIGEST_BYTES = 15
# The longest name that keeps a named key within the tier's 64 bytes.
_MAX_NAME_BYTES = 64 - 1 - _TAG_DIGEST_BYTES

# What a member did to a key, as the channel's prefix.
SEALED, PROMOTED, EVICTED = "node+", "node^", "node-"
CHANGES = (SEALED, PROMOTED, EVICTED)


@functools.lru_cache(maxsize=256)  # a process's handful of tags, on every key
def tag_digest(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=_TAG_DIGEST_BYTES).digest()


def node_key(object_key: str) -> bytes:
    """The node tier's key of ``object_key`` (module doc)."""
    tag, sep, name = object_key.rpartition("-")
    if sep and tag and len(name) % 2 == 0 and 0 < len(name) // 2 <= _MAX_NAME_BYTES:
        try:
            return _NAMED + tag_digest(tag) + bytes.fromhex(name)
        except ValueError:
            pass  # not hex: hashed below
    return _HASHED + hashlib.blake2b(object_key.encode(), digest_size=32).digest()


class ObjectKeyNames:
    """Node tier keys back to object keys, for the tags it is given (the
    scheduler half's namespaces: every shard of its pages)."""

    def __init__(self, tags: Iterable[str]) -> None:
        self._tags = {tag_digest(t): t for t in tags}

    def object_key(self, key: bytes) -> str | None:
        """``key``'s object key; None for a hashed key or another tag's."""
        if len(key) <= 1 + _TAG_DIGEST_BYTES or key[:1] != _NAMED:
            return None
        tag = self._tags.get(key[1:1 + _TAG_DIGEST_BYTES])
        return None if tag is None else f"{tag}-{key[1 + _TAG_DIGEST_BYTES:].hex()}"


def tier_changes(changes: dict[bytes, str]) -> list[str]:
    """Node key -> change (``CHANGES``) as strings of the removal channel."""
    return [change + k.hex() for k, change in changes.items()]


def split_tier_changes(keys: Iterable[str]) -> tuple[list[str], dict[str, list[bytes]]]:
    """``keys`` of the removal channel: (the L3 removals, change -> node
    keys). A tier change whose key is not hex is dropped."""
    removed: list[str] = []
    changes: dict[str, list[bytes]] = {c: [] for c in CHANGES}
    for k in keys:
        change = k[:len(SEALED)]
        if change not in changes:
            removed.append(k)
            continue
        try:
            changes[change].append(bytes.fromhex(k[len(change):]))
        except ValueError:
            pass
    return removed, changes
