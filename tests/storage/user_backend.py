"""A user backend for the ``dynamic`` tests: objects as bytes in a dict.

Loaded with ``create_backend("dynamic", {"module_path":
"tests.storage.user_backend", "class_name": "MemoryBackend", ...})``. With
option ``persist_dir`` every put is also written to ``<persist_dir>/<key>``
(temp file + rename) and a dict miss falls back to that file, so a second
process sees what the first wrote.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hicache.storage import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.file.backend import FileBackend

_SAFE_KEY = re.compile(r"[a-z0-9_-]{1,200}")


class MemoryBackend(StorageBackend):
    """Options: ``persist_dir`` (str, default None: memory only)."""

    name = "memory"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        unknown = sorted(set(options) - {"persist_dir"})
        if unknown:
            raise ValueError(
                f"unknown memory backend option(s) {unknown}; accepted: ['persist_dir']"
            )
        self.persist_dir = options.get("persist_dir")
        if self.persist_dir is not None:
            os.makedirs(self.persist_dir, exist_ok=True)
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _path(self, key: str) -> str | None:
        if self.persist_dir is None or not _SAFE_KEY.fullmatch(key):
            return None
        return os.path.join(self.persist_dir, key)

    def _load(self, key: str) -> bytes | None:
        with self._lock:
            data = self._objects.get(key)
        path = self._path(key)
        if data is None and path is not None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                return None
        return data

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if self._load(key) is None:
                return i
        return len(keys)

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        hits = []
        for key, buffers in zip(keys, targets):
            data = self._load(key)
            ok = data is not None and len(data) == sum(b.nbytes for b in buffers)
            offset = 0
            for b in buffers if ok else ():
                memoryview(b).cast("B")[:] = data[offset:offset + b.nbytes]
                offset += b.nbytes
            hits.append(ok)
        return hits

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        for key, buffers in zip(keys, sources):
            data = b"".join(memoryview(b).cast("B") for b in buffers)
            with self._lock:
                self._objects[key] = data
            path = self._path(key)
            if path is not None:
                tmp = f"{path}.{uuid.uuid4().hex}.tmp"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
        return [True] * len(keys)

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
        if self.persist_dir is not None:
            for name in os.listdir(self.persist_dir):
                if _SAFE_KEY.fullmatch(name):
                    os.unlink(os.path.join(self.persist_dir, name))

    def close(self) -> None:
        pass


class NotABackend:
    """A class that does not subclass StorageBackend (for the error test)."""


class SlowPutBackend(MemoryBackend):
    """MemoryBackend whose every ``put`` call first sleeps ``put_delay_s``
    (default 0.5 s): a congested NFS or object store."""

    name = "slow-put"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        options = dict(options)
        self.put_delay_s = float(options.pop("put_delay_s", 0.5))
        super().__init__(options, ctx)

    def put(self, keys, sources):
        import time

        time.sleep(self.put_delay_s)
        return super().put(keys, sources)


class SleepyBackend(MemoryBackend):
    """MemoryBackend whose every call first sleeps ``sleep_s`` (default 2 s)
    while the file ``sleep_flag`` exists: a store that turns slow mid-run
    and recovers when the test removes the flag."""

    name = "sleepy"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        options = dict(options)
        self.sleep_s = float(options.pop("sleep_s", 2.0))
        self.sleep_flag = str(options.pop("sleep_flag"))
        super().__init__(options, ctx)

    def _nap(self) -> None:
        import time

        if os.path.exists(self.sleep_flag):
            time.sleep(self.sleep_s)

    def exists_prefix(self, keys):
        self._nap()
        return super().exists_prefix(keys)

    def get(self, keys, targets):
        self._nap()
        return super().get(keys, targets)

    def put(self, keys, sources):
        self._nap()
        return super().put(keys, sources)


class SlowFileBackend(FileBackend):
    """The ``file`` backend whose every ``put`` call first sleeps
    ``put_delay_s`` (default 0.5 s; 0 = as fast as the file backend): a
    throttled shared file system. Servers that share its ``path`` share
    objects, whatever their delays."""

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        options = dict(options)
        self.put_delay_s = float(options.pop("put_delay_s", 0.5))
        super().__init__(options, ctx)

    def put(self, keys, sources):
        import time

        time.sleep(self.put_delay_s)
        return super().put(keys, sources)
