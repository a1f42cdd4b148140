"""HiCache's KVConnectorStats and Prometheus metrics, through vLLM's own
classes: the stats a real Scheduler step hands its front end
(``EngineCoreOutputs.scheduler_stats.kv_connector_stats``, with the worker's
stats in the step's KVConnectorOutput as vLLM's model runner puts them),
vLLM's ``KVConnectorLogging`` (the "KV Transfer metrics" line) and
``KVConnectorProm`` (which calls ``build_prom_metrics``) on a private
Prometheus registry."""

from __future__ import annotations

import functools

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)

from tests.connector.harness import BLOCK, make_harness
from tests.l3.test_planner import forget_l1_and_l2, l3_harness
from tests.scheduler.test_scheduler import prompt
from vllm_hicache.common.stats import METRICS, key
from vllm_hicache.connector.metrics import MAX_OBSERVATIONS, HiCacheKVConnectorStats
from vllm_hicache.l3.hit_stages import STAGES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LABELS = ["model_name", "engine"]


def kv_stats_sent(h) -> list[dict]:
    """The kv_connector_stats payloads the harness' steps sent the front end."""
    return [out.scheduler_stats.kv_connector_stats for out in h.engine_outputs
            if out.scheduler_stats is not None and out.scheduler_stats.kv_connector_stats]


def total(payloads: list[dict], sample: str) -> float:
    return sum(p["counters"].get(sample, 0) for p in payloads)


def prom(registry: CollectorRegistry) -> KVConnectorProm:
    """vLLM's KVConnectorProm, its metric classes bound to ``registry``."""
    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
        kv_role="kv_both"))
    return Prom(config, LABELS, {0: ["tiny", "0"], 1: ["tiny", "1"]})


# --- the stats object ---------------------------------------------------------


def test_aggregate_sums_counters_keeps_latest_gauges_and_reduces():
    rank0 = HiCacheKVConnectorStats.of(
        {key("transfer_bytes", "load"): 4e6, key("transfer_seconds", "load"): 0.002}, {})
    rank1 = HiCacheKVConnectorStats.of(
        {key("transfer_bytes", "load"): 4e6, key("transfer_seconds", "load"): 0.002,
         key("l3_errors", "write"): 1}, {})
    sched = HiCacheKVConnectorStats.of({key("hit_tokens", "L2"): 64},
                                       {key("l2_pages_used"): 10, key("l2_pages_total"): 100})
    later = HiCacheKVConnectorStats.of({key("hit_tokens", "L2"): 32}, {key("l2_pages_used"): 12})
    agg = rank0.aggregate(rank1).aggregate(sched).aggregate(later)
    assert agg.counters == {key("transfer_bytes", "load"): 8e6,
                            key("transfer_seconds", "load"): 0.004,
                            key("l3_errors", "write"): 1, key("hit_tokens", "L2"): 96}
    assert agg.gauges == {key("l2_pages_used"): 12, key("l2_pages_total"): 100}
    assert agg.reduce() == {"L2_hit_tokens": 96, "load_MB": 8.0, "load_GB/s": 2.0,
                            "l3_errors_write": 1, "l2_pages_used": 12, "l2_pages_total": 100}
    assert not agg.is_empty()
    agg.reset()
    assert agg.is_empty()
    assert HiCacheKVConnectorStats.of({}, {}) is None


def test_observations_join_bounded_and_reduce_to_a_mean():
    sample = key("l3_hit_stage_seconds", "io")
    a = HiCacheKVConnectorStats.of({}, {}, {sample: [0.001, 0.003]})
    b = HiCacheKVConnectorStats.of({}, {}, {sample: [0.002] * MAX_OBSERVATIONS})
    assert a is not None and b is not None
    agg = a.aggregate(b)
    assert len(agg.observations[sample]) == MAX_OBSERVATIONS
    assert agg.observations[sample][:3] == [0.001, 0.003, 0.002]
    assert agg.reduce() == {"l3_hit_stage_seconds_io_mean_ms": 2.0}
    agg.reset()
    assert agg.is_empty()


def test_every_series_has_a_unique_name_and_help():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert all(m.doc and m.kind in ("counter", "gauge", "histogram") for m in METRICS)


