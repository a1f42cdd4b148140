"""A graceful stop through vLLM's real Scheduler and our worker half
(scheduler/graceful_stop.py): queued and deferred L3 backups go out while
the stop's flush time lasts, what is left then is dropped and counted, and
the engine is no longer kept stepping for it."""

from __future__ import annotations

import logging

import pytest

from tests.connector.harness import BLOCK
from tests.fake_clock import FakeClock
from tests.l3.test_planner import hold_backups, num_pages_stored
from tests.scheduler.test_load_decision import _l3_backlog_harness, run_held, run_idle
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.l3.breaker import BreakerState
from vllm_hicache.policy.stop_budget import stop_budget
from vllm_hicache.scheduler import graceful_stop
from vllm_hicache.scheduler.graceful_stop import GracefulStop
from vllm_hicache.scheduler.stall_watch import STALLED_WORK_S, StallWatch


def stop_harness(tiny_model_dir, timeout_s: int = 20):
    """Backups held; "a" (6 blocks) in flight, "b" (6 blocks) deferred."""
    h, store = _l3_backlog_harness(tiny_model_dir, max_backup_pages=4)
    flag, clock = [False], FakeClock(100.0)
    stop = GracefulStop(stop_budget(timeout_s, 10.0), lambda: flag[0], clock)
    h.sched_half.graceful_stop = stop
    gate = hold_backups(h)
    h.add("a", prompt(900, 6 * BLOCK + 1), max_tokens=1)
    run_held(h)
    h.add("b", prompt(901, 6 * BLOCK + 1), max_tokens=1)
    run_held(h)
    h.step(complete_async=False)
    planner = h.sched_half.l3
    assert planner.backups.backlog.num_blocks >= 6 and planner.backups.open_backup_blocks() >= 6
    return h, store, stop, flag, clock, gate


def queued(h) -> tuple[int, int]:
    """(blocks in backups in flight, blocks deferred)"""
    planner = h.sched_half.l3
    return planner.backups.open_backup_blocks(), planner.backups.backlog.num_blocks


def test_a_stop_writes_the_backlog_out_and_says_so(tiny_model_dir, monkeypatch):
    picked = []
    real_pick = graceful_stop.pick_l2_only

    def counting_pick(planner, tree, room):
        ranges = real_pick(planner, tree, room)
        picked.append(sum(len(r.blocks) for r in ranges))
        return ranges

    monkeypatch.setattr(graceful_stop, "pick_l2_only", counting_pick)
    h, store, stop, flag, clock, gate = stop_harness(tiny_model_dir)
    assert stop.final_line(h.sched_half.l3) is None  # no stop yet
    write_pool = h.worker.worker._io._write_pool
    assert not write_pool.hurried  # backups in the background while serving
    in_flight, deferred = queued(h)
    flag[0] = True
    gate.set()
    run_idle(h)  # vLLM's drain: it steps while the connector has work
    planner = h.sched_half.l3
    assert stop.stopping
    # The flush's steps told the worker: its backups left the background.
    assert write_pool.hurried
    assert planner.backups.backlog.num_blocks == 0 and planner.backups.open_backup_blocks() == 0
    # The deferred blocks went out through the stop's pick.
    assert sum(picked) == deferred
    assert num_pages_stored(store) == in_flight + deferred
    line = stop.final_line(planner)
    n = in_flight + deferred
    assert f"{n} blocks written to L3 ({n} were queued at the signal, 0 more only L1 held)" \
        in line, line
    assert "did not fit: 0 blocks dropped" in line and "0 blocks still being written" in line
    assert_clean(h)


