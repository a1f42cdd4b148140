"""How long worker I/O that makes no progress may keep an idle engine stepping.

vLLM keeps stepping an engine with no request while the connector reports
pending work (``has_pending_work``), so that backups, async loads and L3
prefetches get their acknowledgements. A store that stopped answering would
then spin the engine for ever. The rule: pending work keeps the engine
stepping while an operation finished (the live-op count changed) within the
last ``stalled_s``; after that the acknowledgements ride on the next
request's steps. The scheduler half makes the exceptions (a graceful stop's
flush time, admin commands), not this watch. No torch, no vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# An idle engine keeps stepping for pending L3/async work at most this long
# without any operation finishing.
STALLED_WORK_S = 30.0


class StallWatch:
    """Progress of the pending work, as the scheduler half sees it once a step."""

    def __init__(self, stalled_s: float = STALLED_WORK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stalled_s = stalled_s
        self._clock = clock
        self._ops_seen = 0
        self._since = clock()

    def keeps_stepping(self, pending: bool, num_live_ops: int) -> bool:
        """Whether ``pending`` work (``num_live_ops`` operations live) still
        keeps the engine stepping. Called by the scheduler half's
        ``has_pending_work`` at every step, whatever else decides, so that the
        time without progress is measured from the last change it saw."""
        now = self._clock()
        if not pending or num_live_ops != self._ops_seen:
            self._ops_seen, self._since = num_live_ops, now
        return pending and now - self._since < self.stalled_s
