"""The admin API's status report (admin/status.py) without an engine: its
format (every key, in order, null where nothing is attached), the state
names, and that no secret leaves through it. The report of a live engine
is checked through StorageControl in test_storage_control.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hicache.admin.status import SwitchView, shown_options, status_report, switch_state
from vllm_hicache.policy.storage_switch import StorageSwitch
from vllm_hicache.storage_config import parse_storage

KEYS = ["backend", "state", "extra_config", "prefetch_policy", "prefetch", "write_policy",
        "tiers", "stats", "l3_stats", "breaker", "backfill", "requests", "transfers",
        "admin_storage_switch", "retiring", "last_retired"]


def detached_scheduler():
    """The scheduler half's read-only face the report uses, nothing attached."""
    return SimpleNamespace(l3=None, write_policy="write_through",
                           occupancy=lambda: {"used_pages": 3, "total_pages": 8},
                           stats_snapshot=lambda: {"l2_hit_tokens": 5},
                           num_requests=lambda: 2)


def test_report_of_a_detached_engine_keeps_every_key_in_order():
    view = SwitchView(state="detached", backfill=None, transfers={"backups": 1},
                      switch=StorageSwitch.IDLE, retiring=[], last_retired={"dropped": 4})
    body = status_report(detached_scheduler(), view)
    assert list(body) == KEYS
    assert body["backend"] is None and body["extra_config"] is None
    assert body["prefetch"] is None and body["l3_stats"] is None and body["breaker"] is None
    assert body["tiers"] == {"l2": {"used_pages": 3, "total_pages": 8}, "node": None}
    assert body["requests"] == 2 and body["transfers"] == {"backups": 1}
    assert body["admin_storage_switch"] == "idle" and body["last_retired"] == {"dropped": 4}


@pytest.mark.parametrize("attached, txn_kind, replaces, state", [
    (False, None, False, "detached"),
    (True, None, False, "attached"),
    (True, "prepare", False, "attaching"),
    (True, "prepare", True, "replacing"),
    (True, "commit", True, "replacing"),
    (True, "abort", True, "rolling back"),
    (False, "detach", False, "detaching"),
])
def test_switch_state_names(attached, txn_kind, replaces, state):
    assert switch_state(attached, txn_kind, replaces) == state


def test_shown_options_redact_secrets(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 64)
    storage = parse_storage({
        "hicache_storage_backend": "redis",
        "hicache_storage_backend_extra_config": {
            "url": "redis://user:hunter2@host:6379/0", "password": "hunter2",
            "api_token": "t0k", "storage_secret": f"@{secret}", "prefix": "hc",
        },
    })
    shown = shown_options(storage)
    text = repr(shown)
    assert "hunter2" not in text and "t0k" not in text and "s" * 64 not in text
    assert shown["prefix"] == "hc" and shown["storage_secret"] == "<redacted>"
