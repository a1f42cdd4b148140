"""Node-tier pages loaded straight into CUDA L1 (l3/node_loads.py): the
segment registered with cudaHostRegister in this process, then copied by
torch DMA (``direct``) or the compiled Triton kernels (``kernel``, which
reach the mapping through UVA). Skipped without CUDA; tests/l3 covers the
same path on CPU, with every fault."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_factory import same_bits
from tests.l3.test_node_loads import DST_BLOCKS, HASHES, SRC_BLOCKS, Instance
from vllm_hicache.kernels import describe_kv_tensor
from vllm_hicache.l3.node_loads import build_direct_loader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_a_registered_segment_loads_into_cuda_blocks(node_root, io_backend, request):
    if io_backend == "kernel":
        request.getfixturevalue("compiled_triton")
    a = Instance(node_root, "page_first_direct", seed=5)
    b = Instance(node_root, "page_first_direct")
    try:
        a.publish()
        layers = [t.to("cuda") for t in b.layers]  # strides preserved: same L1 layout
        layouts = [describe_kv_tensor(t, num_blocks=lo.num_blocks, block_size=lo.block_size,
                                      num_kv_heads=lo.heads, head_size=lo.head_size,
                                      is_mla=False, backend_name="FLASH_ATTN")
                   for t, lo in zip(layers, b.layouts)]
        loader = build_direct_loader(b.tier, b.store, layers, layouts, io_backend)
        try:
            assert loader.pool is not None and loader.pool.is_pinned
            assert loader.load(HASHES, DST_BLOCKS) == len(HASHES)
            for got, want in zip(layers, a.layers):
                assert same_bits(got[DST_BLOCKS].cpu(), want[SRC_BLOCKS])
            assert b.tier.stats().pinned_slots == 0
        finally:
            loader.close()
        assert not loader.pool.is_pinned
    finally:
        b.close()
        a.close()
