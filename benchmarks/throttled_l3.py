"""A throttled ``file`` L3 for benchmarks: a slow or congested store.

Loaded as a user backend (``hicache_storage_backend="dynamic"``, options
``module_path="throttled_l3"``, ``class_name="ThrottledFileBackend"``, with
this directory on ``sys.path``). Options: those of the ``file`` backend,
plus ``read_mb_s`` and ``write_mb_s`` (MB/s, 10^6 bytes; 0 = unthrottled).

Each direction is one link of that bandwidth shared by every thread of the
process: a transfer waits for the link to be free, then for its bytes to
cross it (a token bucket without burst), so two reader threads get half the
bandwidth each, as on a saturated network. Reads are charged for the bytes
they found, writes for the bytes they write; lookups are free.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hicache.storage import Buffers, StorageContext
from vllm_hicache.storage.file.backend import FileBackend


class Link:
    """A shared link of ``mb_s`` MB/s (0: instant)."""

    def __init__(self, mb_s: float) -> None:
        self.bytes_per_s = mb_s * 1e6
        self._free_at = 0.0
        self._lock = threading.Lock()

    def cross(self, num_bytes: int) -> None:
        if self.bytes_per_s <= 0 or num_bytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + num_bytes / self.bytes_per_s
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))


class ThrottledFileBackend(FileBackend):
    name = "throttled-file"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        options = dict(options)
        self.read_link = Link(float(options.pop("read_mb_s", 0)))
        self.write_link = Link(float(options.pop("write_mb_s", 0)))
        super().__init__(options, ctx)

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        hits = super().get(keys, targets)
        self.read_link.cross(sum(sum(b.nbytes for b in bufs)
                                 for bufs, hit in zip(targets, hits) if hit))
        return hits

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        self.write_link.cross(sum(b.nbytes for bufs in sources for b in bufs))
        return super().put(keys, sources)


class StallingFileBackend(FileBackend):
    """The ``file`` backend, every call of which (lookups too) first sleeps
    ``stall_s`` seconds while the file ``stall_flag`` exists: a store that
    turns unresponsive mid-run (bench_l3_breaker.py)."""

    name = "stalling-file"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        options = dict(options)
        self.stall_s = float(options.pop("stall_s", 2.0))
        self.stall_flag = str(options.pop("stall_flag"))
        super().__init__(options, ctx)

    def _stall(self) -> None:
        if os.path.exists(self.stall_flag):
            time.sleep(self.stall_s)

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._stall()
        return super().exists_prefix(keys)

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        self._stall()
        return super().get(keys, targets)

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        self._stall()
        return super().put(keys, sources)
