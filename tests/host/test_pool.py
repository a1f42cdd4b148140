"""HostKVPool: allocation, canonical page access, byte-exact roundtrips."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_factory import random_bits, same_bits
from vllm_hicache.host import MEM_LAYOUTS, BlockOrder, HostKVPool, MemInfo
from vllm_hicache.host.memory import GiB

PAGES, LAYERS, PLANES, BLOCK, HEADS, HEAD = 9, 3, 2, 4, 2, 8
# Native order of a head-outer L1 tensor: [head][plane][token][elem].
HEAD_OUTER = BlockOrder(
    (PLANES, 1, BLOCK, HEADS, HEAD), (BLOCK * HEAD, 0, HEAD, PLANES * BLOCK * HEAD, 1)
)


def make_pool(mem_layout, order=None, dtype=torch.bfloat16, **kwargs):
    return HostKVPool(PAGES, LAYERS, PLANES, BLOCK, HEADS, HEAD, dtype, mem_layout,
                      block_order=order, **kwargs)


@pytest.mark.parametrize("order", [None, HEAD_OUTER], ids=["canonical", "head_outer"])
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_write_then_read_is_byte_exact(mem_layout, order):
    pool = make_pool(mem_layout, order)
    pages = [6, 0, 3]
    data = random_bits(len(pages) * LAYERS * PLANES * BLOCK * HEADS * HEAD, torch.bfloat16)
    data = data.view(len(pages), LAYERS, PLANES, BLOCK, HEADS, HEAD)
    pool.write_pages(pages, data)
    assert same_bits(pool.read_pages(pages), data)
    others = [p for p in range(PAGES) if p not in pages]
    assert not pool.read_pages(others).view(torch.int16).any()


@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_new_pool_is_zeroed_and_sized(mem_layout):
    pool = make_pool(mem_layout, dtype=torch.float32)
    assert not pool.buffer.any()
    assert pool.bytes_per_page == LAYERS * PLANES * BLOCK * HEADS * HEAD * 4
    assert pool.num_bytes == pool.buffer.numel() * 4 == PAGES * pool.bytes_per_page
    assert not pool.is_pinned  # pin_memory=None: pinned only with CUDA
    assert pool.canonical_page_shape == (LAYERS, PLANES, BLOCK, HEADS, HEAD)


@pytest.mark.parametrize("mem_layout", ["page_first", "page_first_direct"])
def test_page_run_is_the_whole_page(mem_layout):
    pool = make_pool(mem_layout)
    run = pool.page_run(4)
    run.fill_(1.0)
    assert run.numel() * 2 == pool.bytes_per_page
    assert pool.read_pages([4]).eq(1.0).all() and not pool.read_pages([3, 5]).any()


def test_layer_first_has_no_page_run():
    with pytest.raises(ValueError, match="not contiguous"):
        make_pool("layer_first").page_run(0)


def test_oversized_pool_fails_before_allocating(monkeypatch):
    def no_alloc(*args, **kwargs):
        raise AssertionError("allocated before checking the size")

    monkeypatch.setattr(HostKVPool, "_allocate", no_alloc)
    with pytest.raises(ValueError, match="does not fit"):
        make_pool("page_first", meminfo=MemInfo(4 * GiB, 1 * GiB))


def test_write_pages_checks_shape_and_dtype():
    pool = make_pool("layer_first")
    with pytest.raises(ValueError, match="write_pages needs"):
        pool.write_pages([0], torch.zeros(1, LAYERS, PLANES, BLOCK, HEADS, HEAD))


def test_block_order_must_describe_the_block():
    with pytest.raises(ValueError, match="does not describe"):
        make_pool("layer_first", BlockOrder.canonical(PLANES, BLOCK, HEADS, HEAD * 2))


@pytest.mark.parametrize("pages", [[2, 3, 4, 5], [1, 2, 5, 6], [7, 0, 4, 2], [5, 4, 3, 2],
                                   [8, 0, 1, 2, 3, 6]],
                         ids=["one_run", "runs_of_two", "scattered", "descending", "mixed"])
@pytest.mark.parametrize("order", [None, HEAD_OUTER], ids=["canonical", "head_outer"])
@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first_direct"])
def test_layer_payloads_land_in_their_pages_however_the_pages_run(mem_layout, order, pages):
    """Each layer's run of the L3 payload, written layer by layer (slice
    copies for runs of pages, index_copy_ for scattered ones), leaves every
    page as the whole payload would, and no other page touched."""
    pool = make_pool(mem_layout, order)
    data = random_bits(len(pages) * LAYERS * PLANES * BLOCK * HEADS * HEAD, torch.bfloat16)
    canonical = data.view(len(pages), LAYERS, PLANES, BLOCK, HEADS, HEAD)
    reference = make_pool(mem_layout, order)
    reference.write_pages(pages, canonical)
    axes = pool.layout.payload_axes()
    cells = reference.cells()[pages]
    payload = cells.permute(0, *(1 + a for a in axes)).reshape(len(pages), -1)
    payload = payload.contiguous().view(torch.uint8)
    layer_bytes = payload.shape[1] // LAYERS
    for layer in range(LAYERS):
        pool.write_layer_payloads(layer, pages,
                                  payload[:, layer * layer_bytes:(layer + 1) * layer_bytes])
    assert same_bits(pool.buffer, reference.buffer)


@pytest.mark.parametrize("pages", [[2, 3, 4, 5], [1, 2, 5, 6], [7, 0, 4, 2], [5, 4, 3, 2],
                                   [8, 0, 1, 2, 3, 6]],
                         ids=["one_run", "runs_of_two", "scattered", "descending", "mixed"])
@pytest.mark.parametrize("order", [None, HEAD_OUTER], ids=["canonical", "head_outer"])
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_whole_pages_land_and_read_back_however_the_pages_run(mem_layout, order, pages):
    """write_pages / read_pages copy runs of pages as slices and scattered
    pages by index: page by page the same bytes either way."""
    pool = make_pool(mem_layout, order)
    data = random_bits(len(pages) * LAYERS * PLANES * BLOCK * HEADS * HEAD, torch.bfloat16)
    data = data.view(len(pages), LAYERS, PLANES, BLOCK, HEADS, HEAD)
    pool.write_pages(pages, data)
    for i, page in enumerate(pages):
        assert same_bits(pool.read_pages([page])[0], data[i])
    got = pool.read_pages(pages)
    assert got.is_contiguous() and same_bits(got, data)
    others = [p for p in range(PAGES) if p not in pages]
    assert not pool.read_pages(others).view(torch.int16).any()
