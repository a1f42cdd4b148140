"""The replay (planner/l1.py, replay.py) on hand-made logs whose answers are
worked out by hand in each docstring. Blocks are 16 tokens; a prompt of n
blocks + 1 token may hit all n (vLLM computes at least one token)."""

from __future__ import annotations

from tests.planner.logs import BS, LogBuilder, blocks
from vllm_hicache.planner.l1 import l1_pass
from vllm_hicache.planner.replay import ReplayConfig, replay


def run(b: LogBuilder, l1: int, l2: int, l3: int | None = 0, **kw):
    cfg = ReplayConfig(block_size=BS, l1_blocks=l1, l2_pages=l2, l3_objects=l3, **kw)
    steps = l1_pass(b.records, l1, BS, keep_evicted=cfg.write_policy == "write_back")
    return replay(steps, cfg)


A = blocks("a0", "a1", "a2", "a3")
B = blocks("b0", "b1", "b2", "b3")
C = blocks("c0", "c1", "c2", "c3")


def test_l1_hit_stops_one_token_short_of_the_prompt():
    """A block-aligned prompt of 4 blocks may hit only 3: the last token is computed."""
    b = LogBuilder()
    b.request(A, 4 * BS)
    b.request(A, 4 * BS)
    assert run(b, l1=8, l2=0).per_request == [(0, 0, 0), (3 * BS, 0, 0)]


def test_l1_frees_a_request_tail_first():
    """Scenario: L1 of 4 blocks.
    1. A (3 blocks + 1 token) holds 4 blocks; freed, the queue is
       [partial, a2, a1, a0] (uncached first, then cached tail first).
    2. B needs 2 blocks: the partial one and a2.
    3. A again hits a0, a1: 2 blocks."""
    b = LogBuilder()
    b.request(A[:3])
    b.request(blocks("b0"))
    b.request(A[:3])
    assert run(b, l1=4, l2=0).per_request[2] == (2 * BS, 0, 0)


def test_l2_serves_what_l1_evicted_and_write_through_stores_everything():
    b = LogBuilder()
    b.request(A)
    b.request(B)  # evicts A from an L1 of 2 blocks
    b.request(A)
    res = run(b, l1=2, l2=16)
    assert res.per_request == [(0, 0, 0), (0, 0, 0), (0, 4 * BS, 0)]
    assert res.stored_pages == 8
    assert res.hit_rate == 4 * BS / (3 * (4 * BS + 1))


def test_l2_evicts_leaf_first_in_lru_order():
    """L2 of 6 pages: storing B (4) evicts A's two tail blocks; A keeps a0, a1."""
    b = LogBuilder()
    b.request(A)
    b.request(B)
    b.request(A)
    assert run(b, l1=1, l2=6).per_request[2] == (0, 2 * BS, 0)


def test_a_step_looks_up_before_it_stores_and_pins_its_hits():
    """Scenario: L2 of 4 pages, L1 of 1 block.
    1. step 0: A is stored (L2 = A).
    2. step 1: B then A are admitted. Both lookups come first: A hits its 4
       pages, which its load pins; then B's store finds every page pinned
       and stores nothing (store_skipped_blocks in the real scheduler).
    Storing B at its admission would have evicted A before A's lookup."""
    b = LogBuilder()
    b.request(A, step=0)
    b.request(B, step=1, finish=False, arrive=False)
    b.request(A, step=1, arrive=False)
    res = run(b, l1=1, l2=4)
    assert res.per_request[2] == (0, 4 * BS, 0)
    assert res.stored_pages == 4


def test_l3_serves_what_l2_evicted_when_the_request_waits_for_it():
    """L1 2, L2 8 (in-flight cap 0.8 x (8 - 2) = 4 pages), L3 unlimited: B
    and C push A out of L2; A again is prefetched from L3: 4 blocks of L3."""
    b = LogBuilder()
    for step, chain in enumerate((A, B, C, A)):
        b.request(chain, step=step)
    res = run(b, l1=2, l2=8, l3=None)
    assert res.per_request[3] == (0, 0, 4 * BS)


def test_a_best_effort_prefetch_helps_only_requests_admitted_after_it_lands():
    """Same as above without waiting: A admitted in its arrival step gets
    nothing (the prefetch lands two steps later), and its store finds L2's
    pages held by that prefetch; A once more, later, hits a0, a1 in L1 (what
    L1 kept of A) and a2, a3 in the landed pages in L2."""
    b = LogBuilder()
    for step, chain in enumerate((A, B, C, A)):
        b.request(chain, step=step)
    b.request(A, step=10)
    res = run(b, l1=2, l2=8, l3=None, prefetch_waits=False)
    assert res.per_request[3] == (0, 0, 0)
    assert res.per_request[4] == (2 * BS, 2 * BS, 0)


def test_l3_is_an_lru_of_its_size():
    """L3 of 8 objects holds B and C after them: A is gone from every tier."""
    b = LogBuilder()
    for step, chain in enumerate((A, B, C, A)):
        b.request(chain, step=step)
    assert run(b, l1=2, l2=8, l3=8).per_request[3] == (0, 0, 0)


def test_no_l3_lookup_for_blocks_resident_at_arrival():
    """Scenario: A arrives while L2 still holds it, but is admitted only after
    B and C evicted it (one step each). Its L3 lookup skipped what was
    resident at arrival, so it gets nothing from L3, as the scheduler does."""
    b = LogBuilder()
    b.request(A, step=0)
    late = b.arrive(step=1)
    b.request(B, step=1)
    b.request(C, step=2)
    b.admit(late, A, step=3)
    assert run(b, l1=2, l2=8, l3=None).per_request[3] == (0, 0, 0)
    # The same admission without its ARRIVE is looked up at admission: L3 has A.
    b.records = [r for r in b.records if not (r.seq == late and type(r).__name__ == "Arrive")]
    assert run(b, l1=2, l2=8, l3=None).per_request[3] == (0, 0, 4 * BS)


def test_write_back_stores_a_block_only_when_l1_evicts_it():
    """L1 of 4: B's 3 new blocks take A's partial block, the free one and a1,
    which is written back. A again: a0 from L1, a1 from L2 (its new blocks
    take B's partial block and b1: b1 is written back too)."""
    b = LogBuilder()
    b.request(A[:2])
    b.request(B[:2])
    b.request(A[:2])
    back = run(b, l1=4, l2=16, write_policy="write_back")
    through = run(b, l1=4, l2=16)
    assert back.per_request[2] == through.per_request[2] == (BS, BS, 0)
    assert back.stored_pages == 2 and through.stored_pages == 4
