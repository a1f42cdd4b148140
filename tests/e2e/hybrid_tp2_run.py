"""The engine runs of test_hybrid_tp2.py, in a process of their own.

    python -m tests.e2e.hybrid_tp2_run MODEL_DIR L3_DIR

Two TP=2 engines (vLLM's ``mp`` executor: a worker process per rank, gloo),
one after the other: the reference without a connector, then the HiCache
engine (L2, and L3 in files under L3_DIR). The engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the scheduler half of the
connector is reachable; the worker halves are reached through
``collective_rpc``. Prints one line ``RESULTS <json>``; the test asserts.

A process of its own, as for the other TP=2 engine tests: vLLM's CPU
platform starts the ``mp`` executor's workers with ``spawn``, which re-imports
the main module (hence the ``__main__`` guard), and the pytest process keeps
vLLM globals of the in-process engines of other modules.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from tests.e2e.engine_utils import close, generate, make_llm, scheduler_half
from tests.e2e.hybrid_checks import converse, hicache_engine, randomize_group
from tests.e2e.l3_objects import objects, reflag, shard_of, state_flag

# 64 blocks of 32 tokens per group tensor, per rank (a rank's page is 32 KiB
# per layer, as for the TP=1 model of test_hybrid_qwen3next.py).
KV_BYTES = 2 << 20
# Whole prompts per step: prefill chunks span several blocks.
ENGINE_KW = dict(dtype="bfloat16", kv_bytes=KV_BYTES, max_num_batched_tokens=512,
                 tensor_parallel_size=2, distributed_executor_backend="mp")
# Conversation seeds. "evicted": L1 evicted by a filler between the turns (an
# L2 hit); "from_l3": L1 and L2 dropped (an L3 hit); "corrupted_r<N>": L1
# dropped and rank N's host pages given random states (negative controls).
# Only the first runs a filler: it takes longer than the rest of a
# conversation.
SEEDS = {"evicted": 5, "from_l3": 7, "corrupted_r0": 8, "corrupted_r1": 9}


def randomize_states(worker, rank: int) -> bool:
    """In each TP worker (collective_rpc): on TP rank ``rank`` only, random
    bytes in the GDN state layers of every host page; whether it did."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if get_tensor_model_parallel_rank() != rank:
        return False
    randomize_group(get_kv_transfer_group().worker, "mamba")
    return True


def rank_geometry(worker) -> dict:
    """In a TP worker (collective_rpc): what this rank's worker half holds."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    half = get_kv_transfer_group().worker
    return {"groups": [g.kind for g in half.geom.groups],
            "kv_heads": half.geom.num_kv_heads, "page_bytes": half.pool.bytes_per_page}


def flush(llm) -> None:
    """Let the backups in flight land in L3 (and their acknowledgements
    reach the scheduler, with one more step)."""
    time.sleep(1.0)
    generate(llm, [[7, 8]])


def reference_runs(model_dir: str) -> dict:
    """vLLM alone, L1 kept: turn 2 reuses turn 1 from vLLM's own cache, so it
    computes the chunks a HiCache engine computes after an L2/L3 hit. Then
    turn 2 once more (a hit up to turn 2's own kept state)."""
    llm = make_llm(model_dir, connector=False, **ENGINE_KW)
    try:
        out = {}
        for name, seed in SEEDS.items():
            talk = converse(llm, seed, evict="none")
            out[name] = dataclasses.asdict(talk)
        (answer,), (cached,) = generate(llm, [out["from_l3"]["prompts"][1]])
        out["resend"] = {"answer": answer, "cached": cached}
        return out
    finally:
        close(llm)


def hicache_runs(model_dir: str, l3_dir: str) -> dict:
    started = time.monotonic()
    llm = hicache_engine(model_dir, l3_dir, **ENGINE_KW)
    try:
        sched = scheduler_half(llm)
        stats, l3 = sched.stats, sched.l3
        out: dict = {"start_seconds": round(time.monotonic() - started, 1),
                     "groups": [g.kind for g in sched.geom.groups],
                     "block_size": sched.geom.block_size,
                     "ranks": llm.collective_rpc(rank_geometry)}

        loaded = stats.loaded_blocks
        out["evicted"] = dataclasses.asdict(converse(llm, SEEDS["evicted"], evict="l1"))
        out["evicted"]["loaded_blocks"] = stats.loaded_blocks - loaded

        before: set[str] = set()

        def drop_l1_and_l2() -> None:
            flush(llm)  # turn 1's backups
            assert llm.reset_prefix_cache(reset_connector=True)
            before.update(objects(l3_dir))  # all but turn 2's objects

        prefetched = l3.prefetched_blocks
        talk = converse(llm, SEEDS["from_l3"], evict="none", between=drop_l1_and_l2)
        out["from_l3"] = dataclasses.asdict(talk)
        out["from_l3"]["prefetched_blocks"] = l3.prefetched_blocks - prefetched
        out["from_l3"]["shards"] = sorted({shard_of(k) for k in objects(l3_dir)})
        out["from_l3"]["resends"] = resends(llm, l3_dir, talk.prompts[1], before)

        for rank in (0, 1):
            name = f"corrupted_r{rank}"

            def drop_l1_and_corrupt(rank=rank) -> None:
                assert llm.reset_prefix_cache()
                assert llm.collective_rpc(randomize_states, args=(rank,)) == [
                    r == rank for r in (0, 1)]

            loaded = stats.loaded_blocks
            out[name] = dataclasses.asdict(converse(
                llm, SEEDS[name], evict="none", between=drop_l1_and_corrupt))
            out[name]["loaded_blocks"] = stats.loaded_blocks - loaded
        assert llm.reset_prefix_cache(reset_connector=True)  # no corrupt hits after this
        out["load_error_blocks"] = stats.load_error_blocks
        sched.check_integrity()
        return out
    finally:
        close(llm)


def resends(llm, l3_dir: str, turn2: list[int], before: set[str]) -> dict:
    """Turn 2 again from L3 (L1 and L2 dropped), as stored; then with rank
    1's object of the page holding turn 2's kept state resealed as "no valid
    state" (rank 0's still says valid)."""
    flush(llm)  # turn 2's backups
    new = sorted(set(objects(l3_dir)) - before)
    found = objects(l3_dir)
    out = {"new_flags": {s: sorted(state_flag(found[k], k) for k in new if shard_of(k) == s)
                         for s in ("r0", "r1")}}
    assert llm.reset_prefix_cache(reset_connector=True)
    (answer,), (cached,) = generate(llm, [turn2])
    out["as_stored"] = {"answer": answer, "cached": cached}
    flagged = [k for k in new if shard_of(k) == "r1" and state_flag(found[k], k)]
    out["flipped"] = reflag(l3_dir, flagged, state_valid=False)
    assert llm.reset_prefix_cache(reset_connector=True)
    (answer,), (cached,) = generate(llm, [turn2])
    out["one_rank_without_state"] = {"answer": answer, "cached": cached}
    return out


def main() -> None:
    model_dir, l3_dir = sys.argv[1], sys.argv[2]
    started = time.monotonic()
    results = {"reference": reference_runs(model_dir)}
    results["reference_seconds"] = round(time.monotonic() - started, 1)
    results["hicache"] = hicache_runs(model_dir, l3_dir)
    results["seconds"] = round(time.monotonic() - started, 1)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
