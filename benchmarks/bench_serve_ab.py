"""A/B of source trees on the end-to-end benchmark's workloads.

Starts vLLM alone and one ``hicache-l2l3`` server (``e2e/plan.py``; or one
per ``--systems``) per source tree, all at once, then runs the chosen ``vllm bench serve``
workloads of the full plan on them as ``bench_serve.py`` does (fresh caches
before every run, the systems in a rotating order, hit tokens from
``/metrics``), and prints req/s per run and the mean relative to vLLM, and the CPU time
each server's processes spent per request (``e2e/cputime.py``).

A tree is ``NAME=PATH`` (a checkout) or ``NAME=REV`` (exported from this
repository's git into ``OUT/trees/NAME``). Each server imports the package
from its own tree (``PYTHONPATH``; checked before it starts): the console
script alone would import the editable install, i.e. the same code for every
tree.

    .venv/bin/python benchmarks/bench_serve_ab.py before=099ea5f after=HEAD \\
        --workloads random-high,prefix_repetition --reps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve as bs  # noqa: E402
from e2e import cputime, prom  # noqa: E402
from e2e.plan import full_plan  # noqa: E402
from e2e.servers import REPO, Server  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", help="NAME=PATH or NAME=REV")
    p.add_argument("--workloads", default="random-high",
                   help="comma-separated vllm bench serve workloads of the full plan")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--systems", default="hicache-l2l3",
                   help="comma-separated HiCache systems of the plan to run each tree as "
                        "(servers are then named TREE:SYSTEM)")
    p.add_argument("--out", type=Path, default=REPO / ".cache" / "bench-serve-ab")
    p.add_argument("--model", type=Path, default=REPO / ".cache" / "demo-llama")
    p.add_argument("--l3-root", action="append", default=[], metavar="TREE=DIR",
                   help="put TREE's file L3 under DIR (e.g. a tmpfs, to tell the store's "
                        "medium from the code); repeatable")
    p.add_argument("--core", type=int, default=-1,
                   help="the servers' compute core (default: as bench_serve.py chooses)")
    p.add_argument("--settle", action="append", default=[], metavar="[TREE=]SECONDS",
                   help="after emptying a server's caches, sync the file systems and wait "
                        "this long before its run, so that the work an L3 clear leaves to "
                        "the disk ends before the measurement: every server, or TREE's "
                        "(repeatable; TREE= overrides the plain value)")
    return p.parse_args()


def source_tree(name: str, where: str, out: Path) -> Path:
    path = Path(where)
    if path.is_dir():
        return path.resolve()
    tree = out / "trees" / name
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", where], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def settle_of(values: list[str], servers: list[str]) -> dict[str, float]:
    """``--settle`` arguments as seconds per server (``TREE=S`` applies to
    TREE's servers, a plain ``S`` to every server without one)."""
    default, by_tree = 0.0, {}
    for value in values:
        tree, _, seconds = value.rpartition("=")
        try:
            number = float(seconds)
        except ValueError:
            raise SystemExit(f"bad --settle {value!r}: [TREE=]SECONDS") from None
        if tree:
            by_tree[tree] = number
        else:
            default = number
    return {name: by_tree.get(name.split(":")[0], default) for name in servers}


def l3_root_of(pairs: list[str], trees: dict[str, Path]) -> dict[str, Path]:
    """``--l3-root TREE=DIR`` arguments as a map, each TREE one of ``trees``."""
    roots = {}
    for pair in pairs:
        name, _, where = pair.partition("=")
        if name not in trees or not where:
            raise SystemExit(f"bad --l3-root {pair!r}: TREE=DIR with TREE one of {sorted(trees)}")
        roots[name] = Path(where)
    return roots


def check_imports_from(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    where = subprocess.run(
        [sys.executable, "-c", "import vllm_hicache.config as m; print(m.__file__)"],
        env=env, cwd="/", capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree):
        raise SystemExit(f"{tree}: the package comes from {where}, not from the tree")


def start(name: str, tree: Path | None, system: str, plan, core: int, out: Path,
          model: Path, l3_root: Path | None = None) -> Server:
    spec = plan.server_specs()[next(s.server for s in bs.SYSTEMS if s.name == system)]
    os.environ["PYTHONPATH"] = str(tree) if tree is not None else ""
    server = Server(spec, model, bs.SERVED_NAME, plan.block_size,
                    bs.block_bytes(model, plan.block_size), core, out / "servers",
                    plan.max_model_len, plan.max_num_seqs, plan.max_batched_tokens,
                    tag=f"-{name.replace(':', '-')}", l3_root=l3_root)
    shutil.rmtree(server.l3_dir, ignore_errors=True)
    server.start()  # copies the environment: PYTHONPATH as set above
    return server


def run_once(server: Server, system_name: str, bench, label: str, out: Path,
             settle_s: float = 0.0) -> dict:
    system = next(s for s in bs.SYSTEMS if s.name == system_name)
    bs.fresh_caches(server)
    if settle_s > 0:
        os.sync()
        time.sleep(settle_s)
    before = prom.parse(server.metrics())
    cpu_before = cputime.snapshot(server.proc.pid)
    result = bs.run_bench(server, system, bench, label, out)
    bs.wait_idle(server)
    cpu_s = cputime.delta(cpu_before, cputime.snapshot(server.proc.pid))
    moved = prom.delta(before, prom.parse(server.metrics()))
    return {"req_s": result["request_throughput"], "hits": prom.hit_tokens(moved),
            "mean_ttft_ms": result.get("mean_ttft_ms"),
            "cpu_ms_per_req": {k: 1e3 * v / result["completed"] for k, v in cpu_s.items()}}


def summary(results: dict) -> str:
    lines = []
    for workload, by_system in results.items():
        base = by_system.get("vllm")
        base_mean = sum(r["req_s"] for r in base) / len(base) if base else None
        for name, runs in by_system.items():
            mean = sum(r["req_s"] for r in runs) / len(runs)
            rel = f"{mean / base_mean:.3f}" if base_mean else "-"
            l3 = [int(r["hits"].get("L3", 0)) for r in runs]
            lines.append(f"{workload:18s} {name:10s} runs {[round(r['req_s'], 3) for r in runs]} "
                         f"mean {mean:.3f} vs vLLM {rel} L3 hit tokens {l3}")
        lines.append(cpu_table(workload, by_system))
    return "\n".join(lines)


def cpu_table(workload: str, by_system: dict) -> str:
    """CPU ms per request by process (and HiCache thread group), mean over
    the runs with its range, per system (``cputime.py``)."""
    keys = sorted({k for runs in by_system.values() for r in runs for k in r["cpu_ms_per_req"]})
    lines = [f"{workload}: CPU ms per request, mean [min-max] over runs"]
    for key in keys:
        cells = []
        for name, runs in by_system.items():
            values = [r["cpu_ms_per_req"].get(key, 0.0) for r in runs]
            cells.append(f"{name} {sum(values) / len(values):7.1f} "
                         f"[{min(values):.1f}-{max(values):.1f}]")
        lines.append(f"  {key:28s} " + "   ".join(cells))
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    args.out = args.out.resolve()  # trees are imported from it with cwd="/"
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {}
    for arg in args.trees:
        name, _, where = arg.partition("=")
        if not where or name == "vllm":
            raise SystemExit(f"bad tree {arg!r}: NAME=PATH or NAME=REV, NAME not 'vllm'")
        trees[name] = source_tree(name, where, args.out)
        check_imports_from(trees[name])
    plan = full_plan(0)
    benches = {b.name: b for b in plan.bench}
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in benches]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; the plan has {sorted(benches)}")
    systems = args.systems.split(",")
    known = {s.name for s in bs.SYSTEMS} - {"vllm", "ideal"}
    if not set(systems) <= known:
        raise SystemExit(f"unknown systems {sorted(set(systems) - known)}; known: {sorted(known)}")
    bs.ensure_model(args.model)
    core = bs.compute_core(args.core)
    os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - {core} or {core})
    system_of = {"vllm": "vllm"}
    for tree in trees:
        system_of.update((tree if len(systems) == 1 else f"{tree}:{s}", s) for s in systems)
    l3_roots = l3_root_of(args.l3_root, trees)
    servers = {name: start(name, trees.get(name.split(":")[0]), system, plan, core, args.out,
                           args.model, l3_roots.get(name.split(":")[0]))
               for name, system in system_of.items()}
    settle = settle_of(args.settle, list(servers))
    results: dict = {}
    try:
        for server in servers.values():
            server.wait_ready()
            bs.warm_up(server, plan)
        names, turn = list(servers), 0
        for workload in workloads:
            for rep in range(args.reps):
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    run = run_once(servers[name], system_of[name], benches[workload],
                                   f"{name.replace(':', '-')}-{workload}-{rep}", args.out,
                                   settle[name])
                    results.setdefault(workload, {}).setdefault(name, []).append(run)
                    print(f"{workload} #{rep} {name}: {run['req_s']:.3f} req/s", flush=True)
                    (args.out / "ab.json").write_text(json.dumps(results, indent=1))
    finally:
        for server in servers.values():
            server.stop()
            shutil.rmtree(server.l3_dir, ignore_errors=True)
    print(summary(results))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    raise SystemExit(main())
