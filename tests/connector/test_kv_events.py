"""KV cache events of L2 (medium CPU) and L3 (medium STORAGE), as vLLM's
real Scheduler publishes them: ``update_from_output`` takes the
connector's events every step and hands a ``KVEventBatch`` to its
publisher (here a recorder in place of vLLM's ZMQ one)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tests.connector.harness import BLOCK, make_harness
from tests.l3.test_planner import forget_l1_and_l2, l3_harness
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.connector.kv_events import KVEventLog, contiguous_runs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def take(self, kind=None, medium=None) -> list:
        out = [e for e in self.events
               if (kind is None or isinstance(e, kind)) and (medium is None or e.medium == medium)]
        self.events = [e for e in self.events if e not in out]
        return out


def with_events(h) -> Recorder:
    h.sched_half.events = KVEventLog(True, BLOCK)
    h.scheduler.kv_event_publisher = recorder = Recorder()
    return recorder


def ext(hashes) -> list:
    return [maybe_convert_block_hash(x) for x in hashes]


def test_runs_and_bounds():
    assert contiguous_runs([]) == []
    assert contiguous_runs([3, 4, 5]) == [(3, 6)]
    assert contiguous_runs([0, 1, 3, 5, 6]) == [(0, 2), (3, 4), (5, 7)]
    log = KVEventLog(True, BLOCK, max_events=3)
    for i in range(5):
        log.removed("CPU", [bytes([i]) * 32])
    assert log.dropped == 2 and len(log) == 3
    assert [e.block_hashes for e in log.take()] == [ext([bytes([i]) * 32]) for i in (2, 3, 4)]
    assert log.take() == [] and len(log) == 0
    off = KVEventLog(False, BLOCK)
    off.removed("CPU", [b"x" * 32])
    off.stored("CPU", [b"x" * 32], [0])
    assert off.take() == []


def test_l2_stores_evictions_and_reset(tiny_model_dir):
    # L2 = 1.5 x 32 = 48 pages.
    h = make_harness(tiny_model_dir, num_blocks=32, hicache_ratio=1.5)
    rec = with_events(h)
    tokens = prompt(80, 5 * BLOCK + 2)
    req = h.add("a", tokens, max_tokens=2)
    h.run()
    [stored] = rec.take(BlockStored, "CPU")
    assert stored.block_hashes == ext(req.block_hashes[:5])
    assert stored.parent_block_hash is None
    assert stored.token_ids == tokens[: 5 * BLOCK]
    assert stored.block_size == BLOCK and stored.group_idx == 0
    assert rec.take(BlockRemoved) == []

    # A prompt extending a's first two blocks stores only its own three:
    # the event names its parent.
    other = tokens[: 2 * BLOCK] + prompt(81, 3 * BLOCK + 2)
    b = h.add("b", other, max_tokens=2)
    h.run()
    [stored] = rec.take(BlockStored, "CPU")
    assert stored.block_hashes == ext(b.block_hashes[2:5])
    assert stored.parent_block_hash == ext(req.block_hashes[1:2])[0]
    assert stored.token_ids == other[2 * BLOCK: 5 * BLOCK]

    # Evictions: 9 more prompts of 5 blocks overflow 48 pages by 5.
    for i in range(9):
        h.add(f"f{i}", prompt(90 + i, 5 * BLOCK + 2), max_tokens=2)
        h.run()
    removed = rec.take(BlockRemoved, "CPU")
    assert sum(len(e.block_hashes) for e in removed) == h.sched_half.stats.evicted_pages == 5
    # LRU: a's own tail, then b's, trimmed from its end (both share blocks 0, 1).
    assert {x for e in removed for x in e.block_hashes} == set(
        ext(req.block_hashes[2:5] + b.block_hashes[3:5]))
    rec.take()
    # reset_cache: every block left L2, one event.
    held = h.sched_half.tree.num_cached_pages
    assert h.scheduler.connector.reset_cache()
    h.step()
    [cleared] = rec.take(BlockRemoved, "CPU")
    assert len(cleared.block_hashes) == held == 48
    assert_clean(h)


def test_l3_backups_announce_only_what_was_written(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir)
    rec = with_events(h)
    backend = h.worker.worker._io.pages.backend
    put = backend.put
    tokens = prompt(82, 5 * BLOCK + 3)
    req = h.add("a", tokens)
    rejected = h.sched_half.l3.namespaces[0].object_keys([req.block_hashes[3]])[0]

    def refusing_put(keys, sources):  # the store refuses block 3's object
        return [k != rejected and put([k], [s])[0] for k, s in zip(keys, sources)]

    backend.put = refusing_put
    h.run()
    h.step()  # the last acks
    l3 = rec.take(BlockStored, "STORAGE")
    assert [e.block_hashes for e in l3] == [ext(req.block_hashes[:3]), ext(req.block_hashes[4:5])]
    assert [e.parent_block_hash for e in l3] == [None, ext([req.block_hashes[3]])[0]]
    assert all(e.ownership == "mem" and e.token_ids == [] for e in l3)
    assert_clean(h)


def test_l3_prefetch_commits_and_unreadable_objects(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    rec = with_events(h)
    tokens = prompt(83, 5 * BLOCK + 3)
    req = h.add("a", tokens)
    h.run()
    h.step()
    assert len(rec.take(BlockStored, "STORAGE")) == 1
    victim = h.sched_half.l3.namespaces[0].object_keys([req.block_hashes[3]])[0]
    blob = bytearray(store[victim])
    blob[200] ^= 0xFF
    store[victim] = bytes(blob)
    forget_l1_and_l2(h)
    h.step()
    [cleared] = rec.take(BlockRemoved, "CPU")
    assert sorted(cleared.block_hashes) == sorted(ext(req.block_hashes[:5]))
    rec.take()

    # Back from L3: blocks 0-2 committed into L2 (CPU, no token ids); the
    # prefetch stops at block 3, which does not verify: announced gone
    # from L3 with the rest of that prefetch.
    h.add("b", tokens)
    h.run()
    assert h.first_computed["b"] == 3 * BLOCK
    committed = rec.take(BlockStored, "CPU")
    assert committed[0].block_hashes == ext(req.block_hashes[:3])
    assert committed[0].token_ids == []
    [gone] = rec.take(BlockRemoved, "STORAGE")
    assert gone.block_hashes == ext(req.block_hashes[3:5]) and gone.ownership == "mem"
    assert h.sched_half.l3.prefetch_incomplete == 1
    assert_clean(h)
