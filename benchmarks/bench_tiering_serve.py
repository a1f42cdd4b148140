"""Admission rules, exclusive L3 and a write budget on real ``vllm-hicache
serve`` servers, beside the capacity planner's replay of the same trace
(docs/benchmarks.md, "Admission per boundary and exclusive L3").

The trace is bench_admission.py's (``picks``: conversations over one shared
system prompt drawn by a Zipf law, each turn the conversation so far, the
last answer and a new question of ``turn_blocks`` blocks, a conversation
restarting after ``max_turns`` turns), scaled down so that a configuration
is served in minutes on two cores while its working set stays several times
L2 + L3. Requests go one at a time in trace order, greedy, so every server
sees the same prompts as long as the answers agree (checked: each answer is
compared with write-through's).

``--answers synthetic`` makes a long trace affordable: the client appends a
made-up answer block instead of the server's, and the server generates
only a few tokens (fewer than a block), still compared with the base's.
The connector sees the same blocks stored at the same requests either way:
a server never computes the KV of its last generated token, so an answer's
block is first stored by the conversation's next turn, as here.

One server per configuration, all started at once, served one after the
other (or all at once with ``--parallel``; demo model, ``file`` L3 with
``max_bytes`` of ``--l3-objects`` objects, L2 of ``--l2-pages`` pages,
vLLM's L1 of ``--l1-blocks`` blocks, ``wait_complete`` prefetches):

- ``write-through``: L3 ``always``, ``inclusive`` (today's behaviour, the base);
- ``exclusive``: L3 ``always``, ``exclusive``;
- ``hits2``: L3 ``hits:2``, ``inclusive``;
- ``budget``: write-through with ``l3_write_budget_bytes_per_s`` half the file
  L3's write bandwidth, measured first (``measure_l3_write``), or half of
  ``--l3-write-mb-s``: with it, every configuration's L3 is the file backend
  with writes throttled to that rate (benchmarks/throttled_l3.py), a store
  slower than the server writes, so the budget binds and its throughput
  against write-through's on the same store is the cost of skipping.

Per configuration, from the server's ``/metrics`` (what the run moved): the
hit rate in prompt tokens (vLLM's prefix cache, L2, L3), L3 bytes written
per served request (``transfer_bytes{op="backup"}``), requests/s and output
tokens/s with their ratio to write-through's, and skipped stores by tier and
reason. Printed as a markdown table with the replay's; everything goes to
``OUT/results.json``.

    .venv/bin/python benchmarks/bench_tiering_serve.py            # ~10 min per configuration
    .venv/bin/python benchmarks/bench_tiering_serve.py --requests 120 --configs write-through,hits2
    .venv/bin/python benchmarks/bench_tiering_serve.py --configs write-through,budget \
        --answers synthetic --l3-write-mb-s 0.5
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # vllm_hicache

import bench_admission  # noqa: E402
from bench_serve import block_bytes, code_state, ensure_model, wait_idle, warm_up  # noqa: E402
from e2e import prom  # noqa: E402
from e2e import servers as e2e_servers  # noqa: E402
from e2e.servers import REPO, Server, ServerSpec  # noqa: E402
from e2e.workloads import FIRST_WORD_ID, NUM_WORDS  # noqa: E402

from vllm_hicache.planner.report import CostModel, build_plan  # noqa: E402

SERVED_NAME = "demo"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
MAX_MODEL_LEN = 768
REQUEST_TIMEOUT_S = 600.0
# Tokens generated per request with --answers synthetic: fewer than a block,
# so they never complete one (nothing stored beyond the trace's blocks).
CHECK_TOKENS = 4
# The budget's burst at least this many blocks (see hicache_config).
BURST_BLOCKS = 2
BASE = "write-through"
# name -> (the connector's L3 keys, the planner's rules: L3 admission, mode).
CONFIGS: dict[str, tuple[dict, tuple[str, str]]] = {
    BASE: ({"hicache_l3_admission": "always", "hicache_l3_mode": "inclusive"},
           ("always", "inclusive")),
    "exclusive": ({"hicache_l3_admission": "always", "hicache_l3_mode": "exclusive"},
                  ("always", "exclusive")),
    "hits2": ({"hicache_l3_admission": "hits:2", "hicache_l3_mode": "inclusive"},
              ("hits:2", "inclusive")),
    "budget": ({"hicache_l3_admission": "always", "hicache_l3_mode": "inclusive"},
               ("always", "inclusive")),
}
# One sample line of /metrics: name, labels, value.
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# vLLM's per-engine labels: summed over.
_ENGINE_LABELS = {"model_name", "engine"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / ".cache" / "demo-llama")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--conversations", type=int, default=60)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--system-blocks", type=int, default=4)
    p.add_argument("--turn-blocks", type=int, default=1)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--answers", choices=("model", "synthetic"), default="model",
                   help="model: a turn's answer is the server's own (turn-blocks blocks "
                        "generated); synthetic: the client appends a block of words instead "
                        f"and the server generates only {CHECK_TOKENS} tokens, compared with "
                        "the base's (the same blocks stored, at a fraction of the decode time)")
    p.add_argument("--l1-blocks", type=int, default=32)
    p.add_argument("--l2-pages", type=int, default=64)
    p.add_argument("--l3-objects", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", action="store_true",
                   help="serve every configuration's trace at once (each server still sees "
                        "its requests one at a time): hit rates and bytes as sequential, in "
                        "a third of the time for three; requests/s are then not comparable")
    p.add_argument("--l3-write-mb-s", type=float, default=0.0,
                   help="every configuration's L3 is the file backend with writes throttled to "
                        "this many MB/s (benchmarks/throttled_l3.py), and budget's budget is half "
                        "of it; 0: the plain file backend, budget half its measured bandwidth")
    p.add_argument("--core", type=int, default=-1,
                   help="the CPU the server computes on (default: the last one allowed)")
    p.add_argument("--out", type=Path, default=REPO / ".cache" / "bench-tiering-serve")
    p.add_argument("--start-timeout", type=float, default=1500.0,
                   help="seconds each server may take to start (every one starts at once)")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        p.error(f"--configs: unknown {unknown}; accepted: {', '.join(CONFIGS)}")
    # The base first: the others are compared with it, the budget is set from it.
    args.configs = sorted(configs, key=lambda c: c != BASE)
    if args.system_blocks < 1 or args.turn_blocks < 1 or args.max_turns < 1:
        p.error("--system-blocks, --turn-blocks and --max-turns must be >= 1")
    longest = (args.system_blocks + 1 + args.max_turns * 2 * args.turn_blocks) * BLOCK_SIZE
    if longest > MAX_MODEL_LEN:
        p.error(f"a conversation reaches {longest} tokens, over max_model_len {MAX_MODEL_LEN}: "
                "lower --max-turns or --turn-blocks")
    if args.parallel and "budget" in configs:
        p.error("--parallel with budget: its throughput is compared with the base's, so "
                "they must not share the machine; run budget without --parallel")
    if args.l3_write_mb_s < 0:
        p.error(f"--l3-write-mb-s must be >= 0 (0: unthrottled), got {args.l3_write_mb_s}")
    if args.l1_blocks * BLOCK_SIZE <= MAX_MODEL_LEN:  # vLLM keeps one block aside
        p.error(f"--l1-blocks must exceed max_model_len ({MAX_MODEL_LEN // BLOCK_SIZE} blocks)")
    return args


# --- the trace as token ids ----------------------------------------------------------


def _words(tag: str, num_tokens: int) -> list[int]:
    rng = random.Random(tag)
    return [FIRST_WORD_ID + rng.randrange(NUM_WORDS) for _ in range(num_tokens)]


class Conversations:
    """Prompts of the trace's requests, in token ids: the system prompt, a
    first block of the conversation, then per turn the last answer (as the
    server generated it) and the new question."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.system = _words(f"{args.seed}/system", args.system_blocks * BLOCK_SIZE)
        self._context: dict[int, list[int]] = {}

    def prompt(self, seq: int, conv: int, fresh: bool) -> list[int]:
        if fresh:
            self._context[conv] = self.system + _words(f"{self.args.seed}/{conv}/{seq}/first",
                                                       BLOCK_SIZE)
        question = _words(f"{self.args.seed}/{seq}/question", self.args.turn_blocks * BLOCK_SIZE)
        return self._context[conv] + question

    def answered(self, seq: int, conv: int, prompt: list[int], answer: list[int]) -> None:
        """The conversation continues with ``answer`` (the server's), or with
        a made-up block of words where answers are synthetic."""
        if self.args.answers == "synthetic":
            answer = _words(f"{self.args.seed}/{seq}/answer", self.args.turn_blocks * BLOCK_SIZE)
        self._context[conv] = prompt + answer


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=REQUEST_TIMEOUT_S) as resp:
        choice = json.loads(resp.read())["choices"][0]
    ids = choice.get("token_ids")
    if not ids:
        raise RuntimeError(f"the server returned no token ids: {choice}")
    return list(ids)


