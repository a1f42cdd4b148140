"""Which of the package's ticking threads are still running (the root
conftest fails a module that leaves one behind)."""

from __future__ import annotations

import threading
import time

# Threads that wake on a timer and act on a store or a tier: one that outlives
# its module keeps probing stores while later tests time theirs (a CI run once
# lost a flush to 33 of them). Module-scoped engines keep theirs until the
# module ends, so the check runs after every module's own teardown.
TICKING_THREADS = ("hicache-l3-health", "hicache-node-sweep")
TICKING_GRACE_S = 5.0


def ticking_threads_outliving(before: set[threading.Thread],
                              grace_s: float = TICKING_GRACE_S) -> list[str]:
    """Names of the ticking threads started since ``before`` that are still
    running ``grace_s`` from now (a stopped one may take a tick to end)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [t.name for t in threading.enumerate()
                if t not in before and t.is_alive() and t.name.startswith(TICKING_THREADS)]
        if not left or time.monotonic() >= deadline:
            return sorted(left)
        time.sleep(0.05)
