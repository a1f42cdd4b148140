"""``file``: the embedded L3 — one file per object in a local or shared directory.

On-disk layout under ``path``::

    <path>/.hicache-usage             max_bytes accounting (capacity.py)
    <path>/<aa>/<bb>/<key>.hckv       one object: its buffers concatenated
    <path>/<aa>/<bb>/.<key>.<16 hex>.tmp   a write in progress

``aabb`` is the low 16 bits of CRC-32(key) in hex: 65,536 leaf directories,
created on first use, keep every directory small. A key must
match ``[a-z0-9_-]{1,200}``; any other key is a miss (get/exists) or a
failed put, so no key can name a path outside the directory.

Invariants:

- Readers never see a partial object: a put writes a unique temp file in the
  object's directory, then ``os.replace``s it over the final name. Several
  processes may share the directory (one per TP rank and instance, or many
  machines on a shared file system).
- A get is True only if the file is exactly as long as the caller's buffers
  and was read whole; a truncated or longer file is a miss. Buffers move with
  ``writev``/``preadv`` straight to and from the file, never concatenated.
  ``open_ranged`` holds the files of one layered read open: a put that
  replaces an object, or an eviction that unlinks it, meanwhile leaves the
  open file as it was, so every range read comes from one version.
- With ``max_bytes``, committed objects never exceed it (in-flight temp files
  come on top); least recently used objects are evicted whole, and an object
  larger than ``max_bytes`` is refused. All processes sharing a directory
  should use the same ``max_bytes``.
- ``clear`` removes only files named like objects or temp files.
- Files are created ``file_mode`` (0600) and directories ``dir_mode`` (0700),
  whatever the umask. A store directory that others can write to (not owned
  by this user, group- or world-writable, or an ACL granting write), or modes
  that would let others write what we create, are refused at start unless
  ``allow_shared_dir``: whoever can write the store can replace objects.
- The directory checked at start is the one used until close: the root is
  held open and every path below it walked without following symlinks
  (store_dir.py; the 256 first-level directories are held once walked, so a
  write opens only its leaf). A symlink, FIFO or device at an object's name
  is a miss.
- I/O threads are daemons (DaemonPool) and ``close`` waits for them only
  briefly, so a hung mount can stall neither shutdown nor process exit.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from vllm_hicache import io_threads
from vllm_hicache.daemon_pool import DaemonPool
from vllm_hicache.storage.base import Buffers, RangedObjects, StorageBackend, StorageContext
from vllm_hicache.storage.batching import map_slices
from vllm_hicache.storage.buffers import total_bytes
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.file import io as file_io
from vllm_hicache.storage.file.access import check_modes
from vllm_hicache.storage.file.capacity import Capacity, Pending
from vllm_hicache.storage.file.config import FileBackendConfig
from vllm_hicache.storage.file.store_dir import StoreDir
from vllm_hicache.storage.log_throttle import LogThrottle

logger = logging.getLogger(__name__)

# Start-up must fail within the interface's 30 s even on a hung network mount.
_STARTUP_TIMEOUT_S = 20.0
# close() waits this long for each I/O thread; one stuck on a hung mount is
# left behind (a daemon: it cannot hold up the process's exit).
_CLOSE_JOIN_S = 1.0
_OWNER = "file backend"


class FileBackend(StorageBackend):
    """Objects as files under a directory (see the module docstring); options:
    FileBackendConfig (config.py)."""

    name = "file"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        self.config = FileBackendConfig.from_options(options)
        check_modes(self.config.file_mode, self.config.dir_mode, self.config.allow_shared_dir,
                    _OWNER)
        self._umask = file_io.process_umask()
        self._store, self._capacity = _open_root(self.config, self._umask)
        # The directory actually held (a symlinked path resolved once).
        self.root = self._store.path
        self._pool: DaemonPool | None = None
        self._lock = threading.Lock()
        self._counts = Counters("gets", "get_hits", "get_bytes", "puts", "put_ok", "put_bytes",
                                "errors")
        self._error_log = LogThrottle()
        self._closed = False
        max_bytes = self.config.max_bytes
        logger.info("file L3 (%s) at %s: capacity %s, %d I/O threads, fsync=%s, modes %04o/%04o",
                    ctx.role, self.root, f"{max_bytes} B = {max_bytes / 2**30:.2f} GiB = "
                    f"{max_bytes // max(ctx.object_bytes, 1)} objects of {ctx.object_bytes} B"
                    if max_bytes else "unlimited", self.config.num_io_threads, self.config.fsync,
                    self.config.file_mode, self.config.dir_mode)

    # --- StorageBackend ---

    def exists_prefix(self, keys: Sequence[str]) -> int:
        found = 0
        for key in keys:
            if self._closed or not file_io.valid_key(key):
                break
            parts, name = file_io.object_location(key)
            try:
                with self._store.directory(parts) as leaf:
                    if file_io.regular_size(leaf, name) is None:
                        break
            except OSError:  # no such directory, a symlink, or closed meanwhile
                break
            found += 1
        return found

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        assert len(keys) == len(targets), (len(keys), len(targets))
        sizes = self._map(self._get_one, list(zip(keys, targets)))
        hits = [size is not None for size in sizes]
        self._counts.add(gets=len(keys), get_hits=sum(hits), get_bytes=sum(s for s in sizes if s))
        return hits

    def open_ranged(self, keys: Sequence[str], object_bytes: int) -> RangedObjects:
        fds: list[int] = []
        try:
            for key in keys:
                opened = self._open_object(key)
                if opened is None:
                    break
                if opened[1] != object_bytes:
                    os.close(opened[0])
                    break
                fds.append(opened[0])
        except BaseException:
            _FileRanges(fds).close()
            raise
        self._counts.add(gets=len(keys), get_hits=len(fds), get_bytes=len(fds) * object_bytes)
        return _FileRanges(fds)

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        assert len(keys) == len(sources), (len(keys), len(sources))
        items = list(zip(keys, sources))
        if self._capacity.limited:
            # Write in parallel, then publish the batch under one shared lock.
            written = self._map(self._write_one, items)
            done = self._commit([p for p in written if p])
            sizes = [p.size if p and done[p.tmp] else None for p in written]
        else:
            sizes = self._map(self._put_one, items)
        stored = [size is not None for size in sizes]
        self._counts.add(puts=len(keys), put_ok=sum(stored), put_bytes=sum(s for s in sizes if s))
        return stored

    def clear(self) -> None:
        self._capacity.clear()

    def take_removed_keys(self) -> list[str]:
        """Objects this process's ``max_bytes`` LRU evicted (capacity.py)."""
        return self._capacity.take_evicted()

    def stats(self) -> dict[str, float]:
        counts = self._counts.snapshot()
        counts["evictions"] = float(self._capacity.evictions)
        counts["evicted_bytes"] = float(self._capacity.evicted_bytes)
        counts["usage_bytes"] = float(self._capacity.usage_bytes)
        return counts

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, timeout_s=_CLOSE_JOIN_S)
        self._capacity.close()
        self._store.close()

    # --- one object ---

    def _get_one(self, key: str, buffers: Buffers) -> int | None:
        """Bytes read, or None: a miss."""
        opened = self._open_object(key)
        if opened is None:
            return None
        fd, size = opened
        try:
            read = file_io.read_whole(fd, size, buffers)
            return read if read >= 0 else None
        finally:
            os.close(fd)

    def _open_object(self, key: str) -> tuple[int, int] | None:
        """(descriptor, size) of object ``key``'s regular file (its LRU entry
        touched: it is being read), or None: a miss."""
        if not file_io.valid_key(key):
            return None
        parts, name = file_io.object_location(key)
        try:
            fd = self._store.open_file(parts, name, file_io.O_READ)
        except OSError:  # missing, a symlink on the way, or closed meanwhile
            return None
        opened = file_io.regular(fd)
        if opened is None:  # a FIFO, a device...: closed by ``regular``
            return None
        if self._capacity.touch(key):
            try:  # the LRU clock other processes' rescans sort by
                os.utime(fd)
            except OSError:
                pass
        return opened

    def _write_temp(self, key: str, buffers: Buffers, size: int) -> tuple[int, str, str] | None:
        """Write the temp file of one object of ``size`` bytes (not yet
        visible): (its leaf directory's descriptor, for the caller to close;
        the temp file's name; the object's name)."""
        cfg = self.config
        if not file_io.valid_key(key) or (self._capacity.limited and size > cfg.max_bytes):
            return None
        parts, name = file_io.object_location(key)
        for attempt in range(2):
            leaf = self._store.open_dir(parts, cfg.dir_mode, self._umask)
            try:
                return leaf, file_io.write_temp(leaf, name, buffers, cfg.fsync, cfg.file_mode,
                                                self._umask, size), name
            except FileNotFoundError:  # directory removed behind our back: make it again
                os.close(leaf)
                if attempt:
                    raise
            except BaseException:
                os.close(leaf)
                raise
        raise AssertionError("unreachable")

    def _write_one(self, key: str, buffers: Buffers) -> Pending | None:
        """A temp file for the capacity's commit to publish."""
        size = total_bytes(buffers)
        written = self._write_temp(key, buffers, size)
        if written is None:
            return None
        leaf, tmp, _ = written
        os.close(leaf)
        return Pending(key, tmp, size)

    def _put_one(self, key: str, buffers: Buffers) -> int | None:
        """Write and publish one object (no capacity: no shared lock); its
        bytes, or None: not stored."""
        size = total_bytes(buffers)
        written = self._write_temp(key, buffers, size)
        if written is None:
            return None
        leaf, tmp, name = written
        try:
            try:
                os.replace(tmp, name, src_dir_fd=leaf, dst_dir_fd=leaf)
            except OSError:
                file_io.discard(leaf, tmp)
                raise
            if self.config.fsync:  # a rename is durable once its directory is
                os.fsync(leaf)
        finally:
            os.close(leaf)
        return size

    def _commit(self, pending: list[Pending]) -> dict[str, bool]:
        try:
            done = self._capacity.commit(pending)
        except Exception:  # noqa: BLE001 - a failed commit is a failed put
            self._note_error("commit")
            self._discard(pending)
            done = [False] * len(pending)
        if self.config.fsync:  # a rename is durable once its directory is
            dirs = {file_io.object_location(p.key)[0] for p, ok in zip(pending, done) if ok}
            synced = {d: self._fsync_dir(d) for d in dirs}
            done = [ok and synced[file_io.object_location(p.key)[0]]
                    for p, ok in zip(pending, done)]
        return {p.tmp: ok for p, ok in zip(pending, done)}

    def _discard(self, pending: Iterable[Pending]) -> None:
        for p in pending:
            try:
                with self._store.directory(file_io.object_location(p.key)[0]) as leaf:
                    file_io.discard(leaf, p.tmp)
            except OSError:  # left for the stale-temp sweep of a rescan
                pass

    def _fsync_dir(self, parts: tuple[str, str]) -> bool:
        try:
            with self._store.directory(parts) as leaf:
                os.fsync(leaf)
            return True
        except OSError:
            self._note_error("fsync")
            return False

    # --- batches ---

    def _map(self, fn: Callable[..., Any], items: list[tuple[str, Buffers]]) -> list[Any]:
        """``fn(*item)`` for every item, in order; the batch split into
        contiguous slices run in parallel; an exception is a None."""
        def one(item: tuple[str, Buffers]) -> Any:
            try:
                return fn(*item)
            except Exception:  # noqa: BLE001 - per-key failure is a miss
                self._note_error(fn.__name__)
                return None

        if self._closed:
            return [None] * len(items)
        try:
            return map_slices(one, items, self.config.num_io_threads, self._executor)
        except RuntimeError:  # closed meanwhile
            return [None] * len(items)

    def _executor(self) -> DaemonPool:
        with self._lock:
            if self._closed:
                raise RuntimeError("file backend is closed")
            if self._pool is None:
                # map_slices runs one slice on the calling thread.
                self._pool = DaemonPool(max(self.config.num_io_threads - 1, 1), "hicache-file")
            return self._pool

    def _note_error(self, where: str) -> None:
        errors = self._counts.bump("errors")
        # With its traceback at most once a minute; every failure is counted (stats).
        if self._error_log.ready():
            logger.warning("file L3 at %s: %s failed (%d failures so far); counted as a miss",
                           self.root, where, errors, exc_info=True)


