"""A member killed with SIGKILL at each dangerous point: mid-write, after its
seal but before publishing, inside an index transaction, holding pins, and
after publishing (restart). The survivors never see a torn page, are never
blocked past a bound, and get back everything the dead member held."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.node.helpers import IDENTITY, NAME, PAGE_BYTES, Child, capacity_for, page_of
from vllm_hicache.node import NodeTier, NodeTierError, join

# How long a survivor may take to reclaim a dead member without being
# asked: the children's and these tests' sweep interval is 0.2 s.
RECLAIM_DEADLINE_S = 3.0


def make(root: str, slots: int, **kw) -> NodeTier:
    return join(NAME, IDENTITY, capacity_for(slots), PAGE_BYTES, root=root,
                sweep_interval_s=kw.pop("sweep_interval_s", 60.0), **kw)


def dead_member_gone(tier: NodeTier, member: str, deadline_s: float) -> float:
    """Seconds until ``member`` left the index by the survivors' sweeps alone."""
    start = time.monotonic()
    while member in tier.stats().members:
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"{member} still a member after {deadline_s} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("action", ["mid-write", "sealed-only"])
def test_a_page_whose_writer_died_before_publishing_is_never_visible(node_root, action):
    with make(node_root, slots=4) as tier:
        child = Child(node_root, 4, action, "k")
        member = child.wait_ready()
        child.kill()
        assert tier.lookup([b"k"]) == 0
        assert not tier.read(b"k", np.zeros(PAGE_BYTES, np.uint8))
        s = tier.stats()
        assert s.reserved_slots == 1 and member in s.members
        assert tier.live_members() == [tier.member_id]
        assert tier.sweep() == [member]
        s = tier.stats()
        assert (s.free_slots, s.reserved_slots) == (4, 0) and member not in s.members
        assert tier.check_integrity() == []
        # The reclaimed slot's next filling is published and read normally.
        got = tier.reserve(4)
        for res, key in zip(got.slots, [b"k", b"l", b"m", b"n"]):
            tier.write(res, page_of(key))
            assert tier.seal(res, key)
        out = np.zeros(PAGE_BYTES, np.uint8)
        assert tier.read(b"k", out, verify_checksum=True) and out.tobytes() == page_of(b"k")


def test_a_member_killed_inside_an_index_transaction_blocks_nobody_and_changes_nothing(
        node_root):
    with make(node_root, slots=4, lock_timeout_s=0.5) as tier:
        child = Child(node_root, 4, "in-txn")
        child.wait_ready()
        # While it lives, a writer waits for it a bounded time, then says why.
        start = time.monotonic()
        with pytest.raises(NodeTierError, match="no write lock within 0.5 s"):
            tier.reserve(1)
        assert time.monotonic() - start < 5
        child.kill()
        start = time.monotonic()
        (res,) = tier.reserve(1).slots
        tier.write(res, page_of(b"k"))
        assert tier.seal(res, b"k")
        assert time.monotonic() - start < 2.0
        assert tier.check_integrity() == []
        s = tier.stats()
        # Its uncommitted change (slot 0 reserved by 'nobody') is gone.
        assert (s.sealed_slots, s.reserved_slots, s.free_slots) == (1, 0, 3)


def test_pins_of_a_dead_member_are_reclaimed_when_room_runs_out(node_root):
    with make(node_root, slots=2) as tier:
        child = Child(node_root, 2, "pin", "a", "b")
        member = child.wait_ready()
        assert tier.reserve(1).slots == []  # both pinned by a live member
        child.kill()
        got = tier.reserve(1)  # short: sweeps, then evicts
        assert len(got.slots) == 1 and got.evicted_keys == [b"a"]
        assert member not in tier.stats().members
        assert tier.check_integrity() == []


def test_a_dead_member_is_reclaimed_by_the_periodic_sweep_within_the_deadline(node_root):
    with make(node_root, slots=4, sweep_interval_s=0.2) as tier:
        child = Child(node_root, 4, "pin", "a")
        member = child.wait_ready()
        assert tier.stats().pinned_slots == 1
        child.kill()
        dead_member_gone(tier, member, RECLAIM_DEADLINE_S)
        assert tier.stats().pinned_slots == 0
        assert tier.check_integrity() == []


def test_pages_published_before_a_kill_are_found_by_a_restarted_member(node_root):
    child = Child(node_root, 4, "insert", "a", "b")
    member = child.wait_ready()
    child.kill()
    # Nobody is a member now; the restart joins the same tier.
    with make(node_root, slots=4) as tier:
        assert member not in tier.stats().members  # reclaimed on join
        outs = [np.zeros(PAGE_BYTES, np.uint8) for _ in range(2)]
        assert tier.read_prefix([b"a", b"b"], outs, verify_checksum=True) == 2
        assert [o.tobytes() for o in outs] == [page_of(b"a"), page_of(b"b")]
        assert tier.check_integrity() == []


def test_members_joining_a_new_tier_at_once_share_one_tier(node_root):
    children = [Child(node_root, 8, "insert", f"k{i}") for i in range(4)]
    members = [child.wait_ready() for child in children]
    with make(node_root, slots=8) as tier:
        assert tier.lookup([b"k0", b"k1", b"k2", b"k3"]) == 4
        assert set(members) <= set(tier.stats().members)
        for child in children:
            child.kill()
        tier.sweep()  # the children killed last may have reclaimed the first already
        assert set(tier.stats().members) == {tier.member_id}
        assert tier.check_integrity() == []
