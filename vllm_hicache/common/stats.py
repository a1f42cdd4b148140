"""HiCache's counters, and the metrics they become (connector/metrics.py).

Where each number is counted, and how it reaches vLLM:

- ``HiCacheStats``: the scheduler half's counters since engine start (hits,
  stores, evictions, L2 occupancy...), plus the L3 planner's own (prefetches,
  lookups). ``SchedulerReport`` turns them into what changed since its last
  report, for ``get_kv_connector_stats`` on the scheduler, which vLLM polls
  once per step in the EngineCore (``Scheduler.update_from_output``).
- ``WorkerCounters``: what one worker (TP rank) moved since its last report
  (bytes and seconds per copy kind, L3 errors and skipped writes), filled by
  the forward's thread and the L3 threads; ``get_kv_connector_stats`` on the
  worker takes them once per step (``KVConnectorModelRunnerMixin``). vLLM
  sums the ranks' reports (``KVOutputAggregator``), adds the scheduler's, and
  hands the result to the API server's loggers (log line and Prometheus).

Every series is named in ``METRICS`` (Prometheus: ``vllm:hicache_<name>``);
a sample is keyed ``name`` or ``name.label_value[.label_value]``. Pure
module: torch is imported only to time CUDA copies.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# --- the series ----------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    name: str                 # Prometheus: "vllm:hicache_" + name (+ "_total" for counters)
    kind: str                 # "counter" | "gauge" | "histogram" (of seconds)
    labels: tuple[str, ...]
    doc: str


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("hit_tokens", "counter", ("tier",),
               "Prompt tokens HiCache loaded into vLLM's KV cache beyond vLLM's own prefix-cache "
               "hit, by the tier that supplied them: L2 (host memory), or L3 (read from storage "
               "by this request's prefetch)."),
    MetricSpec("transfer_bytes", "counter", ("op",),
               "KV bytes HiCache copied, summed over TP ranks: load (L2->L1), store (L1->L2), "
               "prefetch (L3->L2), backup (L2->L3; objects L3 already had are not written)."),
    MetricSpec("transfer_seconds", "counter", ("op",),
               "Seconds the copies of transfer_bytes took, summed over TP ranks "
               "(transfer_bytes / transfer_seconds: the bandwidth of one rank)."),
    MetricSpec("prefetches", "counter", ("event",),
               "L3 prefetches: started; revoked (L3 had enough blocks but no host pages could "
               "be had: in-flight cap or all pinned); incomplete (ended short: an object was "
               "missing, invalid or unreadable); timed_out (a request stopped waiting for its "
               "lookup or prefetch at its deadline); recompute_cheaper (prefetch_threshold="
               "auto: the cost model expected vLLM to compute the hit sooner); backpressure "
               "(too many lookups queued: the request was not looked up in L3); breaker (the "
               "L3 circuit breaker was not closed: the request was not looked up in L3); same_step "
               "(same_step_read_wait_ms: the request was admitted in the step its read was "
               "sent, its L1 copy waiting for the read; blocks not read in time are in "
               "load_failed_blocks)."),
    MetricSpec("l3_errors", "counter", ("kind",),
               "L3 failures: lookup, read (a prefetch raised), write (a backup raised), "
               "invalid_object (an object did not verify: corrupt or foreign); read, write "
               "and invalid_object summed over TP ranks."),
    MetricSpec("l3_removed_blocks", "counter", ("kind",),
               "L3 removals known exactly (file max_bytes evictions, Redis keyspace "
               "notifications): announced (blocks announced as BlockRemoved for STORAGE), "
               "unmapped (objects of this engine whose block could not be named: keyed by a "
               "storage secret and not recently written or read here)."),
    MetricSpec("store_skipped_blocks", "counter", ("tier", "reason"),
               "Blocks not stored: L2 pinned (no unpinned page to evict), L2 request_limit "
               "(beyond the request's max_offload_tokens), L3 rejected (the backend refused "
               "the write: full, or an error), L3 present (L3 already had the object), L3 "
               "backlog (a deferred backup dropped from the full backlog as the least likely "
               "to be reused), L3 evicted (a deferred backup whose page left L2 first), L3 "
               "breaker (not backed up, or dropped from the backlog, while the L3 circuit "
               "breaker was not closed), L3 write_budget / daily_budget (over "
               "l3_write_budget_bytes_per_s or _per_day: skipped, least valuable first). L3 "
               "rejected and present count objects, summed over TP ranks (each rank writes "
               "its own)."),
    MetricSpec("admission_declined_blocks", "counter", ("tier", "rule"),
               "Blocks a boundary's admission rule kept out of a tier, by the rule's kind "
               "(hits, value): L2 (hicache_l2_admission, or write_through_selective: computed "
               "blocks not stored), L3 (hicache_l3_admission; inclusive mode: blocks L2 stored "
               "that were not backed up then; exclusive mode: blocks L2 evicted unwritten)."),
    MetricSpec("l3_admitted_late_blocks", "counter", (),
               "Inclusive L3 mode: blocks hicache_l3_admission declined when L2 stored them "
               "that a later hit made it admit (backed up the next step if their page is "
               "still in L2)."),
    MetricSpec("l3_exclusive_blocks", "counter", ("event",),
               "Exclusive L3 mode: victim_written (held blocks written to L3 as L2 needed "
               "their room, or at a graceful stop; after the write budget), promoted (blocks "
               "an L3 prefetch brought into L2; they stay in L3, where another instance "
               "sharing the store may need them, so none leaves it)."),
    MetricSpec("l3_write_budget_bytes", "counter", ("outcome",),
               "L2 -> L3 backups under l3_write_budget_*, in L3 bytes (all ranks' objects): "
               "written (backups opened within the budget), write_budget / daily_budget "
               "(blocks that limit skipped: store_skipped_blocks{tier=\"L3\"} in bytes)."),
    MetricSpec("backup_deferred_blocks", "counter", ("event",),
               "L2 -> L3 backups over the in-flight bound: deferred (queued in the backlog "
               "instead of written now), flushed (written later, once L3 caught up)."),
    MetricSpec("load_decisions", "counter", ("tier", "decision"),
               "Prompt tokens of hits by what hicache_load_decision did with them: L2 loaded "
               "or declined (vLLM recomputed them: loading was expected to be slower); node "
               "likewise, for node-tier hits loaded into vLLM's cache directly; L3 "
               "loaded (the request waited for its prefetch) or declined (it computed them "
               "instead; the prefetch still ran, for later requests)."),
    MetricSpec("l3_breaker_trips", "counter", (),
               "Times the L3 circuit breaker tripped: the store failed its health checks "
               "(errors, or answers over l3_breaker_latency_budget_ms) for "
               "l3_breaker_window_s, and HiCache stopped using it."),
    MetricSpec("l2_evicted_pages", "counter", (), "L2 pages evicted to make room."),
    MetricSpec("load_failed_blocks", "counter", (),
               "Blocks whose load from L2 failed on some rank (vLLM recomputed them)."),
    MetricSpec("request_param_errors", "counter", (),
               "Requests whose kv_transfer_params HiCache rejected (served without HiCache)."),
    MetricSpec("kv_events_dropped", "counter", (),
               "KV cache events dropped because their bounded queue was full."),
    MetricSpec("l2_pages_used", "gauge", (),
               "L2 pages holding KV (indexed, or being filled by a prefetch)."),
    MetricSpec("l2_pages_pinned", "gauge", (), "L2 pages pinned by an operation in flight."),
    MetricSpec("l2_pages_total", "gauge", (), "L2 pages per rank."),
    MetricSpec("l3_used_bytes", "gauge", (),
               "Bytes the L3 store holds, where the backend knows (file with max_bytes)."),
    MetricSpec("l3_capacity_bytes", "gauge", (),
               "L3 capacity in bytes, where the backend has one (file with max_bytes)."),
    MetricSpec("l3_breaker_state", "gauge", (),
               "The L3 circuit breaker: 0 closed (L3 in use; also with the breaker off), 1 "
               "tripped (L3 not used: served from L1/L2, backups skipped), 2 probing (not "
               "used; a health check decides whether to resume)."),
    MetricSpec("node_tier_used_bytes", "gauge", (),
               "Bytes of sealed pages in the node tier (shared by every instance on the "
               "machine: the same value on each)."),
    MetricSpec("node_tier_capacity_bytes", "gauge", (), "The node tier's size (node_tier_bytes)."),
    MetricSpec("node_tier_hit_tokens", "counter", (),
               "Of hit_tokens{tier=\"L3\"}, the tokens this instance's L3 lookup found in the "
               "node tier (the machine's shared host memory), not in the remote store behind it "
               "(L3 minus these: the remote store's)."),
    MetricSpec("node_tier_stored_pages", "counter", (),
               "Pages this instance's backups sealed into the node tier (pages the tier had "
               "already are not counted; the L3 health check's probes are), summed over TP "
               "ranks."),
    MetricSpec("node_tier_promoted_pages", "counter", (),
               "Pages this instance read from the remote store and sealed into the node tier, "
               "so that the machine's next lookup finds them there; summed over TP ranks."),
    MetricSpec("node_tier_evicted_pages", "counter", (),
               "Node tier pages evicted to make room for this instance's stores, summed over "
               "TP ranks: summed over the machine's instances, the tier's evictions (each "
               "counted once)."),
    MetricSpec("node_tier_direct_loaded_pages", "counter", (),
               "Pages loaded from the node tier straight into vLLM's cache (no private L2 "
               "page in between), summed over TP ranks; a node-tier hit staged through L2 "
               "instead is not counted."),
    MetricSpec("node_tier_members", "gauge", (),
               "Processes joined to the node tier (each instance's scheduler and workers)."),
    MetricSpec("backup_backlog_blocks", "gauge", (),
               "Deferred L2 -> L3 backups waiting in the backlog."),
    MetricSpec("l3_backups_rescued", "counter", (),
               "L2 -> L3 backup jobs started at the engine's CPU priority because no "
               "background thread (below it) had started them 0.1 s after they were queued: "
               "the core the worker's I/O runs on was that busy; summed over TP ranks."),
    MetricSpec("estimated_bandwidth_bytes_per_second", "gauge", ("tier",),
               "hicache_load_decision=auto: the bandwidth one rank is expected to load a hit "
               "at: L2 (L2 -> L1) or L3 (L3 -> L2); absent until measured."),
    MetricSpec("l3_hit_stage_seconds", "histogram", ("stage",),
               "Where the wait of a request whose hit its own L3 prefetch brought in went, per "
               "request and stage: lookup, lookup_seen (the answer waiting for the next step), "
               "queue (for an L3 thread), io (backend reads), seal_check (opening the objects), "
               "step_wait (the job's trip to the workers and the report's back), l2_insert, "
               "load_wait (for the request to be scheduled), load (L2 -> L1). All but load sum "
               "to the request's wait from its lookup to its admission (l3/hit_stages.py)."),
    MetricSpec("l3_same_step_wait_seconds", "counter", (),
               "same_step_read_wait_ms: seconds the forward waited for the reads of the L3 "
               "hits admitted in its step (before its copies; on CPU layer by layer, and for "
               "the pages' checks before its stores), summed over TP ranks (per hit: "
               "divided by prefetches{event=\"same_step\"}); the compute core idles meanwhile."),
    MetricSpec("l3_reads_by_layer", "counter", (),
               "same_step_read_wait_ms on CPU: L3 reads delivered layer by layer (the store "
               "reads byte ranges, the layout's payload is layer-major, no encryption), each "
               "layer's L1 copy waiting for that layer only; summed over TP ranks."),
    MetricSpec("estimated_prefill_tokens_per_second", "gauge", (),
               "hicache_load_decision=auto: the engine's prefill rate, as its prefill model "
               "predicts it for a 1024-token prompt; absent until measured."),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}

TRANSFER_OPS = ("load", "store", "prefetch", "backup")


def key(name: str, *label_values: str) -> str:
    """The sample key of series ``name`` with these label values."""
    assert len(label_values) == len(METRIC_BY_NAME[name].labels), (name, label_values)
    return ".".join((name, *label_values))


def split_key(sample_key: str) -> tuple[MetricSpec, tuple[str, ...]]:
    name, *values = sample_key.split(".")
    spec = METRIC_BY_NAME[name]
    if len(values) != len(spec.labels):
        raise ValueError(f"sample {sample_key!r} has {len(values)} label values, "
                         f"{spec.name} has labels {spec.labels}")
    return spec, tuple(values)


# --- scheduler half ----------------------------------------------------------------


@dataclass(slots=True)
class HiCacheStats:
    """Counters of the scheduler half, in blocks (pages) or tokens, since engine start."""

    # Blocks loaded L2 -> L1 (hits beyond vLLM's own prefix cache).
    loaded_blocks: int = 0
    # Requests that got at least one L2 block.
    load_requests: int = 0
    # Tokens of those loads from pages that were in L2 / that this request's
    # own L3 prefetch brought in.
    hit_tokens_l2: int = 0
    hit_tokens_l3: int = 0
    # Of hit_tokens_l3, those the request's lookup found in the node tier.
    hit_tokens_node: int = 0
    # Blocks copied L1 -> L2 (write-through and write-back).
    stored_blocks: int = 0
    # Blocks not stored because no page could be freed (all pinned).
    store_skipped_blocks: int = 0
    # Blocks not stored because of the request's max_offload_tokens.
    store_limited_blocks: int = 0
    # Blocks the L1 -> L2 admission rule did not store, by the rule's kind.
    store_declined_blocks: dict[str, int] = field(default_factory=dict)
    # L2 pages evicted to make room.
    evicted_pages: int = 0
    # Blocks the workers reported as failed loads (vLLM recomputes them).
    load_error_blocks: int = 0
    # Pages taken out of the index because a copy into or out of them failed.
    invalidated_pages: int = 0
    # Requests whose kv_transfer_params were rejected.
    request_param_errors: int = 0

    def record_load(self, num_blocks: int) -> None:
        self.loaded_blocks += num_blocks
        self.load_requests += 1

    def record_hit_tokens(self, l2_tokens: int, l3_tokens: int) -> None:
        self.hit_tokens_l2 += l2_tokens
        self.hit_tokens_l3 += l3_tokens

    def record_store(self, num_blocks: int) -> None:
        self.stored_blocks += num_blocks

    def record_store_skipped(self, num_blocks: int) -> None:
        self.store_skipped_blocks += num_blocks

    def record_store_limited(self, num_blocks: int) -> None:
        self.store_limited_blocks += num_blocks

    def record_store_declined(self, rule_kind: str, num_blocks: int) -> None:
        if num_blocks:
            declined = self.store_declined_blocks
            declined[rule_kind] = declined.get(rule_kind, 0) + num_blocks

    def record_evict(self, num_pages: int) -> None:
        self.evicted_pages += num_pages

    def record_load_errors(self, num_blocks: int) -> None:
        self.load_error_blocks += num_blocks

    def record_invalidated(self, num_pages: int) -> None:
        self.invalidated_pages += num_pages

    def record_param_error(self) -> None:
        self.request_param_errors += 1

    def as_samples(self) -> dict[str, float]:
        """Cumulative values, keyed by sample (the counters that are series)."""
        return {
            key("hit_tokens", "L2"): self.hit_tokens_l2,
            key("hit_tokens", "L3"): self.hit_tokens_l3,
            key("node_tier_hit_tokens"): self.hit_tokens_node,
            key("store_skipped_blocks", "L2", "pinned"): self.store_skipped_blocks,
            key("store_skipped_blocks", "L2", "request_limit"): self.store_limited_blocks,
            key("l2_evicted_pages"): self.evicted_pages,
            key("load_failed_blocks"): self.load_error_blocks,
            key("request_param_errors"): self.request_param_errors,
            **{key("admission_declined_blocks", "L2", kind): n
               for kind, n in self.store_declined_blocks.items()},
        }


# L3Planner attribute -> sample (read with getattr: the planner keeps them).
_PLANNER_SAMPLES = {
    "prefetch_started": key("prefetches", "started"),
    "prefetch_revoked": key("prefetches", "revoked"),
    "prefetch_incomplete": key("prefetches", "incomplete"),
    "prefetch_timed_out": key("prefetches", "timed_out"),
    "skipped_lookups": key("prefetches", "backpressure"),
    "prefetch_not_worth": key("prefetches", "recompute_cheaper"),
    "lookup_errors": key("l3_errors", "lookup"),
    "breaker_skipped_lookups": key("prefetches", "breaker"),
    "same_step_admitted": key("prefetches", "same_step"),
    "breaker_trips": key("l3_breaker_trips"),
    "budget_skipped_bandwidth": key("store_skipped_blocks", "L3", "write_budget"),
    "budget_skipped_day": key("store_skipped_blocks", "L3", "daily_budget"),
    "l3_removed_blocks": key("l3_removed_blocks", "announced"),
    "l3_removed_unmapped": key("l3_removed_blocks", "unmapped"),
}

# L3Backups attribute -> sample (read with getattr from ``planner.backups``,
# l3/backups.py: the planner's backups keep them).
_BACKUP_SAMPLES = {
    "backup_deferred": key("backup_deferred_blocks", "deferred"),
    "backup_flushed": key("backup_deferred_blocks", "flushed"),
    "backup_dropped": key("store_skipped_blocks", "L3", "backlog"),
    "backup_evicted": key("store_skipped_blocks", "L3", "evicted"),
    "breaker_skipped_blocks": key("store_skipped_blocks", "L3", "breaker"),
}


def planner_samples(planner) -> dict[str, float]:
    out = {sample: getattr(planner, attr, 0) for attr, sample in _PLANNER_SAMPLES.items()}
    backups = getattr(planner, "backups", None)
    out.update({sample: getattr(backups, attr, 0) for attr, sample in _BACKUP_SAMPLES.items()})
    # (The node tier's page counts come from common/node_counts.py's tallies.)
    out.update(tiering_samples(planner))
    return out


def tiering_samples(planner) -> dict[str, float]:
    """The L2 -> L3 boundary's admission, exclusive mode and write budget
    (l3/admission.py, l3/victims.py, l3/backup_budget.py), where the
    planner's backups (``planner.backups``, l3/backups.py) have them (a
    planner without backups, an admission or a budget: none)."""
    out: dict[str, float] = {}
    backups = getattr(planner, "backups", None)
    admission = getattr(backups, "admission", None)
    if admission is not None:
        out[key("admission_declined_blocks", "L3", str(admission.rule.kind))] = \
            admission.num_declined
        out[key("l3_admitted_late_blocks")] = admission.num_admitted_later
    if backups is not None and getattr(backups, "victims", None) is not None:
        out[key("l3_exclusive_blocks", "victim_written")] = backups.victim_written_blocks
        out[key("l3_exclusive_blocks", "promoted")] = planner.prefetched_blocks
    budget = getattr(backups, "budget", None)
    if budget is not None and budget.enabled:
        out[key("l3_write_budget_bytes", "written")] = budget.bucket.spent_bytes
        for reason, blocks in budget.skipped.items():
            out[key("l3_write_budget_bytes", reason)] = blocks * budget.block_bytes
    return out


class Deltas:
    """What cumulative counters gained since the last ``take``.

    A counter that went down was reset (its source was rebuilt, e.g. L3
    attached again): its whole value is new."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, current: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        last = self._last
        for k, v in current.items():
            d = v - last.get(k, 0)
            if d < 0:
                d = v
            if d:
                out[k] = d
            last[k] = v
        return out


