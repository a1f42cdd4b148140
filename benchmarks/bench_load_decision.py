"""Never slower than recomputing, and storing without a tax: a real engine
with a throttled L3.

Two parts, each on vLLM's offline engine (in-process, CPU, one OpenMP thread)
with the demo's model, an L3 that is the ``file`` backend throttled to a low
bandwidth (benchmarks/throttled_l3.py: a shared link of N MB/s per direction):

1. **Load decisions** (``hicache_load_decision``). Conversations whose
   history is in L3 only (vLLM's cache and L2 are reset before each
   request), each asked a new question; the prefetch policy is
   ``wait_complete``, so a request waits for its L3 hit. L3 reads are
   throttled (``--read-mb-s``) below the speed at which the model
   recomputes the history. Compared: vLLM alone (recomputes), ``recompute``
   (the HiCache engine with HiCache off for the request), ``always`` (waits
   for the slow read) and ``auto`` (declines the hit once L3 is measured:
   the first ``--warmup`` requests are its cold start and are reported
   apart). The last three run in the same engine, the mode switched between
   requests, each history asked under all three, so they see the machine at
   the same moment (it may be shared: other processes make engines that run
   at different moments differ by more than the effect); vLLM alone runs in
   its own engine just before; ``--alternate`` rounds. Reported: TTFT per configuration and
   its ratio to vLLM alone; every answer must equal vLLM's.
2. **Store tax** (backup backpressure). Unique prompts (nothing to reuse),
   every computed block stored to L2 and backed up to an L3 whose writes are
   throttled (``--write-mb-s``) far below the rate blocks are computed, so
   backups fall behind for the whole run. Low load: one request at a time
   (TTFT); high load: ``--batch`` requests at once (throughput). Compared
   with vLLM alone; HiCache's deferred/dropped backup counters are shown.
   Each engine runs ``--repeat`` rounds (low, then high); the two engines
   alternate ``--alternate`` times (fresh engines, fresh L3); medians over
   all rounds are reported (other processes on the machine add noise both
   ways).

    .venv/bin/python benchmarks/bench_load_decision.py [--quick]

Exit status 1 if an answer differs from vLLM alone's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

BLOCK = 32
MAX_MODEL_LEN = 2048
L1_BLOCKS = 160          # 5,120 tokens
L2_RATIO = 2.0


def make_llm(model: str, extra: dict | None, max_num_seqs: int = 8):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None if extra is None else KVTransferConfig(
        kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
        kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    return LLM(model=model, dtype="float32", block_size=BLOCK, enable_prefix_caching=True,
               num_gpu_blocks_override=L1_BLOCKS, kv_cache_memory_bytes=256 << 20,
               max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=MAX_MODEL_LEN, enforce_eager=True, seed=0,
               distributed_executor_backend="uni", disable_log_stats=False,
               skip_tokenizer_init=True, kv_transfer_config=ktc)


def close(llm) -> None:
    import gc

    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        ensure_kv_transfer_shutdown()
        del llm
        gc.collect()


def scheduler_half(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def hicache_extra(l3_dir: str, decision: str = "auto", read_mb_s: float = 0.0,
                  write_mb_s: float = 0.0) -> dict:
    return {
        "hicache_ratio": L2_RATIO, "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct", "hicache_load_decision": decision,
        "hicache_storage_backend": "dynamic",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {
            "module_path": "throttled_l3", "class_name": "ThrottledFileBackend",
            "path": l3_dir, "read_mb_s": read_mb_s, "write_mb_s": write_mb_s,
            "prefetch_threshold": BLOCK,
        },
    }


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 480) for _ in range(n)]


# Per-request kv_transfer_params that turn HiCache off for one request: no
# load, no store (docs/serving.md, "Per-request options").
HICACHE_OFF = {"hicache_tiers": [], "max_offload_tokens": 0}


def generate(llm, prompts: list[list[int]], max_tokens: int, params: dict | None = None):
    """(answers, TTFTs in seconds, wall seconds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        detokenize=False,
                        extra_args={"kv_transfer_params": params} if params else None)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - start
    return ([tuple(o.outputs[0].token_ids) for o in outs],
            [o.metrics.first_token_latency for o in outs], wall)


