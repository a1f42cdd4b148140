"""Runtime attach/detach of L3 (admin/storage_control.py) through vLLM's real
Scheduler and our worker half (harness.py), with the in-process store
(mem_backend.py). Commands are submitted as the admin API's HTTP thread
does (``StorageControl.submit``) and run by the harness's steps. The idle
rule (admin_storage_switch=idle) here; switching while requests run in
test_live_switch.py."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tests.connector import mem_backend
from tests.connector.harness import BLOCK, make_harness
from tests.l3.test_planner import (
    forget_l1_and_l2,
    l3_harness,
    num_pages_stored,
)
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.admin import clear as admin_clear
from vllm_hicache.admin import storage_control as l3_attach
from vllm_hicache.admin.api import parse_attach
from vllm_hicache.admin.guard import AdminPolicy
from vllm_hicache.common.page_ops import OpKind
from vllm_hicache.l3.health_check import probe_key
from vllm_hicache.policy.storage_switch import StorageSwitch

# The operator's allow-list: the admin API may import the test backend.
ALLOW_MEM = AdminPolicy(dynamic_modules=("tests.connector.mem_backend",))


def mem_spec(store: str, **body):
    return parse_attach({
        "backend": "dynamic",
        "extra_config": {"module_path": "tests.connector.mem_backend",
                         "class_name": "MemBackend", "store": store,
                         "prefetch_threshold": BLOCK},
        "prefetch_policy": "wait_complete", **body,
    }, policy=ALLOW_MEM)


# Bounded by time, not steps: an empty step takes a millisecond, and what a
# command waits for (a background clear, backups draining, a drain timeout)
# takes what the machine's load makes it (a step bound failed in CI).
ANSWER_S = 30.0


def step_idle(h, **step) -> None:
    """One step; a short sleep when it scheduled nothing (the engine's
    background threads have the core)."""
    if h.step(**step).total_num_scheduled_tokens == 0:
        time.sleep(0.002)


def settle(h, future, timeout_s: float = ANSWER_S, **step):
    """Step the engine until the command is answered: (status, body)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if future.done():
            return future.result()
        step_idle(h, **step)
    if future.done():
        return future.result()
    raise AssertionError(f"the admin command was not answered within {timeout_s:g} s")


def control(h) -> l3_attach.StorageControl:
    return h.sched_half.storage_control


def idle_rule(h):
    """admin_storage_switch=idle (SGLang's rule); returns the harness."""
    control(h).switch = StorageSwitch.IDLE
    return h


