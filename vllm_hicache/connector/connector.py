"""HiCacheConnector: vLLM's entry point; dispatches to one of the two halves.

vLLM builds it twice: with role SCHEDULER in EngineCore (-> HiCacheScheduler)
and with role WORKER in each worker (-> HiCacheWorker). Each method asserts
it runs on the half that owns it. Use with ``kv_connector="HiCacheConnector"``
(the package's vLLM plugin registers the name; ``kv_connector_module_path=
"vllm_hicache"`` works too).

Start-up logging: the scheduler half (one per engine) logs one INFO line with
the resolved configuration (``start_line``: bytes and pages per tier, layout,
policies, L3 backend with secrets redacted) and one warning per rewrite
``config_finish.finish_config`` returns. Worker halves finish the same options from
the same input, model and platform, so they get the same rewrites and do not
repeat them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_hicache.admin.api import start_admin_api
from vllm_hicache.admin.storage_control import make_control
from vllm_hicache.config import HiCacheConfig, LoadMode
from vllm_hicache.config_finish import EngineFacts, finish_config
from vllm_hicache.connector.geometry import KVGeometry, geometry_from
from vllm_hicache.connector.kv_events import KVEventLog, kv_events_enabled
from vllm_hicache.connector.metadata import HiCacheMetadata
from vllm_hicache.connector.metrics import HiCacheKVConnectorStats, HiCachePromMetrics
from vllm_hicache.connector.vllm_compat import engine_stop_flag, shutdown_timeout_s
from vllm_hicache.connector.worker import HiCacheWorker
from vllm_hicache.kernels import kernel_io_missing
from vllm_hicache.l3.setup import build_planner, check_shareable_hashes
from vllm_hicache.l3.worker_io import SHUTDOWN_DRAIN_S
from vllm_hicache.logs import log_through_vllm
from vllm_hicache.policy.prefetch import PrefetchPolicyName
from vllm_hicache.policy.stop_budget import stop_budget
from vllm_hicache.redaction import redacted
from vllm_hicache.scheduler.graceful_stop import GracefulStop
from vllm_hicache.scheduler.scheduler import HiCacheScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Drafters that propose from token ids alone: no attention layers, so no KV of
# their own in L1 or L2 and no layer hook outside the target forward, and vLLM
# drops no last block from their prefix hits. vLLM still defers wait_for_save
# past get_block_ids_with_load_errors for them; that is harmless because the
# target forward reaches every layer hook (layerwise loads require piecewise
# CUDA graphs), so wait_for_save finds no layer left to report, and a store
# that fails there is caught by the worker's garbage-page check before any
# load reads the page.
_TOKEN_ONLY_SPECULATION = ("ngram", "ngram_gpu")


def check_speculative_decoding(vllm_config: VllmConfig) -> None:
    """Refuse at start the speculative methods whose drafter L2 cannot serve.

    Drafters with KV (EAGLE, EAGLE-3, MTP, DFlash, DSpark, draft models,
    extract_hidden_states) register attention layers that vLLM puts into the
    target's KV cache group when their spec matches (a second group, which
    ``geometry_from`` refuses, otherwise), so pages would carry drafter KV
    too. The drafter runs after the target forward and may not reach every
    layer hook on every step; a layer never waited for is reported as a
    failed load from ``wait_for_save``, which speculation defers until after
    vLLM has collected ``get_block_ids_with_load_errors``: one step late.
    The EAGLE family must also recompute the last block of a prefix hit: its
    drafter KV there depends on the token after the block, which the block
    hash does not cover. vLLM drops that block from its own hits, not from a
    connector's, and the scheduler half does not drop it. Drafters reading
    target hidden states (Medusa, MLP speculator), custom and suffix proposers
    are refused until tested.
    """
    spec = vllm_config.speculative_config
    if spec is None or spec.method in _TOKEN_ONLY_SPECULATION:
        return
    supported = " or ".join(repr(m) for m in _TOKEN_ONLY_SPECULATION)
    raise ValueError(
        f"HiCacheConnector does not support speculative decoding "
        f"(speculative_config method={spec.method!r}) yet: drafters with their own "
        f"KV or reading target hidden states are not served correctly with L2 "
        f"hits (EAGLE/MTP need the last block of a prefix hit recomputed, which "
        f"the connector does not do). Use method {supported}, "
        f"or disable speculative decoding."
    )


# Tier -> vLLM's name for it in per-source hit metrics.
_HIT_SOURCE = {"L2": CacheHitSource.HOST, "L3": CacheHitSource.DISK}


# --- start-up logging ------------------------------------------------------

def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def _groups(geom: KVGeometry) -> str:
    """A hybrid model's KV cache groups, in vLLM's order: which layers a
    page holds how (e.g. ``sliding(64 tokens)x2+fullx2``)."""
    return "+".join(
        (f"sliding({g.sliding_window_tokens} tokens)" if g.sliding_window_tokens else g.kind)
        + f"x{len(g.layers)}" for g in geom.groups)


def start_line(cfg: HiCacheConfig, geom: KVGeometry, num_pages: int, local_ranks: int = 1) -> str:
    """The one INFO line an engine logs at start: the resolved configuration."""
    page = geom.bytes_per_block
    l2_by = (f"hicache_size={cfg.hicache_size:g} GB" if cfg.host_bytes_override > 0
             else f"hicache_ratio={cfg.hicache_ratio:g}")
    parts = [
        f"L1 {geom.num_l1_blocks} blocks x {page} B = {_size(geom.num_l1_blocks * page)} (vLLM)",
        f"L2 {num_pages} pages x {page} B = {_size(num_pages * page)} per rank"
        f"{f' x {local_ranks} ranks' if local_ranks > 1 else ''} ({l2_by})",
        f"block_size={geom.block_size} layers={geom.num_layers} kv_dtype={geom.kv_dtype or '?'}"
        + (f" groups={_groups(geom)}" if geom.groups else ""),
        f"mem_layout={cfg.hicache_mem_layout} io_backend={cfg.hicache_io_backend} "
        f"load_mode={cfg.hicache_load_mode} write_policy={cfg.hicache_write_policy} "
        f"eviction={cfg.radix_eviction_policy}",
    ]
    storage = cfg.storage
    if storage is None:
        parts.append("L3 off")
    else:
        wait = {
            PrefetchPolicyName.TIMEOUT: f" wait={storage.prefetch_timeout_base:g}+"
                       f"{storage.prefetch_timeout_per_ki_token:g}/Ki tokens"
                       f" (max {storage.prefetch_timeout_max:g}) s",
            PrefetchPolicyName.WAIT_COMPLETE: f" wait<={storage.prefetch_timeout_max:g} s",
        }.get(storage.prefetch_policy, "")
        parts.append(
            f"L3 {storage.backend} prefetch={storage.prefetch_policy}{wait} "
            f"threshold={storage.prefetch_threshold} tokens "
            f"options={redacted(dict(storage.backend_options))}"
            + (f" model_version={cfg.model_version!r}" if cfg.model_version else "")
        )
    if cfg.hicache_decode_offload:
        parts.append("PD decode offload: no lookups or loads, L2 stages the L3 backups")
    return "HiCache: " + "; ".join(parts)


# The start warning where a stop cannot write anything out (policy/stop_budget.py).
STOP_LOSES_BACKUPS = (
    "vLLM's --shutdown-timeout is 0 (its default): on SIGTERM or SIGINT vLLM kills EngineCore "
    "at once, so L3 backups still queued and deferred (pages only L2 holds) are lost, and a "
    "restarted or peer server misses them in L3; start with --shutdown-timeout N (seconds, "
    "e.g. 30) to write them out first, the most valuable first, within N seconds")


def engine_facts(geom: KVGeometry, kv_role: str | None) -> EngineFacts:
    """What ``finish_config`` needs from vLLM and the platform, as plain values.

    ``kv_role``: HiCache's own, which in a MultiConnector is the instance's PD
    role (scheduler/pd.py)."""
    return EngineFacts(
        kernel_io_missing=kernel_io_missing(current_platform.is_cuda()),
        kv_role=kv_role,
        kv_group_kinds=tuple(g.kind for g in geom.groups),
        state_groups=bool(geom.mamba_groups),
    )


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_through_vllm()  # also where the plugin is filtered out by VLLM_PLUGINS
        parsed = HiCacheConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        check_speculative_decoding(vllm_config)
        geom = geometry_from(kv_cache_config, vllm_config)
        # Finished alike in every process, so both halves (and the L3 keys
        # they derive) agree on the layout; the scheduler half says what changed.
        cfg, rewrites = finish_config(
            parsed, engine_facts(geom, self._kv_transfer_config.kv_role))
        if role == KVConnectorRole.SCHEDULER:
            for rewrite in rewrites:
                logger.warning("HiCache: %s", rewrite)
        if cfg.storage is not None:
            check_shareable_hashes(vllm_config)
        self.scheduler: HiCacheScheduler | None = None
        self.worker: HiCacheWorker | None = None
        self._admin_api = None  # the admin HTTP server (scheduler half, if configured)
        self._shut_down = False
        if role == KVConnectorRole.SCHEDULER:
            parallel = vllm_config.parallel_config
            l3_factory = (functools.partial(build_planner, cfg, geom, vllm_config)
                          if cfg.storage is not None else None)
            self.scheduler = HiCacheScheduler(cfg, geom, parallel.local_world_size, l3_factory)
            self.scheduler.events = KVEventLog(kv_events_enabled(vllm_config), geom.block_size)
            logger.info("%s", start_line(cfg, geom, self.scheduler.num_pages,
                                         parallel.local_world_size))
            budget = stop_budget(shutdown_timeout_s(vllm_config), SHUTDOWN_DRAIN_S)
            self.scheduler.graceful_stop = GracefulStop(budget, engine_stop_flag())
            if cfg.storage is not None and not budget.graceful:
                logger.warning("HiCache: %s", STOP_LOSES_BACKUPS)
            # Runtime attach/detach of L3 (admin/storage_control.py, admin/api.py).
            control = make_control(self.scheduler, geom, vllm_config)
            self.scheduler.install_commands(control)
            self._admin_api = start_admin_api(control, cfg, vllm_config)
        else:
            self.worker = HiCacheWorker(cfg, geom, vllm_config)

    # --- capabilities ------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a preempted request simply recomputes.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layerwise loads wait per layer, which full CUDA-graph replay skips.
        cfg = HiCacheConfig.parse(extra_config)  # the scheduler half logs any rewrite
        # A decode-offload instance never loads (pd.py).
        return cfg.hicache_load_mode == LoadMode.LAYERWISE and not cfg.hicache_decode_offload

    # --- scheduler half ----------------------------------------------------

    def _sched(self) -> HiCacheScheduler:
        assert self.scheduler is not None, "scheduler-side method called on a worker"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Hybrid allocator: one block table per KV cache group.
        return self._sched().request_finished_all_groups(request, block_ids)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._sched().bind_gpu_block_pool(gpu_block_pool)

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM stepping while backups, async loads or prefetches are
        # in flight with no request running: their acknowledgements (and the
        # pins they release) travel only with a step's output.
        return self.scheduler is not None and self.scheduler.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self._sched().reset_cache() if self.scheduler is not None else None

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        # L2 is host memory; L3 is storage (files, or a remote store).
        tiers = self._sched().hit_tiers(request.request_id, num_external_tokens)
        return {_HIT_SOURCE[tier]: n for tier, n in tiers.items()}

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._sched().take_events() if self.scheduler is not None else ()

    # --- metrics (both halves; metrics.py) ----------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        half = self.scheduler.stats_report if self.scheduler is not None else self._work().stats
        return HiCacheKVConnectorStats.of(*half())

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        if data is None:
            return HiCacheKVConnectorStats()
        # A copy: vLLM's log-interval accumulator adds into it in place.
        return HiCacheKVConnectorStats(data={
            "counters": dict(data.get("counters") or {}),
            "gauges": dict(data.get("gauges") or {}),
            "observations": {k: list(v) for k, v in (data.get("observations") or {}).items()}})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- worker half -------------------------------------------------------

    def _work(self) -> HiCacheWorker:
        assert self.worker is not None, "worker-side method called on the scheduler"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, HiCacheMetadata)
        self._work().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, HiCacheMetadata)
        self._work().bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._work().clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        # Stores copy whole blocks of all layers after the forward
        # (wait_for_save): one batched copy instead of one per layer.
        return

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        # Hybrid models: failed async loads, by request (worker.py).
        results.failed_recving = self._work().take_failed_recving()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().worker_meta()

    def shutdown(self) -> None:
        # vLLM may call it more than once (an engine's teardown, then an
        # owner's close): the halves' threads and stores are closed once.
        if self._shut_down:
            return
        self._shut_down = True
        if self._admin_api is not None:
            self._admin_api.stop()
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
