"""Node-tier pages loaded straight into L1 (datapath/node_loads.py,
host/segment_pool.py): one instance publishes pages through its private L2
as the connector does (L1 -> L2 -> PageStore -> node tier), another loads
them from the shared segment into its L1 with its private L2 untouched;
and every way a slot can be wrong (torn seal, evicted, refilled during the
copy, a failing copy, with a MAC a forged payload) is fewer blocks loaded,
never wrong KV, with no pin left behind. Checksum objects are checked by
their publisher, not again by each reader: an object promoted from the
remote store that does not verify is never published."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.kv_factory import make_kv_layers, random_bits, same_bits
from vllm_hicache.host import HostKVPool
from vllm_hicache.host.segment_pool import SegmentKVPool
from vllm_hicache.kernels import DirectTransfer, describe_kv_tensor
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.node_loads import build_direct_loader
from vllm_hicache.node import NodeTier
from vllm_hicache.node.segment import HEADER_BYTES as SEGMENT_HEADER_BYTES
from vllm_hicache.node.segment import SLOT_HEADER_BYTES
from vllm_hicache.storage import StorageContext, create_backend
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.node_chain import NodeChainBackend
from vllm_hicache.storage.node_direct import promotion_check
from vllm_hicache.storage.pages import PageStore
from vllm_hicache.storage.sealing import ChecksumCodec, make_codec
from vllm_hicache.storage_secret import StorageSecret

NB, NP, L, BLOCK, H, D = 10, 6, 3, 4, 2, 8
SLOTS = 12
HASHES = [bytes([i]) * 32 for i in range(1, 6)]
SRC_BLOCKS = [3, 4, 5, 7, 9]
DST_BLOCKS = [1, 2, 6, 8, 0]


class Instance:
    """One instance's L1 layers, private L2 pool, and node-tier member."""

    def __init__(self, root: str, mem_layout: str, codec=None, seed: int = 0) -> None:
        self.layers = make_kv_layers("LBNHC", num_layers=L, num_blocks=NB, heads=H,
                                     tokens=BLOCK, content=2 * D)
        for t in self.layers:
            t.copy_(random_bits(t.numel(), t.dtype, seed=seed).view_as(t) if seed else
                    torch.zeros_like(t))
        self.layouts = [describe_kv_tensor(t, num_blocks=NB, block_size=BLOCK, num_kv_heads=H,
                                           head_size=D, is_mla=False, backend_name="FLASH_ATTN")
                        for t in self.layers]
        self.pool = HostKVPool.for_layouts(NP, self.layouts, mem_layout, pin_memory=False)
        self.transfer = DirectTransfer(self.layers, self.layouts, self.pool)
        object_bytes = HEADER_BYTES + self.pool.bytes_per_page
        ctx = StorageContext("worker", 0, 1, object_bytes)
        self.tier = NodeTier.join("t", "direct-test", SLOTS * (object_bytes + 4096),
                                  object_bytes, root=root)
        backend = NodeChainBackend({}, ctx, tier=self.tier)
        ns = KeyNamespace("test/model", "bfloat16", mem_layout, BLOCK, 1, 0)
        self.store = PageStore(backend, self.pool, ns, codec or ChecksumCodec())

    def publish(self) -> None:
        """L1 blocks -> L2 pages -> node tier, as write-through and backup do."""
        pages = list(range(len(HASHES)))
        self.transfer.store(SRC_BLOCKS, pages)
        assert self.store.write(HASHES, pages) == [True] * len(HASHES)

    def close(self) -> None:
        self.store.backend.close()


# Both read protocols run on any machine: without pins (x86-64's default)
# and with them (every other architecture's).
@pytest.fixture(params=[("page_first_direct", True), ("page_first", True),
                        ("page_first_direct", False), ("page_first", False)],
                ids=["page_first_direct-pinless", "page_first-pinless",
                     "page_first_direct-pinned", "page_first-pinned"])
def pair(request, node_root):
    layout, pinless = request.param
    a = Instance(node_root, layout, seed=7)
    b = Instance(node_root, layout)
    b.tier.pinless_reads = pinless
    a.publish()
    loader = build_direct_loader(b.tier, b.store, b.layers, b.layouts, "direct")
    yield a, b, loader
    loader.close()
    b.close()
    a.close()


