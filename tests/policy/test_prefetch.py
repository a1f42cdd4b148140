"""Prefetch policies: the wait budget and when a request keeps waiting."""

from __future__ import annotations

import math

import pytest

from tests.conftest import make_config
from vllm_hicache.policy.prefetch import PREFETCH_POLICIES, PrefetchPolicy


def policy(name: str) -> PrefetchPolicy:
    return PrefetchPolicy(name, timeout_base_s=2.0, timeout_per_ki_token_s=0.1, timeout_max_s=30.0)


def test_timeout_budget_grows_with_tokens_and_is_capped():
    assert math.isclose(policy("timeout").wait_budget_s(2048), 2.0 + 0.1 * 2)
    assert policy("timeout").wait_budget_s(10**9) == 30.0


def test_wait_complete_is_bounded_and_best_effort_never_waits():
    assert policy("wait_complete").wait_budget_s(10) == 30.0
    assert policy("best_effort").wait_budget_s(10**6) == 0.0
    assert not policy("best_effort").should_wait(False, now=0.0, deadline=1e9)


@pytest.mark.parametrize("name", ["wait_complete", "timeout"])
def test_waiting_ends_with_the_prefetch_or_the_deadline(name):
    p = policy(name)
    assert p.should_wait(False, now=1.0, deadline=2.0)
    assert not p.should_wait(True, now=1.0, deadline=2.0)
    assert not p.should_wait(False, now=2.5, deadline=2.0)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="accepted: best_effort, wait_complete, timeout"):
        policy("eager")


def test_config_accepts_exactly_the_policies():
    for name in PREFETCH_POLICIES:
        cfg = make_config(hicache_storage_backend="file",
                          hicache_storage_prefetch_policy=name)
        assert cfg.storage.prefetch_policy == name
