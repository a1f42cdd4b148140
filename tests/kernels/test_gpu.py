"""The copy backends on a real GPU: CUDA L1 tensors, pinned host pool.

Skipped without CUDA. Checks the same roundtrip as test_transfer.py, with
the compiled Triton kernels, issued from a transfer stream the way the
worker issues them.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.kernels.kv_factory import make_kv_layers, same_bits
from vllm_hicache.host import MEM_LAYOUTS, HostKVPool
from vllm_hicache.kernels import DirectTransfer, KernelTransfer, describe_kv_tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NB, NP, L, BLOCK, H, D = 64, 70, 4, 16, 4, 128


@pytest.fixture(scope="module")
def compiled_triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from vllm_hicache.kernels import triton_copy

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)
        importlib.reload(triton_copy)
    assert not triton_copy.is_interpreted()
    return triton_copy


@pytest.mark.parametrize("order", ["LBNHC", "LHBNC"])
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_cuda_roundtrip(mem_layout, io_backend, order, request):
    layers = make_kv_layers(order, num_layers=L, num_blocks=NB, heads=H, tokens=BLOCK,
                            content=2 * D, device="cuda")
    layouts = [
        describe_kv_tensor(t, num_blocks=NB, block_size=BLOCK, num_kv_heads=H, head_size=D,
                          is_mla=False, backend_name="FLASH_ATTN")
        for t in layers
    ]
    pool = HostKVPool(NP, L, 2, BLOCK, H, D, torch.bfloat16, mem_layout, pin_memory=True,
                      block_order=layouts[0].block_order)
    assert pool.is_pinned
    if io_backend == "kernel":
        request.getfixturevalue("compiled_triton")
        transfer = KernelTransfer(layers, layouts, pool)
    else:
        transfer = DirectTransfer(layers, layouts, pool)
    src, pages, dst = [1, 2, 3, 40, 7], [0, 1, 2, 69, 33], [9, 10, 11, 50, 0]
    before = [t.clone() for t in layers]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        transfer.store(src, pages)
    transfer.synchronize()
    canonical = torch.stack([lay.semantic_view(t)[src] for lay, t in zip(layouts, layers)], 1)
    assert same_bits(pool.read_pages(pages), canonical)
    transfer.load(dst, pages)
    transfer.synchronize()
    untouched = [b for b in range(NB) if b not in dst]
    for t, old in zip(layers, before):
        assert same_bits(t[dst], old[src]) and same_bits(t[untouched], old[untouched])
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        transfer.load_layer(2, [5], [69])
    transfer.wait_layer(2)  # the compute stream waits; the host does not
    torch.cuda.current_stream().synchronize()
    assert same_bits(layers[2][5], before[2][40])
    pool.close()
