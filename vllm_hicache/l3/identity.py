"""What an L3 object's bytes mean besides its tokens: the page's byte order
and the weights that computed it (both go into the key namespace, keys.py).

Page format, the byte order of an object's payload:

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
(``expected_page_format``).

With head slices (``tp_lcm_size``) an object holds some of a page's heads
in the same order; its format is the one of a page with that many heads
(``pool_page_format(pool, slice_heads)``), equal for every TP size. With
pipeline parallelism, ``num_layers`` is the stage's.

Weights: the model name (path) and revision, plus ``model_version`` when the
user names the weights, else a fingerprint of the weight files of a local
model directory (names, sizes and sampled bytes, or the content hash a
Hugging Face cache snapshot links to). The fingerprint reads at most 64 KiB
per file, and is equal for equal copies on different hosts whatever their
mtimes (multi-host TP ranks must derive the scheduler's keys); sampling can
miss an in-place edit of a few tensors, which is what model_version is for.
A hub id without a local directory is identified by name and revision only.

Weight options: what vLLM does to the weights as it loads them also decides
the KV, so it is named too (``weights_options``): the quantization method and
its config (``--quantization``, ``quantization_config``) and
``hf_overrides``, each as canonical JSON (sorted keys, no whitespace, enums
by value, dataclasses as their fields), so equal settings give equal keys in
every process whatever the order they were written in. A value that is not
plain data cannot be named: the namespace refuses it (ValueError). A
callable ``hf_overrides`` (Python API only) is named by its qualified name:
what it does is not seen, which is what model_version is for.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_hicache.config import HiCacheConfig
from vllm_hicache.connector.geometry import KVGeometry
from vllm_hicache.host.layout import BlockOrder, HostLayout
from vllm_hicache.host.layout_names import MemLayout
from vllm_hicache.kernels.device_layout import CPU_BACKENDS, PACKED_BACKENDS, describe_kv_tensor

logger = logging.getLogger(__name__)

# Files whose bytes decide the KV a model computes (config.json: rope and
# attention settings).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_CONFIG_FILES = ("config.json",)
# Sampled windows per file: enough to see any rewrite of a checkpoint (a new
# fine-tune changes every tensor), small enough to read at start from a
# network file system.
_SAMPLE_WINDOWS = 16
_SAMPLE_WINDOW_BYTES = 4096



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
    if layout.name == MemLayout.LAYER_FIRST:
        axes = _contiguous(("layer", layers), ("plane", planes), ("token", tokens),
                           ("head", heads), ("elem", dim))
    elif layout.name == MemLayout.PAGE_FIRST:
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


def pool_page_format(pool, slice_heads: int | None = None) -> str:
    """What this worker's objects hold (``pool``: a HostKVPool): its pages,
    or with head slices (keys.HeadSlicing) runs of ``slice_heads`` heads."""
    layout = pool.layout
    if slice_heads is not None:
        layout = layout.head_slice_layout(slice_heads)
    return page_format_of(layout, pool.dtype.itemsize)


def expected_page_format(cfg: HiCacheConfig, geom: KVGeometry, vllm_config,
                         num_layers: int | None = None,
                         slice_heads: int | None = None) -> str:
    """The page format every process derives without seeing KV tensors.
    ``num_layers``: of another pipeline stage (default: ``geom``'s);
    ``slice_heads``: the heads of one head slice, when objects hold those."""
    planes = 1 if geom.is_mla else 2
    heads = 1 if geom.is_mla else geom.num_kv_heads
    if slice_heads is not None:
        heads = slice_heads
    if cfg.hicache_mem_layout == MemLayout.PAGE_FIRST_DIRECT:
        order = _expected_device_order(geom, vllm_config, heads)
    else:
        order = BlockOrder.canonical(planes, geom.block_size, heads, geom.head_size)
    layout = HostLayout(cfg.hicache_mem_layout, 1, num_layers or geom.num_layers, order)
    return page_format_of(layout, getattr(torch, geom.kv_dtype).itemsize)


def _expected_device_order(geom: KVGeometry, vllm_config, heads: int) -> BlockOrder:
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
    content = geom.head_size if geom.is_mla else 2 * geom.head_size
    shape = (2, heads, geom.block_size, content)  # [B, H, N, C]
    strides, step = [0] * 4, 1
    for axis in reversed(layout.layer_view_order):
        strides[axis] = step
        step *= shape[axis]
    tensor = torch.empty_strided(shape, strides, dtype=torch.int8, device="meta")
    return describe_kv_tensor(
        tensor, num_blocks=2, block_size=geom.block_size, num_kv_heads=heads,
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


def weights_identity(cfg: HiCacheConfig, model_config, log: bool) -> str:
    """The fingerprint for the namespace ("" when model_version names the
    weights or there is no local directory), logging what identifies them."""
    ident = model_ident(model_config)
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


def model_ident(model_config) -> str:
    return model_config.model + (f"@{model_config.revision}" if model_config.revision else "")


# --- weight options -----------------------------------------------------------


def weights_options(model_config, log: bool) -> tuple[str, str]:
    """(quantization, hf_overrides) as the key namespace names them
    (KeyNamespace's fields of those names): canonical JSON, "" when unset."""
    method = getattr(model_config, "quantization", None)
    config = getattr(model_config, "quantization_config", None)
    quantization = "" if method is None and config is None else _canonical(
        {"method": method, "config": config}, "quantization")
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        name = (f"{getattr(overrides, '__module__', '?')}."
                f"{getattr(overrides, '__qualname__', type(overrides).__qualname__)}")
        if log:
            logger.warning(
                "HiCache L3: hf_overrides is a function (%s): L3 keys name it, not what it "
                "does. Change model_version in kv_connector_extra_config when you change "
                "what it does.", name)
        return quantization, _canonical({"callable": name}, "hf_overrides")
    return quantization, _canonical(overrides, "hf_overrides") if overrides else ""


def _canonical(value: Any, option: str) -> str:
    return json.dumps(_plain(value, option), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False)


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data, the same for equal settings; ValueError
    naming ``where`` (the option and the path in it) for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value, where)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), f"{where}.{f.name}")
                for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"cannot name {where} in the L3 key namespace: its keys must be "
                             f"strings, got {sorted(map(repr, value))[:4]}")
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"cannot name {where} in the L3 key namespace: a value of type "
                     f"{type(value).__name__} is not plain data (use JSON values: strings, "
                     "finite numbers, booleans, lists, objects)")
