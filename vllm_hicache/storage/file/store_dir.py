"""The store's root directory, held open: its path is resolved once, at start.

``StoreDir.open`` opens the root with ``O_DIRECTORY | O_NOFOLLOW`` and checks
who can write it on that descriptor (access.py). Every later operation names
files relative to the descriptor, reaching subdirectories one component at a
time with ``O_DIRECTORY | O_NOFOLLOW``, and files are opened with
``O_NOFOLLOW`` by their callers. Hence:

- re-pointing the configured path after start (a symlink swapped, a parent
  renamed) changes nothing: objects keep going to the directory checked;
- a symlink planted anywhere below the root is never followed: the operation
  fails (a miss, a failed put), nothing is read or written elsewhere.

A configured path that is itself a symlink is resolved once at start, and
only if this user owns the link (or ``allow_shared_dir``): whoever owns the
link chooses the directory. The directory it names is checked like any other.

Files are reached in one ``openat2`` call where the kernel has it
(beneath.py: the same guarantees, one system call instead of one per path
component); elsewhere by the walk.

The first-level directories of deeper paths (the file backend's ``aa`` of
``aa/bb``) are opened once, by the same walk, and held: a write then opens
only its leaf below the held descriptor, one ``openat`` and ``close`` fewer
per object. A held one found removed (no links left, or a stale NFS handle)
is reopened from the root; one renamed within the root keeps receiving what
is written below it until close (only whoever can write the root can rename
it).

The root descriptor, and the held ones, outlive ``close`` while an operation
is still using them (a thread stuck on a hung mount): closing one under that
thread could hand its number to another file, which the thread's next
``openat`` would then use. For the same reason a held descriptor replaced
after its directory was removed is closed only once no operation is in
flight.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from vllm_hicache.storage.file import beneath
from vllm_hicache.storage.file.access import check_store_dir

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC


class StoreDir:
    def __init__(self, fd: int, path: str) -> None:
        """Take ownership of ``fd``, the open root (``path`` is for messages)."""
        self.path = path
        self._fd = fd
        self._users = 0
        self._closed = False
        self._lock = threading.Lock()
        # First-level directories held open (name -> descriptor), and those
        # replaced because their directory was removed (closed when no
        # operation is in flight, as only one in flight can still use them).
        self._held: dict[str, int] = {}
        self._retired: list[int] = []
        # Probed once: whether open_file resolves a path in one call.
        self.resolves_beneath = beneath.available(fd)

    @classmethod
    def open(cls, path: str, *, dir_mode: int, umask: int, allow_shared_dir: bool,
             owner: str) -> StoreDir:
        """Create ``path`` if missing (``dir_mode`` exactly), open and check it;
        ValueError if others can write it, OSError if it cannot be used."""
        parent = os.path.dirname(path)
        if parent != path:
            os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, dir_mode)
            created = True
        except FileExistsError:
            created = False
        fd, resolved = _open_root(path, allow_shared_dir, owner)
        try:
            if created and dir_mode & umask:
                os.fchmod(fd, dir_mode)
            check_store_dir(fd, resolved, allow_shared_dir, owner)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, resolved)

    def open_dir(self, names: Sequence[str], mode: int | None = None, umask: int = 0) -> int:
        """A new descriptor (the caller closes it) of directory ``root/names[0]/...``,
        no component a symlink (OSError: ELOOP). Missing components are created
        with exactly ``mode`` if given, else FileNotFoundError."""
        root = self._enter()  # every write's path: no context manager
        try:
            if len(names) < 2:
                return _walk(root, names, mode, umask)
            top = self._held_dir(root, names[0], mode, umask)
            try:
                return _walk(top, names[1:], mode, umask)
            except OSError as err:
                if not _removed(top, err):  # a plain miss, or a symlink refused
                    raise
            # Removed behind our back: hold it anew, as made or found now.
            top = self._held_dir(root, names[0], mode, umask, stale=top)
            return _walk(top, names[1:], mode, umask)
        finally:
            self._leave()

    def _held_dir(self, root: int, name: str, mode: int | None, umask: int,
                  stale: int | None = None) -> int:
        """The held descriptor of first-level directory ``name``, opened by the
        walk on first use (or when ``stale``, the one held, was removed)."""
        fd = self._held.get(name)
        if fd is not None and fd != stale:
            return fd
        fresh = _open_subdir(root, name, mode, umask)
        with self._lock:
            held = self._held.get(name)
            if held is not None and held != stale:  # another thread was first
                loser, fd = fresh, held
            else:
                loser, fd = None, fresh
                self._held[name] = fresh
                if held is not None:
                    self._retired.append(held)
        if loser is not None:
            os.close(loser)
        return fd

    def open_file(self, names: Sequence[str], name: str, flags: int) -> int:
        """A descriptor of file ``root/names[0]/.../name`` opened with ``flags``
        (which should hold ``O_NOFOLLOW``), no component a symlink (OSError)."""
        if self.resolves_beneath:  # the hot path: no context managers
            root = self._enter()
            try:
                return beneath.open_beneath(root, "/".join((*names, name)), flags)
            finally:
                self._leave()
        with self.directory(names) as leaf:
            return os.open(name, flags, dir_fd=leaf)

    @contextmanager
    def directory(self, names: Sequence[str], mode: int | None = None,
                  umask: int = 0) -> Iterator[int]:
        """``open_dir`` for a ``with`` block, closed after it."""
        fd = self.open_dir(names, mode, umask)
        try:
            yield fd
        finally:
            os.close(fd)

    def close(self) -> None:
        """No new operation starts; the descriptor closes when the last one ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = not self._users
        if idle:
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._fd, *self._held.values(), *self._retired):
            os.close(fd)
        self._held.clear()
        self._retired.clear()

    def _enter(self) -> int:
        """The root descriptor, kept open until the matching ``_leave``."""
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, f"store directory {self.path!r} is closed")
            self._users += 1
            return self._fd

    def _leave(self) -> None:
        retired: list[int] = []
        with self._lock:
            self._users -= 1
            last = self._closed and not self._users
            if not self._users and not last:
                retired, self._retired = self._retired, []
        if last:
            self._close_fds()
        for fd in retired:
            os.close(fd)


