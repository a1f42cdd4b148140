"""Backend-owned DRAM that every NIXL transfer of the ``nixl`` backend goes through.

Why: NIXL cannot cancel a transfer, so one that misses its deadline is parked
and keeps running after ``get``/``put`` returned (engine.py). Had it
targeted the caller's buffers, a late READ would write into a host page the
caller already freed and reused (silently wrong KV data), and a late
PutObject would upload a page the caller already overwrote. So a transfer
only ever touches a *slot* of this pool:

- get: NIXL reads into the slot; the slot is copied into the caller's buffers
  only when the transfer completed within the call (``scatter``).
- put: the caller's buffers are copied into the slot before the transfer is
  posted (``gather``); the transfer reads only the slot.

A slot returns to the pool only in the job's ``finish``, i.e. once NIXL says
the transfer ended, so a parked transfer keeps its slot and nobody else's.
NIXL's ERR does not always mean that: a request of several I/Os (a POSIX
batch) reports ERR at its first failed I/O while others may still run, so the
engine *retires* the slots of such a request: they never return to the pool
(failures are rare; retired slots count against the cap below).

Memory: slots of ``object_bytes`` (rounded up to 4 KiB) in arenas registered
with the agent once (a 64 MiB arena first, then each new arena as large as all
before it, so there are few regions); lazily, so a scheduler-side backend
allocates nothing. At most ``max(1 GiB, 512 objects)``: when no slot is free
then (e.g. a hung store with hundreds of parked transfers), the key is a miss
without any I/O. A larger object than a slot gets its own buffer, registered
per call. Arenas live until close, and forever if transfers are still parked
then (a late write must never land in freed memory).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from vllm_hicache.storage.buffers import address

_ALIGN = 4096
_FIRST_ARENA_BYTES = 64 << 20
_MIN_CAP_BYTES = 1 << 30
_CAP_OBJECTS = 512
# Arenas of pools closed while transfers still ran: never freed.
_LEAKED: list[np.ndarray] = []


class StagingSlots:
    """Fixed-size slots, one object each, in NIXL-registered arenas that grow
    up to a cap; a slot a failed transfer may still touch is retired, never
    reused."""

    def __init__(self, engine: Any, object_bytes: int) -> None:
        self.engine = engine
        self.slot_bytes = -(-max(object_bytes, 1) // _ALIGN) * _ALIGN
        self.max_bytes = max(_MIN_CAP_BYTES, _CAP_OBJECTS * self.slot_bytes)
        self._arenas: list[np.ndarray] = []
        self._free: list[np.ndarray] = []
        self._retired: dict[int, np.ndarray] = {}  # address -> slot not to reuse
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arenas)

    def take(self, nbytes: int) -> np.ndarray | None:
        """A buffer of at least ``nbytes`` only this caller uses until ``give``; None
        when the pool is exhausted."""
        if nbytes > self.slot_bytes:
            return np.empty(nbytes, np.uint8)  # registered per call (engine.py)
        with self._lock:
            if not self._free and not self._grow():
                return None
            return self._free.pop()

    def give(self, slot: np.ndarray) -> None:
        if slot.nbytes != self.slot_bytes:
            return  # an oversized buffer of its own: freed with its last reference
        with self._lock:
            if self._retired.pop(address(slot), None) is None:
                self._free.append(slot)

    def retire(self, slot: Any) -> None:
        """``slot`` may be written after its job ends: ``give`` then keeps it out of
        the pool for good (an oversized buffer is kept alive forever instead)."""
        if slot is None:
            return
        with self._lock:
            if slot.nbytes == self.slot_bytes:
                self._retired[address(slot)] = slot
            else:
                _LEAKED.append(slot)

    def _grow(self) -> bool:
        have = self.nbytes
        size = min(max(have, _FIRST_ARENA_BYTES), self.max_bytes - have)
        slots = size // self.slot_bytes
        if slots < 1:
            return False
        arena = np.empty(slots * self.slot_bytes, np.uint8)
        self.engine.register_region(arena)
        self._arenas.append(arena)
        self._free.extend(arena.reshape(slots, self.slot_bytes)[::-1])
        return True

    def close(self, leak: bool) -> None:
        """Drop the arenas (the engine deregisters them); keep them forever if
        ``leak`` (transfers still parked may write into them)."""
        with self._lock:
            if leak:
                _LEAKED.extend(self._arenas)
            self._arenas, self._free = [], []

