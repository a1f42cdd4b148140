"""How a graceful stop splits vLLM's --shutdown-timeout (policy/stop_budget.py)."""

from __future__ import annotations

import pytest

from vllm_hicache.policy.stop_budget import StopBudget, stop_budget


def test_zero_timeout_flushes_nothing_and_keeps_the_standing_drain():
    budget = stop_budget(0, 10.0)
    assert budget == StopBudget(0.0, 0.0, 10.0)
    assert not budget.graceful


@pytest.mark.parametrize("timeout_s, flush_s, drain_s", [
    (1, 0.0, 0.75),      # all of it is teardown: nothing to flush in
    (4, 0.0, 3.0),
    (6, 2.0, 3.0),       # at least 4 s of teardown
    (20, 40 / 3, 5.0),   # a third
    (30, 20.0, 7.5),     # at most 10 s of teardown
    (100, 90.0, 7.5),
])
def test_split(timeout_s, flush_s, drain_s):
    budget = stop_budget(timeout_s, 10.0)
    assert budget.flush_s == pytest.approx(flush_s)
    assert budget.drain_s == pytest.approx(drain_s)
    assert budget.shutdown_timeout_s == timeout_s
    assert budget.flush_s + budget.drain_s <= timeout_s
    assert budget.graceful == (flush_s > 0)


def test_negative_timeout_is_refused():
    with pytest.raises(ValueError, match="shutdown_timeout_s must be >= 0, got -1"):
        stop_budget(-1, 10.0)
