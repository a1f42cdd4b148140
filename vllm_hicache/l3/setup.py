"""Builds the L3 tier's pieces for each half from the vLLM config.

Both halves derive the same key namespaces (keys.py): the scheduler queries
every (PP, TP) rank's keys (a prefix is in L3 only if all ranks wrote it; MLA
has one copy per PP stage; with head slices, every slice of every stage),
each worker reads and writes its own. What the namespace says about the
bytes (page format, weights) is l3/identity.py's.

Pipeline parallelism: page numbers come from the scheduler, so every stage
fills and reads the same pages; each stage stores its own layers under its
PP rank. The scheduler derives stage p's page format from stage p's layer
count (geometry.pp_stage_num_layers), not from the first stage's geometry
it holds. Worker reports (prefetch progress, backup and attach acks) carry
``worker_id`` (unique over PP x TP; not the TP rank), and the scheduler
waits for all ``num_workers`` of them.
Each worker keys its objects by the page format it actually has and, where
that differs from what the scheduler derives, keeps L3 off with an error:
its objects would sit under keys the scheduler never looks up. With a storage
secret, both halves put its one-way tag in the namespace and the workers seal
objects with the codec it selects (storage/sealing.py).
"""

from __future__ import annotations

import logging
import os

from vllm_hicache.common.page_states import PageStates
from vllm_hicache.config import HiCacheConfig
from vllm_hicache.connector.geometry import KVGeometry, pp_stage_num_layers
from vllm_hicache.connector.vllm_compat import shutdown_timeout_s
from vllm_hicache.keys import HeadSlicing, KeyNamespace, check_head_slicing
from vllm_hicache.l3.breaker import BreakerConfig
from vllm_hicache.l3.canary import DisabledPageStore, guard_with_canary
from vllm_hicache.l3.health_check import L3Health, probe_key, round_trip_check
from vllm_hicache.l3.identity import (
    expected_page_format,
    model_ident,
    pool_page_format,
    weights_identity,
    weights_options,
)
from vllm_hicache.l3.node_backend import build_backend
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.l3.worker_io import SHUTDOWN_DRAIN_S, StorageIO
from vllm_hicache.policy.prefetch import prefetch_inflight_cap
from vllm_hicache.policy.stop_budget import stop_budget
from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.node_chain import NodeChainBackend
from vllm_hicache.storage.node_direct import promotion_check
from vllm_hicache.storage.pages import PageStore
from vllm_hicache.storage.sealing import make_codec
from vllm_hicache.storage_config import StorageConfig

logger = logging.getLogger(__name__)

_RANDOM_SEEDED_HASHES = ("xxhash", "xxhash_cbor")


def check_shareable_hashes(vllm_config) -> None:
    """L3 is shared across processes: block hashes must be reproducible."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo in _RANDOM_SEEDED_HASHES and os.getenv("PYTHONHASHSEED") is None:
        raise ValueError(
            f"hicache_storage_backend needs block hashes that are equal in every "
            f"process, but prefix_caching_hash_algo={algo!r} is seeded randomly per "
            "process unless PYTHONHASHSEED is set. Set PYTHONHASHSEED to the same "
            "value for every instance sharing the L3 store, or use "
            "--prefix-caching-hash-algo sha256 (the default)."
        )


# --- ranks -------------------------------------------------------------------


def num_workers(vllm_config) -> int:
    """Workers that report to the scheduler: every (PP, TP) rank."""
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def worker_ranks(vllm_config) -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker process."""
    parallel = vllm_config.parallel_config
    tp_rank = pp_rank = 0
    if parallel.tensor_parallel_size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    if parallel.pipeline_parallel_size > 1:
        from vllm.distributed.parallel_state import get_pp_group

        pp_rank = get_pp_group().rank_in_group
    return tp_rank, pp_rank


def worker_id(vllm_config) -> int:
    """This worker's id in its reports, in [0, num_workers): PP x TP, unlike
    the TP rank that keys its objects."""
    tp_rank, pp_rank = worker_ranks(vllm_config)
    return pp_rank * vllm_config.parallel_config.tensor_parallel_size + tp_rank


# --- namespaces and the two halves -------------------------------------------