class SchedulerReport:
    """The scheduler half's part of each step's stats: counter increments
    since the last report, and the gauges that changed."""

    def __init__(self) -> None:
        self._deltas = Deltas()
        self._planner = None
        self._planner_deltas = Deltas()
        self._last_gauges: dict[str, float] = {}

    def take(self, stats: HiCacheStats, planner, gauges: dict[str, float],
             extra: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, float]]:
        counters = self._deltas.take({**stats.as_samples(), **(extra or {})})
        if planner is not self._planner:
            self._planner, self._planner_deltas = planner, Deltas()
        if planner is not None:
            counters.update(self._planner_deltas.take(planner_samples(planner)))
        changed = {k: v for k, v in gauges.items() if self._last_gauges.get(k) != v}
        self._last_gauges.update(changed)
        return counters, changed


# --- worker half ---------------------------------------------------------------------


class WorkerCounters:
    """Increments since the last ``take``, from any thread of one worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # A plain dict, not a Counter: increments may be fractional (seconds).
        self._counts: dict[str, float] = {}

    def add(self, sample_key: str, value: float = 1) -> None:
        if value:
            with self._lock:
                self._counts[sample_key] = self._counts.get(sample_key, 0) + value

    def add_transfer(self, op: str, num_bytes: int, seconds: float | None) -> None:
        with self._lock:
            bytes_key = key("transfer_bytes", op)
            self._counts[bytes_key] = self._counts.get(bytes_key, 0) + num_bytes
            if seconds is not None:
                seconds_key = key("transfer_seconds", op)
                self._counts[seconds_key] = self._counts.get(seconds_key, 0) + seconds

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._counts = self._counts, {}
        return out


def overlap_blocks(span: tuple[int, int] | None, start: int, end: int) -> int:
    """How many blocks of [start, end) lie in ``span`` ([lo, hi); None: none)."""
    return 0 if span is None else max(0, min(end, span[1]) - max(start, span[0]))


def l3_usage_gauges(backend) -> dict[str, float]:
    """L3 occupancy, where the backend keeps count: the ``file`` backend
    with ``max_bytes`` (its shared usage counter, as of this process's last
    write), also behind a node tier; and the node tier's own. Others:
    nothing (no series)."""
    stats = backend.stats()
    out = {key(f"node_tier_{name}"): stats[f"node_tier_{stat}"]
           for name, stat in (("used_bytes", "occupancy_bytes"),
                              ("capacity_bytes", "capacity_bytes"), ("members", "members"))
           if f"node_tier_{stat}" in stats}
    # A node tier chains the remote store as ``remote`` (storage/node_chain.py).
    store = getattr(backend, "remote", backend) or backend
    capacity = getattr(getattr(store, "config", None), "max_bytes", 0)
    used = stats.get("usage_bytes")
    if isinstance(capacity, int) and capacity > 0 and used is not None:
        out.update({key("l3_used_bytes"): used, key("l3_capacity_bytes"): capacity})
    return out
