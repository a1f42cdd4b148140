"""Finishing a parsed configuration for one engine: ``finish_config``.

The connector extracts what it needs from vLLM and the platform as plain
values (``EngineFacts``); ``finish_config`` returns the configuration the
engine runs with, plus the ``config.Rewrite`` s it made: the copy backend
and host layout (``config.resolve_pair``, shared with the
platform-independent ``config.resolve_conflicts``) and a hybrid model's load
mode; or it refuses a contradiction (a PD role against
hicache_decode_offload, options a hybrid model cannot serve) with a
``ValueError`` naming the keys.

Invariant: every process of one engine gets the same facts, so both halves,
and the L3 keys they derive, finish alike. It logs nothing: the scheduler
half logs the rewrites once per engine. Pure module: imports neither torch
nor vllm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_hicache.config import HiCacheConfig, LoadMode, Rewrite, resolve_pair
from vllm_hicache.policy.write import WritePolicyName

__all__ = ["KV_ROLES", "EngineFacts", "check_kv_role", "finish_config"]


@dataclass(frozen=True)
class EngineFacts:
    """What the engine and the platform say, as plain values (the connector
    extracts them from vLLM, so this module needs none of it)."""

    # What this platform lacks for hicache_io_backend=kernel ("" = nothing;
    # kernels.kernel_io_missing finds out).
    kernel_io_missing: str = ""
    # HiCache's kv_role in vLLM's kv_transfer_config (None = not given).
    kv_role: str | None = None
    # Kinds of vLLM's KV cache groups, in its order, for a hybrid model
    # (geometry.KVGroup.kind); () for one group.
    kv_group_kinds: tuple[str, ...] = ()
    # Does a group hold Mamba / linear-attention state (raw state pages)?
    state_groups: bool = False


def finish_config(cfg: HiCacheConfig,
                  facts: EngineFacts) -> tuple[HiCacheConfig, list[Rewrite]]:
    """The configuration the engine runs with, and the rewrites made to get it.

    Raises ValueError, naming the keys, for a contradiction with the PD role
    (``check_kv_role``) or with a hybrid model's KV cache groups. Every
    process of one engine gets the same facts (the same model, platform and
    kv_role), so both halves, and the L3 keys they derive, agree; the
    scheduler half logs the rewrites, the workers do not repeat them.
    """
    check_kv_role(cfg, facts.kv_role)
    cfg, rewrites = resolve_pair(cfg, facts.kernel_io_missing)
    cfg, group_rewrites = _fit_to_groups(cfg, facts.kv_group_kinds, facts.state_groups)
    return cfg, rewrites + group_rewrites


def _fit_to_groups(cfg: HiCacheConfig, kinds: tuple[str, ...],
                   state_groups: bool) -> tuple[HiCacheConfig, list[Rewrite]]:
    """The configuration a hybrid model (several KV cache groups) runs with;
    ValueError naming the key of an option that cannot serve them.

    - ``hicache_load_mode``: vLLM takes load failures of a multi-group model
      only per request, and only for async loads (its ``invalid_block_ids``
      path raises there), so loads are async. Left unset, it becomes async;
      set to layerwise, the engine is refused.
    - ``hicache_write_policy=write_back`` copies a block when vLLM reuses it,
      which the pool reports per block of one group: refused.
    - ``tp_lcm_size`` with a Mamba group: head slices of a raw state page
      mean nothing: refused.
    """
    if len(kinds) <= 1:
        return cfg, []
    described = f"{len(kinds)} KV cache groups: {'+'.join(kinds)}"
    if state_groups and cfg.storage is not None and cfg.storage.tp_lcm_size:
        # Head slices cut pages by attention heads; a state page is raw bytes.
        raise ValueError(
            f"tp_lcm_size (in hicache_storage_backend_extra_config) is not supported for "
            f"models with Mamba / linear-attention state ({'+'.join(kinds)}): their state "
            "pages cannot be cut into head slices; leave it unset")
    if cfg.hicache_write_policy == WritePolicyName.WRITE_BACK:
        raise ValueError(
            f"hicache_write_policy=write_back is not supported for hybrid models "
            f"({described}); use write_through or write_through_selective")
    if cfg.hicache_load_mode == LoadMode.ASYNC:
        return cfg, []
    if "hicache_load_mode" in cfg.keys_given:
        raise ValueError(
            f"hicache_load_mode={cfg.hicache_load_mode} is not supported for hybrid "
            f"models ({described}): vLLM can only be told of a failed load per request, "
            "for async loads; set hicache_load_mode=async")
    rewrite = Rewrite("hicache_load_mode", cfg.hicache_load_mode, LoadMode.ASYNC,
                      f"a hybrid model ({described}) reports failed loads per request, "
                      "which vLLM takes for async loads only")
    return dataclasses.replace(cfg, hicache_load_mode=LoadMode.ASYNC), [rewrite]


# vLLM's kv_role values (vllm.config.kv_transfer.KVRole).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def check_kv_role(cfg: HiCacheConfig, kv_role: str | None) -> None:
    """Refuse a HiCache ``kv_role`` that contradicts hicache_decode_offload.

    In a MultiConnector, HiCache's entry carries the instance's PD role, like
    the NixlConnector entry next to it: "kv_producer" on prefill instances
    (HiCache loads hits and stores, as on a single instance), "kv_consumer"
    on decode instances (HiCache only offloads), "kv_both" without PD.
    """
    role = kv_role or "kv_both"
    if role not in KV_ROLES:
        raise ValueError(f"invalid kv_role={kv_role!r} for HiCacheConnector; accepted: "
                         f"{', '.join(KV_ROLES)}")
    if cfg.hicache_decode_offload and role != "kv_consumer":
        raise ValueError(
            f"hicache_decode_offload=true is the decode instance's role, but HiCache's "
            f"kv_role={role!r}: set kv_role='kv_consumer' (as NixlConnector's on decode) or "
            "drop hicache_decode_offload (prefill instances load and store as usual)")
    if role == "kv_consumer" and not cfg.hicache_decode_offload:
        raise ValueError(
            "HiCache's kv_role='kv_consumer' (a decode instance) needs "
            "hicache_decode_offload=true: on decode NixlConnector delivers the prompt's KV "
            "and HiCache may only offload; use kv_role='kv_producer' on prefill instances "
            "or 'kv_both' without PD")