def blocks(inst: Instance, ids) -> list[torch.Tensor]:
    return [t[list(ids)].clone() for t in inst.layers]


def assert_loaded(a: Instance, b: Instance, n: int) -> None:
    for got, want in zip(blocks(b, DST_BLOCKS[:n]), blocks(a, SRC_BLOCKS[:n])):
        assert same_bits(got, want)


def slot_start(tier: NodeTier, slot: int) -> int:
    g = tier.geometry
    return g.data_offset + slot * g.slot_stride


def slot_of(b: Instance, i: int) -> int:
    pages = b.tier.hold_pages([_node_key(b, i)])
    b.tier.release_pages(pages, 0, 0)
    return pages[0].slot


def _node_key(b: Instance, i: int) -> bytes:
    from vllm_hicache.storage.node_chain import node_key
    return node_key(b.store.keys([HASHES[i]])[0])


def no_pins(tier: NodeTier) -> bool:
    return tier.stats().pinned_slots == 0


def test_another_instance_loads_the_pages_into_l1_without_its_private_l2(pair):
    a, b, loader = pair
    l2_before = b.pool.buffer.clone()
    assert loader.load(HASHES, DST_BLOCKS) == len(HASHES)
    assert_loaded(a, b, len(HASHES))
    assert torch.equal(b.pool.buffer, l2_before)  # the private L2 took no part
    assert loader.counts["pages"] == len(HASHES)
    assert loader.counts["bytes"] == len(HASHES) * b.pool.bytes_per_page
    assert no_pins(b.tier)
    me = b.tier.stats().members[b.tier.member_id]
    assert (me.hits, me.misses) == (len(HASHES), 0)


def test_a_deferred_release_drops_the_pins_after_the_copy_and_marks_the_pages_used(pair):
    """In a step the pins go on another thread (``defer``): the blocks are
    loaded when ``load`` returns, the pins until the deferred call runs; the
    pages read, and only those, become the most recently used."""
    a, b, loader = pair
    before = {row.slot: row.last_access_ns for row in slot_rows(b.tier)}
    deferred = []
    assert loader.load(HASHES[:3], DST_BLOCKS[:3], lambda fn, *args: deferred.append(
        (fn, args))) == 3
    assert_loaded(a, b, 3)
    assert loader.counts["pages"] == 3  # counted at once
    held = 0 if b.tier.pinless_reads else 3
    assert b.tier.stats().pinned_slots == held and len(deferred) == 1
    fn, args = deferred[0]
    fn(*args)
    assert no_pins(b.tier)
    after = {row.slot: row.last_access_ns for row in slot_rows(b.tier)}
    read = {slot_of(b, i) for i in range(3)}
    assert [s for s in after if after[s] != before[s]] == sorted(read)


def slot_rows(tier: NodeTier):
    """(slot, last_access_ns) of every sealed slot, from the index."""
    from collections import namedtuple
    Row = namedtuple("Row", "slot last_access_ns")
    with tier._index.read() as db:
        return [Row(*r) for r in db.execute(
            "SELECT slot, last_access_ns FROM slots WHERE state = 2 ORDER BY slot")]


def test_the_segment_pool_pages_are_the_slot_payloads(pair):
    a, b, loader = pair
    seg = loader.pool
    assert isinstance(seg, SegmentKVPool) and seg.num_pages == b.tier.geometry.num_slots
    slot = slot_of(b, 2)
    assert torch.equal(seg.read_pages([slot]), a.pool.read_pages([2]))


def test_a_prefix_stops_at_the_first_missing_page(pair):
    a, b, loader = pair
    unknown = [HASHES[0], HASHES[1], b"\xee" * 32, HASHES[3]]
    assert loader.load(unknown, DST_BLOCKS[:4]) == 2
    assert_loaded(a, b, 2)
    assert loader.counts["misses"] == 2
    assert no_pins(b.tier)


