"""Counters bumped from many threads add up; the log throttle lets one line
per interval through."""

from __future__ import annotations

import threading

import pytest

from vllm_hicache.storage import log_throttle
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.log_throttle import LogThrottle


def test_counters_add_up_across_threads():
    counts = Counters("gets", "errors")
    threads = [threading.Thread(target=lambda: [counts.add(gets=1) for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts.bump("errors") == 1 and counts["errors"] == 1
    assert counts.snapshot() == {"gets": 4000.0, "errors": 1.0}
    with pytest.raises(KeyError):
        counts.add(typo=1)


def test_log_throttle_passes_the_first_then_once_per_interval(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(log_throttle.time, "monotonic", lambda: now[0])
    throttle = LogThrottle(60.0)
    assert throttle.ready() and not throttle.ready()
    now[0] += 59.0
    assert not throttle.ready()
    now[0] += 1.0
    assert throttle.ready() and not throttle.ready()
