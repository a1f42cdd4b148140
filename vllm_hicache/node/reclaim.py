"""Reclaiming what dead members of a node tier held (the package
docstring's fourth invariant).

A member is dead exactly when its lease lock can be taken (lease.py).
``reclaim_dead`` removes every dead member from the index, with its pins and
reservations, in one transaction each, and then the lease files of no
member. Survivors call it from a background ``Sweeper`` (every
``sweep_interval_s``), from every reservation that comes back short, and
when they open the tier.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

from vllm_hicache.node.errors import NodeTierError
from vllm_hicache.node.index import Index
from vllm_hicache.node.lease import orphan_files, probe

logger = logging.getLogger(__name__)


def probe_and_release(members_dir: str, member: str) -> bool:
    """Whether ``member`` is dead, leaving its lease file as it was."""
    found = probe(members_dir, member)
    found.let_go()
    return found.dead


def reclaim_dead(index: Index, members_dir: str, me: str | None) -> list[str]:
    """Remove every dead member from ``index`` (its pins and reservations
    with it), then the lease files of no member; returns the removed ids."""
    gone: list[str] = []
    rows = index.members()
    for row in rows:
        if row.member == me:
            continue
        found = probe(members_dir, row.member)
        if not found.dead:
            continue
        try:
            freed = index.remove_member(row.member)
        finally:
            found.finish()
        gone.append(row.member)
        logger.info("HiCache node tier: reclaimed dead member %s (%d reservations, %d pins)",
                    row.member, freed.reservations, freed.pins)
    orphan_files(members_dir, {row.member for row in rows})
    return gone


class Sweeper:
    """A daemon thread reclaiming dead members every ``interval_s``, on a
    connection of its own (a sweep never waits for the member's threads)."""

    def __init__(self, name: str, index_path: str, members_dir: str, member_id: str,
                 lock_timeout_s: float, interval_s: float) -> None:
        self._name = name
        self._index_path = index_path
        self._members_dir = members_dir
        self._member_id = member_id
        self._lock_timeout_s = lock_timeout_s
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"hicache-node-sweep-{name}",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop sweeping; waits for a sweep in progress (unless called from it)."""
        self._stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _loop(self) -> None:
        index: Index | None = None
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    index = index or Index(self._index_path, self._lock_timeout_s)
                    reclaim_dead(index, self._members_dir, self._member_id)
                except (NodeTierError, OSError, sqlite3.Error) as e:
                    # A busy or vanished index must not end the sweeps for good.
                    logger.warning("HiCache node tier %r: sweep failed (%s); retrying in "
                                   "%.1f s", self._name, e, self._interval_s)
        finally:
            if index is not None:
                index.close()
