"""Per-request controls in ``kv_transfer_params`` (request_params.py): the
parser, then each control through vLLM's real Scheduler (harness.py), the
request's ``priority`` feeding the ``priority`` eviction policy, and bad
values answered in the request's output, never by a failed engine."""

from __future__ import annotations

import pytest

from tests.connector.harness import BLOCK, make_harness
from tests.l3.test_planner import forget_l1_and_l2, l3_harness
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.scheduler.request_params import (
    DEFAULT_CONTROLS,
    RequestControls,
    parse_request_params,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# --- the parser ------------------------------------------------------------------


def test_parse_accepts_vllms_names_and_ours():
    assert parse_request_params(None) is DEFAULT_CONTROLS
    assert parse_request_params({"do_remote_prefill": False}) is DEFAULT_CONTROLS
    assert parse_request_params({"max_load_tokens": 64, "max_offload_tokens": 0,
                                 "hicache_tiers": ["L2"]}) == RequestControls(
        64, 0, frozenset({"L2"}))
    assert parse_request_params({"hicache_tiers": []}).tiers == frozenset()


@pytest.mark.parametrize("params, named", [
    ({"max_load_tokens": -1}, "max_load_tokens=-1"),
    ({"max_load_tokens": "64"}, "max_load_tokens='64'"),
    ({"max_offload_tokens": True}, "max_offload_tokens=True"),
    ({"max_offload_tokens": 1.5}, "max_offload_tokens=1.5"),
    ({"hicache_tiers": "L2"}, "hicache_tiers='L2'"),
    ({"hicache_tiers": ["L2", "GPU"]}, "['GPU'] not a tier"),
    ({"hicache_tiers": ["L3"]}, "L3 data is loaded through L2"),
    ({"hicache_tier": ["L2"]}, "unknown kv_transfer_params key(s) ['hicache_tier']"),
])
def test_parse_names_the_bad_field(params, named):
    with pytest.raises(ValueError, match="kv_transfer_params") as err:
        parse_request_params(params)
    assert named in str(err.value)


# --- through the scheduler ---------------------------------------------------------


def cached_blocks(h, req_id: str) -> int:
    """Leading blocks of the request's prompt L2 holds."""
    pages = h.sched_half.tree.match(h.hashes_of[req_id].block_hashes).pages
    return next((i for i, p in enumerate(pages) if p is None), len(pages))


def test_max_load_tokens_caps_the_load(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    tokens = prompt(50, 5 * BLOCK + 3)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens, kv_transfer_params={"max_load_tokens": 2 * BLOCK + 7})
    h.run()
    assert h.first_computed["b"] == 2 * BLOCK
    assert h.sched_half.stats.loaded_blocks == 2
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_max_offload_tokens_caps_the_store(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    h.add("a", prompt(51, 5 * BLOCK + 3), kv_transfer_params={"max_offload_tokens": 2 * BLOCK})
    h.run()
    assert cached_blocks(h, "a") == 2
    assert h.sched_half.tree.num_cached_pages == 2
    assert h.sched_half.stats.store_limited_blocks == 3
    h.add("b", prompt(52, 3 * BLOCK + 3), kv_transfer_params={"max_offload_tokens": 0})
    h.run()
    assert h.sched_half.tree.num_cached_pages == 2
    assert_clean(h)


def test_no_tiers_means_no_load(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    tokens = prompt(53, 4 * BLOCK + 3)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.add("b", tokens, kv_transfer_params={"hicache_tiers": []})
    h.run()
    assert h.first_computed["b"] == 0
    assert h.sched_half.stats.loaded_blocks == 0
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("c", tokens)  # the defaults: served from L2
    h.run()
    assert h.first_computed["c"] == 4 * BLOCK
    assert h.sched_half.stats.loaded_blocks == 4
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_l2_only_skips_the_l3_lookup(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir)
    tokens = prompt(54, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    h.step()
    forget_l1_and_l2(h)
    h.add("b", tokens, kv_transfer_params={"hicache_tiers": ["L2"]})
    h.run()
    assert h.first_computed["b"] == 0
    assert h.sched_half.l3.prefetched_blocks == 0
    forget_l1_and_l2(h)
    h.add("c", tokens, kv_transfer_params={"hicache_tiers": ["L2", "L3"],
                                           "max_load_tokens": 3 * BLOCK})
    h.run()
    # The lookup, so the prefetch, is capped too.
    assert h.sched_half.l3.prefetched_blocks == 3
    assert h.first_computed["c"] == 3 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_bad_params_are_answered_in_the_output_not_by_the_engine(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    tokens = prompt(55, 4 * BLOCK + 3)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.add("bad", tokens, kv_transfer_params={"max_load_tokens": -5})
    h.add("good", prompt(56, 3 * BLOCK + 1))
    h.run()
    # Served, without HiCache: no load from L2 although it holds the prefix,
    # and nothing stored for it.
    assert h.first_computed["bad"] == 0
    assert h.first_computed["good"] == 0
    finished = {o.request_id: o for step in h.engine_outputs for o in step.outputs
                if o.finish_reason is not None}
    assert finished["bad"].kv_transfer_params == {
        "hicache_error": "invalid kv_transfer_params max_load_tokens=-5; expected an integer "
                         ">= 0 (a number of tokens)"}
    assert finished["good"].kv_transfer_params is None
    assert h.sched_half.stats.request_param_errors == 1
    assert h.sched_half.stats.loaded_blocks == 0
    assert cached_blocks(h, "good") == 3
    assert_clean(h)


@pytest.mark.parametrize("policy", ["priority", "lru"])
def test_request_priority_orders_eviction(tiny_model_dir, policy):
    """vLLM's priority (lower is more important) reaches the tree: under
    ``priority`` a background request's pages go first even though they
    are newer; under ``lru`` the older, important ones do."""
    # L2 = 1.5 x 32 = 48 pages.
    h = make_harness(tiny_model_dir, num_blocks=32, hicache_ratio=1.5,
                     radix_eviction_policy=policy)
    h.add("important", prompt(60, 5 * BLOCK + 2), max_tokens=2, priority=0)
    h.run()
    h.add("background", prompt(61, 5 * BLOCK + 2), max_tokens=2, priority=10)
    h.run()
    for i in range(8):  # 40 more pages: 50 > 48, two must go
        h.add(f"flood{i}", prompt(70 + i, 5 * BLOCK + 2), max_tokens=2, priority=0)
        h.run()
    assert h.sched_half.stats.evicted_pages == 2
    if policy == "priority":
        assert cached_blocks(h, "important") == 5
        assert cached_blocks(h, "background") == 3
    else:
        assert cached_blocks(h, "important") == 3
        assert cached_blocks(h, "background") == 5
    assert_clean(h)
