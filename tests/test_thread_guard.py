"""The root conftest's check for ticking threads a module leaves running."""

from __future__ import annotations

import threading

from tests.threads import ticking_threads_outliving
from vllm_hicache.l3.breaker import BreakerConfig
from vllm_hicache.l3.health_check import L3Health
from vllm_hicache.node.reclaim import Sweeper


def _ticker(name: str, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=lambda: stop.wait(10.0), name=name, daemon=True)
    thread.start()
    return thread


def test_a_ticking_thread_still_running_is_named() -> None:
    before = set(threading.enumerate())
    stop = threading.Event()
    _ticker("hicache-l3-health", stop)
    _ticker("hicache-node-sweep-abc", stop)
    _ticker("hicache-lookup", stop)  # waits on a queue: not a ticking thread
    try:
        assert ticking_threads_outliving(before, grace_s=0.05) == [
            "hicache-l3-health", "hicache-node-sweep-abc"]
    finally:
        stop.set()


def test_one_that_ends_within_the_grace_is_not() -> None:
    before = set(threading.enumerate())
    stop = threading.Event()
    _ticker("hicache-l3-health", stop)
    threading.Timer(0.1, stop.set).start()
    assert ticking_threads_outliving(before, grace_s=5.0) == []


def test_threads_running_before_are_not_counted() -> None:
    stop = threading.Event()
    _ticker("hicache-l3-health", stop)
    try:
        assert ticking_threads_outliving(set(threading.enumerate()), grace_s=0.05) == []
    finally:
        stop.set()


def test_the_package_s_ticking_threads_are_the_ones_checked(tmp_path) -> None:
    """A renamed health or sweep thread would slip past the check: start the
    real ones, see them named, close them, see them gone."""
    before = set(threading.enumerate())
    health = L3Health(BreakerConfig(window_s=1.0, latency_budget_s=1.0, probe_interval_s=1.0),
                      lambda: "", "file")
    sweeper = Sweeper("guard", str(tmp_path / "index.db"), str(tmp_path), "me",
                      lock_timeout_s=1.0, interval_s=1.0)
    try:
        assert ticking_threads_outliving(before, grace_s=0.05) == [
            "hicache-l3-health", "hicache-node-sweep-guard"]
    finally:
        health.close()
        sweeper.stop()
    assert ticking_threads_outliving(before, grace_s=5.0) == []