def test_when_the_flush_time_is_up_the_rest_is_dropped_and_counted(tiny_model_dir):
    h, store, stop, flag, clock, gate = stop_harness(tiny_model_dir, timeout_s=20)
    half, planner = h.sched_half, h.sched_half.l3
    in_flight, deferred = queued(h)
    try:
        flag[0] = True
        assert half.has_pending_work()  # stopping, within the flush time
        clock.now += stop.budget.flush_s + 0.01
        assert not half.has_pending_work()  # backups open, but the budget is spent
        assert planner.backups.backlog.num_blocks == 0
        line = stop.final_line(planner)
        assert f"0 blocks written to L3 ({in_flight + deferred} were queued at the " \
               "signal, 0 more only L1 held)" in line, line
        assert f"did not fit: {deferred} blocks dropped (only L2 held them), {in_flight} " \
               "blocks still being written" in line
        assert "drain, 5.0 s" in line
    finally:
        gate.set()


class TrippedBreaker:
    """The health check's surface the planner reads, with the breaker tripped."""

    usable = False
    trips = 1
    state = BreakerState.TRIPPED

    def status(self) -> dict[str, object]:
        return {"state": self.state.value}

    def close(self) -> None:
        pass


def test_a_tripped_breaker_does_not_keep_the_stop_waiting(tiny_model_dir):
    """Nothing writes L2-only pages while the breaker is not closed: the stop
    stops waiting for them at once (not at the end of the flush time), and its
    last line says what the breaker cost."""
    h, store, stop, flag, clock, gate = stop_harness(tiny_model_dir)
    half, planner = h.sched_half, h.sched_half.l3
    in_flight, deferred = queued(h)
    flag[0] = True
    assert half.has_pending_work()  # the store is in use: the backlog keeps it stepping
    assert stop.has_l2_only(planner)
    planner.health.close()  # the real one's threads end here, not with the session
    planner.health = TrippedBreaker()
    planner.begin_step()  # what the next step does first
    assert not stop.has_l2_only(planner)
    gate.set()
    run_idle(h)  # the in-flight backups finish; the backlog is skipped by the breaker
    assert not half.has_pending_work() and not stop.budget.flush_s <= clock.now - 100.0
    assert planner.backups.open_backup_blocks() == 0 and planner.backups.backlog.num_blocks == 0
    assert num_pages_stored(store) == in_flight
    line = stop.final_line(planner)
    assert f"{in_flight} blocks written to L3" in line, line
    assert line.endswith(f"; {deferred} blocks not written because the L3 circuit breaker "
                         "was not closed"), line
    assert_clean(h)


def test_without_a_stop_nothing_changes(tiny_model_dir):
    h, store, stop, flag, clock, gate = stop_harness(tiny_model_dir)
    in_flight, deferred = queued(h)
    clock.now += 1000.0
    gate.set()
    run_idle(h)  # as before: the backlog is caught up while idle
    assert not stop.stopping and stop.final_line(h.sched_half.l3) is None
    assert num_pages_stored(store) == in_flight + deferred
    assert not h.worker.worker._io._write_pool.hurried


def test_the_last_line_is_logged_at_shutdown(tiny_model_dir, caplog):
    h, store, stop, flag, clock, gate = stop_harness(tiny_model_dir)
    flag[0] = True
    gate.set()
    run_idle(h)
    with caplog.at_level(logging.INFO, logger="vllm_hicache.scheduler.scheduler"):
        h.sched_half.shutdown()
    lines = [r.getMessage() for r in caplog.records if "HiCache: stop after" in r.getMessage()]
    assert len(lines) == 1 and "blocks written to L3" in lines[0]
    assert "did not fit: 0 blocks dropped" in lines[0]


@pytest.mark.parametrize("timeout_s, warned", [(0, True), (20, False)])
def test_start_warns_when_a_stop_loses_the_backups(tiny_model_dir, caplog, tmp_path,
                                                   timeout_s, warned):
    from tests.connector.harness import make_harness

    with caplog.at_level(logging.WARNING, logger="vllm_hicache.connector.connector"):
        h = make_harness(tiny_model_dir, shutdown_timeout=timeout_s,
                         hicache_storage_backend="file",
                         hicache_storage_backend_extra_config={"path": str(tmp_path)})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert ("--shutdown-timeout is 0" in text) == warned, text
    assert ("start with --shutdown-timeout N" in text) == warned
    budget = stop_budget(timeout_s, 10.0)
    assert h.sched_half.graceful_stop.budget == budget
    # The workers' drain is the teardown share of the same budget.
    assert h.worker.worker._io._drain_timeout_s == pytest.approx(budget.drain_s)



