"""The L3 planner's backups live in l3/backups.py (``L3Backups``); the
planner owns them as ``planner.backups``, and the scheduler half, the admin
status and the metrics read them there. ``planner_samples`` reads counters
with ``getattr(planner, name, 0)`` and ``getattr(planner.backups, name, 0)``,
so a counter neither exposes would silently read 0."""

from __future__ import annotations

from tests.l3.test_write_budget_planner import A, planner_with, stored
from vllm_hicache.common.stats import _BACKUP_SAMPLES, _PLANNER_SAMPLES, key, planner_samples
from vllm_hicache.policy.offload import BackupBacklog


def test_every_counter_the_metrics_read_is_on_the_planner():
    planner, _, _ = planner_with()
    missing = [name for name in _PLANNER_SAMPLES if not hasattr(planner, name)]
    missing += [name for name in _BACKUP_SAMPLES if not hasattr(planner.backups, name)]
    assert missing == []


def test_the_planner_shows_and_sets_its_backups_state():
    planner, tree, _ = planner_with()
    planner.backups.max_backup_pages = 0  # every backup deferred
    planner.backups.backlog = BackupBacklog(max_blocks=2)  # two of A's four blocks fit
    assert planner.plan_backups([stored(tree, A)], step=1) == []
    assert (planner.backups.backup_deferred, planner.backups.backup_dropped) == (4, 2)
    samples = planner_samples(planner)
    assert samples[key("backup_deferred_blocks", "deferred")] == 4
    assert samples[key("store_skipped_blocks", "L3", "backlog")] == 2
