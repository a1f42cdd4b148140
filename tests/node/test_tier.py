"""The node tier in one process: publishing, lookups, reads, pins, eviction
order, seals that fail, and refused keys and buffers (joining:
test_membership.py)."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest

from tests.node.helpers import (
    PAGE_BYTES,
    buf,
    insert,
    make,
    page_of,
)
from vllm_hicache.node import NodeTier, NodeTierError
from vllm_hicache.node.segment import SlotSeal


def test_capacity_is_exactly_the_slots_asked_for(node_root):
    with make(node_root, slots=5) as tier:
        s = tier.stats()
        assert (s.num_slots, s.free_slots, s.sealed_slots) == (5, 5, 0)
        assert os.path.getsize(os.path.join(tier.directory, "pages")) <= s.capacity_bytes


def test_published_pages_are_found_as_a_prefix_and_read_exactly(node_root):
    with make(node_root) as tier:
        insert(tier, [b"a", b"b", b"c"])
        assert tier.lookup([b"a", b"b", b"x", b"c"]) == 2
        assert tier.lookup([b"x", b"a"]) == 0
        outs = [buf() for _ in range(4)]
        assert tier.read_prefix([b"a", b"b", b"c", b"x"], outs, verify_checksum=True) == 3
        for key, out in zip([b"a", b"b", b"c"], outs):
            assert out.tobytes() == page_of(key)
        m = tier.stats().members[tier.member_id]
        assert (m.hits, m.misses, m.inserts) == (3, 1, 3)
        assert tier.check_integrity() == []


def test_a_short_page_keeps_its_length(node_root):
    with make(node_root) as tier:
        (res,) = tier.reserve(1).slots
        tier.write(res, b"xyz")
        assert tier.seal(res, b"k", length_bytes=3)
        out = buf()
        out[:] = 7
        assert tier.read(b"k", out, verify_checksum=True)
        assert out[:3].tobytes() == b"xyz" and (out[3:] == 7).all()


def test_a_key_published_twice_keeps_the_first_and_frees_the_second_slot(node_root):
    with make(node_root, slots=4) as tier:
        a, b = tier.reserve(2).slots
        tier.write(a, page_of(b"k"))
        tier.write(b, page_of(b"k"))
        assert tier.seal(a, b"k")
        assert not tier.seal(b, b"k")
        s = tier.stats()
        assert (s.sealed_slots, s.free_slots, s.reserved_slots) == (1, 3, 0)


def test_an_unsealed_or_aborted_slot_is_never_visible(node_root):
    with make(node_root, slots=2) as tier:
        a, b = tier.reserve(2).slots
        tier.write(a, page_of(b"k"))
        assert tier.lookup([b"k"]) == 0 and not tier.read(b"k", buf())
        tier.abort(a)
        tier.abort(b)
        assert tier.stats().free_slots == 2
        assert not tier.seal(a, b"k")  # aborted: the reservation is gone
        assert tier.lookup([b"k"]) == 0


def test_lru_evicts_the_least_recently_used_unpinned_page(node_root):
    with make(node_root, slots=3) as tier:
        insert(tier, [b"a", b"b", b"c"])
        assert tier.read(b"a", buf())  # a is now the most recent
        assert insert(tier, [b"d"]) == [b"b"]
        assert tier.pin([b"c"]) == 1
        assert insert(tier, [b"e"]) == [b"a"]  # c is pinned, a older than d
        assert tier.stats().members[tier.member_id].evictions == 2
        tier.unpin([b"c"])
        assert insert(tier, [b"f"]) == [b"d"]  # the pin used c after d was published


def test_lfu_evicts_the_least_used_page(node_root):
    with make(node_root, slots=3, eviction="lfu") as tier:
        insert(tier, [b"a", b"b", b"c"])
        for _ in range(3):
            assert tier.read(b"a", buf())
        assert tier.read(b"c", buf())
        assert insert(tier, [b"d"]) == [b"b"]


def test_pinned_pages_are_never_evicted_and_pins_count(node_root):
    with make(node_root, slots=2) as tier:
        insert(tier, [b"a", b"b"])
        assert tier.pin([b"a", b"b", b"x"]) == 2
        assert tier.pin([b"a"]) == 1
        assert tier.reserve(1).slots == []
        tier.unpin([b"b"])
        assert tier.reserve(1).evicted_keys == [b"b"]
        tier.unpin([b"a"])
        assert tier.stats().pinned_slots == 1  # pinned twice, unpinned once
        tier.unpin([b"a"])
        assert tier.stats().pinned_slots == 0


def test_a_key_listed_twice_in_one_pin_is_pinned_twice(node_root):
    """Pins and releases of distinct slots run as one statement per batch;
    a list that names a slot twice counts it twice, both ways."""
    with make(node_root, slots=3) as tier:
        tier.pinless_reads = False  # the pinned protocol, as off x86-64
        insert(tier, [b"a", b"b", b"c"])
        pages = tier.hold_pages([b"a", b"b", b"a"])
        assert [p.key for p in pages] == [b"a", b"b", b"a"]
        tier.release_pages(pages[:2], hits=2, misses=0)  # one pin of a, b's only
        assert tier.stats().pinned_slots == 1
        got = tier.reserve(3)  # a is still pinned once: only b and c can go
        assert len(got.slots) == 2 and sorted(got.evicted_keys) == [b"b", b"c"]
        tier.release_pages(pages[2:], hits=1, misses=0)
        assert tier.stats().pinned_slots == 0


def test_a_corrupted_page_is_a_miss_with_checksums_and_is_dropped(node_root):
    with make(node_root) as tier:
        insert(tier, [b"a"])
        slot = tier._index.find([b"a"])[0].slot
        tier._segment.data(slot)[100] ^= 0xFF
        out = buf()
        assert tier.read(b"a", out)  # the seal's key and generation still match
        assert out.tobytes() != page_of(b"a")
        assert not tier.read(b"a", out, verify_checksum=True)
        assert tier.lookup([b"a"]) == 0
        assert tier.stats().free_slots == tier.stats().num_slots


def test_a_foreign_seal_is_a_miss_never_wrong_bytes(node_root):
    with make(node_root) as tier:
        insert(tier, [b"a", b"b"])
        hit = tier._index.find([b"a"])[0]
        tier._segment.write_seal(hit.slot, SlotSeal(hit.gen, PAGE_BYTES, 0, b"b"))
        assert tier.check_integrity() != []
        out = buf()
        assert tier.read_prefix([b"a", b"b"], [out, buf()]) == 0
        assert (out == 0).all()
        assert tier.lookup([b"b"]) == 1 and tier.lookup([b"a"]) == 0
        assert tier.check_integrity() == []


@pytest.mark.parametrize("break_seal", [
    lambda hit: SlotSeal(hit.gen + 1, PAGE_BYTES, 0, hit.key),       # refilled since
    lambda hit: SlotSeal(hit.gen, PAGE_BYTES, 0, b"x"),              # another key
    lambda hit: SlotSeal(hit.gen, PAGE_BYTES, 0, hit.key + b"\0"),   # a longer key
    lambda hit: SlotSeal(hit.gen, PAGE_BYTES + 1, 0, hit.key),       # past the page
])
def test_seals_checked_at_once_agree_with_one_by_one(node_root, break_seal):
    with make(node_root) as tier:
        keys = [b"a", b"bb", b"c" * 48, b"d"]
        insert(tier, keys)
        pages = tier._index.find(keys)
        assert tier.seals_held(pages) == 4 and all(map(tier.seal_holds, pages))
        assert tier.seals_held([]) == 0
        tier._segment.write_seal(pages[2].slot, break_seal(pages[2]))
        assert [tier.seal_holds(p) for p in pages] == [True, True, False, True]
        assert tier.seals_held(pages) == 2
        assert tier.seals_held(pages[3:]) == 1


def test_bad_keys_buffers_and_counts_are_refused_by_name(node_root):
    with make(node_root) as tier:
        with pytest.raises(TypeError, match="key 1 is a str"):
            tier.lookup([b"a", "b"])
        with pytest.raises(ValueError, match="key 0 has 65 bytes"):
            tier.lookup([b"x" * 65])
        assert tier.lookup([b"x" * 64]) == 0
        with pytest.raises(ValueError, match="key 0 has 0 bytes"):
            tier.pin([b""])
        with pytest.raises(ValueError, match="buffer 0 has 10 bytes"):
            tier.read(b"a", np.zeros(10, np.uint8))
        with pytest.raises(ValueError, match="writable"):
            tier.read(b"a", bytes(PAGE_BYTES))
        with pytest.raises(ValueError, match="2 keys but 1 buffers"):
            tier.read_prefix([b"a", b"b"], [buf()])
        with pytest.raises(ValueError, match="count"):
            tier.reserve(-1)
        (res,) = tier.reserve(1).slots
        with pytest.raises(ValueError, match="do not fit"):
            tier.write(res, bytes(PAGE_BYTES + 1))
        with pytest.raises(ValueError, match="length_bytes"):
            tier.seal(res, b"k", length_bytes=PAGE_BYTES + 1)
        assert tier.check_integrity() == []


def test_a_member_that_left_refuses_to_be_used(node_root):
    tier = make(node_root)
    tier.leave()
    tier.leave()  # idempotent
    with pytest.raises(NodeTierError, match="has left"):
        tier.lookup([b"a"])


def test_a_forked_child_must_join_on_its_own(node_root):
    with make(node_root) as tier:
        pid = os.fork()
        if pid == 0:  # the child: exit status says what it saw
            try:
                tier.lookup([b"a"])
                code = 1
            except NodeTierError as e:
                code = 0 if "forked child" in str(e) else 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def test_threads_of_one_member_share_it_without_tearing(node_root):
    errors: list[str] = []

    def traffic(tier: NodeTier, seed: int) -> None:
        rng = random.Random(seed)
        out = buf()
        try:
            for _ in range(150):
                key = b"k%d" % rng.randrange(12)
                if rng.random() < 0.5:
                    for res in tier.reserve(1).slots:
                        tier.write(res, page_of(key))
                        tier.seal(res, key)
                elif tier.read(key, out) and out.tobytes() != page_of(key):
                    errors.append(f"torn read of {key!r}")
        except Exception as e:  # surfaces in the main thread's assertion
            errors.append(repr(e))

    with make(node_root, slots=6) as tier:
        threads = [threading.Thread(target=traffic, args=(tier, i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert tier.check_integrity() == []
        s = tier.stats()
        assert s.reserved_slots == 0 and s.free_slots + s.sealed_slots == s.num_slots


def test_clear_drops_every_unpinned_page_and_keeps_pinned_ones(node_root):
    with make(node_root, slots=4) as tier:
        insert(tier, [b"a", b"b", b"c"])
        assert tier.pin([b"a"]) == 1
        assert tier.clear() == 2
        assert tier.lookup([b"a"]) == 1 and tier.lookup([b"b"]) == 0 and tier.lookup([b"c"]) == 0
        stats = tier.stats()
        assert (stats.free_slots, stats.sealed_slots) == (3, 1)
        assert tier.check_integrity() == []


def test_held_pages_are_pinned_only_where_reads_need_pins(node_root):
    from vllm_hicache.node.segment import PINLESS_READS
    with make(node_root, slots=2) as tier:
        assert tier.pinless_reads == PINLESS_READS
        insert(tier, [b"a", b"b"])
        for pinless in (True, False):
            tier.pinless_reads = pinless
            pages = tier.hold_pages([b"a", b"b", b"x"])
            assert [p.key for p in pages] == [b"a", b"b"]
            assert tier.stats().pinned_slots == (0 if pinless else 2)
            tier.release_pages(pages, hits=2, misses=1)
            assert tier.stats().pinned_slots == 0
        m = tier.stats().members[tier.member_id]
        assert (m.hits, m.misses) == (4, 2)


@pytest.mark.parametrize("unseal", [True, False], ids=["unsealed", "control-no-unseal"])
def test_a_refill_under_an_unpinned_reader_fails_its_second_seal_check(node_root, monkeypatch,
                                                                       unseal):
    """Without a pin, a held page may be evicted and its slot refilled while
    it is read: the refiller unseals the slot before its first byte, so a
    seal check after the copy fails even before the new seal is written.
    The control skips the unseal: the check then passes over bytes that are
    no longer the page's, which is why reserve unseals."""
    from vllm_hicache.node.segment import Segment
    if not unseal:
        monkeypatch.setattr(Segment, "unseal", lambda self, slot, generation: None)
    with make(node_root, slots=1) as tier:
        tier.pinless_reads = True
        insert(tier, [b"a"])
        pages = tier.hold_pages([b"a"])
        assert tier.seals_held(pages) == 1  # before the copy
        got = tier.reserve(1)  # another writer needs room: nothing pins a
        assert got.evicted_keys == [b"a"]
        tier.write(got.slots[0], page_of(b"b"))  # mid-fill, not sealed yet
        copied = tier._segment.data(pages[0].slot).tobytes()
        assert copied != page_of(b"a")
        assert tier.seals_held(pages) == (0 if unseal else 1)  # after the copy
        tier.release_pages(pages, hits=0, misses=1)
        tier.abort(got.slots[0])
        assert tier.check_integrity() == []


def test_dropping_a_refilled_page_leaves_the_new_page_and_its_pins(node_root):
    """An unpinned reader that refuses a page may be late: the slot was
    evicted and sealed again for another key, which another reader pins.
    The drop names the old generation and changes nothing."""
    with make(node_root, slots=1) as tier:
        insert(tier, [b"a"])
        (old,) = tier._index.find([b"a"])
        insert(tier, [b"b"])  # evicts a, reuses its slot
        tier.pinless_reads = False
        (new,) = tier.hold_pages([b"b"])
        assert new.slot == old.slot and new.gen != old.gen
        tier.drop_page(old, "refused late by the test")
        assert tier.lookup([b"b"]) == 1 and tier.stats().pinned_slots == 1
        tier.release_pages([new], hits=1, misses=0)
        assert tier.check_integrity() == []