def _open_root(path: str, allow_shared_dir: bool, owner: str) -> tuple[int, str]:
    """The root open without following a final symlink (a link we own is
    resolved once); (descriptor, path of what was opened)."""
    try:
        return os.open(path, DIR_FLAGS), path
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR) or not os.path.islink(path):
            raise
    link = os.lstat(path)
    target = os.path.realpath(path)
    if link.st_uid != os.geteuid() and not allow_shared_dir:
        raise ValueError(
            f"{owner}: refusing path {path!r}: it is a symlink owned by uid {link.st_uid}, "
            f"who can re-point it; configure the directory it names ({target!r}) instead, "
            "or set allow_shared_dir: true")
    return os.open(target, DIR_FLAGS), target


def _removed(fd: int, err: OSError) -> bool:
    """Was directory ``fd`` removed, by ``err`` from an operation below it? A
    removed directory has no links left; on NFS its handle goes stale."""
    if err.errno == errno.ESTALE:
        return True
    if not isinstance(err, FileNotFoundError):
        return False
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError as stat_err:
        return stat_err.errno == errno.ESTALE


def _walk(start: int, names: Sequence[str], mode: int | None, umask: int) -> int:
    """A new descriptor of ``start/names[0]/...``, one component at a time
    (``start`` itself duplicated when ``names`` is empty)."""
    fd = start
    try:
        for name in names:
            sub = _open_subdir(fd, name, mode, umask)
            if fd != start:
                os.close(fd)
            fd = sub
    except BaseException:
        if fd != start:
            os.close(fd)
        raise
    return fd if fd != start else os.dup(start)


def _open_subdir(dir_fd: int, name: str, mode: int | None, umask: int) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if mode is None:
            raise
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
        created = True
    except FileExistsError:  # another thread or process made it meanwhile
        created = False
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    if created and mode & umask:  # the umask stripped bits ``mode`` asks for
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
    return fd
