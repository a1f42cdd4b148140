"""Registered memory for the mooncake backend: zero copy where possible.

Mooncake moves an object between the storage daemon and *registered* local
memory (``register_buffer``); with RDMA, unregistered memory cannot be a
transfer source or target at all. So every buffer of a call is either

- inside a registered region (the host pool, via ``register_memory``): its
  address goes to Mooncake as it is (zero copy), or
- anywhere else (the 64-byte headers, buffers of an unregistered caller):
  it is copied through a *staging buffer*, a registered scratch array the
  backend owns. A call in flight leases one buffer of the pool; the pool
  grows to the number of concurrent calls (so threads never share one) and
  its buffers live, registered, until close().

A ``ChunkPlan`` lays out one chunk of a batch (as many objects as one
staging buffer can serve): per object, the pointer and size lists Mooncake
takes (the object is their concatenation), plus the caller buffers to copy
into staging before a put / out of it after a get.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from vllm_hicache.storage.base import Buffers
from vllm_hicache.storage.batching import chunks
from vllm_hicache.storage.buffers import address

# Staging views start on cache-line boundaries (cheap copies, no false sharing).
_ALIGN = 64


class RegisteredRegions:
    """Address ranges registered with the store; lookups are lock-free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Replaced, never mutated, so readers may iterate a snapshot.
        self._spans: tuple[tuple[int, int], ...] = ()

    def add(self, start: int, nbytes: int) -> None:
        with self._lock:
            self._spans = (*self._spans, (start, start + nbytes))

    def clear(self) -> None:
        with self._lock:
            self._spans = ()

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of each region; a snapshot."""
        return self._spans

    def covers(self, buf: np.ndarray) -> bool:
        return _inside(address(buf), buf.nbytes, self._spans)

    def __len__(self) -> int:
        return len(self._spans)


class ScratchLeases:
    """Registered scratch buffers of ``capacity`` bytes, one per call in flight."""

    def __init__(self, capacity: int, register: Callable[[np.ndarray], bool]) -> None:
        self.capacity = capacity
        self._register = register
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._all: list[np.ndarray] = []

    @contextmanager
    def lease(self) -> Iterator[np.ndarray]:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = self._new_buffer()
        try:
            yield buf
        finally:
            with self._lock:
                self._free.append(buf)

    def _new_buffer(self) -> np.ndarray:
        buf = np.empty(self.capacity, np.uint8)
        buf.fill(0)  # pre-fault now: first-touch faults are slow on small VMs
        if not self._register(buf):
            raise OSError(f"cannot register a {self.capacity}-byte staging buffer")
        with self._lock:
            self._all.append(buf)
        return buf

    def buffers(self) -> list[np.ndarray]:
        with self._lock:
            return list(self._all)

    def drop(self) -> None:
        with self._lock:
            self._free.clear()
            self._all.clear()


@dataclass
class ChunkPlan:
    """Objects ``lo:hi`` of a batch, laid out for one Mooncake call.

    Staged buffers get their pointers from ``bind`` (the staging buffer is
    leased only once some chunk needs one).
    """

    lo: int
    ptrs: list[list[int]] = field(default_factory=list)
    sizes: list[list[int]] = field(default_factory=list)
    # Expected object lengths (sum of sizes).
    totals: list[int] = field(default_factory=list)
    # (object index in chunk, slot in its ptrs, caller buffer, staging offset).
    staged: list[tuple[int, int, np.ndarray, int]] = field(default_factory=list)
    direct_bytes: int = 0
    staged_bytes: int = 0
    # Staging bytes used, with alignment padding.
    used: int = 0
    # A lone object whose staged bytes exceed the capacity: never sent.
    oversized: bool = False

    @property
    def hi(self) -> int:
        return self.lo + len(self.totals)

    def add(self, buffers: list[tuple[np.ndarray, int, bool]]) -> None:
        """One object: its (buffer, address, inside registered memory) list."""
        index, ptrs, sizes = len(self.totals), [], []
        for slot, (buf, start, direct) in enumerate(buffers):
            sizes.append(buf.nbytes)
            if direct:
                ptrs.append(start)
                self.direct_bytes += buf.nbytes
            else:
                ptrs.append(0)
                self.staged.append((index, slot, buf, self.used))
                self.used += _padded(buf.nbytes)
                self.staged_bytes += buf.nbytes
        self.ptrs.append(ptrs)
        self.sizes.append(sizes)
        self.totals.append(sum(sizes))

    def bind(self, staging: np.ndarray) -> None:
        assert self.used <= staging.nbytes, (self.used, staging.nbytes)
        base = address(staging)
        for index, slot, _, offset in self.staged:
            self.ptrs[index][slot] = base + offset

    def views(self, staging: np.ndarray | None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(object index in chunk, caller buffer, its staging view); ``staging``
        is None only for a chunk that stages nothing."""
        for index, _, buf, offset in self.staged:
            assert staging is not None, "a chunk that stages needs its staging buffer"
            yield index, buf, staging[offset:offset + buf.nbytes]


def plan_chunks(
    objects: Sequence[Buffers], regions: RegisteredRegions, capacity: int
) -> Iterator[ChunkPlan]:
    """Consecutive chunks of ``objects`` whose staged bytes fit ``capacity``;
    an object that never fits comes alone, ``oversized``."""
    spans = regions.spans
    # Empty buffers contribute nothing, and Mooncake rejects empty slices.
    laid = [[(buf, start, _inside(start, buf.nbytes, spans))
             for buf in objs if buf.nbytes for start in (address(buf),)] for objs in objects]
    needs = [sum(_padded(buf.nbytes) for buf, _, direct in bufs if not direct) for bufs in laid]
    for span in chunks(needs, max_bytes=capacity):
        if needs[span.start] > capacity:  # alone in its span
            yield ChunkPlan(lo=span.start, totals=[0], oversized=True)
            continue
        chunk = ChunkPlan(lo=span.start)
        for i in span:
            chunk.add(laid[i])
        yield chunk


def _inside(start: int, nbytes: int, spans: tuple[tuple[int, int], ...]) -> bool:
    for lo, hi in spans:
        if lo <= start and start + nbytes <= hi:
            return True
    return False


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
