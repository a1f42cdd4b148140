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
from dataclasses import dataclass

# --- the series ----------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    name: str                 # Prometheus: "vllm:hicache_" + name (+ "_total" for counters)
    kind: str                 # "counter" | "gauge"
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
               "lookup or prefetch at its deadline); backpressure (too many lookups queued: "
               "the request was not looked up in L3)."),
    MetricSpec("l3_errors", "counter", ("kind",),
               "L3 failures: lookup, read (a prefetch raised), write (a backup raised), "
               "invalid_object (an object did not verify: corrupt or foreign); read, write "
               "and invalid_object summed over TP ranks."),
    MetricSpec("store_skipped_blocks", "counter", ("tier", "reason"),
               "Blocks not stored: L2 pinned (no unpinned page to evict), L2 request_limit "
               "(beyond the request's max_offload_tokens), L3 rejected (the backend refused "
               "the write: full, or an error), L3 present (L3 already had the object), L3 "
               "backlog (a deferred backup dropped from the full backlog as the least likely "
               "to be reused), L3 evicted (a deferred backup whose page left L2 first). L3 "
               "rejected and present count objects, summed over TP ranks (each rank writes "
               "its own)."),
    MetricSpec("backup_deferred_blocks", "counter", ("event",),
               "L2 -> L3 backups over the in-flight bound: deferred (queued in the backlog "
               "instead of written now), flushed (written later, once L3 caught up)."),
    MetricSpec("load_decisions", "counter", ("tier", "decision"),
               "Prompt tokens of hits by what hicache_load_decision did with them: L2 loaded "
               "or declined (vLLM recomputed them: loading was expected to be slower); L3 "
               "loaded (the request waited for its prefetch) or declined (it computed them "
               "instead; the prefetch still ran, for later requests)."),
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
    MetricSpec("backup_backlog_blocks", "gauge", (),
               "Deferred L2 -> L3 backups waiting in the backlog."),
    MetricSpec("estimated_bandwidth_bytes_per_second", "gauge", ("tier",),
               "hicache_load_decision=auto: the bandwidth one rank is expected to load a hit "
               "at: L2 (L2 -> L1) or L3 (L3 -> L2); absent until measured."),
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
    # Blocks copied L1 -> L2 (write-through and write-back).
    stored_blocks: int = 0
    # Blocks not stored because no page could be freed (all pinned).
    store_skipped_blocks: int = 0
    # Blocks not stored because of the request's max_offload_tokens.
    store_limited_blocks: int = 0
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
            key("store_skipped_blocks", "L2", "pinned"): self.store_skipped_blocks,
            key("store_skipped_blocks", "L2", "request_limit"): self.store_limited_blocks,
            key("l2_evicted_pages"): self.evicted_pages,
            key("load_failed_blocks"): self.load_error_blocks,
            key("request_param_errors"): self.request_param_errors,
        }


# L3Planner attribute -> sample (read with getattr: the planner keeps them).
_PLANNER_SAMPLES = {
    "prefetch_started": key("prefetches", "started"),
    "prefetch_revoked": key("prefetches", "revoked"),
    "prefetch_incomplete": key("prefetches", "incomplete"),
    "prefetch_timed_out": key("prefetches", "timed_out"),
    "skipped_lookups": key("prefetches", "backpressure"),
    "lookup_errors": key("l3_errors", "lookup"),
    "backup_deferred": key("backup_deferred_blocks", "deferred"),
    "backup_flushed": key("backup_deferred_blocks", "flushed"),
    "backup_dropped": key("store_skipped_blocks", "L3", "backlog"),
    "backup_evicted": key("store_skipped_blocks", "L3", "evicted"),
}


def planner_samples(planner) -> dict[str, float]:
    return {sample: getattr(planner, attr, 0) for attr, sample in _PLANNER_SAMPLES.items()}


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


def l3_usage_gauges(backend) -> dict[str, float]:
    """L3 occupancy, where the backend keeps count: the ``file`` backend
    with ``max_bytes`` (its shared usage counter, as of this process's last
    write). Others: nothing (no series)."""
    capacity = getattr(getattr(backend, "config", None), "max_bytes", 0)
    if not isinstance(capacity, int) or capacity <= 0:
        return {}
    used = backend.stats().get("usage_bytes")
    if used is None:
        return {}
    return {key("l3_used_bytes"): used, key("l3_capacity_bytes"): capacity}
