"""Members' leases: how a survivor tells a dead member from a live one.

A member holds an exclusive ``flock`` on its own file ``members/<member id>``
for as long as it is a member. The kernel drops that lock when the last
descriptor of the open file goes away, so on any exit, SIGKILL included;
nothing is left for a survivor to guess from. ``flock`` rather than
``lockf``/``F_SETLK``: a POSIX record lock belongs to the process and is lost
when the process closes *any* descriptor of the same file, a flock belongs to
the open file description. Nothing depends on PIDs (reused, and meaningless
across PID namespaces); the member id carries the pid and its start time
only to be read by people.

Invariants:
- a lease file appears under its final name already locked (created under a
  temporary name, locked, then renamed), and disappears only after its
  member's rows are gone from the index (``leave`` or a reclaim);
- so a file whose lock can be taken, or a member whose file is missing, is
  a dead member, and probing never mistakes a live member for a dead one.

A process that forks while a member shares the open file description with
its child: the lease then lasts while either lives. That errs the safe way
(a dead parent's pages are reclaimed when the child is gone too).
"""

from __future__ import annotations

import fcntl
import os
import secrets
from dataclasses import dataclass


def process_start_ticks(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); 0 where there is
    no /proc. Parsed after the last ')' because the command name may hold
    spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[19])


def new_member_id() -> str:
    """``<pid>-<start ticks>-<random>``: unique even when pids repeat across
    PID namespaces that share the tmpfs."""
    pid = os.getpid()
    return f"{pid}-{process_start_ticks(pid)}-{secrets.token_hex(4)}"


class Lease:
    """This process's lease, held from ``acquire`` to ``release``."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, members_dir: str, member_id: str) -> Lease:
        final = os.path.join(members_dir, member_id)
        temporary = os.path.join(members_dir, f".new-{member_id}")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(temporary, final)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(temporary)
            except FileNotFoundError:
                pass
            raise
        return cls(final, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close_only(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Remove the file, then drop the lock (that order: see the module's
        invariants). Call after the member's rows are gone."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


@dataclass
class Probe:
    """What ``probe`` found. ``dead`` with ``held`` set: the prober now holds
    the dead member's lock, so no second prober reclaims it at the same time;
    ``finish`` after the reclaim removes its file and drops the lock."""

    dead: bool
    held: Lease | None = None

    def finish(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None

    def let_go(self) -> None:
        """Drop the dead member's lock without removing its file (probed, not
        reclaimed: the next sweep finds it dead again)."""
        if self.held is not None:
            self.held.close_only()
            self.held = None


def probe(members_dir: str, member_id: str) -> Probe:
    path = os.path.join(members_dir, member_id)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return Probe(dead=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return Probe(dead=False)
    return Probe(dead=True, held=Lease(path, fd))


def orphan_files(members_dir: str, member_ids: set[str]) -> list[str]:
    """Lease files of no listed member whose lock is free: left by a member
    killed between its lease and its index row, or by a reclaimer killed
    between the index and the file. Removed; returns their names."""
    removed = []
    for name in os.listdir(members_dir):
        if name.startswith(".") or name in member_ids:
            continue
        found = probe(members_dir, name)
        if found.dead:
            found.finish()
            removed.append(name)
    return removed


def remove_unfinished(members_dir: str) -> list[str]:
    """Remove the temporary files of joiners that died before renaming their
    lease. Only for a caller holding the tier's creation lock: no joiner can
    be between its temporary file and its rename then."""
    removed = [name for name in os.listdir(members_dir) if name.startswith(".new-")]
    for name in removed:
        try:
            os.unlink(os.path.join(members_dir, name))
        except FileNotFoundError:
            pass
    return removed


def live_leases(members_dir: str) -> int:
    """How many lease files under ``members_dir`` are held (by live members),
    read without the index (which may be the thing that is damaged)."""
    try:
        names = os.listdir(members_dir)
    except FileNotFoundError:
        return 0
    live = 0
    for name in names:
        if name.startswith("."):
            continue
        found = probe(members_dir, name)
        found.let_go()
        live += not found.dead
    return live
