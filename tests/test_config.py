import dataclasses
import logging

import pytest

from tests.conftest import make_config
from vllm_hicache.config import HiCacheConfig, resolve_conflicts
from vllm_hicache.policy.write import WritePolicy


def test_defaults_mirror_sglang():
    cfg = HiCacheConfig.from_extra_config(None)
    assert cfg.hicache_ratio == 2.0
    assert cfg.hicache_size == 0.0
    assert cfg.hicache_write_policy == "write_through"
    assert cfg.hicache_mem_layout == "layer_first"
    assert cfg.hicache_io_backend == "kernel"
    assert cfg.radix_eviction_policy == "lru"
    assert cfg.hicache_load_mode == "layerwise"


def test_config_is_frozen():
    cfg = make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hicache_ratio = 3.0


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("hicache_ratio", 1.0, "must be > 1"),
        ("hicache_ratio", "abc", "expected a number"),
        ("hicache_ratio", True, "expected a number"),
        ("hicache_ratio", float("nan"), "hicache_ratio"),
        ("hicache_size", -1, "must be >= 0"),
        ("hicache_write_policy", "write_around",
         "write_through, write_through_selective, write_back"),
        ("hicache_mem_layout", "page_head", "layer_first, page_first, page_first_direct"),
        ("hicache_io_backend", 3, "kernel, direct"),
        ("radix_eviction_policy", "random", "lru, lfu, fifo, mru, filo, priority"),
        ("hicache_load_mode", "sync", "layerwise, async"),
    ],
)
def test_bad_values_name_key_value_and_choices(key, value, match):
    with pytest.raises(ValueError, match=match) as err:
        make_config(**{key: value})
    assert key in str(err.value)


def test_unknown_key_lists_accepted_keys():
    with pytest.raises(ValueError, match="hicache_ratoi") as err:
        make_config(hicache_ratoi=3)
    assert "hicache_ratio" in str(err.value)


@pytest.mark.parametrize(
    "key", ["hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config"]
)
def test_l3_keys_need_a_backend(key):
    with pytest.raises(ValueError, match="without hicache_storage_backend") as err:
        make_config(**{key: "x"})
    assert key in str(err.value)


def test_numbers_accept_strings_and_ints():
    cfg = make_config(hicache_ratio="3", hicache_size=4)
    assert cfg.hicache_ratio == 3.0
    assert cfg.host_bytes_override == 4_000_000_000


def test_write_threshold():
    # The policy a config names is the threshold's one home (policy/write.py).
    def threshold(cfg):
        return WritePolicy(cfg.hicache_write_policy, 8).threshold

    assert threshold(make_config()) == 1
    assert threshold(make_config(hicache_write_policy="write_through_selective")) == 2


@pytest.mark.parametrize(
    "layout, io, want_layout, want_io",
    [
        ("page_first_direct", "kernel", "page_first_direct", "direct"),
        ("page_first", "direct", "page_first_direct", "direct"),
        ("layer_first", "direct", "layer_first", "direct"),
        ("page_first", "kernel", "page_first", "kernel"),
    ],
)
def test_incompatible_pairs_rewritten_with_one_warning(caplog, layout, io, want_layout, want_io):
    with caplog.at_level(logging.WARNING, logger="vllm_hicache.config"):
        cfg = make_config(hicache_mem_layout=layout, hicache_io_backend=io)
    assert (cfg.hicache_mem_layout, cfg.hicache_io_backend) == (want_layout, want_io)
    changed = (layout, io) != (want_layout, want_io)
    assert len(caplog.records) == (1 if changed else 0)


def test_kernel_without_cuda_falls_back_to_direct(caplog):
    cfg = make_config(hicache_mem_layout="page_first")
    with caplog.at_level(logging.WARNING, logger="vllm_hicache.config"):
        resolved = resolve_conflicts(cfg, kernel_io_missing="CUDA")
    assert resolved.hicache_io_backend == "direct"
    # page_first needs the kernel backend; without it the layout follows.
    assert resolved.hicache_mem_layout == "page_first_direct"
    assert any("needs CUDA" in r.message for r in caplog.records)


def test_redacted_strips_url_and_query_secrets():
    from vllm_hicache.redaction import redacted

    shown = redacted({"url": "redis://alice:pw1@h:6379/0?password=pw2&db=1;token=pw3",
                      "nested": [{"Password": "pw4"}, "https://x/?sig=1&api_key=pw5#f"],
                      "ok": 3})
    text = repr(shown)
    for secret in ("pw1", "pw2", "pw3", "pw4", "pw5"):
        assert secret not in text
    assert shown["ok"] == 3 and "db=1" in text and "sig=1" in text and "alice" not in text
    assert redacted("error: cannot reach redis://h:1/0?password=hunter2 (refused)") == \
        "error: cannot reach redis://h:1/0?password=<redacted> (refused)"


def test_l3_breaker_keys():
    cfg = make_config()
    assert cfg.l3_breaker and cfg.l3_breaker_window_s == 10.0
    assert cfg.l3_breaker_latency_budget_ms == 1000.0 and cfg.l3_breaker_probe_interval_s == 1.0
    cfg = make_config(l3_breaker_window_s=2, l3_breaker_latency_budget_ms=250,
                      l3_breaker_probe_interval_s=0.5)
    assert (cfg.l3_breaker_window_s, cfg.l3_breaker_latency_budget_ms,
            cfg.l3_breaker_probe_interval_s) == (2.0, 250.0, 0.5)
    assert not make_config(l3_breaker=False).l3_breaker


@pytest.mark.parametrize("key, value", [
    ("l3_breaker", "yes"), ("l3_breaker_window_s", -1), ("l3_breaker_latency_budget_ms", 0),
    ("l3_breaker_probe_interval_s", 0), ("l3_breaker_window_s", float("inf")),
])
def test_l3_breaker_bad_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        make_config(**{key: value})


def test_l3_breaker_settings_with_the_breaker_off_are_refused():
    with pytest.raises(ValueError, match="l3_breaker_window_s: set, but l3_breaker is false"):
        make_config(l3_breaker=False, l3_breaker_window_s=3)
