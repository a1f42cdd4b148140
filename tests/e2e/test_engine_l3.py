"""L3 on a real vLLM CPU engine with the file backend: a prefix computed by
one process is served to another, reset keeps L3, corrupt objects are misses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    settle_backups,
)

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[2]


def l3_extra(path, policy="wait_complete") -> dict:
    return {
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": policy,
        "hicache_storage_backend_extra_config": {"path": str(path), "prefetch_threshold": 32},
        # These tests count hits by tier. Under "auto" the load gate declines
        # an L3 hit once its estimates say the tiny model recomputes it
        # faster, which a loaded machine's slow reads make it say now and
        # then (test_engine_load_decision.py tests the gate).
        "hicache_load_decision": "always",
    }


def expected_hits(prompts) -> list[int]:
    return [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]


def run_in_subprocess(model_dir, extra) -> None:
    """Process A: compute the prompts with L3 on, then exit."""
    script = textwrap.dedent(f"""
        from tests.e2e.engine_utils import close, generate, make_llm, prompts_with_shared_prefix
        llm = make_llm({str(model_dir)!r}, {extra!r})
        generate(llm, prompts_with_shared_prefix())
        close(llm)
        print("done")
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-4000:]


def test_another_process_gets_the_hits(tiny_model_dir, reference, tmp_path):
    extra = l3_extra(tmp_path / "l3")
    run_in_subprocess(tiny_model_dir, extra)
    assert any((tmp_path / "l3").rglob("*.hckv"))
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)  # fresh L1 and L2, same L3
    try:
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        assert cached == expected_hits(prompts)
        assert scheduler_half(llm).l3.prefetched_blocks > 0
        # reset_connector clears L2, not L3: the hits come back from L3.
        assert llm.reset_prefix_cache(reset_connector=True)
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        assert cached == expected_hits(prompts)
        assert scheduler_half(llm).stats.load_error_blocks == 0
    finally:
        close(llm)


def test_corrupt_objects_are_misses_with_identical_outputs(tiny_model_dir, reference, tmp_path):
    extra = l3_extra(tmp_path / "l3")
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)
    try:
        generate(llm, prompts)
        settle_backups(llm)
        # First show that L3 serves these prompts: otherwise "identical
        # outputs after corruption" would prove nothing.
        half = scheduler_half(llm)
        assert llm.reset_prefix_cache(reset_connector=True)
        outputs, cached = generate(llm, prompts)
        assert outputs == reference and cached == expected_hits(prompts)
        prefetched = half.l3.prefetched_blocks
        assert prefetched > 0
        files = sorted((tmp_path / "l3").rglob("*.hckv"))
        assert files
        for i, f in enumerate(files):  # flip, truncate, or swap objects
            data = bytearray(f.read_bytes())
            if i % 3 == 0:
                data[len(data) // 2] ^= 0xFF
            elif i % 3 == 1:
                data = data[:-7]
            else:
                data = bytearray(files[0].read_bytes())
            f.write_bytes(bytes(data))
        assert llm.reset_prefix_cache(reset_connector=True)
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        # Every object was damaged: nothing may come back from L3.
        assert half.l3.prefetched_blocks == prefetched
        assert half.stats.load_error_blocks == 0
    finally:
        close(llm)
