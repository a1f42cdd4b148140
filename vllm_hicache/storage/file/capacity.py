"""``max_bytes`` for the ``file`` backend: a usage counter shared by every
process on the directory, and LRU eviction of whole objects.

Shared state is one file, ``<root>/.hicache-usage``: ``b"HCUSAGE1"`` then the
bytes of committed objects (little-endian u64). Every change to the set of
committed objects — renaming a temp file into place, evicting, clearing —
happens while holding ``flock(LOCK_EX)`` on it (plus a thread lock, since
flock does not exclude threads sharing one descriptor), so the counter moves
in step with the files and committed objects never exceed ``max_bytes``.
Temp files being written are not counted: each process may have its
in-flight batches on disk on top of ``max_bytes``.

LRU order is per process: an index of the objects this process wrote or
read, oldest first. When it runs out of victims, the directory is rescanned
(objects of every process, ordered by mtime; readers bump mtime on a hit)
and the counter reset to what the scan found, which also repairs drift from
a process that died between a rename and its counter update. A file another
process already evicted is skipped; a reader holding it open still reads
the whole object (unlink keeps the inode alive).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from vllm_hicache.storage.file import io as file_io

_USAGE = struct.Struct("<8sQ")
_MAGIC = b"HCUSAGE1"
USAGE_FILE = ".hicache-usage"
# A hit bumps the file's mtime (the LRU clock a rescan sorts by) at most this
# often, so hot objects do not cost a metadata write per read.
_TOUCH_INTERVAL_NS = 1_000_000_000
# No write takes this long: an older temp file is a crashed writer's.
_STALE_TEMP_NS = 3600 * 1_000_000_000


class Pending(NamedTuple):
    """A written temp file waiting to be renamed into place."""

    key: str
    final: str
    tmp: str
    size: int


class Capacity:
    def __init__(self, root: str, max_bytes: int, file_mode: int = 0o600) -> None:
        self.root = root
        # 0 = unlimited: commits skip the shared lock entirely.
        self.max_bytes = max_bytes
        self._fd = _open_usage_file(os.path.join(root, USAGE_FILE), file_mode)
        self._mutex = threading.Lock()
        self._index_lock = threading.Lock()
        # key -> when its file's mtime was last set (time.time_ns()), least
        # recently used first.
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.usage_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0

    @property
    def limited(self) -> bool:
        return self.max_bytes > 0

    def close(self) -> None:
        with self._mutex:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex:
            if self._fd < 0:
                raise OSError("file backend is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # --- shared counter (call with the lock held) ---

    def _read_usage(self) -> int | None:
        raw = os.pread(self._fd, _USAGE.size, 0)
        if len(raw) != _USAGE.size:
            return None
        magic, usage = _USAGE.unpack(raw)
        return usage if magic == _MAGIC else None

    def _write_usage(self, usage: int) -> None:
        os.pwrite(self._fd, _USAGE.pack(_MAGIC, usage), 0)
        self.usage_bytes = usage

    def _rescan(self) -> int:
        """Index every object in the directory, oldest first; their bytes.
        Temp files left by a crashed writer (older than an hour) go too."""
        stale_before_ns = time.time_ns() - _STALE_TEMP_NS
        found = sorted(file_io.scan_objects(self.root, stale_before_ns), key=lambda o: o.mtime_ns)
        with self._index_lock:
            self._lru = OrderedDict((o.key, o.mtime_ns) for o in found)
        return sum(o.size for o in found)

    # --- LRU index ---

    def touch(self, key: str) -> bool:
        """A hit: ``key`` becomes most recently used. True if its file's
        mtime is due a bump (so other processes' rescans see the use)."""
        if not self.limited:
            return False
        now = time.time_ns()
        with self._index_lock:
            last = self._lru.pop(key, 0)
            due = now - last > _TOUCH_INTERVAL_NS
            self._lru[key] = now if due else last
        return due

    def _written(self, key: str) -> None:
        with self._index_lock:
            self._lru.pop(key, None)
            self._lru[key] = time.time_ns()

    def _oldest(self, protected: set[str]) -> str | None:
        with self._index_lock:
            key = next((k for k in self._lru if k not in protected), None)
            if key is not None:
                del self._lru[key]
            return key

    # --- commits ---

    def commit(self, pending: Sequence[Pending]) -> list[bool]:
        """Rename each temp file into place if it fits (evicting LRU objects
        not in this batch); a temp file that cannot fit is removed."""
        assert self.limited, "unlimited puts publish without the shared lock"
        done = []
        with self._locked():
            usage = self._read_usage()
            usage = self._rescan() if usage is None else usage
            protected = {p.key for p in pending}
            for p in pending:
                delta = p.size - _size_or_zero(p.final)
                usage = self._make_room(usage, delta, protected)
                ok = usage + delta <= self.max_bytes and _replace(p)
                if ok:
                    usage += delta
                    self._written(p.key)
                else:
                    file_io.discard(p.tmp)
                done.append(ok)
            self._write_usage(usage)
        return done

    def _make_room(self, usage: int, delta: int, protected: set[str]) -> int:
        """Evict until ``usage + delta`` fits; the new usage. Bounded: each
        round drops one index entry, and the directory is rescanned once."""
        rescanned = False
        while usage + delta > self.max_bytes:
            key = self._oldest(protected)
            if key is None:
                if rescanned:
                    break
                usage, rescanned = self._rescan(), True
                continue
            path = file_io.object_path(self.root, key)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except OSError:  # evicted by another process already
                continue
            usage -= size
            self.evictions += 1
            self.evicted_bytes += size
        return usage

    def clear(self) -> None:
        """Remove every object (every process's) and zero the counter."""
        with self._locked():
            file_io.remove_ours(self.root)
            with self._index_lock:
                self._lru.clear()
            self._write_usage(0)


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _replace(p: Pending) -> bool:
    try:
        os.replace(p.tmp, p.final)
        return True
    except OSError:
        file_io.discard(p.tmp)
        return False


def _open_usage_file(path: str, mode: int) -> int:
    """Open (creating it with exactly ``mode``) the shared accounting file."""
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return os.open(path, flags)
    try:
        os.fchmod(fd, mode)  # once per directory: the umask may have stripped bits
    except OSError:
        os.close(fd)
        raise
    return fd
