import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from tests.conftest import make_config
from vllm_hicache.config import HiCacheConfig
from vllm_hicache.config_finish import finish_config
from vllm_hicache.connector.connector import engine_facts
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


SWA = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64,
                        dtype=torch.bfloat16, sliding_window=128)


def test_sliding_and_full_groups_share_one_page_per_position():
    geom = geometry_from(kv_config(SWA, FULL, num_blocks=100))
    assert [g.kind for g in geom.groups] == ["sliding", "full"]
    assert [g.layers for g in geom.groups] == [range(0, 2), range(2, 4)]
    assert geom.groups[0].sliding_window_tokens == 128
    assert geom.layer_names == ("l0.a", "l0.b", "l1.a", "l1.b")
    # A page: one block position of all four layers.
    assert geom.bytes_per_block == 4 * 2 * 32 * 2 * 64 * 2
    assert geom.group_block_id(0, 7) == 7 and geom.group_block_id(1, 7) == 107


def mamba_spec(**overrides):
    """A Mamba state group whose padded page is one FULL page, as vLLM pads it."""
    from vllm.v1.kv_cache_interface import MambaSpec

    params = dict(block_size=32, shapes=((3, 160), (8, 16, 16)),
                  dtypes=(torch.float32, torch.float32),
                  page_size_padded=FULL.page_size_bytes, mamba_cache_mode="align")
    params.update(overrides)
    return MambaSpec(**params)


def test_mamba_and_attention_groups_share_one_page_per_position():
    geom = geometry_from(kv_config(mamba_spec(), FULL, num_blocks=100))
    assert [g.kind for g in geom.groups] == ["mamba", "full"]
    assert geom.mamba_groups == (0,)
    # The page layout is the attention group's, whichever group comes first.
    assert (geom.num_kv_heads, geom.head_size, geom.kv_dtype) == (2, 64, "bfloat16")
    assert geom.bytes_per_block == 4 * FULL.page_size_bytes
    assert geom.group_block_id(1, 3) == 103


@pytest.mark.parametrize("overrides, message", [
    ({"mamba_cache_mode": "all"}, r"group 0 \(MambaSpec.*mamba_cache_mode is 'all'"),
    ({"mamba_cache_mode": "none"}, r"mamba_cache_mode is 'none'"),
    ({"num_speculative_blocks": 1}, r"num_speculative_blocks=1.*speculative_config"),
    ({"page_size_padded": None}, r"block size and page bytes"),
    ({"block_size": 64}, r"block size and page bytes"),
])
def test_mamba_groups_a_page_cannot_hold_refused_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        geometry_from(kv_config(mamba_spec(**overrides), FULL))


def test_mamba_with_head_slices_refused_naming_the_key():
    geom = geometry_from(kv_config(mamba_spec(), FULL))
    cfg = make_config(hicache_storage_backend="file",
                      hicache_storage_backend_extra_config={"path": "/tmp/x", "tp_lcm_size": 2})
    with pytest.raises(ValueError, match="tp_lcm_size .*Mamba"):
        finish(cfg, geom)


def test_mamba_groups_without_attention_refused():
    with pytest.raises(ValueError, match="needs an attention KV cache group"):
        geometry_from(kv_config(mamba_spec(), mamba_spec()))


def test_groups_with_different_block_shapes_refused():
    other = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=64,
                              dtype=torch.bfloat16, sliding_window=128)
    with pytest.raises(ValueError, match="same per-layer block shape"):
        geometry_from(kv_config(FULL, other))


def test_chunked_local_group_refused():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    local = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                      dtype=torch.bfloat16, attention_chunk_size=64)
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec.*full attention, "
                                         "sliding window and Mamba state"):
        geometry_from(kv_config(FULL, local))


def finish(cfg: HiCacheConfig, geom):
    """``cfg`` finished for ``geom`` on a CUDA-less platform; the rewrites."""
    return finish_config(cfg, engine_facts(geom, None))


def test_hybrid_load_mode_becomes_async_unless_set():
    geom = geometry_from(kv_config(SWA, FULL))
    cfg, rewrites = finish(make_config(hicache_io_backend="direct"), geom)
    assert cfg.hicache_load_mode == "async"
    # The rewrite is reported (the scheduler half logs it), naming the groups.
    assert [(r.key, r.old, r.new) for r in rewrites] == [("hicache_load_mode", "layerwise",
                                                          "async")]
    assert "2 KV cache groups: sliding+full" in str(rewrites[0])
    with pytest.raises(ValueError, match="hicache_load_mode=layerwise is not supported for "
                                         "hybrid models"):
        finish(make_config(hicache_load_mode="layerwise"), geom)
    with pytest.raises(ValueError, match="hicache_write_policy=write_back"):
        finish(make_config(hicache_write_policy="write_back"), geom)
    # One group: nothing changes.
    single = geometry_from(kv_config(FULL))
    cfg, rewrites = finish(make_config(hicache_io_backend="direct"), single)
    assert (cfg.hicache_load_mode, rewrites) == ("layerwise", [])


