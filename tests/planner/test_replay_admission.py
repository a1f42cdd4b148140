"""The replay's admission rules and L3 modes (planner/l3_boundary.py) on
hand-made logs, worked out by hand. Blocks are 16 tokens; L1 of 2 blocks,
L2 of 8 pages (the in-flight prefetch cap is 4 pages)."""

from __future__ import annotations

from tests.planner.logs import BS, LogBuilder, blocks
from tests.planner.test_replay import run
from vllm_hicache.policy.admission import L3Mode, parse_admission

A = blocks("a0", "a1", "a2", "a3")
B = blocks("b0", "b1", "b2", "b3")
C = blocks("c0", "c1", "c2", "c3")


def log(*chains) -> LogBuilder:
    b = LogBuilder()
    for step, chain in enumerate(chains):
        b.request(chain, step=step)
    return b


def test_exclusive_l3_holds_what_l2_evicted_where_inclusive_duplicates_l2():
    """L3 of 8 objects. Inclusive writes A, B, C as L2 stores them (L3
    keeps B and C: A is lost from every tier), then A again: 16 objects.
    Exclusive writes A when storing C evicts it from L2, and B when A's
    prefetch takes B's pages: 8 objects, and A comes back."""
    inclusive = run(log(A, B, C, A), l1=2, l2=8, l3=8)
    exclusive = run(log(A, B, C, A), l1=2, l2=8, l3=8, l3_mode=L3Mode.EXCLUSIVE)
    assert inclusive.per_request[3] == (0, 0, 0)
    assert inclusive.l3_written == 16
    assert exclusive.per_request[3] == (0, 0, 4 * BS)
    assert exclusive.l3_written == 8


def test_exclusive_does_not_write_back_what_it_promoted():
    """A, B, C come back from L3 in turn, each promotion evicting another
    promoted chain: each object is written once."""
    res = run(log(A, B, C, A, B, C), l1=2, l2=8, l3=None, l3_mode=L3Mode.EXCLUSIVE)
    assert res.per_request[3:] == [(0, 0, 4 * BS)] * 3
    assert res.l3_written == 12


def test_l3_hits_2_writes_only_what_was_used_twice():
    """Always: A, B, C all go to L3 (12 objects). hits:2: A is written when
    its second use (an L1 + L2 hit) admits it, B and C never (used once);
    the last A still comes from L3."""
    chains = (A, A, B, C, A)
    always = run(log(*chains), l1=2, l2=8, l3=None)
    twice = run(log(*chains), l1=2, l2=8, l3=None, l3_admission=parse_admission("hits:2"))
    assert always.l3_written == 12
    assert twice.l3_written == 4
    assert twice.per_request[4] == always.per_request[4] == (0, 0, 4 * BS)


def test_l3_hits_2_costs_the_hits_of_blocks_used_once_before_eviction():
    """A used once, evicted from L2: under hits:2 it never reached L3; it is
    recomputed, and that second use admits it."""
    twice = run(log(A, B, C, A), l1=2, l2=8, l3=None, l3_admission=parse_admission("hits:2"))
    assert twice.per_request[3] == (0, 0, 0)
    assert twice.l3_written == 4


def test_exclusive_with_hits_2_writes_only_admitted_victims():
    chains = (A, A, B, C, A)
    res = run(log(*chains), l1=2, l2=8, l3=None, l3_mode=L3Mode.EXCLUSIVE,
              l3_admission=parse_admission("hits:2"))
    assert res.l3_written == 4  # A (two uses) when evicted; B was used once
    assert res.per_request[4] == (0, 0, 4 * BS)


def test_l3_value_rule_admits_deep_blocks_with_their_prefix():
    """value:48 with one use: block i is worth (i + 1) x 16, so a2, a3 pass
    (48, 64) and a0, a1 (16, 32) come with them: the whole chain."""
    res = run(log(A, B, C, A), l1=2, l2=8, l3=None, l3_mode=L3Mode.EXCLUSIVE,
              l3_admission=parse_admission("value:48"))
    assert res.per_request[3] == (0, 0, 4 * BS)
    # One use of a3 is worth 64: under value:65 nothing used once is written.
    none = run(log(A, B, C), l1=2, l2=8, l3=None, l3_admission=parse_admission("value:65"))
    assert none.l3_written == 0


def test_l2_hits_2_is_write_through_selective():
    chains = (A, B, A)
    selective = run(log(*chains), l1=2, l2=16, write_policy="write_through_selective")
    rule = run(log(*chains), l1=2, l2=16, l2_admission=parse_admission("hits:2"))
    assert rule.stored_pages == selective.stored_pages
    assert rule.per_request == selective.per_request
    assert run(log(*chains), l1=2, l2=16).stored_pages == 8


def test_a_request_that_hits_in_l1_and_stores_again_uses_a_block_once():
    """L1 of 8 blocks, L2 of 4 pages: B's store evicts A from L2 while vLLM's
    L1 keeps it. The second A hits A in L1 and stores it again (L2 lost it):
    one use by that request, not two, so hits:3 admits A only at the third A."""
    rule = parse_admission("hits:3")
    twice = run(log(A, B, A), l1=8, l2=4, l3=None, l3_admission=rule)
    assert twice.per_request[2][0] > 0  # the second A: an L1 hit
    assert twice.l3_written == 0
    thrice = run(log(A, B, A, B, A), l1=8, l2=4, l3=None, l3_admission=rule)
    assert thrice.l3_written > 0
