"""Joining a node tier (node/membership.py): a page survives its members,
identities never share a tier, the size and damage rules, leftovers of
joiners and creators that died, and refused arguments."""

from __future__ import annotations

import os

import pytest

from tests.node.helpers import IDENTITY, NAME, PAGE_BYTES, buf, capacity_for, insert, make, page_of
from vllm_hicache.node import NodeTier, NodeTierError, join, tier_directory


def test_a_page_survives_leaving_and_is_found_on_rejoin(node_root):
    with make(node_root) as tier:
        insert(tier, [b"a"])
    with make(node_root) as tier:
        out = buf()
        assert tier.read(b"a", out, verify_checksum=True)
        assert out.tobytes() == page_of(b"a")


def test_other_identities_never_see_each_others_pages(node_root):
    with make(node_root) as one, make(node_root, identity="another") as two:
        insert(one, [b"a"])
        assert two.lookup([b"a"]) == 0
        assert one.directory != two.directory
        assert one.directory == tier_directory(node_root, NAME, IDENTITY)


def test_a_joiner_of_another_size_is_refused_while_a_member_lives(node_root):
    with make(node_root, slots=4) as tier:
        insert(tier, [b"a"])
        with pytest.raises(NodeTierError, match=r"1 live member.*capacity_bytes"):
            make(node_root, slots=8)
        with pytest.raises(NodeTierError, match="eviction is 'lru' there, 'lfu' here"):
            make(node_root, slots=4, eviction="lfu")
        tier.leave()
        # A size that holds no page is refused before the tier is touched.
        with pytest.raises(NodeTierError, match="holds no page"):
            join(NAME, IDENTITY, 8192, PAGE_BYTES, root=node_root)
        with make(node_root, slots=4) as again:
            assert again.lookup([b"a"]) == 1
    # Nobody left: the new size replaces the tier.
    with make(node_root, slots=8) as tier:
        assert tier.stats().num_slots == 8 and tier.lookup([b"a"]) == 0


def test_a_damaged_tier_is_refused_while_a_member_lives_and_replaced_after(node_root):
    with make(node_root) as tier:
        insert(tier, [b"a"])
        os.unlink(os.path.join(tier.directory, "pages"))  # the member's mapping stays
        assert tier.lookup([b"a"]) == 1
        with pytest.raises(NodeTierError, match="1 live member.*segment is damaged"):
            make(node_root)
    with make(node_root) as tier:
        assert tier.lookup([b"a"]) == 0 and tier.check_integrity() == []


def test_leftovers_of_a_joiner_that_died_before_its_lease_are_removed_on_join(node_root):
    with make(node_root) as tier:
        leftover = os.path.join(tier.directory, "members", ".new-123-4-abcd")
        open(leftover, "w").close()
        with make(node_root) as second:
            assert not os.path.exists(leftover)
            assert sorted(os.listdir(os.path.join(tier.directory, "members"))) == sorted(
                [tier.member_id, second.member_id])


def test_a_creation_that_died_halfway_is_redone(node_root):
    directory = tier_directory(node_root, NAME, IDENTITY)
    os.makedirs(os.path.join(directory, "members"))
    with open(os.path.join(directory, "pages"), "wb") as f:
        f.write(b"junk")
    with make(node_root) as tier:
        insert(tier, [b"a"])
        assert tier.check_integrity() == []


def test_a_tier_larger_than_the_tmpfs_is_refused_naming_the_fix(node_root):
    with pytest.raises(NodeTierError, match="--shm-size"):
        join(NAME, IDENTITY, 1 << 50, PAGE_BYTES, root=node_root)
    # Nothing left behind but the creation lock.
    tier_name = os.path.basename(tier_directory(node_root, NAME, IDENTITY))
    assert os.listdir(node_root) == [f".{tier_name}.lock"]


@pytest.mark.parametrize("kw, error, match", [
    ({"name": "a/b"}, ValueError, "node tier name"),
    ({"name": ""}, ValueError, "node tier name"),
    ({"identity": ""}, ValueError, "identity"),
    ({"capacity_bytes": 0}, ValueError, "capacity_bytes"),
    ({"page_bytes": 1.5}, ValueError, "page_bytes"),
    ({"capacity_bytes": 8192}, NodeTierError, "holds no page"),
    ({"eviction": "fifo"}, ValueError, "lru, lfu"),
    ({"lock_timeout_s": 0}, ValueError, "lock_timeout_s"),
    ({"sweep_interval_s": -1}, ValueError, "sweep_interval_s"),
    ({"root": "/nonexistent-dir"}, NodeTierError, "not a directory"),
])
def test_bad_join_arguments_are_refused_by_name(node_root, kw, error, match):
    args = {"name": NAME, "identity": IDENTITY, "capacity_bytes": capacity_for(4),
            "page_bytes": PAGE_BYTES, "root": node_root, **kw}
    with pytest.raises(error, match=match):
        NodeTier.join(**args)
