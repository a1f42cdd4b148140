"""Node-tier hits loaded into L1 directly, through vLLM's real Scheduler and
our two halves (tests/connector/harness.py, fake forward that writes each
token's exact KV): instance A computes a prompt and backs it up into the
node tier; instance B, another member of the same tier, gets the prompt's
blocks as one direct load (no L2 page, no L3 prefetch), and every loaded
block holds exactly the KV A computed. With ``hicache_load_mode=layerwise``
the load runs within the step that admits the request, before its forward
(as an L2 hit's does); with ``async`` the request waits for it. A page
whose seal no longer names it (torn, foreign or refilled), or evicted
between the lookup and the load, is not used: B recomputes from that block on (in the step's
case, vLLM takes the load error and reschedules the request from there)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.connector.harness import BLOCK, close_open_harnesses, make_harness
from vllm_hicache.node.segment import HEADER_BYTES as SEGMENT_HEADER_BYTES
from vllm_hicache.node.segment import SLOT_HEADER_BYTES
from vllm_hicache.storage.node_chain import node_key

PROMPT_BLOCKS = 5
PROMPT = list(range(1000, 1000 + PROMPT_BLOCKS * BLOCK + 3))


@pytest.fixture
def shm_root(node_root):
    """conftest's tmpfs directory; the instances built on it leave the tier
    before node_root removes the directory (the root conftest's close of
    every harness would come after it)."""
    yield node_root
    close_open_harnesses()


def build(model_dir, root: str, max_num_seqs: int = 4, **l2):
    l2 = {"hicache_ratio": 2, **l2} if "hicache_size" not in l2 else l2
    return make_harness(
        model_dir, num_blocks=32, max_num_seqs=max_num_seqs, **l2,
        hicache_mem_layout="page_first_direct", node_tier_bytes=16 << 20,
        node_tier_name="direct", node_tier_root=root,
        hicache_storage_prefetch_policy="best_effort",
        hicache_storage_backend_extra_config={"prefetch_threshold": BLOCK})


def publish(model_dir, root: str, prompt=PROMPT, **l2):
    """Instance A computes ``prompt``; its blocks reach the node tier."""
    a = build(model_dir, root, **l2)
    a.add("a", prompt, max_tokens=1)
    a.run()
    for _ in range(20):  # backups are acknowledged a step later
        a.step()
        assert a.worker.worker._io.wait_idle(10)
    tier = a.sched_half.l3.backend.tier
    req = a.hashes_of["a"]
    blocks = (len(prompt) - 1) // BLOCK
    keys = a.sched_half.l3.namespaces[0].object_keys(req.block_hashes[:blocks])
    assert tier.lookup([node_key(k) for k in keys]) == blocks
    return a, tier, [node_key(k) for k in keys]


def watch_loads(b):
    """(job, blocks loaded, each block's bytes right) per direct load of B."""
    queue = b.worker.worker._node.queue
    assert queue is not None and queue.loader is not None
    loader, seen = queue.loader, []
    inner = loader.finish

    def finish(op, defer=None):  # every load ends here, in step or async
        n = inner(op, defer)
        req = b.hashes_of["b"]
        ok = [b.check_block(block, req, i) for i, block in enumerate(op.block_ids[:n])]
        seen.append((op.asked, n, ok))
        return n

    loader.finish = finish
    return seen


def tear_seal(tier, key: bytes) -> None:
    """Flip a generation bit in the seal of ``key``'s slot, as a torn or
    foreign slot shows (the index still lists it)."""
    found = tier.hold_pages([key])
    tier.release_pages(found, 0, 0)
    mapping = np.frombuffer(tier.mapping(), np.uint8)
    mapping[SEGMENT_HEADER_BYTES + found[0].slot * SLOT_HEADER_BYTES] ^= 0x01


MODES = ["layerwise", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_another_instance_loads_the_prefix_from_the_node_tier_directly(tiny_model_dir,
                                                                       shm_root, mode):
    a, tier, keys = publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, hicache_load_mode=mode)
    seen = watch_loads(b)
    l2 = b.worker.worker.pool.buffer.clone()
    gate, planned = b.sched_half.load_gate, []
    inner_planned = gate.step_planned
    gate.step_planned = lambda so, copies: (planned.append(copies), inner_planned(so, copies))
    b.add("b", PROMPT, max_tokens=1)
    so = b.step()
    jobs = so.kv_connector_metadata.node_loads
    assert [(j.req_id, j.in_step) for j in jobs] == [("b", mode == "layerwise")]
    # A step that copies before its forward is no sample of the prefill rate.
    assert planned == [mode == "layerwise"]
    if mode == "layerwise":
        # Admitted, loaded and computed in one step, as an L2 hit is.
        assert so.has_sync_kv_loads
        assert [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs] == [
            ("b", PROMPT_BLOCKS * BLOCK)]
    else:
        assert not so.scheduled_new_reqs  # waits for the load
    b.run()
    assert seen == [(PROMPT_BLOCKS, PROMPT_BLOCKS, [True] * PROMPT_BLOCKS)]
    assert b.first_computed["b"] == PROMPT_BLOCKS * BLOCK
    half = b.sched_half
    assert half.stats.hit_tokens_l3 == PROMPT_BLOCKS * BLOCK
    assert half.stats.hit_tokens_l2 == 0
    # ...all of them from the node tier (vllm:hicache_node_tier_hit_tokens_total).
    assert half.stats.hit_tokens_node == PROMPT_BLOCKS * BLOCK
    loader = b.worker.worker._node.queue.loader
    assert loader.counts["pages"] == PROMPT_BLOCKS
    # L2 took no part: no prefetch staged the pages, and the loaded blocks
    # were not stored to it afterwards (the machine holds them in the tier).
    assert not half.l3.in_flight().get("prefetch", 0)
    assert torch.equal(b.worker.worker.pool.buffer, l2)
    assert half.tree.match(b.hashes_of["b"].block_hashes).host_run(0) == []
    # Through the load gate, under the node tier's own name.
    assert half.load_gate.decisions == {("node", "loaded"): PROMPT_BLOCKS * BLOCK}
    # Its arrival's probe of the node tier stood in for an L3 lookup.
    assert half.l3.lookups_started == 0
    # B's loads trust the seals (A's PageStore checked the objects it sealed);
    # what B itself promotes from a remote store is checked before sealing.
    assert loader._check is None
    assert b.worker.worker._io.pages.backend.promotion_check is not None


def test_a_request_the_node_tier_no_longer_serves_when_scheduled_is_looked_up(
        tiny_model_dir, shm_root):
    """The probe at arrival found the prompt in the node tier, so no L3
    lookup started; by the time vLLM has room for the request the tier
    dropped it: the request is looked up then, and computed."""
    _, tier, _ = publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, max_num_seqs=1)
    seen = watch_loads(b)
    b.add("x", list(range(3000, 3000 + BLOCK + 5)), max_tokens=4)
    b.step()  # x runs; b, added now, waits for the only slot
    started = b.sched_half.l3.lookups_started  # x's own
    b.add("b", PROMPT, max_tokens=1)
    state = b.sched_half._reqs["b"]
    assert state.l3_lookup_deferred and state.node_probe.found == PROMPT_BLOCKS
    assert b.sched_half.l3.lookups_started == started
    assert tier.clear() > 0
    b.run()
    assert b.sched_half.l3.lookups_started == started + 1
    assert b.first_computed["b"] == 0 and seen == []
    assert b.sched_half.stats.load_error_blocks == 0


