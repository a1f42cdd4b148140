"""What the admin side does to the attached backend's contents, as opposed
to switching backends (admin/storage_control.py, which owns one of each and
calls them from the engine loop): empty it (clear) or fill it with what L2
held before it was attached (backfill).

Clear: at most one runs at a time, on its own thread (the scheduler half
never waits on I/O); the HTTP caller's answer comes from that thread. While
it runs, the planner it empties is ``clearing()``: a retired backend's
client is not closed under it.

Backfill: what L2 held before an attach or replace is backed up to the new
backend in the background (l3/backfill.py), at most
``BACKFILL_PAGES_PER_STEP`` pages a step and ``BACKFILL_MAX_INFLIGHT_PAGES``
(or a quarter of L2, if less) unacknowledged, within the L3 write budget, as
ordinary BACKUP ops (pinned until every rank acknowledged). One backfill at a
time: a switch starts a new one, a detach stops it, an idle-mode detach
pauses it while transfers drain. Its report stays for GET once it is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm_hicache import io_threads
from vllm_hicache.common.jobs import BackupJob
from vllm_hicache.l3.backfill import Backfill
from vllm_hicache.redaction import shown_error

if TYPE_CHECKING:
    from vllm_hicache.index import HiRadixTree
    from vllm_hicache.l3.planner import L3Planner

logger = logging.getLogger(__name__)

BACKFILL_PAGES_PER_STEP = 256
BACKFILL_MAX_INFLIGHT_PAGES = 1024

# Answers an admin command: (HTTP status, JSON body).
Reply = Callable[[int, dict[str, Any]], None]


class StorageClear:
    """Empties the attached backend, one clear at a time, off the engine thread."""

    def __init__(self) -> None:
        self._done: Future | None = None
        self._planner: L3Planner | None = None  # whose backend the clear empties

    def running(self) -> bool:
        return self._done is not None and not self._done.done()

    def clearing(self) -> L3Planner | None:
        """The planner a running clear empties (not to be closed meanwhile)."""
        return self._planner if self.running() else None

    def start(self, planner: L3Planner | None, reply: Reply) -> None:
        """Clear ``planner``'s backend; ``reply`` gets the answer (409 at once
        when nothing is attached or a clear already runs)."""
        if planner is None:
            reply(409, {"error": "no storage backend attached"})
            return
        if self.running():
            reply(409, {"error": "a clear is already running"})
            return
        done: Future = Future()
        name = planner.cfg.backend

        def run() -> None:
            try:
                planner.clear_storage()
            except Exception as err:  # noqa: BLE001 - reported in the answer
                logger.warning("HiCache L3: clearing backend %r failed: %r", name, err)
                reply(502, {"error": f"clearing {name!r} failed: {shown_error(err)}"})
            else:
                logger.info("HiCache L3: backend %r cleared", name)
                reply(200, {"backend": name, "message": "cleared"})
            finally:
                done.set_result(None)

        self._done, self._planner = done, planner
        io_threads.named_thread(run, "hicache-clear").start()


class BackfillRun:
    """The backfill of the last attach or replace, planned step by step."""

    def __init__(self) -> None:
        self._backfill: Backfill | None = None
        # An idle-mode detach drains transfers: no new backfill op meanwhile.
        self.paused = False
        self._done_report: dict[str, Any] | None = None  # the last one's, once done

    def restart(self, tree: HiRadixTree, num_pages: int) -> None:
        """A new backend serves: back up what L2 holds now, hottest first."""
        self._done_report = None
        self._backfill = Backfill(tree.hot_nodes(), BACKFILL_PAGES_PER_STEP,
                                  min(BACKFILL_MAX_INFLIGHT_PAGES, max(1, num_pages // 4)))

    def stop(self) -> None:
        """The backend detached: nothing more to back up to it."""
        self._backfill = None

    def can_plan(self, planner: L3Planner | None) -> bool:
        """Pages wait to be backed up and may be now (keeps the engine stepping)."""
        return (self._backfill is not None and planner is not None
                and not self.paused and self._backfill.can_plan(planner))

    def plan(self, tree: HiRadixTree, planner: L3Planner | None, step: int) -> list[BackupJob]:
        """This step's share of the backfill, as one BACKUP op of ``planner``."""
        backfill = self._backfill
        if backfill is None or planner is None or self.paused:
            return []
        budget = min(backfill.pages_per_step,
                     backfill.max_inflight_pages - backfill.inflight_pages(planner))
        affordable = planner.backups.budget_blocks()  # the L3 write budget: the rest waits
        if affordable is not None:
            budget = min(budget, affordable)
        ranges = backfill.next_ranges(tree, budget) if budget > 0 else []
        if not ranges:
            if backfill.done(planner):
                logger.info("HiCache L3: backup of pre-attach L2 done: %d pages in %.1f s",
                            backfill.queued_pages, time.monotonic() - backfill.started)
                self._done_report = backfill.report(planner)
                self._backfill = None
            return []
        jobs = planner.backups.plan_backup(ranges, step)
        backfill.opened(jobs[0].op_id, sum(len(r.pages) for r in ranges))
        return jobs

    def report(self, planner: L3Planner | None) -> dict[str, Any] | None:
        """GET's view: the running backfill's progress, else the last one's report."""
        if self._backfill is not None:
            return self._backfill.report(planner)
        return self._done_report
