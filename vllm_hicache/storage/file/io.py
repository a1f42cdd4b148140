"""File I/O for the ``file`` backend: key -> location, whole-object reads and
atomic writes with scatter/gather system calls, directory scans.

Every function works relative to an open directory (store_dir.py) and opens
files with ``O_NOFOLLOW``: a symlink at an object's name is a miss, never
followed. Reads open with ``O_NONBLOCK`` and ``fstat`` before reading, so a
FIFO or device planted at an object's name is a miss too, never a hang.

Every object is written to a unique temp file next to its final name and
then renamed over it, so a reader opens either the old whole object or the
new one. A reader keeps reading the inode it opened even if the name is
replaced or unlinked meanwhile, so a concurrent eviction yields either the
complete object or a miss, never a mix.

Files are created with the backend's ``file_mode`` exactly: where the
process umask would strip bits the mode asks for, the new file is chmod-ed
(one more call only then).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import stat
import zlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
from typing_extensions import Buffer

from vllm_hicache.storage.buffers import total_bytes
from vllm_hicache.storage.file.store_dir import StoreDir

# Keys are the project's object keys ([a-z0-9-], ~120 chars); '_' is allowed
# for user backends' keys. No '/', '.', or uppercase, so a key can name
# neither another directory nor a temp file, nor collide on case-insensitive
# file systems. 200 + suffixes stays under the 255-byte NAME_MAX.
KEY_RE = re.compile(r"[a-z0-9_-]{1,200}")
OBJECT_SUFFIX = ".hckv"
_OBJECT_NAME = re.compile(r"([a-z0-9_-]{1,200})\.hckv")
_TEMP_NAME = re.compile(r"\.[a-z0-9_-]{1,200}\.[0-9a-f]{16}\.tmp")
_FANOUT_NAME = re.compile(r"[0-9a-f]{2}")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO for reading would wait for a writer.
O_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | _O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
# Temp names: a random per-process prefix (processes on several machines may
# share the directory, so no pid) + a counter (next() is atomic under the GIL).
_TEMP_PREFIX = os.urandom(4).hex()
_temp_ids = itertools.count()


def valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY_RE.fullmatch(key) is not None


def object_location(key: str) -> tuple[tuple[str, str], str]:
    """``(("aa", "bb"), "<key>.hckv")``: two levels of 256 directories, picked
    by the key's CRC-32 (spread, not security: the key is already validated),
    keep every directory small."""
    h = zlib.crc32(key.encode())
    return (f"{h >> 8 & 0xFF:02x}", f"{h & 0xFF:02x}"), f"{key}{OBJECT_SUFFIX}"


def object_path(root: str, key: str) -> str:
    """``root/aa/bb/<key>.hckv``, for messages and tests (I/O goes by location)."""
    (top, leaf), name = object_location(key)
    return f"{root}/{top}/{leaf}/{name}"


def _views(buffers: Sequence[Buffer]) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in buffers]


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """The part of ``views`` left after the first ``done`` bytes."""
    while views and done >= len(views[0]):
        done -= len(views[0])
        views = views[1:]
    if views and done:
        views = [views[0][done:], *views[1:]]
    return views


def regular(fd: int) -> tuple[int, int] | None:
    """``(fd, size)`` if ``fd`` (opened with ``O_READ``) is a regular file, now
    in blocking mode; else None, and ``fd`` is closed."""
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            # Regular files ignore O_NONBLOCK today; open(2) warns that may
            # change, and NIXL's async engines must never see EAGAIN.
            fcntl.fcntl(fd, fcntl.F_SETFL, 0)
            return fd, st.st_size
    except OSError:
        pass
    os.close(fd)
    return None


def read_whole(fd: int, size: int, buffers: Sequence[np.ndarray]) -> int:
    """Fill ``buffers`` from regular file ``fd`` of ``size`` bytes (``regular``):
    its size if exactly ``total_bytes(buffers)`` long and read whole, else -1."""
    expected = total_bytes(buffers)
    if size != expected:
        return -1
    # One byte past the end: a file that grew since the fstat fills it.
    # A regular file reads short only at EOF (or on a signal, or past
    # 2 GiB per call), so a shorter read is resumed until it progresses
    # no more.
    views: list[Buffer] = [*buffers, bytearray(1)]
    done = os.preadv(fd, views, 0)
    while done < expected:
        n = os.preadv(fd, _advance(_views(views), done), done)
        if n <= 0:  # truncated
            return -1
        done += n
    return expected if done == expected else -1


def read_range(fd: int, offset: int, buffer: np.ndarray | memoryview) -> bool:
    """Fill ``buffer`` from regular file ``fd`` at ``offset``; False if the
    file ends first (resumed as ``read_whole`` is)."""
    expected = buffer.nbytes
    done = 0
    while done < expected:
        n = os.preadv(fd, [memoryview(buffer).cast("B")[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


def read_ranges(fd: int, offset: int, buffers: Sequence[np.ndarray]) -> bool:
    """Fill ``buffers``, in order, from regular file ``fd`` at ``offset``, in
    one ``preadv`` where the file gives all at once; False if it ends first."""
    views = [memoryview(b).cast("B") for b in buffers]
    got = os.preadv(fd, views, offset)
    if got < 0:
        return False
    for view in views:  # a short read: the rest piece by piece
        if got < view.nbytes and not read_range(fd, offset + got, view[got:]):
            return False
        got = max(0, got - view.nbytes)
        offset += view.nbytes
    return True


def regular_size(dir_fd: int, name: str) -> int | None:
    """Size of ``name`` in ``dir_fd`` if it is a regular file (a symlink is not
    followed), else None."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def process_umask() -> int:
    """The process umask, read without changing it where Linux allows."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # elsewhere: set and restore (at start-up only)
    os.umask(mask)
    return mask


def create_file(dir_fd: int, name: str, mode: int, umask: int) -> int:
    """A new file ``name`` in ``dir_fd`` with exactly ``mode``, open for
    writing (FileExistsError if the name is taken, by anything)."""
    fd = os.open(name, _O_CREATE, mode, dir_fd=dir_fd)
    if mode & umask:
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            discard(dir_fd, name)
            raise
    return fd


def write_temp(dir_fd: int, final: str, buffers: Sequence[np.ndarray], fsync: bool,
               mode: int = 0o600, umask: int = 0o022, expected: int | None = None) -> str:
    """Write ``buffers`` (``expected`` bytes, if the caller knows) to a fresh
    temp file beside object file ``final`` in ``dir_fd`` with permissions
    ``mode``; the temp file's name."""
    unique = f"{_TEMP_PREFIX}{next(_temp_ids) & 0xFFFFFFFF:08x}"
    tmp = f".{final[: -len(OBJECT_SUFFIX)]}.{unique}.tmp"
    fd = create_file(dir_fd, tmp, mode, umask)
    try:
        if expected is None:
            expected = total_bytes(buffers)
        done = os.writev(fd, buffers)
        while done < expected:  # short write: resume after what landed
            n = os.writev(fd, _advance(_views(buffers), done))
            if n <= 0:
                raise OSError(f"writev wrote {done} of {expected} bytes to {tmp}")
            done += n
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        discard(dir_fd, tmp)
        raise
    os.close(fd)
    return tmp


