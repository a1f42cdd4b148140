"""The L3 circuit breaker: when HiCache stops using its store, and when it resumes.

States (``BreakerState``):

    closed    the store is used as configured
    tripped   the store is not used: lookups are misses, nothing is
              prefetched, backups are skipped; requests are served from L1
              and L2 and recompute the rest
    probing   not used either; a health check is running whose result
              decides whether to resume

What the breaker learns is health checks (``l3/health_check.py``: one small
object written, found and read back), one at a time, at most one starting
every ``probe_interval_s``, in every state: while closed they watch the
store, while tripped they are the probes. A check is *healthy* when it
succeeded within ``latency_budget_s``; a check still running past the
budget counts as a failed one each time that is noticed (``check_overdue``),
so a store that hangs trips the breaker as surely as one that errors.

Trip rule: while closed, failures seen over at least ``window_s`` with no
healthy check among them (the first failure since the last healthy check
is ``window_s`` older than the latest one). Resume rule: a check that
started after the trip (or was running when it tripped) finishes healthy.

Invariants (``check``): exactly one state; ``probing`` exactly when the
breaker is not closed and a check runs; a failure streak exists only while
closed; ``trips`` counts the transitions out of ``closed``.

Pure: times are seconds of a monotonic clock passed in by the caller, so
tests drive it with a fake one. Not thread-safe: its owner serialises calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class BreakerState(StrEnum):
    CLOSED = "closed"
    TRIPPED = "tripped"
    PROBING = "probing"


# The metrics gauge's value of each state (stats.METRICS, l3_breaker_state).
STATE_GAUGE = {BreakerState.CLOSED: 0, BreakerState.TRIPPED: 1, BreakerState.PROBING: 2}


@dataclass(frozen=True)
class BreakerConfig:
    window_s: float
    latency_budget_s: float
    probe_interval_s: float

    def __post_init__(self) -> None:
        if self.window_s < 0 or self.latency_budget_s <= 0 or self.probe_interval_s <= 0:
            raise ValueError(f"breaker: window_s must be >= 0, latency_budget_s and "
                             f"probe_interval_s > 0 (got {self})")


class Transition(NamedTuple):
    old: BreakerState
    new: BreakerState
    at: float       # monotonic seconds
    reason: str     # why (the last failure, for a trip)


class CircuitBreaker:
    def __init__(self, cfg: BreakerConfig, now: float) -> None:
        self.cfg = cfg
        self.state = BreakerState.CLOSED
        self.state_since = now
        self.trips = 0
        # The running check's start, or None.
        self.running_since: float | None = None
        self._last_start = now  # the first check is due one interval after start
        # Closed only: when the failures since the last healthy check began.
        self.streak_start: float | None = None
        self.last_failure = ""
        self.checks = 0
        self.failed_checks = 0

    @property
    def usable(self) -> bool:
        return self.state == BreakerState.CLOSED

    def due(self, now: float) -> bool:
        """May a check start now?"""
        return (self.running_since is None
                and now - self._last_start >= self.cfg.probe_interval_s)

    def check_started(self, now: float) -> Transition | None:
        if self.running_since is not None:
            raise RuntimeError("breaker: a health check is already running")
        self.running_since = self._last_start = now
        if self.state == BreakerState.TRIPPED:
            return self._move(BreakerState.PROBING, now, "probe started")
        return None

    def check_finished(self, ok: bool, now: float, detail: str = "") -> Transition | None:
        """The running check ended: ``ok`` if the store did what was asked
        (``detail`` says what went wrong otherwise). Healthy only if it also
        ended within the latency budget."""
        if self.running_since is None:
            raise RuntimeError("breaker: no health check is running")
        took_s = now - self.running_since
        self.running_since = None
        self.checks += 1
        healthy = ok and took_s <= self.cfg.latency_budget_s
        if not healthy:
            self.failed_checks += 1
            self.last_failure = (detail or "failed") if not ok else (
                f"took {took_s * 1e3:.0f} ms, over the budget of "
                f"{self.cfg.latency_budget_s * 1e3:.0f} ms")
        if self.state == BreakerState.PROBING:
            if healthy:
                return self._move(BreakerState.CLOSED, now, "probe healthy")
            return self._move(BreakerState.TRIPPED, now, self.last_failure)
        return self._observe(healthy, now)

    def check_overdue(self, now: float) -> Transition | None:
        """A running check past its budget is a failure each time it is noticed."""
        if self.running_since is None or now - self.running_since <= self.cfg.latency_budget_s:
            return None
        self.last_failure = (f"no answer for {(now - self.running_since) * 1e3:.0f} ms, over "
                             f"the budget of {self.cfg.latency_budget_s * 1e3:.0f} ms")
        return self._observe(False, now)

    def _observe(self, healthy: bool, now: float) -> Transition | None:
        if self.state != BreakerState.CLOSED:
            return None
        if healthy:
            self.streak_start = None
            return None
        if self.streak_start is None:
            self.streak_start = now
        if now - self.streak_start < self.cfg.window_s:
            return None
        self.trips += 1
        # A check running now is fresh evidence: its result decides.
        new = BreakerState.PROBING if self.running_since is not None else BreakerState.TRIPPED
        return self._move(new, now, self.last_failure)

    def _move(self, new: BreakerState, now: float, reason: str) -> Transition:
        old, self.state, self.state_since = self.state, new, now
        if new != BreakerState.CLOSED:
            self.streak_start = None
        return Transition(old, new, now, reason)

    def status(self, now: float) -> dict[str, object]:
        """For the admin API's GET."""
        return {
            "state": str(self.state),
            "state_for_s": round(now - self.state_since, 3),
            "trips": self.trips,
            "checks": self.checks,
            "failed_checks": self.failed_checks,
            "last_failure": self.last_failure or None,
            "window_s": self.cfg.window_s,
            "latency_budget_ms": round(self.cfg.latency_budget_s * 1e3, 3),
            "probe_interval_s": self.cfg.probe_interval_s,
        }

    def check(self) -> None:
        """Raise RuntimeError naming a broken invariant (tests)."""
        problems = []
        if self.state not in STATE_GAUGE:
            problems.append(f"unknown state {self.state!r}")
        probing = self.state == BreakerState.PROBING
        if probing != (self.state != BreakerState.CLOSED and self.running_since is not None):
            problems.append(f"state {self.state} with a check running since {self.running_since}")
        if self.streak_start is not None and self.state != BreakerState.CLOSED:
            problems.append(f"a failure streak in state {self.state}")
        if problems:
            raise RuntimeError("breaker: " + "; ".join(problems))
