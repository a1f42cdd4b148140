"""Multi-turn chat on vLLM's offline LLM class, with and without HiCache.

Several users share a system prompt and talk in turns, one request at a time.
vLLM's KV cache (L1) holds about one conversation, so a user's history is
evicted before their next turn. Without HiCache it is computed again; with
HiCache it comes back from host memory (L2) or, once L2 is full too, from
files (L3). Per turn the demo prints where the cached prompt tokens came from
and the time to first token with and without HiCache, both on the same L1 and
CPU thread, then checks that every answer is identical.

    make demo             # or: python examples/offline_multiturn.py [--users N --turns N]
    VERBOSE=1 make demo   # vLLM's own output on screen too

Quiet by default: vLLM's output goes to .cache/demo.log (its end is shown if
the demo fails).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from statistics import median

# Before torch loads. In-process engine: its logs and the connector's
# counters are in this process. One OpenMP thread: with more, vLLM's CPU
# kernels spin-wait on a core another process holds, and a prefill can take
# ten times longer from one run to the next.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_report import Terminal, TurnRow, open_terminal, plot, print_table, summary  # noqa: E402
from tiny_model import DEMO_DIR, DEMO_SIZE, build_tiny_llama  # noqa: E402

CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache"
BLOCK_SIZE = 32
L1_BLOCKS = 40           # 1,280 tokens: one conversation, not all of them
L2_RATIO = 3.0           # 120 pages: outgrown by turn 5, when L3 serves the rest
SYSTEM_TOKENS = 192      # shared by every user: stays hot in L1
FIRST_TOKENS = 320       # each user's opening message (a pasted document) ...
FOLLOW_UP_TOKENS = (32, 96)  # ... then shorter follow-ups, as chats go
ANSWER_TOKENS = 12
MAX_MODEL_LEN = (L1_BLOCKS - 1) * BLOCK_SIZE  # vLLM keeps one block back


def hicache_extra(l3_dir: Path) -> dict:
    return {
        "hicache_ratio": L2_RATIO,
        "hicache_io_backend": "direct",  # no CUDA: torch copies
        "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "file",
        # A request waits for its L3 pages (local files: milliseconds), so the
        # hits do not depend on how fast the prefetch thread was scheduled.
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {
            "path": str(l3_dir), "prefetch_threshold": BLOCK_SIZE,
        },
    }


def make_llm(model: str, extra: dict | None):
    """The same engine with or without the connector: same L1, same threads."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None if extra is None else KVTransferConfig(
        kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
        kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute",
    )
    return LLM(
        model=model, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=True,
        num_gpu_blocks_override=L1_BLOCKS, kv_cache_memory_bytes=64 << 20,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=1,
        max_num_batched_tokens=MAX_MODEL_LEN,  # a prompt is one prefill step
        enforce_eager=True, seed=0, distributed_executor_backend="uni",
        disable_log_stats=False,  # fills RequestOutput.metrics (TTFT)
        kv_transfer_config=ktc,
    )


# --- the conversation ------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    system: tuple[int, ...]
    messages: tuple[tuple[tuple[int, ...], ...], ...]  # [turn][user]: new tokens


def make_workload(users: int, turns: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)

    def words(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 480) for _ in range(n))

    system = words(SYSTEM_TOKENS)
    first = tuple(words(FIRST_TOKENS) for _ in range(users))
    follow_ups = tuple(tuple(words(rng.randrange(*FOLLOW_UP_TOKENS)) for _ in range(users))
                       for _ in range(turns - 1))
    return Workload(system, (first, *follow_ups))


@dataclass(frozen=True)
class Reply:
    prompt_tokens: int
    cached_tokens: int  # L1 + L2 + L3 (RequestOutput.num_cached_tokens)
    l2_tokens: int
    l3_tokens: int
    ttft_s: float
    answer: tuple[int, ...]


def converse(llm, work: Workload) -> list[list[Reply]]:
    """Every user, turn by turn; a history grows by message and answer."""
    histories = [list(work.system) for _ in work.messages[0]]
    replies = []
    for turn_messages in work.messages:
        row = []
        for history, message in zip(histories, turn_messages):
            history += message
            row.append(ask(llm, history))
            history += row[-1].answer
        replies.append(row)
    return replies


def ask(llm, prompt: list[int]) -> Reply:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True,
                        detokenize=False)
    loaded0, fetched0 = _tier_tokens(llm)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    loaded1, fetched1 = _tier_tokens(llm)
    # Pages prefetched from L3 land in L2 and are loaded from there: the L2
    # load count includes them.
    l3 = min(fetched1 - fetched0, loaded1 - loaded0)
    return Reply(len(prompt), out.num_cached_tokens, loaded1 - loaded0 - l3, l3,
                 out.metrics.first_token_latency, tuple(out.outputs[0].token_ids))


def _tier_tokens(llm) -> tuple[int, int]:
    """Tokens loaded L2 -> L1 and prefetched L3 -> L2 since the engine started."""
    sched = _scheduler_half(llm)
    if sched is None:
        return 0, 0
    fetched = sched.l3.prefetched_blocks if sched.l3 is not None else 0
    return sched.stats.loaded_blocks * BLOCK_SIZE, fetched * BLOCK_SIZE


def _scheduler_half(llm):
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return None if connector is None else connector.scheduler


# --- the two runs ----------------------------------------------------------

