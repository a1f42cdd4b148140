"""vLLM's default multiprocess executor: the worker half runs in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]


def test_multiprocess_engine_hits_l2(tiny_model_dir):
    script = textwrap.dedent(
        f"""
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        ktc = KVTransferConfig(kv_connector="HiCacheConnector",
                               kv_connector_module_path="vllm_hicache", kv_role="kv_both",
                               kv_connector_extra_config={{"hicache_io_backend": "direct"}})
        llm = LLM(model={str(tiny_model_dir)!r}, dtype="float32", block_size=32,
                  enable_prefix_caching=True, max_model_len=512, max_num_seqs=4,
                  enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 20,
                  skip_tokenizer_init=True, kv_transfer_config=ktc)
        prompt = TokensPrompt(prompt_token_ids=[3 + (i * 37) % 470 for i in range(150)])
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        first = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert llm.reset_prefix_cache()
        second = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert first.outputs[0].token_ids == second.outputs[0].token_ids
        print("CACHED", second.num_cached_tokens)
        """
    )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "CACHED 128" in out.stdout
