"""The L2 -> L3 boundary in the L3 planner: the admission rule in inclusive
mode (declined now, admitted by a later hit), and exclusive (victim) mode:
stored pages held until L2 needs their room, backed up before they can be
freed, declined ones released unwritten, holds dropped with L2."""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.page_ops import OpKind, PageOps, PinnedRange
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.l3.victims import reserve_pages
from vllm_hicache.policy.admission import L3Mode, parse_admission
from vllm_hicache.policy.eviction import make_eviction_policy

BLOCK = 16


def chain(tag: int, n: int) -> tuple[bytes, ...]:
    return tuple(bytes([tag, i]) * 16 for i in range(n))


class Rig:
    def __init__(self, num_pages: int, rule: str = "always",
                 mode: L3Mode = L3Mode.INCLUSIVE) -> None:
        storage = make_config(hicache_storage_backend="file",
                              hicache_storage_backend_extra_config={}).storage
        backend = MemBackend({"store": uuid.uuid4().hex}, {})
        self.tree = HiRadixTree(num_pages, make_eviction_policy("lru"))
        self.ops = PageOps(self.tree)
        self.planner = L3Planner(storage, backend, [], BLOCK, world_size=2,
                                 max_inflight_pages=num_pages,
                                 ctx=PlannerContext(self.tree, self.ops),
                                 admission=parse_admission(rule), mode=mode)
        self.step = 0

    def store(self, hashes: tuple[bytes, ...]) -> list[PinnedRange]:
        """What L2StorePlanner does for a computed chain: pages, pinned by a STORE."""
        pages = self.tree.alloc_up_to(len(hashes))
        n = len(pages)
        if not n:
            return []
        self.tree.insert(list(hashes[:n]), list(pages))
        rng = PinnedRange(hashes[:n], tuple(range(n)), tuple(pages))
        self.ops.open(OpKind.STORE, self.step, [rng])
        return [rng]

    def end_step(self, stored: list[PinnedRange]):
        jobs = self.planner.plan_backups(stored, self.step)
        self.step += 1
        self.ops.close_step(self.step)
        assert not self.ops.check() and not self.planner.check()
        self.tree.check_integrity()
        return jobs

    def ack(self, jobs, ranks=(0, 1)) -> None:
        for job in jobs:
            self.planner.on_worker_meta(HiCacheWorkerMetadata(backups={job.op_id: set(ranks)}))


def backed(jobs) -> list[bytes]:
    return [h for job in jobs for h in job.hashes]


def test_inclusive_hits_2_backs_up_on_the_second_use():
    rig = Rig(16, "hits:2")
    a = chain(1, 3)
    assert rig.end_step(rig.store(a)) == []  # computed once: declined
    assert rig.planner.backups.admission.num_declined == 3
    rig.planner.backups.note_use(a[:2])  # a second request hits the first two blocks
    jobs = rig.end_step([])
    assert backed(jobs) == list(a[:2])  # from L2, the step after the hit
    assert rig.planner.backups.admission.num_admitted_later == 2


def test_inclusive_always_is_todays_write_through():
    rig = Rig(16)
    a = chain(1, 3)
    assert backed(rig.end_step(rig.store(a))) == list(a)


def test_a_declined_block_gone_from_l2_is_not_backed_up():
    rig = Rig(4, "hits:2")
    a, b = chain(1, 2), chain(2, 4)
    rig.end_step(rig.store(a))
    rig.end_step(rig.store(b))  # evicts a
    rig.planner.backups.note_use(a)
    assert rig.end_step([]) == []


def test_exclusive_holds_until_l2_needs_the_room():
    rig = Rig(32, mode=L3Mode.EXCLUSIVE)
    reserve = reserve_pages(32)
    a = chain(1, 8)
    assert rig.end_step(rig.store(a)) == []  # room to spare: nothing written
    assert rig.tree.num_locked_pages == 8  # held, not evictable
    rig.end_step(rig.store(chain(2, 12)))
    b = chain(3, 10)
    jobs = rig.end_step(rig.store(b))  # 30 held: below the reserve
    written = backed(jobs)
    assert written and set(written) <= set(a) | set(chain(2, 12))
    assert set(a) <= set(written)  # the oldest first
    # Until every rank acked, the written pages stay pinned.
    rig.ack(jobs, ranks=(0,))
    assert rig.tree.num_free_pages + rig.tree.num_cached_pages - rig.tree.num_locked_pages \
        < reserve
    rig.ack(jobs, ranks=(1,))
    evictable = rig.tree.num_free_pages + rig.tree.num_cached_pages - rig.tree.num_locked_pages
    assert evictable >= reserve
    assert rig.planner.backups.victims.num_backed_up == len(written)


