"""The node tier against private L2s: three vLLM engines on one machine.

Eight engine processes (benchmarks/node_tier/instance.py: vLLM's offline
engine, CPU, one OpenMP thread each, the demo's model), alive together and
asked one request at a time, so only one computes at any moment:

* **node tier**: three instances sharing a node tier of S pages, each with a
  small private L2 (the staging area the current load path needs: a hit is
  copied segment -> private L2 -> L1);
* **private L2 of S/3**: three instances, no node tier;
* **private L2 of S**: one instance able to hold the working set, which it is
  asked once: what each of three instances with private L2s holds after a
  rotation (each sees every document), so its memory counts three times;
* **vLLM alone**: one engine without the connector, for the reference
  answers and the memory an engine takes without HiCache.

Measured, in this order:

1. Hit rate. A working set of documents that fits S but not S/3; every round
   asks each document once with a new question, on the instance after the one
   that served it last (three in rotation). Reported: tokens served from a
   cache over the reusable tokens (the documents' full blocks) of the rounds
   after the first, per configuration, with the tier they came from.
2. Host memory, right after: PSS (``/proc/PID/smaps_rollup``, which divides
   a shared page among the processes that map it) summed over each
   configuration's three processes, and that sum less three vLLM-alone
   engines', against S.
3. TTFT of a cross-instance hit: a document computed by instance A, asked on
   B (its pages come from the node tier), against a same-instance L2 hit (A
   asks it again after emptying vLLM's own cache); the two alternate, and
   before each the third instance computes a token, so that neither is the
   process that ran last (whose weights the CPU's cache still holds).
   Each kind of hit's TTFT is also split into its wait in the engine before
   the step that admits it and that step up to the first token (vLLM's
   request metrics), which tells scheduling from the step's own work.

Every answer must equal vLLM alone's (exit status 1 otherwise). Timings on a
machine shared with other jobs are noisy: read the ratios.

    .venv/bin/python benchmarks/bench_node_tier.py [--quick] [--model DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from node_tier import plan as P  # noqa: E402
from node_tier.fleet import REPO, Instance  # noqa: E402
from node_tier.pss import allocated_bytes, pss_bytes  # noqa: E402

NODE, SMALL, LARGE, ALONE = "node tier", "private L2 of S/3", "private L2 of S", "vLLM alone"
# tier_hits' entry for pages loaded from the node tier straight into L1.
DIRECT = "direct loads (pages)"
MiB = 1 << 20


def page_bytes(model: Path) -> int:
    """One block of every layer (K and V) of ``model``, float32."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4 \
        * P.BLOCK_TOKENS


def common_extra() -> dict:
    return {"hicache_io_backend": "direct", "hicache_mem_layout": "page_first_direct"}


