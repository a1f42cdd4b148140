"""The staging area: the only memory the mooncake backend registers.

Why: Mooncake's transfer engine lets any peer that reaches its port (TCP, or
an RDMA device) read and write *registered* memory, without authentication
(docs/security.md). Registering the host pool would hand every such peer the
whole L2 cache: they could read any page and alter pages after they were
verified. So the pool is never registered; the engine sees one staging area
of ``staging_pages`` slots, each holding one object, and every object is
copied between the caller's buffers and a slot: into it before a put, out of
it after a get (before the page store verifies what was read, so a peer
that overwrites a slot mid-transfer costs a failed check, never accepted KV).

Slot layout: an object's buffers back to back (the object is their
concatenation), from the slot's start; slots start on cache-line
boundaries. An object is one contiguous run, so it moves with the
single-buffer batch calls. An object longer than a slot (or empty) is never
sent: a miss / a skipped write.

Leases: a call leases as many free slots as it has objects to send (at
least one), waiting at most ``LEASE_WAIT_S`` for one to free up; a batch
larger than its lease is cut into several Mooncake calls. Slots are held
only for one Mooncake call, so the wait is bounded by that call's own
timeout; the area's size is fixed for the backend's lifetime.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from vllm_hicache.storage.base import Buffers
from vllm_hicache.storage.buffers import address

# Slots start on cache-line boundaries (cheap copies, no false sharing).
ALIGN_BYTES = 64
# A Mooncake call returns within ~4.5 s (master.py); waiting much longer for
# a slot means something is stuck: the batch's remaining objects miss.
LEASE_WAIT_S = 30.0


def slot_bytes_for(object_bytes: int) -> int:
    """Bytes of one slot for objects of ``object_bytes`` (cache-line padded)."""
    return -(-object_bytes // ALIGN_BYTES) * ALIGN_BYTES


class StagingArea:
    """``slots`` slots of ``slot_bytes`` in one buffer, registered once."""

    def __init__(self, slots: int, slot_bytes: int,
                 register: Callable[[np.ndarray], bool]) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"staging area of {slots} slots x {slot_bytes} B")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.buffer = np.empty(slots * slot_bytes, np.uint8)
        self.buffer.fill(0)  # pre-fault now: first-touch faults are slow on small VMs
        if not register(self.buffer):
            raise OSError(f"mooncake backend: cannot register the {self.buffer.nbytes}-byte "
                          "staging area with Mooncake")
        self._free = list(range(slots))
        self._changed = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @contextmanager
    def lease(self, wanted: int, timeout_s: float = LEASE_WAIT_S) -> Iterator[list[np.ndarray]]:
        """Up to ``wanted`` free slots (at least one), as views; TimeoutError
        when none frees up within ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._free, timeout=timeout_s):
                raise TimeoutError(f"no staging slot free within {timeout_s:g} s")
            taken = self._free[-max(1, wanted):]
            del self._free[-len(taken):]
        try:
            yield [self.buffer[i * self.slot_bytes:(i + 1) * self.slot_bytes] for i in taken]
        finally:
            with self._changed:
                self._free.extend(taken)
                self._changed.notify_all()


@dataclass
class Chunk:
    """Objects of a batch laid out in leased slots, for one Mooncake call."""

    # Batch index of each object sent, in call order.
    sent: list[int] = field(default_factory=list)
    # Per object sent: its slot's address and the object's length.
    ptrs: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    # (position in ``sent``, caller buffer, its view in the slot).
    copies: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    # One past the last batch index this chunk covers (sent or skipped).
    hi: int = 0

    @property
    def staged_bytes(self) -> int:
        return sum(self.sizes)

    def views(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        return iter(self.copies)


def object_lengths(objects: Sequence[Buffers]) -> list[int]:
    return [sum(buf.nbytes for buf in bufs) for bufs in objects]


def plan_chunk(objects: Sequence[Buffers], lengths: Sequence[int], lo: int,
               slots: Sequence[np.ndarray]) -> Chunk:
    """Objects from ``lo`` on, one per slot, until the slots run out; those
    that fit no slot (or are empty) are passed over, unsent."""
    chunk, free = Chunk(hi=lo), list(slots)
    while chunk.hi < len(objects) and free:
        i = chunk.hi
        chunk.hi += 1
        if not 0 < lengths[i] <= free[0].nbytes:
            continue
        slot = free.pop(0)
        position, offset = len(chunk.sent), 0
        for buf in objects[i]:
            if buf.nbytes:  # Mooncake refuses empty slices; they add nothing
                chunk.copies.append((position, buf, slot[offset:offset + buf.nbytes]))
                offset += buf.nbytes
        chunk.sent.append(i)
        chunk.ptrs.append(address(slot))
        chunk.sizes.append(lengths[i])
    return chunk


def fits(lengths: Sequence[int], slot_bytes: int) -> list[bool]:
    return [0 < n <= slot_bytes for n in lengths]
