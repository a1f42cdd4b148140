"""Head-slice objects (heterogeneous TP) through PageStore: what ranks of one
TP size write, ranks of any other TP size dividing tp_lcm_size read back into
exactly their own heads, in every host layout and device block order; a page
is read or written only with all of its slices."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.connector.mem_backend import STORES, MemBackend
from vllm_hicache.host import HostKVPool
from vllm_hicache.host.layout import BlockOrder
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.pages import PageStore

PAGES, LAYERS, BLOCK, HEADS, HEAD, SLICES = 8, 2, 8, 4, 4, 4
HASHES = [bytes([i + 1]) * 8 for i in range(3)]

# Nestings of [plane, kernel_block, token_in_kernel_block, head, elem],
# outermost first (the device's native block order), with kernel blocks.
NESTINGS = {
    "canonical": ((0, 1, 2, 3, 4), 1),
    "heads_outer": ((3, 0, 1, 2, 4), 1),       # CPU_ATTN-like
    "tokens_outer": ((1, 2, 3, 0, 4), 1),      # K|V packed per token
    "kernel_split": ((1, 3, 0, 2, 4), 2),      # kernel blocks outermost
}


def block_order(heads: int, nesting: str) -> BlockOrder:
    axes, kernel_blocks = NESTINGS[nesting]
    dims = (2, kernel_blocks, BLOCK // kernel_blocks, heads, HEAD)
    strides, step = [0] * 5, 1
    for axis in reversed(axes):
        strides[axis] = step
        step *= dims[axis]
    return BlockOrder(dims, tuple(strides))


def rank_pool(tp: int, layout: str, nesting: str) -> HostKVPool:
    heads = HEADS // tp
    return HostKVPool(PAGES, LAYERS, 2, BLOCK, heads, HEAD, torch.float32, layout,
                      pin_memory=False, block_order=block_order(heads, nesting))


def store_for(tp: int, rank: int, pool: HostKVPool, store: str, backend_cls=MemBackend,
              codec=None):
    ns = KeyNamespace("m", "float32", pool.mem_layout, BLOCK, tp, rank,
                      page_format="same for every TP size", head_slices=SLICES,
                      head_slice=rank * (SLICES // tp))
    ctx = StorageContext("worker", rank, tp, 0)
    return PageStore(backend_cls({"store": store}, ctx), pool, ns, codec)


@pytest.fixture
def store():
    name = uuid.uuid4().hex
    yield name
    STORES.pop(name, None)


LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.mark.parametrize("nesting", list(NESTINGS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("writer_tp, reader_tp", [(1, 2), (2, 1), (1, 4), (4, 2), (2, 2)])
def test_any_tp_size_reads_what_another_wrote(store, layout, nesting, writer_tp, reader_tp):
    # [page, layer, plane, token, head, elem]
    truth = torch.randn(PAGES, LAYERS, 2, BLOCK, HEADS, HEAD)
    for rank in range(writer_tp):
        pool = rank_pool(writer_tp, layout, nesting)
        heads = HEADS // writer_tp
        pool.write_pages(list(range(PAGES)), truth[..., rank * heads:(rank + 1) * heads, :])
        pages = store_for(writer_tp, rank, pool, store)
        assert pages.write(HASHES, [1, 2, 3]) == [True] * 3
        assert pages.object_bytes - pages.payload_bytes == 64
    assert len(STORES[store]) == len(HASHES) * SLICES  # one object per slice, whatever the TP
    for rank in range(reader_tp):
        pool = rank_pool(reader_tp, layout, nesting)
        pages = store_for(reader_tp, rank, pool, store)
        assert pages.exists_prefix(HASHES) == 3
        assert pages.read(HASHES, [5, 6, 7]) == 3
        heads = HEADS // reader_tp
        got = pool.read_pages([5, 6, 7])
        assert torch.equal(got, truth[[1, 2, 3], ..., rank * heads:(rank + 1) * heads, :])
        # One slice per page in a page-major layout: the page itself is the payload.
        one = SLICES // reader_tp == 1
        assert pages._zero_copy == (one and layout != "layer_first")


def test_a_page_needs_every_one_of_its_slices(store):
    pool = rank_pool(1, "page_first_direct", "heads_outer")
    pool.buffer.copy_(torch.randn_like(pool.buffer))
    assert store_for(1, 0, pool, store).write(HASHES, [0, 1, 2]) == [True] * 3
    # Lose slice 3 of the second page: only ranks that hold slice 3 miss it.
    lost = [k for k in STORES[store] if k.endswith("-s3-" + HASHES[1].hex())]
    assert len(lost) == 1
    del STORES[store][lost[0]]
    whole = store_for(1, 0, rank_pool(1, "page_first_direct", "heads_outer"), store)
    assert whole.exists_prefix(HASHES) == 1
    assert whole.read(HASHES, [3, 4, 5]) == 1
    low = store_for(2, 0, rank_pool(2, "page_first_direct", "heads_outer"), store)
    high = store_for(2, 1, rank_pool(2, "page_first_direct", "heads_outer"), store)
    assert (low.exists_prefix(HASHES), high.exists_prefix(HASHES)) == (3, 1)
    assert (low.read(HASHES, [3, 4, 5]), high.read(HASHES, [3, 4, 5])) == (3, 1)


class _LosesSlice1(MemBackend):
    def put(self, keys, sources):
        kept = ["-s1-" not in k for k in keys]
        super().put([k for k, ok in zip(keys, kept) if ok],
                    [s for s, ok in zip(sources, kept) if ok])
        return kept


def test_a_page_is_written_only_with_all_its_slices(store):
    pool = rank_pool(2, "layer_first", "canonical")
    # Rank 0 holds slices 0 and 1: every page loses one, so none is written.
    assert store_for(2, 0, pool, store, _LosesSlice1).write(HASHES, [0, 1, 2]) == [False] * 3
    assert store_for(2, 1, pool, store, _LosesSlice1).write(HASHES, [0, 1, 2]) == [True] * 3


def test_heads_that_do_not_cut_into_the_ranks_slices_are_refused(store):
    pool = HostKVPool(PAGES, LAYERS, 2, BLOCK, 3, HEAD, torch.float32, "page_first",
                      pin_memory=False)
    with pytest.raises(ValueError, match="3 KV heads per page cannot be cut into 2"):
        store_for(2, 0, pool, store)


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_slices_cross_tp_sizes(store, encrypt):
    """With a storage secret each slice object is sealed on its own (MAC or
    AEAD through scratch): TP=2 still reads what TP=1 wrote."""
    from tests.conftest import make_config
    from vllm_hicache.storage.sealing import make_codec

    extra = {"storage_secret": "correct-horse-battery-staple-0123456789",
             "storage_encrypt": encrypt}
    st = make_config(hicache_storage_backend="file",
                     hicache_storage_backend_extra_config=extra).storage
    truth = torch.randn(PAGES, LAYERS, 2, BLOCK, HEADS, HEAD)
    writer = rank_pool(1, "page_first", "canonical")
    writer.write_pages(list(range(PAGES)), truth)
    pages = store_for(1, 0, writer, store, codec=make_codec(st.secret, st.encrypt))
    assert pages.write(HASHES, [0, 1, 2]) == [True] * 3
    for rank in range(2):
        pool = rank_pool(2, "page_first", "canonical")
        reader = store_for(2, rank, pool, store, codec=make_codec(st.secret, st.encrypt))
        assert reader.read(HASHES, [4, 5, 6]) == 3
        assert torch.equal(pool.read_pages([4, 5, 6]), truth[:3, ..., rank * 2:rank * 2 + 2, :])
