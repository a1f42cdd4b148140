"""Regressions of the hardening review, each reproduced on vLLM's real
Scheduler (tests/connector/harness.py) before it was fixed."""

from __future__ import annotations

import pytest

from tests.connector.harness import BLOCK, make_harness
from tests.scheduler.test_scheduler import assert_clean, prompt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_l1_hits_keep_the_prefix_hot_in_l2(tiny_model_dir):
    """A prefix vLLM keeps serving from L1 must not age out of L2: once L1
    drops it (reset), it comes back from L2 instead of being recomputed."""
    h = make_harness(tiny_model_dir, num_blocks=24, hicache_ratio=2)  # L2: 48 pages
    hot = prompt(40, 3 * BLOCK)
    h.add("hot", hot + prompt(99, BLOCK // 2))
    h.run()  # the hot prefix enters L2 first: the oldest insert
    for i in range(11):  # 44 more pages: L2 fills up, nothing evicted yet
        h.add(f"hot{i}", hot + prompt(100 + i, BLOCK // 2))  # an L1 hit
        h.add(f"cold{i}", prompt(200 + i, 4 * BLOCK + 1))
        h.run()
    half = h.sched_half
    assert half.stats.evicted_pages == 0
    assert h.first_computed["hot10"] == 3 * BLOCK  # served by L1, not L2
    assert half.stats.loaded_blocks == 0
    for i in range(11, 17):  # 24 more pages: the least recently used leave
        h.add(f"cold{i}", prompt(200 + i, 4 * BLOCK + 1))
        h.run()
    assert half.stats.evicted_pages >= 20, "L2 was never under pressure"
    loaded_before = half.stats.loaded_blocks
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("after", hot + prompt(999, BLOCK // 2))
    h.run()
    assert h.first_computed["after"] == 3 * BLOCK
    assert half.stats.loaded_blocks - loaded_before == 3
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


class FailingLoads:
    """Wraps the worker's transfer: loads that touch ``bad_page`` raise."""

    def __init__(self, transfer, bad_page: int) -> None:
        self._transfer, self.bad_page, self.failures = transfer, bad_page, 0

    def __getattr__(self, name):
        return getattr(self._transfer, name)

    def load_layer(self, layer, block_ids, page_ids):
        if self.bad_page in page_ids:
            self.failures += 1
            raise RuntimeError("injected: page unreadable")
        return self._transfer.load_layer(layer, block_ids, page_ids)

    def load(self, block_ids, page_ids):
        if self.bad_page in page_ids:
            self.failures += 1
            raise RuntimeError("injected: page unreadable")
        return self._transfer.load(block_ids, page_ids)


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_a_page_whose_load_failed_leaves_the_index(tiny_model_dir, load_mode):
    """Before: the page stayed indexed and every request reloaded it (async
    mode: forever). Now the failing page and what hangs below it leave L2;
    the request recomputes, stores again, and the next one hits."""
    h = make_harness(tiny_model_dir, hicache_load_mode=load_mode)
    tokens = prompt(41, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    hashes = h.hashes_of["a"].block_hashes[:4]
    pages = h.sched_half.tree.match(hashes).pages
    assert None not in pages and len(pages) == 4
    worker = h.worker.worker
    failing = FailingLoads(worker.transfer, bad_page=pages[2])
    worker.transfer = failing  # the async loader's too
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens)
    h.run(max_steps=50)  # a livelock would exhaust the step budget
    assert failing.failures >= 1
    half = h.sched_half
    assert half.stats.invalidated_pages >= 1
    assert half.stats.load_error_blocks >= 1
    # "b" recomputed from the failing block on and stored it again.
    new_pages = half.tree.match(hashes).pages
    assert len(new_pages) == 4 and None not in new_pages
    worker.transfer = failing._transfer
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.load_checks.clear()
    h.add("c", tokens)
    h.run()
    assert h.first_computed["c"] == 4 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_idle_engine_keeps_stepping_until_backups_are_acknowledged(tiny_model_dir):
    """vLLM steps only while ``has_requests()``; the connector's pending
    work keeps it stepping after the last request, so backup acks (and the
    pins they release) arrive without waiting for the next request."""
    import time

    from tests.l3.test_planner import hold_backups, l3_harness

    h, store = l3_harness(tiny_model_dir, policy="best_effort")
    gate = hold_backups(h)
    h.add("a", prompt(42, 3 * BLOCK + 1), max_tokens=1)
    for _ in range(50):
        h.step(complete_async=False)
        if not h.scheduler.has_unfinished_requests():
            break
    assert not h.scheduler.has_unfinished_requests()
    assert h.sched_half.tree.num_locked_pages == 3
    assert h.scheduler.has_requests(), "an idle engine would stop with pages pinned"
    gate.set()
    for _ in range(200):  # what vLLM's busy loop does while has_requests()
        if not h.scheduler.has_requests():
            break
        h.step(complete_async=False)
        time.sleep(0.01)  # the backup thread runs meanwhile
    assert not h.scheduler.has_requests()
    assert h.sched_half.tree.num_locked_pages == 0
    from vllm_hicache.l3.canary import is_canary_key

    assert sum(not is_canary_key(k) for k in store) == 3


def test_write_back_keeps_multi_turn_histories_beyond_l1(tiny_model_dir):
    """Three chats share a system prompt and grow turn by turn past what L1
    holds and past what the write-back watcher tracks (2 x L1 blocks). Every
    block reaches L2 when vLLM reuses it, so each new turn finds its whole
    history in L1 or L2 and recomputes only the new tokens. (The hot-parent
    defect itself is reproduced block by block in test_write_back.py.)"""
    h = make_harness(tiny_model_dir, num_blocks=24, hicache_write_policy="write_back",
                     hicache_ratio=4)
    system = prompt(60, 2 * BLOCK)
    chats = {c: list(system) for c in range(3)}
    misses = []
    for turn in range(12):
        for c, history in chats.items():
            history += prompt(1000 + 10 * c + turn, BLOCK + 5)  # the user's new message
            req_id = f"c{c}t{turn}"
            h.add(req_id, list(history), max_tokens=1)
            h.run()
            if turn:
                previous_prompt = len(history) - (BLOCK + 5) - 1
                reusable = previous_prompt // BLOCK * BLOCK
                misses.append(reusable - min(h.first_computed[req_id], reusable))
            history += [7]  # the answer becomes part of the history
    half = h.sched_half
    distinct_blocks = 2 + sum((len(hist) - 2 * BLOCK) // BLOCK for hist in chats.values())
    # More than L1 holds, and more than the watcher tracks (2 x L1 blocks).
    assert distinct_blocks > 2 * 24, "the chats fit: nothing had to be written back or trimmed"
    assert half.stats.stored_blocks > 0 and half.stats.loaded_blocks > 0
    assert sum(misses) == 0, misses
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_failed_load_leaves_vllms_prefix_cache_too(tiny_model_dir):
    """Under kv_load_failure_policy=recompute vLLM keeps the failed blocks
    cached until their request recomputes them; a request scheduled
    meanwhile would hit garbage in L1 (and we would store it). The connector
    evicts them, and what the failed request computed on top of them."""
    h = make_harness(tiny_model_dir)
    tokens = prompt(43, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    hashes = h.hashes_of["a"].block_hashes[:4]
    pages = h.sched_half.tree.match(hashes).pages
    worker = h.worker.worker
    worker.transfer = FailingLoads(worker.transfer, bad_page=pages[1])
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens + prompt(44, 2 * BLOCK))
    h.step()  # loads 4 blocks from L2: one page fails
    pool = h.scheduler.kv_cache_manager.block_pool
    cached = [pool.get_cached_block(bh, [0]) is not None for bh in h.hashes_of["b"].block_hashes]
    assert worker.transfer.failures >= 1
    assert not any(cached), cached
    h.run()
    assert h.load_checks == []  # the failed load was never counted as good
    assert_clean(h)