@pytest.fixture(params=["page_first_direct", "page_first"])
def mac_pair(request, node_root):
    """``pair`` for objects sealed with a MAC (storage_secret)."""
    codec = make_codec(StorageSecret(b"s" * 32))
    a = Instance(node_root, request.param, codec=codec, seed=7)
    b = Instance(node_root, request.param, codec=codec)
    a.publish()
    loader = build_direct_loader(b.tier, b.store, b.layers, b.layouts, "direct")
    yield a, b, loader
    loader.close()
    b.close()
    a.close()


def test_checksum_objects_are_trusted_by_their_seal_not_hashed_again(pair, monkeypatch):
    a, b, loader = pair
    opened = []
    inner = ChecksumCodec.open
    monkeypatch.setattr(ChecksumCodec, "open", lambda self, *args: opened.append(args[0]) or
                        inner(self, *args))
    assert loader.load(HASHES, DST_BLOCKS) == 5
    assert_loaded(a, b, 5)
    assert opened == []  # a's PageStore checked them when it published them


def test_a_forged_payload_after_sealing_is_refused_and_dropped(mac_pair):
    a, b, loader = mac_pair
    mapping = np.frombuffer(b.tier.mapping(), np.uint8)
    start = slot_start(b.tier, slot_of(b, 2)) + HEADER_BYTES + 100
    mapping[start] ^= 0xFF  # the node seal (its generation and key) still holds
    assert loader.load(HASHES, DST_BLOCKS) == 2
    assert_loaded(a, b, 2)
    zero = torch.zeros_like(blocks(b, DST_BLOCKS[2:3])[0])
    assert all(same_bits(t, zero) for t in blocks(b, DST_BLOCKS[2:3]))  # never copied
    assert loader.counts["refused"] == 1
    assert b.tier.lookup([_node_key(b, i) for i in range(5)]) == 2  # dropped from the tier
    assert no_pins(b.tier)


def test_a_torn_seal_is_refused(pair):
    a, b, loader = pair
    mapping = np.frombuffer(b.tier.mapping(), np.uint8)
    seal_at = SEGMENT_HEADER_BYTES + slot_of(b, 1) * SLOT_HEADER_BYTES
    mapping[seal_at] ^= 0x01  # the generation: a writer died or another key's page
    assert loader.load(HASHES, DST_BLOCKS) == 1
    assert loader.counts["refused"] == 1
    assert no_pins(b.tier)


def test_pages_evicted_between_lookup_and_load_are_a_miss(pair):
    a, b, loader = pair
    assert b.tier.lookup([_node_key(b, i) for i in range(5)]) == 5  # the scheduler's lookup
    assert a.tier.clear() == 5                                       # then every page leaves
    assert loader.load(HASHES, DST_BLOCKS) == 0
    assert no_pins(b.tier)


def test_pages_evicted_during_the_load_are_still_their_keys_bytes(pair):
    """Pinned pages cannot be evicted mid-copy; unpinned ones can, and an
    eviction alone leaves the slot's bytes and seal as they were: the copy
    is still the key's page."""
    a, b, loader = pair
    seen = {}

    class ClearingTransfer:
        def load(self, block_ids, page_ids):
            seen["cleared"] = a.tier.clear()  # another member wants room mid-copy
            loader_transfer.load(block_ids, page_ids)

        def synchronize(self):
            pass

    loader_transfer = loader.transfer
    loader.transfer = ClearingTransfer()
    assert loader.load(HASHES, DST_BLOCKS) == 5
    assert seen["cleared"] == (5 if b.tier.pinless_reads else 0)
    assert_loaded(a, b, 5)


def test_a_seal_that_changes_during_the_copy_ends_the_prefix_there(pair):
    a, b, loader = pair
    mapping = np.frombuffer(b.tier.mapping(), np.uint8)
    seal_at = SEGMENT_HEADER_BYTES + slot_of(b, 3) * SLOT_HEADER_BYTES

    class TearingTransfer:
        def load(self, block_ids, page_ids):
            inner.load(block_ids, page_ids)
            mapping[seal_at] ^= 0x01

        def synchronize(self):
            pass

    inner = loader.transfer
    loader.transfer = TearingTransfer()
    assert loader.load(HASHES, DST_BLOCKS) == 3
    assert no_pins(b.tier)


