"""Host layouts: buffer shapes, BlockOrder, and semantic cells of each layout."""

from __future__ import annotations

import pytest
import torch

from vllm_hicache.host import MEM_LAYOUTS, BlockOrder, HostLayout, page_bytes, pool_bytes
from vllm_hicache.host.layout import as_dims5

PAGES, LAYERS, PLANES, BLOCK, HEADS, HEAD = 5, 3, 2, 4, 2, 3


def layout(name: str, order: BlockOrder | None = None) -> HostLayout:
    order = order or BlockOrder.canonical(PLANES, BLOCK, HEADS, HEAD)
    return HostLayout(name, PAGES, LAYERS, order)


def test_buffer_shapes():
    e = PLANES * BLOCK * HEADS * HEAD
    assert layout("layer_first").buffer_shape == (LAYERS, PAGES, e)
    assert layout("page_first_direct").buffer_shape == (PAGES, LAYERS, e)
    assert layout("page_first").buffer_shape == (PAGES, PLANES, BLOCK, LAYERS, HEADS, HEAD)


def test_unknown_layout_names_the_choices():
    with pytest.raises(ValueError, match="layer_first, page_first, page_first_direct"):
        layout("page_last")


@pytest.mark.parametrize("name", MEM_LAYOUTS)
def test_cells_address_every_element_once(name):
    lay = layout(name)
    buffer = torch.arange(PAGES * lay.elems_per_page).view(lay.buffer_shape)
    cells = lay.cells(buffer)
    assert cells.shape == (PAGES, LAYERS, PLANES, 1, BLOCK, HEADS, HEAD)
    assert cells.flatten().sort().values.equal(torch.arange(buffer.numel()))


def test_page_first_is_token_major_across_layers():
    lay = layout("page_first")
    buffer = torch.arange(PAGES * lay.elems_per_page).view(lay.buffer_shape)
    cells = lay.cells(buffer)
    # K of token t: layer l's heads directly follow layer l-1's.
    assert cells[2, 1, 0, 0, 3, 0, 0] - cells[2, 0, 0, 0, 3, 0, 0] == HEADS * HEAD
    # V blob starts after the whole K blob of the page.
    assert cells[2, 0, 1, 0, 0, 0, 0] - cells[2, 0, 0, 0, 0, 0, 0] == BLOCK * LAYERS * HEADS * HEAD


def test_page_first_direct_page_is_one_run():
    lay = layout("page_first_direct")
    buffer = torch.arange(PAGES * lay.elems_per_page).view(lay.buffer_shape)
    page = lay.cells(buffer)[3]
    assert page.min() == 3 * lay.elems_per_page and page.max() == 4 * lay.elems_per_page - 1


def test_native_rows_follow_block_order():
    # Heads outermost: rows hold head 0 of every (plane, token), then head 1.
    dims = (PLANES, 1, BLOCK, HEADS, HEAD)
    order = BlockOrder(dims, (BLOCK * HEAD, 0, HEAD, PLANES * BLOCK * HEAD, 1))
    lay = layout("layer_first", order)
    buffer = torch.arange(PAGES * lay.elems_per_page).view(lay.buffer_shape)
    cells = lay.cells(buffer)
    assert cells[0, 0, 0, 0, 0, 1, 0] == PLANES * BLOCK * HEAD
    assert cells[1, 2, 0, 0, 0, 0, 0] == (2 * PAGES + 1) * lay.elems_per_block


def test_block_order_rejects_gaps_and_normalises_unit_axes():
    with pytest.raises(AssertionError, match="gaps or overlaps"):
        BlockOrder((2, 1, 4, 1, 8), (64, 0, 8, 0, 1))
    assert BlockOrder((2, 1, 4, 1, 8), (32, 7, 8, 99, 1)) == BlockOrder.canonical(2, 4, 1, 8)


def test_sizes():
    e = PLANES * BLOCK * HEADS * HEAD
    assert page_bytes(LAYERS, e, torch.bfloat16) == LAYERS * e * 2
    assert pool_bytes(layout("page_first"), torch.float32) == PAGES * LAYERS * e * 4


# --- head slices (heterogeneous TP) --------------------------------------------


def heads_outer(heads: int) -> BlockOrder:
    """A CPU_ATTN-like native order: [head, plane, token, elem]."""
    dims = (PLANES, 1, BLOCK, heads, HEAD)
    return BlockOrder(dims, (BLOCK * HEAD, 0, HEAD, PLANES * BLOCK * HEAD, 1))


def test_with_heads_keeps_the_nesting_and_closes_the_gaps():
    four = heads_outer(4)
    assert four.with_heads(4) == four
    assert four.with_heads(2) == heads_outer(2)
    assert four.with_heads(1).strides == (BLOCK * HEAD, 0, HEAD, 0, 1)
    canonical = BlockOrder.canonical(PLANES, BLOCK, 4, HEAD)
    assert canonical.with_heads(2) == BlockOrder.canonical(PLANES, BLOCK, 2, HEAD)


@pytest.mark.parametrize("name", MEM_LAYOUTS)
@pytest.mark.parametrize("order", [None, "heads_outer"])
def test_a_head_slice_is_the_page_of_a_pool_with_those_heads(name, order):
    """Copying slice j out of a 4-head page gives the bytes that a 2-head
    pool holding those heads has as its page payload."""
    big_order = heads_outer(4) if order else BlockOrder.canonical(PLANES, BLOCK, 4, HEAD)
    big = HostLayout(name, PAGES, LAYERS, big_order)
    small = HostLayout(name, PAGES, LAYERS, big_order.with_heads(2))
    assert big.head_slice_layout(2) == HostLayout(name, 1, LAYERS, small.order)
    big_buf = torch.randn(big.buffer_shape)
    small_buf = torch.empty(small.buffer_shape)
    small.cells(small_buf).copy_(big.cells(big_buf)[..., 2:4, :])
    payload = big.head_slice(big_buf, 3, 2, 2).contiguous().flatten()
    # The small pool's payload of page 3: its cells in payload order.
    expected = small.cells(small_buf)[3].permute(small.payload_axes()).contiguous().flatten()
    assert torch.equal(payload, expected)
    if name != "layer_first":  # page-major: the payload is the page run
        assert torch.equal(payload, small_buf[3].flatten())


@pytest.mark.parametrize("name", ["page_first", "page_first_direct"])
def test_all_heads_of_a_page_major_page_are_the_page_run_itself(name):
    lay = HostLayout(name, PAGES, LAYERS, heads_outer(HEADS))
    buffer = torch.arange(PAGES * lay.elems_per_page).view(lay.buffer_shape)
    whole = lay.head_slice(buffer, 2, 0, HEADS)
    assert whole.is_contiguous() and whole.data_ptr() == buffer[2].data_ptr()


def test_as_dims5_takes_exactly_five_axes():
    assert as_dims5(iter([1, 2, 3, 4, 5])) == (1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="expected 5 block axes, got 4"):
        as_dims5([1, 2, 3, 4])
