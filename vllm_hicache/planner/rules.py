"""The capacity plan's comparison of admission rules and L3 modes: the log
replayed at the served sizes once per (L1->L2 rule, L2->L3 rule, L3 mode),
so an operator picks one from their own traffic: hit rate against bytes
written across each boundary (L3 writes wear SSDs and load shared networks).

Bytes are at full scale (a sampled log's counts divided by its rate): L2
bytes are pages stored x block bytes, L3 bytes objects written x L3 block
bytes. Pure module.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from vllm_hicache.planner.l1 import Step
from vllm_hicache.planner.log_format import LogHeader
from vllm_hicache.planner.model import ReplayConfig, ReplayResult
from vllm_hicache.planner.replay import replay
from vllm_hicache.policy.admission import AdmissionRule, L3Mode, parse_admission
from vllm_hicache.policy.write import l2_admission_rule


@dataclass(frozen=True)
class Rules:
    l2: AdmissionRule
    l3: AdmissionRule
    mode: L3Mode

    def describe(self) -> str:
        return f"L2 {self.l2}, L3 {self.l3} {self.mode.value}"


@dataclass
class RulePoint:
    rules: Rules
    result: ReplayResult
    # Full-scale bytes written across L1 -> L2 and L2 -> L3.
    l2_bytes: float
    l3_bytes: float
    served: bool = False

    @property
    def l3_bytes_per_request(self) -> float:
        return self.l3_bytes / self.result.requests if self.result.requests else 0.0


def served_rules(header: LogHeader) -> Rules:
    """The rules the server ran with (older logs: write-through's)."""
    return Rules(parse_admission(header.l2_admission), parse_admission(header.l3_admission),
                 L3Mode(header.l3_mode))


def rule_grid(header: LogHeader, l2: list[str] | None = None, l3: list[str] | None = None,
              modes: list[str] | None = None) -> list[Rules]:
    """The served rules first, then every combination asked for (default:
    L2 always / hits:2, L3 always / hits:2, inclusive / exclusive; with no
    L3 in the log, only the L2 rules). A rule the write policy cannot take
    (write_back, or write_through_selective: hits:2 only) is left out."""
    served = served_rules(header)
    has_l3 = bool(header.l3_backend)
    l2_rules = [parse_admission(r) for r in (l2 or ["always", "hits:2"])]
    l3_rules = [parse_admission(r) for r in (l3 or ["always", "hits:2"])] if has_l3 else [served.l3]
    mode_list = [L3Mode(m) for m in (modes or list(L3Mode))] if has_l3 else [served.mode]
    out = [served]
    for a, b, m in itertools.product(l2_rules, l3_rules, mode_list):
        try:
            l2_admission_rule(header.write_policy, a)
        except ValueError:
            continue
        rules = Rules(a, b, m)
        if rules not in out:
            out.append(rules)
    return out


def sweep_rules(steps: list[Step], base: ReplayConfig, grid: list[Rules], header: LogHeader,
                rate: float) -> list[RulePoint]:
    """Replay ``steps`` at ``base``'s sizes once per rule set of ``grid``."""
    l2_block = header.block_bytes
    l3_block = header.l3_block_bytes or header.block_bytes
    points = []
    for i, rules in enumerate(grid):
        cfg = replace(base, l2_admission=rules.l2, l3_admission=rules.l3, l3_mode=rules.mode)
        res = replay(steps, cfg)
        points.append(RulePoint(rules, res, res.stored_pages * l2_block / rate,
                                res.l3_written * l3_block / rate, served=i == 0))
    return points


def format_rules(points: list[RulePoint]) -> list[str]:
    if not points:
        return []
    lines = [
        ("Admission rules and L3 mode at the served sizes (bytes written across each "
         "boundary; * = as served)"),
        (f"  {'L2 rule':<10} {'L3 rule':<10} {'L3 mode':<10} {'hit%':>6} {'L3%':>6} "
         f"{'L2 GB wr':>9} {'L3 GB wr':>9} {'L3 MB/req':>10}"),
    ]
    for p in points:
        r = p.result
        mark = "*" if p.served else " "
        lines.append(
            f"{mark} {str(p.rules.l2):<10} {str(p.rules.l3):<10} {p.rules.mode.value:<10} "
            f"{100 * r.hit_rate:6.1f} {100 * r.rate(r.l3_tokens):6.1f} "
            f"{p.l2_bytes / 1e9:9.3g} {p.l3_bytes / 1e9:9.3g} "
            f"{p.l3_bytes_per_request / 1e6:10.3g}")
    return lines