def test_a_page_refilled_during_the_copy_ends_the_prefix_there(pair):
    """The fourth page leaves mid-copy (dropped, which a pin does not stop)
    and another member starts filling its slot: the refill's unseal fails
    the second seal check, so the first three blocks count and the fourth
    is recomputed."""
    a, b, loader = pair
    fourth = slot_of(b, 3)

    class RefillingTransfer:
        def load(self, block_ids, page_ids):
            inner.load(block_ids, page_ids)
            a.tier.drop_page(a.tier.hold_pages([_node_key(b, 3)])[0], "evicted by the test")
            got = a.tier.reserve(SLOTS).slots  # every free slot, the fourth's among them
            (res,) = [r for r in got if r.slot == fourth]
            a.tier.write(res, b"\xee" * 64)

        def synchronize(self):
            pass

    inner = loader.transfer
    loader.transfer = RefillingTransfer()
    assert loader.load(HASHES, DST_BLOCKS) == 3
    assert_loaded(a, b, 3)


def test_a_failing_copy_loads_nothing_and_releases_the_pins(pair):
    a, b, loader = pair

    class Broken:
        def load(self, block_ids, page_ids):
            raise RuntimeError("DMA error")

        def synchronize(self):
            pass

    loader.transfer = Broken()
    assert loader.load(HASHES, DST_BLOCKS) == 0
    assert loader.counts["copy_errors"] == 5
    assert no_pins(b.tier)


def test_a_mac_slot_is_verified_once_per_generation(mac_pair):
    a, b, loader = mac_pair
    calls = []
    check = loader._check
    loader._check = lambda *args: calls.append(1) or check(*args)
    assert loader.load(HASHES, DST_BLOCKS) == 5
    assert loader.load(HASHES, DST_BLOCKS) == 5
    assert len(calls) == 5
    # Evicted and published again: a new generation is checked anew.
    assert a.tier.clear() == 5
    a.publish()
    assert loader.load(HASHES, DST_BLOCKS) == 5
    assert len(calls) == 10


def test_mismatched_hashes_and_blocks_are_refused(pair):
    a, b, loader = pair
    with pytest.raises(ValueError, match="2 hashes but 1 blocks"):
        loader.load(HASHES[:2], [0])
    assert loader.load([], []) == 0


def test_a_mac_store_loads_directly_and_each_process_refuses_forgeries(mac_pair):
    a, b, loader = mac_pair
    assert loader.load(HASHES, DST_BLOCKS) == 5
    assert_loaded(a, b, 5)
    # A payload changed by someone without the secret: the MAC no longer
    # matches. A slot is checked once per generation (like an L2 page,
    # once read), so only a process that has not checked it yet refuses it.
    mapping = np.frombuffer(b.tier.mapping(), np.uint8)
    mapping[slot_start(b.tier, slot_of(b, 0)) + HEADER_BYTES] ^= 0xFF
    assert loader.load(HASHES, DST_BLOCKS) == 5  # verified at this generation already
    loader._verified.clear()  # a fresh process
    assert loader.load(HASHES, DST_BLOCKS) == 0


class CorruptingRemote:
    """A file store that returns the object of one key with a payload byte
    flipped (a damaged disk, or a writer without the secret)."""

    def __init__(self, inner, bad_key: str) -> None:
        self.inner, self.bad_key = inner, bad_key

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, keys, targets):
        ok = self.inner.get(keys, targets)
        for key, target, hit in zip(keys, targets, ok):
            if hit and key == self.bad_key:
                target[-1][100] ^= 0xFF
        return ok


