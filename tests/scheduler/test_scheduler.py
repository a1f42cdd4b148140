"""Scheduler half on vLLM's real Scheduler, with the worker half and a fake forward."""

from __future__ import annotations

import threading

import pytest

from tests.connector.harness import BLOCK, make_harness
from vllm_hicache.common.stats import key

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [10 + (seed * 131 + i * 17) % 400 for i in range(num_tokens)]


def request_keyed(obj, req_ids) -> list[str]:
    """Attributes of ``obj`` (dicts, sets) that hold any of ``req_ids``."""
    return [name for name, value in vars(obj).items()
            if isinstance(value, (dict, set, frozenset)) and any(r in value for r in req_ids)]


def assert_clean(h) -> None:
    """No request left, no pinned page, tree consistent; nothing in the
    scheduler half remembers a request the harness ever added (its one
    request record map included)."""
    half = h.sched_half
    tree = half.tree
    tree.check_integrity()
    h.step()  # releases the last step's load locks
    assert tree.num_locked_pages == 0
    assert not len(half._inflight)
    assert not half._reqs
    req_ids = set(h.hashes_of)
    for part in (half, half.stores, half.load_gate):
        assert not request_keyed(part, req_ids), type(part).__name__


def test_cold_request_stores_every_full_block(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    h.add("a", prompt(1, 5 * BLOCK + 3), max_tokens=2)
    h.run()
    tree = h.sched_half.tree
    assert tree.num_cached_pages == 5
    assert h.sched_half.stats.stored_blocks == 5
    assert_clean(h)


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_hit_after_l1_reset_loads_exact_bytes(tiny_model_dir, load_mode):
    h = make_harness(tiny_model_dir, hicache_load_mode=load_mode)
    tokens = prompt(2, 4 * BLOCK + 5)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens)
    so = h.step()
    if load_mode == "async":
        assert so.num_scheduled_tokens.get("b") is None  # waits for its load
    h.run()
    assert h.sched_half.stats.loaded_blocks == 4
    assert h.load_checks and all(h.load_checks)
    assert h.first_computed['b'] == 4 * BLOCK
    assert_clean(h)


