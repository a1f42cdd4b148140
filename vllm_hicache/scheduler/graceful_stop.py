"""A graceful stop of the engine: write out what only L2 holds, within vLLM's budget.

On SIGTERM/SIGINT ``vllm serve`` keeps EngineCore stepping while it has
work (the connector's ``has_pending_push_work`` included) and kills it
``--shutdown-timeout`` seconds later. vLLM tells the connector nothing, so
``GracefulStop`` polls vLLM's own stop flag (``vllm_compat.engine_stop_flag``)
every step and from ``has_pending_work``; from the first poll that sees it:

- for ``budget.flush_s`` seconds (policy/stop_budget.py) the engine keeps
  stepping while backups are open or L2 holds pages L3 lacks; the room under
  the in-flight bound goes to ``pick_l2_only``, most valuable first; under
  write-back, the first step also copies what only L1 holds to L2 (the
  watcher's tracked blocks, shallow ones first), from where it is backed up
  like any store; and the workers' backups leave the background
  (``HiCacheMetadata.stop_flush``): they are what the engine waits for now;
- when that time is up, what is still L2-only is dropped and counted, and
  the engine is no longer kept stepping (vLLM's teardown follows: the
  workers finish the writes still open within ``budget.drain_s``);
- ``final_line`` is what the scheduler half logs at shutdown, its last line:
  what was written during the stop, what did not fit.

The invariant: once the flush time is up, ``keeps_engine_busy`` is False
whatever is pending, so the stop never runs into vLLM's kill because of us.
Nor do pages only L2 holds keep it stepping while the L3 circuit breaker is
not closed: nothing would write them (the planner skips backups then), and
waiting for the flush time to run out would only eat vLLM's teardown time.

What L2 alone holds, and in what order it goes out, is decided in one place,
``l2_only_blocks`` and ``pick_l2_only``: today the deferred backlog
(policy/offload.py; every page stored to L2, under write-through and
write-back alike, is backed up as it is stored, so the backlog is all that
L2 holds alone), ordered by its value (uses since deferred, then prefix
depth, then recency). A mode that keeps pages only in L2 on purpose (an
exclusive L3) adds its pages there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_hicache.common.page_ops import PinnedRange
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.planner import L3Planner, PickL2Only
from vllm_hicache.policy.stop_budget import StopBudget

logger = logging.getLogger(__name__)


def l2_only_blocks(planner: L3Planner) -> int:
    """Blocks whose pages only L2 holds and a stop should write to L3: the
    deferred backlog, or in exclusive mode the held blocks (the planner
    releases those itself when given a pick)."""
    if planner.backups.victims is not None:
        return len(planner.backups.victims)
    return planner.backups.backlog.num_blocks


def pick_l2_only(planner: L3Planner, tree: HiRadixTree, room: int) -> list[PinnedRange]:
    """Up to ``room`` of the ``l2_only_blocks`` to back up next, most valuable first."""
    return planner.backups.take_backlog(tree, room)


@dataclass
class _Stop:
    started_s: float
    written_before: int = 0  # planner.backups.written_blocks when the stop was seen
    queued: int = 0          # blocks open or L2-only when the stop was seen
    dropped: int = 0         # L2-only blocks dropped when the flush time ran out
    from_l1: int = 0         # write-back: blocks only L1 held, copied to L2 for L3
    stepped: bool = False    # a step was planned since the stop was seen
    open_at_deadline: int = 0
    expired: bool = False
    breaker_skipped_before: int = 0  # planner.backups.breaker_skipped_blocks when the stop was seen


class GracefulStop:
    def __init__(self, budget: StopBudget, stop_requested: Callable[[], bool] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``stop_requested``: vLLM's stop flag; None where there is none
        (an in-process engine): then nothing here ever starts."""
        self.budget = budget
        self._stop_requested = stop_requested
        self._clock = clock
        self._stop: _Stop | None = None

    @property
    def stopping(self) -> bool:
        return self._stop is not None

    @property
    def flushing(self) -> bool:
        """A stop was seen and its flush time is not up: the flush's own
        deadline bounds the wait (the idle engine's stall rule does not)."""
        return self._stop is not None and not self._stop.expired

    def poll(self, planner: L3Planner | None) -> None:
        """Notice a stop; once its flush time is up, drop what is still L2-only."""
        if self._stop is None:
            if self._stop_requested is None or not self._stop_requested():
                return
            self._stop = _Stop(self._clock()) if planner is None else _Stop(
                self._clock(), planner.backups.written_blocks,
                planner.backups.open_backup_blocks() + l2_only_blocks(planner),
                breaker_skipped_before=planner.backups.breaker_skipped_blocks)
            if self.budget.graceful:
                logger.info("HiCache: stop requested: writing %d queued blocks to L3 within "
                            "%.1f s (vLLM's --shutdown-timeout %g s)", self._stop.queued,
                            self.budget.flush_s, self.budget.shutdown_timeout_s)
            else:
                logger.warning("HiCache: stop requested with vLLM's --shutdown-timeout 0: %d "
                               "blocks queued for L3 are lost", self._stop.queued)
        stop = self._stop
        if not stop.expired and self._clock() - stop.started_s >= self.budget.flush_s:
            stop.expired = True
            if planner is not None:
                stop.dropped = planner.backups.drop_backlog()
                stop.open_at_deadline = planner.backups.open_backup_blocks()

    def pick(self, planner: L3Planner | None) -> PickL2Only | None:
        """What the planner's room goes to during the flush time (None: its default)."""
        if planner is None or self._stop is None or self._stop.expired:
            return None
        return lambda tree, room: pick_l2_only(planner, tree, room)

    def first_step(self) -> bool:
        """True once: at the first step planned in the flush time (where
        write-back hands over what only L1 holds)."""
        stop = self._stop
        if stop is None or stop.expired or stop.stepped:
            return False
        stop.stepped = True
        return True

    def count_from_l1(self, num_blocks: int) -> None:
        """Write-back: blocks only L1 held, now on their way to L2 and L3."""
        if self._stop is not None:
            self._stop.from_l1 += num_blocks

    def has_l2_only(self, planner: L3Planner | None) -> bool:
        """During the flush time, with the store in use: does L2 still hold
        pages to write out, or has no step run yet (the first one hands over
        what only L1 holds)?"""
        stop = self._stop
        return (stop is not None and not stop.expired and planner is not None
                and planner.usable
                and (not stop.stepped or l2_only_blocks(planner) > 0))

    def keeps_engine_busy(self, pending: bool) -> bool:
        """Should the engine keep stepping for ``pending`` work? Never once
        the flush time is up (see module doc)."""
        return pending and not (self._stop is not None and self._stop.expired)

    def final_line(self, planner: L3Planner | None) -> str | None:
        """The last line of a stop (None if no stop was seen)."""
        stop = self._stop
        if stop is None:
            return None
        written = ((planner.backups.written_blocks if planner is not None else 0)
                   - stop.written_before)
        elapsed_s = self._clock() - stop.started_s
        if not stop.expired and planner is not None:
            # vLLM ended the stop before the flush time was up: nothing was
            # dropped here, but what is left is lost all the same.
            stop.dropped = l2_only_blocks(planner)
            stop.open_at_deadline = planner.backups.open_backup_blocks()
        skipped = (planner.backups.breaker_skipped_blocks - stop.breaker_skipped_before
                   if planner is not None else 0)
        breaker = (f"; {skipped} blocks not written because the L3 circuit breaker was not "
                   f"closed" if skipped else "")
        return (f"HiCache: stop after {elapsed_s:.1f} s (vLLM's --shutdown-timeout "
                f"{self.budget.shutdown_timeout_s:g} s): {written} blocks written to L3 "
                f"({stop.queued} were queued at the signal, {stop.from_l1} more only L1 held); "
                f"did not fit: {stop.dropped} blocks "
                f"dropped (only L2 held them), {stop.open_at_deadline} blocks still being "
                f"written when the flush time ended (the workers' drain, "
                f"{self.budget.drain_s:.1f} s, finishes what it can){breaker}")
