"""Serving while the L3 store stalls: vLLM alone, HiCache with its circuit
breaker tripped, and HiCache with the breaker off.

Each configuration is a fresh offline engine (in-process, CPU, one OpenMP
thread) with the demo's model. HiCache's L3 is the ``file`` backend made to
stall (benchmarks/throttled_l3.py, ``StallingFileBackend``: every call
sleeps ``--stall-s`` while a flag file exists). The engine is warmed while
the store is healthy; then the store stalls, HiCache waits until its breaker
trips (for the breaker-off engine: the same time), and ``--rounds`` rounds
of ``--batch`` new prompts (nothing to reuse) are served under the
``timeout`` prefetch policy, so a request may wait for its L3 lookup.
Reported per configuration: median time to first token and throughput over
all rounds, and their ratio to vLLM alone. Every answer must equal vLLM's.

    .venv/bin/python benchmarks/bench_l3_breaker.py [--quick]

Exit status 1 if an answer differs from vLLM alone's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_load_decision import BLOCK, close, generate, make_llm, scheduler_half, words  # noqa: E402

CONFIGS = ("vllm", "breaker", "no-breaker")


def extra(config: str, l3_dir: str, flag: str, stall_s: float) -> dict | None:
    if config == "vllm":
        return None
    keys = ({"l3_breaker_window_s": 2.0, "l3_breaker_latency_budget_ms": 500,
             "l3_breaker_probe_interval_s": 0.5} if config == "breaker"
            else {"l3_breaker": False})
    return {
        "hicache_io_backend": "direct", "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "dynamic", "hicache_storage_prefetch_policy": "timeout",
        "hicache_storage_backend_extra_config": {
            "module_path": "throttled_l3", "class_name": "StallingFileBackend",
            "path": l3_dir, "stall_flag": flag, "stall_s": stall_s, "prefetch_threshold": BLOCK,
        },
        **keys,
    }


def run(config: str, args, prompts: list[list[list[int]]]) -> tuple[list, list[float], float]:
    """(answers, TTFTs, seconds serving) over every round."""
    with tempfile.TemporaryDirectory() as tmp:
        flag = os.path.join(tmp, "stall")
        llm = make_llm(args.model, extra(config, os.path.join(tmp, "l3"), flag, args.stall_s),
                       max_num_seqs=args.batch)
        try:
            generate(llm, [words(random.Random(99), 256)], 4)  # warm-up, store healthy
            Path(flag).touch()
            if config == "breaker":
                health = scheduler_half(llm).l3.health
                deadline = time.monotonic() + 60
                while health.usable and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not health.usable, "the breaker did not trip within 60 s"
            elif config == "no-breaker":
                time.sleep(3.0)  # as long as the breaker takes to trip
            answers, ttfts, seconds = [], [], 0.0
            for batch in prompts:
                out, ttft, wall = generate(llm, batch, args.answer)
                answers += out
                ttfts += ttft
                seconds += wall
            return answers, ttfts, seconds
        finally:
            close(llm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(HERE.parent / ".cache" / "demo-llama"))
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--stall-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--answer", type=int, default=16)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2
    if not Path(args.model, "config.json").exists():
        sys.path.insert(0, str(HERE.parent / "examples"))
        from tiny_model import DEMO_SIZE, build_tiny_llama

        build_tiny_llama(args.model, **DEMO_SIZE)
    rng = random.Random(0)
    prompts = [[words(rng, args.prompt) for _ in range(args.batch)] for _ in range(args.rounds)]
    results = {config: run(config, args, prompts) for config in CONFIGS}
    base_answers, base_ttfts, base_s = results["vllm"]
    tokens = args.rounds * args.batch * args.answer
    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs, model "
          f"{args.model}; L3 stalls {args.stall_s:g} s per call; {args.rounds} rounds x "
          f"{args.batch} prompts of {args.prompt} tokens, {args.answer} output tokens\n")
    print("| configuration | median TTFT (s) | vs vLLM | output tok/s | vs vLLM | answers |")
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    for config, (answers, ttfts, seconds) in results.items():
        same = answers == base_answers
        ok &= same
        ttft = statistics.median(ttfts)
        print(f"| {config} | {ttft:.3f} | {ttft / statistics.median(base_ttfts):.2f} | "
              f"{tokens / seconds:.1f} | {base_s / seconds:.2f} | "
              f"{'same' if same else 'DIFFERENT'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
