"""Builds the L3 tier's pieces for each half from the vLLM config.

Both halves derive the same key namespaces (keys.py): the scheduler queries
every (PP, TP) rank's keys (a prefix is in L3 only if all ranks wrote it; MLA
has one copy per PP stage), each worker reads and writes its own.

Page format, the byte order of an object's payload, is part of every key:

    layer_first        staged by PageStore in the canonical order
                       [layers, planes, tokens, heads, head_size]
    page_first         the host page as it is: [planes, tokens, layers,
                       heads, head_size]
    page_first_direct  the host page as it is: [layers, E], E one block in
                       the device's *native* order, which depends on the
                       attention backend (K|V packed per token, or split
                       per block: CPU_ATTN), vLLM's KV cache layout
                       (token- or head-major: NHD/HND) and its kernel block
                       split; whether layers or blocks are outermost in L1
                       does not change it

The first two are fixed by the geometry. The third only a worker can see (it
holds the KV tensors); the scheduler derives the order the worker should
have from the resolved KV cache layout and the platform
(``expected_page_format``). Each worker keys its objects by the order it
actually has and, where that differs from the derivation, keeps L3 off with
an error: its objects would sit under keys the scheduler never looks up.

Weights: the model name (path) and revision, plus ``model_version`` when the
user names the weights, else a fingerprint of the weight files of a local
model directory (names, sizes and sampled bytes, or the content hash a
Hugging Face cache snapshot links to). The fingerprint reads at most 64 KiB
per file, and is equal for equal copies on different hosts whatever their
mtimes (multi-host TP ranks must derive the scheduler's keys); sampling can
miss an in-place edit of a few tensors, which is what model_version is for.
A hub id without a local directory is identified by name and revision only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch
from vllm.platforms import current_platform
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_hicache.config import HiCacheConfig
from vllm_hicache.connector.geometry import KVGeometry
from vllm_hicache.connector.l3_canary import DisabledPageStore, guard_with_canary
from vllm_hicache.connector.l3_scheduler import StoragePlanner
from vllm_hicache.connector.l3_worker import StorageIO
from vllm_hicache.host.layout import BlockOrder, HostLayout
from vllm_hicache.kernels.device_layout import CPU_BACKENDS, PACKED_BACKENDS, describe_kv_tensor
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage import StorageContext, create_backend
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.pages import PageStore

logger = logging.getLogger(__name__)

_RANDOM_SEEDED_HASHES = ("xxhash", "xxhash_cbor")

# Files whose bytes decide the KV a model computes (config.json: rope and
# attention settings).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_CONFIG_FILES = ("config.json",)
# Sampled windows per file: enough to see any rewrite of a checkpoint (a new
# fine-tune changes every tensor), small enough to read at start from a
# network file system.
_SAMPLE_WINDOWS = 16
_SAMPLE_WINDOW_BYTES = 4096


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
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("hicache_storage_backend does not support pipeline parallelism yet")


# --- page format ------------------------------------------------------------


def page_format_of(layout: HostLayout, itemsize: int) -> str:
    """Byte order of one page's L3 payload: semantic axes with their sizes
    and element strides, outermost first, e.g.
    ``4B[layer2:2048 plane2:1024 token16:64 head2:32 elem32:1]``.

    Deterministic and canonical: two layouts give the same string iff their
    payloads put every (layer, plane, token, head, elem) at the same byte.
    Mirrors what ``PageStore`` stores (layer_first: a canonical staging copy;
    the page-major layouts: the page itself).
    """
    o = layout.order
    layers, planes, tokens, heads, dim = (
        layout.num_layers, o.planes, o.block_size, o.heads, o.head_size
    )
    if layout.name == "layer_first":
        axes = _contiguous(("layer", layers), ("plane", planes), ("token", tokens),
                           ("head", heads), ("elem", dim))
    elif layout.name == "page_first":
        axes = _contiguous(("plane", planes), ("token", tokens), ("layer", layers),
                           ("head", heads), ("elem", dim))
    else:
        plane_s, kb_s, token_s, head_s, elem_s = o.strides
        axes = [("layer", layers, o.elems), ("plane", planes, plane_s),
                ("kblock", o.kernel_blocks, kb_s), ("token", o.dims[2], token_s),
                ("head", heads, head_s), ("elem", dim, elem_s)]
    return f"{itemsize}B[{' '.join(f'{n}{size}:{stride}' for n, size, stride in _normal(axes))}]"


def _contiguous(*named_sizes: tuple[str, int]) -> list[tuple[str, int, int]]:
    axes, step = [], 1
    for name, size in reversed(named_sizes):
        axes.append((name, size, step))
        step *= size
    return axes[::-1]


def _normal(axes: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Drop size-1 axes, merge kernel blocks into the token axis where they
    are one strided run, order outermost first."""
    by_name = {name: (size, stride) for name, size, stride in axes if size > 1}
    if "kblock" in by_name and "token" in by_name:
        (kb, kb_stride), (tok, tok_stride) = by_name["kblock"], by_name["token"]
        if kb_stride == tok * tok_stride:
            del by_name["kblock"]
            by_name["token"] = (kb * tok, tok_stride)
    elif "kblock" in by_name:  # one token per kernel block: they are the tokens
        by_name["token"] = by_name.pop("kblock")
    return sorted(((n, s, st) for n, (s, st) in by_name.items()), key=lambda a: -a[2])


