"""Reclaiming dead members' holdings (node/reclaim.py): a member killed
holding pins and a reservation loses them at the next sweep, a live one
never does, and the sweeper survives a failing sweep."""

from __future__ import annotations

import logging
import time

from tests.node.helpers import Child, insert, make
from vllm_hicache.node.reclaim import Sweeper


def test_a_dead_members_pins_and_reservations_go_and_a_live_ones_stay(node_root):
    with make(node_root, slots=8, sweep_interval_s=60) as tier:
        insert(tier, [b"a", b"b"])
        assert tier.pin([b"a"]) == 1
        child = Child(node_root, 8, "stop", "c")  # inserts and pins c, reserves a slot
        child.wait_ready()
        assert tier.stats().pinned_slots == 2 and tier.stats().reserved_slots == 1
        assert tier.sweep() == []  # alive: nothing taken
        child.kill()
        assert tier.sweep() != []
        stats = tier.stats()
        assert stats.pinned_slots == 1 and stats.reserved_slots == 0
        assert tier.check_integrity() == []


def test_a_failing_sweep_is_logged_and_retried_and_stop_ends_it(tmp_path, caplog):
    (tmp_path / "members").mkdir()
    (tmp_path / "index.sqlite").mkdir()  # SQLite cannot open a directory
    caplog.set_level(logging.WARNING, logger="vllm_hicache.node.reclaim")
    sweeper = Sweeper("t", str(tmp_path / "index.sqlite"), str(tmp_path / "members"), "me",
                      lock_timeout_s=0.5, interval_s=0.01)

    def failures() -> int:
        return sum("sweep failed" in r.getMessage() for r in caplog.records)

    deadline = time.monotonic() + 10
    while failures() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failures() >= 2 and sweeper.thread.is_alive()
    sweeper.stop()
    assert not sweeper.thread.is_alive()
