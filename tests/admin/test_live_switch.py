"""Attach, replace and detach of L3 while requests run
(admin_storage_switch=live, the default; admin/storage_control.py) through
vLLM's real Scheduler and our worker half (harness.py), with the in-process
store (mem_backend.py): each takes effect between two steps, within two
steps of being taken; the old backend's prefetches stop and its unwritten
backups are finished, dropped or moved as the call says; acknowledgements
that arrive after the switch complete only the old backend's ops; a new
backend that fails its canary leaves the old one serving."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tests.admin.test_storage_control import (
    control,
    hold_backups,
    mem_spec,
    settle,
)
from tests.connector import mem_backend
from tests.connector.harness import BLOCK, make_harness
from tests.l3.test_planner import forget_l1_and_l2, l3_harness, num_pages_stored
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.admin import clear as admin_clear
from vllm_hicache.admin.api import parse_attach, parse_detach
from vllm_hicache.admin.guard import AdminPolicy
from vllm_hicache.common.jobs import BackupJob, PrefetchJob, StorageCommand
from vllm_hicache.common.page_ops import OpKind
from vllm_hicache.common.stats import WorkerCounters
from vllm_hicache.l3 import lookups as lookups_module
from vllm_hicache.l3.attach_worker import RankL3
from vllm_hicache.l3.backfill import Backfill
from vllm_hicache.l3.prefetch_ops import GENERATION_SHIFT


def keys_of(h, req_id: str, planner) -> list[str]:
    req = h.hashes_of[req_id]
    full = len(req.prompt_token_ids) // BLOCK
    return planner.namespaces[0].object_keys(req.block_hashes[:full])


def until_retired(h, max_steps: int = 3000, timeout_s: float = 30.0, **step) -> None:
    """Step until no backup is open and every old backend has closed.

    Bounded in time, not only in steps: the old client's last read runs on
    an L3 thread, which on busy cores may get little time while this loop
    steps (a step takes a millisecond; each yields one)."""
    deadline_s = time.monotonic() + timeout_s
    for _ in range(max_steps):
        if (not control(h)._retiring and not h.sched_half.ops.num_live(OpKind.BACKUP)
                and not control(h).has_work()):
            return
        if time.monotonic() > deadline_s:
            break
        h.step(**step)
        time.sleep(0.001)
    raise AssertionError("the old backend did not retire")


def no_backfill(monkeypatch) -> None:
    """An attach backs up nothing of what L2 held (to see what moved)."""
    monkeypatch.setattr(admin_clear, "Backfill", lambda nodes, *a: Backfill([], *a))


def lookups_answered_in_the_pass(monkeypatch) -> None:
    """Every lookup (an in-memory store's) is answered in the schedule pass
    that started it, as on an idle machine: the tests below count steps, and
    on a busy one a lookup thread may miss the planner's 2 ms wait, which
    admits its request a step later (seen in CI)."""
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", 10.0)


def test_replace_under_load_switches_between_steps(tiny_model_dir):
    h, old_store = l3_harness(tiny_model_dir)
    old = h.sched_half.l3
    for i in range(4):
        h.add(f"r{i}", prompt(60 + i, 3 * BLOCK + 1), max_tokens=40)
    for _ in range(3):
        h.step()
    assert h.sched_half.num_requests() == 4
    new_name = uuid.uuid4().hex
    status, body = settle(h, control(h).submit("attach", mem_spec(new_name)))
    assert status == 200 and body["message"] == "replaced", body
    assert body["switch"]["steps"] <= 2 and body["switch"]["pending_backups"]["pending_backups"] \
        == "finish"
    assert h.sched_half.num_requests() == 4  # nobody failed or waited for it
    planner = h.sched_half.l3
    assert planner is not old and planner.generation == 1
    assert h.worker.worker._io.pages.backend.store_name == new_name
    h.add("after", prompt(70, 4 * BLOCK + 1))
    h.run()
    until_retired(h)
    new_store = mem_backend.STORES[new_name]
    assert all(k in new_store for k in keys_of(h, "after", planner))
    assert not any(k in old_store for k in keys_of(h, "after", planner))
    assert all(k in new_store for k in keys_of(h, "r0", planner))  # backfilled
    snap = control(h).snapshot()
    assert snap["retiring"] == [] and snap["last_retired"]["generation"] == 0
    assert all(h.load_checks)
    assert_clean(h)


@pytest.mark.parametrize("mode, old_pages, new_pages, unwritten", [
    ("finish", 8, 0, 0), ("drop", 0, 0, 8), ("move", 4, 4, 0)])
def test_pending_backups_of_the_old_backend(tiny_model_dir, monkeypatch, mode, old_pages,
                                            new_pages, unwritten):
    """Four backups of two pages held in the old client (two running, two
    queued) at a replace: finish writes all to the old store; drop writes
    none (the running ones had not begun a batch); move sends the queued
    ones to the new store."""
    no_backfill(monkeypatch)
    lookups_answered_in_the_pass(monkeypatch)
    h, old_store = l3_harness(tiny_model_dir)
    gate = hold_backups(h)
    try:
        for i in range(4):
            h.add(f"a{i}", prompt(80 + i, 2 * BLOCK + 1), max_tokens=1)
            h.step(complete_async=False)
            h.step(complete_async=False)
        assert h.sched_half.ops.num_live(OpKind.BACKUP) == 4
        new_name = uuid.uuid4().hex
        spec = mem_spec(new_name, pending_backups=mode)
        status, body = settle(h, control(h).submit("attach", spec), complete_async=False)
        assert status == 200, body
        pending = body["switch"]["pending_backups"]
        assert pending["pending_backups"] == mode and pending["backup_pages_sent"] == 8
    finally:
        gate.set()
    h.run()
    until_retired(h)
    assert num_pages_stored(old_store) == old_pages
    assert num_pages_stored(mem_backend.STORES[new_name]) == new_pages
    retired = control(h).snapshot()["last_retired"]
    assert retired["pending_backups"] == mode and retired["backup_pages_unwritten"] == unwritten
    assert_clean(h)


@pytest.mark.parametrize("mode, old_pages, new_pages", [
    ("finish", 6, 0), ("drop", 0, 0), ("move", 2, 4)])
def test_deferred_backups_of_the_old_backend(tiny_model_dir, monkeypatch, mode, old_pages,
                                             new_pages):
    """The old backend's backlog (backups deferred by backpressure) at a
    replace: finish sends it to the old store in the switching step, drop
    forgets it, move hands it to the new backend."""
    no_backfill(monkeypatch)
    lookups_answered_in_the_pass(monkeypatch)
    h, old_store = l3_harness(tiny_model_dir)
    old = h.sched_half.l3
    old.backups.max_backup_pages = 1  # one op in flight; the rest is deferred
    gate = hold_backups(h)
    try:
        for i in range(3):
            h.add(f"d{i}", prompt(110 + i, 2 * BLOCK + 1), max_tokens=1)
            h.step(complete_async=False)
            h.step(complete_async=False)
        assert old.backups.backlog.num_blocks == 4
        new_name = uuid.uuid4().hex
        status, body = settle(h, control(h).submit(
            "attach", mem_spec(new_name, pending_backups=mode)), complete_async=False)
        assert status == 200, body
        assert body["switch"]["pending_backups"]["backup_blocks_deferred"] == 4
    finally:
        gate.set()
    h.run()
    until_retired(h)
    assert num_pages_stored(old_store) == old_pages
    assert num_pages_stored(mem_backend.STORES[new_name]) == new_pages
    retired = control(h).snapshot()["last_retired"]
    assert retired["backup_blocks_dropped"] == (4 if mode == "drop" else 0)
    assert retired["backup_blocks_flushed"] == (4 if mode == "finish" else 0)
    assert retired["backup_blocks_moved"] == (4 if mode == "move" else 0)
    assert_clean(h)


def test_late_prefetch_of_the_old_backend_never_reaches_the_new_one(tiny_model_dir):
    """A request waits for a prefetch stuck in the old store; the replace
    frees it (it recomputes, same answer); the old read's progress arrives
    after the switch and completes only the old op, while the new backend
    prefetches under op ids of its own generation."""
    h, old_store = l3_harness(tiny_model_dir)
    tokens = prompt(90, 5 * BLOCK + 3)
    h.add("a", tokens)
    h.run()
    h.step()
    assert num_pages_stored(old_store) == 5
    old = h.sched_half.l3
    new_name = uuid.uuid4().hex
    mem_backend.STORES[new_name] = dict(old_store)  # the new store has them too
    forget_l1_and_l2(h)
    stuck = mem_backend.GATES[old.backend.store_name] = threading.Event()
    try:
        h.add("b", tokens)
        for _ in range(5):
            h.step(complete_async=False)
        assert "b" not in h.first_computed  # waiting for its prefetch
        old_ops = {op.op_id for op in old.prefetches}
        assert old_ops and all(op < 1 << GENERATION_SHIFT for op in old_ops)
        status, body = settle(h, control(h).submit("attach", mem_spec(new_name)),
                              complete_async=False)
        assert status == 200 and body["switch"]["pending_backups"]["prefetches_stopped"] == 1
        h.add("c", prompt(91, 4 * BLOCK + 1))
        for _ in range(50):
            if "b" in h.first_computed:
                break
            h.step(complete_async=False)
        assert h.first_computed["b"] == 0  # no L2 page yet: it computes them
    finally:
        stuck.set()  # the old read goes on, reported after the switch
    del mem_backend.GATES[old.backend.store_name]
    h.run()
    until_retired(h)
    assert not old.prefetches.num_open() and old.prefetch_started == 1
    new = h.sched_half.l3
    assert all(op.op_id >> GENERATION_SHIFT == 1 for op in new.prefetches)
    forget_l1_and_l2(h)
    h.add("b2", tokens)
    h.run()
    assert h.first_computed["b2"] == 5 * BLOCK  # from the new backend
    assert new.prefetched_blocks == 5 and all(h.load_checks)
    assert_clean(h)


def test_failed_canary_of_the_new_backend_leaves_the_old_one_serving(tiny_model_dir):
    h, old_store = l3_harness(tiny_model_dir)
    old, old_io = h.sched_half.l3, h.worker.worker._io
    h.add("long", prompt(92, 2 * BLOCK + 1), max_tokens=30)
    h.step()
    # Stores every payload reversed and re-sealed: the canary reads back
    # wrong bytes that verify (l3/canary.py: failed).
    broken = parse_attach({
        "backend": "dynamic", "extra_config": {
            "module_path": "tests.l3.test_canary", "class_name": "ReorderingBackend",
            "store": uuid.uuid4().hex}},
        policy=AdminPolicy(dynamic_modules=("tests.l3.test_canary",)))
    status, body = settle(h, control(h).submit("attach", broken))
    assert status == 500 and "0" in body["ranks"], body
    assert "still serves" in body["error"]
    assert h.sched_half.l3 is old and h.worker.worker._io is old_io
    h.sched_half.check_integrity()  # the canary's scratch pages went back
    h.add("next", prompt(93, 3 * BLOCK + 1))
    h.run()
    h.step()
    assert all(k in old_store for k in keys_of(h, "next", old))
    assert_clean(h)


def test_failure_on_another_rank_aborts_the_replace(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir)
    old, old_io = h.sched_half.l3, h.worker.worker._io
    control(h).world_size = 2

    def second_rank_fails(meta):
        if meta is not None:
            for by_rank in meta.storage_acks.values():
                by_rank[1] = "ConnectionError: rank 1 cannot reach the store"
        return meta

    h.worker_meta_filter = second_rank_fails
    status, body = settle(h, control(h).submit("attach", mem_spec(uuid.uuid4().hex)))
    assert status == 500 and body["ranks"] == {"1": "ConnectionError: rank 1 cannot reach "
                                                    "the store"}, body
    assert h.sched_half.l3 is old and h.worker.worker._io is old_io
    assert h.worker.worker._rank_l3._staged == {}  # the new client was dropped


@pytest.mark.parametrize("mode", ["finish", "drop"])
def test_detach_under_load(tiny_model_dir, mode):
    h, store = l3_harness(tiny_model_dir)
    for i in range(3):
        h.add(f"r{i}", prompt(100 + i, 3 * BLOCK + 1), max_tokens=30)
    for _ in range(3):
        h.step()
    status, body = settle(h, control(h).submit("detach", parse_detach(
        {"pending_backups": mode})))
    assert status == 200 and body["message"] == "detached" and body["state"] == "detached"
    assert body["switch"]["steps"] == 0  # removed in the step that took it
    assert h.sched_half.l3 is None and h.worker.worker._io is None
    assert h.sched_half.num_requests() == 3
    h.run()
    until_retired(h)
    assert all(h.load_checks)
    assert_clean(h)


def test_move_needs_a_backend_to_move_to(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    status, body = settle(h, control(h).submit(
        "attach", mem_spec(uuid.uuid4().hex, pending_backups="move")))
    assert status == 400 and body["field"] == "pending_backups"
    assert h.sched_half.l3 is None
    with pytest.raises(ValueError, match="pending_backups"):
        parse_detach({"pending_backups": "move"})


def test_a_job_of_a_generation_without_client_is_answered_at_once():
    """The scheduler never waits on a job no client runs."""
    rank = RankL3(None, None, worker_id=3)
    rank.submit_backup(BackupJob(7, (b"h1", b"h2"), (1, 2), (), generation=5))
    rank.submit_prefetch(PrefetchJob(9, (b"h3",), (3,), generation=5))
    reports = rank.take_reports()
    assert reports.backups == {7} and reports.failures == {7: {b"h1", b"h2"}}
    assert reports.prefetch[9].finished and reports.prefetch[9].done == 0
    assert rank.take_reports().backups == set()  # reported once


class FakeIO:
    """Stands in for a rank's StorageIO: open jobs on demand, counters."""

    pages = None

    def __init__(self) -> None:
        self.counters = WorkerCounters()
        self.busy = True
        self.retired_with: str | None = None
        self.closed = threading.Event()

    def retire(self, pending_backups: str) -> list:
        self.retired_with = pending_backups
        return []

    def has_open_jobs(self) -> bool:
        return self.busy

    def poll(self):
        return {}, set()

    def take_removed_keys(self):
        return []

    def take_prefetch_timings(self):
        return {}

    def take_backup_failures(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.closed.set()


def test_a_rank_keeps_the_old_client_until_its_jobs_end_and_keeps_its_metrics():
    old, new = FakeIO(), FakeIO()
    rank = RankL3(old, None, worker_id=0)
    keys = {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config": {}}
    rank.run(StorageCommand(1, "prepare", keys, (0, 1), generation=1), lambda *a: new)
    assert rank.io is old and rank.acks == {1: {0: ""}}  # staged; the old one serves
    rank.run(StorageCommand(2, "commit", generation=1, pending_backups="drop"), None)
    assert rank.io is new and rank.generation == 1 and old.retired_with == "drop"
    old.counters.add("backup_bytes", 2)
    rank.take_reports()
    assert rank.retiring_generations() == [0] and not old.closed.is_set()  # jobs open
    assert rank.take_retired_counts() == {"backup_bytes": 2}
    old.busy = False
    old.counters.add("backup_bytes", 3)
    rank.take_reports()
    assert rank.retiring_generations() == [] and old.closed.wait(5)
    assert rank.take_retired_counts() == {"backup_bytes": 3}
    assert rank.take_retired_counts() == {}
