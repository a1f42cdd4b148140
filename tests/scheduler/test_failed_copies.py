"""FailedCopies on its own: a real HiRadixTree and page ops, fake block
tables, a fake vLLM block pool and fake connector outputs (what
HiCacheScheduler.update_connector_output passes it)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace

from vllm_hicache.common.page_ops import OpKind, PageOp, PageOps, PinnedRange
from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.policy import make_eviction_policy
from vllm_hicache.scheduler.failed_copies import FailedCopies


def chain_of(name: str, num_blocks: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(num_blocks))


@dataclass
class FakeState:
    block_ids: list[int]


class FakeBlockPool:
    """The one BlockPool call drop_l1_blocks makes."""

    def __init__(self) -> None:
        self.evicted: set[int] = set()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted |= block_ids


def output(invalid_block_ids=(), failed_recving=None):
    return SimpleNamespace(invalid_block_ids=set(invalid_block_ids), failed_recving=failed_recving)


class Rig:
    """FailedCopies wired as HiCacheScheduler wires it, on 32 L2 pages."""

    def __init__(self) -> None:
        self.tree = HiRadixTree(32, make_eviction_policy("lru"))
        self.ops = PageOps(self.tree)
        self.stats = HiCacheStats()
        self.reqs: dict[str, FakeState] = {}
        self.pool = FakeBlockPool()
        self.failed = FailedCopies(self.tree, self.ops, self.stats, self.reqs)
        self.failed.bind(self.pool)  # type: ignore[arg-type]

    def cached(self, name: str, num_blocks: int) -> tuple[tuple[bytes, ...], list[int]]:
        chain = chain_of(name, num_blocks)
        pages = self.tree.alloc(num_blocks)
        assert pages is not None
        assert not self.tree.insert(chain, pages)
        return chain, pages

    def load(self, kind: OpKind, req_id: str, name: str, l1_blocks: list[int]) -> PageOp:
        """A request loading ``name``'s cached chain into ``l1_blocks``, pinned."""
        chain, pages = self.cached(name, len(l1_blocks))
        self.reqs[req_id] = FakeState(list(l1_blocks))
        blocks = tuple(range(len(chain)))
        return self.ops.open(kind, 0, [PinnedRange(chain, blocks, tuple(pages))], req_id,
                             l1_blocks)

    def indexed_blocks(self, name: str, num_blocks: int) -> int:
        """How many leading blocks of ``name``'s chain L2 still holds."""
        pages = self.tree.match(chain_of(name, num_blocks)).pages
        return next((i for i, p in enumerate(pages) if p is None), len(pages))


def test_a_failed_block_drops_its_request_from_there_on_in_l1_and_l2():
    rig = Rig()
    rig.load(OpKind.LOAD, "a", "a", [10, 11, 12, 13])
    rig.load(OpKind.LOAD, "b", "b", [20, 21])
    # Block 12 failed: "a" recomputes from its third block on, "b" is fine.
    rig.failed.drop_failed_copies(output(invalid_block_ids={12}), None)
    assert rig.pool.evicted == {12, 13}
    assert rig.indexed_blocks("a", 4) == 2
    assert rig.indexed_blocks("b", 2) == 2
    assert rig.stats.load_error_blocks == 1
    assert rig.stats.invalidated_pages == 2


def test_failed_blocks_of_several_requests_in_one_step():
    rig = Rig()
    rig.load(OpKind.LOAD, "a", "a", [10, 11, 12])
    rig.load(OpKind.LOAD, "b", "b", [20, 21, 22, 23])
    rig.load(OpKind.LOAD, "c", "c", [30, 31])
    rig.failed.drop_failed_copies(output(invalid_block_ids={11, 22}), None)
    assert rig.pool.evicted == {11, 12, 22, 23}
    assert (rig.indexed_blocks("a", 3), rig.indexed_blocks("b", 4),
            rig.indexed_blocks("c", 2)) == (1, 2, 2)
    assert rig.stats.load_error_blocks == 2


def test_failed_async_loads_of_several_requests_leave_the_index():
    rig = Rig()
    for req_id, l1_blocks in (("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6, 7])):
        rig.load(OpKind.ASYNC_LOAD, req_id, req_id, l1_blocks)
    rig.failed.drop_failed_requests(output(failed_recving={"a", "b"}))
    assert [rig.indexed_blocks(r, n) for r, n in (("a", 3), ("b", 2), ("c", 2))] == [0, 0, 2]
    assert rig.stats.load_error_blocks == 5
    assert rig.stats.invalidated_pages == 5
    assert rig.pool.evicted == set()  # vLLM takes per-request failures itself


def test_a_failed_loads_pins_stay_with_its_op_until_it_ends():
    """Its pages leave the index at once but stay allocated while the copy's
    op is live; the scheduler's finished_recving closes it, and they go free."""
    rig = Rig()
    op = rig.load(OpKind.ASYNC_LOAD, "a", "a", [1, 2, 3])
    free = rig.tree.num_free_pages
    rig.failed.drop_failed_requests(output(failed_recving={"a"}))
    assert rig.indexed_blocks("a", 3) == 0
    assert rig.ops.num_live(OpKind.ASYNC_LOAD) == 1 and not op.closed
    assert rig.tree.num_free_pages == free
    rig.ops.close(op)
    assert rig.tree.num_free_pages == free + 3
    rig.tree.check_integrity()


def test_a_failed_store_drops_its_page_and_what_hangs_below():
    rig = Rig()
    chain, pages = rig.cached("s", 4)
    rig.ops.open(OpKind.STORE, 0, [PinnedRange(chain, (0, 1, 2, 3), tuple(pages))])
    rig.failed.drop_failed_copies(output(), HiCacheWorkerMetadata(failed_store_pages={pages[1]}))
    assert rig.indexed_blocks("s", 4) == 1
    assert rig.stats.invalidated_pages == 3
    assert rig.stats.load_error_blocks == 0
    assert rig.pool.evicted == set()