def pool_page_format(pool) -> str:
    """What this worker's objects hold (``pool``: a HostKVPool)."""
    return page_format_of(pool.layout, pool.dtype.itemsize)


def expected_page_format(cfg: HiCacheConfig, geom: KVGeometry, vllm_config) -> str:
    """The page format every process derives without seeing KV tensors."""
    planes = 1 if geom.is_mla else 2
    heads = 1 if geom.is_mla else geom.num_kv_heads
    if cfg.hicache_mem_layout == "page_first_direct":
        order = _expected_device_order(geom, vllm_config)
    else:
        order = BlockOrder.canonical(planes, geom.block_size, heads, geom.head_size)
    layout = HostLayout(cfg.hicache_mem_layout, 1, geom.num_layers, order)
    return page_format_of(layout, getattr(torch, geom.kv_dtype).itemsize)


def _expected_device_order(geom: KVGeometry, vllm_config) -> BlockOrder:
    """Native block order of the L1 tensor vLLM should allocate: the resolved
    KV cache layout applied to the expected backend's block shape, read by
    the same ``describe_kv_tensor`` the worker runs on the real tensor. A
    kernel block split is not predicted: the worker's check catches it."""
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_layout is not None:
        layout = cache_config.get_resolved_kv_cache_layout()
    else:  # not resolved (no engine core): vLLM's default
        layout = KVCacheLayout.LBHNC
    forced = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    forced = getattr(forced, "name", None)
    if forced in PACKED_BACKENDS + CPU_BACKENDS:
        backend = forced
    else:
        # Every GPU backend packs K|V per token; only CPU_ATTN splits them.
        backend = CPU_BACKENDS[0] if current_platform.is_cpu() else PACKED_BACKENDS[0]
    heads = 1 if geom.is_mla else geom.num_kv_heads
    content = geom.head_size if geom.is_mla else 2 * geom.head_size
    shape = (2, heads, geom.block_size, content)  # [B, H, N, C]
    strides, step = [0] * 4, 1
    for axis in reversed(layout.layer_view_order):
        strides[axis] = step
        step *= shape[axis]
    tensor = torch.empty_strided(shape, strides, dtype=torch.int8, device="meta")
    return describe_kv_tensor(
        tensor, num_blocks=2, block_size=geom.block_size, num_kv_heads=geom.num_kv_heads,
        head_size=geom.head_size, is_mla=geom.is_mla, backend_name=backend,
    ).block_order


# --- weights ----------------------------------------------------------------


def weights_fingerprint(model_dir: str) -> tuple[str, int]:
    """(fingerprint, weight files covered) of a local model directory: names,
    sizes and content identities of its weight files and config.json."""
    names = sorted(
        n for n in os.listdir(model_dir)
        if (n in _CONFIG_FILES or n.endswith(_WEIGHT_SUFFIXES))
        and os.path.isfile(os.path.join(model_dir, n))
    )
    digest = hashlib.sha256()
    for name in names:
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        digest.update(json.dumps([name, size, _content_id(path, size)]).encode())
    return digest.hexdigest()[:32], sum(n not in _CONFIG_FILES for n in names)