def test_never_claims_the_last_token(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    tokens = prompt(3, 4 * BLOCK)  # exactly 4 full blocks
    h.add("a", tokens)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add("b", tokens)
    h.run()
    assert h.first_computed['b'] == 3 * BLOCK
    assert h.load_checks and all(h.load_checks)


def test_partial_l2_hit_after_l1_hit(tiny_model_dir):
    """vLLM keeps a short prefix in L1; L2 supplies the rest."""
    h = make_harness(tiny_model_dir)
    long = prompt(4, 6 * BLOCK + 1)
    h.add("a", long)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add("short", long[: 2 * BLOCK + 1])  # loads 2 blocks from L2 into L1
    h.run()
    loaded_before = h.sched_half.stats.loaded_blocks
    h.add("b", long)
    h.run()
    assert h.sched_half.stats.loaded_blocks - loaded_before == 4
    assert h.first_computed['b'] == 6 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_selective_write_needs_second_use(tiny_model_dir):
    h = make_harness(tiny_model_dir, hicache_write_policy="write_through_selective")
    tokens = prompt(5, 3 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    assert h.sched_half.tree.num_cached_pages == 0
    # Counted as kept out by the rule (admission_declined_blocks{tier="L2", rule="hits"}).
    declined = h.sched_half.stats.store_declined_blocks
    assert declined.keys() == {"hits"} and declined["hits"] >= 3
    assert h.sched_half.stats.as_samples()[
        key("admission_declined_blocks", "L2", "hits")] == declined["hits"]
    h.add("b", tokens)  # L1 hit: second use of the 3 blocks
    h.run()
    assert h.sched_half.tree.num_cached_pages == 3
    h.scheduler.reset_prefix_cache()
    h.add("c", tokens)
    h.run()
    assert h.first_computed['c'] == 3 * BLOCK
    assert h.load_checks and all(h.load_checks)


def test_write_back_stores_only_on_l1_eviction(tiny_model_dir):
    h = make_harness(tiny_model_dir, num_blocks=24, hicache_write_policy="write_back")
    first = prompt(6, 4 * BLOCK + 1)
    h.add("a", first)
    h.run()
    assert h.sched_half.tree.num_cached_pages == 0
    for i in range(4):  # churn L1 with other prompts until "a" is evicted
        h.add(f"x{i}", prompt(100 + i, 5 * BLOCK + 1))
        h.run()
    assert h.sched_half.stats.stored_blocks > 0
    h.add("b", first)
    h.run()
    assert h.first_computed['b'] == 4 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_write_back_on_prefix_cache_reset(tiny_model_dir):
    h = make_harness(tiny_model_dir, hicache_write_policy="write_back")
    tokens = prompt(7, 3 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.step()  # the write-back copies run before any block is reused
    assert h.sched_half.tree.num_cached_pages == 3
    h.add("b", tokens)
    h.run()
    assert h.first_computed['b'] == 3 * BLOCK
    assert h.load_checks and all(h.load_checks)


def test_eviction_pressure_keeps_tree_consistent(tiny_model_dir):
    # L2 = 1.5 x 32 blocks = 48 pages; 12 prompts x 5 blocks overflow it.
    h = make_harness(tiny_model_dir, num_blocks=32, hicache_ratio=1.5)
    for i in range(12):
        h.add(f"r{i}", prompt(200 + i, 5 * BLOCK + 2), max_tokens=2)
        h.run()
        h.sched_half.tree.check_integrity()
    stats = h.sched_half.stats
    assert stats.evicted_pages > 0
    assert h.sched_half.tree.num_cached_pages <= h.sched_half.num_pages
    h.scheduler.reset_prefix_cache()
    h.add("again", prompt(211, 5 * BLOCK + 2))  # the most recent prompt
    h.run()
    assert h.first_computed['again'] == 5 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_preemption_finishes_everything_without_leaks(tiny_model_dir):
    # 12 usable blocks for 4 requests that each grow to 4 blocks: preemptions.
    h = make_harness(tiny_model_dir, num_blocks=13, max_batched=64)
    for i in range(4):
        h.add(f"p{i}", prompt(300 + i, 2 * BLOCK + 8), max_tokens=20)
    h.run(max_steps=400)
    assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 12
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_abort_during_async_load_releases_pins(tiny_model_dir):
    from vllm.v1.request import RequestStatus

    h = make_harness(tiny_model_dir, hicache_load_mode="async")
    tokens = prompt(8, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    h.scheduler.reset_prefix_cache()
    transfer = h.worker.worker.transfer
    release = threading.Event()
    real_load = transfer.load

    def slow_load(block_ids, page_ids):
        assert release.wait(timeout=10)
        real_load(block_ids, page_ids)

    transfer.load = slow_load
    h.add("b", tokens)
    h.step(complete_async=False)
    assert len(h.sched_half._inflight)  # the load is in flight, pages pinned
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    h.step(complete_async=False)
    assert "b" in h.scheduler.requests  # vLLM keeps its blocks until the load ends
    assert len(h.sched_half._inflight)
    release.set()
    h.run()
    for _ in range(3):
        h.step()
    assert "b" not in h.scheduler.requests
    assert_clean(h)


def test_no_request_state_outlives_its_request(tiny_model_dir):
    """A lookup that waits, an abort while waiting, a declined hit, rejected
    and accepted kv_transfer_params, a hit split by tier: the scheduler half
    keeps all of it in one record per request, and drops the record when
    vLLM finishes the request."""
    from vllm.v1.request import RequestStatus

    h = make_harness(tiny_model_dir, hicache_load_mode="async")
    half = h.sched_half
    tokens = prompt(40, 4 * BLOCK + 5)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    # b loads its hit asynchronously (held until released); c, the same
    # prefix, is looked up and told to wait for b's load.
    transfer = h.worker.worker.transfer
    release = threading.Event()
    real_load = transfer.load

    def held_load(block_ids, page_ids):
        assert release.wait(timeout=10)
        real_load(block_ids, page_ids)

    transfer.load = held_load
    h.add("b", tokens)
    h.add("c", tokens)
    h.step(complete_async=False)
    h.step(complete_async=False)  # c asks again: the last lookup wins
    assert len(half._inflight)
    assert half._reqs["c"].lookup is not None  # never allocated: no update_state_after_alloc
    assert request_keyed(half, {"c"}) == ["_reqs"]  # the one map that knows c
    h.scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert "c" not in half._reqs
    assert not request_keyed(half, {"c"})
    release.set()
    transfer.load = real_load
    h.run()
    assert h.first_computed["b"] == 4 * BLOCK
    # d: the load gate declines its hit; counted when d is admitted.
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    half.load_gate.load_l2 = lambda *args: False
    h.add("d", tokens, max_tokens=3)
    h.step()
    assert half._reqs["d"].declined_blocks == 0 and half._reqs["d"].lookup is None
    assert half.load_gate.decisions[("L2", "declined")] == 4 * BLOCK
    del half.load_gate.load_l2
    # e: rejected kv_transfer_params, reported when it finishes; f: a load cap.
    h.add("e", prompt(41, 2 * BLOCK + 1), kv_transfer_params={"hicache_tiers": "L2"})
    h.add("f", tokens, max_tokens=1, kv_transfer_params={"max_load_tokens": BLOCK})
    assert half._reqs["e"].param_error is not None
    assert half._reqs["f"].controls.max_load_tokens == BLOCK
    h.run()
    errors = [o.kv_transfer_params for outs in h.engine_outputs for o in outs.outputs
              if o.request_id == "e" and o.kv_transfer_params]
    assert errors and "hicache_tiers" in errors[-1]["hicache_error"]
    assert half.stats.request_param_errors == 1
    assert_clean(h)


def test_reset_cache_clears_l2(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    h.add("a", prompt(9, 3 * BLOCK + 1))
    h.run()
    assert h.sched_half.tree.num_cached_pages == 3
    assert h.scheduler.connector.reset_cache() is True
    assert h.sched_half.tree.num_cached_pages == 0
    h.scheduler.reset_prefix_cache()
    h.add("b", prompt(9, 3 * BLOCK + 1))
    h.run()
    assert h.first_computed['b'] == 0


def test_async_shared_prefix_is_loaded_once(tiny_model_dir):
    """Scenario: two requests share a 4-block L2 prefix and arrive together
    in async mode. The second waits for the first's load, then hits vLLM's
    own prefix cache instead of loading the same pages again."""
    h = make_harness(tiny_model_dir, hicache_load_mode="async")
    shared = prompt(10, 4 * BLOCK)
    h.add("a", shared + [1, 2, 3])
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add("b", shared + [4, 5, 6])
    h.add("c", shared + [7, 8, 9])
    h.run()
    assert h.sched_half.stats.loaded_blocks == 4
    assert h.first_computed["c"] == 4 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert not h.sched_half._inflight.overlaps(h.hashes_of["c"].block_hashes)
    assert_clean(h)


def test_pool_that_does_not_fit_fails_before_allocating(tiny_model_dir):
    with pytest.raises(ValueError, match="does not fit"):
        make_harness(tiny_model_dir, hicache_size=100_000)