@pytest.mark.parametrize("codec", ["checksum", "mac"])
def test_a_remote_object_that_does_not_verify_is_never_promoted(node_root, tmp_path, codec):
    """B reads A's pages from the remote store through its L2 (the node
    tier lost them): what verifies is promoted and then loaded directly by
    a reader that hashes nothing; the damaged third object is refused by
    B's PageStore and kept out of the tier."""
    secret = StorageSecret(b"s" * 32) if codec == "mac" else None
    remote_dir = str(tmp_path / "l3")

    def instance(seed=0):
        inst = Instance(node_root, "page_first_direct", codec=make_codec(secret), seed=seed)
        ctx = StorageContext("worker", 0, 1, inst.store.object_bytes)
        remote = create_backend("file", {"path": remote_dir}, ctx)
        inst.store.backend.remote = remote
        return inst

    a, b = instance(seed=5), instance()
    try:
        a.publish()
        assert a.tier.clear() == 5  # only the remote store has them now
        chain = b.store.backend
        assert chain.promotion_check is None  # what build_storage_io installs:
        chain.promotion_check = promotion_check(b.store)
        bad = b.store.keys(HASHES)[2]
        chain.remote = CorruptingRemote(chain.remote, bad)
        assert b.store.read(HASHES, list(range(5))) == 2
        assert b.store.invalid_objects == 1
        stats = chain.stats()
        assert (stats["node_tier_promotions"], stats["node_tier_promotions_refused"]) == (4, 1)
        node_keys = [_node_key(b, i) for i in range(5)]
        assert [b.tier.lookup([k]) for k in node_keys] == [1, 1, 0, 1, 1]
        loader = build_direct_loader(b.tier, b.store, b.layers, b.layouts, "direct")
        assert loader.load(HASHES[:2], DST_BLOCKS[:2]) == 2
        assert_loaded(a, b, 2)
        loader.close()
    finally:
        b.close()
        a.close()


@pytest.mark.parametrize("layout, codec, reason", [
    ("layer_first", None, "layer_first"),
    ("page_first_direct", "aead", "encrypted"),
])
def test_what_cannot_be_read_in_place_is_refused_by_name(node_root, layout, codec, reason):
    if codec == "aead":
        codec = make_codec(StorageSecret(b"s" * 32), encrypt=True)
    inst = Instance(node_root, layout, codec=codec)
    try:
        with pytest.raises(ValueError, match=reason):
            build_direct_loader(inst.tier, inst.store, inst.layers, inst.layouts, "direct")
    finally:
        inst.close()


def test_a_segment_pool_refuses_geometry_that_does_not_fit():
    like = HostKVPool(2, 1, 2, 4, 2, 8, torch.bfloat16, "page_first_direct", pin_memory=False)
    mapping = memoryview(bytearray(4096))
    with pytest.raises(ValueError, match="cannot hold pages"):
        SegmentKVPool(mapping, num_slots=2, slot_stride_bytes=64, first_payload_offset_bytes=0,
                      like=like)
    with pytest.raises(ValueError, match="multiples"):
        SegmentKVPool(mapping, num_slots=1, slot_stride_bytes=257,
                      first_payload_offset_bytes=1, like=like)
    with pytest.raises(ValueError, match="the mapping has 4096"):
        SegmentKVPool(mapping, num_slots=20, slot_stride_bytes=256,
                      first_payload_offset_bytes=0, like=like)
    layer_first = HostKVPool(2, 1, 2, 4, 2, 8, torch.bfloat16, "layer_first", pin_memory=False)
    with pytest.raises(ValueError, match="layer_first"):
        SegmentKVPool(mapping, num_slots=1, slot_stride_bytes=256,
                      first_payload_offset_bytes=0, like=layer_first)


def test_pinning_without_cuda_leaves_the_segment_pageable():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/gpu covers registration")
    like = HostKVPool(2, 1, 2, 4, 2, 8, torch.bfloat16, "page_first_direct", pin_memory=False)
    pool = SegmentKVPool(memoryview(bytearray(4096)), num_slots=2, slot_stride_bytes=512,
                         first_payload_offset_bytes=64, like=like, pin_memory=True)
    assert not pool.is_pinned


def test_a_remembered_page_s_seal_is_checked_once_before_the_copy(pair, monkeypatch):
    """Pages found before come from the tier's hints with their seals just
    checked: the loader checks only the others before copying, and every
    page after."""
    a, b, loader = pair
    assert loader.load(HASHES, DST_BLOCKS) == 5  # found in the index, now remembered
    checked = []
    seals_held = b.tier.seals_held
    monkeypatch.setattr(b.tier, "seals_held",
                        lambda pages: checked.append(len(pages)) or seals_held(pages))
    assert loader.load(HASHES, DST_BLOCKS) == 5
    assert_loaded(a, b, 5)
    assert checked == ([0, 5] if b.tier.pinless_reads else [5, 5])