def wait_backups(llm, timeout_s: float = 120.0) -> None:
    """Step the idle engine while HiCache has work (deferred backups, acks),
    as ``vllm serve``'s engine loop does (the offline LLM steps only inside
    ``generate``), then let the L3 threads finish."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step()
    io = get_kv_transfer_group().worker._io
    if io is not None:
        io.wait_idle(max(0.0, deadline - time.monotonic()))


def reset_all(llm, connector: bool) -> None:
    if connector:
        assert llm.reset_prefix_cache(reset_connector=True)
    else:
        assert llm.reset_prefix_cache()


# --- part 1 ----------------------------------------------------------------------


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def part_load_decision(args) -> tuple[list[str], bool]:
    """Per round: a vLLM-alone engine, then one HiCache engine in which each
    measured history is asked three times: recomputed (HiCache off for the
    request), under ``always`` and under ``auto`` (the mode is switched
    between requests; the order rotates), so the three see the same machine
    at the same moment."""
    rng = random.Random(1)
    w, n = args.warmup, args.warmup + args.requests
    rounds = [[words(rng, args.history) for _ in range(n)] for _ in range(args.alternate)]
    question = [words(rng, 48) for _ in range(n)]
    modes = ("vLLM alone", "recompute", "always", "auto")
    ttft: dict[str, list[float]] = {m: [] for m in modes}
    answers: dict[str, dict] = {m: {} for m in modes}
    tokens: dict[str, dict] = {m: {} for m in ("always", "auto")}
    tokens["recompute"] = {}
    cold: list[float] = []
    page_bytes = rates = None
    for r, histories in enumerate(rounds):
        prompts = [h + q for h, q in zip(histories, question)]
        llm = make_llm(args.model, None, max_num_seqs=1)
        try:
            for i in range(w, n):
                reset_all(llm, False)
                a, t, _ = generate(llm, [prompts[i]], max_tokens=args.answer)
                ttft["vLLM alone"] += t
                answers["vLLM alone"][r, i] = a
        finally:
            close(llm)
        l3_dir = tempfile.mkdtemp(prefix="hicache-bench-l3-")
        llm = make_llm(args.model, hicache_extra(l3_dir, "auto", read_mb_s=args.read_mb_s),
                       max_num_seqs=1)
        try:
            generate(llm, histories, max_tokens=1)   # into L2, backed up to L3
            wait_backups(llm)
            gate = scheduler_half(llm).load_gate
            for i in range(w):                        # auto's cold start
                reset_all(llm, True)                  # the history is in L3 only
                cold += generate(llm, [prompts[i]], max_tokens=args.answer)[1]
            for i in range(w, n):
                order = ("recompute", "always", "auto")
                for mode in order[i % 3:] + order[: i % 3]:
                    gate.decider.mode = "auto" if mode == "recompute" else mode
                    before = dict(gate.decisions)
                    reset_all(llm, True)
                    a, t, _ = generate(llm, [prompts[i]], max_tokens=args.answer,
                                       params=HICACHE_OFF if mode == "recompute" else None)
                    ttft[mode] += t
                    answers[mode][r, i] = a
                    for k, v in gate.decisions.items():
                        tokens[mode][k] = tokens[mode].get(k, 0) + v - before.get(k, 0)
            gate.decider.mode = "auto"
            page_bytes = gate.decider.page_bytes
            rates = gate.decider.estimates()
        finally:
            close(llm)
            shutil.rmtree(l3_dir, ignore_errors=True)

    identical = all(answers[m] == answers["vLLM alone"] for m in modes)
    base = ttft["vLLM alone"]
    lines = [
        "Part 1: load decisions (L3 hit vs recompute)",
        f"  {args.alternate} round(s), each a vLLM-alone engine then a HiCache engine; per round "
        f"{args.requests} histories of {args.history} tokens in L3 only (L1 and L2 reset before "
        f"each request) + 48 new tokens, {args.answer} answer tokens, one request at a time; "
        f"HiCache asks each three times: recomputed (HiCache off for the request: "
        f"{HICACHE_OFF}), under always and under auto (rotating order); prefetch policy "
        f"wait_complete; L3 reads throttled to {args.read_mb_s:g} MB/s; pages of {page_bytes} B "
        f"({BLOCK} tokens)",
        f"  auto's cold start ({w} requests per round, before its first L3 estimate): mean TTFT "
        f"{statistics.mean(cold) * 1e3:.0f} ms (they wait for L3)",
    ]
    if rates:
        lines.append(f"  auto's estimates at the end: L3 {rates.get('L3', 0) / 1e6:.1f} MB/s, "
                     f"L2 {rates.get('L2', 0) / 1e9:.2f} GB/s, prefill of 1024 tokens "
                     f"{rates.get('prefill', 0):,.0f} tokens/s")
    lines += ["",
              "  | configuration | requests | TTFT median | TTFT p90 | TTFT max | "
              "median / vLLM alone's | L3 tokens loaded / declined |",
              "  | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base_med = statistics.median(base)
    for mode in modes:
        t = ttft[mode]
        d = tokens.get(mode)
        split = (f"{d.get(('L3', 'loaded'), 0):,} / {d.get(('L3', 'declined'), 0):,}"
                 if mode in ("always", "auto") else "-")
        lines.append(f"  | {mode} | {len(t)} | {statistics.median(t) * 1e3:.0f} ms | "
                     f"{_quantile(t, 0.9) * 1e3:.0f} ms | {max(t) * 1e3:.0f} ms | "
                     f"{statistics.median(t) / base_med:.2f} | {split} |")
    for other in ("recompute", "always"):
        paired = [b / a for a, b in zip(ttft[other], ttft["auto"])]
        lines.append(f"  auto / {other}, same history, same engine: median "
                     f"{statistics.median(paired):.2f}, max {max(paired):.2f}")
    lines.append(f"  answers identical to vLLM alone: {'yes' if identical else 'NO'}")
    return lines, identical


# --- part 2 ----------------------------------------------------------------------

# The connector methods vLLM calls on the engine's thread (both halves).
ENGINE_THREAD_METHODS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "on_new_request", "has_pending_push_work",
    "get_kv_connector_stats", "take_events", "get_external_cache_hit_sources",
    "handle_preemptions", "bind_connector_metadata", "clear_connector_metadata",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_block_ids_with_load_errors", "build_connector_worker_meta",
)


class ConnectorClock:
    """Seconds spent inside the connector's methods on the engine's thread:
    what HiCache adds to serving there, free of the machine's noise."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, conn) -> None:
        for name in ENGINE_THREAD_METHODS:
            orig = getattr(conn, name, None)
            if orig is None:
                continue

            def timed(*a, _orig=orig, **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(conn, name, timed)


def clock_connector(llm) -> ConnectorClock:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    clock = ConnectorClock()
    clock.wrap(llm.llm_engine.engine_core.engine_core.scheduler.connector)
    clock.wrap(get_kv_transfer_group())
    return clock


def part_store_tax(args) -> tuple[list[str], bool]:
    rng = random.Random(2)
    rounds = args.repeat
    low = [[words(rng, args.prompt) for _ in range(args.low)] for _ in range(rounds)]
    high = [[words(rng, args.prompt) for _ in range(args.batch)] for _ in range(rounds)]
    configs = ("vLLM alone", "HiCache, slow L3")
    measured = {name: {"low": [], "high": []} for name in configs}
    # CPU seconds of the whole process (every thread: the forward's, the L3
    # threads') per phase: what other processes on the machine cannot inflate.
    cpu = {name: {"low": [], "high": []} for name in configs}
    answers: dict[str, list] = {}
    counters: dict[str, dict] = {}
    engine_s = [0.0, 0.0]  # connector seconds on the engine thread, wall seconds
    for name in configs * args.alternate:
        connector = name != "vLLM alone"
        l3_dir = tempfile.mkdtemp(prefix="hicache-bench-l3-")
        extra = hicache_extra(l3_dir, write_mb_s=args.write_mb_s) if connector else None
        llm = make_llm(args.model, extra, max_num_seqs=args.batch)
        low_ttft, high_tput, got = [], [], []
        try:
            # Warm-up (the process's first engine also pays one-off start-up costs).
            generate(llm, [words(random.Random(9 + i), args.prompt) for i in range(4)],
                     max_tokens=2)
            clock = clock_connector(llm) if connector else None
            started = time.perf_counter()
            for r in range(rounds):
                ttfts = []
                cpu0 = time.process_time()
                for p in low[r]:
                    a, t, _ = generate(llm, [p], max_tokens=args.answer)
                    ttfts += t
                    got += a
                cpu1 = time.process_time()
                low_ttft.append(statistics.median(ttfts))
                a, _, wall = generate(llm, high[r], max_tokens=args.answer)
                cpu[name]["low"].append(cpu1 - cpu0)
                cpu[name]["high"].append(time.process_time() - cpu1)
                got += a
                high_tput.append(len(high[r]) * (args.prompt + args.answer) / wall)
            if connector:
                engine_s[0] += clock.seconds
                engine_s[1] += time.perf_counter() - started
                half = scheduler_half(llm)
                l3 = half.l3
                counters[name] = {
                    "stored": half.stats.stored_blocks,
                    "deferred": l3.backups.backup_deferred, "flushed": l3.backups.backup_flushed,
                    "dropped": l3.backups.backup_dropped, "evicted": l3.backups.backup_evicted,
                    "backlog": l3.backups.backlog.num_blocks, "bound": l3.backups.max_backup_pages,
                    "L2 skipped (pinned)": half.stats.store_skipped_blocks,
                }
        finally:
            close(llm)
            shutil.rmtree(l3_dir, ignore_errors=True)
        measured[name]["low"] += low_ttft
        measured[name]["high"] += high_tput
        answers[name] = got
    identical = answers[configs[0]] == answers[configs[1]]
    base, hc = measured[configs[0]], measured[configs[1]]
    low_ratio = statistics.median(base["low"]) / statistics.median(hc["low"])
    high_ratio = statistics.median(hc["high"]) / statistics.median(base["high"])
    c = counters[configs[1]]
    lines = [
        "Part 2: store tax (backups to a slow L3)",
        f"  unique {args.prompt}-token prompts, {args.answer} answer tokens; L3 writes throttled "
        f"to {args.write_mb_s:g} MB/s; {rounds} rounds x {args.alternate} engines each, "
        f"alternating, medians",
        "",
        "  | load | vLLM alone | HiCache, slow L3 | ratio (>= 0.98: no tax) | process CPU s, "
        "vLLM alone / HiCache | CPU ratio |",
        "  | --- | ---: | ---: | ---: | ---: | ---: |",
        f"  | low: {args.low} requests one at a time, TTFT median | "
        f"{statistics.median(base['low']) * 1e3:.1f} ms | "
        f"{statistics.median(hc['low']) * 1e3:.1f} ms | {low_ratio:.3f} | "
        f"{_cpu(cpu, configs, 'low')} |",
        f"  | high: {args.batch} requests at once, tokens/s | "
        f"{statistics.median(base['high']):,.0f} | {statistics.median(hc['high']):,.0f} | "
        f"{high_ratio:.3f} | {_cpu(cpu, configs, 'high')} |",
        "",
        f"  HiCache: {c['stored']} blocks stored to L2; backups bound {c['bound']} pages in "
        f"flight; deferred {c['deferred']}, flushed later {c['flushed']}, dropped (backlog "
        f"full) {c['dropped']}, left L2 before their turn {c['evicted']}, still queued "
        f"{c['backlog']}; L2 stores skipped (all pages pinned) {c['L2 skipped (pinned)']}",
        f"  HiCache's own time on the engine's thread (both connector halves, every call): "
        f"{engine_s[0] * 1e3:,.0f} ms of {engine_s[1]:,.1f} s measured "
        f"({engine_s[0] / engine_s[1]:.2%})",
        f"  answers identical to vLLM alone: {'yes' if identical else 'NO'}",
    ]
    return lines, identical


def _cpu(cpu: dict, configs: tuple[str, str], phase: str) -> str:
    base, hc = (statistics.median(cpu[c][phase]) for c in configs)
    return f"{base:.2f} / {hc:.2f} | {base / hc:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(HERE.parent / ".cache" / "demo-llama"))
    parser.add_argument("--part", choices=("all", "load", "store"), default="all")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--read-mb-s", type=float, default=4.0)
    parser.add_argument("--write-mb-s", type=float, default=2.0)
    parser.add_argument("--history", type=int, default=1536)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--low", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--alternate", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.low, args.batch, args.repeat, args.alternate = 4, 3, 6, 1, 1
    if not Path(args.model, "config.json").exists():
        from tiny_model import DEMO_SIZE, build_tiny_llama

        build_tiny_llama(args.model, **DEMO_SIZE)
    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs, "
          f"model {args.model}")
    ok = True
    for part, fn in (("load", part_load_decision), ("store", part_store_tax)):
        if args.part in ("all", part):
            lines, identical = fn(args)
            ok &= identical
            print("\n".join(lines), flush=True)
            print()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