def test_a_deferred_lookup_after_l3_was_detached_is_a_miss(tiny_model_dir, shm_root):
    """The probe at arrival stood in for the L3 lookup; before vLLM has room
    for the request the admin API detaches L3 (node tier and all): the
    request is computed, with no lookup and no crash of the engine."""
    from tests.admin.test_storage_control import settle
    from vllm_hicache.admin.api import parse_detach

    publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, max_num_seqs=1)
    b.add("x", list(range(3000, 3000 + BLOCK + 5)), max_tokens=8)
    b.step()  # x runs; b, added now, waits for the only slot
    b.add("b", PROMPT, max_tokens=1)
    assert b.sched_half._reqs["b"].l3_lookup_deferred
    status, body = settle(b, b.sched_half.storage_control.submit(
        "detach", parse_detach({"pending_backups": "drop"})))
    assert status == 200 and b.sched_half.l3 is None, body
    assert "b" not in b.first_computed  # not scheduled yet: its deferred lookup is pending
    b.run()
    assert b.first_computed["b"] == 0
    assert not b.sched_half._reqs  # both finished and forgotten


@pytest.mark.parametrize("mode", MODES)
def test_after_l3_is_detached_and_attached_again_hits_load_from_the_new_membership(
        tiny_model_dir, shm_root, mode):
    """An admin detach and a new attach give B a new member of the tier (in
    front of another store): its worker loads the next hit through that
    member, not the one that left (whose reads all missed: recomputed)."""
    from tests.admin.test_storage_control import mem_spec, settle
    from vllm_hicache.admin.api import parse_detach

    publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, hicache_load_mode=mode)
    old_loader = b.worker.worker._node.queue.loader
    control = b.sched_half.storage_control
    for kind, spec in (("detach", parse_detach({"pending_backups": "drop"})),
                       ("attach", mem_spec("after-detach", prefetch_policy="best_effort"))):
        status, body = settle(b, control.submit(kind, spec))
        assert status == 200, (kind, body)
    seen = watch_loads(b)
    b.add("b", PROMPT, max_tokens=1)
    b.run()
    assert seen == [(PROMPT_BLOCKS, PROMPT_BLOCKS, [True] * PROMPT_BLOCKS)]
    assert b.first_computed["b"] == PROMPT_BLOCKS * BLOCK
    assert b.sched_half.stats.load_error_blocks == 0
    loader = b.worker.worker._node.queue.loader
    assert loader is not old_loader
    assert loader.tier is b.worker.worker._rank_l3.io.pages.backend.tier
    assert loader.counts["pages"] == PROMPT_BLOCKS and old_loader.counts["misses"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_request_whose_node_loads_keep_failing_is_computed_not_offered_the_hit_forever(
        tiny_model_dir, shm_root, mode):
    """The scheduler half finds the prefix in the tier, and B's worker
    cannot load any of it, and drops nothing (here: it has no loader; in
    the field, halves that disagree, e.g. a rank whose tier fails its
    reads). Under async loads vLLM then asks again for the request it just
    recomputed from block 0: the hit is offered at most MAX_NODE_ADMISSIONS
    times, then the request is computed."""
    from vllm_hicache.scheduler.node_hits import MAX_NODE_ADMISSIONS

    publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, hicache_load_mode=mode)
    b.worker.worker._node.queue.replace_loader(None)
    b.add("b", PROMPT, max_tokens=1)
    admitted = []
    inner = b.sched_half.node_hits.admit

    def admit(state, *args):
        admitted.append(state.request.request_id)
        return inner(state, *args)

    b.sched_half.node_hits.admit = admit
    b.run()
    assert 1 <= len(admitted) <= MAX_NODE_ADMISSIONS
    assert b.scheduler.requests == {} and not b.sched_half._reqs


