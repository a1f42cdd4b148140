"""Rate-limited logging: a recurring failure is logged at most once per interval.

The first occurrence always passes (so it is seen at once, with its
traceback where the caller adds one); the rest within ``interval_s`` are
only counted by the caller (stats), never logged one by one from a hot path.
"""

from __future__ import annotations

import threading
import time

DEFAULT_INTERVAL_S = 60.0


class LogThrottle:
    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._next = -float("inf")

    def ready(self) -> bool:
        """True at most once per ``interval_s``: log now."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                return False
            self._next = now + self.interval_s
            return True