# --- metrics --------------------------------------------------------------------------


def parse_series(text: str, prefix: str = "vllm:hicache_") -> dict[str, float]:
    """Every sample of series named ``prefix...``, keyed ``name{label=value,...}``
    with vLLM's per-engine labels summed over."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not match.group(1).startswith(prefix) \
                or match.group(1).endswith("_created"):  # prometheus_client's timestamps
            continue
        name, labels, value = match.groups()
        kept = ",".join(f"{k}={v}" for k, v in _LABEL.findall(labels or "")
                        if k not in _ENGINE_LABELS)
        sample = f"{name}{{{kept}}}" if kept else name
        out[sample] = out.get(sample, 0.0) + float(value)
    return out


def skipped_by_reason(moved: dict[str, float]) -> dict[str, int]:
    """store_skipped_blocks moved, as ``tier/reason``."""
    out = {}
    for sample, value in moved.items():
        if sample.startswith("vllm:hicache_store_skipped_blocks_total{") and value:
            labels = dict(kv.split("=", 1) for kv in sample[sample.index("{") + 1:-1].split(","))
            out[f"{labels.get('tier')}/{labels.get('reason')}"] = int(value)
    return out


def summarize(moved: dict[str, float], requests: int, wall_s: float,
              output_tokens: int) -> dict:
    hits = prom.hit_tokens(moved)
    prompt = hits["prompt"] or 1.0
    backup_bytes = moved.get('vllm:hicache_transfer_bytes_total{op=backup}', 0.0)
    backup_s = moved.get('vllm:hicache_transfer_seconds_total{op=backup}', 0.0)
    return {
        "requests": requests, "wall_s": wall_s, "requests_per_s": requests / wall_s,
        "output_tokens_per_s": output_tokens / wall_s, "hit_tokens": hits,
        "hit_rate": (hits["L1"] + hits["L2"] + hits["L3"]) / prompt,
        "l3_hit_rate": hits["L3"] / prompt,
        "l3_bytes_written": backup_bytes, "l3_bytes_per_request": backup_bytes / requests,
        "l3_write_bytes_per_s": backup_bytes / backup_s if backup_s else 0.0,
        "skipped": skipped_by_reason(moved),
    }


# --- one configuration ------------------------------------------------------------------


def hicache_config(args: argparse.Namespace, name: str, page_bytes: int,
                   budget_bytes_per_s: int) -> dict:
    l3_keys, _ = CONFIGS[name]
    object_bytes = page_bytes + 4096  # the object's header and key, generously
    storage: dict = {"prefetch_threshold": BLOCK_SIZE,
                     "max_bytes": args.l3_objects * object_bytes}
    if name == "budget":
        storage["l3_write_budget_bytes_per_s"] = budget_bytes_per_s
        # The burst (default one second of the budget) must hold a block: on
        # a slow store half its bandwidth may be less than one block a second.
        if budget_bytes_per_s < BURST_BLOCKS * object_bytes:
            storage["l3_write_burst_bytes"] = BURST_BLOCKS * object_bytes
    backend = "file"
    if args.l3_write_mb_s:  # a store slower than the server writes
        backend = "dynamic"
        storage.update(module_path="throttled_l3", class_name="ThrottledFileBackend",
                       write_mb_s=args.l3_write_mb_s)
    return {
        "hicache_io_backend": "direct", "hicache_write_policy": "write_through",
        # A little over the pages asked for: the size is rounded down to whole pages.
        "hicache_size": (args.l2_pages * page_bytes + page_bytes // 2) / 1e9,
        "hicache_storage_backend": backend,
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": storage, **l3_keys,
    }


def make_server(args: argparse.Namespace, name: str, page_bytes: int, core: int,
                budget_bytes_per_s: int) -> Server:
    spec = ServerSpec(name, args.l1_blocks,
                      hicache_config(args, name, page_bytes, budget_bytes_per_s))
    return Server(spec, args.model, SERVED_NAME, BLOCK_SIZE, page_bytes, core,
                  args.out / "servers", MAX_MODEL_LEN, 4, MAX_MODEL_LEN)


def run_config(args: argparse.Namespace, server: Server) -> tuple[dict, list[list[int]]]:
    """The trace against one started server; stops it."""
    name = server.spec.name
    try:
        plan = SimpleNamespace(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
        warm_up(server, plan)  # vLLM's CPU KV cache is allocated lazily
        wait_idle(server)
        server.clear_l3()
        wait_idle(server)
        server.reset_caches()
        before = server.metrics()
        convs = Conversations(args)
        answers: list[list[int]] = []
        max_tokens = (CHECK_TOKENS if args.answers == "synthetic"
                      else args.turn_blocks * BLOCK_SIZE)
        load_before = os.getloadavg()
        start = time.monotonic()
        for seq, conv, fresh in bench_admission.picks(args):
            prompt = convs.prompt(seq, conv, fresh)
            answer = complete(server.url, prompt, max_tokens)
            convs.answered(seq, conv, prompt, answer)
            answers.append(answer)
            if (seq + 1) % 50 == 0:
                print(f"[{name}] {seq + 1}/{args.requests} requests, "
                      f"{time.monotonic() - start:.0f} s", flush=True)
        wall_s = time.monotonic() - start
        wait_idle(server)
        after = server.metrics()
    finally:
        server.stop()
        shutil.rmtree(server.l3_dir, ignore_errors=True)
    moved = prom.delta({**prom.parse(before), **parse_series(before)},
                       {**prom.parse(after), **parse_series(after)})
    result = summarize(moved, len(answers), wall_s, sum(map(len, answers)))
    result.update(config=server.spec.hicache, metrics=moved,
                  loadavg_before=load_before, loadavg_after=os.getloadavg())
    return result, answers


def served(args: argparse.Namespace, servers: list[Server]) -> Iterator[tuple[Server, tuple]]:
    """(server, run_config's result) per configuration, in ``servers``'
    order (the base first): one after the other, or with ``--parallel`` all
    at once, each trace on its own thread."""
    if not args.parallel:
        for server in servers:
            yield server, run_config(args, server)
        return
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(run_config, args, server) for server in servers]
        for server, future in zip(servers, futures):
            yield server, future.result()


def measure_l3_write(scratch: Path, page_bytes: int, objects: int = 128,
                     rounds: int = 3) -> float:
    """The file L3's write bandwidth (bytes/s, median of ``rounds``): a batch
    of ``objects`` page-sized objects written with ``FileBackend.put`` into
    a fresh directory beside the servers' L3."""
    from bench_l3_file import HEADER, make_objects

    from vllm_hicache.storage import StorageContext, create_backend

    sources, _ = make_objects(objects, page_bytes)
    backend = create_backend("file", {"path": str(scratch)},
                             StorageContext("worker", 0, 1, HEADER + page_bytes))
    samples = []
    try:
        for r in range(rounds):
            backend.clear()
            keys = [f"hc1-bench-{r}-{i:06d}" for i in range(objects)]
            start = time.perf_counter()
            backend.put(keys, sources)
            samples.append(objects * (HEADER + page_bytes) / (time.perf_counter() - start))
    finally:
        backend.clear()
        backend.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return sorted(samples)[len(samples) // 2]


# --- the planner's replay -----------------------------------------------------------------


def replay(args: argparse.Namespace, zipf: float) -> dict[str, dict]:
    """bench_admission's replay of the trace at these sizes, per rule pair."""
    targs = argparse.Namespace(**{**vars(args), "zipf": zipf})
    plan = build_plan(bench_admission.trace(targs), CostModel(), l2_gb=[], l3_gb=[],
                      rules=(["always"], ["always", "hits:2"], ["inclusive", "exclusive"]))
    out = {}
    for pt in plan.rules:
        r = pt.result
        out[f"{pt.rules.l3}/{pt.rules.mode.value}"] = {
            "hit_rate": r.hit_rate, "l3_hit_rate": r.rate(r.l3_tokens),
            "l3_objects_per_request": r.l3_written / r.requests,
            "distinct_blocks": plan.profile.distinct_blocks}
    return out


def table(results: dict, replays: dict[str, dict[str, dict]], zipf: float) -> str:
    base = results["configs"].get(BASE) or next(iter(results["configs"].values()))
    rows = ["| configuration | hit rate | of which L3 | L3 MB written / request | req/s | "
            "hit rate × base | L3 bytes × base | throughput × base | skipped blocks | "
            "replay hit rate × base | replay L3 writes × base | answers as base |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    rep = replays[str(zipf)]
    rep_base = rep["always/inclusive"]
    for name, r in results["configs"].items():
        rule = "/".join(CONFIGS[name][1])
        rp = rep[rule]

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.3f}" if b else "-"

        rows.append(
            f"| {name} | {100 * r['hit_rate']:.1f}% | {100 * r['l3_hit_rate']:.1f}% | "
            f"{r['l3_bytes_per_request'] / 1e6:.3f} | {r['requests_per_s']:.2f} | "
            f"{ratio(r['hit_rate'], base['hit_rate'])} | "
            f"{ratio(r['l3_bytes_per_request'], base['l3_bytes_per_request'])} | "
            f"{ratio(r['requests_per_s'], base['requests_per_s'])} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(r['skipped'].items())) or '-'} | "
            f"{ratio(rp['hit_rate'], rep_base['hit_rate'])} | "
            f"{ratio(rp['l3_objects_per_request'], rep_base['l3_objects_per_request'])} | "
            f"{r['answers_as_base']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    e2e_servers.START_TIMEOUT_S = args.start_timeout  # read by Server.wait_ready
    ensure_model(args.model)
    # The servers import this repository, whatever the caller's environment.
    # (and this directory, for throttled_l3).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(Path(__file__).resolve().parent),
         *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    page_bytes = block_bytes(args.model, BLOCK_SIZE)
    core = args.core if args.core >= 0 else sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - {core} or {core})
    replays = {str(z): replay(args, z) for z in dict.fromkeys((args.zipf, 1.0, 0.8))}
    results: dict = {"command": shlex.join([sys.executable, *sys.argv]),
                     "date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "code": code_state(), "loadavg_start": os.getloadavg(),
                     "page_bytes": page_bytes, "replays": replays, "configs": {}}
    print(f"bench_tiering_serve: {args.requests} requests over {args.conversations} "
          f"conversations (Zipf {args.zipf}), "
          f"{replays[str(args.zipf)]['always/inclusive']['distinct_blocks']} distinct blocks; "
          f"L1 {args.l1_blocks}, L2 {args.l2_pages}, L3 {args.l3_objects} blocks", flush=True)
    budget = 0
    if "budget" in args.configs:
        bandwidth = (args.l3_write_mb_s * 1e6 if args.l3_write_mb_s
                     else measure_l3_write(args.out / "l3-bandwidth", page_bytes))
        budget = int(bandwidth / 2)
        results["l3_write_bytes_per_s"] = bandwidth
        print(f"L3 writes {bandwidth / 1e6:.3g} MB/s: budget {budget / 1e6:.3g} MB/s",
              flush=True)
    servers = [make_server(args, name, page_bytes, core, budget) for name in args.configs]
    # Started at once (each takes minutes on a busy machine), served one at a
    # time: an idle server takes no CPU.
    for server in servers:
        shutil.rmtree(server.l3_dir, ignore_errors=True)
        server.start()
    base_answers: list[list[int]] | None = None
    try:
        # Every one ready before the first is served (wait_ready's deadline
        # runs from the start, not from the end of the previous run).
        ready_s = {server.spec.name: server.wait_ready() for server in servers}
        for server, (result, answers) in served(args, servers):
            name = server.spec.name
            base_answers = base_answers or answers  # the base runs first
            same = sum(a == b for a, b in zip(answers, base_answers))
            result["answers_as_base"] = f"{same}/{len(answers)}"
            result["ready_s"] = ready_s[name]
            result["answers_sha256"] = hashlib.sha256(json.dumps(answers).encode()).hexdigest()
            results["configs"][name] = result
            print(f"[{name}] {result['requests_per_s']:.2f} req/s, hit rate "
                  f"{100 * result['hit_rate']:.1f}% (L3 {100 * result['l3_hit_rate']:.1f}%), "
                  f"L3 {result['l3_bytes_per_request'] / 1e6:.3f} MB/request, skipped "
                  f"{result['skipped']}, answers as base {result['answers_as_base']}",
                  flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        for server in servers:
            server.stop()
            shutil.rmtree(server.l3_dir, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results, replays, args.zipf))
    for z, rep in replays.items():
        print(f"replay, Zipf {z}: " + "; ".join(
            f"{k} hit {100 * v['hit_rate']:.1f}% L3 obj/req {v['l3_objects_per_request']:.2f}"
            for k, v in rep.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
