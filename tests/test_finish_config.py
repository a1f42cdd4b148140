"""config_finish.finish_config: the one function that finishes a parsed configuration."""

import json
import logging

import pytest

from vllm_hicache.config import HiCacheConfig, Rewrite
from vllm_hicache.config_finish import EngineFacts, finish_config
from vllm_hicache.host.layout_names import MemLayout
from vllm_hicache.kernels.io_backends import IOBackend


def test_rewrites_are_returned_not_logged(caplog):
    cfg = HiCacheConfig.parse({"hicache_mem_layout": "page_first"})
    with caplog.at_level(logging.DEBUG, logger="vllm_hicache"):
        done, rewrites = finish_config(cfg, EngineFacts(kernel_io_missing="CUDA"))
    assert caplog.records == []
    assert (done.hicache_io_backend, done.hicache_mem_layout) == ("direct", "page_first_direct")
    assert [(r.key, r.old, r.new) for r in rewrites] == [
        ("hicache_io_backend", "kernel", "direct"),
        ("hicache_mem_layout", "page_first", "page_first_direct")]
    assert "needs CUDA" in str(rewrites[0])
    # parse alone rewrites nothing: the connector finishes once per process.
    assert cfg.hicache_mem_layout is MemLayout.PAGE_FIRST


def test_nothing_to_rewrite():
    cfg = HiCacheConfig.parse({"hicache_io_backend": "direct"})
    assert finish_config(cfg, EngineFacts(kernel_io_missing="CUDA")) == (cfg, [])


def test_kv_role_contradiction_refused():
    with pytest.raises(ValueError, match="needs hicache_decode_offload=true"):
        finish_config(HiCacheConfig.parse({}), EngineFacts(kv_role="kv_consumer"))
    with pytest.raises(ValueError, match="invalid kv_role='kv_decode'"):
        finish_config(HiCacheConfig.parse({}), EngineFacts(kv_role="kv_decode"))


def test_option_values_are_named_and_still_strings():
    cfg = HiCacheConfig.parse({"hicache_io_backend": "direct"})
    assert cfg.hicache_io_backend is IOBackend.DIRECT and cfg.hicache_io_backend == "direct"
    assert json.dumps({"io": cfg.hicache_io_backend}) == '{"io": "direct"}'
    assert f"{cfg.hicache_write_policy}" == "write_through"


def test_rewrite_reads_as_a_log_line():
    assert str(Rewrite("k", "a", "b", "why")) == "k=a -> b: why"
