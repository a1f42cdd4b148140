"""PrefetchOps (l3/prefetch_ops.py) on its own: an op's pages, its commits
as the ranks report, its end, and the ops that never go out, against a real
radix tree and real lookup records (tests/l3/test_lookups.py's store)."""

from __future__ import annotations

from tests.l3.test_lookups import CHAIN, NS, GatedStore, finished
from vllm_hicache.common.events import MEDIUM_L2, MEDIUM_L3, EventLog
from vllm_hicache.common.jobs import PrefetchProgress
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.lookups import L3Lookup, L3Lookups
from vllm_hicache.l3.prefetch_ops import GENERATION_SHIFT, PrefetchOps
from vllm_hicache.l3.removals import RemovedKeys
from vllm_hicache.policy.eviction import make_eviction_policy

NUM_PAGES = 8


class Rig:
    """A PrefetchOps over an 8-page tree, with request "r"'s lookup answered
    (a 4-block hit)."""

    def __init__(self, world_size: int) -> None:
        store = GatedStore(hit=len(CHAIN))
        store.gate.set()
        self.lookups = L3Lookups(store, [NS])  # type: ignore[arg-type]
        self.lookups.start("r", CHAIN, 0, deadline=1e18, nowait=False)
        finished(self.lookups, 1)
        self.tree = HiRadixTree(NUM_PAGES, make_eviction_policy("lru"))
        self.events = EventLog(True, 16)
        self.ops = PrefetchOps(self.lookups, RemovedKeys([NS]), "mem", world_size, NUM_PAGES)

    @property
    def lookup(self) -> L3Lookup:
        lookup = self.lookups.get("r")
        assert lookup is not None
        return lookup

    def report(self, op_id: int, rank: int, done: int, finished: bool) -> None:
        meta = HiCacheWorkerMetadata(prefetch={op_id: {rank: PrefetchProgress(done, finished)}})
        self.ops.on_worker_meta(meta, self.tree, self.events)

    def close(self) -> None:
        self.lookups.close()


def test_a_partial_read_commits_what_every_rank_verified_and_frees_the_rest():
    rig = Rig(world_size=2)
    pages = rig.tree.alloc(4)
    assert pages is not None
    job = rig.ops.start(rig.lookup, 0, list(pages), waited=True)
    assert job.hashes == CHAIN and job.pages == tuple(pages)
    assert rig.lookup.op is not None and rig.lookup.op.op_id == job.op_id
    assert rig.ops.inflight_pages == 4 and rig.ops.room_pages == NUM_PAGES - 4
    rig.report(job.op_id, 0, 3, True)
    assert rig.tree.match(CHAIN).num_blocks == 0  # rank 1 has not reported
    rig.report(job.op_id, 1, 2, False)
    assert rig.tree.match(CHAIN).pages == pages[:2]  # the min over ranks
    assert rig.ops.uncommitted_pages() == set(pages[2:])
    assert rig.ops.prefetched_range("r") == (0, 2) and rig.ops.prefetched_blocks == 2
    rig.report(job.op_id, 1, 1, True)  # a stale count: what was committed stays
    # Both ranks finished: the op ends with blocks 2, 3 never verified.
    assert rig.ops.num_open() == 0 and rig.ops.inflight_pages == 0
    assert rig.ops.incomplete == 1 and rig.lookup.done
    assert rig.tree.match(CHAIN).pages == pages[:2]
    assert rig.tree.allocated_pages() == frozenset()  # pages 2, 3 went back
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in rig.events.take()] == [
        ("StoredBlocks", MEDIUM_L2, list(CHAIN[:2])),
        ("RemovedBlocks", MEDIUM_L3, list(CHAIN[2:]))]
    assert rig.ops.prefetched_range("r") == (0, 2)  # still the request's
    rig.close()


def test_a_held_same_step_op_goes_out_once_or_is_aborted_with_its_pages():
    rig = Rig(world_size=1)
    pages = rig.tree.alloc(4)
    assert pages is not None
    job = rig.ops.start(rig.lookup, 0, list(pages), waited=True)
    op = rig.lookup.op
    rig.ops.hold(op, job)
    assert op.unsent
    assert rig.ops.take_unsent() == [job] and not op.unsent
    assert rig.ops.take_unsent() == []  # once
    # A second pass holds another op; a replace drops it before it is sent.
    rig.lookups.forget("r")
    rig.lookups.start("r", CHAIN, 0, deadline=1e18, nowait=False)
    finished(rig.lookups, 1)
    more = rig.tree.alloc(2)
    assert more is not None
    held = rig.ops.start(rig.lookup, 2, list(more), waited=False)
    rig.ops.hold(rig.lookup.op, held)
    rig.ops.abort_unsent(rig.tree)
    assert rig.ops.num_open() == 1 and rig.ops.inflight_pages == 4  # the sent op stays
    assert rig.ops.uncommitted_pages() == set(pages)
    assert rig.tree.allocated_pages() == frozenset(pages)  # the held op's pages are free
    assert rig.ops.take_unsent() == []
    rig.report(job.op_id, 0, 4, True)
    assert rig.ops.num_open() == 0 and rig.tree.match(CHAIN).pages == pages
    rig.close()


def test_a_probe_reads_within_the_room_under_the_generations_op_ids():
    rig = Rig(world_size=1)
    rig.ops.set_generation(3)
    pages = rig.tree.alloc(6)
    assert pages is not None
    job = rig.ops.start(rig.lookup, 0, list(pages[:3]), waited=False)
    filler = rig.ops.start(rig.lookup, 0, list(pages[3:]), waited=False)
    assert rig.ops.room_pages == 2

    def alloc(chain, matched, num):
        return rig.tree.alloc(num)

    (probe,) = rig.ops.probe(rig.lookup, len(CHAIN), rig.tree, alloc)
    assert len(probe.pages) == 2 and probe.hashes == CHAIN[:2]  # the room, not the hit
    assert rig.lookup.op.op_id == filler.op_id  # a probe is nobody's op
    assert all(j.op_id >> GENERATION_SHIFT == 3 and j.generation == 3
               for j in (job, filler, probe))
    assert rig.ops.room_pages == 0 and rig.ops.probe(rig.lookup, 4, rig.tree, alloc) == []
    rig.close()