def head_slicing(cfg: HiCacheConfig, geom: KVGeometry, vllm_config) -> HeadSlicing | None:
    """The head slices L3 objects hold (tp_lcm_size), or None: refuses a
    tp_lcm_size that this model and TP size cannot use."""
    if cfg.storage is None or not cfg.storage.tp_lcm_size:
        return None
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    total_heads = vllm_config.model_config.get_total_num_kv_heads()
    check_head_slicing(cfg.storage.tp_lcm_size, tp_size, total_heads, geom.is_mla)
    return HeadSlicing(cfg.storage.tp_lcm_size, total_heads, tp_size)


def stage_num_layers(geom: KVGeometry, vllm_config, pp_rank: int) -> int:
    """KV layers of pipeline stage ``pp_rank`` (``geom``'s own without PP)."""
    if vllm_config.parallel_config.pipeline_parallel_size == 1:
        return geom.num_layers
    return pp_stage_num_layers(vllm_config)[pp_rank]


def namespace(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, tp_rank: int,
              pp_rank: int = 0, *, page_format: str | None = None,
              log: bool = False) -> KeyNamespace:
    """The key namespace of one (TP, PP) rank (with head slices: of the
    rank's first slice). ``page_format``: the worker's actual one (default:
    the one every process derives, ``expected_page_format``)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    slicing = head_slicing(cfg, geom, vllm_config)
    quantization, hf_overrides = weights_options(model, log)
    if page_format is None:
        page_format = expected_page_format(
            cfg, geom, vllm_config, num_layers=stage_num_layers(geom, vllm_config, pp_rank),
            slice_heads=slicing.heads_per_slice if slicing else None)
    return KeyNamespace(
        model=model_ident(model), kv_dtype=geom.kv_dtype, mem_layout=cfg.hicache_mem_layout,
        block_size=geom.block_size, tp_size=parallel.tensor_parallel_size, tp_rank=tp_rank,
        is_mla=geom.is_mla, page_format=page_format, model_version=cfg.model_version,
        weights_fingerprint=weights_identity(cfg, model, log),
        quantization=quantization, hf_overrides=hf_overrides,
        pp_size=parallel.pipeline_parallel_size, pp_rank=pp_rank,
        protection=cfg.storage.key_protection if cfg.storage is not None else "",
        name_key=cfg.storage.object_name_key if cfg.storage is not None else b"",
        head_slices=slicing.num_slices if slicing else 0,
        head_slice=slicing.rank_slices(tp_rank)[0] if slicing else 0,
    )


def node_identity(cfg: HiCacheConfig, geom: KVGeometry, vllm_config) -> str:
    """What names the node tier besides node_tier_name: the rank-0 key
    namespace, which both halves derive alike."""
    return namespace(cfg, geom, vllm_config, 0, 0).tag


def build_planner(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, num_pages: int,
                  page_states: PageStates | None = None,
                  ctx: PlannerContext | None = None) -> L3Planner:
    """The scheduler half's L3 planner; ``ctx``: the scheduler state it acts
    on (``HiCacheScheduler.l3_context``; None builds one that only names
    keys and queries the store, for tools and tests)."""
    storage = _storage_of(cfg)
    parallel = vllm_config.parallel_config
    tp_size = parallel.tensor_parallel_size
    tp_ranks = [0] if geom.is_mla else list(range(tp_size))
    # Logs what identifies the weights; refuses an unusable tp_lcm_size.
    per_page = len(namespace(cfg, geom, vllm_config, 0, log=True).page_namespaces())
    store_ctx = StorageContext("scheduler", 0, tp_size,
                               HEADER_BYTES + geom.bytes_per_block // per_page)
    backend = build_backend(cfg, storage, store_ctx, node_identity(cfg, geom, vllm_config))
    # Each stage's page format has that stage's layers.
    namespaces = [
        ns
        for p in range(parallel.pipeline_parallel_size)
        for t in tp_ranks
        for ns in namespace(cfg, geom, vllm_config, t, p).page_namespaces()
    ]
    cap = prefetch_inflight_cap(num_pages, geom.num_l1_blocks)
    health = None
    if cfg.l3_breaker and ctx is not None:  # a planner that plans: the engine's
        check = round_trip_check(backend, probe_key(namespaces[0]), store_ctx.object_bytes)
        health = L3Health(breaker_config(cfg), check, storage.backend)
    return L3Planner(
        storage, backend, namespaces, geom.block_size,
        world_size=num_workers(vllm_config), max_inflight_pages=cap, ctx=ctx,
        page_states=page_states, admission=cfg.hicache_l3_admission, mode=cfg.hicache_l3_mode,
        health=health, block_bytes=len(namespaces) * store_ctx.object_bytes,
    )


def breaker_config(cfg: HiCacheConfig) -> BreakerConfig:
    return BreakerConfig(window_s=cfg.l3_breaker_window_s,
                         latency_budget_s=cfg.l3_breaker_latency_budget_ms / 1e3,
                         probe_interval_s=cfg.l3_breaker_probe_interval_s)


def _storage_of(cfg: HiCacheConfig) -> StorageConfig:
    """The L3 configuration the tier is built from: callers build one only
    when a backend is configured (or being attached)."""
    if cfg.storage is None:
        raise ValueError("no L3 backend is configured (hicache_storage_backend)")
    return cfg.storage


def build_storage_io(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, pool,
                     canary_pages: tuple[int, int] | None = None) -> StorageIO:
    """``canary_pages``: two free host pages for the canary when L2 is in
    use (an attach at run time); None at start (l3_canary)."""
    storage = _storage_of(cfg)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    tp_rank, pp_rank = worker_ranks(vllm_config)
    expected = namespace(cfg, geom, vllm_config, tp_rank, pp_rank)
    slicing = head_slicing(cfg, geom, vllm_config)
    actual = pool_page_format(pool, slicing.heads_per_slice if slicing else None)
    per_page = len(expected.page_namespaces())
    ctx = StorageContext("worker", tp_rank, tp_size, HEADER_BYTES + pool.bytes_per_page // per_page)
    backend = build_backend(cfg, storage, ctx, node_identity(cfg, geom, vllm_config))
    codec = make_codec(storage.secret, storage.encrypt)
    pages = PageStore(backend, pool, namespace(cfg, geom, vllm_config, tp_rank, pp_rank,
                                               page_format=actual), codec,
                      page_states=bool(geom.mamba_groups))
    if isinstance(backend, NodeChainBackend):  # publish only what verifies
        backend.promotion_check = promotion_check(pages)
    if tp_rank == 0 and pp_rank == 0:
        logger.info("HiCache L3: objects sealed with %s%s", codec.name,
                    "" if storage.secret is not None else
                    " only (no storage_secret: anyone who can write the store can forge objects)")
        if slicing:
            logger.info("HiCache L3: objects hold %d of %d KV heads (tp_lcm_size=%d: "
                        "%d per page on each of %d TP ranks), shareable with any TP size "
                        "dividing %d", slicing.heads_per_slice, slicing.total_kv_heads,
                        slicing.num_slices, slicing.slices_per_rank, tp_size,
                        slicing.num_slices)
    # A stop's teardown share of --shutdown-timeout (policy/stop_budget.py).
    drain_s = stop_budget(shutdown_timeout_s(vllm_config), SHUTDOWN_DRAIN_S).drain_s
    return StorageIO(checked_page_store(pages, expected.page_format, canary_pages),
                     worker_id(vllm_config), writes=not geom.is_mla or tp_rank == 0,
                     drain_timeout_s=drain_s)


def checked_page_store(pages: PageStore, expected_format: str,
                       canary_pages: tuple[int, int] | None = None,
                       ) -> PageStore | DisabledPageStore:
    """``pages`` if this worker's objects can be found and read back, else a
    stand-in that keeps L3 off for this worker (see l3_canary)."""
    actual = pages.ns.page_format
    if actual != expected_format:
        reason = (
            f"this worker's host pages ({pages.pool.mem_layout}) hold {actual}, but the "
            f"scheduler looks up keys for {expected_format} (an attention backend or KV "
            "cache layout whose block order the scheduler cannot derive); use "
            "hicache_mem_layout=layer_first (or page_first) with an L3 backend"
        )
        logger.error("HiCache L3 disabled on this worker (backend %r, namespace %s): %s",
                     pages.backend.name, pages.ns.tag, reason)
        return DisabledPageStore(pages, reason)
    return guard_with_canary(pages, canary_pages)
