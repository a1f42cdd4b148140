"""An in-process L3 for scheduler-harness tests: one dict per ``store`` name,
shared by the scheduler's and the worker's instances (same process).
Option ``read_bytes_per_s`` (0: unlimited) makes reads sleep per byte read,
like a slow or congested store. ``RangedMemBackend`` also reads byte ranges
(layer by layer, storage/pages.py ``read_by_layer``); ``RANGE_GATES`` holds
back its range reads from an offset on."""

from __future__ import annotations

import threading
import time

import numpy as np

from vllm_hicache.storage import StorageBackend
from vllm_hicache.storage.base import RangedObjects

STORES: dict[str, dict[str, bytes]] = {}
GATES: dict[str, threading.Event] = {}
# store name -> (offset, gate): RangedMemBackend's reads of ranges starting
# at or past offset wait for the gate (at most 10 s).
RANGE_GATES: dict[str, tuple[int, threading.Event]] = {}
_LOCK = threading.Lock()


class MemBackend(StorageBackend):
    name = "mem"

    def __init__(self, options, ctx) -> None:
        unknown = set(options) - {"store", "read_bytes_per_s"}
        if unknown:
            raise ValueError(f"unknown MemBackend options {sorted(unknown)}")
        self.store_name = options["store"]
        self.read_bytes_per_s = float(options.get("read_bytes_per_s", 0))
        with _LOCK:
            self.data = STORES.setdefault(self.store_name, {})

    def _gate(self) -> None:
        gate = GATES.get(self.store_name)
        if gate is not None:
            gate.wait(timeout=10)

    def exists_prefix(self, keys):
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return n

    def get(self, keys, targets):
        self._gate()
        out = []
        for key, bufs in zip(keys, targets):
            blob = self.data.get(key)
            if blob is None or len(blob) != sum(b.nbytes for b in bufs):
                out.append(False)
                continue
            offset = 0
            for b in bufs:
                b[:] = np.frombuffer(blob, np.uint8, b.nbytes, offset)
                offset += b.nbytes
            out.append(True)
        if self.read_bytes_per_s > 0:
            time.sleep(sum(b.nbytes for bufs in targets for b in bufs) / self.read_bytes_per_s)
        return out

    def put(self, keys, sources):
        for key, bufs in zip(keys, sources):
            self.data[key] = b"".join(b.tobytes() for b in bufs)
        return [True] * len(keys)

    def clear(self):
        self.data.clear()

    def close(self):
        pass


class FlakyMemBackend(MemBackend):
    """MemBackend whose calls are slow and fail at random (seeded): gets
    and puts report failures, lookups raise, the way a congested or
    half-broken store behaves. Options: ``fail_rate``, ``delay_s``, ``seed``."""

    name = "flaky-mem"

    def __init__(self, options, ctx) -> None:
        import random

        options = dict(options)
        self.fail_rate = float(options.pop("fail_rate", 0.2))
        self.delay_s = float(options.pop("delay_s", 0.0))
        self._rng = random.Random(int(options.pop("seed", 0)))
        self._rng_lock = threading.Lock()
        super().__init__(options, ctx)

    def _bad_luck(self) -> bool:
        import time

        if self.delay_s:
            time.sleep(self.delay_s)
        with self._rng_lock:
            return self._rng.random() < self.fail_rate

    def exists_prefix(self, keys):
        if self._bad_luck():
            raise ConnectionError("flaky-mem: lookup failed")
        return super().exists_prefix(keys)

    def get(self, keys, targets):
        ok = super().get(keys, targets)
        return [good and not self._bad_luck() for good in ok]

    def put(self, keys, sources):
        keep = [not self._bad_luck() for _ in keys]
        super().put([k for k, g in zip(keys, keep) if g], [s for s, g in zip(sources, keep) if g])
        return keep


class RangedMemBackend(MemBackend):
    """MemBackend that also reads objects by byte ranges."""

    name = "ranged-mem"

    def open_ranged(self, keys, object_bytes):
        self._gate()
        blobs = []
        for key in keys:
            blob = self.data.get(key)
            if blob is None or len(blob) != object_bytes:
                break
            blobs.append(blob)
        return _MemRanges(blobs, RANGE_GATES.get(self.store_name))


class _MemRanges(RangedObjects):
    def __init__(self, blobs: list[bytes], gate: tuple[int, threading.Event] | None) -> None:
        self._blobs, self._gate = blobs, gate

    @property
    def num_opened(self) -> int:
        return len(self._blobs)

    def read(self, index, offset, buffer):
        if self._gate is not None and offset >= self._gate[0]:
            self._gate[1].wait(timeout=10)
        blob = self._blobs[index]
        if offset + buffer.nbytes > len(blob):
            return False
        buffer[:] = np.frombuffer(blob, np.uint8, buffer.nbytes, offset)
        return True

    def close(self):
        self._blobs = []
