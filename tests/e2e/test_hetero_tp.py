"""Heterogeneous TP (tp_lcm_size=2, the tiny model's 2 KV heads): a TP=1
instance and a TP=2 instance share L3 objects of one prefix.

Three engine runs on one store, in order: TP=1 computes prompt A cold (its
backup writes A's head slices); TP=2, with fresh L1/L2, hits A in L3 and
must answer as TP=1 did, then computes B cold; TP=1 hits B and must answer
as TP=2 did. Negative control in the last run: the store's slice objects
are swapped (slice 0 <-> 1, resealed so they verify); the hit is the same
length but the answer changes, so the loaded KV is used, head slice by head
slice."""

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
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from tests.e2e.l3_objects import await_objects, swap_shards

    PROMPTS = {"A": [3 + (i * 37) % 470 for i in range(150)],
               "B": [5 + (i * 53) % 460 for i in range(150)]}

    def main():
        model, tp, l3, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
        extra = {"hicache_io_backend": "direct", "hicache_storage_backend": "file",
                 "hicache_storage_prefetch_policy": "wait_complete",
                 "hicache_storage_backend_extra_config": {
                     "path": l3, "prefetch_threshold": 32, "tp_lcm_size": 2}}
        ktc = KVTransferConfig(kv_connector="HiCacheConnector",
                               kv_connector_module_path="vllm_hicache", kv_role="kv_both",
                               kv_connector_extra_config=extra)
        llm = LLM(model=model, dtype="float32", block_size=32, tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else "uni",
                  enable_prefix_caching=True, max_model_len=512, max_num_seqs=4,
                  enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 20,
                  skip_tokenizer_init=True, kv_transfer_config=ktc)
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        results = []
        for i, step in enumerate(steps):
            if step == "flush":  # backups acknowledged (each prompt's objects written)
                written = set(steps[:i]) & PROMPTS.keys()
                await_objects(l3, len(written) * 4 * 2)  # 4 full blocks, 2 head slices
                llm.generate([TokensPrompt(prompt_token_ids=[7, 8])], sp, use_tqdm=False)
            elif step == "swap":
                assert llm.reset_prefix_cache(reset_connector=True)
                results.append({"swapped": swap_shards(l3, "s0", "s1")})
            else:
                out = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[step])], sp,
                                   use_tqdm=False)[0]
                results.append({"prompt": step, "tokens": list(out.outputs[0].token_ids),
                                "cached": out.num_cached_tokens})
        print("RESULTS " + json.dumps(results))

    if __name__ == "__main__":
        main()
""")


def run(model_dir, tp: int, l3: Path, *steps: str) -> list[dict]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(REPO),
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(tp), str(l3),
                          *steps], capture_output=True, text=True, env=env, timeout=400,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-5000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.fixture(scope="module")
def store(tiny_model_dir, tmp_path_factory):
    """The store after TP=1 wrote prompt A; A's cold answer."""
    l3 = tmp_path_factory.mktemp("hetero") / "l3"
    [cold_a] = run(tiny_model_dir, 1, l3, "A", "flush")
    assert cold_a["cached"] == 0
    return l3, cold_a


def test_tp1_writes_tp2_reads_and_the_reverse(tiny_model_dir, store):
    l3, cold_a = store
    shards = {shard_of(k) for k in objects(l3)}
    digests = {k.split("-")[1] for k in objects(l3)}
    assert shards == {"s0", "s1"} and len(digests) == 1  # head slices, not TP ranks

    hit_a, cold_b = run(tiny_model_dir, 2, l3, "A", "B", "flush")
    assert hit_a["cached"] == 128  # 4 blocks from L3 (fresh L1 and L2)
    assert hit_a["tokens"] == cold_a["tokens"]
    assert cold_b["cached"] == 0
    # TP=2 wrote B into the same namespace, still as two head slices.
    assert {k.split("-")[1] for k in objects(l3)} == digests
    assert {shard_of(k) for k in objects(l3)} == {"s0", "s1"}

    hit_b, swapped, hit_swapped = run(tiny_model_dir, 1, l3, "B", "swap", "B")
    assert hit_b["cached"] == 128 and hit_b["tokens"] == cold_b["tokens"]
    # Negative control: the same hit with slices 0 and 1 exchanged.
    assert swapped["swapped"] >= 8  # A's and B's 4 blocks each
    assert hit_swapped["cached"] == 128
    assert hit_swapped["tokens"] != cold_b["tokens"]
