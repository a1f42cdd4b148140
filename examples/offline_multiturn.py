"""Multi-turn chat on the offline LLM class, with and without HiCache.

Several users talk in turns; vLLM's KV cache (L1) is kept small, so a user's
history is evicted from L1 before their next turn. With HiCache the history
comes back from the host pool (L2) instead of being recomputed. The script
prints, per turn, the tokens vLLM served from cache and how many of them came
from L2, then checks that every answer equals the run without HiCache.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python examples/offline_multiturn.py --model DIR
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import DEFAULT_DIR, build_tiny_llama  # noqa: E402

HICACHE = {
    "kv_connector": "HiCacheConnector",
    "kv_connector_module_path": "vllm_hicache",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"hicache_ratio": 4.0, "hicache_write_policy": "write_through"},
}


def make_llm(model: str, hicache: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=model, dtype="float32", block_size=32, enable_prefix_caching=True,
        max_model_len=768, max_num_seqs=8, max_num_batched_tokens=1024,
        enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 20,  # 32 blocks
        distributed_executor_backend="uni", skip_tokenizer_init=True,
        kv_transfer_config=KVTransferConfig(**HICACHE) if hicache else None,
    )


def chat(llm, users: int, turns: int, hicache: bool) -> list[list[list[int]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    histories = [[rng.randrange(3, 480) for _ in range(40)] for _ in range(users)]
    answers: list[list[list[int]]] = []
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sched = _scheduler_half(llm) if hicache else None
    for turn in range(turns):
        for h in histories:
            h += [rng.randrange(3, 480) for _ in range(rng.randrange(30, 60))]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=h) for h in histories], sp, use_tqdm=False)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        answers.append([list(o.outputs[0].token_ids) for o in outs])
        for h, o in zip(histories, outs):
            h += list(o.outputs[0].token_ids)
        if hicache:
            _report(turn, outs, sched, elapsed_ms)
    return answers


def _scheduler_half(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def _report(turn: int, outs, sched, elapsed_ms: float) -> None:
    cells = []
    for o in outs:
        l2 = sum(v for k, v in sched.recent_hit_tokens.items() if k.startswith(f"{o.request_id}-") or k == o.request_id)
        cells.append(f"{len(o.prompt_token_ids):4d} tok, cached {o.num_cached_tokens:4d} (L2 {l2:4d})")
    print(f"turn {turn}: {elapsed_ms:6.0f} ms | " + " | ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_DIR))
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    args = ap.parse_args()
    model = str(build_tiny_llama(args.model))

    from vllm_hicache.config import HiCacheConfig

    print("HiCache config:", HiCacheConfig.from_extra_config(HICACHE["kv_connector_extra_config"]))
    baseline_llm = make_llm(model, hicache=False)
    baseline = chat(baseline_llm, args.users, args.turns, hicache=False)
    _shutdown(baseline_llm)

    llm = make_llm(model, hicache=True)
    print(f"{args.users} users x {args.turns} turns; per user: prompt tokens, tokens served from cache (of which from L2)")
    with_hicache = chat(llm, args.users, args.turns, hicache=True)
    stats = _scheduler_half(llm).stats
    print(f"L2: {stats.loaded_blocks} blocks loaded for {stats.load_requests} requests, "
          f"{stats.stored_blocks} stored, {stats.evicted_pages} evicted")
    same = with_hicache == baseline
    print("answers identical to the run without HiCache:", same)
    _shutdown(llm)
    return 0 if same and stats.loaded_blocks > 0 else 1


def _shutdown(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()


if __name__ == "__main__":
    sys.exit(main())
