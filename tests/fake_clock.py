"""A clock the test moves, for code that takes one (``clock=``, a
``Callable[[], float]`` of seconds)."""

from __future__ import annotations


class FakeClock:
    """Returns ``now``; the test sets or advances it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