def _content_id(path: str, size: int) -> str:
    target = os.path.realpath(path)
    if os.path.basename(os.path.dirname(target)) == "blobs":
        # A Hugging Face cache snapshot links each file to a blob named by its
        # content hash: exact, and free.
        return "blob:" + os.path.basename(target)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _SAMPLE_WINDOWS * _SAMPLE_WINDOW_BYTES:
            digest.update(f.read())
        else:
            last = size - _SAMPLE_WINDOW_BYTES
            for i in range(_SAMPLE_WINDOWS):
                f.seek(last * i // (_SAMPLE_WINDOWS - 1))
                digest.update(f.read(_SAMPLE_WINDOW_BYTES))
    return "sampled:" + digest.hexdigest()


def _weights_identity(cfg: HiCacheConfig, model_config, log: bool) -> str:
    """The fingerprint for the namespace ("" when model_version names the
    weights or there is no local directory), logging what identifies them."""
    ident = _model_ident(model_config)
    if cfg.model_version:
        if log:
            logger.info("HiCache L3: weights of %s identified by model_version=%r",
                        ident, cfg.model_version)
        return ""
    fingerprint, num_files = "", 0
    if os.path.isdir(model_config.model):
        fingerprint, num_files = weights_fingerprint(model_config.model)
    if log and num_files:
        logger.info("HiCache L3: weights of %s fingerprinted from %d files (%s)",
                    ident, num_files, fingerprint)
    elif log:
        logger.warning(
            "HiCache L3: weights of %s are identified by name and revision only (no "
            "local weight files to fingerprint): a checkpoint replaced under the same "
            "name%s would hit KV computed with the old one. Set model_version in "
            "kv_connector_extra_config to name the weights.",
            ident, "" if model_config.revision else " and no revision",
        )
    return fingerprint


def _model_ident(model_config) -> str:
    return model_config.model + (f"@{model_config.revision}" if model_config.revision else "")


# --- namespaces and the two halves -------------------------------------------


def namespace(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, tp_rank: int,
              pp_rank: int = 0, *, page_format: str | None = None,
              log: bool = False) -> KeyNamespace:
    """The key namespace of one (TP, PP) rank. ``page_format``: the worker's
    actual one (default: ``expected_page_format``)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if page_format is None:
        page_format = expected_page_format(cfg, geom, vllm_config)
    return KeyNamespace(
        model=_model_ident(model), kv_dtype=geom.kv_dtype, mem_layout=cfg.hicache_mem_layout,
        block_size=geom.block_size, tp_size=parallel.tensor_parallel_size, tp_rank=tp_rank,
        is_mla=geom.is_mla, page_format=page_format, model_version=cfg.model_version,
        weights_fingerprint=_weights_identity(cfg, model, log),
        pp_size=parallel.pipeline_parallel_size, pp_rank=pp_rank,
    )


def build_planner(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, num_pages: int) -> StoragePlanner:
    storage = cfg.storage
    parallel = vllm_config.parallel_config
    tp_size = parallel.tensor_parallel_size
    tp_ranks = [0] if geom.is_mla else list(range(tp_size))
    ctx = StorageContext("scheduler", 0, tp_size, HEADER_BYTES + geom.bytes_per_block)
    backend = create_backend(storage.backend, storage.backend_options, ctx)
    base = namespace(cfg, geom, vllm_config, 0, log=True)
    namespaces = [base.for_rank(t, p)
                  for p in range(parallel.pipeline_parallel_size) for t in tp_ranks]
    # SGLang's cap: 80% of what L2 holds beyond L1.
    cap = max(1, int(0.8 * (num_pages - geom.num_l1_blocks)))
    return StoragePlanner(
        storage, backend, namespaces, geom.block_size, world_size=tp_size,
        max_inflight_pages=cap,
    )


def build_storage_io(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, pool) -> StorageIO:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    storage = cfg.storage
    parallel = vllm_config.parallel_config
    tp_size = parallel.tensor_parallel_size
    rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
    pp_rank = get_pp_group().rank_in_group if parallel.pipeline_parallel_size > 1 else 0
    ctx = StorageContext("worker", rank, tp_size, HEADER_BYTES + pool.bytes_per_page)
    backend = create_backend(storage.backend, storage.backend_options, ctx)
    actual = pool_page_format(pool)
    pages = PageStore(backend, pool, namespace(cfg, geom, vllm_config, rank, pp_rank,
                                               page_format=actual))
    return StorageIO(checked_page_store(pages, expected_page_format(cfg, geom, vllm_config)),
                     rank, writes=not geom.is_mla or rank == 0)


def checked_page_store(pages: PageStore, expected_format: str) -> PageStore | DisabledPageStore:
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
    return guard_with_canary(pages)
