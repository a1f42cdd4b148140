"""Start-time refusals of HiCacheConnector.__init__ (no engine, no model run)."""

from __future__ import annotations

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from vllm_hicache.connector import HiCacheConnector

BLOCK = 16
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
ROLES = [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER]


@pytest.fixture(scope="module")
def model_config(tiny_model_dir):
    return ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512)


def vllm_config_with(model_config, speculative_config=None):
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative_config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
            kv_role="kv_both", kv_connector_extra_config={"hicache_io_backend": "direct"}),
    )


def speculative(model_config, method, **kwargs):
    return SpeculativeConfig(method=method, num_speculative_tokens=2,
                             target_model_config=model_config,
                             target_parallel_config=ParallelConfig(), **kwargs)


def kv_cache_config(*group_layer_names, num_blocks=64):
    groups = [KVCacheGroupSpec(list(names), SPEC) for names in group_layer_names]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


TARGET_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def refusal(method: str) -> str:
    return rf"does not support speculative decoding \(speculative_config method='{method}'\)"


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model", "medusa"])
def test_speculation_with_a_drafter_model_is_refused(model_config, tiny_model_dir, method, role):
    spec = speculative(model_config, method, model=str(tiny_model_dir))
    vllm_config = vllm_config_with(model_config, spec)
    # The drafter's layers in the target's group, as vLLM groups equal specs.
    layers = TARGET_LAYERS + ["model.layers.2.self_attn.attn"]
    with pytest.raises(ValueError, match=refusal(method)):
        HiCacheConnector(vllm_config, role, kv_cache_config(layers))


@pytest.mark.parametrize("method", ["mtp", "dflash", "dspark", "suffix", "mlp_speculator",
                                    "custom_class", "extract_hidden_states"])
def test_methods_not_buildable_offline_are_refused_too(model_config, method):
    # Building these needs checkpoints or packages a test lacks; the check
    # reads the method alone, so a built config relabelled stands in.
    spec = speculative(model_config, "ngram")
    vllm_config = vllm_config_with(model_config, spec)
    vllm_config.speculative_config.method = method
    assert vllm_config.speculative_config.method == method
    with pytest.raises(ValueError, match=refusal(method)):
        HiCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config(TARGET_LAYERS))


def test_drafter_in_its_own_group_gets_the_speculation_message(model_config, tiny_model_dir):
    """Not the generic 'Hybrid models' one: the user learns what to turn off."""
    vllm_config = vllm_config_with(model_config,
                                   speculative(model_config, "eagle", model=str(tiny_model_dir)))
    kv = kv_cache_config(TARGET_LAYERS, ["draft.layers.0.self_attn.attn"])
    with pytest.raises(ValueError, match=refusal("eagle")):
        HiCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("method", ["ngram", "ngram_gpu"])
def test_token_only_speculation_is_served(model_config, method, role):
    vllm_config = vllm_config_with(model_config, speculative(model_config, method))
    assert vllm_config.speculative_config.method == method
    connector = HiCacheConnector(vllm_config, role, kv_cache_config(TARGET_LAYERS))
    try:
        half = connector.scheduler if role == KVConnectorRole.SCHEDULER else connector.worker
        assert half is not None
        # hicache_ratio 2.0 (default) x 64 L1 blocks.
        assert half.num_pages == 128
    finally:
        connector.shutdown()


def test_no_speculation_is_served(model_config):
    connector = HiCacheConnector(vllm_config_with(model_config), KVConnectorRole.SCHEDULER,
                                 kv_cache_config(TARGET_LAYERS))
    try:
        assert connector.scheduler is not None
    finally:
        connector.shutdown()


def test_unpinned_pool_falls_back_only_where_the_layout_allows_it():
    from tests.conftest import make_config
    from vllm_hicache.connector.worker import HiCacheWorker

    kept = HiCacheWorker._without_pinning(make_config(hicache_mem_layout="layer_first"))
    assert (kept.hicache_mem_layout, kept.hicache_io_backend) == ("layer_first", "direct")
    # page_first has no direct copy path, and the pool is already laid out.
    with pytest.raises(ValueError, match="memlock"):
        HiCacheWorker._without_pinning(make_config(hicache_mem_layout="page_first"))


@pytest.mark.parametrize("role", ROLES)
def test_rewrites_are_logged_once_by_the_scheduler_half(model_config, caplog, role):
    """finish_config's rewrites are logged by the scheduler half only: each
    worker makes the same ones from the same input and stays quiet."""
    import logging

    vllm_config = vllm_config_with(model_config)
    vllm_config.kv_transfer_config.kv_connector_extra_config["hicache_mem_layout"] = "page_first"
    with caplog.at_level(logging.WARNING, logger="vllm_hicache"):
        connector = HiCacheConnector(vllm_config, role, kv_cache_config(TARGET_LAYERS))
    try:
        half = connector.scheduler if role == KVConnectorRole.SCHEDULER else connector.worker
        assert half is not None and half.cfg.hicache_mem_layout == "page_first_direct"
        rewrites = [r.getMessage() for r in caplog.records
                    if "hicache_mem_layout" in r.getMessage()]
        if role == KVConnectorRole.SCHEDULER:
            assert rewrites == ["HiCache: hicache_mem_layout=page_first -> page_first_direct: "
                                "page_first with hicache_io_backend=direct becomes "
                                "page_first_direct (direct copies need page-contiguous runs)"]
        else:
            assert rewrites == []
    finally:
        connector.shutdown()