def run_recording_recompute(b) -> tuple[int, list[int], set[int]]:
    """Run B's request "b": (tokens computed when first scheduled, tokens
    computed when it was scheduled next, the load errors B reported)."""
    errors: set[int] = set()
    worker = b.worker
    inner = worker.get_block_ids_with_load_errors

    def take():
        got = inner()
        errors.update(got)
        return got

    worker.get_block_ids_with_load_errors = take
    later = []
    while b.scheduler.has_unfinished_requests():
        so = b.step()
        cached = so.scheduled_cached_reqs
        later += [n for r, n in zip(cached.req_ids, cached.num_computed_tokens) if r == "b"]
        if so.total_num_scheduled_tokens == 0:
            time.sleep(0.002)
    return b.first_computed["b"], later, errors


def assert_recomputed_from(b, mode: str, good: int, errors: set[int], first: int,
                           later: list[int]) -> None:
    """B used ``good`` loaded blocks and computed the rest itself."""
    if mode == "async":
        assert first == good * BLOCK  # admitted once the load ended
        return
    # In step: admitted with the whole hit; the blocks from the bad one on
    # are load errors, and vLLM rescheduled the request from there.
    assert first == PROMPT_BLOCKS * BLOCK
    assert len(errors) == PROMPT_BLOCKS - good
    assert later[:1] == [good * BLOCK]


@pytest.mark.parametrize("mode", MODES)
def test_a_slot_whose_seal_is_torn_is_recomputed_not_used(tiny_model_dir, shm_root, mode):
    a, tier, keys = publish(tiny_model_dir, shm_root)
    tear_seal(tier, keys[2])
    b = build(tiny_model_dir, shm_root, hicache_load_mode=mode)
    seen = watch_loads(b)
    b.add("b", PROMPT, max_tokens=1)
    first, later, errors = run_recording_recompute(b)
    assert seen == [(PROMPT_BLOCKS, 2, [True, True])]
    assert b.worker.worker._node.queue.loader.counts["refused"] == 1
    # vLLM kept the two good blocks and recomputed from the torn one on.
    assert_recomputed_from(b, mode, 2, errors, first, later)


def evict_before_pin(b, tier, key: bytes) -> None:
    """B's loads find ``key``'s page evicted from the tier: it leaves after
    the scheduler's lookup, just before the worker pins the load's pages."""
    inner = b.worker.worker._node.queue.loader.begin

    def evict_then_begin(hashes, block_ids):
        page = tier.hold_pages([key])
        tier.drop_page(page[0], "evicted by the test")
        return inner(hashes, block_ids)

    b.worker.worker._node.queue.loader.begin = evict_then_begin


