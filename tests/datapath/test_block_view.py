"""``block_view``: a Mamba group's raw int8 state tensor seen as attention
pages over the same bytes, so copies move each state page byte for byte."""

import pytest
import torch

from vllm_hicache.datapath.grouped import block_view

NUM_BLOCKS, PAGE_BYTES, STATE_BYTES = 6, 2 * 4 * 8 * 4, 100


def shared_memory():
    """One buffer holding an attention layer ``[blocks, 2, 4, 8]`` float32
    and, as vLLM lays it out, a Mamba layer's raw padded pages."""
    buffer = torch.zeros(NUM_BLOCKS * PAGE_BYTES, dtype=torch.int8)
    attention = buffer.view(torch.float32).view(NUM_BLOCKS, 2, 4, 8)
    raw = buffer.as_strided((NUM_BLOCKS, 1, 1, STATE_BYTES), (PAGE_BYTES, STATE_BYTES,
                                                              STATE_BYTES, 1))
    return buffer, attention, raw


def test_view_covers_each_state_page_byte_for_byte():
    buffer, attention, raw = shared_memory()
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8))
    view = block_view(raw, attention)
    assert view.shape == attention.shape and view.dtype == attention.dtype
    for block in range(NUM_BLOCKS):
        page = view[block].contiguous().view(torch.int8).flatten()
        assert torch.equal(page[:STATE_BYTES], raw[block].flatten())
    # Writing the whole view (a load) writes exactly the state bytes, padding included.
    src = torch.randn(attention.shape)
    view.copy_(src)
    assert torch.equal(buffer, src.view(torch.int8).flatten())


def test_mismatched_pages_refused():
    _, attention, raw = shared_memory()
    with pytest.raises(ValueError, match="block for block"):
        block_view(raw[:-1], attention)
    strided = attention.transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous page"):
        block_view(raw, strided)