# --- the scheduler's and the workers' numbers, one real step at a time ----------


def test_steps_report_hits_bytes_and_occupancy_and_vllm_logs_them(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    tokens = prompt(40, 4 * BLOCK + 5)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens)
    h.run()
    h.step()
    payloads = kv_stats_sent(h)
    page_bytes = h.worker.worker.pool.bytes_per_page
    half = h.sched_half
    # Every counter is sent once, as increments.
    assert total(payloads, key("hit_tokens", "L2")) == 4 * BLOCK == half.stats.hit_tokens_l2
    assert total(payloads, key("hit_tokens", "L3")) == 0
    assert total(payloads, key("transfer_bytes", "store")) == 4 * page_bytes
    assert total(payloads, key("transfer_bytes", "load")) == 4 * page_bytes
    assert total(payloads, key("transfer_seconds", "load")) > 0
    assert total(payloads, key("transfer_seconds", "store")) > 0
    # Gauges only when they change; the latest is the tree's now.
    latest = {}
    for p in payloads:
        latest.update(p["gauges"])
    assert latest == {key("l2_pages_used"): 4, key("l2_pages_pinned"): 0,
                      key("l2_pages_total"): half.num_pages}

    lines = []
    logging = KVConnectorLogging(h.scheduler.vllm_config.kv_transfer_config)
    for p in payloads:
        logging.observe(p)
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: ")
    assert f"L2_hit_tokens={4 * BLOCK}" in lines[0]
    assert f"load_MB={round(4 * page_bytes / 1e6, 2)}" in lines[0]
    # The accumulator works on copies: the payloads were not changed.
    assert total(kv_stats_sent(h), key("hit_tokens", "L2")) == 4 * BLOCK


def test_prometheus_series_through_vllms_connector_prom(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    tokens = prompt(41, 3 * BLOCK + 2)
    h.add("a", tokens)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    h.kv_zero()
    h.add("b", tokens)
    h.run()
    h.step()
    registry = CollectorRegistry()
    metrics = prom(registry)
    for p in kv_stats_sent(h):
        metrics.observe(p, engine_idx=1)
    page_bytes = h.worker.worker.pool.bytes_per_page

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "1", **labels})

    assert value("vllm:hicache_hit_tokens_total", tier="L2") == 3 * BLOCK
    assert value("vllm:hicache_transfer_bytes_total", op="load") == 3 * page_bytes
    assert value("vllm:hicache_transfer_bytes_total", op="store") == 3 * page_bytes
    assert value("vllm:hicache_transfer_seconds_total", op="store") > 0
    assert value("vllm:hicache_l2_pages_used") == 3
    assert value("vllm:hicache_l2_pages_total") == h.sched_half.num_pages
    # Series appear when they move: no L3 here, so no L3 series at all.
    assert value("vllm:hicache_hit_tokens_total", tier="L3") is None
    assert value("vllm:hicache_transfer_bytes_total", op="backup") is None
    assert value("vllm:hicache_hit_tokens_total", tier="L2") is not None
    # Unknown samples (a newer worker) are skipped, never raised.
    metrics.observe({"counters": {"no_such_series": 1, "hit_tokens.L9.x": 1}, "gauges": {}})


