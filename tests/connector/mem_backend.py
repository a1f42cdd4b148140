"""An in-process L3 for scheduler-harness tests: one dict per ``store`` name,
shared by the scheduler's and the worker's instances (same process)."""

from __future__ import annotations

import threading

import numpy as np

from vllm_hicache.storage import StorageBackend

STORES: dict[str, dict[str, bytes]] = {}
GATES: dict[str, threading.Event] = {}
_LOCK = threading.Lock()


class MemBackend(StorageBackend):
    name = "mem"

    def __init__(self, options, ctx) -> None:
        unknown = set(options) - {"store"}
        if unknown:
            raise ValueError(f"unknown MemBackend options {sorted(unknown)}")
        self.store_name = options["store"]
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
        return out

    def put(self, keys, sources):
        for key, bufs in zip(keys, sources):
            self.data[key] = b"".join(b.tobytes() for b in bufs)
        return [True] * len(keys)

    def clear(self):
        self.data.clear()

    def close(self):
        pass
