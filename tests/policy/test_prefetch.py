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


def test_prefetch_threshold_is_auto_by_default_or_a_number_of_tokens():
    from vllm_hicache.policy.prefetch import (
        PREFETCH_THRESHOLD_AUTO,
        min_prefetch_blocks,
        parse_prefetch_threshold,
    )

    def storage(**extra):
        return make_config(hicache_storage_backend="file",
                           hicache_storage_backend_extra_config={"path": "/x", **extra}).storage

    assert storage().prefetch_threshold == PREFETCH_THRESHOLD_AUTO
    assert storage(prefetch_threshold="auto").prefetch_threshold == "auto"
    assert storage(prefetch_threshold=256).prefetch_threshold == 256
    assert parse_prefetch_threshold(64.0) == 64
    for bad in (0, -1, 1.5, True, "256", "Auto", None):
        with pytest.raises(ValueError, match="prefetch_threshold"):
            storage(prefetch_threshold=bad)
    assert min_prefetch_blocks("auto", 16) == 1
    assert min_prefetch_blocks(256, 16) == 16 and min_prefetch_blocks(17, 16) == 2