def test_under_write_back_a_stop_writes_out_what_only_l1_holds(tiny_model_dir):
    import uuid

    from tests.connector import mem_backend
    from tests.connector.harness import make_harness

    name = uuid.uuid4().hex
    h = make_harness(tiny_model_dir, hicache_write_policy="write_back",
                     hicache_storage_backend="dynamic",
                     hicache_storage_backend_extra_config={
                         "module_path": "tests.connector.mem_backend",
                         "class_name": "MemBackend", "store": name})
    store = mem_backend.STORES[name]
    flag = [False]
    stop = GracefulStop(stop_budget(20, 10.0), lambda: flag[0], FakeClock(100.0))
    h.sched_half.graceful_stop = stop
    h.add("a", prompt(930, 4 * BLOCK + 1), max_tokens=1)
    h.run()
    run_idle(h)
    # Write-back: nothing left L1, so nothing reached L2 or L3.
    assert num_pages_stored(store) == 0 and h.sched_half.tree.num_cached_pages == 0
    flag[0] = True
    run_idle(h)  # vLLM's drain
    assert num_pages_stored(store) == 4
    line = stop.final_line(h.sched_half.l3)
    assert "4 blocks written to L3 (0 were queued at the signal, 4 more only L1 held)" in line
    assert_clean(h)


def test_without_a_budget_a_stop_only_says_what_it_loses(tiny_model_dir, caplog):
    h, store, stop, flag, clock, gate = stop_harness(tiny_model_dir, timeout_s=0)
    in_flight, deferred = queued(h)
    try:
        flag[0] = True
        with caplog.at_level(logging.INFO, logger="vllm_hicache.scheduler.graceful_stop"):
            assert not h.sched_half.has_pending_work()  # nothing to wait for
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert f"--shutdown-timeout 0: {in_flight + deferred} blocks queued for L3 are lost" \
            in text, text
        assert "writing" not in text
    finally:
        gate.set()


def test_a_stalled_store_does_not_end_the_flush_time_early(tiny_model_dir, monkeypatch):
    """Outside a stop, backups that made no progress for STALLED_WORK_S stop
    keeping an idle engine stepping; during the flush time they keep it
    stepping until the stop's own deadline (a slow store's open backups are
    what the stop waits for)."""
    h, store, stop, flag, clock, gate = stop_harness(tiny_model_dir, timeout_s=20)
    half = h.sched_half
    # Every queued block in an open backup, none left only in L2 (a stop's
    # usual state once the backlog went out): only the backups keep it stepping.
    monkeypatch.setattr(graceful_stop, "l2_only_blocks", lambda planner: 0)
    stall_clock = FakeClock(100.0)  # the stall rule's own, apart from the stop's
    half.stall_watch = StallWatch(clock=stall_clock)
    try:
        assert half.has_pending_work()  # open backups, no stop
        flag[0] = True
        h.step(complete_async=False)  # the stop's first step
        assert stop.flushing and h.sched_half.l3.backups.open_backup_blocks() > 0
        assert half.has_pending_work()
        stall_clock.now += STALLED_WORK_S + 1.0  # no progress since
        assert not half.stall_watch.keeps_stepping(True, len(half.ops))  # stalled
        assert half.has_pending_work()  # the flush time, not the stall rule, decides
        clock.now += stop.budget.flush_s + 0.01
        assert not half.has_pending_work()  # and its deadline ends it
    finally:
        gate.set()