def test_exclusive_uses_make_a_hold_recent():
    rig = Rig(16, mode=L3Mode.EXCLUSIVE)
    a, b = chain(1, 6), chain(2, 6)
    rig.end_step(rig.store(a))
    rig.end_step(rig.store(b))
    rig.planner.backups.note_use(a)  # a is hot again: b leaves first
    jobs = rig.end_step(rig.store(chain(3, 4)))
    assert set(backed(jobs)) <= set(b) and backed(jobs)


def test_exclusive_declined_pages_are_released_unwritten():
    rig = Rig(16, "hits:2", mode=L3Mode.EXCLUSIVE)
    a, b = chain(1, 6), chain(2, 6)
    rig.end_step(rig.store(a))
    rig.planner.backups.note_use(a[:3])  # a's first three blocks: 2 uses
    rig.end_step(rig.store(b))
    jobs = rig.end_step(rig.store(chain(3, 4)))
    assert backed(jobs) == list(a[:3])
    assert rig.planner.backups.victims.num_declined >= 3  # a[3:] released unwritten


def test_exclusive_waits_for_backups_when_every_page_is_held():
    rig = Rig(8, mode=L3Mode.EXCLUSIVE)
    jobs = rig.end_step(rig.store(chain(1, 8)))
    assert backed(jobs)  # L2 full of held pages: the oldest go out now
    assert rig.store(chain(2, 8)) == []  # and L2 waits for their acks
    rig.ack(jobs)
    assert len(rig.store(chain(2, 8))[0].blocks) == len(backed(jobs))


def test_l2_only_by_value_and_release():
    rig = Rig(32, "hits:1", mode=L3Mode.EXCLUSIVE)
    a, b = chain(1, 2), chain(2, 2)
    rig.end_step(rig.store(a) + rig.store(b))
    rig.planner.backups.note_use(b)
    listed = rig.planner.backups.l2_only_by_value()
    # b[1]: 2 uses x 32 tokens; a[1] and b[0]: 32; a[0]: 16.
    assert [(c[-1], v) for c, _, v in listed[:1]] == [(b[1], 64)]
    assert [v for *_, v in listed] == [64, 32, 32, 16]
    assert [v for *_, v in listed] == sorted((v for *_, v in listed), reverse=True)
    assert rig.planner.backups.release_l2() == 4
    assert rig.tree.num_locked_pages == 0 and rig.planner.backups.l2_only_by_value() == []


def test_inclusive_lists_deferred_backups_as_l2_only():
    rig = Rig(16)
    rig.planner.backups.max_backup_pages = 0  # every backup deferred
    a = chain(1, 3)
    assert rig.end_step(rig.store(a)) == []
    assert sorted(c[-1] for c, _, _ in rig.planner.backups.l2_only_by_value()) == sorted(a)


@pytest.mark.parametrize("mode", list(L3Mode))
def test_a_lookups_only_planner_takes_either_mode(mode):
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config={}).storage
    planner = L3Planner(storage, MemBackend({"store": uuid.uuid4().hex}, {}), [], BLOCK,
                        world_size=1, max_inflight_pages=8, mode=mode)
    assert planner.backups.victims is None and planner.check() == []
    planner.close()


def test_exclusive_value_rule_writes_the_prefix_of_what_it_admits():
    """value:48, one use each (block i is worth (i + 1) x 16). L2 of 8 pages
    keeps 4 free or evictable. Storing a (4 blocks) after b (2) leaves 2:
    b, the oldest hold, is released unwritten (16, 32). Storing c leaves
    none: a is released, blocks 2 and 3 (48, 64) pass and blocks 0 and 1
    go with them."""
    rig = Rig(8, "value:48", mode=L3Mode.EXCLUSIVE)
    a, b, c = chain(1, 4), chain(2, 2), chain(3, 2)
    assert rig.end_step(rig.store(b)) == []
    assert rig.end_step(rig.store(a)) == []
    assert rig.planner.backups.victims.num_declined == 2
    assert backed(rig.end_step(rig.store(c))) == list(a)


def test_a_hit_stored_again_by_the_same_request_is_one_use():
    """A request whose prefix vLLM's own cache served stores the blocks L2
    lacks in the same step: note_use counted its hit, the store is not a
    second use (hits:2 declines them); a later request's hit is."""
    rig = Rig(16, "hits:2")
    a = chain(1, 3)
    rig.planner.backups.note_use(a)  # the hit (update_state_after_alloc)...
    assert rig.end_step(rig.store(a)) == []  # ...and its store, same step
    assert [rig.planner.backups.admission.hits(h) for h in a] == [1, 1, 1]
    rig.planner.backups.note_use(a)  # another request, a later step
    assert backed(rig.end_step([])) == list(a)
