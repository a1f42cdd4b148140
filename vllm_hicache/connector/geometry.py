"""What the connector needs to know about the model's KV cache, and L2 sizing.

Both halves derive the same ``KVGeometry`` and the same number of host pages
from ``(HiCacheConfig, KVCacheConfig, VllmConfig)``, so page numbering agrees
without any message between them. A model the connector cannot serve is
refused here, at engine start, with a message saying why.

Pipeline parallelism: each worker's KVCacheConfig holds only its stage's
layers, and the scheduler's is a copy of the first worker's (vLLM's
``generate_scheduler_kv_cache_config``). A page is one block of *all* of a
stage's layers, so with ``hicache_size`` a stage with more layers would fit
fewer pages than the scheduler hands out. Every process therefore sizes L2 by
the largest stage, which all of them compute alike from the model config.

Hybrid models (vLLM's hybrid allocator, several KV cache groups): a host
page is one block *position* of the prefix across every group, so one radix
tree and one page number serve all groups. ``layer_names`` lists the layers
group by group (``KVGroup.layers`` gives each group's range); the L1 side of
a copy names a block of one group with a *group block id*
(``group_block_id``), so the data path, which never learns about groups
beyond those ranges, copies each group's layers with that group's blocks.
Accepted: full-attention and sliding-window groups whose layers have the
same per-layer block shape (so one pool layout holds them), and Mamba /
linear-attention state groups in vLLM's ``align`` cache mode, whose padded
state page vLLM makes exactly as large as an attention page (the worker
copies it as raw bytes through an attention-shaped view, padding included).
Refused at start, naming the group: other Mamba cache modes, speculative
Mamba blocks, a Mamba model without attention groups, chunked-local, cross
and encoder-only attention, and groups excluded from KV transfer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from vllm_hicache.config import HiCacheConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


# Group kinds a host page can hold.
GROUP_FULL = "full"
GROUP_SLIDING = "sliding"
# One recurrent state per block position, valid only where vLLM keeps the
# state of that boundary (its ``align`` mode); raw padded pages.
GROUP_MAMBA = "mamba"


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups, as the connector sees it."""

    kind: str  # GROUP_FULL | GROUP_SLIDING | GROUP_MAMBA
    # Indices into KVGeometry.layer_names of this group's layers (contiguous).
    layers: range
    # Tokens a sliding-window layer attends to (None for full attention).
    sliding_window_tokens: int | None = None


