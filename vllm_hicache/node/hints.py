"""Where this process last found pages (key -> slot, generation), so that a
reader that needs no pins can skip the index for pages it found before.

A hint is never trusted by itself: ``prefix`` returns a hinted page only
while the slot's seal still names its key at its generation, and a page
that passes that check and the reader's check after its copy was read as
sealed (node/segment.py: a writer unseals a slot before changing a byte).
A stale hint (the page refilled, or sealed again at a newer generation)
fails the seal check, leaves the cache, and its key goes to the index.

An evicted page whose slot nobody refilled yet still passes: its bytes are
still its key's, as they were for a reader that pinned it before the
eviction. A page *dropped* (it failed a member's checks, or the admin API
cleared the tier) must not be read again, so every hint is forgotten when
the segment's drop count changes: ``prefix`` is given the count read
before it, and hints learned at another count are gone.
Nothing here is shared between processes; a lost hint costs one index read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from vllm_hicache.node.index import Found

# (slots, generations, keys) -> how many leading slots carry those seals.
SealCheck = Callable[[Sequence[int], Sequence[int], Sequence[bytes]], int]


class SlotHints:
    """At most ``capacity`` hints, the oldest learned dropped first. Used
    from any thread of the process (one lock; every call is short)."""

    def __init__(self, capacity: int, seals_match: SealCheck) -> None:
        self.capacity = capacity
        self._seals_match = seals_match
        self._where: dict[bytes, Found] = {}
        self._drops = -1  # the segment's drop count the hints were learned at
        self._lock = threading.Lock()

    def prefix(self, keys: Sequence[bytes], drops: int) -> list[Found]:
        """The hinted pages of the longest prefix of ``keys`` whose seals
        still hold, given the segment's drop count ``drops`` (read before
        this call); the first stale hint is forgotten, and every hint when
        ``drops`` changed since they were learned."""
        with self._lock:
            if drops != self._drops:
                self._where.clear()
                self._drops = drops
            known: list[Found] = []
            for key in keys:
                found = self._where.get(key)
                if found is None:
                    break
                known.append(found)
            held = self._seals_match([f.slot for f in known], [f.gen for f in known],
                                     [f.key for f in known])
            if held < len(known):
                del self._where[known[held].key]
            return known[:held]

    def learn(self, pages: Sequence[Found], drops: int) -> None:
        """Remember ``pages``, found in the index after the segment's drop
        count read ``drops`` (not learned if it has changed since)."""
        with self._lock:
            if drops != self._drops:
                return
            for page in pages:
                self._where.pop(page.key, None)  # re-learned: the newest again
                self._where[page.key] = page
            while len(self._where) > self.capacity:
                del self._where[next(iter(self._where))]

    def clear(self) -> None:
        with self._lock:
            self._where.clear()

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._where.pop(key, None)

    def __len__(self) -> int:
        return len(self._where)