def test_sliding_window_in_full_attention_spec_is_served():
    """Without vLLM's hybrid allocator, windowed layers keep every token's KV."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16, sliding_window=128)
    assert geometry_from(kv_config(spec)).block_size == 32


def test_non_attention_spec_refused():
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="full-attention and MLA KV caches only .*got MambaSpec"):
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


# --- pipeline parallelism: every stage and the scheduler count the same pages ---

# One layer's share of a FULL block: K,V x 32 tokens x 2 heads x 64 x 2 bytes.
FULL_LAYER_BLOCK_BYTES = 2 * 32 * 2 * 64 * 2
# 1 MB: 7 pages of an 8-layer stage but 8 pages of a 7-layer one, so sizing by
# the wrong stage shows up as a different page count.
HICACHE_SIZE_GB = 0.001


@pytest.fixture(scope="module")
def pp_model_config(tiny_model_dir):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512,
                       hf_overrides={"num_hidden_layers": 30})


def pp_vllm_config(model_config, pp_size: int):
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    return VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                      parallel_config=ParallelConfig(pipeline_parallel_size=pp_size))


def stage_kv_configs(stage_sizes, num_blocks=100):
    """Per-worker KV cache configs as vLLM builds them: each holds its stage's layers."""
    configs, first = [], 0
    for size in stage_sizes:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(first, first + size)]
        configs.append(KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                     kv_cache_groups=[KVCacheGroupSpec(names, FULL)]))
        first += size
    return configs


def pages_of_every_process(vllm_config, stage_sizes, cfg):
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    workers = stage_kv_configs(stage_sizes)
    scheduler = generate_scheduler_kv_cache_config(workers)
    geoms = [geometry_from(c, vllm_config) for c in workers]
    return (host_num_pages(cfg, geometry_from(scheduler, vllm_config)),
            [host_num_pages(cfg, g) for g in geoms], geoms)


@pytest.mark.parametrize("partition_env, stage_sizes", [
    (None, [7, 8, 8, 7]),          # vLLM's default split of 30 layers on 4 stages
    ("4,10,9,7", [4, 10, 9, 7]),   # VLLM_PP_LAYER_PARTITION, largest stage in the middle
])
def test_pp_stages_and_scheduler_agree_on_pages_by_size(
    pp_model_config, monkeypatch, partition_env, stage_sizes,
):
    if partition_env is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition_env)
    vllm_config = pp_vllm_config(pp_model_config, 4)
    cfg = make_config(hicache_size=HICACHE_SIZE_GB)
    sched_pages, stage_pages, geoms = pages_of_every_process(vllm_config, stage_sizes, cfg)

    assert stage_pages == [sched_pages] * 4
    largest_page_bytes = max(stage_sizes) * FULL_LAYER_BLOCK_BYTES
    assert sched_pages == cfg.host_bytes_override // largest_page_bytes
    for geom, size in zip(geoms, stage_sizes):
        assert geom.bytes_per_block == size * FULL_LAYER_BLOCK_BYTES
        assert sched_pages * geom.bytes_per_block <= cfg.host_bytes_override
    # Sized from the scheduler's own (first) stage alone, the largest stage
    # would overflow: the case this sizing exists for.
    first_stage_alone = host_num_pages(cfg, geometry_from(stage_kv_configs(stage_sizes)[0]))
    assert first_stage_alone * largest_page_bytes > cfg.host_bytes_override


def test_pp_stages_agree_on_pages_by_ratio(pp_model_config, monkeypatch):
    """vLLM gives every stage the smallest num_blocks, so ratio x L1 agrees."""
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    vllm_config = pp_vllm_config(pp_model_config, 4)
    sched_pages, stage_pages, _ = pages_of_every_process(
        vllm_config, [7, 8, 8, 7], make_config(hicache_ratio=2.5))
    assert stage_pages == [250] * 4
    assert sched_pages == 250


def test_pp_stage_with_more_layers_than_partition_refused(pp_model_config, monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    vllm_config = pp_vllm_config(pp_model_config, 4)
    with pytest.raises(ValueError, match=r"largest pipeline stage, 8 layers .* has 9 layers"):
        geometry_from(stage_kv_configs([9])[0], vllm_config)


def test_without_pp_pages_follow_the_kv_cache_layers(pp_model_config):
    """PP size 1: the KV cache's 2 layers size L2, not the model's 30 decoder layers."""
    vllm_config = pp_vllm_config(pp_model_config, 1)
    cfg = make_config(hicache_size=HICACHE_SIZE_GB)
    geom = geometry_from(stage_kv_configs([2])[0], vllm_config)
    assert host_num_pages(cfg, geom) == cfg.host_bytes_override // (2 * FULL_LAYER_BLOCK_BYTES)