@pytest.mark.parametrize("mode", MODES)
def test_a_page_evicted_between_lookup_and_load_is_recomputed(tiny_model_dir, shm_root,
                                                              mode):
    a, tier, keys = publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, hicache_load_mode=mode)
    seen = watch_loads(b)
    # The scheduler found all five; the fourth leaves before the worker pins it.
    evict_before_pin(b, tier, keys[3])
    b.add("b", PROMPT, max_tokens=1)
    first, later, errors = run_recording_recompute(b)
    assert seen == [(PROMPT_BLOCKS, 3, [True] * 3)]
    assert_recomputed_from(b, mode, 3, errors, first, later)


@pytest.mark.parametrize("cause", ["evicted", "torn"])
def test_what_a_step_computes_over_a_node_load_that_came_short_is_not_stored(
        tiny_model_dir, shm_root, cause):
    """B's prompt runs two blocks past the published ones, and the fourth
    published page leaves before B pins it, or fails its seal check: the
    step that admits B computes its last blocks over KV that never arrived,
    so none of that step's stores may become L2 content (they are
    dropped and un-indexed); vLLM recomputes from that block, and the blocks
    are stored then."""
    a, tier, keys = publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, hicache_load_mode="layerwise")
    data = b.worker.worker.data
    dropped: list = []
    mark_failed = data._mark_failed_stores

    def record(stores):
        dropped.append(list(stores.block_ids))
        return mark_failed(stores)

    data._mark_failed_stores = record
    if cause == "evicted":
        evict_before_pin(b, tier, keys[3])
    else:
        tear_seal(tier, keys[3])
    longer = PROMPT[:PROMPT_BLOCKS * BLOCK] + list(range(5000, 5000 + 2 * BLOCK + 3))
    b.add("b", longer, max_tokens=1)
    first, later, errors = run_recording_recompute(b)
    assert first == PROMPT_BLOCKS * BLOCK and later[:1] == [3 * BLOCK]
    assert len(errors) == 2  # the fourth and fifth blocks
    assert len(dropped) == 1 and len(dropped[0]) == 2  # the step's two computed blocks
    # Stored when recomputed.
    pages = b.sched_half.tree.match(b.hashes_of["b"].block_hashes[:7]).pages
    assert pages[5] is not None and pages[6] is not None


@pytest.mark.parametrize("mode", MODES)
def test_a_hit_the_load_gate_declines_is_computed_and_counted_as_node(tiny_model_dir,
                                                                      shm_root, mode):
    a, tier, keys = publish(tiny_model_dir, shm_root)
    b = build(tiny_model_dir, shm_root, hicache_load_mode=mode)
    seen = watch_loads(b)
    half = b.sched_half
    asked = []

    def decline(start, num_tokens, num_pages):
        asked.append((start, num_tokens, num_pages))
        return False

    half.load_gate.load_node = decline
    b.add("b", PROMPT, max_tokens=1)
    b.run()
    assert asked and asked[0] == (0, PROMPT_BLOCKS * BLOCK, PROMPT_BLOCKS)
    assert seen == []
    assert b.first_computed["b"] == 0
    assert half.stats.hit_tokens_l3 == 0
    # Not staged through L2 either: the gate said computing is faster.
    assert not half.l3.in_flight().get("prefetch", 0)
    assert half.load_gate.decisions == {("node", "declined"): PROMPT_BLOCKS * BLOCK}


def test_a_small_private_l2_serves_a_working_set_larger_than_itself(tiny_model_dir,
                                                                   shm_root):
    """hicache_size of 6 pages per instance in front of a 16 MiB tier: the
    L2 stages each request's stores on their way into the tier (it must hold
    one request's chain: the radix tree stays prefix-closed), and three
    prompts of 5 blocks, 15 pages in all, come straight from the tier."""
    small = {"hicache_size": 6 * 16384 / 1e9}
    prompts = [list(range(3000 + 100 * i, 3000 + 100 * i + PROMPT_BLOCKS * BLOCK + 3))
               for i in range(3)]
    for prompt in prompts:
        a, tier, keys = publish(tiny_model_dir, shm_root, prompt, **small)
    assert a.worker.worker.pool.num_pages == 6
    b = build(tiny_model_dir, shm_root, **small)
    assert b.worker.worker.pool.num_pages == 6
    loader = b.worker.worker._node.queue.loader
    for i, prompt in enumerate(prompts):
        b.add(f"b{i}", prompt, max_tokens=1)
        b.run()
        assert b.first_computed[f"b{i}"] == PROMPT_BLOCKS * BLOCK
    assert loader.counts["pages"] == 3 * PROMPT_BLOCKS
    assert loader.counts["misses"] == 0
