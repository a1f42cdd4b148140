"""The L3 circuit breaker's state machine (l3/breaker.py), on a fake clock."""

from __future__ import annotations

import random

import pytest

from vllm_hicache.l3.breaker import BreakerConfig, BreakerState, CircuitBreaker

CFG = BreakerConfig(window_s=5.0, latency_budget_s=0.5, probe_interval_s=1.0)
CLOSED, TRIPPED, PROBING = BreakerState.CLOSED, BreakerState.TRIPPED, BreakerState.PROBING


def run_check(b: CircuitBreaker, now: float, ok: bool, took_s: float = 0.01):
    assert b.due(now)
    first = b.check_started(now)
    return first, b.check_finished(ok, now + took_s, "" if ok else "write refused")


def test_trips_after_failures_span_the_window_and_resumes_on_a_healthy_probe():
    b = CircuitBreaker(CFG, now=0.0)
    assert b.usable and not b.due(0.5) and b.due(1.0)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        assert run_check(b, t, ok=False) == (None, None)
        assert b.state == CLOSED
    _, moved = run_check(b, 6.0, ok=False)  # 5 s after the first failure
    assert moved is not None and (moved.old, moved.new) == (CLOSED, TRIPPED)
    assert moved.reason == "write refused" and b.trips == 1 and not b.usable
    started = b.check_started(7.0)  # the probe
    assert started is not None and started.new == PROBING and not b.usable
    assert b.check_finished(False, 7.1, "write refused").new == TRIPPED
    b.check_started(8.0)
    assert b.check_finished(True, 8.1).new == CLOSED
    assert b.usable and b.trips == 1 and b.streak_start is None
    b.check()


def test_a_healthy_check_resets_the_streak():
    b = CircuitBreaker(CFG, now=0.0)
    for t in range(1, 5):
        run_check(b, float(t), ok=False)
    run_check(b, 5.0, ok=True)
    for t in range(6, 11):
        assert run_check(b, float(t), ok=False) == (None, None)
    assert b.state == CLOSED  # 4 s of failures since the healthy one: not yet
    assert run_check(b, 11.0, ok=False)[1].new == TRIPPED


def test_a_slow_check_is_a_failure_and_a_hung_one_trips_while_it_runs():
    b = CircuitBreaker(CFG, now=0.0)
    assert run_check(b, 1.0, ok=True, took_s=0.6) == (None, None)  # over the 0.5 s budget
    assert b.failed_checks == 1 and "budget" in b.last_failure
    b.check_started(2.0)  # hangs
    assert b.check_overdue(2.4) is None and b.streak_start == 1.6  # from the slow one
    moved = b.check_overdue(6.6)
    assert moved is not None and (moved.old, moved.new) == (CLOSED, PROBING)
    assert "no answer" in moved.reason and not b.due(7.0)  # one check at a time
    b.check()
    assert b.check_finished(True, 8.0).new == TRIPPED  # 6 s: far over the budget
    b.check_started(9.0)
    assert b.check_finished(True, 9.1).new == CLOSED


def test_window_zero_trips_on_the_first_failure():
    b = CircuitBreaker(BreakerConfig(0.0, 0.5, 1.0), now=0.0)
    assert run_check(b, 1.0, ok=False)[1].new == TRIPPED


def test_misuse_is_refused():
    b = CircuitBreaker(CFG, now=0.0)
    with pytest.raises(RuntimeError, match="no health check is running"):
        b.check_finished(True, 1.0)
    b.check_started(1.0)
    with pytest.raises(RuntimeError, match="already running"):
        b.check_started(1.5)
    with pytest.raises(ValueError, match="latency_budget_s"):
        BreakerConfig(1.0, 0.0, 1.0)


@pytest.mark.parametrize("seed", range(20))
def test_random_outcomes_keep_the_invariants(seed):
    """Random clocks, outcomes, latencies and hangs; after every event the
    invariants hold, a trip only ever follows failures spanning the window
    with no healthy check among them, and only a healthy check resumes."""
    rng = random.Random(seed)
    cfg = BreakerConfig(window_s=rng.choice([0.0, 0.5, 2.0, 5.0]),
                        latency_budget_s=rng.choice([0.1, 0.5]),
                        probe_interval_s=rng.choice([0.2, 1.0]))
    b = CircuitBreaker(cfg, now=0.0)
    now = 0.0
    first_bad: float | None = None  # the test's own account of the streak
    trips = 0
    for _ in range(400):
        now += rng.choice([0.01, 0.1, 0.3, 1.0])
        event = rng.random()
        was = b.state
        moved = None
        if b.running_since is None:
            if b.due(now):
                moved = b.check_started(now)
                assert b.state == (PROBING if was != CLOSED else CLOSED)
        elif event < 0.3:
            moved = b.check_overdue(now)
            overdue = now - b.running_since > cfg.latency_budget_s
            if overdue and was == CLOSED:
                first_bad = now if first_bad is None else first_bad
        else:
            ok = rng.random() < 0.5
            took = now - b.running_since
            healthy = ok and took <= cfg.latency_budget_s
            moved = b.check_finished(ok, now)
            if was == CLOSED:
                first_bad = None if healthy else (now if first_bad is None else first_bad)
            if was == PROBING:
                assert b.state == (CLOSED if healthy else TRIPPED)
        if moved is not None:
            assert (moved.old, moved.new) == (was, b.state)
            if was == CLOSED:
                trips += 1
                assert first_bad is not None and now - first_bad >= cfg.window_s
                first_bad = None
        if b.state == CLOSED and was != CLOSED:
            first_bad = None
        assert b.trips == trips
        assert b.usable == (b.state == CLOSED)
        b.check()
