"""TP=2 on the CPU (multiprocess, gloo): two worker halves, one scheduler
half. Outputs with L2 + L3 hits equal the cold run; the scheduler's per-rank
accounting (prefetch progress, backup acks) completes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[2]


def test_tp2_l2_and_l3_hits(tiny_model_dir, tmp_path):
    script = textwrap.dedent(f"""
        from tests.e2e.l3_objects import await_objects
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        extra = {{"hicache_io_backend": "direct", "hicache_storage_backend": "file",
                  "hicache_storage_prefetch_policy": "wait_complete",
                  "hicache_storage_backend_extra_config": {{"path": {str(tmp_path / "l3")!r},
                                                           "prefetch_threshold": 32}}}}
        ktc = KVTransferConfig(kv_connector="HiCacheConnector",
                               kv_connector_module_path="vllm_hicache", kv_role="kv_both",
                               kv_connector_extra_config=extra)
        llm = LLM(model={str(tiny_model_dir)!r}, dtype="float32", block_size=32,
                  tensor_parallel_size=2, distributed_executor_backend="mp",
                  enable_prefix_caching=True, max_model_len=512, max_num_seqs=4,
                  enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 20,
                  skip_tokenizer_init=True, kv_transfer_config=ktc)
        prompt = TokensPrompt(prompt_token_ids=[3 + (i * 37) % 470 for i in range(150)])
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        cold = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert llm.reset_prefix_cache()
        l2 = llm.generate([prompt], sp, use_tqdm=False)[0]
        await_objects({str(tmp_path / "l3")!r}, 4 * 2)  # 4 full blocks, one copy per rank
        llm.generate([TokensPrompt(prompt_token_ids=[7, 8])], sp, use_tqdm=False)  # acks
        assert llm.reset_prefix_cache(reset_connector=True)
        l3 = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert cold.outputs[0].token_ids == l2.outputs[0].token_ids == l3.outputs[0].token_ids
        print("CACHED", l2.num_cached_tokens, l3.num_cached_tokens)
    """)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(REPO),
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "CACHED 128 128" in out.stdout
    objects = list((tmp_path / "l3").rglob("*.hckv"))
    assert {p.name.split("-")[2] for p in objects} == {"r0", "r1"}  # one copy per rank
