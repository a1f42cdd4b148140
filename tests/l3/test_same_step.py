"""Same-step admission of an L3 hit (l3/same_step.py), through vLLM's real
Scheduler and our worker half with an in-process store: the request is
admitted in the step it arrives in, its L1 copies wait (bounded) for the
step's read, and a read that is late or fails is a load error that vLLM
recomputes, never wrong KV."""

from __future__ import annotations

import sys
import threading

import pytest

from tests.connector import mem_backend
from tests.connector.harness import BLOCK
from tests.connector.test_stress_tiering import lookups_answered
from tests.l3.test_planner import forget_l1_and_l2, l3_harness
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.common.stats import key, planner_samples
from vllm_hicache.l3 import lookups as lookups_module
from vllm_hicache.storage.format import HEADER_BYTES

# Long enough for any lookup on a loaded machine (the lookup must answer in
# the pass for same-step admission); every wait ends as soon as it is answered.
GENEROUS_S = 30.0
NUM_BLOCKS = 5


@pytest.fixture(autouse=True)
def lookups_answer_in_the_pass(monkeypatch):
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", GENEROUS_S)


# Every test runs on a store that reads whole objects and on one that reads
# byte ranges, where the worker's copies follow the read layer by layer.
@pytest.fixture(autouse=True, params=["MemBackend", "RangedMemBackend"])
def backend_class(request, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BACKEND_CLASS", request.param)
    return request.param


BACKEND_CLASS = "MemBackend"


def warm_l3(tiny_model_dir, read_wait_ms: float = 1000.0, **extra):
    """A harness whose L3 holds request "a"'s blocks, L1 and L2 emptied."""
    h, store = l3_harness(tiny_model_dir, same_step_read_wait_ms=read_wait_ms,
                          backend_class=BACKEND_CLASS, **extra)
    # The configuration under test: reads by layer exactly on the ranged store.
    pages = h.worker.worker._rank_l3.io.pages
    assert pages.reads_by_layer == (BACKEND_CLASS == "RangedMemBackend")
    tokens = prompt(40, NUM_BLOCKS * BLOCK + 3)
    h.add("a", tokens)
    h.run()
    h.step()  # the last backup acks
    forget_l1_and_l2(h)
    return h, store, tokens


def admit(h, req_id: str, tokens) -> int:
    """Add the request (unless ``tokens`` is None: added already) and step
    until it is scheduled; the steps that took after the first (0: admitted
    in the step it arrived in)."""
    if tokens is not None:
        h.add(req_id, tokens)
    for waited in range(50):
        so = h.step()
        if any(r.req_id == req_id for r in so.scheduled_new_reqs):
            return waited
    raise AssertionError(f"{req_id} was never scheduled")


def all_blocks_hold_their_kv(h, req_id: str) -> bool:
    req = h.hashes_of[req_id]
    blocks = h.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
    return all(h.check_block(blocks[i], req, i) for i in range(NUM_BLOCKS))


def test_an_l3_hit_is_admitted_in_its_arrival_step(tiny_model_dir):
    h, _, tokens = warm_l3(tiny_model_dir)
    worker_counts: list[dict] = []  # what the worker reports per step
    report = h.worker.get_kv_connector_stats

    def recording_report():
        stats = report()
        if stats is not None:
            worker_counts.append(dict(stats.data.get("counters", {})))
        return stats

    h.worker.get_kv_connector_stats = recording_report
    stored = h.sched_half.stats.stored_blocks
    assert admit(h, "b", tokens) == 0
    # The blocks read for it reach L2 as the read commits: never stored
    # again from L1 (a copy, and a second page each, for nothing).
    assert h.sched_half.stats.stored_blocks == stored
    assert not any(c.get(key("transfer_bytes", "store")) for c in worker_counts), worker_counts
    # The step's forward waited for the read, and says how long.
    waits = [c[key("l3_same_step_wait_seconds")] for c in worker_counts
             if key("l3_same_step_wait_seconds") in c]
    assert len(waits) == 1 and waits[0] > 0, worker_counts
    assert h.first_computed["b"] == NUM_BLOCKS * BLOCK  # all of it from L3
    assert h.sched_half.l3.same_step_admitted == 1
    assert planner_samples(h.sched_half.l3)[key("prefetches", "same_step")] == 1  # the metric
    assert h.sched_half.stats.hit_tokens_l3 == NUM_BLOCKS * BLOCK  # counted as L3 hits
    assert h.load_checks and all(h.load_checks)  # every loaded block holds its KV
    assert all_blocks_hold_their_kv(h, "b")
    assert h.sched_half.stats.load_error_blocks == 0
    h.sched_half.check_integrity()
    h.run()
    assert h.sched_half.l3.prefetched_blocks == NUM_BLOCKS  # and now an L2 hit for others
    assert_clean(h)


def test_without_the_option_the_hit_waits_a_step(tiny_model_dir):
    """The negative control: same store, same request, option off."""
    h, _, tokens = warm_l3(tiny_model_dir, read_wait_ms=0.0)
    assert admit(h, "b", tokens) == 1
    assert h.first_computed["b"] == NUM_BLOCKS * BLOCK
    assert h.sched_half.l3.same_step_admitted == 0
    h.run()
    assert_clean(h)


def test_an_l2_part_and_an_l3_part_load_in_one_step(tiny_model_dir):
    h, _, tokens = warm_l3(tiny_model_dir)
    h.add("short", tokens[: 2 * BLOCK + 1])  # brings blocks 0, 1 back into L2
    h.run()
    assert h.scheduler.reset_prefix_cache()  # L1 only: L2 keeps 0, 1
    h.kv_zero()
    stats = h.sched_half.stats
    l2_before, l3_before = stats.hit_tokens_l2, stats.hit_tokens_l3
    assert admit(h, "b", tokens) == 0
    assert h.first_computed["b"] == NUM_BLOCKS * BLOCK
    assert (stats.hit_tokens_l2 - l2_before, stats.hit_tokens_l3 - l3_before) == (
        2 * BLOCK, (NUM_BLOCKS - 2) * BLOCK)
    assert all(h.load_checks) and all_blocks_hold_their_kv(h, "b")
    h.run()
    assert_clean(h)


def late_reads(h, gate: threading.Event, then=None):
    """The worker's copy waits for reads the store holds back (``gate``);
    once the copy has given up, ``then()`` runs and the store lets them go.
    On CPU the copy's first wait is for the first layer (StreamedLoads)."""
    rank = h.worker.worker._rank_l3
    real = rank.wait_layer
    seen = []

    def wait_layer(generation, op_id, layer, num_pages, timeout_s):
        read = real(generation, op_id, layer, num_pages, timeout_s)
        seen.append(read)
        if then is not None:
            then()
        gate.set()
        return read

    rank.wait_layer = wait_layer
    return seen


def test_a_late_read_is_a_load_error_and_is_recomputed(tiny_model_dir):
    h, store, tokens = warm_l3(tiny_model_dir, read_wait_ms=20.0)
    name = h.sched_half.l3.backend.store_name
    mem_backend.GATES[name] = gate = threading.Event()
    try:
        seen = late_reads(h, gate)
        assert admit(h, "b", tokens) == 0
    finally:
        gate.set()
        del mem_backend.GATES[name]
    assert seen == [0]  # nothing was read within the wait
    assert h.sched_half.stats.load_error_blocks == NUM_BLOCKS
    assert h.scheduler.requests["b"].num_computed_tokens < NUM_BLOCKS * BLOCK
    h.step()  # vLLM recomputes the blocks
    assert all_blocks_hold_their_kv(h, "b")  # the answer equals recomputation
    h.run()
    # The read did land: later requests hit it in L2.
    assert h.sched_half.l3.prefetched_blocks == NUM_BLOCKS
    forget_l1 = h.scheduler.reset_prefix_cache()
    assert forget_l1
    h.kv_zero()
    assert admit(h, "c", tokens) == 0
    assert all(h.load_checks) and all_blocks_hold_their_kv(h, "c")
    h.run()
    assert_clean(h)


def test_a_read_that_fails_its_seal_loads_only_what_came_before(tiny_model_dir):
    h, store, tokens = warm_l3(tiny_model_dir)
    bad = 2
    victim = h.sched_half.l3.namespaces[0].object_keys([h.hashes_of["a"].block_hashes[bad]])[0]
    blob = bytearray(store[victim])
    blob[200] ^= 0xFF
    store[victim] = bytes(blob)
    assert admit(h, "b", tokens) == 0
    assert h.sched_half.stats.load_error_blocks == NUM_BLOCKS - bad
    req, blocks = h.hashes_of["b"], h.scheduler.kv_cache_manager.get_block_ids("b")[0]
    assert all(h.check_block(blocks[i], req, i) for i in range(bad))  # loaded and right
    h.step()  # the rest recomputed
    assert all_blocks_hold_their_kv(h, "b")
    h.run()
    assert h.sched_half.l3.prefetched_blocks == bad  # only verified pages are indexed
    # The recomputed blocks were stored: L2 holds the whole prompt again.
    assert h.sched_half.tree.match(req.block_hashes[:NUM_BLOCKS]).num_blocks == NUM_BLOCKS
    assert_clean(h)


def test_an_abort_mid_read_leaks_nothing(tiny_model_dir):
    """The read is still running when the request is aborted, after the
    step that admitted it: the op completes and serves L2, no pin leaks."""
    from vllm.v1.request import RequestStatus

    h, _, tokens = warm_l3(tiny_model_dir, read_wait_ms=20.0)
    name = h.sched_half.l3.backend.store_name
    mem_backend.GATES[name] = gate = threading.Event()
    try:
        h.add("b", tokens)
        so = h.step(complete_async=False)  # the copy gives up; the read is held
        assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
        assert h.sched_half.l3.prefetch_pages()  # the read is open
        h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        h.sched_half.check_integrity()
    finally:
        gate.set()
        del mem_backend.GATES[name]
    assert h.worker.worker._io.wait_idle(10)
    h.step()
    h.sched_half.check_integrity()
    assert not h.sched_half.l3.prefetch_pages()
    assert h.sched_half.l3.prefetched_blocks == NUM_BLOCKS  # the read still serves L2
    assert_clean(h)


def test_a_busy_engine_falls_back_to_waiting(tiny_model_dir):
    """vLLM has no slot for the request in its arrival step: the read goes
    out anyway and the request is admitted later as an L2 hit."""
    h, _, tokens = warm_l3(tiny_model_dir, max_num_seqs=1)
    h.add("blocker", prompt(99, BLOCK + 1), max_tokens=6)
    h.step()
    h.add("b", tokens)
    lookups_answered(h)  # b's lookup is planned while b has no slot
    so = h.step()
    assert not so.scheduled_new_reqs
    assert h.sched_half.l3.prefetch_started == 1  # the read went out without b
    assert admit(h, "b", None) > 0
    assert h.sched_half.l3.same_step_admitted == 0
    assert h.first_computed["b"] == NUM_BLOCKS * BLOCK
    assert all(h.load_checks)
    h.run()
    assert_clean(h)


def test_requests_sharing_a_prefix_are_admitted_together(tiny_model_dir):
    """c shares b's blocks in L1 (loaded this very step); c's own read starts
    after them, so c is admitted in the same step too, every block read once."""
    h, _, tokens = warm_l3(tiny_model_dir)
    h.add("b", tokens[: 3 * BLOCK + 1])  # blocks 0-2
    h.add("c", tokens)  # blocks 0-2 shared with b, 3-4 its own
    so = h.step()
    assert sorted(r.req_id for r in so.scheduled_new_reqs) == ["b", "c"]
    assert h.first_computed["b"] == 3 * BLOCK and h.first_computed["c"] == NUM_BLOCKS * BLOCK
    assert h.sched_half.l3.same_step_admitted == 2
    assert h.sched_half.stats.hit_tokens_l3 == NUM_BLOCKS * BLOCK  # no block read twice
    assert all(h.load_checks) and all_blocks_hold_their_kv(h, "c")
    h.run()
    assert_clean(h)


@pytest.mark.parametrize("backend_class", ["RangedMemBackend"], indirect=True)
def test_a_layer_that_comes_late_fails_the_whole_load(tiny_model_dir, backend_class):
    """Layer 0 arrives, layer 1 does not within the budget: what was copied
    of the request is incomplete, so every block of its load is a load error
    and is recomputed; the read still lands for later requests."""
    h, store, tokens = warm_l3(tiny_model_dir, read_wait_ms=50.0)
    pages = h.worker.worker._rank_l3.io.pages
    layer_bytes = pages.payload_bytes // pages.pool.num_layers
    name = h.sched_half.l3.backend.store_name
    mem_backend.RANGE_GATES[name] = (HEADER_BYTES + layer_bytes, gate := threading.Event())
    rank = h.worker.worker._rank_l3
    real, seen = rank.wait_layer, []

    def wait_layer(generation, op_id, layer, num_pages, timeout_s):
        seen.append(real(generation, op_id, layer, num_pages, timeout_s))
        if layer == 1:  # given up on: let the read go on
            gate.set()
        return seen[-1]

    rank.wait_layer = wait_layer
    try:
        assert admit(h, "b", tokens) == 0
    finally:
        gate.set()
        del mem_backend.RANGE_GATES[name]
    assert seen == [NUM_BLOCKS, 0]  # layer 0 came, layer 1 did not: no wait after that
    assert h.sched_half.stats.load_error_blocks == NUM_BLOCKS
    h.step()  # vLLM recomputes the blocks
    assert all_blocks_hold_their_kv(h, "b")  # the answer equals recomputation
    h.run()
    assert h.sched_half.l3.prefetched_blocks == NUM_BLOCKS
    assert_clean(h)
