"""Fidelity against vLLM itself: tensors built by vLLM's own
``create_kv_cache_views`` for every ``KVCacheLayout``, read back the way the
attention backends read them. Skipped when vLLM is not installed."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_factory import random_bits, same_bits
from vllm_hicache.host import HostKVPool
from vllm_hicache.kernels import DirectTransfer, describe_kv_tensor

kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface", reason="vLLM is not installed")
kv_layout = pytest.importorskip("vllm.v1.kv_cache_layout", reason="vLLM is not installed")

NB, L, BLOCK, HEADS, HEAD = 6, 3, 8, 2, 4
LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def vllm_views(spec, layout_name, kernel_block_size=None):
    layout = kv_layout.KVCacheLayout[layout_name]
    layer_stride, block_stride, *_ = kv_iface.compute_layout_strides(spec, NB, L, layout)
    size = spec.page_size_bytes * NB * L
    tensor = kv_iface.KVCacheTensor(
        size=size, layers=[f"layer{i}" for i in range(L)],
        layer_stride=layer_stride, block_stride=block_stride,
    )
    raw = random_bits(size, torch.int8)
    return kv_iface.create_kv_cache_views(
        raw, spec, NB, layout, tensor, kernel_block_size=kernel_block_size
    )


def roundtrip(views, layouts, mem_layout):
    pool = HostKVPool(
        4, L, layouts[0].planes, layouts[0].block_size, layouts[0].heads,
        layouts[0].head_size, views[0].dtype, mem_layout, block_order=layouts[0].block_order,
    )
    transfer = DirectTransfer(views, layouts, pool)
    before = [v.clone() for v in views]
    transfer.store([4, 1], [2, 0])
    transfer.load([0, 5], [2, 0])
    for view, old in zip(views, before):
        # Manager blocks: vLLM's kernel-block split puts several rows per block.
        view, old = view.unflatten(0, (NB, -1)), old.unflatten(0, (NB, -1))
        assert same_bits(view[[0, 5]], old[[4, 1]])
        assert same_bits(view[[1, 2, 3, 4]], old[[1, 2, 3, 4]])


@pytest.mark.parametrize("kernel_block_size", [None, BLOCK // 2])
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_flash_attn_views_of_every_layout(layout_name, kernel_block_size):
    if kernel_block_size and not layout_name.startswith("LB"):
        pytest.skip("vLLM splits kernel blocks only in layer-compact layouts")
    spec = kv_iface.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    views = vllm_views(spec, layout_name, kernel_block_size)
    layouts = [
        describe_kv_tensor(v, num_blocks=NB, block_size=BLOCK, num_kv_heads=HEADS,
                          head_size=HEAD, is_mla=False, backend_name="FLASH_ATTN")
        for v in views
    ]
    cells = layouts[1].cells(views[1])
    key, value = views[1].transpose(1, 2).split(HEAD, dim=-1)
    ratio = layouts[1].kernel_blocks
    shape = (NB, ratio, BLOCK // ratio, HEADS, HEAD)
    assert same_bits(cells[:, 0], key.reshape(shape))
    assert same_bits(cells[:, 1], value.reshape(shape))
    for mem_layout in ("layer_first", "page_first", "page_first_direct"):
        roundtrip(views, layouts, mem_layout)


def test_cpu_attn_view():
    spec = kv_iface.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    views = vllm_views(spec, "LBHNC")
    layout = describe_kv_tensor(views[0], num_blocks=NB, block_size=BLOCK, num_kv_heads=HEADS,
                               head_size=HEAD, is_mla=False, backend_name="CPU_ATTN")
    key, value = views[0].view(NB, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    sv = layout.semantic_view(views[0])
    assert same_bits(sv[:, 0], key.transpose(1, 2)) and same_bits(sv[:, 1], value.transpose(1, 2))


def test_mla_view():
    spec = kv_iface.MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=HEAD * 4, dtype=torch.bfloat16
    )
    views = vllm_views(spec, "LBNHC")
    layouts = [
        describe_kv_tensor(v, num_blocks=NB, block_size=BLOCK, num_kv_heads=1,
                          head_size=HEAD * 4, is_mla=True, backend_name="CPU_MLA")
        for v in views
    ]
    assert same_bits(layouts[0].semantic_view(views[0])[:, 0, :, 0], views[0][:, 0])
    roundtrip(views, layouts, "page_first")