def discard(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


class ObjectFile(NamedTuple):
    key: str
    size: int
    mtime_ns: int


def _fanout_names(dir_fd: int) -> list[str]:
    """Names of the fan-out directories in ``dir_fd`` (symlinks left out)."""
    try:
        with os.scandir(dir_fd) as it:
            return [e.name for e in it
                    if _FANOUT_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _leaf_dirs(store: StoreDir) -> Iterator[int]:
    """An open descriptor of each ``aa/bb`` directory (closed after the
    consumer's step); one swapped for a symlink meanwhile is skipped."""
    try:
        with store.directory(()) as root:
            tops = _fanout_names(root)
    except OSError:
        return
    for top in tops:
        try:
            with store.directory((top,)) as top_fd:
                leaves = _fanout_names(top_fd)
        except OSError:
            continue
        for leaf in leaves:
            try:
                fd = store.open_dir((top, leaf))
            except OSError:
                continue
            try:
                yield fd
            finally:
                os.close(fd)


def _entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of everything but directories in ``dir_fd``."""
    found: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(dir_fd) as it:
            entries = list(it)
    except OSError:
        return found
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:  # removed since listed
            continue
        if not stat.S_ISDIR(st.st_mode):
            found.append((entry.name, st))
    return found


def scan_objects(store: StoreDir, stale_temp_before_ns: int = 0) -> list[ObjectFile]:
    """Every object file in the store; temp files last modified before
    ``stale_temp_before_ns`` are removed on the way."""
    found = []
    for leaf in _leaf_dirs(store):
        for name, st in _entries(leaf):
            if not stat.S_ISREG(st.st_mode):
                continue
            match = _OBJECT_NAME.fullmatch(name)
            if match is not None:
                found.append(ObjectFile(match[1], st.st_size, st.st_mtime_ns))
            elif _TEMP_NAME.fullmatch(name) and st.st_mtime_ns < stale_temp_before_ns:
                discard(leaf, name)
    return found


def remove_ours(store: StoreDir) -> int:
    """Unlink everything named like an object or temp file in the store (a
    planted symlink or FIFO too: unlinking follows nothing); bytes of
    objects removed."""
    removed = 0
    for leaf in _leaf_dirs(store):
        for name, st in _entries(leaf):
            is_object = _OBJECT_NAME.fullmatch(name) is not None
            if not (is_object or _TEMP_NAME.fullmatch(name)):
                continue
            try:
                os.unlink(name, dir_fd=leaf)
            except OSError:
                continue
            removed += st.st_size if is_object and stat.S_ISREG(st.st_mode) else 0
    return removed
