"""The no-reuse tax: CPU time HiCache spends on requests that hit nothing.

Every prompt is new, so neither L2 nor L3 can serve a token: whatever the
connector does for these requests (L3 lookups, backups of every stored page,
metadata, stats) is pure overhead. This measures that overhead as CPU time
and call counts, which stay meaningful on a shared machine where wall time
does not.

vLLM's real ``Scheduler`` and our worker half run in one process
(``tests/connector/harness.py``, its byte-checking fake forward turned off:
nothing is loaded). Every connector method either half exposes is wrapped by
a ``time.thread_time`` accumulator (CPU of the calling thread, the engine's
own); the background threads we start (``hicache-lookup``, ``hicache-l3w``,
the file pool...) are read from their own CPU clocks before and after the run.
The report is per request: CPU microseconds per hook and per thread group,
and calls per request. ``--systems`` picks L2 alone (``l2``) and L2 + the
``file`` L3 (``l2l3``, under the end-to-end benchmark's prefetch policy).

    .venv/bin/python benchmarks/bench_noreuse.py --model .cache/tiny-llama
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.connector.harness import BLOCK, make_harness  # noqa: E402
from vllm_hicache import io_threads  # noqa: E402

SCHEDULER_METHODS = (
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
    "build_connector_meta", "update_connector_output", "request_finished",
    "get_kv_connector_stats", "take_events",
)
WORKER_METHODS = (
    "handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
    "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "clear_connector_metadata", "get_kv_connector_stats",
)
_THREAD_NUMBER = re.compile(r"[-_]\d+$")


class HookTimes:
    """CPU seconds and calls per wrapped method, and how often
    get_num_new_matched_tokens answered ``None`` (ask again)."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.deferred = 0
        self.profiler: cProfile.Profile | None = None

    def wrap(self, obj, names: tuple[str, ...], half: str) -> None:
        clock = time.thread_time
        for name in names:
            orig = getattr(obj, name, None)
            if orig is None:
                continue
            key = f"{half}.{name}"

            def timed(*a, _orig=orig, _key=key, **kw):
                prof = self.profiler
                if prof is not None:
                    prof.enable()
                t0 = clock()
                out = _orig(*a, **kw)
                if _key.endswith("take_events"):
                    out = list(out) if out is not None else []
                self.cpu_s[_key] += clock() - t0
                if prof is not None:
                    prof.disable()
                self.calls[_key] += 1
                if _key.endswith("get_num_new_matched_tokens") and out[0] is None:
                    self.deferred += 1
                return out

            setattr(obj, name, timed)


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds of every live thread but this one, by thread id."""
    out = {}
    me = threading.get_ident()
    for t in threading.enumerate():
        if t.ident is None or t.ident == me:
            continue
        try:
            clock = time.pthread_getcpuclockid(t.ident)
            out[t.ident] = (_THREAD_NUMBER.sub("", t.name), time.clock_gettime(clock))
        except (OSError, ProcessLookupError):
            continue  # it ended meanwhile
    return out


def thread_delta(before, after) -> dict[str, float]:
    groups: dict[str, float] = defaultdict(float)
    for ident, (name, cpu) in after.items():
        groups[name] += cpu - before.get(ident, (name, 0.0))[1]
    return {k: v for k, v in groups.items() if v > 0}


def system_options(system: str, l3_dir: str) -> dict:
    base = {"hicache_io_backend": "direct", "hicache_write_policy": "write_through",
            "hicache_ratio": 2}
    if system == "l2":
        return base
    # The end-to-end benchmark's hicache-l2l3 (benchmarks/e2e/plan.py).
    return dict(base, hicache_storage_backend="file",
                hicache_storage_prefetch_policy="timeout",
                hicache_storage_backend_extra_config={"path": l3_dir,
                                                      "prefetch_threshold": BLOCK})


class ThreadProfiles:
    """A CPU-time profiler in each of our I/O threads started while installed
    (they all call ``io_threads.enter_io_thread`` first)."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        self._inner = io_threads.enter_io_thread

    def __enter__(self) -> ThreadProfiles:
        def enter(background=None) -> None:
            self._inner(background)
            prof = cProfile.Profile(time.thread_time)
            self.profiles.append(prof)
            prof.enable()

        io_threads.enter_io_thread = enter
        return self

    def __exit__(self, *exc) -> None:
        io_threads.enter_io_thread = self._inner

    def text(self) -> str:
        if not self.profiles:
            return "(no I/O thread started)"
        buf = io.StringIO()
        stats = pstats.Stats(self.profiles[0], stream=buf)
        for prof in self.profiles[1:]:
            stats.add(prof)
        stats.sort_stats("tottime").print_stats(30)
        return buf.getvalue()


def warm_fanout(path: str) -> None:
    """Make every fan-out directory of a file store (``aa/bb``, 65,536 of
    them), as a store that has served for a while has them: a fresh store
    makes one for nearly every object it writes."""
    for top in range(256):
        for leaf in range(256):
            os.makedirs(os.path.join(path, f"{top:02x}", f"{leaf:02x}"), mode=0o700,
                        exist_ok=True)


def run_system(args, system: str, seed: int, profile: bool) -> dict:
    if profile:
        with ThreadProfiles() as threads:
            out = _run_system(args, system, seed, profile)
        out["profile"] += "\n## ... and of its I/O threads, by tottime (CPU)\n" + threads.text()
        return out
    return _run_system(args, system, seed, profile)