def run(model: str, work: Workload, extra: dict | None) -> list[list[Reply]]:
    llm = make_llm(model, extra)
    try:
        warm_up(llm)
        return converse(llm, work)
    finally:
        _shutdown(llm)


def warm_up(llm) -> None:
    """First calls pay one-off costs (allocator, kernels); then start cold:
    the timed run must find nothing of the warm-up in L1 or L2."""
    rng = random.Random(1)
    for n in (900, 100, 900):
        ask(llm, [rng.randrange(3, 480) for _ in range(n)])
    assert llm.reset_prefix_cache(reset_connector=True), "reset_prefix_cache refused"


def _shutdown(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        ensure_kv_transfer_shutdown()


def turn_rows(hicache: list[list[Reply]], without: list[list[Reply]]) -> list[TurnRow]:
    rows = []
    for turn, (h, w) in enumerate(zip(hicache, without), start=1):
        l2, l3 = sum(r.l2_tokens for r in h), sum(r.l3_tokens for r in h)
        rows.append(TurnRow(
            turn, sum(r.prompt_tokens for r in h), sum(r.cached_tokens for r in h) - l2 - l3,
            l2, l3, median(r.ttft_s for r in h), median(r.ttft_s for r in w),
        ))
    return rows


# --- main ------------------------------------------------------------------

def demo(model: str, users: int, turns: int, term: Terminal) -> bool:
    work = make_workload(users, turns)
    l3_dir = CACHE_DIR / "demo-l3"
    shutil.rmtree(l3_dir, ignore_errors=True)  # every run starts with an empty L3
    print_setup(term, model, work, l3_dir)
    # vLLM's first import is slow; outside the runs, so their times compare.
    _timed(term.out, "loading vLLM", lambda: importlib.import_module("vllm.entrypoints.llm"))
    without = _timed(term.out, "without HiCache", lambda: run(model, work, None))
    hicache = _timed(term.out, "with HiCache", lambda: run(model, work, hicache_extra(l3_dir)))
    rows = turn_rows(hicache, without)
    print(file=term.out)
    print_table(term.out, rows, users)
    line = summary(rows, [r.ttft_s for r in _flat(hicache)], [r.ttft_s for r in _flat(without)],
                   sum(r.cached_tokens for r in _flat(without)))
    print("\n" + line, file=term.out)
    png = CACHE_DIR / "demo-ttft.png"
    if plot(rows, png):
        print(f"TTFT per turn plotted in {_rel(png)}", file=term.out)
    return verdict(hicache, without, term.out)


def print_setup(term: Terminal, model: str, work: Workload, l3_dir: Path) -> None:
    l2_pages = int(L1_BLOCKS * L2_RATIO)
    lines = [
        f"HiCache demo: {len(work.messages[0])} users x {len(work.messages)} turns, one request "
        f"at a time, sharing a {len(work.system)}-token system prompt",
        f"  model  {_describe(model)}; CPU, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
        f"  L1     vLLM's KV cache: {L1_BLOCKS} blocks = {L1_BLOCKS * BLOCK_SIZE:,} tokens, "
        "about one user's history",
        f"  L2     host memory: {l2_pages} pages = {l2_pages * BLOCK_SIZE:,} tokens;  "
        f"L3  files in {_rel(l3_dir)}",
        f"  vLLM's own output: {_rel(term.log_path) if term.log_path else 'on screen'}\n",
    ]
    print("\n".join(lines), file=term.out)


def _timed(out, label: str, fn):
    print(f"  {label + ' ':.<20} ", end="", file=out, flush=True)
    start = time.perf_counter()
    result = fn()
    print(f"{time.perf_counter() - start:5.1f} s", file=out)
    return result


def verdict(hicache: list[list[Reply]], without: list[list[Reply]], out) -> bool:
    """The demo passes when HiCache served tokens and changed no answer."""
    answers = [[r.answer for r in t] for t in hicache]
    expected = [[r.answer for r in t] for t in without]
    n = len(_flat(hicache))
    same = answers == expected
    if same:
        print(f"answers identical: yes, all {n} answers equal the run without HiCache, "
              "token for token", file=out)
    else:
        wrong = sum(a != e for ta, te in zip(answers, expected) for a, e in zip(ta, te))
        print(f"answers identical: NO, {wrong} of {n} answers differ", file=out)
    served = sum(r.l2_tokens + r.l3_tokens for r in _flat(hicache))
    if served == 0:
        print("HiCache served no tokens from L2 or L3: L1 held every history (more users?)",
              file=out)
    return same and served > 0


def _flat(replies: list[list[Reply]]) -> list[Reply]:
    return [r for turn in replies for r in turn]


def _describe(model: str) -> str:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return (f"{_rel(Path(model))} (random weights, {cfg['num_hidden_layers']} layers, "
            f"hidden {cfg['hidden_size']})")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_DIR))
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    args = ap.parse_args()
    verbose = os.environ.get("VERBOSE", "") not in ("", "0")
    term = open_terminal(CACHE_DIR / "demo.log", verbose)
    try:
        model = str(build_tiny_llama(args.model, **DEMO_SIZE))
        return 0 if demo(model, args.users, args.turns, term) else 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=term.err)
        return 130
    except Exception as exc:  # noqa: BLE001 - any failure: say so, show the log's end
        traceback.print_exc()  # into the log
        term.fail(f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
