"""File I/O for the ``file`` backend: key -> path, whole-object reads and
atomic writes with scatter/gather system calls, directory scans.

Every object is written to a unique temp file next to its final name and
then renamed over it, so a reader opens either the old whole object or the
new one. A reader keeps reading the inode it opened even if the name is
replaced or unlinked meanwhile, so a concurrent eviction yields either the
complete object or a miss, never a mix.

Files and directories are created with the backend's ``file_mode`` and
``dir_mode`` exactly: where the process umask would strip bits the mode asks
for, the new file or directory is chmod-ed (one more call only then).
"""

from __future__ import annotations

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
# Objects are plain files we wrote: a symlink in their place is not followed.
_O_READ = os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
# Temp names: a random per-process prefix (processes on several machines may
# share the directory, so no pid) + a counter (next() is atomic under the GIL).
_TEMP_PREFIX = os.urandom(4).hex()
_temp_ids = itertools.count()


def valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY_RE.fullmatch(key) is not None


def object_path(root: str, key: str) -> str:
    """``root/aa/bb/<key>.hckv``: two levels of 256 directories, picked by the
    key's CRC-32 (spread, not security: the key is already validated), keep
    every directory small."""
    h = zlib.crc32(key.encode())
    return f"{root}/{h >> 8 & 0xFF:02x}/{h & 0xFF:02x}/{key}{OBJECT_SUFFIX}"


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


def read_object(path: str, buffers: Sequence[np.ndarray]) -> int:
    """Fill ``buffers`` from the object at ``path``: its size if the file is
    exactly ``total_bytes(buffers)`` long and was read whole, else -1
    (missing, shorter, longer, unreadable)."""
    try:
        fd = os.open(path, _O_READ)
    except OSError:
        return -1
    try:
        expected = total_bytes(buffers)
        # One byte past the end: a longer file fills it. A regular file reads
        # short only at EOF (or on a signal, or past 2 GiB per call), so a
        # read that stops at ``expected`` found the end, and a shorter one is
        # resumed until it progresses no more: no fstat needed to check size.
        views: list[Buffer] = [*buffers, bytearray(1)]
        done = os.preadv(fd, views, 0)
        while done < expected:
            n = os.preadv(fd, _advance(_views(views), done), done)
            if n <= 0:  # truncated
                return -1
            done += n
        return expected if done == expected else -1
    finally:
        os.close(fd)


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


def make_dir(path: str, mode: int, umask: int) -> bool:
    """Create directory ``path`` with exactly ``mode``; False if it existed."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return False
    if mode & umask:
        os.chmod(path, mode)
    return True


def make_fanout_dirs(final: str, mode: int, umask: int) -> None:
    """The ``aa/bb`` directories of object path ``final`` (root must exist)."""
    leaf = os.path.dirname(final)
    make_dir(os.path.dirname(leaf), mode, umask)
    make_dir(leaf, mode, umask)


def check_owner(root: str, allow_shared_dir: bool, owner: str = "file backend") -> None:
    """ValueError if others can write ``root`` (and that is not allowed);
    ``owner`` names the backend in the message."""
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{owner} option path={root!r} is not a directory")
    problems = []
    if st.st_mode & stat.S_IWOTH:
        problems.append(f"it is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})")
    if st.st_uid != os.geteuid():
        problems.append(f"it is owned by uid {st.st_uid}, not by this process (uid "
                        f"{os.geteuid()})")
    if problems and not allow_shared_dir:
        raise ValueError(
            f"{owner}: refusing directory {root!r}: {' and '.join(problems)}, so others "
            "can replace its objects. Use a directory of your own (chmod o-w), or set "
            "allow_shared_dir: true (then set storage_secret, so objects others plant are misses)"
        )


def write_temp(final: str, buffers: Sequence[np.ndarray], fsync: bool,
               mode: int = 0o600, umask: int = 0o022) -> str:
    """Write ``buffers`` to a fresh temp file beside ``final`` with
    permissions ``mode``; its path. The directory must exist
    (FileNotFoundError otherwise)."""
    head, name = os.path.split(final)
    unique = f"{_TEMP_PREFIX}{next(_temp_ids) & 0xFFFFFFFF:08x}"
    tmp = f"{head}/.{name[: -len(OBJECT_SUFFIX)]}.{unique}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, mode)
    try:
        if mode & umask:
            os.fchmod(fd, mode)
        expected, done = total_bytes(buffers), os.writev(fd, buffers)
        while done < expected:  # short write: resume after what landed
            n = os.writev(fd, _advance(_views(buffers), done))
            if n <= 0:
                raise OSError(f"writev wrote {done} of {expected} bytes to {tmp}")
            done += n
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        discard(tmp)
        raise
    os.close(fd)
    return tmp


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class ObjectFile(NamedTuple):
    key: str
    path: str
    size: int
    mtime_ns: int


def _fanout_dirs(root: str) -> Iterator[str]:
    """The ``aa/bb`` directories under ``root`` (never following symlinks)."""
    for top in _subdirs(root):
        yield from _subdirs(top)


def _subdirs(path: str) -> Iterator[str]:
    try:
        with os.scandir(path) as it:
            entries = [e for e in it if _FANOUT_NAME.fullmatch(e.name)]
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield entry.path


def scan_objects(root: str, stale_temp_before_ns: int = 0) -> list[ObjectFile]:
    """Every object file under ``root``; temp files last modified before
    ``stale_temp_before_ns`` are removed on the way."""
    found = []
    for directory in _fanout_dirs(root):
        try:
            with os.scandir(directory) as it:
                entries = [e for e in it if e.is_file(follow_symlinks=False)]
        except OSError:
            continue
        for entry in entries:
            match = _OBJECT_NAME.fullmatch(entry.name)
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:  # removed since listed
                continue
            if match is not None:
                found.append(ObjectFile(match[1], entry.path, st.st_size, st.st_mtime_ns))
            elif _TEMP_NAME.fullmatch(entry.name) and st.st_mtime_ns < stale_temp_before_ns:
                discard(entry.path)
    return found


def remove_ours(root: str) -> int:
    """Unlink every object and temp file under ``root``; bytes of objects removed."""
    removed = 0
    for directory in _fanout_dirs(root):
        try:
            with os.scandir(directory) as it:
                names = [e for e in it if not e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for entry in names:
            is_object = _OBJECT_NAME.fullmatch(entry.name) is not None
            if not (is_object or _TEMP_NAME.fullmatch(entry.name)):
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
            except OSError:
                continue
            removed += size if is_object else 0
    return removed
