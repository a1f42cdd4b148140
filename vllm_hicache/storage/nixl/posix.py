"""The ``nixl`` backend's POSIX store: one file per object, moved by NIXL's POSIX plugin.

On-disk layout under ``path``::

    <path>/<xx>/<key>                          one object: its buffers concatenated
    <path>/<xx>/.<key>.<pid>.<tid>.<n>.tmp     a put in progress

``xx`` is crc32(key) & 0xff in hex: 256 fan-out directories, created at start.
A key must match ``[a-z0-9][a-z0-9_-]{0,199}``; any other key is a miss or a
failed put, so no key can name a path outside the directory.

Invariants:

- Readers never see a partial object: a put copies its buffers into a staging
  slot (staging.py), writes the slot into a unique temp file (one NIXL
  descriptor), checks the file's size, then ``os.replace``s it over the final
  name. A put past its deadline is never published.
- A get opens the file first and reads only if its size equals the buffers'
  total: a truncated or longer file is a miss without any I/O. The open file
  keeps its inode, so a concurrent overwrite or ``clear`` cannot tear a read.
  NIXL reads into a staging slot, copied to the caller's buffers only when
  the read completed within the call.
- ``clear`` removes only object files and temp files in the fan-out directories.
- Files are created ``file_mode`` (0600) and directories ``dir_mode`` (0700)
  exactly, whatever the umask, and a store directory others can write to
  (owner, group, world, ACL), or modes letting others write, are refused
  unless ``allow_shared_dir`` (the file backend's checks, file/access.py).
- The root is held open from start to close and every name is resolved
  relative to it, one component at a time, never following a symlink
  (file/store_dir.py). An object is opened ``O_NONBLOCK`` and must be a
  regular file: a symlink, FIFO or device at its name is a miss, never a
  hang.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import zlib
from collections.abc import Sequence
from functools import partial

from vllm_hicache.storage.base import Buffers
from vllm_hicache.storage.buffers import address, gather, scatter, total_bytes
from vllm_hicache.storage.file import io as file_io
from vllm_hicache.storage.file.access import check_modes
from vllm_hicache.storage.file.store_dir import StoreDir
from vllm_hicache.storage.nixl.config import NixlConfig
from vllm_hicache.storage.nixl.engine import Job, NixlEngine
from vllm_hicache.storage.nixl.staging import StagingSlots

_KEY = re.compile(r"[a-z0-9][a-z0-9_-]{0,199}")
_FAN_OUT = 256
_OWNER = "nixl backend (POSIX)"


class PosixStore:
    def __init__(self, engine: NixlEngine, staging: StagingSlots, config: NixlConfig) -> None:
        self.engine = engine
        self.staging = staging
        path = os.path.abspath(str(config.path))
        self._file_mode, self._dir_mode = config.file_mode, config.dir_mode
        self._umask = file_io.process_umask()
        self._seq = itertools.count()
        check_modes(self._file_mode, self._dir_mode, config.allow_shared_dir, _OWNER)
        try:
            self._store = StoreDir.open(path, dir_mode=self._dir_mode, umask=self._umask,
                                        allow_shared_dir=config.allow_shared_dir, owner=_OWNER)
        except OSError as err:
            raise ValueError(f"{_OWNER}: cannot use directory path={path!r}: {err}") from err
        self.root = self._store.path
        try:
            for i in range(_FAN_OUT):
                os.close(self._store.open_dir((f"{i:02x}",), self._dir_mode, self._umask))
            probe = self._temp_name("probe")
            fd = self._create("probe", probe)
            if fd is None:
                raise OSError(f"cannot create {probe} in {self._fan_out('probe')}/")
            os.close(fd)
            self._unlink("probe", probe)
        except OSError as err:
            self._store.close()
            raise ValueError(f"{_OWNER}: cannot use directory path={self.root!r}: "
                             f"{err}") from err

    @property
    def address(self) -> str:
        return self.root

    def close(self) -> None:
        """The root closes once no operation is using it."""
        self._store.close()

    # Names are f-strings, not os.path.join: they are built once per object on
    # the hot path (1024 x 64 KiB reads from the page cache take ~20 ms).
    @staticmethod
    def _fan_out(key: str) -> str:
        return f"{zlib.crc32(key.encode()) & 0xFF:02x}"

    def object_path(self, key: str) -> str:
        """``root/xx/<key>``, for messages and tests (I/O goes by descriptor)."""
        return f"{self.root}/{self._fan_out(key)}/{key}"

    def _temp_name(self, key: str) -> str:
        return f".{key}.{os.getpid()}.{threading.get_ident()}.{next(self._seq)}.tmp"

    # --- operations ----------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not _KEY.fullmatch(key):
                return i
            try:
                with self._store.directory((self._fan_out(key),)) as d:
                    if file_io.regular_size(d, key) is None:
                        return i
            except OSError:  # its directory is gone or a symlink
                return i
        return len(keys)

    def get(self, keys: Sequence[str], targets: Sequence[Buffers], timeout_s: float) -> list[bool]:
        jobs = [self._read_job(k, t) if _KEY.fullmatch(k) else None for k, t in zip(keys, targets)]
        ready = [job for job in jobs if job is not None]
        self.engine.transfer("READ", ready, timeout_s, batch=True)
        return [job is not None and job.done for job in jobs]

    def put(self, keys: Sequence[str], sources: Sequence[Buffers], timeout_s: float) -> list[bool]:
        jobs = [self._write_job(k, s) if _KEY.fullmatch(k) else None for k, s in zip(keys, sources)]
        ready = [job for job in jobs if job is not None]
        self.engine.transfer("WRITE", ready, timeout_s, batch=True)
        return [job is not None and job.done for job in jobs]

    def clear(self) -> None:
        for i in range(_FAN_OUT):
            try:
                with self._store.directory((f"{i:02x}",)) as d:
                    with os.scandir(d) as it:
                        names = [e.name for e in it
                                 if _is_ours(e.name) and not e.is_dir(follow_symlinks=False)]
                    for name in names:
                        try:
                            os.unlink(name, dir_fd=d)
                        except FileNotFoundError:
                            pass  # removed by another process meanwhile
            except OSError:  # gone, or a symlink: nothing of ours in it
                continue

    # --- jobs ------------------------------------------------------------------

    def _read_job(self, key: str, target: Buffers) -> Job | None:
        total = total_bytes(target)
        try:
            fd = self._store.open_file((self._fan_out(key),), key, file_io.O_READ)
        except OSError:
            return None
        opened = file_io.regular(fd)
        if opened is None:
            return None
        fd, size = opened
        slot = None
        try:
            if not total or size != total:
                raise OSError("no object of this size")
            self.engine.register_fd(fd)
            slot = self.staging.take(total)
        except Exception:  # noqa: BLE001 - NIXL raises its own error types
            pass
        if slot is None:
            os.close(fd)
            return None

        def finish(ok: bool) -> bool:
            try:
                os.close(fd)
                if ok:
                    scatter(slot, target)
            finally:
                self.staging.give(slot)
            return ok

        return Job([(address(slot), total)], [(0, total, fd)], finish, keep=slot)

    def _create(self, key: str, name: str) -> int | None:
        """A new file ``name`` in ``key``'s fan-out directory with exactly
        ``file_mode`` (the directory is made again if someone removed it).
        None if it cannot be created."""
        for attempt in range(2):
            try:
                with self._store.directory((self._fan_out(key),), self._dir_mode,
                                           self._umask) as d:
                    return file_io.create_file(d, name, self._file_mode, self._umask)
            except FileNotFoundError:  # the directory went between open and create
                if attempt:
                    return None
            except OSError:
                return None
        return None

    def _unlink(self, key: str, name: str) -> None:
        try:
            with self._store.directory((self._fan_out(key),)) as d:
                os.unlink(name, dir_fd=d)
        except OSError:
            pass  # clear() got there first, or the directory is gone

    def _write_job(self, key: str, source: Buffers) -> Job | None:
        total = total_bytes(source)
        slot = self.staging.take(total) if total else None
        if slot is None:
            return None
        temp = self._temp_name(key)
        fd = self._create(key, temp)
        try:
            if fd is None:
                raise OSError("cannot create the temp file")
            self.engine.register_fd(fd)
        except Exception:  # noqa: BLE001 - NIXL raises its own error types
            self.staging.give(slot)
            if fd is not None:
                os.close(fd)
                self._unlink(key, temp)
            return None
        gather(source, slot)
        return Job([(address(slot), total)], [(0, total, fd)],
                   partial(self._publish, key, temp, fd, total, slot), keep=slot)

    def _publish(self, key: str, temp: str, fd: int, total: int, slot, ok: bool) -> bool:
        """A put's finish: the temp file becomes the object only if whole."""
        self.staging.give(slot)
        try:
            ok = ok and os.fstat(fd).st_size == total
        finally:
            os.close(fd)
        if ok:
            try:
                with self._store.directory((self._fan_out(key),)) as d:
                    os.replace(temp, key, src_dir_fd=d, dst_dir_fd=d)
                return True
            except OSError:
                pass
        self._unlink(key, temp)
        return False


def _is_ours(name: str) -> bool:
    if name.startswith(".") and name.endswith(".tmp"):
        return True
    return _KEY.fullmatch(name) is not None
