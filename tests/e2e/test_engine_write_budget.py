"""An L3 write budget on a real vLLM CPU engine (file backend): answers are
unchanged, blocks over the budget are skipped and counted, and the bytes
that reached L3 stay within burst + rate x elapsed time."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
)
from vllm_hicache.l3.canary import is_canary_key
from vllm_hicache.storage.format import HEADER_BYTES

pytestmark = pytest.mark.engine


def block_bytes(model_dir) -> int:
    """One block's L3 object (float32, one TP rank)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return HEADER_BYTES + (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim
                           * BLOCK_SIZE * 4)


def l3_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.hckv") if not is_canary_key(p.stem))


def test_a_write_budget_skips_blocks_and_keeps_answers(tiny_model_dir, reference, tmp_path):
    one = block_bytes(tiny_model_dir)
    burst, rate = 3 * one, one // 20   # three blocks at once, then one every 20 s
    extra = {
        "hicache_io_backend": "direct", "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": {
            "path": str(tmp_path / "l3"), "l3_write_budget_bytes_per_s": rate,
            "l3_write_burst_bytes": burst},
    }
    began = time.monotonic()
    llm = make_llm(tiny_model_dir, extra)
    try:
        planner = scheduler_half(llm).l3
        assert planner.block_bytes == one
        outputs, _ = generate(llm, prompts_with_shared_prefix())
        assert outputs == reference
        for _ in range(3):  # let the last acknowledgements in
            generate(llm, [[7, 8, 9]], max_tokens=1)
        skipped = planner.budget_skipped_bandwidth
        assert skipped > 0, "nothing was over the budget"
        written = l3_bytes(tmp_path / "l3")
        elapsed = time.monotonic() - began
        assert 0 < written <= burst + rate * elapsed
        assert written == planner.write_budget.spent_bytes  # every planned byte landed
        # Each block is backed up or skipped, never both.
        assert planner.backups.backed_up_blocks * one == planner.write_budget.spent_bytes
    finally:
        close(llm)