def _run_system(args, system: str, seed: int, profile: bool) -> dict:
    rng = random.Random(seed)
    per_req = -(-(args.prompt_tokens + args.output_tokens) // BLOCK)
    with tempfile.TemporaryDirectory(prefix="hicache-noreuse-") as fresh:
        l3_dir = args.warm_store or fresh
        h = make_harness(args.model, num_blocks=args.concurrency * per_req + 16,
                         max_num_seqs=args.concurrency, max_batched=args.max_batched,
                         **system_options(system, l3_dir))
        h._fake_forward = lambda so: None  # nothing is ever loaded: no bytes to check
        hooks = HookTimes()
        hooks.wrap(h.scheduler.connector, SCHEDULER_METHODS, "sched")
        hooks.wrap(h.worker, WORKER_METHODS, "worker")
        if profile:
            hooks.profiler = cProfile.Profile(time.thread_time)
        threads_before = thread_cpu_s()
        added = 0
        steps = 0
        while added < args.requests or h.scheduler.has_unfinished_requests():
            while added < args.requests and len(h.scheduler.requests) < args.concurrency:
                tokens = [rng.randrange(10, 500) for _ in range(args.prompt_tokens)]
                h.add(f"{system}-{seed}-{added}", tokens, max_tokens=args.output_tokens)
                added += 1
            so = h.step()
            steps += 1
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.001)  # a lookup in flight
            if steps > 100 * args.requests:
                raise RuntimeError(f"{system}: requests did not finish")
        # The last backups' acknowledgements.
        for _ in range(5):
            h.step()
        threads = thread_delta(threads_before, thread_cpu_s())
        loaded = sum(1 for n in h.first_computed.values() if n)
        text = ""
        if hooks.profiler is not None:
            buf = io.StringIO()
            pstats.Stats(hooks.profiler, stream=buf).sort_stats("tottime").print_stats(30)
            text = buf.getvalue()
        h.scheduler.connector.shutdown()
        h.worker.shutdown()
    return {"hooks": hooks, "threads": threads, "steps": steps, "loaded": loaded,
            "profile": text}


def report(system: str, runs: list[dict], requests: int) -> None:
    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    print(f"\n## {system}: CPU us per request, median of {len(runs)} runs [min-max]; "
          f"calls per request")
    names = sorted({k for r in runs for k in r["hooks"].cpu_s},
                   key=lambda k: -median([r["hooks"].cpu_s.get(k, 0.0) for r in runs]))
    total = [sum(r["hooks"].cpu_s.values()) * 1e6 / requests for r in runs]
    print(f"{'hook':<46} {'us/req':>9} {'range':>17} {'calls/req':>10}")
    for k in names:
        xs = [r["hooks"].cpu_s.get(k, 0.0) * 1e6 / requests for r in runs]
        calls = median([r["hooks"].calls.get(k, 0) for r in runs]) / requests
        print(f"{k:<46} {median(xs):>9.1f} {min(xs):>8.1f}-{max(xs):<8.1f} {calls:>10.2f}")
    print(f"{'all hooks (engine threads)':<46} {median(total):>9.1f} "
          f"{min(total):>8.1f}-{max(total):<8.1f}")
    groups = sorted({g for r in runs for g in r["threads"]})
    bg = [sum(r["threads"].values()) * 1e6 / requests for r in runs]
    for g in groups:
        xs = [r["threads"].get(g, 0.0) * 1e6 / requests for r in runs]
        print(f"{'thread ' + g:<46} {median(xs):>9.1f} {min(xs):>8.1f}-{max(xs):<8.1f}")
    print(f"{'all background threads':<46} {median(bg):>9.1f} {min(bg):>8.1f}-{max(bg):<8.1f}")
    deferred = [r["hooks"].deferred / requests for r in runs]
    print(f"get_num_new_matched_tokens answered None: {median(deferred):.2f} per request; "
          f"steps per run {[r['steps'] for r in runs]}; requests that loaded anything "
          f"{[r['loaded'] for r in runs]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / ".cache" / "tiny-llama"))
    p.add_argument("--systems", default="l2,l2l3", help="comma list of l2, l2l3")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=448)
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-batched", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="runs per system, interleaved")
    p.add_argument("--warm-store", action="store_true",
                   help="one file store for all runs, its 65,536 fan-out directories made "
                        "first (a store in service); default: a fresh store per run")
    p.add_argument("--profile", action="store_true",
                   help="one more run per system under cProfile (CPU clock): its hooks and "
                        "its I/O threads, printed")
    args = p.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ("l2", "l2l3"):
            p.error(f"--systems: unknown system {s!r} (l2, l2l3)")
    if args.prompt_tokens + args.output_tokens > 512 - BLOCK:
        p.error("--prompt-tokens + --output-tokens must leave a block of the harness's "
                "512-token model length")
    if not (Path(args.model) / "config.json").exists():
        from examples.tiny_model import build_tiny_llama  # noqa: PLC0415

        build_tiny_llama(args.model)
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}; {args.requests} requests x {args.prompt_tokens} new "
          f"tokens + {args.output_tokens} out, concurrency {args.concurrency}, "
          f"repeat {args.repeat}, {'warm' if args.warm_store else 'fresh'} file store")
    with tempfile.TemporaryDirectory(prefix="hicache-noreuse-warm-") as warm:
        if args.warm_store:
            args.warm_store = os.path.join(warm, "l3")
            warm_fanout(args.warm_store)
        else:
            args.warm_store = ""
        return measure(args, systems)


def measure(args, systems: list[str]) -> int:
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for i in range(args.repeat):
        for s in systems:
            runs[s].append(run_system(args, s, seed=i, profile=False))
    for s in systems:
        if any(r["loaded"] for r in runs[s]):
            print(f"FAIL: {s}: a request loaded something; the traffic is not no-reuse",
                  file=sys.stderr)
            return 1
        report(s, runs[s], args.requests)
    if args.profile:
        for s in systems:
            print(f"\n## cProfile of {s}'s hooks (engine threads), by tottime (CPU)")
            print(run_system(args, s, seed=args.repeat, profile=True)["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