@dataclass(frozen=True)
class KVGeometry:
    # Tokens per vLLM block == tokens per host page.
    block_size: int
    # Attention layers in model order (the host page holds all of them).
    layer_names: tuple[str, ...]
    # Bytes of one block across all layers, on this rank.
    bytes_per_block: int
    # Blocks in vLLM's KV cache (L1).
    num_l1_blocks: int
    num_kv_heads: int
    head_size: int
    is_mla: bool
    # KV element type, e.g. "bfloat16" (part of L3 keys).
    kv_dtype: str = ""
    # Layers of the pipeline stage with the most layers: L2 is sized by its
    # page bytes so that every stage, and the scheduler, count the same pages.
    # 0: this rank's own layer count (no pipeline parallelism).
    sizing_num_layers: int = 0
    # vLLM's KV cache groups, in its order; empty means one full-attention
    # group holding every layer (the geometry of a non-hybrid model).
    groups: tuple[KVGroup, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))

    @property
    def mamba_groups(self) -> tuple[int, ...]:
        """Indices of the Mamba / linear-attention state groups."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind == GROUP_MAMBA)

    def group_block_id(self, group: int, block_id: int) -> int:
        """The id naming block ``block_id`` of group ``group`` in a copy.

        Block ids are only unique within a group; a copy names group g's
        block b as ``g * num_l1_blocks + b`` (group 0: the block id itself),
        and ``datapath.GroupedTransfer`` splits it back."""
        return group * self.num_l1_blocks + block_id

    @property
    def sizing_bytes_per_block(self) -> int:
        """Bytes of one block on the largest pipeline stage (this rank without PP)."""
        bytes_per_layer_block = self.bytes_per_block // max(1, self.num_layers)
        return bytes_per_layer_block * (self.sizing_num_layers or self.num_layers)


def pp_stage_num_layers(vllm_config: VllmConfig) -> list[int]:
    """Decoder layers of each pipeline stage, as vLLM partitions the model.

    The only reach into vLLM internals for pipeline parallelism: models pick
    their layers with ``vllm.distributed.utils.get_pp_indices`` (honouring
    ``VLLM_PP_LAYER_PARTITION``), from the total decoder layer count. The
    result depends only on the model config, the PP size and that variable,
    which every process of one engine shares, so every process gets the same
    list. Decoder layers without KV (no-op blocks, shared KV) make a stage's
    count an upper bound on its KV layers, which only makes the pool smaller.
    """
    from vllm.distributed.utils import get_pp_indices

    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    total_layers = vllm_config.model_config.get_total_num_hidden_layers()
    counts = []
    for stage in range(pp_size):
        start, end = get_pp_indices(total_layers, stage, pp_size)
        counts.append(end - start)
    return counts


def geometry_from(
    kv_cache_config: KVCacheConfig, vllm_config: VllmConfig | None = None
) -> KVGeometry:
    """Describe the KV cache; raise ValueError for models we cannot serve.

    ``vllm_config`` is needed for pipeline parallelism (L2 sizing by the
    largest stage); without it the geometry describes this rank alone.
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("HiCacheConnector: the model has no KV cache group")
    spec = groups[0].kv_cache_spec
    if len(groups) == 1:
        # A FullAttentionSpec may carry a sliding window (vLLM without its
        # hybrid allocator): blocks then hold every token's KV, pages are exact.
        if not isinstance(spec, FullAttentionSpec):
            raise ValueError(
                "HiCacheConnector supports full-attention and MLA KV caches only "
                f"(sliding window next to full attention); got {type(spec).__name__}"
                + _mamba_hint(spec))
        layer_names = tuple(groups[0].layer_names)
        hybrid: tuple[KVGroup, ...] = ()
    else:
        layer_names, hybrid = _hybrid_groups(groups)
        # The page layout is an attention group's (Mamba pages match its bytes).
        spec = next(g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, AttentionSpec))
    hash_block_size = kv_cache_config.hash_block_size
    if hash_block_size is not None and hash_block_size != spec.block_size:
        raise ValueError(
            f"HiCacheConnector needs hash_block_size == block_size; got "
            f"{hash_block_size} != {spec.block_size}"
        )
    sizing_num_layers = 0  # without PP every process holds the same layers
    if vllm_config is not None and vllm_config.parallel_config.pipeline_parallel_size > 1:
        stage_num_layers = pp_stage_num_layers(vllm_config)
        if len(layer_names) > max(stage_num_layers):
            # Our model of vLLM's partition is wrong for this model: the pool
            # would outgrow hicache_size, so refuse rather than guess.
            raise ValueError(
                f"HiCacheConnector sizes L2 by the largest pipeline stage, "
                f"{max(stage_num_layers)} layers (stages {stage_num_layers}), but "
                f"this stage's KV cache has {len(layer_names)} layers"
            )
        sizing_num_layers = max(stage_num_layers)
    return KVGeometry(
        block_size=spec.block_size,
        layer_names=layer_names,
        bytes_per_block=spec.page_size_bytes * len(layer_names),
        sizing_num_layers=sizing_num_layers,
        num_l1_blocks=kv_cache_config.num_blocks,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        is_mla=isinstance(spec, MLAAttentionSpec),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        groups=hybrid,
    )


def _mamba_hint(spec) -> str:
    if "Mamba" in type(spec).__name__:
        return (" (Mamba / linear-attention state is served next to attention groups "
                "only, with vLLM's hybrid KV cache manager)")
    return ""