class _FileRanges(RangedObjects):
    """Open object files of one layered read (``FileBackend.open_ranged``)."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    @property
    def num_opened(self) -> int:
        return len(self._fds)

    def read(self, index: int, offset: int, buffer: np.ndarray) -> bool:
        try:
            return file_io.read_range(self._fds[index], offset, buffer)
        except OSError:
            return False

    def read_vectored(self, index: int, offset: int, buffers: Sequence[np.ndarray]) -> bool:
        try:
            return file_io.read_ranges(self._fds[index], offset, buffers)
        except OSError:
            return False

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def _open_root(cfg: FileBackendConfig, umask: int) -> tuple[StoreDir, Capacity]:
    """Open and check the directory (in a thread, so a hung mount cannot hang
    start-up) and its capacity accounting; ValueError if unusable or shared."""
    root = cfg.path
    outcome: list[tuple[StoreDir, Capacity] | OSError | ValueError] = []

    def probe() -> None:
        try:
            store = StoreDir.open(root, dir_mode=cfg.dir_mode, umask=umask,
                                  allow_shared_dir=cfg.allow_shared_dir, owner=_OWNER)
        except (OSError, ValueError) as err:
            outcome.append(err)
            return
        try:
            _probe_writable(store, cfg.file_mode, umask)
            outcome.append((store, Capacity(store, cfg.max_bytes, cfg.file_mode, umask)))
        except (OSError, ValueError) as err:
            store.close()
            outcome.append(err)

    thread = io_threads.named_thread(probe, "hicache-probe")
    thread.start()
    thread.join(_STARTUP_TIMEOUT_S)
    if not outcome:
        raise ValueError(f"file backend: directory {root!r} did not answer within "
                         f"{_STARTUP_TIMEOUT_S:.0f} s (a hung mount?)")
    if isinstance(outcome[0], ValueError):
        raise outcome[0]
    if isinstance(outcome[0], OSError):
        raise ValueError(f"file backend: cannot use directory {root!r}: {outcome[0]}")
    return outcome[0]


def _probe_writable(store: StoreDir, file_mode: int, umask: int) -> None:
    """Prove a file can be created and removed in the directory."""
    name = f".probe-{uuid.uuid4().hex}"
    with store.directory(()) as root:
        os.close(file_io.create_file(root, name, file_mode, umask))
        os.unlink(name, dir_fd=root)
