"""The admin API's status report: the JSON body of GET /hicache/storage-backend,
which every successful attach, replace, detach and policy update also
returns (with a ``message``).

Format: one flat JSON object, its keys always present (``null`` where they
do not apply, e.g. every backend field while none is attached), in this
order: ``backend``, ``state``, ``extra_config`` (the backend's options,
secrets redacted), ``prefetch_policy``, ``prefetch`` (its knobs, in tokens
and seconds), ``write_policy``, ``tiers`` (L2 occupancy, node tier),
``stats`` (the scheduler half's counters), ``l3_stats`` (the planner's),
``breaker``, ``backfill``, ``requests``, ``transfers``,
``admin_storage_switch``, ``retiring`` and ``last_retired``.

Invariant: the report only reads. It is built on the engine thread, between
steps, from the scheduler half and the switch's own state (``SwitchView``,
which admin/storage_control.py fills), so it never sees a half-done switch.
No secret leaves through it: backend options go through
redaction.redacted, and a storage secret is shown only as redacted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_hicache.policy.storage_switch import StorageSwitch
from vllm_hicache.redaction import REDACTED, redacted
from vllm_hicache.storage.node_chain import node_tier_status
from vllm_hicache.storage_config import StorageConfig

if TYPE_CHECKING:
    from vllm_hicache.l3.planner import L3Planner
    from vllm_hicache.scheduler.scheduler import HiCacheScheduler


@dataclass(frozen=True)
class SwitchView:
    """What the switching state machine adds to the report."""

    # switch_state's answer.
    state: str
    # The running backfill's report, else the last finished one's (or None).
    backfill: dict[str, Any] | None
    # Transfers in flight by kind (StorageControl.transfers).
    transfers: dict[str, int]
    switch: StorageSwitch
    # Replaced or detached backends still finishing their ops, and the
    # last one that closed.
    retiring: list[dict[str, Any]]
    last_retired: dict[str, Any] | None


def switch_state(attached: bool, txn_kind: str | None, replaces: bool) -> str:
    """The backend's state as GET names it, from whether a planner serves
    and the kind of the transaction open, if any (storage_control._Txn)."""
    if txn_kind is None:
        return "attached" if attached else "detached"
    if txn_kind == "detach":
        return "detaching"
    if txn_kind == "abort":
        return "rolling back"
    return "replacing" if replaces else "attaching"


def status_report(sched: HiCacheScheduler, view: SwitchView) -> dict[str, Any]:
    """The report (module doc); engine thread only."""
    planner = sched.l3
    storage = planner.cfg if planner is not None else None
    return {
        "backend": storage.backend if storage is not None else None,
        "state": view.state,
        "extra_config": shown_options(storage) if storage is not None else None,
        "prefetch_policy": storage.prefetch_policy if storage is not None else None,
        "prefetch": _prefetch_knobs(storage) if storage is not None else None,
        "write_policy": sched.write_policy,
        "tiers": {"l2": sched.occupancy(),
                  "node": node_tier_status(
                      planner.backend if planner else None,
                      None if planner is None or planner.node_events is None
                      else planner.node_events.status(sched.stats.hit_tokens_node,
                                                      sched.node_counts.total(planner.backend)))},
        "stats": sched.stats_snapshot(),
        "l3_stats": _l3_counters(planner) if planner is not None else None,
        "breaker": None if planner is None else planner.breaker_status(),
        "backfill": view.backfill,
        "requests": sched.num_requests(),
        "transfers": view.transfers,
        "admin_storage_switch": str(view.switch),
        "retiring": view.retiring,
        "last_retired": view.last_retired,
    }


def _prefetch_knobs(storage: StorageConfig) -> dict[str, Any]:
    return {
        "threshold_tokens": storage.prefetch_threshold,
        "timeout_base_s": storage.prefetch_timeout_base,
        "timeout_per_ki_token_s": storage.prefetch_timeout_per_ki_token,
        "timeout_max_s": storage.prefetch_timeout_max,
    }


def _l3_counters(planner: L3Planner) -> dict[str, Any]:
    return {
        "prefetched_blocks": planner.prefetched_blocks,
        "backed_up_blocks": planner.backups.backed_up_blocks,
        "skipped_lookups": planner.skipped_lookups,
        "write_budget_skipped_blocks": dict(planner.backups.budget.skipped),
        "write_budget_spent_bytes": planner.write_budget.spent_bytes,
    }


def shown_options(storage: StorageConfig) -> dict[str, Any]:
    """The backend's options as the report shows them: secrets redacted."""
    shown = redacted(dict(storage.backend_options))
    if getattr(storage, "secret", None) is not None:
        shown["storage_secret"] = REDACTED
        shown["storage_encrypt"] = bool(getattr(storage, "encrypt", False))
    return shown
