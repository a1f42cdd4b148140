import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec,
)

from tests.conftest import make_config
from vllm_hicache.connector.geometry import geometry_from, host_num_pages


def kv_config(*specs, num_blocks=100):
    groups = [KVCacheGroupSpec([f"l{i}.a", f"l{i}.b"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


FULL = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def test_full_attention_geometry():
    geom = geometry_from(kv_config(FULL))
    assert geom.block_size == 32
    assert geom.num_layers == 2
    # 2 layers x K,V x 32 tokens x 2 heads x 64 x 2 bytes
    assert geom.bytes_per_block == 2 * 2 * 32 * 2 * 64 * 2
    assert not geom.is_mla


def test_mla_geometry():
    spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    geom = geometry_from(kv_config(spec))
    assert geom.is_mla
    assert geom.bytes_per_block == 2 * 32 * 576 * 2


def test_hybrid_model_refused_with_reason():
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64,
                            dtype=torch.bfloat16, sliding_window=128)
    with pytest.raises(ValueError, match="Hybrid models"):
        geometry_from(kv_config(FULL, swa))


def test_sliding_window_in_full_attention_spec_is_served():
    """Without vLLM's hybrid allocator, windowed layers keep every token's KV."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16, sliding_window=128)
    assert geometry_from(kv_config(spec)).block_size == 32


def test_non_attention_spec_refused():
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="full-attention and MLA KV caches only; got MambaSpec"):
        geometry_from(kv_config(spec))


def test_pages_from_ratio_and_from_size():
    geom = geometry_from(kv_config(FULL, num_blocks=100))
    assert host_num_pages(make_config(hicache_ratio=2.5), geom) == 250
    size_gb = 10 * geom.bytes_per_block / 1e9
    assert host_num_pages(make_config(hicache_size=size_gb), geom) == 10


def test_size_smaller_than_one_page_is_an_error():
    geom = geometry_from(kv_config(FULL))
    with pytest.raises(ValueError, match="holds no page"):
        host_num_pages(make_config(hicache_size=1e-9), geom)
