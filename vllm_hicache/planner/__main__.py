"""``python -m vllm_hicache.planner LOG [LOG ...]``: the capacity plan of an
access log (docs/capacity-planning.md)."""

from __future__ import annotations

import argparse
import sys

from vllm_hicache.planner.log_format import LogReadError, read_logs
from vllm_hicache.planner.report import CostModel, build_plan, format_report
from vllm_hicache.policy.admission import L3Mode, parse_admission

_COST = CostModel()


def _sizes(text: str, unlimited: bool) -> list[float | None]:
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if unlimited and item in ("inf", "unlimited"):
            out.append(None)
            continue
        value = float(item)
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"{item!r}: sizes are GB >= 0")
        out.append(value)
    return out


def _rules(text: str) -> list[str]:
    out = [item.strip() for item in text.split(",") if item.strip()]
    for item in out:
        try:
            parse_admission(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return out


def _modes(text: str) -> list[str]:
    out = [item.strip() for item in text.split(",") if item.strip()]
    for item in out:
        if item not in tuple(L3Mode):
            raise argparse.ArgumentTypeError(
                f"{item!r}: L3 modes are {', '.join(m.value for m in L3Mode)}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m vllm_hicache.planner",
        description="Replay a HiCache access log (hicache_access_log) through L1, L2 and L3 "
                    "for a sweep of sizes: hit rate, prefill saved, reuse-distance CDF, knee, "
                    "cost. Sizes are GB of KV across ranks (hicache_size is per rank).")
    p.add_argument("logs", nargs="+", metavar="LOG",
                   help="log files, oldest first (after a rotation: LOG.1 LOG)")
    p.add_argument("--l2-gb", type=lambda s: _sizes(s, False),
                   help="L2 sizes to sweep, comma-separated (default: around the footprint)")
    p.add_argument("--l3-gb", type=lambda s: _sizes(s, True),
                   help="L3 sizes, comma-separated, 0 = none, inf = unlimited")
    p.add_argument("--prefetch", choices=("wait", "no-wait"),
                   help="a request waits for its own L3 prefetch (wait_complete, timeout) or "
                        "gets what landed before it was admitted (best_effort); "
                        "default: as served")
    rules = p.add_argument_group(
        "admission rules (compared at the served sizes; policy/admission.py's grammar)")
    rules.add_argument("--l2-admission", type=_rules,
                       help="L1->L2 rules, comma-separated (default: always,hits:2)")
    rules.add_argument("--l3-admission", type=_rules,
                       help="L2->L3 rules, comma-separated (default: always,hits:2)")
    rules.add_argument("--l3-mode", type=_modes,
                       help="L3 modes, comma-separated (default: inclusive,exclusive)")
    p.add_argument("--plots", metavar="DIR", default="hicache-plan",
                   help="where the PNGs go (default: %(default)s); needs matplotlib")
    p.add_argument("--no-plots", action="store_true")
    cost = p.add_argument_group("cost model (assumptions)")
    cost.add_argument("--mem-usd-gb-month", type=float, default=_COST.mem_usd_gb_month,
                      help="host memory (L2), $/GB-month (assumed: %(default)s)")
    cost.add_argument("--storage-usd-gb-month", type=float,
                      default=_COST.storage_usd_gb_month,
                      help="storage (L3), $/GB-month (assumed: %(default)s)")
    cost.add_argument("--gpu-usd-hour", type=float, default=_COST.gpu_usd_hour,
                      help="one GPU, $/hour (assumed: %(default)s)")
    cost.add_argument("--prefill-tokens-per-s", type=float,
                      default=_COST.prefill_tokens_per_s,
                      help="prefill throughput of one GPU (assumed: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cost = CostModel(args.mem_usd_gb_month, args.storage_usd_gb_month, args.gpu_usd_hour,
                     args.prefill_tokens_per_s)
    try:
        log = read_logs(args.logs)
    except (OSError, LogReadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    waits = None if args.prefetch is None else args.prefetch == "wait"
    plan = build_plan(log, cost, args.l2_gb, args.l3_gb, waits,
                      (args.l2_admission, args.l3_admission, args.l3_mode))
    print(format_report(plan, cost))
    if not args.no_plots:
        from vllm_hicache.planner.plots import save_plots

        paths = save_plots(plan, args.plots)
        if paths is None:
            print("plots: matplotlib is not installed (pip install 'vllm-hicache[bench]'); "
                  "text only")
        else:
            print("plots: " + " ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
