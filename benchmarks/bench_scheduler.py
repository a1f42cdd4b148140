"""Scheduler-half cost per step: HiCacheConnector vs vLLM's OffloadingConnector.

Runs one synthetic trace through vLLM's real ``Scheduler`` (in-process, no
model, no worker) twice: once with our ``HiCacheConnector`` and once with
vLLM's ``OffloadingConnector``, both scheduler-only. A fake "worker" answers
every step with a ``ModelRunnerOutput`` whose ``KVConnectorOutput`` marks this
step's transfers complete, as a fast worker would:

* HiCache, ``hicache_load_mode=layerwise`` (default): loads finish inside the
  step, nothing to report. With ``--hicache-load-modes async`` the step's
  ``async_loads`` requests are reported in ``finished_recving``.
* OffloadingConnector: every load/store job of the step is reported in an
  ``OffloadingWorkerMetadata.completed_jobs`` (count 1 = world size), and the
  requests of its load jobs in ``finished_recving``.

Only the time spent inside the connector's scheduler-side methods is measured
(each method on ``scheduler.connector`` is wrapped by a perf_counter
accumulator); ``schedule()`` + ``update_from_output()`` are timed as context.

Trace (defaults): 64 concurrent requests of 4096 prompt tokens, 8 prefix groups
sharing 3072 tokens, unique 1024-token suffixes, 8 decode tokens, block 16,
max_num_batched_tokens 2048. Round 0 is a warm-up (cold: stores only) and is
excluded. Before every later round vLLM's prefix cache is reset
(``reset_prefix_cache()``, connector untouched), so prefixes come back from the
connector's CPU tier. Odd rounds use fresh suffixes (3072 of 4096 tokens can
hit), even rounds repeat the previous round exactly. The script exits 1 if a
connector loads nothing in a timed round. Each configuration runs ``--repeat``
times (interleaved); the run with the median connector total is reported.

    .venv/bin/python benchmarks/bench_scheduler.py --model .cache/tiny-llama
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import os
import platform
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

# vLLM may try to reach the hub for a tokenizer or config otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_hicache.connector.metadata import HiCacheMetadata  # noqa: E402

# KV geometry of the fake cache: only sizes matter (no tensor is allocated).
HEADS, HEAD_SIZE, LAYERS = 2, 32, 2

# Scheduler-side methods a connector may expose; whichever exist are timed.
TIMED_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_kv_connector_stats",
    "take_events",
)


# --- trace --------------------------------------------------------------------


@dataclass
class Trace:
    rounds: list[list[tuple[str, list[int]]]]
    num_requests: int
    prompt_len: int
    prefix_len: int
    num_groups: int
    decode_tokens: int


def build_trace(args) -> Trace:
    rng = random.Random(args.seed)
    vocab = range(10, 500)  # the tiny model's word ids

    def tokens(n: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.groups)]
    suffix_len = args.prompt_len - args.prefix_len
    rounds: list[list[tuple[str, list[int]]]] = []
    prompts: list[list[int]] = []
    for r in range(args.rounds + 1):
        if r == 0 or r % 2 == 1:  # fresh suffixes
            prompts = [prefixes[i % args.groups] + tokens(suffix_len) for i in range(args.requests)]
        # else: repeat the previous round's prompts exactly
        order = list(range(args.requests))
        rng.shuffle(order)  # group members interleave in the queue
        rounds.append([(f"r{r}-{i}", prompts[i]) for i in order])
    return Trace(rounds, args.requests, args.prompt_len, args.prefix_len, args.groups,
                 args.decode_tokens)


# --- scheduler ------------------------------------------------------------------


def kv_bytes_per_block(block_size: int) -> int:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    return spec.page_size_bytes * LAYERS


def build_scheduler(args, connector: str, extra: dict, module_path: str | None) -> Scheduler:
    max_len = args.prompt_len + args.decode_tokens + args.block_size
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(args.model), dtype="float32", max_model_len=max_len,
            # The tiny model declares 2048 positions; no weights are read here.
            hf_overrides={"max_position_embeddings": max_len},
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.requests, max_num_batched_tokens=args.max_batched_tokens,
            max_model_len=max_len, enable_chunked_prefill=True, is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=args.block_size, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_connector_module_path=module_path,
            kv_role="kv_both", kv_connector_extra_config=extra,
        ),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=args.gpu_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    vllm_config.cache_config.num_gpu_blocks = args.gpu_blocks
    for name in names:
        vllm_config.compilation_config.static_forward_context[name] = SimpleNamespace(
            attn_backend=SimpleNamespace(get_name=lambda: "CPU_ATTN"))
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=args.block_size, log_stats=True)


# --- timing ---------------------------------------------------------------------


@dataclass
class Timers:
    per_method: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    current: float = 0.0  # connector seconds since the last step boundary
    enabled: bool = True
    profiler: cProfile.Profile | None = None


def wrap_connector(conn, timers: Timers) -> list[str]:
    wrapped = []
    perf = time.perf_counter
    for name in TIMED_METHODS:
        orig = getattr(conn, name, None)
        if orig is None:
            continue

        def timed(*a, _orig=orig, _name=name, **kw):
            prof = timers.profiler
            if prof is not None:
                prof.enable()
            t0 = perf()
            out = _orig(*a, **kw)
            if _name == "take_events":
                # Generators do their work when iterated: do it here, timed.
                out = list(out) if out is not None else []
            dt = perf() - t0
            if prof is not None:
                prof.disable()
            if timers.enabled:
                timers.current += dt
                timers.per_method[_name] = timers.per_method.get(_name, 0.0) + dt
                timers.calls[_name] = timers.calls.get(_name, 0) + 1
            return out

        setattr(conn, name, timed)
        wrapped.append(name)
    return wrapped


# --- fake worker ----------------------------------------------------------------


def fake_kv_output(meta, kind: str) -> tuple[KVConnectorOutput, int, int, int]:
    """This step's transfers, all complete.

    Returns (output, loaded blocks, stored blocks, requests with a load).
    """
    if kind == "hicache":
        assert isinstance(meta, HiCacheMetadata)
        loaded = sum(len(j.copy) for j in meta.loads) + sum(len(j.copy) for j in meta.async_loads)
        stored = len(meta.stores) + len(meta.evict_stores)
        recv = {j.req_id for j in meta.async_loads}
        nreq = len(meta.loads) + len(meta.async_loads)
        return KVConnectorOutput(finished_recving=recv or None), loaded, stored, nreq
    assert isinstance(meta, OffloadingConnectorMetadata)
    done = OffloadingWorkerMetadata()
    for job_id in meta.load_jobs:
        done.mark_completed(job_id)
    for job_id in meta.store_jobs:
        done.mark_completed(job_id)
    loaded = sum(len(j.dst_spec.block_ids) for j in meta.load_jobs.values())
    stored = sum(len(j.src_spec.block_ids) for j in meta.store_jobs.values())
    recv = {j.req_id for j in meta.load_jobs.values()}
    out = KVConnectorOutput(finished_recving=recv or None, kv_connector_worker_meta=done)
    return out, loaded, stored, len(meta.load_jobs)


# --- one run --------------------------------------------------------------------


@dataclass
class RoundStats:
    steps: int = 0
    computed_tokens: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0
    load_requests: int = 0


@dataclass
class RunResult:
    name: str
    step_connector_s: list[float]  # timed rounds only
    sched_s: float  # schedule() + update_from_output(), timed rounds
    method_s: dict[str, float]
    method_calls: dict[str, int]
    rounds: list[RoundStats]
    wrapped: list[str]
    profile: str = ""


def play_round(sched: Scheduler, hasher, reqs: list[tuple[str, list[int]]], decode_tokens: int,
               kind: str, timers: Timers, max_steps: int, label: str
               ) -> tuple[RoundStats, float, list[float]]:
    """Add one round's requests and step until every one finishes.

    Returns the round's counts, the seconds in ``schedule()`` +
    ``update_from_output()``, and the connector seconds of each step.
    """
    perf = time.perf_counter
    stats = RoundStats()
    sched_s = 0.0
    step_times: list[float] = []
    timers.current = 0.0
    for req_id, tokens in reqs:
        sp = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        sched.add_request(Request(req_id, tokens, sp, None, block_hasher=hasher))
    while sched.has_unfinished_requests():
        if stats.steps >= max_steps:
            raise RuntimeError(f"{label} did not finish in {max_steps} steps")
        t0 = perf()
        so = sched.schedule()
        t1 = perf()
        kvo, loaded, stored, nreq = fake_kv_output(so.kv_connector_metadata, kind)
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            req = sched.requests[req_id]
            # A request still in prefill samples nothing this step.
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={x: i for i, x in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        t2 = perf()
        sched.update_from_output(so, out)
        t3 = perf()
        stats.steps += 1
        stats.computed_tokens += so.total_num_scheduled_tokens
        stats.loaded_blocks += loaded
        stats.stored_blocks += stored
        stats.load_requests += nreq
        sched_s += (t1 - t0) + (t3 - t2)
        step_times.append(timers.current)
        timers.current = 0.0
    return stats, sched_s, step_times


def run(args, trace: Trace, name: str, kind: str, connector: str, extra: dict,
        module_path: str | None, profile: bool) -> RunResult:
    sched = build_scheduler(args, connector, extra, module_path)
    timers = Timers()
    wrapped = wrap_connector(sched.connector, timers)
    hasher = get_request_block_hasher(args.block_size, sha256)
    step_times: list[float] = []
    sched_s = 0.0
    rounds: list[RoundStats] = []
    prof = cProfile.Profile() if profile else None
    gc.collect()

    for r, reqs in enumerate(trace.rounds):
        warm = r == 0
        timers.enabled = not warm
        timers.profiler = None if warm else prof
        if r > 0:
            if not sched.reset_prefix_cache():
                raise RuntimeError(f"{name}: reset_prefix_cache() failed before round {r}")
        stats, round_sched_s, round_steps = play_round(
            sched, hasher, reqs, trace.decode_tokens, kind, timers, args.max_steps_per_round,
            f"{name}: round {r}")
        if not warm:
            sched_s += round_sched_s
            step_times.extend(round_steps)
        rounds.append(stats)

    text = ""
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        text = buf.getvalue()
    return RunResult(name, step_times, sched_s, timers.per_method, timers.calls, rounds,
                     wrapped, text)


# --- report ---------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def summarize(res: RunResult) -> dict[str, float]:
    xs = res.step_connector_s
    return {
        "steps": len(xs),
        "mean_us": statistics.fmean(xs) * 1e6,
        "p50_us": pct(xs, 50) * 1e6,
        "p99_us": pct(xs, 99) * 1e6,
        "max_us": max(xs) * 1e6,
        "total_ms": sum(xs) * 1e3,
        "sched_ms": res.sched_s * 1e3,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / ".cache" / "tiny-llama"),
                   help="local model dir (config.json + tokenizer; "
                        "built by examples/tiny_model.py)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--prefix-len", type=int, default=3072)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (after one warm-up)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=0,
                   help="L1 blocks (default: all requests' prompts + decode, +1024 spare)")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--hicache-load-modes", default="layerwise,async",
                   help="comma list; the first one is the headline ratio")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per connector; the run with the median total is reported")
    p.add_argument("--max-steps-per-round", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", choices=("none", "hicache", "offloading", "both"), default="none",
                   help="cProfile the connector methods in one extra run (not the timed ones)")
    args = p.parse_args()

    if not (Path(args.model) / "config.json").exists():
        from examples.tiny_model import build_tiny_llama  # noqa: PLC0415

        build_tiny_llama(args.model)
    if args.gpu_blocks <= 0:
        per_req = -(-(args.prompt_len + args.decode_tokens) // args.block_size)
        args.gpu_blocks = args.requests * per_req + 1024
    modes = [m.strip() for m in args.hicache_load_modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("layerwise", "async"):
            p.error(f"unknown hicache load mode {m!r}")

    init_none_hash(sha256)
    trace = build_trace(args)

    # Same CPU-tier capacity in pages for both connectors.
    num_pages = int(args.gpu_blocks * args.hicache_ratio)
    bpb = kv_bytes_per_block(args.block_size)
    align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    cpu_bytes = num_pages * (-(-bpb // align) * align)
    offload_extra = {"cpu_bytes_to_use": cpu_bytes}

    import vllm  # noqa: PLC0415

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  "
          f"{platform.machine()} {os.cpu_count()} cpus  python {platform.python_version()}  "
          f"torch {torch.__version__}  vllm {vllm.__version__}")
    print(f"# trace: {args.requests} reqs x {args.prompt_len} tokens, {args.groups} groups "
          f"sharing {args.prefix_len}, {args.decode_tokens} decode tokens, 1 warm-up + "
          f"{args.rounds} timed rounds; block {args.block_size}, L1 {args.gpu_blocks} blocks, "
          f"CPU tier {num_pages} pages ({cpu_bytes / 2**20:.0f} MiB), "
          f"max_num_batched_tokens {args.max_batched_tokens}, repeat {args.repeat}")

    configs = []
    for m in modes:
        extra = {"hicache_io_backend": "direct", "hicache_ratio": args.hicache_ratio,
                 "hicache_load_mode": m}
        configs.append((f"HiCache[{m}]", "hicache", "HiCacheConnector", extra, "vllm_hicache"))
    configs.append(
        ("OffloadingConnector", "offloading", "OffloadingConnector", offload_extra, None))
    for name, _, _, extra, _ in configs:
        print(f"# {name} extra config: {extra}")

    # Interleave the repeats so drift (thermal, other load) hits all alike.
    runs: dict[str, list[RunResult]] = {c[0]: [] for c in configs}
    for _ in range(args.repeat):
        for name, kind, conn, extra, module in configs:
            runs[name].append(run(args, trace, name, kind, conn, extra, module, profile=False))
    results = []
    for name, _, _, _, _ in configs:
        rs = sorted(runs[name], key=lambda r: sum(r.step_connector_s))
        res = rs[len(rs) // 2]
        print(f"# {name}: connector totals over repeats (ms): "
              + ", ".join(f"{sum(r.step_connector_s) * 1e3:.1f}" for r in runs[name]))
        results.append(res)
    print(f"# timed methods (whichever exist): {', '.join(TIMED_METHODS)}")

    # Sanity: every connector loaded in every timed round and stored in the warm-up.
    print("\n## per round (round 0 = warm-up, excluded from timings)")
    print(f"{'connector':<20} {'round':>5} {'steps':>6} {'computed tok':>13} "
          f"{'loaded blk':>11} {'load reqs':>10} {'stored blk':>11}")
    failures = []
    for res in results:
        for r, s in enumerate(res.rounds):
            print(f"{res.name:<20} {r:>5} {s.steps:>6} {s.computed_tokens:>13} "
                  f"{s.loaded_blocks:>11} {s.load_requests:>10} {s.stored_blocks:>11}")
            if r > 0 and s.loaded_blocks == 0:
                failures.append(f"{res.name} loaded nothing in round {r}")
        if res.rounds[0].stored_blocks == 0:
            failures.append(f"{res.name} stored nothing in the warm-up round")
    if failures:
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        return 1

    print("\n## connector scheduler-side time per step (timed rounds, median run)")
    print(f"{'connector':<20} {'steps':>6} {'mean us':>9} {'p50 us':>9} {'p99 us':>9} "
          f"{'max us':>9} {'total ms':>9} {'sched+update ms':>16} {'share':>6}")
    sums = {}
    for res in results:
        s = summarize(res)
        sums[res.name] = s
        print(f"{res.name:<20} {s['steps']:>6} {s['mean_us']:>9.1f} {s['p50_us']:>9.1f} "
              f"{s['p99_us']:>9.1f} {s['max_us']:>9.1f} {s['total_ms']:>9.1f} "
              f"{s['sched_ms']:>16.1f} {s['total_ms'] / s['sched_ms']:>6.1%}")

    print("\n## per method: total ms (calls), median run")
    names = sorted({m for r in results for m in r.method_s},
                   key=lambda m: -max(r.method_s.get(m, 0.0) for r in results))
    print(f"{'method':<31}" + "".join(f"{r.name:>24}" for r in results))
    for m in names:
        cells = "".join(
            f"{r.method_s[m] * 1e3:>15.2f} ({r.method_calls[m]:>6})" if m in r.method_s
            else f"{'-':>24}" for r in results)
        print(f"{m:<31}{cells}")

    theirs = sums["OffloadingConnector"]
    print()
    verdict = ""
    for i, m in enumerate(modes):
        ours = sums[f"HiCache[{m}]"]
        ratio_total = ours["total_ms"] / theirs["total_ms"]
        ratio_mean = ours["mean_us"] / theirs["mean_us"]
        ratio_p50 = ours["p50_us"] / theirs["p50_us"] if theirs["p50_us"] else float("nan")
        print(f"ratio HiCache[{m}]/OffloadingConnector: total {ratio_total:.3f}, per-step mean "
              f"{ratio_mean:.3f}, p50 {ratio_p50:.3f}, p99 {ours['p99_us'] / theirs['p99_us']:.3f}")
        if i == 0:
            verdict = (f"headline (HiCache[{m}], total): {ratio_total:.3f} -> target <= 1/3 "
                       f"{'met' if ratio_total <= 1 / 3 else 'NOT met'}")
    print(verdict)

    if args.profile != "none":
        for name, kind, conn, extra, module in configs:
            if args.profile not in (kind, "both"):
                continue
            res = run(args, trace, name, kind, conn, extra, module, profile=True)
            print(f"\n## cProfile of {name} connector methods (timed rounds, by tottime)")
            print(res.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