def extras(plan: P.Plan, root: str) -> dict[str, dict | None]:
    """The connector's extra config per configuration."""
    return {
        NODE: {**common_extra(), "hicache_ratio": plan.staging_ratio,
               "node_tier_bytes": plan.node_tier_bytes,
               "node_tier_name": f"bench-{uuid.uuid4().hex[:8]}", "node_tier_root": root,
               "hicache_storage_prefetch_policy": "wait_complete",
               "hicache_storage_backend_extra_config": {"prefetch_threshold": P.BLOCK_TOKENS}},
        SMALL: {**common_extra(),
                "hicache_size": plan.private_l2_gb(plan.node_pages // P.INSTANCES)},
        LARGE: {**common_extra(), "hicache_size": plan.private_l2_gb(plan.node_pages)},
        ALONE: None,
    }


def start(plan: P.Plan, model: Path, root: str, log_dir: Path) -> dict[str, list[Instance]]:
    """Every instance at once (their starts overlap), then wait for each."""
    fleet: dict[str, list[Instance]] = {}
    try:
        for config, extra in extras(plan, root).items():
            spec = {"model": str(model), "extra": extra, "block_tokens": P.BLOCK_TOKENS,
                    "l1_blocks": plan.l1_blocks, "page_bytes": plan.page_bytes,
                    "max_model_len": plan.max_model_len}
            count = 1 if config in (ALONE, LARGE) else P.INSTANCES
            fleet[config] = [Instance(f"{config.replace(' ', '_').replace('/', '_')}-{i}",
                                      spec, log_dir) for i in range(count)]
        for instances in fleet.values():
            for inst in instances:
                print(f"  {inst.name}: ready in {inst.wait_ready():.0f} s", flush=True)
    except BaseException:
        stop(fleet)
        raise
    return fleet


def stop(fleet: dict[str, list[Instance]]) -> None:
    for instances in fleet.values():
        for inst in instances:
            inst.stop()


def ask(inst: Instance, prompt: list[int]) -> dict:
    got = inst.call("generate", prompt=prompt, max_tokens=P.ANSWER_TOKENS)
    got["prompt"] = prompt
    return got


def tier_hits(instances: list[Instance]) -> tuple[dict[str, float], float]:
    """Hit tokens per tier label (and the pages loaded from the node tier
    directly, under ``DIRECT``) and node-tier page reads, summed."""
    hits: dict[str, float] = {}
    reads = 0.0
    for inst in instances:
        s = inst.call("stats")
        for label, value in s["hit_tokens"].items():
            hits[label] = hits.get(label, 0) + value
        reads += s["backend"].get("node_tier_hits", 0.0)
        hits["load errors (blocks)"] = (hits.get("load errors (blocks)", 0)
                                        + s.get("load_error_blocks", 0))
        hits[DIRECT] = hits.get(DIRECT, 0) + s.get("direct_pages", 0)
    return hits, reads


def part_hit_rate(plan: P.Plan, fleet: dict[str, list[Instance]], asked: list[dict]) -> dict:
    docs = P.documents(plan, "working-set")
    out = {}
    for config in (NODE, SMALL):
        instances = fleet[config]
        before, reads_before = tier_hits(instances)
        served = []
        for r, d, i in P.rotation(plan):
            got = ask(instances[i], docs[d] + P.question(plan, "rotation", r, d))
            instances[i].call("settle")
            served.append({"round": r, "prompt_len": len(got["prompt"]),
                           "cached": got["cached"]})
            asked.append(got)
        after, reads_after = tier_hits(instances)
        hit, reusable = P.hit_rate(served)
        out[config] = {"hit": hit, "reusable": reusable,
                       "by_tier": {k: v - before.get(k, 0) for k, v in after.items()},
                       "node_reads": reads_after - reads_before}
        print(f"  {config}: {hit:,} of {reusable:,} reusable tokens", flush=True)
    return out


def fill_private(plan: P.Plan, inst: Instance, asked: list[dict]) -> None:
    """The working set into one private L2 of S, as a rotation leaves it in
    each of three (the first round's prompts)."""
    docs = P.documents(plan, "working-set")
    for d, doc in enumerate(docs):
        asked.append(ask(inst, doc + P.question(plan, "rotation", 0, d)))
        inst.call("settle")


def part_memory(fleet: dict[str, list[Instance]], root: str) -> dict:
    """PSS of every configuration at the same moment (shared libraries are
    divided among the same processes for all of them); the configurations
    of one instance count it three times."""
    out = {config: pss_bytes([inst.pid for inst in instances]) * (P.INSTANCES // len(instances))
           for config, instances in fleet.items()}
    out["node tier files"] = allocated_bytes(root)
    return out


def part_ttft(plan: P.Plan, fleet: dict[str, list[Instance]], asked: list[dict]) -> dict:
    a, b, other = fleet[NODE]
    docs = P.documents(dataclasses.replace(plan, docs=max(plan.docs, plan.ttft_trials)), "ttft")
    l2, cross, cold = [], [], []
    # Per hit: (waiting in the engine before the step that admits it, that
    # step up to the first token), to tell scheduling from the step's work.
    parts: dict[str, list[tuple[float, float]]] = {"L2": [], "node": []}
    short: list[str] = []  # hits that did not serve the whole document
    hits_before, reads_before = tier_hits([b])
    for t, doc in enumerate(docs[: plan.ttft_trials]):
        got = ask(a, doc + P.question(plan, "ttft-cold", t))   # computed by A
        cold.append(got["ttft_s"])
        asked.append(got)
        a.call("settle")                                       # its pages in the node tier
        order = (("L2", a), ("node", b)) if t % 2 == 0 else (("node", b), ("L2", a))
        for kind, inst in order:
            inst.call("reset_l1")
            # The same warm state for both: another process computed last.
            # (B is never the process that ran last, A is after its own
            # settle; A's hits were 2 ms faster then: its weights still in
            # the CPU's cache.)
            other.call("generate", prompt=[7, 8], max_tokens=1)
            got = ask(inst, doc + P.question(plan, "ttft", kind, t))
            if got["cached"] != P.reusable_tokens(len(got["prompt"])):
                short.append(f"trial {t}, {kind} hit: {got['cached']} of "
                             f"{P.reusable_tokens(len(got['prompt']))} tokens")
            (l2 if kind == "L2" else cross).append(got["ttft_s"])
            parts[kind].append((got["queue_s"], got["run_s"]))
            asked.append(got)
        a.call("settle")
        b.call("settle")
    hits_after, reads_after = tier_hits([b])
    return {"l2": l2, "cross": cross, "cold": cold, "short": short, "parts": parts,
            "b_by_tier": {k: v - hits_before.get(k, 0) for k, v in hits_after.items()},
            "b_node_reads": reads_after - reads_before}


def check_answers(fleet: dict[str, list[Instance]], asked: list[dict]) -> tuple[int, int]:
    """(requests whose answer differs from vLLM alone's, requests)."""
    ref = fleet[ALONE][0]
    reference: dict[tuple[int, ...], list[int]] = {}
    differ = 0
    for got in asked:
        key = tuple(got["prompt"])
        if key not in reference:
            reference[key] = ask(ref, got["prompt"])["answer"]
        differ += got["answer"] != reference[key]
    return differ, len(asked)


def hit_path(by_tier: dict[str, float], reads: float) -> str:
    """Which load path served the node tier's hits, from the counters."""
    direct = by_tier.get(DIRECT, 0)  # not in ``reads``: those are the staging path's
    if reads <= 0 and direct <= 0:
        return "no page was read from the node tier"
    labels = sorted(k for k, v in by_tier.items() if v > 0 and k != DIRECT)
    if direct > 0 and labels == ["L3"]:
        return (f"segment -> L1 directly ({direct:.0f} pages; counted as L3 hits; "
                f"pages staged through L2: {reads:.0f})")
    if labels == ["L3"] or labels == ["L2", "L3"]:
        return ("segment -> private L2 -> L1 (the tier's pages are prefetched into L2 and "
                "counted as L3 hits)")
    return f"hit tokens by tier {by_tier} (node-tier page reads {reads:.0f})"


def ttft_parts(label: str, parts: list[tuple[float, float]]) -> str:
    """Where a kind of hit's TTFT went: engine wait, then its step."""
    queue = P.median([q for q, _ in parts]) * 1e3
    run = P.median([r for _, r in parts]) * 1e3
    return (f"  {label}: waiting before the step that admits it {queue:.1f} ms, that step "
            f"to the first token {run:.1f} ms (medians)")


def report(plan: P.Plan, hit: dict, mem: dict, ttft: dict, differ: int, total: int) -> list[str]:
    s_bytes = plan.node_pages * plan.page_bytes
    lines = [
        f"  S = {plan.node_pages} pages of {plan.page_bytes:,} B ({s_bytes / MiB:.1f} MiB); "
        f"working set {plan.docs} documents x {plan.doc_blocks} blocks = "
        f"{plan.working_set_pages} pages; L1 {plan.l1_blocks} blocks per instance; node-tier "
        f"instances' private L2 {plan.staging_ratio:g} x L1 = {plan.staging_pages} pages (a "
        f"prefetch holds up to {plan.staging_prefetch_pages}); {plan.rounds} rounds; "
        f"{P.QUESTION_TOKENS}-token questions, {P.ANSWER_TOKENS} answer tokens",
        "",
        "  Hit rate, three instances in rotation (rounds after the first):",
        "",
        "  | configuration | hit tokens / reusable | rate | hit tokens by tier (L1 not shown) |",
        "  | --- | ---: | ---: | --- |",
    ]
    for config, h in hit.items():
        tiers = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(h["by_tier"].items())) or "-"
        lines.append(f"  | {config} | {h['hit']:,} / {h['reusable']:,} | "
                     f"{h['hit'] / h['reusable']:.1%} | {tiers} |")
    base = mem[ALONE]  # counted three times
    lines += [
        "",
        "  Host memory after the rotation (PSS summed over the three processes):",
        "",
        "  | configuration | PSS of three instances | above three vLLM-alone engines | that / S |",
        "  | --- | ---: | ---: | ---: |",
    ]
    for config in (NODE, SMALL, LARGE):
        above = mem[config] - base
        lines.append(f"  | {config} | {mem[config] / MiB:,.0f} MiB | {above / MiB:,.0f} MiB | "
                     f"{above / s_bytes:.2f} |")
    lines.append(f"  vLLM alone, one engine: {mem[ALONE] / 3 / MiB:,.0f} MiB; private L2 of S: one "
                 f"instance holding the working set, counted three times; the node tier's files "
                 f"in tmpfs: {mem['node tier files'] / MiB:,.1f} MiB")
    node_above, large_above = mem[NODE] - base, mem[LARGE] - base
    l2_med, cross_med = P.median(ttft["l2"]), P.median(ttft["cross"])
    paired = [c / s for c, s in zip(ttft["cross"], ttft["l2"])]
    lines += [
        "",
        f"  TTFT, {len(ttft['l2'])} documents computed by instance A (median "
        f"{P.median(ttft['cold']) * 1e3:.0f} ms), then asked again on A (L2 hit) and on B "
        f"(node-tier hit), alternating:",
        f"  same-instance L2 hit median {l2_med * 1e3:.1f} ms; cross-instance hit median "
        f"{cross_med * 1e3:.1f} ms",
        *(ttft_parts(label, ttft["parts"][kind])
          for kind, label in (("L2", "L2 hit"), ("node", "cross-instance hit"))),
        f"  B's hits were served by: {hit_path(ttft['b_by_tier'], ttft['b_node_reads'])}",
        f"  hits short of the whole document: {'; '.join(ttft['short']) or 'none'}",
        "",
        "  Targets (issue 22):",
        f"  - cross-instance hit TTFT / same-instance L2 hit TTFT: {cross_med / l2_med:.2f} "
        f"(median of pairs {P.median(paired):.2f}); target <= 1.1",
        f"  - node tier's hit rate: {hit[NODE]['hit'] / hit[NODE]['reusable']:.1%} of the "
        f"reusable tokens (private L2 of S/3: "
        f"{hit[SMALL]['hit'] / hit[SMALL]['reusable']:.1%}); target >= 95%",
        f"  - host memory above vLLM alone, node tier / three private L2s of S: "
        f"{node_above / large_above:.2f}; node tier {node_above / s_bytes:.2f} x S "
        f"(target <= {1 + 0.05 * P.INSTANCES:.2f} x S: S plus 5% per instance)",
        memory_split(node_above, mem["node tier files"], s_bytes),
        f"  - answers identical to vLLM alone: "
        f"{'yes' if not differ else f'NO ({differ} of {total} differ)'} ({total} requests)",
    ]
    return lines


def memory_split(node_above: int, tier_files: int, s_bytes: int) -> str:
    """The node tier's memory above vLLM alone as the tier's pages (its
    tmpfs files, once for the machine) and what each instance adds beside
    them (its staging L2, HiCache's code, threads and caches, each bounded
    whatever S is: a process's slot hints at about 16 MiB), and the tier size
    from which that rest is within 5% of S."""
    per_instance = max(0, node_above - tier_files) / P.INSTANCES
    return (f"    of which the tier's pages {tier_files / MiB:,.1f} MiB "
            f"({tier_files / s_bytes:.2f} x S, once for the machine) and "
            f"{per_instance / MiB:,.1f} MiB per instance beside them (bounded whatever S "
            f"is): within 5% of S from S = "
            f"{per_instance / 0.05 / (1 << 30):,.2f} GiB on")


def ensure_model(model: Path) -> None:
    if not (model / "config.json").exists():
        sys.path.insert(0, str(REPO / "examples"))
        from tiny_model import DEMO_SIZE, build_tiny_llama

        build_tiny_llama(str(model), **DEMO_SIZE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "demo-llama")
    parser.add_argument("--quick", action="store_true",
                        help="fewer documents, rounds and trials (a smoke run)")
    parser.add_argument("--logs", type=Path, default=None,
                        help="directory for the instances' logs (default: a temporary one)")
    args = parser.parse_args()
    ensure_model(args.model)
    pb = page_bytes(args.model)
    plan = P.quick(pb) if args.quick else P.Plan(page_bytes=pb)
    plan.check()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="hicache-bench-node-", dir=shm)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="hicache-bench-node-logs-"))
    print(f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs, model "
          f"{args.model}; {'quick' if args.quick else 'full'} run; logs in {logs}", flush=True)
    fleet: dict[str, list[Instance]] = {}
    try:
        fleet = start(plan, args.model, root, logs)
        asked: list[dict] = []
        hit = part_hit_rate(plan, fleet, asked)
        fill_private(plan, fleet[LARGE][0], asked)
        mem = part_memory(fleet, root)
        ttft = part_ttft(plan, fleet, asked)
        differ, total = check_answers(fleet, asked)
    finally:
        stop(fleet)
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(report(plan, hit, mem, ttft, differ, total)), flush=True)
    if not args.logs:
        shutil.rmtree(logs, ignore_errors=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
