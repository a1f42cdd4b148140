"""Admission rules and exclusive L3 on a synthetic multi-turn trace, through
the capacity planner's replay (docs/benchmarks.md, "Admission per boundary
and exclusive L3").

The trace: conversations over one shared system prompt, picked by a Zipf
law (a few hot, a long tail), each turn extending its conversation's prompt
by the last answer and a new question; its working set is several times
L2 + L3. It is written as an access log (the format hicache_access_log
writes), so the same numbers come from the planner's CLI:

    python benchmarks/bench_admission.py --write-log /tmp/trace.log
    python -m vllm_hicache.planner /tmp/trace.log --no-plots \
        --l2-admission always --l3-admission always,hits:2 --l3-mode inclusive,exclusive

Printed: per rule, hit rate, L3 objects written per request and bytes, and
the ratios against today's write-through (L2 always, L3 always, inclusive).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from vllm_hicache.planner.log_format import (
    MAGIC,
    AccessLog,
    Admit,
    Arrive,
    Finish,
    LogHeader,
    encode_admit,
    encode_arrive,
    encode_finish,
    encode_header,
    frame,
)
from vllm_hicache.planner.report import CostModel, build_plan

BLOCK = 16
PAGE_BYTES = 64 * 1024


def _chain(prev: bytes, names: list[str]) -> list[bytes]:
    out = []
    for name in names:
        prev = hashlib.sha256(prev + name.encode()).digest()[:8]
        out.append(prev)
    return out


def picks(args: argparse.Namespace) -> Iterator[tuple[int, int, bool]]:
    """(request, its conversation, whether that conversation starts afresh)
    for every request of the trace: the conversation is drawn by the Zipf
    law, and restarts after ``max_turns`` turns. bench_tiering_serve.py
    replays the same sequence against real servers."""
    rng = random.Random(args.seed)
    weights = [1 / (i + 1) ** args.zipf for i in range(args.conversations)]
    turns: dict[int, int] = {}
    for seq in range(args.requests):
        c = rng.choices(range(args.conversations), weights)[0]
        fresh = c not in turns or turns[c] >= args.max_turns
        turns[c] = 1 if fresh else turns[c] + 1
        yield seq, c, fresh


def trace(args: argparse.Namespace) -> AccessLog:
    system = _chain(b"", [f"sys{i}" for i in range(args.system_blocks)])
    convs: dict[int, list[bytes]] = {}
    records: list = []
    for seq, c, fresh in picks(args):
        if fresh:
            convs[c] = system + _chain(system[-1], [f"{c}/{seq}/q"])
        chain = convs[c]
        # The new question (a block) on top of the conversation so far.
        chain = chain + _chain(chain[-1], [f"{seq}q{i}" for i in range(args.turn_blocks)])
        tokens = len(chain) * BLOCK + 1
        answer = _chain(chain[-1], [f"{seq}a{i}" for i in range(args.turn_blocks)])
        t_ms = seq * 100
        records += [Arrive(t_ms, seq, seq), Admit(t_ms, seq, seq, tokens, 0, 0, 0, 0, tuple(chain)),
                    Finish(t_ms, seq, seq + 1, len(chain) + len(answer) + 1, tuple(answer))]
        convs[c] = chain + answer
    l3_block = PAGE_BYTES + 64
    header = LogHeader(block_size=BLOCK, page_bytes=PAGE_BYTES, ranks=1,
                       l1_blocks=args.l1_blocks + 1, l2_pages=args.l2_pages,
                       l3_backend="file", l3_prefetch_policy="wait_complete",
                       l3_threshold_tokens=BLOCK, l3_capacity_bytes=args.l3_objects * l3_block,
                       l3_block_bytes=l3_block)
    return AccessLog(header, records, [], 0)


def write_log(log: AccessLog, path: Path) -> None:
    body = bytearray()
    for r in log.records:
        if isinstance(r, Arrive):
            body += encode_arrive(*r)
        elif isinstance(r, Admit):
            body += encode_admit(*r[:8], b"".join(r.chain))
        else:
            body += encode_finish(*r[:4], b"".join(r.chain_ext))
    path.write_bytes(MAGIC + frame(encode_header(log.header)) + frame(bytes(body)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--requests", type=int, default=6000)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--system-blocks", type=int, default=8)
    p.add_argument("--turn-blocks", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--l1-blocks", type=int, default=64)
    p.add_argument("--l2-pages", type=int, default=512)
    p.add_argument("--l3-objects", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-log", type=Path, help="also write the trace as an access log")
    args = p.parse_args(argv)
    log = trace(args)
    if args.write_log:
        write_log(log, args.write_log)
    plan = build_plan(log, CostModel(), l2_gb=[], l3_gb=[],
                      rules=(["always"], ["always", "hits:2"], ["inclusive", "exclusive"]))
    distinct = plan.profile.distinct_blocks
    print(f"trace: {plan.num_requests} requests, {distinct} distinct blocks; L1 "
          f"{args.l1_blocks}, L2 {args.l2_pages}, L3 {args.l3_objects} blocks "
          f"(working set {distinct / (args.l2_pages + args.l3_objects):.1f} x L2 + L3)")
    base = next(pt for pt in plan.rules if pt.served)
    print(f"{'L3 rule':<8} {'mode':<10} {'hit%':>6} {'L3 hit%':>7} {'L3 obj/req':>10} "
          f"{'L3 MB/req':>9} {'hit x base':>10} {'L3 wr x base':>12}")
    for pt in plan.rules:
        r = pt.result
        per_req = r.l3_written / r.requests
        print(f"{str(pt.rules.l3):<8} {pt.rules.mode.value:<10} {100 * r.hit_rate:6.1f} "
              f"{100 * r.rate(r.l3_tokens):7.1f} {per_req:10.3f} "
              f"{pt.l3_bytes_per_request / 1e6:9.3f} "
              f"{r.hit_rate / base.result.hit_rate:10.3f} "
              f"{pt.l3_bytes / base.l3_bytes if base.l3_bytes else 0:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
