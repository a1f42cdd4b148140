"""HiCache's numbers in vLLM's two stats paths (series: stats.METRICS).

``HiCacheKVConnectorStats`` is the ``KVConnectorStats`` both halves return
from ``get_kv_connector_stats``: ``data = {"counters": {sample: increment},
"gauges": {sample: value}, "observations": {sample: [seconds, ...]}}``, plain
dicts of numbers and lists of them, so it crosses every process boundary
vLLM sends it over. ``aggregate`` adds counters (the TP ranks of one step,
then the steps of one log interval), keeps the latest gauges and joins the
histograms' observations (at most ``MAX_OBSERVATIONS`` per sample: a
sample); ``reduce`` makes the fields of vLLM's periodic "KV Transfer
metrics" log line.

``HiCachePromMetrics`` is what ``build_prom_metrics`` returns in the API
server: one Prometheus series per ``stats.METRICS`` entry, named
``vllm:hicache_<name>`` (counters get prometheus_client's ``_total``), with
vLLM's per-engine labels (``model_name``, ``engine``) plus the series' own.
A labelled series appears when it first moves. Unknown samples are skipped:
the logger must never fail the API server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_hicache.common.stats import METRICS, TRANSFER_OPS, key, split_key

logger = logging.getLogger(__name__)

PREFIX = "vllm:hicache_"
# Observations one histogram sample keeps between two reports, at most.
MAX_OBSERVATIONS = 4096
# Buckets of the seconds histograms: 0.5 ms to 10 s.
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                   5.0, 10.0)


@dataclass
class HiCacheKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})
        self.data.setdefault("observations", {})

    @classmethod
    def of(cls, counters: dict[str, float], gauges: dict[str, float],
           observations: dict[str, list[float]] | None = None
           ) -> HiCacheKVConnectorStats | None:
        if not counters and not gauges and not observations:
            return None
        return cls(data={"counters": dict(counters), "gauges": dict(gauges),
                         "observations": {k: list(v) for k, v in (observations or {}).items()}})

    @property
    def counters(self) -> dict[str, float]:
        return self.data["counters"]

    @property
    def gauges(self) -> dict[str, float]:
        return self.data["gauges"]

    @property
    def observations(self) -> dict[str, list[float]]:
        return self.data["observations"]

    def reset(self) -> None:
        self.data: dict[str, dict[str, Any]] = {"counters": {}, "gauges": {},
                                                "observations": {}}

    def aggregate(self, other: KVConnectorStats) -> HiCacheKVConnectorStats:
        if other is self or other.is_empty():
            return self
        assert isinstance(other, HiCacheKVConnectorStats), type(other)
        counters = self.counters
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0) + v
        self.gauges.update(other.gauges)
        observations = self.observations
        for k, values in other.observations.items():
            mine = observations.setdefault(k, [])
            mine += values[: max(0, MAX_OBSERVATIONS - len(mine))]
        return self

    def is_empty(self) -> bool:
        return not self.counters and not self.gauges and not self.observations

    def reduce(self) -> dict[str, int | float]:
        counters = self.counters
        out: dict[str, int | float] = {}
        for tier in ("L2", "L3"):
            tokens = counters.get(key("hit_tokens", tier), 0)
            if tokens:
                out[f"{tier}_hit_tokens"] = int(tokens)
        for op in TRANSFER_OPS:
            num_bytes = counters.get(key("transfer_bytes", op), 0)
            seconds = counters.get(key("transfer_seconds", op), 0)
            if num_bytes:
                out[f"{op}_MB"] = round(num_bytes / 1e6, 2)
                if seconds > 0:
                    out[f"{op}_GB/s"] = round(num_bytes / seconds / 1e9, 3)
        for sample, value in counters.items():
            if value and not sample.startswith(("hit_tokens.", "transfer_")):
                out[sample.replace(".", "_")] = int(value)
        for sample, value in self.gauges.items():
            out[sample] = int(value)
        for sample, values in self.observations.items():
            if values:  # the mean, in ms, of this log interval
                out[sample.replace(".", "_") + "_mean_ms"] = round(
                    1000 * sum(values) / len(values), 2)
        return out


class HiCachePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for spec in METRICS:
            kwargs: dict[str, Any] = {"name": PREFIX + spec.name, "documentation": spec.doc,
                                      "labelnames": [*labelnames, *spec.labels]}
            if spec.kind == "gauge":
                self._families[spec.name] = self._gauge_cls(multiprocess_mode="mostrecent",
                                                             **kwargs)
            elif spec.kind == "histogram":
                self._families[spec.name] = self._histogram_cls(buckets=SECONDS_BUCKETS,
                                                                 **kwargs)
            else:
                self._families[spec.name] = self._counter_cls(**kwargs)
        # (engine, sample) -> the labelled child
        self._children: dict[tuple[int, str], Any] = {}

    def _child(self, engine_idx: int, sample: str):
        child = self._children.get((engine_idx, sample))
        if child is None:
            spec, values = split_key(sample)
            engine_values = self.per_engine_labelvalues[engine_idx]
            child = self._families[spec.name].labels(*engine_values, *values)
            self._children[(engine_idx, sample)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for sample, value in (transfer_stats_data.get("counters") or {}).items():
            if value > 0:
                child = self._safe_child(engine_idx, sample)
                if child is not None:
                    child.inc(value)
        for sample, value in (transfer_stats_data.get("gauges") or {}).items():
            child = self._safe_child(engine_idx, sample)
            if child is not None:
                child.set(value)
        for sample, values in (transfer_stats_data.get("observations") or {}).items():
            child = self._safe_child(engine_idx, sample)
            if child is not None:
                for value in values:
                    child.observe(value)

    def _safe_child(self, engine_idx: int, sample: str):
        try:
            return self._child(engine_idx, sample)
        except (KeyError, ValueError):
            logger.debug("HiCache metrics: unknown sample %r skipped", sample)
            return None