def _hybrid_groups(groups) -> tuple[tuple[str, ...], tuple[KVGroup, ...]]:
    """Layers (group by group) and group descriptions of a hybrid model;
    ValueError naming the first group a host page cannot hold."""
    first = next((g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, AttentionSpec)),
                 None)
    if first is None:
        raise ValueError("HiCacheConnector needs an attention KV cache group next to Mamba / "
                         "linear-attention state groups; this model has none")
    layer_names: list[str] = []
    described: list[KVGroup] = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = f"KV cache group {index} ({type(spec).__name__}, layers {group.layer_names[:3]}...)"
        if not getattr(group, "enable_kv_transfer", True):
            raise ValueError(f"HiCacheConnector cannot restore {name}: vLLM excludes it from "
                             "KV transfer")
        if isinstance(spec, SlidingWindowSpec):
            kind, window = GROUP_SLIDING, spec.sliding_window
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec) and not (
                spec.sliding_window or spec.attention_chunk_size):
            kind, window = GROUP_FULL, None
        elif isinstance(spec, MambaSpec):
            _check_mamba_group(spec, first, name)
            start = len(layer_names)
            layer_names += group.layer_names
            described.append(KVGroup(GROUP_MAMBA, range(start, len(layer_names))))
            continue
        else:
            raise ValueError(
                f"HiCacheConnector cannot restore {name} of a hybrid model: supported "
                "groups are full attention, sliding window and Mamba state ('align' mode)")
        if _block_shape(spec) != _block_shape(first):
            raise ValueError(
                f"HiCacheConnector needs every KV cache group of a hybrid model to have the "
                f"same per-layer block shape (block_size, KV heads, head size, dtype, page "
                f"bytes); {name} has {_block_shape(spec)}, group 0 {_block_shape(first)}")
        start = len(layer_names)
        layer_names += group.layer_names
        described.append(KVGroup(kind, range(start, len(layer_names)), window))
    return tuple(layer_names), tuple(described)


def _check_mamba_group(spec: MambaSpec, attention: AttentionSpec, name: str) -> None:
    """A Mamba group a host page can hold: one state per block boundary
    (``align`` mode), in pages exactly as large as an attention group's."""
    if spec.mamba_cache_mode != "align":
        raise ValueError(
            f"HiCacheConnector cannot restore {name}: its mamba_cache_mode is "
            f"{spec.mamba_cache_mode!r}; only 'align' keeps a state per block boundary "
            "(vLLM's --mamba-cache-mode align, its default with prefix caching)")
    if spec.num_speculative_blocks:
        raise ValueError(
            f"HiCacheConnector cannot restore {name} with speculative decoding "
            f"(num_speculative_blocks={spec.num_speculative_blocks}): vLLM moves its state "
            "blocks between positions; unset speculative_config")
    if (spec.block_size, spec.page_size_bytes) != (attention.block_size,
                                                   attention.page_size_bytes):
        raise ValueError(
            f"HiCacheConnector needs {name} to have the attention groups' block size and "
            f"page bytes (vLLM pads Mamba pages to match); got block_size={spec.block_size}, "
            f"page {spec.page_size_bytes} B vs {attention.block_size}, "
            f"{attention.page_size_bytes} B")


def _block_shape(spec: AttentionSpec) -> tuple:
    return (spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.dtype,
            spec.page_size_bytes, isinstance(spec, MLAAttentionSpec))


def host_num_pages(cfg: HiCacheConfig, geom: KVGeometry) -> int:
    """L2 pages: hicache_size GB per rank if set, else hicache_ratio x L1.

    Equal in every process of one engine. By size: the largest pipeline
    stage's page bytes divide it (so that stage's pool fits hicache_size and
    smaller stages use less). By ratio: vLLM gives every worker, and the
    scheduler, the smallest num_blocks among the workers
    (``get_kv_cache_configs``; ``generate_scheduler_kv_cache_config`` asserts
    they agree), so pages = ratio x num_blocks agree whatever the stage.
    """
    if cfg.host_bytes_override > 0:
        bytes_per_page = max(1, geom.sizing_bytes_per_block)
        num_pages = cfg.host_bytes_override // bytes_per_page
        if num_pages < 1:
            raise ValueError(
                f"hicache_size={cfg.hicache_size} GB holds no page: one page "
                f"(a block of all {geom.sizing_num_layers or geom.num_layers} layers"
                f"{' of the largest pipeline stage' if geom.sizing_num_layers else ''}) is "
                f"{bytes_per_page} bytes"
            )
        return int(num_pages)
    return int(geom.num_l1_blocks * cfg.hicache_ratio)
