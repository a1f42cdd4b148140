"""Prefill/decode disaggregation: HiCache next to NixlConnector, through
vllm-router, on the tiny Llama (full attention, float32).

The topology, the conversation and the checks are pd_topology.py's: a
reference server without any connector, a prefill and a decode server with
docs/pd.md's two ``--kv-transfer-config``s, vllm-router in front (started
once per module; the module takes about 100 s on 2 busy cores). Checked: a two-turn
conversation through the router equals the reference; turn 2's prefill hits
in L3 the blocks only decode computed; decode never looks up or loads; and
after a decode instance on other weights (same L3 keys) wrote turn 1, the
prefill instance's own answer to turn 2 changes.
"""

from __future__ import annotations

import pytest

from tests.e2e.pd_topology import (
    check_decode_only_offloads,
    check_decode_written_kv_is_used,
    check_second_turn_prefill_loads_decode_writes,
    check_two_turns_match_one_instance,
    hicache_entry,
    page_bytes,
    readme_pd_configs,
    run_pd_topology,
    unexpected_tracebacks,
)
from tests.e2e.test_serve import TEST_ARGS

pytestmark = pytest.mark.engine


_W = "(Worker pid=7) ERROR 12-01 02:56:46 [base_worker.py:1354] "
HANDSHAKE_TIMEOUT = "\n".join(_W + line for line in (
    "Handshake failed for request r1",
    "Traceback (most recent call last):",
    '  File "/v/nixl/base_worker.py", line 1047, in _nixl_handshake',
    "    reply_parts = sock.recv_multipart()",
    '  File "zmq/backend/cython/_zmq.py", line 186, in zmq.backend.cython._zmq._check_rc',
    "zmq.error.Again: Resource temporarily unavailable"))
OUR_ERROR = "\n".join(_W + line for line in (
    "Traceback (most recent call last):",
    '  File "/r/vllm_hicache/connector/worker.py", line 9, in start_load_kv',
    "    raise RuntimeError('boom')",
    "RuntimeError: boom"))


def test_log_check_passes_only_vllms_handshake_timeout():
    """The servers' logs may hold vLLM's recovered NIXL handshake timeout,
    nothing else: any other traceback (a shutdown's included) fails."""
    assert unexpected_tracebacks("INFO ok\n" + HANDSHAKE_TIMEOUT + "\nINFO ok") == []
    found = unexpected_tracebacks(HANDSHAKE_TIMEOUT + "\n" + OUR_ERROR + "\nINFO later")
    assert len(found) == 1 and found[0].endswith("RuntimeError: boom")
    # A traceback cut off at the end of the log is still reported.
    assert len(unexpected_tracebacks(OUR_ERROR.rsplit("\n", 1)[0])) == 1


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    return run_pd_topology(tiny_model_dir, tmp_path_factory.mktemp("pd"), TEST_ARGS,
                           page_bytes(tiny_model_dir, dtype_bytes=4))


def test_readme_configs_have_the_pd_roles():
    configs = readme_pd_configs()
    prefill, decode = (hicache_entry(configs[r]) for r in ("kv_producer", "kv_consumer"))
    assert prefill["kv_role"] == "kv_producer" and decode["kv_role"] == "kv_consumer"
    assert decode["kv_connector_extra_config"]["hicache_decode_offload"] is True
    assert "hicache_decode_offload" not in prefill["kv_connector_extra_config"]
    # Same L3 backend and layout options on both sides: the keys must agree.
    shared = {k: v for k, v in prefill["kv_connector_extra_config"].items()
              if k != "hicache_storage_prefetch_policy"}
    assert shared == {k: v for k, v in decode["kv_connector_extra_config"].items()
                      if k != "hicache_decode_offload"}


def test_two_turns_through_the_router_match_one_instance(pd):
    check_two_turns_match_one_instance(pd)


def test_second_turn_prefill_loads_what_decode_wrote_to_l3(pd):
    check_second_turn_prefill_loads_decode_writes(pd)


def test_decode_only_offloads(pd):
    check_decode_only_offloads(pd)


def test_negative_control_decode_written_kv_is_used(pd):
    check_decode_written_kv_is_used(pd)
