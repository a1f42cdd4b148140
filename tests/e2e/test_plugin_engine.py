"""An offline engine with ``kv_connector="HiCacheConnector"`` and no
``kv_connector_module_path``: vLLM finds the connector through the package's
``vllm.general_plugins`` entry point, which it loads itself."""

from __future__ import annotations

import pytest

from tests.e2e.engine_utils import BLOCK_SIZE, close, generate, make_llm, prompts_with_shared_prefix

pytestmark = pytest.mark.engine


def test_engine_finds_the_connector_without_module_path(tiny_model_dir):
    from vllm.config import KVTransferConfig

    from vllm_hicache.connector import HiCacheConnector

    ktc = KVTransferConfig(
        kv_connector="HiCacheConnector", kv_role="kv_both",
        kv_connector_extra_config={"hicache_io_backend": "direct"},
        kv_load_failure_policy="recompute",
    )
    assert ktc.kv_connector_module_path is None
    llm = make_llm(tiny_model_dir, connector=False, kv_transfer_config=ktc)
    try:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        assert isinstance(connector, HiCacheConnector)
        prompt = prompts_with_shared_prefix()[0]
        first, _ = generate(llm, [prompt])
        assert llm.reset_prefix_cache()  # L1 only: the prompt comes back from L2
        second, cached = generate(llm, [prompt])
        assert second == first
        assert cached[0] == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    finally:
        close(llm)
