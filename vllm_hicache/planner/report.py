"""The capacity plan: a sweep of L2 and L3 sizes, the reuse-distance CDF,
the knee, and what each size costs and saves. Pure module.

Sizes are GB (1e9 bytes) of KV across the ranks that hold it (what you pay
for); ``hicache_size`` is per rank, so it is the L2 size divided by the
ranks. With a sampled log (rate r) every tier is simulated at r times its
size, and tokens saved are divided by r to stand for the whole traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_hicache.planner.l1 import l1_pass
from vllm_hicache.planner.log_format import AccessLog, Admit, LogHeader
from vllm_hicache.planner.model import ReplayConfig, ReplayResult
from vllm_hicache.planner.replay import replay
from vllm_hicache.planner.reuse import ReuseProfile, knee, reuse_profile
from vllm_hicache.planner.rules import (
    RulePoint,
    format_rules,
    rule_grid,
    served_rules,
    sweep_rules,
)
from vllm_hicache.policy.prefetch import PrefetchPolicyName
from vllm_hicache.policy.write import WritePolicyName

GB = 1e9
SECONDS_PER_MONTH = 730 * 3600
# StorageConfig's default prefetch_threshold, for a log served without L3:
# "auto", logged as 0; the replay has no cost model and fetches any hit.
DEFAULT_THRESHOLD_TOKENS = 0
# A shorter log gives no monthly figures: its rate says too little.
MIN_PRICED_SECONDS = 60.0


@dataclass(frozen=True)
class CostModel:
    """Prices, all assumptions (override them with the CLI's options)."""

    # Host DRAM for L2, $ per GB-month (cloud memory, about $0.004/GB-hour).
    mem_usd_gb_month: float = 3.0
    # L3 storage, $ per GB-month (NVMe / SSD-backed block or file storage).
    storage_usd_gb_month: float = 0.10
    # One GPU, $ per hour (on-demand H100-class).
    gpu_usd_hour: float = 2.5
    # Prefill throughput of one GPU, tokens per second (an 8B model: ~10k).
    prefill_tokens_per_s: float = 10_000.0

    def describe(self) -> str:
        return (f"memory ${self.mem_usd_gb_month:g}/GB-month, storage "
                f"${self.storage_usd_gb_month:g}/GB-month, GPU ${self.gpu_usd_hour:g}/hour "
                f"at {self.prefill_tokens_per_s:g} prefill tokens/s")


@dataclass
class SweepPoint:
    l2_gb: float
    # None: unlimited.
    l3_gb: float | None
    result: ReplayResult
    # Monthly: GPU time the saved prefill is worth, and the capacity's price.
    value_usd: float | None = None
    cost_usd: float = 0.0

    @property
    def net_usd(self) -> float | None:
        return None if self.value_usd is None else self.value_usd - self.cost_usd


@dataclass
class Plan:
    header: LogHeader
    # Distinct requests (a request admitted again after a preemption is
    # replayed, and counted in the hit rates, once per admission).
    num_requests: int
    duration_s: float
    num_dropped: int
    # What the server measured (the log's own hit tokens).
    measured: ReplayResult
    # The replay at the served sizes.
    served: SweepPoint
    sweep: list[SweepPoint]
    profile: ReuseProfile
    knee_gb: float | None
    prefetch_waits: bool
    notes: list[str] = field(default_factory=list)
    # Admission rules and L3 modes replayed at the served sizes (rules.py).
    rules: list[RulePoint] = field(default_factory=list)


class Sizing:
    """GB <-> simulated blocks, with the log's sampling rate."""

    def __init__(self, header: LogHeader) -> None:
        self.header = header
        self.rate = header.sample
        self.l2_block_bytes = max(1, header.block_bytes)
        self.l3_block_bytes = max(1, header.l3_block_bytes or header.block_bytes)

    def l2_pages(self, gb: float) -> int:
        """Simulated pages per rank for ``gb`` of L2 across ranks."""
        return _whole(gb * GB / self.l2_block_bytes * self.rate)

    def l3_objects(self, gb: float | None) -> int | None:
        if gb is None:
            return None
        return _whole(gb * GB / self.l3_block_bytes * self.rate)

    def l2_gb(self, blocks: float) -> float:
        """GB of ``blocks`` simulated (sample) blocks, at full scale."""
        return blocks / self.rate * self.l2_block_bytes / GB

    def l1_blocks(self) -> int:
        """Simulated L1 blocks: vLLM's, less its null block."""
        return max(1, round((self.header.l1_blocks - 1) * self.rate))


def _whole(blocks: float) -> int:
    """Whole blocks, not one less for a GB figure that lost a bit on the way."""
    return int(blocks + 1e-6)


def measured(log: AccessLog) -> ReplayResult:
    res = ReplayResult()
    for rec in log.records:
        if isinstance(rec, Admit):
            res.requests += 1
            res.prompt_tokens += rec.prompt_tokens
            res.l1_tokens += rec.l1_tokens
            res.l2_tokens += rec.l2_tokens
            res.l3_tokens += rec.l3_tokens
            res.declined_tokens += rec.declined_tokens
            res.per_request.append((rec.l1_tokens, rec.l2_tokens, rec.l3_tokens))
    return res


def served_sizes(header: LogHeader) -> tuple[float, float | None]:
    """(L2 GB, L3 GB or None = unlimited) the server ran with; L3 0 = none."""
    l2 = header.l2_pages * header.block_bytes / GB
    if not header.l3_backend:
        return l2, 0.0
    return l2, (header.l3_capacity_bytes / GB if header.l3_capacity_bytes else None)


def default_grid(header: LogHeader,
                 profile: ReuseProfile) -> tuple[list[float], list[float | None]]:
    """L2 sizes around the log's footprint; L3 from none to unlimited."""
    sizing = Sizing(header)
    footprint = sizing.l2_gb(max(1, profile.distinct_blocks))
    served_l2, served_l3 = served_sizes(header)
    l2 = sorted({_round(footprint * f) for f in (1 / 16, 1 / 4, 1)} | {_round(served_l2)})
    l3: set[float] = {0.0} | {_round(footprint * f) for f in (1 / 4, 1 / 2, 1)}
    if served_l3:
        l3.add(_round(served_l3))
    return l2, [*sorted(l3), None]


def _round(gb: float) -> float:
    """Three significant digits: grid sizes read as typed."""
    return float(f"{gb:.3g}") if gb > 0 else 0.0


def build_plan(log: AccessLog, cost: CostModel, l2_gb: list[float] | None = None,
               l3_gb: list[float | None] | None = None,
               prefetch_waits: bool | None = None,
               rules: tuple[list[str] | None, list[str] | None, list[str] | None] = (
                   None, None, None)) -> Plan:
    """``rules``: the L2 rules, L3 rules and L3 modes to compare (None:
    rules.rule_grid's defaults)."""
    header = log.header
    sizing = Sizing(header)
    admits = [r for r in log.records if isinstance(r, Admit)]
    duration_s = (admits[-1].t_ms - admits[0].t_ms) / 1000 if len(admits) > 1 else 0.0
    if prefetch_waits is None:
        prefetch_waits = header.l3_prefetch_policy != PrefetchPolicyName.BEST_EFFORT
    profile = reuse_profile(log.records, header.block_size)
    default_l2, default_l3 = default_grid(header, profile)
    steps = l1_pass(log.records, sizing.l1_blocks(), header.block_size,
                    keep_evicted=header.write_policy == WritePolicyName.WRITE_BACK)

    def point(l2: float, l3: float | None) -> SweepPoint:
        cfg = _config(header, sizing, l2, l3, prefetch_waits)
        return _priced(SweepPoint(l2, l3, replay(steps, cfg)), sizing, duration_s, cost)

    served = point(*served_sizes(header))
    sweep = [point(a, b) for a in (default_l2 if l2_gb is None else l2_gb)
             for b in (default_l3 if l3_gb is None else l3_gb)]
    knee_blocks = knee(profile)
    knee_gb = sizing.l2_gb(knee_blocks) if knee_blocks else None
    plan = Plan(header, len({a.seq for a in admits}), duration_s, log.num_dropped,
                measured(log), served, sweep, profile, knee_gb, prefetch_waits)
    served_cfg = _config(header, sizing, *served_sizes(header), prefetch_waits)
    plan.rules = sweep_rules(steps, served_cfg, rule_grid(header, *rules), header, sizing.rate)
    plan.notes += _notes(log, plan)
    return plan


def _config(header: LogHeader, sizing: Sizing, l2: float, l3: float | None,
            prefetch_waits: bool) -> ReplayConfig:
    threshold = header.l3_threshold_tokens if header.l3_backend else DEFAULT_THRESHOLD_TOKENS
    served = served_rules(header)
    return ReplayConfig(
        block_size=header.block_size, l1_blocks=sizing.l1_blocks(),
        l2_pages=sizing.l2_pages(l2), l3_objects=sizing.l3_objects(l3),
        eviction_policy=header.eviction_policy, write_policy=header.write_policy,
        l3_threshold_blocks=max(1, -(-threshold // header.block_size)),
        prefetch_waits=prefetch_waits, l2_admission=served.l2, l3_admission=served.l3,
        l3_mode=served.mode,
    )


def _priced(p: SweepPoint, sizing: Sizing, duration_s: float, cost: CostModel) -> SweepPoint:
    l3_gb = p.l3_gb
    if l3_gb is None:  # unlimited: pay for what it held
        l3_gb = p.result.l3_peak_objects / sizing.rate * sizing.l3_block_bytes / GB
    p.cost_usd = p.l2_gb * cost.mem_usd_gb_month + l3_gb * cost.storage_usd_gb_month
    if duration_s >= MIN_PRICED_SECONDS:
        saved_per_s = p.result.saved_tokens / sizing.rate / duration_s
        gpu_s = saved_per_s * SECONDS_PER_MONTH / cost.prefill_tokens_per_s
        p.value_usd = gpu_s / 3600 * cost.gpu_usd_hour
    return p


def _notes(log: AccessLog, plan: Plan) -> list[str]:
    notes = []
    if log.num_dropped:
        notes.append(f"the server dropped {log.num_dropped} records (its writer fell "
                     "behind): the replay misses their requests")
    if log.truncated_files:
        notes.append(f"cut short (last frame lost): {', '.join(log.truncated_files)}")
    if log.num_writers > 1:
        notes.append(f"{log.num_writers} server starts in these files: replayed as one "
                     "stream, in the order given")
    if plan.header.sample < 1:
        notes.append(f"sampled log (rate {plan.header.sample:g}): tiers simulated at "
                     f"{plan.header.sample:g} x their size, savings scaled by 1/rate")
    if not plan.prefetch_waits:
        notes.append("best_effort: a request gets only the prefetches that landed before it "
                     "was admitted (--prefetch wait: as if every request waited for its own)")
    return notes


# --- text ---------------------------------------------------------------------------


def _gb(gb: float | None) -> str:
    if gb is None:
        return "unlim"
    return f"{gb:.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}"


def _usd(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _tiers(res: ReplayResult) -> str:
    return (f"hit {100 * res.hit_rate:.1f}% (L1 {100 * res.rate(res.l1_tokens):.1f}%, "
            f"L2 {100 * res.rate(res.l2_tokens):.1f}%, L3 {100 * res.rate(res.l3_tokens):.1f}%)")


def format_report(plan: Plan, cost: CostModel) -> str:
    lines = [*_head_lines(plan), "", *_table_lines(plan), "", *_cdf_lines(plan), "",
             *_cost_lines(plan, cost)]
    if plan.rules:
        lines += ["", *format_rules(plan.rules)]
    if plan.notes:
        lines += ["", *(f"note: {n}" for n in plan.notes)]
    return "\n".join(lines)


def _head_lines(plan: Plan) -> list[str]:
    h = plan.header
    served_l2, served_l3 = served_sizes(h)
    l1_gb = _gb(h.l1_blocks * h.block_bytes / GB)
    l3 = "off"
    if h.l3_backend:
        size = "unlimited" if served_l3 is None else f"{_gb(served_l3)} GB"
        l3 = f"{h.l3_backend} {size}, prefetch {h.l3_prefetch_policy}"
    delta = 100 * (plan.served.result.hit_rate - plan.measured.hit_rate)
    return [
        (f"HiCache capacity plan: {plan.num_requests} requests over {plan.duration_s:.0f} s, "
         f"{plan.measured.prompt_tokens} prompt tokens (sample {h.sample:g})"),
        (f"KV: {h.block_size} tokens/block, {h.block_bytes} B/block across {h.ranks} rank(s); "
         f"L1 {h.l1_blocks} blocks = {l1_gb} GB (fixed); eviction {h.eviction_policy}, "
         f"write {h.write_policy}"),
        f"served: L2 {_gb(served_l2)} GB, L3 {l3}",
        f"  measured by the server: {_tiers(plan.measured)}",
        f"  replay of those sizes:  {_tiers(plan.served.result)}  ({delta:+.1f} points)",
        *_declined_lines(plan.measured),
    ]


def _declined_lines(measured: ReplayResult) -> list[str]:
    """What the server's load gate recomputed though HiCache held it: part
    of any gap between the replay (which has no gate) and the measurement."""
    if not measured.declined_tokens:
        return []
    return [f"  declined by the server's load gate (held, recomputed): "
            f"{100 * measured.rate(measured.declined_tokens):.1f}% of prompt tokens, "
            f"counted as hits by the replay"]


def _table_lines(plan: Plan) -> list[str]:
    lines = [
        ("Hit rate and prefill saved by capacity (saved = tokens L2 + L3 supplied; $/month "
         "extrapolates the log's rate)"),
        (f"{'L2 GB':>8} {'L3 GB':>8} {'hit%':>6} {'L1%':>6} {'L2%':>6} {'L3%':>6} "
         f"{'saved tok':>10} {'value $':>9} {'cost $':>8} {'net $':>9}"),
    ]
    for p in plan.sweep:
        r = p.result
        lines.append(
            f"{_gb(p.l2_gb):>8} {_gb(p.l3_gb):>8} {_pct(r.hit_rate):>6} "
            f"{_pct(r.rate(r.l1_tokens)):>6} {_pct(r.rate(r.l2_tokens)):>6} "
            f"{_pct(r.rate(r.l3_tokens)):>6} {r.saved_tokens:>10} {_usd(p.value_usd):>9} "
            f"{_usd(p.cost_usd):>8} {_usd(p.net_usd):>9}")
    return lines


def _cdf_lines(plan: Plan) -> list[str]:
    profile = plan.profile
    sizing = Sizing(plan.header)
    if not profile.histogram:
        return ["Reuse distance: no prefix was ever reused in this log."]
    lines = [("Reuse-distance CDF (GB of distinct prefix KV used between two uses of a "
              "block = hit rate of one ideal LRU cache of that size)")]
    cdf = profile.cdf()
    top = profile.max_hit_rate
    for q in (0.5, 0.9, 0.99):
        blocks = next(c for c, rate in cdf if rate >= q * top)
        lines.append(f"  {100 * q:.0f}% of reused tokens come back within "
                     f"{_gb(sizing.l2_gb(blocks))} GB")
    lines.append(f"  every reuse hits at {_gb(sizing.l2_gb(cdf[-1][0]))} GB: "
                 f"{100 * top:.1f}% of prompt tokens (the rest are first uses)")
    if plan.knee_gb is not None:
        at = profile.hit_rate(plan.knee_gb * GB / sizing.l2_block_bytes * sizing.rate)
        lines.append(f"Knee: beyond {_gb(plan.knee_gb)} GB, +10% capacity buys < 1% hit "
                     f"rate ({100 * at:.1f}% there, {100 * top:.1f}% at most)")
    return lines


def _cost_lines(plan: Plan, cost: CostModel) -> list[str]:
    lines = [f"Cost model (assumptions; see --help to change): {cost.describe()}"]
    priced = [p for p in plan.sweep if p.net_usd is not None]
    if not priced:
        return lines + [f"  the log spans under {MIN_PRICED_SECONDS:g} s: no monthly figures"]
    best = max(priced, key=lambda p: (p.net_usd, -p.cost_usd))
    lines.append(
        f"Best value: L2 {_gb(best.l2_gb)} GB + L3 {_gb(best.l3_gb)} GB saves "
        f"${_usd(best.value_usd)}/month of GPU time for ${_usd(best.cost_usd)}/month of "
        f"capacity (net ${_usd(best.net_usd)})")
    return lines