def drain(h, timeout_s: float = ANSWER_S) -> None:
    """Step until no admin work and no backup is left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not control(h).has_work() and not h.sched_half.ops.num_live(OpKind.BACKUP):
            return
        step_idle(h)
    raise AssertionError(f"backups did not drain within {timeout_s:g} s")


def hold_backups(h) -> threading.Event:
    gate = threading.Event()
    io = h.worker.worker._io
    real_backup = io._backup

    def held_backup(job, ready):
        assert gate.wait(timeout=10)
        real_backup(job, ready)

    io._backup = held_backup
    return gate


def test_attach_backs_up_earlier_l2_under_the_keys_lookups_use(tiny_model_dir):
    """L2 filled with no L3; attach; the backfill writes every page; with L1
    and L2 cleared, the same prompt is a prefetch hit of the right bytes."""
    h = make_harness(tiny_model_dir)
    tokens = [prompt(40, 5 * BLOCK + 3), prompt(41, 3 * BLOCK + 1)]
    h.add("a", tokens[0])
    h.add("b", tokens[1])
    h.run()
    assert h.sched_half.l3 is None and h.sched_half.tree.num_cached_pages == 8
    store = uuid.uuid4().hex
    status, body = settle(h, control(h).submit("attach", mem_spec(store)))
    assert status == 200, body
    assert body["state"] == "attached" and body["backend"] == "dynamic"
    drain(h)
    data = mem_backend.STORES[store]
    planner = h.sched_half.l3
    for req in ("a", "b"):
        hashes = h.hashes_of[req].block_hashes
        full = len(h.hashes_of[req].prompt_token_ids) // BLOCK
        assert all(key in data for key in planner.namespaces[0].object_keys(hashes[:full]))
    assert num_pages_stored(data) == 8
    assert control(h).snapshot()["backfill"]["pages_queued"] == 8
    forget_l1_and_l2(h)
    h.add("a2", tokens[0])
    h.run()
    assert h.first_computed["a2"] == 5 * BLOCK
    assert planner.prefetched_blocks == 5
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_idle_rule_refuses_attach_and_detach_while_a_request_runs(tiny_model_dir):
    h = idle_rule(make_harness(tiny_model_dir))
    h.add("long", prompt(42, 2 * BLOCK), max_tokens=50)
    h.step()
    status, body = settle(h, control(h).submit("attach", mem_spec(uuid.uuid4().hex)))
    assert status == 409 and body["running"] == 1 and body["waiting"] == 0, body
    assert h.sched_half.l3 is None and h.worker.worker._io is None
    h.run()
    status, body = settle(h, control(h).submit("attach", mem_spec(uuid.uuid4().hex)))
    assert status == 200, body
    h.add("long2", prompt(43, 2 * BLOCK), max_tokens=50)
    h.step()
    status, body = settle(h, control(h).submit("detach"))
    assert status == 409 and body["running"] + body["waiting"] == 1, body
    assert h.sched_half.l3 is not None and h.worker.worker._io is not None


def test_idle_detach_waits_for_backups_in_flight_and_keeps_objects(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    idle_rule(h)
    gate = hold_backups(h)
    h.add("a", prompt(44, 3 * BLOCK + 1), max_tokens=1)
    for _ in range(50):
        h.step(complete_async=False)
        if not h.sched_half._reqs:
            break
    assert h.sched_half.ops.num_live(OpKind.BACKUP) == 1
    future = control(h).submit("detach")
    for _ in range(5):  # waits: a backup is in flight
        h.step(complete_async=False)
    assert not future.done() and h.sched_half.l3 is not None
    gate.set()
    status, body = settle(h, future)
    assert status == 200 and body["state"] == "detached" and body["backend"] is None, body
    assert h.worker.worker._io is None and h.sched_half.l3 is None
    assert num_pages_stored(store) == 3  # nothing deleted
    status, body = settle(h, control(h).submit("detach"))  # idempotent
    assert status == 200 and body["message"] == "no storage backend was attached"
    h.add("b", prompt(45, 2 * BLOCK + 1))
    h.run()  # L2 only from here
    assert_clean(h)


def test_idle_detach_refused_when_backups_do_not_drain(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    idle_rule(h)
    control(h).drain_timeout_s = 0.05
    gate = hold_backups(h)
    try:
        h.add("a", prompt(46, 2 * BLOCK + 1), max_tokens=1)
        for _ in range(50):
            h.step(complete_async=False)
            if not h.sched_half._reqs:
                break
        status, body = settle(h, control(h).submit("detach"), complete_async=False)
        assert status == 409 and body["transfers"]["backups"] == 1, body
        assert h.sched_half.l3 is not None and h.worker.worker._io is not None
    finally:
        gate.set()
    drain(h)
    assert num_pages_stored(store) == 2


def test_idle_detach_mid_backfill_waits_for_the_chunk_in_flight(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(admin_clear, "BACKFILL_PAGES_PER_STEP", 2)
    h = idle_rule(make_harness(tiny_model_dir))
    h.add("a", prompt(47, 6 * BLOCK + 1))
    h.run()
    store = uuid.uuid4().hex
    status, _ = settle(h, control(h).submit("attach", mem_spec(store)))
    assert status == 200
    # The commit's step already sent the first chunk.
    before = num_pages_stored(mem_backend.STORES[store])
    gate = hold_backups(h)
    h.step(complete_async=False)  # the next backfill chunk, held
    assert h.sched_half.ops.num_live(OpKind.BACKUP) == 1
    future = control(h).submit("detach")
    for _ in range(5):
        h.step(complete_async=False)
    assert not future.done()
    assert h.sched_half.ops.num_live(OpKind.BACKUP) == 1  # no new chunk meanwhile
    gate.set()
    status, body = settle(h, future)
    assert status == 200, body
    # That one chunk, then stopped.
    assert num_pages_stored(mem_backend.STORES[store]) == before + 2
    assert h.sched_half.tree.num_locked_pages == 0
    assert_clean(h)


def test_attach_rolls_back_when_one_rank_fails(tiny_model_dir):
    """A second rank (simulated in the workers' merged message) fails its
    attach: every rank is detached again and the answer names the rank."""
    h = make_harness(tiny_model_dir)
    h.add("a", prompt(48, 2 * BLOCK + 1))
    h.run()
    control(h).world_size = 2

    def second_rank_fails(meta):
        if meta is not None:
            for by_rank in meta.storage_acks.values():
                by_rank[1] = "ConnectionError: rank 1 cannot reach the store"
        return meta

    h.worker_meta_filter = second_rank_fails
    status, body = settle(h, control(h).submit("attach", mem_spec(uuid.uuid4().hex)))
    assert status == 500, body
    assert body["ranks"] == {"1": "ConnectionError: rank 1 cannot reach the store"}
    assert "rolled back" in body["error"]
    assert h.sched_half.l3 is None and h.worker.worker._io is None
    h.sched_half.check_integrity()  # the canary's scratch pages went back
    assert h.sched_half.tree.num_free_pages + h.sched_half.tree.num_cached_pages == \
        h.sched_half.tree.num_pages
    status, body = settle(h, control(h).submit("get"))
    assert status == 200 and body["state"] == "detached"


def test_attach_failing_on_the_scheduler_changes_nothing(tiny_model_dir):
    h = make_harness(tiny_model_dir)
    bad = parse_attach({"backend": "dynamic", "extra_config": {
        "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
        "store": "x", "bogus": 1}}, policy=ALLOW_MEM)
    status, body = settle(h, control(h).submit("attach", bad))
    assert status == 400 and body["field"] == "extra_config" and "bogus" in body["error"]
    assert h.sched_half.l3 is None and h.worker.worker._io is None
    h.sched_half.check_integrity()


def test_reattach_updates_policies_and_idle_rule_refuses_other_stores(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir, policy="best_effort")
    idle_rule(h)
    store = h.sched_half.l3.backend.store_name
    planner = h.sched_half.l3
    status, body = settle(h, control(h).submit("attach", parse_attach(
        {"backend": "dynamic", "prefetch_policy": "timeout",
         "write_policy": "write_through_selective"})))
    assert status == 200, body
    assert body["prefetch_policy"] == "timeout"
    assert body["write_policy"] == "write_through_selective"
    assert h.sched_half.l3 is planner and planner.cfg.prefetch_policy == "timeout"
    assert h.sched_half.stores.write_policy.name == "write_through_selective"
    status, body = settle(h, control(h).submit("attach", parse_attach({"backend": "file"})))
    assert status == 409 and "detach it first" in body["error"], body
    status, body = settle(h, control(h).submit("attach", mem_spec(store + "-other")))
    assert status == 409 and body["field"] == "extra_config"
    status, body = settle(h, control(h).submit("attach", parse_attach(
        {"backend": "dynamic", "write_policy": "write_back"})))
    assert status == 400 and body["field"] == "write_policy"
    # Same options again: only the policies change (threshold via the knob).
    status, body = settle(h, control(h).submit("attach", mem_spec(store)))
    assert status == 200 and body["prefetch_policy"] == "wait_complete"
    assert h.sched_half.l3 is planner


def test_clear_and_get(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    h.add("a", prompt(49, 3 * BLOCK + 1))
    h.run()
    h.step()
    assert num_pages_stored(store) == 3
    status, body = settle(h, control(h).submit("get"))
    assert status == 200
    assert body["tiers"]["l2"]["pages_used"] == 3
    assert body["tiers"]["l2"]["pages_total"] == h.sched_half.num_pages
    assert body["tiers"]["node"] is None  # no node tier: test_node_chain.py shows one
    assert body["l3_stats"]["backed_up_blocks"] == 3
    assert body["stats"]["stored_blocks"] >= 3
    assert body["breaker"]["state"] == "closed" and body["breaker"]["trips"] == 0
    probe = probe_key(h.sched_half.l3.namespaces[0])
    status, body = settle(h, control(h).submit("clear"))
    assert status == 200 and body["message"] == "cleared"
    assert set(store) <= {probe}  # the breaker's health check may write it again at once
    settle(h, control(h).submit("detach"))
    status, body = settle(h, control(h).submit("clear"))
    assert status == 409


@pytest.mark.parametrize("kind", ["get", "detach"])
def test_withdrawn_command_never_runs(tiny_model_dir, kind):
    h = make_harness(tiny_model_dir)
    future = control(h).submit(kind)
    assert control(h).withdraw(future)
    h.step()
    assert future.cancelled() and not control(h).has_work()