def test_l3_series_and_hit_sources(tiny_model_dir):
    """The L3 half: backup bytes, prefetch bytes, and hits vLLM's per-source
    metric sees as DISK (get_external_cache_hit_sources)."""
    h, _store = l3_harness(tiny_model_dir)
    sources = []
    connector = h.scheduler.connector
    hit_sources = connector.get_external_cache_hit_sources

    def recorded(request, num_tokens):
        out = hit_sources(request, num_tokens)
        sources.append((request.request_id, out))
        return out

    connector.get_external_cache_hit_sources = recorded
    tokens = prompt(42, 5 * BLOCK + 3)
    h.add("a", tokens)
    h.run()
    h.step()  # the last acks
    forget_l1_and_l2(h)
    h.add("b", tokens)
    h.run()
    h.step()
    payloads = kv_stats_sent(h)
    page_bytes = h.worker.worker.pool.bytes_per_page
    assert total(payloads, key("transfer_bytes", "backup")) == 5 * page_bytes
    assert total(payloads, key("transfer_bytes", "prefetch")) == 5 * page_bytes
    assert total(payloads, key("prefetches", "started")) == 1
    assert total(payloads, key("hit_tokens", "L3")) == 5 * BLOCK
    assert total(payloads, key("hit_tokens", "L2")) == 0
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert sources == [("b", {CacheHitSource.DISK: 5 * BLOCK})]
    # Where b's wait went: one observation per stage, and Prometheus has them.
    observed: dict[str, list[float]] = {}
    for p in payloads:
        for sample, values in p.get("observations", {}).items():
            observed.setdefault(sample, []).extend(values)
    assert set(observed) == {key("l3_hit_stage_seconds", s) for s in STAGES}
    assert all(len(v) == 1 and v[0] >= 0 for v in observed.values())
    registry = CollectorRegistry()
    metrics = prom(registry)
    for p in payloads:
        metrics.observe(p)
    for stage in STAGES:
        assert registry.get_sample_value("vllm:hicache_l3_hit_stage_seconds_count", {
            "model_name": "tiny", "engine": "0", "stage": stage}) == 1


def test_copy_clock_times_cuda_copies_when_the_gpu_is_done(monkeypatch):
    """On CUDA a copy is only queued: bytes count at once, seconds when its
    end event has completed (events resolved in order, bounded)."""
    import torch

    from vllm_hicache.common.stats import WorkerCounters
    from vllm_hicache.datapath import clock as stats_mod
    from vllm_hicache.datapath.clock import CopyClock

    class TimedEvent:
        clock_ms = 0.0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None
            self.done = False

        def record(self, stream):
            self.at = TimedEvent.clock_ms

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", TimedEvent)
    counters = WorkerCounters()
    clock = CopyClock(counters)
    stream = object()
    started = clock.start(stream)
    TimedEvent.clock_ms = 4.0
    clock.stop(started, "store", 1000, stream)
    clock.collect()
    assert counters.take() == {key("transfer_bytes", "store"): 1000}  # queued, not done
    clock._pending[0][1].done = True
    clock.collect()
    assert counters.take() == {key("transfer_seconds", "store"): 0.004}
    monkeypatch.setattr(stats_mod, "MAX_PENDING_TIMINGS", 2)
    for _ in range(3):
        clock.stop(clock.start(stream), "load", 1, stream)
    assert len(clock._pending) == 2
    # CPU: wall time around a synchronous copy.
    clock.stop(clock.start(), "load", 8)
    assert counters.take()[key("transfer_bytes", "load")] == 3 + 8


def test_l3_admission_series_and_l1_hits_count_as_uses(tiny_model_dir):
    """hicache_l3_admission=hits:2 on vLLM's real scheduler: a's blocks are
    declined at L3 when stored (admission_declined_blocks); b's hit on them
    is served by vLLM's own prefix cache (L1), which HiCache still counts as
    a use, so they are admitted then and backed up (l3_admitted_late_blocks)."""
    store = "tiering-" + str(id(tiny_model_dir))
    h = make_harness(
        tiny_model_dir, hicache_l3_admission="hits:2",
        hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config={
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": store, "prefetch_threshold": BLOCK})
    tokens = prompt(43, 3 * BLOCK + 2)
    h.add("a", tokens)
    h.run()
    h.step()
    h.add("b", tokens)  # in L1 still: vLLM's prefix cache serves the 3 blocks
    h.run()
    h.step()
    h.step()  # the backup's acks
    assert h.first_computed["b"] == 3 * BLOCK  # vLLM's hit, not HiCache's
    registry = CollectorRegistry()
    metrics = prom(registry)
    for p in kv_stats_sent(h):
        metrics.observe(p)

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})

    assert value("vllm:hicache_admission_declined_blocks_total", tier="L3", rule="hits") >= 3
    assert value("vllm:hicache_l3_admitted_late_blocks_total") == 3
    assert value("vllm:hicache_transfer_bytes_total", op="backup") == \
        3 * h.worker.worker.pool.bytes_per_page
