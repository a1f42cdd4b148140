"""Named counters that many threads bump: what a backend's ``stats()`` reports.

Every update and every snapshot holds one lock, so a snapshot is consistent
(no counter is read half-way through an update of several).
"""

from __future__ import annotations

import threading


class Counters:
    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def bump(self, name: str, delta: int = 1) -> int:
        """Add ``delta`` to one counter; its new value."""
        with self._lock:
            self._values[name] += delta
            return self._values[name]

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {name: float(value) for name, value in self._values.items()}
