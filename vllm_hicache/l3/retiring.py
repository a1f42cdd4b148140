"""The scheduler half's side of a replaced or detached backend, until its
last op ends (admin/storage_control.py drives it).

At the switch the old planner stops its lookups (no request waits on it any
more: they load what L2 holds and recompute the rest) and plans no new
prefetch; its open prefetches end as the workers report them (cancelled on
the workers, what arrived is indexed), its open backups as every rank
acknowledges them. Its deferred backlog (unpinned blocks not yet sent)
follows ``pending_backups``: ``finish`` sends what of it L2 still holds to
the old backend as one last backup op, in the switching step itself (so no
job of the old generation is made after that step: a rank may close the old
client as soon as its jobs end); ``drop`` drops and counts it; ``move``
hands it to the new planner. ``RETIRE_DRAIN_S`` bounds, on each rank, how
long the old backend may take to write what it was given (then the queued
rest is dropped) and, here, how long the old backend keeps an idle engine
stepping.

Reports are fed to it as to the serving planner: op ids are unique over
generations (l3/planner.py), so it acts only on its own. Its backend client
closes once nothing of it is open.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm_hicache.common.jobs import BackupJob
from vllm_hicache.policy.storage_switch import PendingBackups

if TYPE_CHECKING:
    from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
    from vllm_hicache.l3.planner import L3Planner

# How long a replaced or detached backend may take to write what it still
# has to (pending_backups=finish) before the queued rest is dropped.
RETIRE_DRAIN_S = 10.0


class RetiringPlanner:
    """A planner no request uses any more, finishing its ops."""

    def __init__(self, planner: L3Planner, mode: PendingBackups,
                 successor: L3Planner | None, drain_s: float) -> None:
        self.planner = planner
        self.mode = mode
        self.started = time.monotonic()
        self.deadline = self.started + drain_s
        planner.stop_lookups()
        backlog = planner.backups.backlog
        # What was pending at the switch (the answer's counts).
        self.at_switch = {
            "backup_pages_sent": planner.backups.open_backup_pages(),
            "backup_blocks_deferred": backlog.num_blocks,
            "prefetches_stopped": planner.in_flight()["prefetches"],
        }
        self.dropped_blocks = 0
        self.moved_blocks = 0
        self._flushed = False
        self.flushed_blocks = 0
        # Pages of its open backups some rank did not write (dropped, or failed).
        self.unwritten_pages = 0
        if mode == PendingBackups.MOVE and successor is not None:
            for entry in backlog.take(backlog.num_blocks):
                self.moved_blocks += len(entry.blocks)
                self.dropped_blocks += successor.backups.backlog.defer(entry.chain, entry.blocks)
            self.moved_blocks -= self.dropped_blocks
        elif mode != PendingBackups.FINISH:  # drop (or move with nowhere to go)
            self.dropped_blocks += backlog.clear()

    @property
    def generation(self) -> int:
        return self.planner.generation

    def plan(self, step: int) -> list[BackupJob]:
        """``finish``: the deferred backlog, as one last op to the old
        backend, in the switching step (the first call); nothing after."""
        if self._flushed:
            return []
        self._flushed = True
        planner = self.planner
        evicted = planner.backups.backup_evicted
        jobs = planner.backups.flush_backlog(step)
        self.flushed_blocks = sum(len(job.pages) for job in jobs)
        self.dropped_blocks += planner.backups.backup_evicted - evicted  # left L2 meanwhile
        return jobs

    def on_worker_meta(self, meta: HiCacheWorkerMetadata) -> None:
        for op_id, hashes in meta.backup_failures.items():
            if self.planner.backups.is_backup_open(op_id):  # reported no later than its ack
                self.unwritten_pages += len(hashes)
        self.planner.on_worker_meta(meta)

    def done(self) -> bool:
        return self.planner.is_idle() and not len(self.planner.backups.backlog)

    def report(self) -> dict[str, Any]:
        planner = self.planner
        return {
            "backend": planner.cfg.backend, "generation": planner.generation,
            "pending_backups": str(self.mode), **self.at_switch,
            "backup_pages_open": planner.backups.open_backup_pages(),
            "backup_pages_unwritten": self.unwritten_pages,
            "backup_blocks_flushed": self.flushed_blocks,
            "backup_blocks_moved": self.moved_blocks,
            "backup_blocks_dropped": self.dropped_blocks,
            "prefetches_open": planner.in_flight()["prefetches"],
            "seconds": round(time.monotonic() - self.started, 3),
        }
