"""The PD roles (scheduler/pd.py): refusals at start, and a decode-offload
scheduler half through vLLM's real Scheduler (tests/connector/harness.py):
it never reports a hit, and every full block, prompt and generated, reaches
L3 in a form a prefill instance loads byte-exact."""

from __future__ import annotations

import uuid

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tests.connector import mem_backend
from tests.connector.harness import BLOCK, make_harness
from tests.l3.test_planner import num_pages_stored
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.config import HiCacheConfig
from vllm_hicache.config_finish import check_kv_role
from vllm_hicache.connector import HiCacheConnector
from vllm_hicache.scheduler.pd import PDRole, loads_hits, pd_role


def l3(store: str = "pd") -> dict:
    return {
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": {
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": store, "prefetch_threshold": BLOCK,
        },
    }


def offload(**extra) -> dict:
    return {"hicache_decode_offload": True, **l3(), **extra}


# --- configuration ---------------------------------------------------------------

def test_decode_offload_parses():
    cfg = HiCacheConfig.from_extra_config(offload())
    assert cfg.hicache_decode_offload and cfg.storage is not None
    assert not loads_hits(cfg)
    assert loads_hits(HiCacheConfig.from_extra_config(l3()))
    assert not HiCacheConfig().hicache_decode_offload


def test_decode_offload_needs_l3():
    with pytest.raises(ValueError, match=r"hicache_decode_offload=true needs an L3 backend: "
                                         r"set hicache_storage_backend"):
        HiCacheConfig.from_extra_config({"hicache_decode_offload": True})


@pytest.mark.parametrize("value", ["true", 1, None])
def test_decode_offload_must_be_a_bool(value):
    with pytest.raises(ValueError, match=r"invalid hicache_decode_offload=.*expected true"):
        HiCacheConfig.from_extra_config(offload(hicache_decode_offload=value))


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_decode_offload_needs_write_through(policy):
    with pytest.raises(ValueError, match=rf"needs hicache_write_policy='write_through' "
                                         rf"\(got '{policy}'\)"):
        HiCacheConfig.from_extra_config(offload(hicache_write_policy=policy))
    HiCacheConfig.from_extra_config(offload(hicache_write_policy="write_through"))


@pytest.mark.parametrize("key,value", [("hicache_load_mode", "async"),
                                       ("hicache_load_decision", "always"),
                                       ("hicache_storage_prefetch_policy", "wait_complete"),
                                       ("hicache_access_log", "/tmp/decode.log")])
def test_decode_offload_refuses_load_only_keys(key, value):
    with pytest.raises(ValueError, match=rf"{key} set with hicache_decode_offload=true: .* "
                                         "never loads"):
        HiCacheConfig.from_extra_config(offload(**{key: value}))


def test_kv_role_and_decode_offload_must_agree():
    off = HiCacheConfig.from_extra_config(offload())
    plain = HiCacheConfig.from_extra_config(l3())
    assert pd_role(off, "kv_consumer") is PDRole.DECODE_OFFLOAD
    assert pd_role(plain, "kv_producer") is PDRole.PREFILL
    assert pd_role(plain, "kv_both") is PDRole.SINGLE
    assert pd_role(plain, None) is PDRole.SINGLE
    assert loads_hits(plain) and not loads_hits(off)  # only a decode-offload instance skips
    for role in ("kv_producer", "kv_both"):
        with pytest.raises(ValueError, match=rf"hicache_decode_offload=true is the decode "
                                             rf"instance's role, but HiCache's "
                                             rf"kv_role='{role}'"):
            check_kv_role(off, role)
    with pytest.raises(ValueError, match=r"kv_role='kv_consumer' \(a decode instance\) needs "
                                         r"hicache_decode_offload=true"):
        check_kv_role(plain, "kv_consumer")
    with pytest.raises(ValueError, match=r"invalid kv_role='kv_decode'"):
        check_kv_role(plain, "kv_decode")


# --- the connector refuses at start ------------------------------------------------

SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)


def _connector(model_dir, role: KVConnectorRole, kv_role: str, extra: dict):
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
            kv_role=kv_role, kv_connector_extra_config={"hicache_io_backend": "direct",
                                                        **extra}))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(names, SPEC)])
    return HiCacheConnector(vllm_config, role, kv_cache_config)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_connector_refuses_contradicting_pd_roles(tiny_model_dir, role):
    with pytest.raises(ValueError, match=r"HiCache's kv_role='kv_producer'"):
        _connector(tiny_model_dir, role, "kv_producer", offload())
    with pytest.raises(ValueError, match=r"needs hicache_decode_offload=true"):
        _connector(tiny_model_dir, role, "kv_consumer", l3())
    with pytest.raises(ValueError, match=r"needs an L3 backend"):
        _connector(tiny_model_dir, role, "kv_consumer", {"hicache_decode_offload": True})


def test_decode_offload_needs_no_piecewise_cuda_graphs():
    """Nothing loads layer by layer on decode, so full CUDA graphs stay allowed."""
    assert not HiCacheConnector.requires_piecewise_for_cudagraph(offload())
    assert HiCacheConnector.requires_piecewise_for_cudagraph(l3())


# --- a decode-offload scheduler half ---------------------------------------------------

def test_decode_offload_writes_prompt_and_generated_blocks_and_never_loads(tiny_model_dir):
    store = uuid.uuid4().hex
    decode = make_harness(tiny_model_dir, kv_role="kv_consumer",
                          **offload(**l3(store)))
    tokens = prompt(40, 2 * BLOCK + 5)
    # 2 blocks of prompt, then generated tokens complete blocks 2 and 3 (the
    # last sampled token's KV is never computed: 4 * BLOCK + 4 tokens of KV).
    turn1 = decode.add("turn1", tokens, max_tokens=2 * BLOCK)
    decode.run()
    decode.step()  # the last backups' acknowledgements
    assert num_pages_stored(mem_backend.STORES[store]) == 4
    assert decode.sched_half.stats.hit_tokens_l2 == decode.sched_half.stats.hit_tokens_l3 == 0
    # The same prompt again, out of L1 but in L2 and L3: still no hit.
    assert decode.scheduler.reset_prefix_cache()
    decode.add("again", tokens, max_tokens=1)
    decode.run()
    assert decode.first_computed["again"] == 0
    assert decode.sched_half.l3.prefetched_blocks == 0
    assert not decode.load_checks
    assert_clean(decode)

    # The next turn on a prefill instance (same L3): every block decode
    # computed is a hit, loaded byte-exact (the harness checks each block).
    prefill = make_harness(tiny_model_dir, kv_role="kv_producer",
                           hicache_storage_prefetch_policy="wait_complete", **l3(store))
    turn2 = list(turn1.all_token_ids) + prompt(41, 10)
    prefill.add("turn2", turn2, max_tokens=1)
    prefill.run()
    assert prefill.first_computed["turn2"] == 4 * BLOCK
    assert prefill.sched_half.l3.prefetched_blocks == 4
    assert prefill.load_checks and all(prefill.load_checks)
    assert_clean(prefill)
