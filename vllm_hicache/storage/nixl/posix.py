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
  exactly, whatever the umask (the file backend's helpers), and a store
  directory others can write to is refused unless ``allow_shared_dir``.
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
from vllm_hicache.storage.nixl.config import NixlConfig
from vllm_hicache.storage.nixl.engine import Job, NixlEngine
from vllm_hicache.storage.nixl.staging import StagingSlots

_KEY = re.compile(r"[a-z0-9][a-z0-9_-]{0,199}")
_FAN_OUT = 256


class PosixStore:
    def __init__(self, engine: NixlEngine, staging: StagingSlots, config: NixlConfig) -> None:
        self.engine = engine
        self.staging = staging
        self.root = os.path.abspath(str(config.path))
        self._file_mode, self._dir_mode = config.file_mode, config.dir_mode
        self._umask = file_io.process_umask()
        self._seq = itertools.count()
        try:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            file_io.make_dir(self.root, self._dir_mode, self._umask)
            file_io.check_owner(self.root, config.allow_shared_dir, "nixl backend (POSIX)")
            for i in range(_FAN_OUT):
                file_io.make_dir(os.path.join(self.root, f"{i:02x}"), self._dir_mode, self._umask)
            probe = self._temp_path("probe")
            fd = self._create(probe)
            if fd is None:
                raise OSError(f"cannot create {probe}")
            os.close(fd)
            os.unlink(probe)
        except OSError as err:
            raise ValueError(f"nixl backend (POSIX): cannot use directory path={self.root!r}: "
                             f"{err}") from err

    @property
    def address(self) -> str:
        return self.root

    # Paths are f-strings, not os.path.join: they are built once per object on
    # the hot path (1024 x 64 KiB reads from the page cache take ~20 ms).
    def _dir(self, key: str) -> str:
        return f"{self.root}/{zlib.crc32(key.encode()) & 0xFF:02x}"

    def _final_path(self, key: str) -> str:
        return f"{self.root}/{zlib.crc32(key.encode()) & 0xFF:02x}/{key}"

    def _temp_path(self, key: str) -> str:
        tag = f"{os.getpid()}.{threading.get_ident()}.{next(self._seq)}"
        return f"{self._dir(key)}/.{key}.{tag}.tmp"

    # --- operations ----------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not (_KEY.fullmatch(key) and os.path.isfile(self._final_path(key))):
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
                entries = list(os.scandir(f"{self.root}/{i:02x}"))
            except FileNotFoundError:
                continue
            for entry in entries:
                if _is_ours(entry.name) and entry.is_file(follow_symlinks=False):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass  # removed by another process meanwhile

    # --- jobs ------------------------------------------------------------------

    def _read_job(self, key: str, target: Buffers) -> Job | None:
        total = total_bytes(target)
        try:
            fd = os.open(self._final_path(key), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        slot = None
        try:
            if not total or os.fstat(fd).st_size != total:
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

    def _create(self, path: str) -> int | None:
        """A new file with exactly ``file_mode``; its fan-out directory is made
        again if someone removed it. None if it cannot be created."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        for attempt in range(2):
            try:
                fd = os.open(path, flags, self._file_mode)
            except FileNotFoundError:
                if attempt:
                    return None
                try:
                    file_io.make_dir(os.path.dirname(path), self._dir_mode, self._umask)
                except OSError:
                    return None
                continue
            except OSError:
                return None
            if self._file_mode & self._umask:
                try:
                    os.fchmod(fd, self._file_mode)
                except OSError:
                    os.close(fd)
                    _unlink(path)
                    return None
            return fd
        return None

    def _write_job(self, key: str, source: Buffers) -> Job | None:
        total = total_bytes(source)
        slot = self.staging.take(total) if total else None
        if slot is None:
            return None
        temp = self._temp_path(key)
        fd = self._create(temp)
        try:
            if fd is None:
                raise OSError("cannot create the temp file")
            self.engine.register_fd(fd)
        except Exception:  # noqa: BLE001 - NIXL raises its own error types
            self.staging.give(slot)
            if fd is not None:
                os.close(fd)
                _unlink(temp)
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
        try:
            if ok:
                os.replace(temp, self._final_path(key))
                return True
        except OSError:
            pass
        _unlink(temp)
        return False




def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # clear() got there first


def _is_ours(name: str) -> bool:
    if name.startswith(".") and name.endswith(".tmp"):
        return True
    return _KEY.fullmatch(name) is not None
