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

Evicted keys are kept (bounded, ``MAX_EVICTED_KEYS``) until taken, for
exact ``BlockRemoved`` events (l3/removals.py): a key committed again
before it is taken is dropped from them, as it is back in the store; both
happen under the lock, so the order is exact for this process.

LRU order is per process: an index of the objects this process wrote or
read, oldest first. When it runs out of victims, the directory is rescanned
(objects of every process, ordered by mtime; readers bump mtime on a hit)
and the counter reset to what the scan found, which also repairs drift from
a process that died between a rename and its counter update. A file another
process already evicted is skipped; a reader holding it open still reads
the whole object (unlink keeps the inode alive).

The usage file is opened relative to the store's root descriptor with
``O_NOFOLLOW``, and must be a regular file with one link: a symlink, FIFO or
hard link planted in its place (by whoever can write a shared directory) is
refused at start, so the counter's writes never land in another file.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from vllm_hicache.storage.file import io as file_io
from vllm_hicache.storage.file.store_dir import StoreDir

logger = logging.getLogger(__name__)

_USAGE = struct.Struct("<8sQ")
_MAGIC = b"HCUSAGE1"
USAGE_FILE = ".hicache-usage"
# A hit bumps the file's mtime (the LRU clock a rescan sorts by) at most this
# often, so hot objects do not cost a metadata write per read.
_TOUCH_INTERVAL_NS = 1_000_000_000
# No write takes this long: an older temp file is a crashed writer's.
_STALE_TEMP_NS = 3600 * 1_000_000_000
# Evicted keys waiting to be taken, at most; beyond, the oldest are dropped
# (counted in evicted_untold: their removal events are lost, not wrong).
MAX_EVICTED_KEYS = 1 << 16
# close() gives a commit stuck on a hung mount this long before leaving the
# usage file's descriptor to it.
_CLOSE_WAIT_S = 1.0


class Pending(NamedTuple):
    """A written temp file (``tmp``: its name in the key's leaf directory)
    waiting to be renamed into place."""

    key: str
    tmp: str
    size: int


class Capacity:
    def __init__(self, store: StoreDir, max_bytes: int, file_mode: int = 0o600,
                 umask: int = 0o022) -> None:
        self.store = store
        # 0 = unlimited: commits skip the shared lock entirely.
        self.max_bytes = max_bytes
        self._fd = _open_usage_file(store, file_mode, umask)
        self._mutex = threading.Lock()
        self._index_lock = threading.Lock()
        # key -> when its file's mtime was last set (time.time_ns()), least
        # recently used first.
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.usage_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0
        # Evicted keys not yet taken (take_evicted), oldest first.
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self.evicted_untold = 0

    @property
    def limited(self) -> bool:
        return self.max_bytes > 0

    def close(self) -> None:
        if not self._mutex.acquire(timeout=_CLOSE_WAIT_S):
            logger.warning("file L3 at %s: a commit is stuck (hung mount?); its usage file "
                           "stays open", self.store.path)
            return
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        finally:
            self._mutex.release()

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
        found = sorted(file_io.scan_objects(self.store, stale_before_ns),
                       key=lambda o: o.mtime_ns)
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
            self._evicted.pop(key, None)  # back in the store

    def _note_evicted(self, key: str) -> None:
        with self._index_lock:
            self._evicted[key] = None
            if len(self._evicted) > MAX_EVICTED_KEYS:
                self._evicted.popitem(last=False)
                self.evicted_untold += 1

    def take_evicted(self) -> list[str]:
        """Keys evicted (and not committed again) since the last call."""
        with self._index_lock:
            keys, self._evicted = list(self._evicted), OrderedDict()
        return keys

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
                parts, name = file_io.object_location(p.key)
                try:
                    leaf = self.store.open_dir(parts)
                except OSError:  # its directory went away (or is a symlink now)
                    done.append(False)
                    continue
                try:
                    delta = p.size - (file_io.regular_size(leaf, name) or 0)
                    usage = self._make_room(usage, delta, protected)
                    ok = usage + delta <= self.max_bytes and _replace(leaf, p.tmp, name)
                    if ok:
                        usage += delta
                        self._written(p.key)
                    else:
                        file_io.discard(leaf, p.tmp)
                finally:
                    os.close(leaf)
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
            size = self._evict(key)
            if size is None:  # evicted by another process already
                continue
            usage -= size
            self._note_evicted(key)
            self.evictions += 1
            self.evicted_bytes += size
        return usage

    def _evict(self, key: str) -> int | None:
        """Unlink ``key``'s object; its bytes, or None if it was not there."""
        parts, name = file_io.object_location(key)
        try:
            with self.store.directory(parts) as leaf:
                size = file_io.regular_size(leaf, name)
                if size is not None:
                    os.unlink(name, dir_fd=leaf)
                return size
        except OSError:
            return None

    def clear(self) -> None:
        """Remove every object (every process's) and zero the counter."""
        with self._locked():
            file_io.remove_ours(self.store)
            with self._index_lock:
                self._lru.clear()
            self._write_usage(0)


def _replace(dir_fd: int, tmp: str, final: str) -> bool:
    try:
        os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True
    except OSError:
        file_io.discard(dir_fd, tmp)
        return False


def _open_usage_file(store: StoreDir, mode: int, umask: int) -> int:
    """Open (creating it with exactly ``mode``) the shared accounting file;
    ValueError if something else than a plain file of ours is in its place."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    with store.directory(()) as root:
        try:
            fd = file_io.create_file(root, USAGE_FILE, mode, umask)
            os.close(fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(USAGE_FILE, flags, dir_fd=root)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise ValueError(f"file backend: refusing {store.path}/{USAGE_FILE}: it is a "
                             "symlink, and its writes would land in another file; remove it, "
                             "and check who else can write the directory") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ValueError(
                f"file backend: refusing {store.path}/{USAGE_FILE}: it is not a plain file "
                f"with one link ({stat.filemode(st.st_mode)}, {st.st_nlink} links), so writing it "
                "could change another file; remove it, and check who else can write the "
                "directory")
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # blocking again: it is a regular file
    except BaseException:
        os.close(fd)
        raise
    return fd
